//! The OCI bundle containerd prepares for a task: its spec, its rootfs mounts, and the
//! runc settings crab persists there for the `delete` shim command.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxNamespaceType, Spec};

use crate::{
    error::{Error, Result},
    runc::Runc,
};

const RUNC_SETTINGS: &str = "crab-runc.json";

/// One mount of a container's rootfs, as containerd hands it over (its snapshotter's view:
/// usually one overlay whose options name the layers and the upper directory).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RootfsMount {
    /// The filesystem type (`overlay`, `bind`, ...).
    pub kind: String,
    pub source: String,
    /// Where below the rootfs it goes (empty: the rootfs itself).
    pub target: String,
    pub options: Vec<String>,
}

impl RootfsMount {
    /// The rootfs's overlay mount, if it has one (the first).
    pub fn overlay(mounts: &[RootfsMount]) -> Option<&RootfsMount> {
        mounts.iter().find(|m| m.kind == "overlay")
    }
}

pub fn read_spec(bundle: &Path) -> Result<Spec> {
    let path = bundle.join("config.json");
    Spec::load(&path)
        .map_err(|e| Error::InvalidArgument(format!("bundle spec {}: {e}", path.display())))
}

/// The value of the first of `keys` present in the spec's annotations.
pub fn annotation<'a>(spec: &'a Spec, keys: &[&str]) -> Option<&'a str> {
    let annotations = spec.annotations().as_ref()?;
    keys.iter()
        .find_map(|k| annotations.get(*k))
        .map(String::as_str)
}

/// Whether processes left when init exits must be killed by hand: only when the container
/// shares a PID namespace (with the host or a pod); a private one dies with its init.
pub fn must_kill_all_on_exit(spec: &Spec) -> bool {
    let private_pid_ns = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .and_then(|ns| ns.iter().find(|n| n.typ() == LinuxNamespaceType::Pid))
        .is_some_and(|n| n.path().is_none());
    !private_pid_ns
}

/// Whether runc creates the container's network namespace (one without a path in the spec).
pub fn creates_network_namespace(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| {
            ns.iter()
                .any(|n| n.typ() == LinuxNamespaceType::Network && n.path().is_none())
        })
}

pub fn rootfs_path(bundle: &Path) -> PathBuf {
    bundle.join("rootfs")
}

/// Mounts containerd's rootfs mounts at `<bundle>/rootfs`. Returns whether anything was
/// mounted; on error, whatever was mounted is undone.
pub async fn mount_rootfs(bundle: &Path, mounts: &[RootfsMount]) -> Result<bool> {
    if mounts.is_empty() {
        return Ok(false);
    }
    let target = rootfs_path(bundle);
    std::fs::create_dir_all(&target)
        .map_err(Error::io(format!("cannot create {}", target.display())))?;
    for m in mounts {
        // A pod with its own user namespace: the layers are mounted id-mapped first and only
        // needed until the overlay holds them.
        let idmapped = match crate::idmap::prepare(bundle, &m.kind, &m.options) {
            Ok(i) => i.map(|(options, lowers)| {
                let overlay = RootfsMount {
                    options,
                    ..m.clone()
                };
                (overlay, lowers)
            }),
            Err(e) => {
                unmount_rootfs(bundle);
                return Err(e);
            }
        };
        let m = idmapped.as_ref().map_or(m, |(overlay, _)| overlay);
        let what = format!("{} {}", m.kind, m.source);
        let mounted = {
            let (m, target) = (m.clone(), target.clone());
            tokio::task::spawn_blocking(move || {
                // Empty means absent, as containerd's own mount helper takes it.
                fn some(s: &str) -> Option<&str> {
                    (!s.is_empty()).then_some(s)
                }
                containerd_shim::mount::mount_rootfs(
                    some(&m.kind),
                    some(&m.source),
                    &m.options,
                    &target,
                )
            })
            .await
        };
        let failed = match mounted {
            Ok(Ok(())) => None,
            Ok(Err(source)) => Some(Error::Mount { what, source }),
            Err(e) => Some(Error::Task(e)),
        };
        if let Some(e) = failed {
            unmount_rootfs(bundle);
            return Err(e);
        }
    }
    Ok(true)
}

/// Unmounts everything under `<bundle>/rootfs`; best effort (logged), as in cleanup paths.
pub fn unmount_rootfs(bundle: &Path) {
    let target = rootfs_path(bundle);
    if let Err(e) = containerd_shim::mount::umount_recursive(target.to_str(), libc::MNT_DETACH) {
        log::warn!("cannot unmount {}: {e}", target.display());
    }
}

pub fn init_pid_file(bundle: &Path) -> PathBuf {
    bundle.join("init.pid")
}

pub fn read_init_pid(bundle: &Path) -> Result<u32> {
    read_pid(&init_pid_file(bundle))
}

pub fn read_pid(path: &Path) -> Result<u32> {
    let s = std::fs::read_to_string(path)
        .map_err(Error::io(format!("cannot read {}", path.display())))?;
    s.trim().parse().map_err(|source| Error::Pid {
        text: s.trim().to_string(),
        path: path.to_path_buf(),
        source,
    })
}

pub fn save_runc(bundle: &Path, runc: &Runc) -> Result<()> {
    let path = bundle.join(RUNC_SETTINGS);
    let data = serde_json::to_vec(runc).map_err(|source| Error::Json {
        context: format!("cannot encode {}", path.display()),
        source,
    })?;
    std::fs::write(&path, data).map_err(Error::io(format!("cannot write {}", path.display())))
}

pub fn load_runc(bundle: &Path) -> Result<Option<Runc>> {
    let path = bundle.join(RUNC_SETTINGS);
    match std::fs::read(&path) {
        Ok(data) => serde_json::from_slice(&data)
            .map(Some)
            .map_err(|source| Error::Json {
                context: format!("corrupt {}", path.display()),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format!("cannot read {}", path.display()))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> Spec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn kill_all_only_without_a_private_pid_namespace() {
        let private = spec(
            serde_json::json!({"ociVersion": "1.0.2", "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}}),
        );
        assert!(!must_kill_all_on_exit(&private));
        let joined = spec(
            serde_json::json!({"ociVersion": "1.0.2", "linux": {"namespaces": [{"type": "pid", "path": "/proc/1/ns/pid"}]}}),
        );
        assert!(must_kill_all_on_exit(&joined));
        let host = spec(
            serde_json::json!({"ociVersion": "1.0.2", "linux": {"namespaces": [{"type": "mount"}]}}),
        );
        assert!(must_kill_all_on_exit(&host));
    }

    #[test]
    fn runc_settings_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load_runc(dir.path()).unwrap(), None);
        let runc = Runc {
            binary: "/usr/bin/runc".into(),
            root: "/run/crab/runc/ns".into(),
            systemd_cgroup: false,
            log: dir.path().join("log.json"),
        };
        save_runc(dir.path(), &runc).unwrap();
        assert_eq!(load_runc(dir.path()).unwrap(), Some(runc));
        std::fs::write(dir.path().join(RUNC_SETTINGS), b"{").unwrap();
        assert!(load_runc(dir.path())
            .unwrap_err()
            .to_string()
            .contains("corrupt"));
    }
}
