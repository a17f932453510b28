//! The overlay a container's rootfs is, when the caller (dockerd) mounted it itself and the
//! container record names no image or snapshot: its upper and lower directories, whose lower
//! layers become a checkpoint image's base layers.
//!
//! Two sources, in order:
//! - `rootfs.json` in the container's store directory, written by its shim at start
//!   ([`ROOTFS_FILE`], a [`RootfsRecord`]): `{"format":1,"mounted_by":"caller"|"containerd",
//!   "root_path":..,"upperdir":..,"lowerdirs":[top, .., bottom]}`; it outlives the mount;
//! - else the mount table: the overlay mounted at the spec's `root.path`. dockerd's overlay2
//!   driver passes relative directories when the absolute ones do not fit in a page (it
//!   chdirs to its `overlay2/` directory first); those are resolved against the grandparent of
//!   `root.path` (`overlay2/<id>/merged`), where they are.
//!
//! Both are checked as untrusted input: absolute paths without `..`, directories that exist.
//! Symlinked directories (overlay2's `l/<short>` lowers) are resolved to their targets.

use std::path::{Component, Path, PathBuf};

use crab_shim::{
    inspector::fs::{overlay_dirs, OverlayXattrs},
    sandbox::RootfsRecord,
    sys::mountinfo,
};

/// The file in a container's store directory where its shim records its rootfs overlay.
pub use crab_shim::sandbox::ROOTFS_RECORD as ROOTFS_FILE;
/// Bound on [`ROOTFS_FILE`]'s size.
const MAX_ROOTFS_FILE: u64 = 1 << 20;
/// Most lower layers an image may have (containerd's and Docker's limit is 127).
pub const MAX_LOWERS: usize = 500;

/// A rootfs overlay: upper directory (if known), lower directories top first, the xattrs that
/// are its own, and where it was found (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlay {
    pub upperdir: Option<PathBuf>,
    pub lowerdirs: Vec<PathBuf>,
    pub xattrs: OverlayXattrs,
    pub found_in: String,
}

/// Parses [`ROOTFS_FILE`]'s content (checked as [`checked`] does).
pub fn parse_rootfs_file(bytes: &[u8], what: &str) -> Result<Overlay, String> {
    let f: RootfsRecord =
        serde_json::from_slice(bytes).map_err(|e| format!("{what} is not a rootfs record: {e}"))?;
    if f.format != 1 {
        return Err(format!(
            "{what}: format {} is not one crabctl reads (1)",
            f.format
        ));
    }
    let (mut upperdir, mut lowerdirs, mut found_in) = (f.upperdir, f.lowerdirs, what.to_string());
    // A container Docker removed (`docker run --rm` after a crash, `docker rm`) takes its own
    // layers along: its upper directory (which an export does not need: the store's layers hold
    // its changes) and, directly below it, its init layer (the mount points and empty
    // /etc/hosts, /etc/resolv.conf, /etc/hostname that Docker makes again for any container of
    // the image). Only then, and only those two, may be gone.
    let gone = |p: &Path| !p.exists();
    if f.mounted_by == crab_shim::bundle::MountedBy::Caller && upperdir.as_deref().is_some_and(gone)
    {
        upperdir = None;
        if lowerdirs.len() > 1 && gone(&lowerdirs[0]) {
            let init = lowerdirs.remove(0);
            log::info!(
                "{what}: the container's layers are gone with it ({} among them): its image's \
                 layers are the base",
                init.display()
            );
            found_in = format!("{what} (the container removed, its image's layers)");
        }
    }
    checked(Overlay {
        upperdir,
        lowerdirs,
        // dockerd's overlay2 and containerd's snapshotter mount with trusted.overlay.*.
        xattrs: OverlayXattrs::Trusted,
        found_in,
    })
}

/// `overlay` with its paths checked (absolute, no `..`, existing directories, at most
/// [`MAX_LOWERS`] lowers) and resolved to their real locations.
pub fn checked(mut overlay: Overlay) -> Result<Overlay, String> {
    if overlay.lowerdirs.is_empty() {
        return Err(format!(
            "{}: the overlay has no lower layer",
            overlay.found_in
        ));
    }
    if overlay.lowerdirs.len() > MAX_LOWERS {
        return Err(format!(
            "{}: {} lower layers (at most {MAX_LOWERS})",
            overlay.found_in,
            overlay.lowerdirs.len()
        ));
    }
    let found_in = overlay.found_in.clone();
    let check = |p: &Path| -> Result<PathBuf, String> {
        if !p.is_absolute() || p.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(format!(
                "{found_in}: {} is not an absolute, plain path",
                p.display()
            ));
        }
        let real =
            std::fs::canonicalize(p).map_err(|e| format!("{found_in}: {}: {e}", p.display()))?;
        if !real.is_dir() {
            return Err(format!("{found_in}: {} is not a directory", p.display()));
        }
        Ok(real)
    };
    overlay.upperdir = overlay.upperdir.as_deref().map(check).transpose()?;
    overlay.lowerdirs = overlay
        .lowerdirs
        .iter()
        .map(|p| check(p))
        .collect::<Result<_, _>>()?;
    Ok(overlay)
}

/// The overlay mounted at `root_path` in `mounts` (the topmost mount there), with
/// relative directories resolved as dockerd's overlay2 driver means them.
pub fn from_mounts(mounts: &[mountinfo::Mount], root_path: &Path) -> Result<Overlay, String> {
    let found_in = format!("the overlay mounted at {}", root_path.display());
    let mount = mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == root_path)
        .ok_or_else(|| {
            format!(
                "nothing is mounted at the rootfs {} (is the container running?)",
                root_path.display()
            )
        })?;
    if mount.fstype != "overlay" {
        return Err(format!(
            "the rootfs {} is {}, not an overlay: its layers cannot be told apart",
            root_path.display(),
            mount.fstype
        ));
    }
    let options: Vec<String> = mount.super_options().collect();
    let xattrs = OverlayXattrs::of_mount(&options);
    // overlay2's compact form: every directory relative to <data-root>/overlay2.
    let base = root_path.parent().and_then(Path::parent);
    let absolute: Vec<String> = options
        .iter()
        .map(|o| {
            let Some((key, value)) = o.split_once('=') else {
                return o.clone();
            };
            let relative = |v: &str| !v.is_empty() && !v.starts_with('/');
            match (key, base) {
                ("upperdir" | "workdir", Some(base)) if relative(value) => {
                    format!("{key}={}", base.join(value).display())
                }
                ("lowerdir", Some(base)) if value.split(':').any(relative) => {
                    let joined: Vec<String> = value
                        .split(':')
                        .map(|l| match relative(l) {
                            true => base.join(l).display().to_string(),
                            false => l.to_string(),
                        })
                        .collect();
                    format!("lowerdir={}", joined.join(":"))
                }
                _ => o.clone(),
            }
        })
        .collect();
    let (upperdir, lowerdirs) = overlay_dirs(&absolute)
        .ok_or_else(|| format!("{found_in}: no upper directory or unplaceable lower ones"))?;
    checked(Overlay {
        upperdir: Some(upperdir),
        lowerdirs,
        xattrs,
        found_in,
    })
}

/// The largest `spec.json` read (the args and env of one process: far below).
const MAX_SPEC_FILE: u64 = 1 << 20;

/// The spec record of the store `store_dir` ([`crab_shim::sandbox::SPEC_RECORD`]), as the
/// bytes of a JSON object: `None` when there is none (a store older than the record). Read like
/// untrusted input: a regular file (not through a symlink), at most 1 MiB, a JSON object.
pub fn read_spec_record(store_dir: &Path) -> Result<Option<Vec<u8>>, String> {
    let path = store_dir.join(crab_shim::sandbox::SPEC_RECORD);
    let bytes = match crab_shim::sys::file::read_regular_bounded(&path, MAX_SPEC_FILE) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(v) if v.is_object() => Ok(Some(bytes)),
        Ok(_) => Err(format!("{} is not a JSON object", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The rootfs overlay of a container whose store directory is `store_dir` and whose spec's
/// `root.path` is `root_path` (see the module docs).
pub fn resolve(store_dir: &Path, root_path: Option<&Path>) -> Result<Overlay, String> {
    let file = store_dir.join(ROOTFS_FILE);
    match std::fs::metadata(&file) {
        Ok(meta) if meta.len() > MAX_ROOTFS_FILE => {
            return Err(format!(
                "{} is larger than {MAX_ROOTFS_FILE} bytes",
                file.display()
            ))
        }
        Ok(_) => {
            let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            return parse_rootfs_file(&bytes, &file.display().to_string());
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", file.display())),
    }
    let root_path = root_path.filter(|p| p.is_absolute()).ok_or_else(|| {
        format!(
            "no {ROOTFS_FILE} in {} and the spec's root.path is not absolute",
            store_dir.display()
        )
    })?;
    let mounts = mountinfo::read_self().map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    from_mounts(&mounts, root_path)
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let o2 = dir.path().join("overlay2");
        for d in [
            "id1/diff",
            "id1/work",
            "id1/merged",
            "id1-init/diff",
            "base/diff",
            "l",
        ] {
            fs::create_dir_all(o2.join(d)).unwrap();
        }
        std::os::unix::fs::symlink("../id1-init/diff", o2.join("l/INIT")).unwrap();
        std::os::unix::fs::symlink("../base/diff", o2.join("l/BASE")).unwrap();
        (dir, o2)
    }

    fn mount_line(point: &Path, super_options: &str) -> mountinfo::Mount {
        let line = format!(
            "100 1 0:50 / {} rw,relatime - overlay overlay rw,{super_options}",
            point.display()
        );
        mountinfo::parse_line(line.as_bytes()).unwrap()
    }

    #[test]
    fn overlay2_mounts_absolute_and_compact() {
        let (_d, o2) = tree();
        let merged = o2.join("id1/merged");
        let expect = |o: Overlay| {
            assert_eq!(o.upperdir, Some(o2.join("id1/diff")));
            assert_eq!(
                o.lowerdirs,
                [o2.join("id1-init/diff"), o2.join("base/diff")]
            );
            assert_eq!(o.xattrs, OverlayXattrs::Trusted);
        };
        let abs = format!(
            "lowerdir={0}/l/INIT:{0}/l/BASE,upperdir={0}/id1/diff,workdir={0}/id1/work",
            o2.display()
        );
        expect(from_mounts(&[mount_line(&merged, &abs)], &merged).unwrap());
        let compact = "lowerdir=l/INIT:l/BASE,upperdir=id1/diff,workdir=id1/work";
        let other = mount_line(
            Path::new("/elsewhere"),
            "lowerdir=/x,upperdir=/y,workdir=/z",
        );
        expect(from_mounts(&[mount_line(&merged, compact), other], &merged).unwrap());
        let user = format!("{abs},userxattr");
        assert_eq!(
            from_mounts(&[mount_line(&merged, &user)], &merged)
                .unwrap()
                .xattrs,
            OverlayXattrs::User
        );
    }

    #[test]
    fn unusable_mounts_are_explained() {
        let (_d, o2) = tree();
        let merged = o2.join("id1/merged");
        let e = from_mounts(&[], &merged).unwrap_err();
        assert!(e.contains("nothing is mounted"), "{e}");
        let mut tmpfs = mount_line(&merged, "size=1");
        tmpfs.fstype = "tmpfs".into();
        assert!(from_mounts(&[tmpfs], &merged)
            .unwrap_err()
            .contains("not an overlay"));
        let ro = format!("lowerdir={0}/l/BASE", o2.display());
        assert!(from_mounts(&[mount_line(&merged, &ro)], &merged)
            .unwrap_err()
            .contains("no upper directory"));
        let missing = format!(
            "lowerdir={0}/l/NONE,upperdir={0}/id1/diff,workdir={0}/id1/work",
            o2.display()
        );
        assert!(from_mounts(&[mount_line(&merged, &missing)], &merged)
            .unwrap_err()
            .contains("l/NONE"));
    }

    /// Docker removed the container (`--rm` after a crash): its upper directory and its init
    /// layer directly below are gone, and only those may be; the image's layers are the base.
    #[test]
    fn a_removed_docker_container_leaves_its_image_layers() {
        let (_d, o2) = tree();
        let record = |upper: &str, lowers: &[&str]| {
            serde_json::json!({
                "format": 1, "mounted_by": "caller", "root_path": o2.join("gone/merged"),
                "upperdir": o2.join(upper),
                "lowerdirs": lowers.iter().map(|l| o2.join(l)).collect::<Vec<_>>(),
            })
            .to_string()
        };
        let o = parse_rootfs_file(
            record("gone/diff", &["l/GONE-INIT", "l/BASE"]).as_bytes(),
            "f",
        )
        .unwrap();
        assert_eq!(o.upperdir, None);
        assert_eq!(o.lowerdirs, [o2.join("base/diff")]);
        assert!(o.found_in.contains("removed"), "{}", o.found_in);
        // The container is still there: a missing layer is an error.
        let e = parse_rootfs_file(
            record("id1/diff", &["l/GONE-INIT", "l/BASE"]).as_bytes(),
            "f",
        )
        .unwrap_err();
        assert!(e.contains("GONE-INIT"), "{e}");
        // An image layer gone too, or the only layer: an error, never a thinner base.
        for lowers in [
            &["l/GONE-INIT", "l/GONE-BASE"][..],
            &["l/INIT", "l/GONE-BASE"],
            &["l/GONE"],
        ] {
            assert!(
                parse_rootfs_file(record("gone/diff", lowers).as_bytes(), "f").is_err(),
                "{lowers:?}"
            );
        }
    }

    #[test]
    fn the_spec_record_is_read_like_untrusted_input() {
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join(crab_shim::sandbox::SPEC_RECORD);
        assert_eq!(read_spec_record(dir.path()), Ok(None), "none yet");
        let good = br#"{"process":{"args":["sleep","infinity"],"cwd":"/app"}}"#;
        fs::write(&at, good).unwrap();
        assert_eq!(read_spec_record(dir.path()), Ok(Some(good.to_vec())));
        for (bytes, says) in [
            (&b"[1,2]"[..], "not a JSON object"),
            (&b"{\"process\":"[..], "EOF"),
            (&b"\xff\xfe"[..], "expected value"),
        ] {
            fs::write(&at, bytes).unwrap();
            let e = read_spec_record(dir.path()).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        fs::write(&at, vec![b' '; (MAX_SPEC_FILE + 1) as usize]).unwrap();
        assert!(read_spec_record(dir.path())
            .unwrap_err()
            .contains("larger than"));
        // A symlink to a file elsewhere, a FIFO, a directory: refused, nothing read or blocked.
        fs::remove_file(&at).unwrap();
        let elsewhere = dir.path().join("elsewhere.json");
        fs::write(&elsewhere, good).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &at).unwrap();
        assert!(read_spec_record(dir.path()).is_err());
        fs::remove_file(&at).unwrap();
        let fifo = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; a plain syscall.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(read_spec_record(dir.path())
            .unwrap_err()
            .contains("not a regular file"));
        fs::remove_file(&at).unwrap();
        fs::create_dir(&at).unwrap();
        assert!(read_spec_record(dir.path()).is_err());
    }

    #[test]
    fn the_rootfs_file_is_checked_like_untrusted_input() {
        let (d, o2) = tree();
        let good = serde_json::json!({
            "format": 1, "mounted_by": "caller", "root_path": o2.join("id1/merged"),
            "upperdir": o2.join("id1/diff"),
            "lowerdirs": [o2.join("l/INIT"), o2.join("l/BASE")],
        });
        let o = parse_rootfs_file(good.to_string().as_bytes(), "f").unwrap();
        assert_eq!(
            o.lowerdirs,
            [o2.join("id1-init/diff"), o2.join("base/diff")]
        );
        let with = |key: &str, value: serde_json::Value| {
            let mut v = good.clone();
            v[key] = value;
            parse_rootfs_file(v.to_string().as_bytes(), "f").unwrap_err()
        };
        assert!(with("format", 2.into()).contains("format 2"));
        assert!(with("mounted_by", "someone".into()).contains("not a rootfs record"));
        let mut no_upper = good.clone();
        no_upper["upperdir"] = serde_json::Value::Null;
        assert!(parse_rootfs_file(no_upper.to_string().as_bytes(), "f").is_ok());
        assert!(with("lowerdirs", serde_json::json!([])).contains("no lower layer"));
        assert!(with("lowerdirs", serde_json::json!(["rel/dir"])).contains("not an absolute"));
        let dotdot = format!("{}/id1/../base/diff", o2.display());
        assert!(with("lowerdirs", serde_json::json!([dotdot])).contains("not an absolute"));
        let file = o2.join("id1/file");
        fs::write(&file, b"").unwrap();
        assert!(with("upperdir", serde_json::json!(file)).contains("not a directory"));
        let mut containerd_gone = good.clone();
        containerd_gone["mounted_by"] = "containerd".into();
        containerd_gone["upperdir"] = "/nonexistent/x".into();
        assert!(
            parse_rootfs_file(containerd_gone.to_string().as_bytes(), "f")
                .unwrap_err()
                .contains("/nonexistent/x")
        );
        let many: Vec<PathBuf> = (0..=MAX_LOWERS).map(|_| o2.join("base/diff")).collect();
        assert!(with("lowerdirs", serde_json::json!(many)).contains("lower layers"));
        for junk in [&b""[..], b"{", b"[]", b"{\"format\":1}", &[0xff; 64]] {
            assert!(parse_rootfs_file(junk, "f").is_err());
        }
        // resolve() prefers the file and bounds its size.
        let store = d.path().join("store");
        fs::create_dir(&store).unwrap();
        fs::write(store.join(ROOTFS_FILE), good.to_string()).unwrap();
        assert_eq!(resolve(&store, None).unwrap().lowerdirs.len(), 2);
        fs::write(
            store.join(ROOTFS_FILE),
            vec![b' '; MAX_ROOTFS_FILE as usize + 1],
        )
        .unwrap();
        assert!(resolve(&store, None).unwrap_err().contains("larger than"));
        fs::remove_file(store.join(ROOTFS_FILE)).unwrap();
        assert!(resolve(&store, None).unwrap_err().contains("not absolute"));
    }
}
