//! Tracked volumes brought back from a checkpoint: a container started from a checkpoint whose
//! layers hold a tracked volume's contents (below the volume's path in the rootfs) gets them
//! in the volume's host directory before its processes run, so that the bind mount shows the
//! volume as it was at that checkpoint (rollback, recovery, fork and `run` of an exported
//! image all start containers this way).
//!
//! The rootfs comes from a checkpoint image: untrusted. Only directories, regular files and
//! symlinks (as links, never followed) are copied; devices, FIFOs and sockets are left out
//! (a device node in a host directory would outlive the container's device rules). Every
//! entry is opened beneath its parent without following links, on both sides, and the walk
//! is bounded in depth.

use std::{
    ffi::OsStr,
    fs::{self, File},
    io,
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

/// How deep a volume's tree may go.
const MAX_DEPTH: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum VolumeRestoreError {
    #[error("restoring volume {at}: {what} {path}: {source}")]
    Io {
        at: PathBuf,
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("restoring volume {at}: directories nested deeper than {MAX_DEPTH} levels")]
    TooDeep { at: PathBuf },
}

/// What a restore copied.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Copied {
    pub files: u64,
    pub bytes: u64,
    /// Entries left out (devices, FIFOs, sockets).
    pub skipped: u64,
}

/// Makes host directory `dir` (the source of the bind mount at `at`) hold exactly what `at`
/// holds in the restored rootfs `root`: its entries are removed, then those are copied in with
/// their modes, owners and modification times. `at` is resolved beneath `root` with no
/// symlink in any component (the image's `/workspace -> /etc` would otherwise copy the host's
/// `/etc` into the volume); what does not resolve that way restores as empty.
pub fn restore_volume(at: &Path, root: &Path, dir: &Path) -> Result<Copied, VolumeRestoreError> {
    let rel = at.strip_prefix("/").unwrap_or(at);
    let from = root.join(rel);
    let resolved = crate::sys::beneath::open_root(root)
        .and_then(|r| crate::sys::beneath::resolve_beneath(std::os::fd::AsFd::as_fd(&r), rel))
        .and_then(|fd| crate::sys::beneath::fstat(std::os::fd::AsFd::as_fd(&fd)));
    let beneath = match resolved {
        Ok(st) => st.st_mode & libc::S_IFMT == libc::S_IFDIR,
        Err(e) => {
            if e.kind() != io::ErrorKind::NotFound {
                log::warn!(
                    "restoring volume {}: {} does not resolve beneath the rootfs: {e}",
                    at.display(),
                    from.display()
                );
            }
            false
        }
    };
    restore_from(at, beneath.then_some(from.as_path()), dir)
}

/// [`restore_volume`] from `from` (a directory resolved beneath the rootfs), or `None`: empty.
fn restore_from(at: &Path, from: Option<&Path>, dir: &Path) -> Result<Copied, VolumeRestoreError> {
    let err = |what, path: &Path| {
        let at = at.to_path_buf();
        let path = path.to_path_buf();
        move |source| VolumeRestoreError::Io {
            at,
            what,
            path,
            source,
        }
    };
    let meta = fs::symlink_metadata(dir).map_err(err("reading", dir))?;
    if !meta.is_dir() {
        return Err(err("reading", dir)(io::Error::other("not a directory")));
    }
    for entry in fs::read_dir(dir).map_err(err("listing", dir))? {
        let path = entry.map_err(err("listing", dir))?.path();
        let gone = match fs::symlink_metadata(&path).map_err(err("reading", &path))? {
            m if m.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        gone.map_err(err("removing", &path))?;
    }
    let mut copied = Copied::default();
    // The layers hold nothing there (an empty volume whose directory the image lacks).
    let Some(from) = from else {
        return Ok(copied);
    };
    copy_dir(at, from, dir, 0, &mut copied)?;
    let root = fs::symlink_metadata(from).map_err(err("reading", from))?;
    set_meta(dir, &root).map_err(err("setting attributes of", dir))?;
    Ok(copied)
}

fn copy_dir(
    at: &Path,
    from: &Path,
    to: &Path,
    depth: usize,
    copied: &mut Copied,
) -> Result<(), VolumeRestoreError> {
    if depth > MAX_DEPTH {
        return Err(VolumeRestoreError::TooDeep { at: at.into() });
    }
    let err = |what, path: &Path| {
        let (at, path) = (at.to_path_buf(), path.to_path_buf());
        move |source| VolumeRestoreError::Io {
            at,
            what,
            path,
            source,
        }
    };
    let mut names: Vec<_> = fs::read_dir(from)
        .map_err(err("listing", from))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(err("listing", from))?;
    names.sort();
    for name in names {
        let (src, dst) = (from.join(&name), to.join(&name));
        let m = fs::symlink_metadata(&src).map_err(err("reading", &src))?;
        let t = m.file_type();
        if t.is_dir() {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(&dst)
                .map_err(err("creating", &dst))?;
            copy_dir(at, &src, &dst, depth + 1, copied)?;
            set_meta(&dst, &m).map_err(err("setting attributes of", &dst))?;
        } else if t.is_file() {
            copy_file(&src, &dst, &m).map_err(err("copying", &src))?;
            copied.files += 1;
            copied.bytes += m.len();
        } else if t.is_symlink() {
            let target = fs::read_link(&src).map_err(err("reading", &src))?;
            std::os::unix::fs::symlink(&target, &dst).map_err(err("creating", &dst))?;
            std::os::unix::fs::lchown(&dst, Some(m.uid()), Some(m.gid()))
                .map_err(err("setting the owner of", &dst))?;
        } else {
            log::warn!(
                "restoring volume {}: {} is not a file, directory or symlink: left out",
                at.display(),
                Path::new(OsStr::new(&name)).display()
            );
            copied.skipped += 1;
        }
    }
    Ok(())
}

/// Copies regular file `src` to new file `dst` (never through a link at either end).
fn copy_file(src: &Path, dst: &Path, m: &fs::Metadata) -> io::Result<()> {
    let mut input = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(src)?;
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dst)?;
    io::copy(&mut input, &mut out)?;
    set_file_meta(&out, m)
}

fn set_file_meta(f: &File, m: &fs::Metadata) -> io::Result<()> {
    std::os::unix::fs::fchown(f, Some(m.uid()), Some(m.gid()))?;
    f.set_permissions(fs::Permissions::from_mode(m.mode() & 0o7777))?;
    f.set_modified(m.modified()?)
}

fn set_meta(dir: &Path, m: &fs::Metadata) -> io::Result<()> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    set_file_meta(&f, m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn the_directory_ends_up_holding_exactly_the_checkpoints_tree() {
        let t = tempfile::tempdir().unwrap();
        let (from, dir) = (t.path().join("root/workspace"), t.path().join("dir"));
        fs::create_dir_all(from.join("src/deep")).unwrap();
        fs::write(from.join("src/deep/a.py"), b"print(1)\n").unwrap();
        fs::set_permissions(
            from.join("src/deep/a.py"),
            fs::Permissions::from_mode(0o751),
        )
        .unwrap();
        symlink("deep/a.py", from.join("src/link")).unwrap();
        // A link out of the tree stays a link: never followed.
        symlink("/etc/shadow", from.join("shadow")).unwrap();
        nix::unistd::mkfifo(&from.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        fs::create_dir_all(dir.join("later/x")).unwrap();
        fs::write(dir.join("after-the-checkpoint"), b"gone").unwrap();
        symlink("/", dir.join("root-link")).unwrap();

        let c = restore_volume(Path::new("/workspace"), &t.path().join("root"), &dir).unwrap();
        assert_eq!(
            c,
            Copied {
                files: 1,
                bytes: 9,
                skipped: 1
            }
        );
        let mut names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["shadow", "src"]);
        assert_eq!(fs::read(dir.join("src/deep/a.py")).unwrap(), b"print(1)\n");
        let mode = fs::metadata(dir.join("src/deep/a.py")).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o751);
        assert_eq!(
            fs::read_link(dir.join("src/link")).unwrap(),
            Path::new("deep/a.py")
        );
        assert_eq!(
            fs::read_link(dir.join("shadow")).unwrap(),
            Path::new("/etc/shadow")
        );
        // The old link to / was removed as a link, not followed.
        assert!(Path::new("/etc").is_dir());
    }

    #[test]
    fn a_volume_path_through_a_symlink_in_the_image_is_never_followed() {
        // The image makes /workspace (or a parent of it) a link to a host directory: nothing
        // of that directory may reach the volume.
        let t = tempfile::tempdir().unwrap();
        let (root, outside, dir) = (
            t.path().join("root"),
            t.path().join("outside"),
            t.path().join("dir"),
        );
        fs::create_dir_all(outside.join("workspace")).unwrap();
        fs::write(outside.join("secret"), b"host").unwrap();
        fs::write(outside.join("workspace/secret"), b"host").unwrap();
        fs::create_dir_all(&root).unwrap();
        fs::create_dir_all(&dir).unwrap();
        symlink(&outside, root.join("workspace")).unwrap();
        symlink(&outside, root.join("parent")).unwrap();
        for at in ["/workspace", "/parent/workspace"] {
            let c = restore_volume(Path::new(at), &root, &dir).unwrap();
            assert_eq!(c, Copied::default(), "{at}");
            assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "{at}");
        }
    }

    #[test]
    fn nothing_in_the_checkpoint_empties_the_directory() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("dir");
        fs::create_dir_all(dir.join("a")).unwrap();
        let c = restore_volume(Path::new("/w"), t.path(), &dir).unwrap();
        assert_eq!(c, Copied::default());
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        // A file where the host directory should be is refused.
        fs::write(t.path().join("file"), b"").unwrap();
        let e = restore_volume(Path::new("/dir"), t.path(), &t.path().join("file")).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
    }
}
