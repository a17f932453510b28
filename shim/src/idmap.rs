//! Id-mapped rootfs layers for pods with their own user namespace (Kubernetes `hostUsers:
//! false`).
//!
//! containerd 2.x hands such a container's overlay rootfs over with the mount options
//! `uidmap=<ctr>:<host>:<size>[,...]` and `gidmap=...`, which are not overlay's: the shim is to
//! mount each lower layer id-mapped (the files of the image, owned by host uid 0, appear owned by
//! the mapped uid) and build the overlay on those, as containerd's own mount code does for its
//! runc shim. Passed to the kernel as they are, they fail the mount with EINVAL.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::sched::CloneFlags;

use crate::error::{Error, Result};

/// Lower layers mounted id-mapped for one overlay mount. Once the overlay is mounted it holds its
/// own references to them, so they are detached and removed on drop.
pub struct IdmappedLowers {
    dir: PathBuf,
    mounts: Vec<PathBuf>,
}

impl Drop for IdmappedLowers {
    fn drop(&mut self) {
        for m in &self.mounts {
            if let Err(e) = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH) {
                log::warn!("cannot detach id-mapped layer {}: {e}", m.display());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// For a rootfs mount (of filesystem type `kind`) with `uidmap=`/`gidmap=` among its
/// `options`: the options of the overlay mount to make instead (its lower layers id-mapped under
/// `<bundle>/idmapped-layers`, the mapping options gone) and the layer mounts to drop once it is
/// made. None for any other mount.
pub fn prepare(
    bundle: &Path,
    kind: &str,
    mount_options: &[String],
) -> Result<Option<(Vec<String>, IdmappedLowers)>> {
    let option = |key: &str| mount_options.iter().find_map(|o| o.strip_prefix(key));
    let (Some(uidmap), Some(gidmap)) = (option("uidmap="), option("gidmap=")) else {
        return Ok(None);
    };
    if kind != "overlay" {
        return Err(Error::InvalidArgument(format!(
            "an id-mapped rootfs of type {kind:?}: crab maps overlay rootfs layers only"
        )));
    }
    let userns = user_namespace(&parse_mapping(uidmap)?, &parse_mapping(gidmap)?)?;
    let mut lowers = IdmappedLowers {
        dir: bundle.join("idmapped-layers"),
        mounts: Vec::new(),
    };
    std::fs::create_dir_all(&lowers.dir)
        .map_err(Error::io(format!("create {}", lowers.dir.display())))?;
    let mut options = Vec::new();
    for o in mount_options {
        if o.starts_with("uidmap=") || o.starts_with("gidmap=") {
            continue;
        }
        let Some(dirs) = o.strip_prefix("lowerdir=") else {
            options.push(o.clone());
            continue;
        };
        let mut mapped = Vec::new();
        for (i, layer) in dirs.split(':').enumerate() {
            let target = lowers.dir.join(i.to_string());
            std::fs::create_dir_all(&target)
                .map_err(Error::io(format!("create {}", target.display())))?;
            mount_idmapped(Path::new(layer), &target, &userns)?;
            lowers.mounts.push(target.clone());
            mapped.push(target.to_string_lossy().into_owned());
        }
        options.push(format!("lowerdir={}", mapped.join(":")));
    }
    Ok(Some((options, lowers)))
}

/// `ctr:host:size[,ctr:host:size...]` as lines of a /proc/<pid>/uid_map.
fn parse_mapping(mapping: &str) -> Result<String> {
    let mut lines = String::new();
    for m in mapping.split(',') {
        let ids: Vec<u32> = m
            .split(':')
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| {
                Error::InvalidArgument(format!(
                    "id mapping {m:?} of {mapping:?} is not ctr:host:size"
                ))
            })?;
        let [ctr, host, size] = ids[..] else {
            return Err(Error::InvalidArgument(format!(
                "id mapping {m:?} of {mapping:?} is not ctr:host:size"
            )));
        };
        lines.push_str(&format!("{ctr} {host} {size}\n"));
    }
    Ok(lines)
}

/// A user namespace with the given maps, held by an fd: a child is cloned into a new user
/// namespace, its maps written, its namespace opened, and then it is let go (the shim's reaper
/// collects it).
fn user_namespace(uid_map: &str, gid_map: &str) -> Result<OwnedFd> {
    // Close-on-exec: runc and other children the shim spawns meanwhile must not inherit the
    // write end (they would keep the child below alive, and carry the fd into containers).
    let (hold_r, hold_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(Error::sys("pipe"))?;
    let (hold, hold_w_raw) = (hold_r.as_raw_fd(), hold_w.as_raw_fd());
    let mut stack = vec![0u8; 64 * 1024];
    // The child only closes its copy of the write end and blocks in read(2) until the parent
    // closes its own, then exits: nothing that is unsafe after a clone of a multi-threaded
    // process. (Without the close, the child's own copy kept the pipe open, the read never saw
    // EOF, and every user-namespace pod left a process behind that looked like its shim.)
    // SAFETY: the child runs on `stack` (owned here and alive until the parent returns, the
    // child only needs a few bytes of it) and calls only close(2) and read(2) on descriptors it
    // inherited, both async-signal-safe; it touches no lock or allocation of the parent.
    let child = unsafe {
        nix::sched::clone(
            Box::new(move || {
                libc::close(hold_w_raw);
                let mut b = [0u8; 1];
                libc::read(hold, b.as_mut_ptr().cast(), 1);
                0
            }),
            &mut stack,
            CloneFlags::CLONE_NEWUSER,
            Some(libc::SIGCHLD),
        )
    }
    .map_err(Error::sys("clone a user namespace"))?;
    drop(hold_r);
    let proc = PathBuf::from(format!("/proc/{child}"));
    let result = (|| {
        for (file, map) in [("uid_map", uid_map), ("gid_map", gid_map)] {
            std::fs::write(proc.join(file), map).map_err(Error::io(format!(
                "write {map:?} to {}",
                proc.join(file).display()
            )))?;
        }
        let ns = proc.join("ns/user");
        File::open(&ns)
            .map(OwnedFd::from)
            .map_err(Error::io(format!("open {}", ns.display())))
    })();
    drop(hold_w);
    result
}

/// Mounts `source` at `target` id-mapped through `userns` (open_tree, mount_setattr, move_mount).
fn mount_idmapped(source: &Path, target: &Path, userns: &OwnedFd) -> Result<()> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|e| Error::InvalidArgument(e.to_string()))
    };
    let (src, dst, empty) = (c(source)?, c(target)?, CString::default());
    let fail = |what: &str| {
        let e = std::io::Error::last_os_error();
        Error::Io {
            context: format!("{what} of {} for {}", source.display(), target.display()),
            source: e,
        }
    };
    // SAFETY: `src` is a NUL-terminated string that outlives the call; open_tree reads it only.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC,
        )
    };
    if tree < 0 {
        return Err(fail("open_tree"));
    }
    // SAFETY: open_tree succeeded: `tree` is a new descriptor that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as i32) };
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: `empty` is a NUL-terminated string and `attr` a `mount_attr` of the size passed;
    // both outlive the call and the kernel only reads them. `tree` is an open descriptor.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc < 0 {
        return Err(fail("mount_setattr(MOUNT_ATTR_IDMAP)"));
    }
    // SAFETY: `empty` and `dst` are NUL-terminated strings that outlive the call; the kernel
    // only reads them. `tree` is an open descriptor.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 {
        return Err(fail("move_mount"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_become_proc_map_lines() {
        assert_eq!(
            parse_mapping("0:1000000:65536").unwrap(),
            "0 1000000 65536\n"
        );
        assert_eq!(
            parse_mapping("0:100:1,1:200:10").unwrap(),
            "0 100 1\n1 200 10\n"
        );
        assert!(parse_mapping("0:100").is_err());
        assert!(parse_mapping("a:b:c").is_err());
    }

    #[test]
    fn other_mounts_are_left_alone() {
        let overlay = ["lowerdir=/a:/b".to_string()];
        assert!(prepare(Path::new("/nonexistent"), "overlay", &overlay)
            .unwrap()
            .is_none());
        let mapped = ["uidmap=0:1:1".to_string(), "gidmap=0:1:1".to_string()];
        assert!(prepare(Path::new("/nonexistent"), "bind", &mapped).is_err());
    }
}
