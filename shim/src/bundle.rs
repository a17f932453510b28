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

/// Who mounted a container's rootfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountedBy {
    /// containerd handed the mounts over in Create and the shim mounted them under the bundle
    /// (ctr, nerdctl, the CRI).
    Containerd,
    /// The caller mounted the rootfs itself and sent no mounts: Docker Engine (both its overlay2
    /// graph driver and its containerd image store) mounts the overlay and names its `merged`
    /// directory in the spec's `root.path`.
    Caller,
}

/// A container's rootfs: where runc finds it, who mounted it, and the mounts that make it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rootfs {
    /// The directory the spec's `root.path` names (relative paths are below the bundle).
    pub path: PathBuf,
    pub mounted_by: MountedBy,
    /// containerd's mounts; for a caller-mounted rootfs, its overlay as the host's mount table
    /// shows it (none when it is not an overlay: crab then cannot see its changes, and says so
    /// in every turn answer).
    pub mounts: Vec<RootfsMount>,
}

impl Rootfs {
    /// The rootfs of the container whose bundle is `bundle`: containerd's `mounts` when it sent
    /// any, else whatever is mounted at the spec's `root.path`. Read at Create, before any
    /// process of the container runs, so nothing in the mount table is the container's doing.
    pub fn resolve(bundle: &Path, spec: &Spec, mounts: &[RootfsMount]) -> Rootfs {
        let path = root_path(bundle, spec);
        if !mounts.is_empty() {
            return Rootfs {
                path,
                mounted_by: MountedBy::Containerd,
                mounts: mounts.to_vec(),
            };
        }
        let mounts = match crate::sys::mountinfo::read_self() {
            Ok(table) => caller_overlay(&table, &path).into_iter().collect(),
            Err(e) => {
                log::warn!(
                    "cannot read the mount table to find the rootfs {}: {e}",
                    path.display()
                );
                Vec::new()
            }
        };
        Rootfs {
            path,
            mounted_by: MountedBy::Caller,
            mounts,
        }
    }
}

/// The directory the spec's `root.path` names: an absolute path, or one below the bundle
/// (containerd's `rootfs`).
pub fn root_path(bundle: &Path, spec: &Spec) -> PathBuf {
    match spec.root().as_ref().map(|r| r.path()) {
        Some(p) if p.is_absolute() => p.clone(),
        Some(p) if !p.as_os_str().is_empty() => bundle.join(p),
        _ => rootfs_path(bundle),
    }
}

/// The overlay mounted at `root` in the mount table `table`, as a [`RootfsMount`] whose options
/// name absolute directories: the topmost mount there, if it is an overlay.
///
/// Docker's overlay2 driver mounts with paths relative to its home (`<home>/<id>/merged` is the
/// mount point) when absolute ones would overflow the page the options travel in; those are
/// resolved against that home, and kept only if the upper directory they give exists.
pub fn caller_overlay(table: &[crate::sys::mountinfo::Mount], root: &Path) -> Option<RootfsMount> {
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let top = table.iter().rev().find(|m| m.mount_point == root)?;
    if top.fstype != "overlay" {
        log::info!(
            "rootfs {} is a {} mount, not an overlay: its changes cannot be seen",
            root.display(),
            top.fstype
        );
        return None;
    }
    // Relative paths are relative to the directory the mounter worked from: with an absolute
    // upper directory (containerd's overlay snapshotter, also under Docker's containerd image
    // store, whose mount point is elsewhere) the one holding every snapshot, two above it
    // (`<snapshots>/<n>/fs`); else (Docker's overlay2, everything relative) the driver's home,
    // two above the mount point.
    let upper_option = top
        .super_options()
        .into_iter()
        .find_map(|o| o.strip_prefix("upperdir=").map(PathBuf::from));
    let home = match upper_option.as_deref() {
        Some(u) if u.is_absolute() => u.parent().and_then(Path::parent).map(Path::to_path_buf),
        _ => root.parent().and_then(Path::parent).map(Path::to_path_buf),
    };
    let home = home.as_deref();
    let absolute = |v: &str| -> Option<String> {
        let p = Path::new(v);
        match (p.is_absolute(), home) {
            (true, _) => Some(v.to_string()),
            (false, Some(home)) if !v.is_empty() => {
                Some(home.join(p).to_string_lossy().into_owned())
            }
            _ => None,
        }
    };
    let mut options = Vec::new();
    for o in top.super_options() {
        let o = match o.split_once('=') {
            Some((k @ ("upperdir" | "workdir" | "lowerdir+" | "datadir+"), v)) => {
                format!("{k}={}", absolute(v)?)
            }
            Some(("lowerdir", v)) => {
                let layers: Option<Vec<String>> = v
                    .split(':')
                    .filter(|l| !l.is_empty())
                    .map(absolute)
                    .collect();
                format!("lowerdir={}", layers?.join(":"))
            }
            _ => o,
        };
        options.push(o);
    }
    let upper = options.iter().find_map(|o| o.strip_prefix("upperdir="))?;
    if !Path::new(upper).is_dir() {
        log::warn!(
            "rootfs {} is an overlay whose upper directory {upper} is not a directory",
            root.display()
        );
        return None;
    }
    Some(RootfsMount {
        kind: "overlay".to_string(),
        source: top.source.to_string_lossy().into_owned(),
        target: String::new(),
        options,
    })
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

/// Whether the container joins an existing user namespace (one with a path in the spec: a
/// Kubernetes pod's, `hostUsers: false`), rather than having runc make its own or none.
pub fn joins_user_namespace(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|nss| {
            nss.iter()
                .any(|n| n.typ() == LinuxNamespaceType::User && n.path().is_some())
        })
}

/// The argument that makes the shim binary an OCI hook bringing up the loopback interface of
/// the network namespace of the pid in the container state on its stdin ([`loopback_hook`]).
pub const LOOPBACK_HOOK_ARG: &str = "loopback-hook";

/// Adds a `createRuntime` hook to the bundle's `config.json` that runs `shim` (this binary)
/// as [`LOOPBACK_HOOK_ARG`]. For a restore: runc runs `prestart` and `createRuntime` hooks
/// when CRIU has made the namespaces and before it restores sockets, and a TCP connection
/// over 127.0.0.1 can only be put back (CRIU connects it again in repair mode) if `lo` is up
/// by then. `runc create` brings `lo` up itself; `runc restore` never does. The rest of the
/// file is kept as it is (unknown fields included); written atomically.
pub fn add_loopback_hook(bundle: &Path, shim: &Path) -> Result<()> {
    let shim = shim.to_string_lossy().into_owned();
    let hook = serde_json::json!({
        "path": shim,
        "args": [shim, LOOPBACK_HOOK_ARG],
        "timeout": 10,
    });
    edit_spec(bundle, |obj| {
        let hooks = obj
            .entry("hooks")
            .or_insert_with(|| serde_json::json!({}))
            .as_object_mut()
            .ok_or("`hooks` is not an object")?;
        let list = hooks
            .entry("createRuntime")
            .or_insert_with(|| serde_json::json!([]))
            .as_array_mut()
            .ok_or("`hooks.createRuntime` is not a list")?;
        if !list.contains(&hook) {
            list.push(hook);
        }
        Ok(())
    })
}

/// Sets annotation `key` of the bundle's `config.json` to `value` (as [`edit_spec`]).
pub fn set_annotation(bundle: &Path, key: &str, value: &str) -> Result<()> {
    edit_spec(bundle, |obj| {
        obj.entry("annotations")
            .or_insert_with(|| serde_json::json!({}))
            .as_object_mut()
            .ok_or("`annotations` is not an object")?
            .insert(
                key.to_string(),
                serde_json::Value::String(value.to_string()),
            );
        Ok(())
    })
}

/// Changes the bundle's `config.json` by `edit` on its top-level object: the rest of the file
/// is kept as it is (unknown fields included), and it is written atomically.
fn edit_spec(
    bundle: &Path,
    edit: impl FnOnce(
        &mut serde_json::Map<String, serde_json::Value>,
    ) -> std::result::Result<(), &'static str>,
) -> Result<()> {
    let path = bundle.join("config.json");
    let bad =
        |what: String| Error::InvalidArgument(format!("bundle spec {}: {what}", path.display()));
    let text = std::fs::read(&path).map_err(|e| bad(e.to_string()))?;
    let mut spec: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let obj = spec
        .as_object_mut()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    edit(obj).map_err(|e| bad(e.into()))?;
    let tmp = bundle.join(".config.json.crab-tmp");
    let out = serde_json::to_vec(&spec).expect("a JSON value serializes");
    std::fs::write(&tmp, out)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| bad(format!("writing: {e}")))
}

/// Why the loopback hook ([`loopback_hook`]) failed (runc then fails the restore).
#[derive(Debug, thiserror::Error)]
pub enum LoopbackHookError {
    #[error("reading the container state: {0}")]
    Read(#[source] std::io::Error),
    #[error("the container state: {0}")]
    State(#[source] serde_json::Error),
    #[error("the container state has no pid")]
    NoPid,
    #[error("bringing up lo in the network namespace of pid {pid}: {source}")]
    Up {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
}

/// The hook [`add_loopback_hook`] adds: reads the OCI state runc writes to a hook's stdin
/// (at most 1 MiB) and brings up `lo` in the network namespace of its `pid`.
pub fn loopback_hook(stdin: impl std::io::Read) -> std::result::Result<(), LoopbackHookError> {
    use std::io::Read;
    let mut text = Vec::new();
    stdin
        .take(1 << 20)
        .read_to_end(&mut text)
        .map_err(LoopbackHookError::Read)?;
    let state: serde_json::Value =
        serde_json::from_slice(&text).map_err(LoopbackHookError::State)?;
    let pid = state["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or(LoopbackHookError::NoPid)?;
    crate::sys::netns::bring_up_loopback(pid)
        .map_err(|source| LoopbackHookError::Up { pid, source })
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
    fn the_loopback_hook_is_added_once_and_keeps_the_rest_of_the_spec() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        let original = serde_json::json!({
            "ociVersion": "1.1.0",
            "x-unknown": {"kept": true},
            "hooks": {"createRuntime": [{"path": "/bin/theirs"}], "poststop": []},
        });
        std::fs::write(&config, original.to_string()).unwrap();
        let shim = Path::new("/usr/bin/containerd-shim-crab-v1");
        add_loopback_hook(dir.path(), shim).unwrap();
        add_loopback_hook(dir.path(), shim).unwrap();
        let got: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        assert_eq!(got["x-unknown"], original["x-unknown"]);
        let hooks = got["hooks"]["createRuntime"].as_array().unwrap();
        assert_eq!(hooks.len(), 2, "{hooks:?}");
        assert_eq!(hooks[0]["path"], "/bin/theirs");
        assert_eq!(hooks[1]["args"][1], LOOPBACK_HOOK_ARG);
        assert!(read_spec(dir.path()).is_ok(), "still a spec");
        // Specs it cannot extend are refused, untouched.
        for bad in [
            r#"[]"#,
            r#"{"hooks": 3}"#,
            r#"{"hooks": {"createRuntime": {}}}"#,
            "{",
        ] {
            std::fs::write(&config, bad).unwrap();
            assert!(add_loopback_hook(dir.path(), shim).is_err(), "{bad}");
            assert_eq!(std::fs::read_to_string(&config).unwrap(), bad);
        }
    }

    #[test]
    fn the_loopback_hook_refuses_states_without_a_pid() {
        for bad in [
            "",
            "{",
            r#"{"pid": 0}"#,
            r#"{"pid": -1}"#,
            r#"{"pid": 99999999999}"#,
            r#"{"pid": "1"}"#,
            r#"{}"#,
        ] {
            let e = loopback_hook(bad.as_bytes()).unwrap_err();
            assert!(
                matches!(e, LoopbackHookError::State(_) | LoopbackHookError::NoPid),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains("state"), "{bad}: {e}");
        }
        // A pid that does not exist: the namespace cannot be opened, said so.
        let e = loopback_hook(r#"{"pid": 4194304}"#.as_bytes()).unwrap_err();
        assert!(
            matches!(e, LoopbackHookError::Up { pid: 4194304, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("pid 4194304"), "{e}");
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

    /// A mount table line for an overlay at `at` with superblock options `opts` (escaped as
    /// the kernel escapes them).
    fn overlay_line(id: u32, at: &Path, opts: &str) -> String {
        format!(
            "{id} 1 0:{id} / {} rw,relatime shared:3 - overlay overlay rw,{opts}\n",
            at.display()
        )
    }

    /// A Docker-like layout: `<home>/<id>/{merged,diff,work}` and `<home>/l/<short>` layers.
    struct Layout {
        _dir: tempfile::TempDir,
        home: PathBuf,
        root: PathBuf,
    }

    fn layout() -> Layout {
        let dir = tempfile::tempdir().unwrap();
        let home = std::fs::canonicalize(dir.path()).unwrap().join("overlay2");
        for d in ["c1/merged", "c1/diff", "c1/work", "l/A", "l/B"] {
            std::fs::create_dir_all(home.join(d)).unwrap();
        }
        let root = home.join("c1/merged");
        Layout {
            _dir: dir,
            home,
            root,
        }
    }

    fn parse(text: &str) -> Vec<crate::sys::mountinfo::Mount> {
        crate::sys::mountinfo::parse(text.as_bytes())
    }

    #[test]
    fn a_caller_mounted_overlay_is_found_at_the_root_path() {
        let l = layout();
        let h = l.home.display();
        let table = parse(&format!(
            "{}{}",
            overlay_line(
                40,
                &l.home.join("c0/merged"),
                "lowerdir=/x,upperdir=/y,workdir=/z"
            ),
            overlay_line(
                41,
                &l.root,
                &format!("lowerdir={h}/l/A:{h}/l/B,upperdir={h}/c1/diff,workdir={h}/c1/work")
            ),
        ));
        let m = caller_overlay(&table, &l.root).expect("the overlay at the root");
        assert_eq!(m.kind, "overlay");
        let (upper, lowers) = crate::inspector::fs::overlay_dirs(&m.options).unwrap();
        assert_eq!(upper, l.home.join("c1/diff"));
        assert_eq!(lowers, vec![l.home.join("l/A"), l.home.join("l/B")]);
        // A sibling whose name only starts like the root is not it.
        assert!(caller_overlay(&table, &l.home.join("c1/merge")).is_none());
    }

    #[test]
    fn relative_overlay_paths_resolve_against_the_drivers_home() {
        // Docker's overlay2 mounts with relative paths (from its home) when absolute ones would
        // not fit in a page.
        let l = layout();
        let table = parse(&overlay_line(
            41,
            &l.root,
            "lowerdir=l/A:l/B,upperdir=c1/diff,workdir=c1/work",
        ));
        let m = caller_overlay(&table, &l.root).expect("resolved");
        assert!(m
            .options
            .contains(&format!("upperdir={}", l.home.join("c1/diff").display())));
        assert!(m
            .options
            .contains(&format!("workdir={}", l.home.join("c1/work").display())));
        assert!(m.options.contains(&format!(
            "lowerdir={}:{}",
            l.home.join("l/A").display(),
            l.home.join("l/B").display()
        )));
        assert!(m.options.contains(&"rw".to_string()));
    }

    #[test]
    fn relative_lower_paths_under_an_absolute_upper_resolve_against_the_snapshots() {
        // containerd's overlay snapshotter (Docker's containerd image store mounts its snapshot
        // at <data-root>/rootfs/overlayfs/<id>) names deep images' layers relative to the
        // directory of its snapshots, the upper directory absolute.
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let snaps = base.join("io.containerd.snapshotter.v1.overlayfs/snapshots");
        for d in ["3/fs", "1/fs", "9/fs", "9/work"] {
            std::fs::create_dir_all(snaps.join(d)).unwrap();
        }
        let root = base.join("docker/rootfs/overlayfs/c1");
        std::fs::create_dir_all(&root).unwrap();
        let table = parse(&overlay_line(
            41,
            &root,
            &format!(
                "lowerdir=3/fs:1/fs,upperdir={}/9/fs,workdir={}/9/work",
                snaps.display(),
                snaps.display()
            ),
        ));
        let m = caller_overlay(&table, &root).expect("resolved");
        let (upper, lowers) = crate::inspector::fs::overlay_dirs(&m.options).unwrap();
        assert_eq!(upper, snaps.join("9/fs"));
        assert_eq!(lowers, vec![snaps.join("3/fs"), snaps.join("1/fs")]);
    }

    #[test]
    fn what_is_not_a_usable_overlay_at_the_root_gives_none() {
        let l = layout();
        let h = l.home.display();
        let good = overlay_line(
            41,
            &l.root,
            &format!("lowerdir={h}/l/A,upperdir={h}/c1/diff,workdir={h}/c1/work"),
        );
        // Nothing mounted there.
        assert!(caller_overlay(&parse(""), &l.root).is_none());
        // The topmost mount at the root is a bind mount over the overlay.
        let covered = format!(
            "{good}50 41 8:1 /elsewhere {} rw - ext4 /dev/vda rw\n",
            l.root.display()
        );
        assert!(caller_overlay(&parse(&covered), &l.root).is_none());
        // The upper directory does not exist, or is a file.
        let gone = overlay_line(
            41,
            &l.root,
            &format!("lowerdir={h}/l/A,upperdir={h}/c1/nope,workdir=w"),
        );
        assert!(caller_overlay(&parse(&gone), &l.root).is_none());
        std::fs::write(l.home.join("c1/file"), b"").unwrap();
        let file = overlay_line(
            41,
            &l.root,
            &format!("lowerdir={h}/l/A,upperdir={h}/c1/file,workdir=w"),
        );
        assert!(caller_overlay(&parse(&file), &l.root).is_none());
        // No upper directory at all (a read-only overlay).
        let ro = overlay_line(41, &l.root, &format!("lowerdir={h}/l/A:{h}/l/B"));
        assert!(caller_overlay(&parse(&ro), &l.root).is_none());
        // An empty relative path, and garbage lines around a good one.
        let empty = overlay_line(41, &l.root, "lowerdir=,upperdir=,workdir=");
        assert!(caller_overlay(&parse(&empty), &l.root).is_none());
        let noisy = format!("garbage\n\n{good}1 2 3\n");
        assert!(caller_overlay(&parse(&noisy), &l.root).is_some());
    }

    #[test]
    fn escaped_bytes_in_overlay_paths_come_through() {
        // The kernel escapes space, tab, newline, backslash and (for overlay) comma as \ooo.
        let dir = tempfile::tempdir().unwrap();
        let home = std::fs::canonicalize(dir.path()).unwrap().join("a b,c");
        std::fs::create_dir_all(home.join("c1/merged")).unwrap();
        std::fs::create_dir_all(home.join("c1/diff")).unwrap();
        let esc = |p: &Path| {
            p.display()
                .to_string()
                .replace(' ', "\\040")
                .replace(',', "\\054")
        };
        let root = home.join("c1/merged");
        let line = format!(
            "41 1 0:41 / {} rw - overlay overlay rw,lowerdir={},upperdir={},workdir=/w\n",
            esc(&root),
            esc(&home.join("l")),
            esc(&home.join("c1/diff"))
        );
        let m = caller_overlay(&parse(&line), &root).expect("found through the escapes");
        assert!(m
            .options
            .contains(&format!("upperdir={}", home.join("c1/diff").display())));
    }

    #[test]
    fn the_root_path_comes_from_the_spec() {
        let bundle = Path::new("/run/b");
        let abs = spec(
            serde_json::json!({"ociVersion": "1.0.2", "root": {"path": "/var/lib/docker/x/merged"}}),
        );
        assert_eq!(
            root_path(bundle, &abs),
            Path::new("/var/lib/docker/x/merged")
        );
        let rel = spec(serde_json::json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}));
        assert_eq!(root_path(bundle, &rel), Path::new("/run/b/rootfs"));
        let none = spec(serde_json::json!({"ociVersion": "1.0.2"}));
        assert_eq!(root_path(bundle, &none), Path::new("/run/b/rootfs"));
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
            no_pivot_root: true,
            no_new_keyring: false,
            io_owner: Some((65536, 65536)),
            merge_memory: true,
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
