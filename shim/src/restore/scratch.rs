//! Where a restore's own copy of a CRIU image lives: on disk, in the store, never in the bundle.
//!
//! The bundle is under `/run/containerd/...`, a tmpfs on most hosts: an image copied there (up
//! to `[restore] max_image_mib`, 16 GiB by default) would be held in RAM for the container's
//! whole life. Each restore gets a directory of its own instead:
//!
//! ```text
//! <store.state_dir>/.restores/                    root's, 0700 (made so, or refused)
//! <store.state_dir>/.restores/<ns>.<id>.<nonce>/  one restore's copy: criu/ (its CRIU image)
//! <store.state_dir>/.restores/<ns>.<id>.<nonce>.lock
//! ```
//!
//! On the store's filesystem, so the restore cache's verified copies are hard-linked into it,
//! not copied. The shim holds `flock` on the `.lock` file as long as the directory is in use
//! (from Create until Delete, or until the Create that made it fails: [`RestoreDir`] removes it
//! when dropped). A directory whose lock nobody holds belongs to a shim that died (mid-copy or
//! later): every new restore on the host removes such leftovers first, and
//! `containerd-shim-crab-v1 delete` (containerd's cleanup after a shim died) removes the one its
//! bundle names ([`BUNDLE_RECORD`]). Nothing but root can see a copy being written: the
//! directory is below a 0700 one, and runc is handed its path only once the copy is complete
//! and verified.

use std::{
    fs::{self, DirBuilder, File, OpenOptions},
    io,
    os::unix::{
        ffi::OsStringExt,
        fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt},
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use nix::fcntl::{Flock, FlockArg};

/// The directory of restore copies in `store.state_dir` (a dot: no namespace is named so).
pub const RESTORES_DIR: &str = ".restores";
/// The file in a bundle that names its container's restore directory (for the cleanup after a
/// shim died).
pub const BUNDLE_RECORD: &str = "crab-restore-dir";
/// The CRIU image inside a restore directory.
pub const CRIU_SUBDIR: &str = "criu";
const LOCK_SUFFIX: &str = ".lock";

/// One restore's directory, locked while this value lives, removed when it is dropped.
#[derive(Debug)]
pub struct RestoreDir {
    dir: PathBuf,
    lock_path: PathBuf,
    lock: Option<Flock<File>>,
}

impl RestoreDir {
    /// Makes a fresh restore directory for container `id` of `namespace` below
    /// `<state_dir>/.restores` (made root's and 0700 if needed), after removing the leftovers of
    /// shims that died there.
    pub fn create(state_dir: &Path, namespace: &str, id: &str) -> io::Result<RestoreDir> {
        let root = state_dir.join(RESTORES_DIR);
        private_dir(&root)?;
        sweep(&root);
        // A concurrent sweep can take a fresh lock file before its maker does: try a new name.
        let mut tries = 0;
        loop {
            match Self::make(&root, namespace, id) {
                Err(e) if tries < 3 => {
                    tries += 1;
                    log::debug!("restore directory in {}: {e}; trying again", root.display());
                }
                r => return r,
            }
        }
    }

    fn make(root: &Path, namespace: &str, id: &str) -> io::Result<RestoreDir> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!(
            "{namespace}.{id}.{}-{nanos}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let lock_path = root.join(format!("{name}{LOCK_SUFFIX}"));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&lock_path)?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            let _ = fs::remove_file(&lock_path);
            io::Error::from(e)
        })?;
        let mut made = RestoreDir {
            dir: root.join(&name),
            lock_path,
            lock: Some(lock),
        };
        // A sweeper may have taken the lock file between its creation and our lock (it then
        // unlinks it): ours must still be the one at its path, or the directory is unprotected.
        let still_ours = fs::symlink_metadata(&made.lock_path)
            .ok()
            .zip(made.lock.as_ref().and_then(|l| l.metadata().ok()))
            .is_some_and(|(at_path, held)| {
                at_path.ino() == held.ino() && at_path.dev() == held.dev()
            });
        if !still_ours {
            made.lock = None;
            return Err(io::Error::other(format!(
                "{} was swept away while being made",
                made.lock_path.display()
            )));
        }
        DirBuilder::new().mode(0o700).create(&made.dir)?;
        Ok(made)
    }

    /// The restore directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Where the CRIU image goes (made by whoever copies it there).
    pub fn criu(&self) -> PathBuf {
        self.dir.join(CRIU_SUBDIR)
    }

    /// Writes the directory's path into `bundle` ([`BUNDLE_RECORD`], replaced atomically), for
    /// [`remove_recorded`] after a shim died.
    pub fn record_in(&self, bundle: &Path) -> io::Result<()> {
        let tmp = bundle.join(format!(".{BUNDLE_RECORD}.tmp"));
        fs::write(&tmp, self.dir.as_os_str().as_encoded_bytes())?;
        fs::rename(&tmp, bundle.join(BUNDLE_RECORD))
    }
}

impl Drop for RestoreDir {
    fn drop(&mut self) {
        // The lock is held until the directory is gone, so no sweeper races the removal.
        if let Err(e) = remove_tree(&self.dir) {
            log::warn!("removing the restore copy {}: {e}", self.dir.display());
        }
        let _ = fs::remove_file(&self.lock_path);
        self.lock = None;
    }
}

/// Removes the restore directory `bundle` names (its shim died), if it is one: an absolute
/// path whose parent is a [`RESTORES_DIR`]. Whether one was removed.
pub fn remove_recorded(bundle: &Path) -> bool {
    let Ok(text) = fs::read(bundle.join(BUNDLE_RECORD)) else {
        return false;
    };
    let dir = PathBuf::from(std::ffi::OsString::from_vec(text));
    if !is_restore_dir(&dir) {
        log::warn!(
            "{} names {}, which is no restore directory: left alone",
            bundle.join(BUNDLE_RECORD).display(),
            dir.display()
        );
        return false;
    }
    let removed = remove_tree(&dir).is_ok();
    let mut lock = dir.into_os_string();
    lock.push(LOCK_SUFFIX);
    let _ = fs::remove_file(lock);
    let _ = fs::remove_file(bundle.join(BUNDLE_RECORD));
    removed
}

/// An absolute, normal path directly below a [`RESTORES_DIR`] directory.
fn is_restore_dir(dir: &Path) -> bool {
    use std::path::Component;
    dir.is_absolute()
        && dir
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && dir.parent().and_then(Path::file_name) == Some(RESTORES_DIR.as_ref())
        && dir
            .file_name()
            .is_some_and(|n| !n.as_encoded_bytes().starts_with(b"."))
}

/// Makes `dir` a directory of root's (the shim's user) with mode 0700: created so, or an existing
/// one set so; anything else there (a symlink, a file, another owner) is refused.
fn private_dir(dir: &Path) -> io::Result<()> {
    match DirBuilder::new().mode(0o700).recursive(false).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(dir.parent().unwrap_or(dir))?;
            return private_dir(dir);
        }
        Err(e) => return Err(e),
    }
    let md = fs::symlink_metadata(dir)?;
    if !md.is_dir() || md.uid() != nix::unistd::geteuid().as_raw() {
        return Err(io::Error::other(format!(
            "{} must be a directory of the shim's user (uid {}), not a symlink or another's",
            dir.display(),
            nix::unistd::geteuid()
        )));
    }
    if md.mode() & 0o7777 != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Removes the directories below `root` whose lock nobody holds (their shim died), with their
/// lock files. Best effort: what cannot be removed now is tried again by the next restore.
fn sweep(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(dir_name) = name
            .to_str()
            .and_then(|n| n.strip_suffix(LOCK_SUFFIX))
            .map(str::to_owned)
        else {
            continue;
        };
        let lock_path = entry.path();
        let Ok(file) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&lock_path)
        else {
            continue;
        };
        // Held: in use by a live shim.
        let Ok(_held) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
            continue;
        };
        let dir = root.join(&dir_name);
        log::info!(
            "removing the restore copy {} of a shim that died",
            dir.display()
        );
        if remove_tree(&dir).is_ok() {
            let _ = fs::remove_file(&lock_path);
        }
    }
}

fn remove_tree(dir: &Path) -> io::Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restore_dir_is_private_locked_and_gone_when_dropped() {
        let state = tempfile::tempdir().unwrap();
        let d = RestoreDir::create(state.path(), "ns", "c1").unwrap();
        let root = state.path().join(RESTORES_DIR);
        assert_eq!(fs::metadata(&root).unwrap().mode() & 0o7777, 0o700);
        assert_eq!(fs::metadata(d.path()).unwrap().mode() & 0o7777, 0o700);
        assert_eq!(d.path().parent(), Some(root.as_path()));
        assert_eq!(d.criu(), d.path().join("criu"));
        fs::create_dir(d.criu()).unwrap();
        fs::write(d.criu().join("pages-1.img"), b"x").unwrap();
        // In use: another restore's sweep leaves it alone.
        let other = RestoreDir::create(state.path(), "ns", "c2").unwrap();
        assert!(d.criu().join("pages-1.img").exists());
        let path = d.path().to_path_buf();
        drop(d);
        assert!(!path.exists());
        let names: Vec<_> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "the other's dir and lock only: {names:?}");
        drop(other);
        assert_eq!(fs::read_dir(&root).unwrap().count(), 0);
    }

    #[test]
    fn leftovers_of_dead_shims_are_swept_and_a_loose_root_is_made_private() {
        let state = tempfile::tempdir().unwrap();
        let root = state.path().join(RESTORES_DIR);
        fs::create_dir(&root).unwrap();
        fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
        // A dead shim's copy: its lock file is there, nobody holds it.
        let dead = root.join("ns.old.1-2-3");
        fs::create_dir_all(dead.join("criu")).unwrap();
        fs::write(root.join("ns.old.1-2-3.lock"), b"").unwrap();
        let d = RestoreDir::create(state.path(), "ns", "new").unwrap();
        assert!(!dead.exists(), "the dead shim's copy was swept");
        assert!(!root.join("ns.old.1-2-3.lock").exists());
        assert_eq!(fs::metadata(&root).unwrap().mode() & 0o7777, 0o700);
        drop(d);
    }

    #[test]
    fn a_symlinked_root_is_refused() {
        let state = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), state.path().join(RESTORES_DIR)).unwrap();
        let err = RestoreDir::create(state.path(), "ns", "c").unwrap_err();
        assert!(err.to_string().contains("not a symlink"), "{err}");
        assert_eq!(fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    }

    #[test]
    fn the_bundle_record_removes_only_restore_dirs() {
        let state = tempfile::tempdir().unwrap();
        let bundle = tempfile::tempdir().unwrap();
        let d = RestoreDir::create(state.path(), "ns", "c").unwrap();
        fs::create_dir(d.criu()).unwrap();
        d.record_in(bundle.path()).unwrap();
        let path = d.path().to_path_buf();
        // As after a shim died: the value is gone without its Drop running.
        std::mem::forget(d);
        assert!(remove_recorded(bundle.path()));
        assert!(!path.exists());
        assert!(!bundle.path().join(BUNDLE_RECORD).exists());
        // A record naming anything else is ignored.
        let victim = tempfile::tempdir().unwrap();
        for bad in [
            victim.path().to_path_buf(),
            state.path().join(RESTORES_DIR).join("../x"),
            PathBuf::from("relative/.restores/x"),
        ] {
            fs::write(
                bundle.path().join(BUNDLE_RECORD),
                bad.as_os_str().as_encoded_bytes(),
            )
            .unwrap();
            assert!(!remove_recorded(bundle.path()), "{}", bad.display());
        }
        assert!(victim.path().exists());
        assert!(!remove_recorded(tempfile::tempdir().unwrap().path()));
    }
}
