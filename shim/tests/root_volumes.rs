//! Tracked volumes refilled from a restored rootfs on the real system, as root: the image's
//! owners kept and its set-uid bits dropped, device nodes left out, and a mount inside the
//! volume's host directory (standing for a directory another mount replaced) never entered,
//! whether it was there before the refill or appears during it. Needs root (chown, mknod,
//! mount); fails without (see `support`).

mod support;

use std::{
    fs,
    os::unix::fs::{symlink, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
};

use crab_shim::restore::volumes::{restore_volume, Copied, VolumeLimits, VolumeRestoreError};
use nix::{
    mount::{mount, MsFlags},
    sys::stat::{makedev, mknod, Mode, SFlag},
    unistd::{Gid, Uid},
};

/// Moves the calling thread (and the threads it spawns after) into a mount namespace of its
/// own, private: the test's mounts are seen by no one else and go with the thread.
fn private_mount_namespace() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare(CLONE_NEWNS)");
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .expect("make / private in the test's mount namespace");
}

fn bind(from: &Path, on: &Path) -> nix::Result<()> {
    mount(Some(from), on, None::<&str>, MsFlags::MS_BIND, None::<&str>)
}

/// Every path below `dir`, symlinks not followed.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if fs::symlink_metadata(&p).unwrap().is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    n.sort();
    n
}

#[test]
fn owners_are_the_images_set_id_bits_are_not_and_devices_are_left_out() {
    support::require_root("chowns files to other users and makes device nodes");
    let t = tempfile::tempdir().unwrap();
    let (root, dir) = (t.path().join("root"), t.path().join("dir"));
    let from = root.join("w");
    fs::create_dir_all(from.join("home")).unwrap();
    fs::create_dir_all(&dir).unwrap();
    let own = |p: &Path, uid: u32, gid: u32| {
        nix::unistd::fchownat(
            None,
            p,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .unwrap()
    };
    // A set-uid root shell and a set-gid file of another group: on the host they would be
    // privilege for whoever reaches the directory.
    fs::write(from.join("rootshell"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(from.join("rootshell"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::write(from.join("home/tool"), b"tool").unwrap();
    own(&from.join("home/tool"), 1000, 1001);
    fs::set_permissions(from.join("home/tool"), fs::Permissions::from_mode(0o2750)).unwrap();
    own(&from.join("home"), 1000, 1000);
    fs::set_permissions(from.join("home"), fs::Permissions::from_mode(0o2770)).unwrap();
    symlink("tool", from.join("home/link")).unwrap();
    own(&from.join("home/link"), 1000, 1002);
    // Device nodes: a char device (the null device's numbers) and a block device.
    mknod(
        &from.join("null"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(1, 3),
    )
    .unwrap();
    mknod(
        &from.join("home/disk"),
        SFlag::S_IFBLK,
        Mode::from_bits_truncate(0o660),
        makedev(7, 0),
    )
    .unwrap();
    let mtime = filetime(&from.join("home/tool"));

    let c = restore_volume(Path::new("/w"), &root, &dir, VolumeLimits::default()).unwrap();
    assert_eq!(
        c,
        Copied {
            files: 2,
            bytes: 14,
            skipped: 2
        }
    );
    assert_eq!(names(&dir), ["home", "rootshell"]);
    assert_eq!(names(&dir.join("home")), ["link", "tool"]);
    let meta = |p: &str| fs::symlink_metadata(dir.join(p)).unwrap();
    assert_eq!((meta("rootshell").uid(), meta("rootshell").gid()), (0, 0));
    assert_eq!(meta("rootshell").mode() & 0o7777, 0o755);
    assert_eq!(
        (meta("home/tool").uid(), meta("home/tool").gid()),
        (1000, 1001)
    );
    assert_eq!(meta("home/tool").mode() & 0o7777, 0o750);
    assert_eq!(filetime(&dir.join("home/tool")), mtime);
    // A directory keeps set-gid (group inheritance, no privilege).
    assert_eq!((meta("home").uid(), meta("home").gid()), (1000, 1000));
    assert_eq!(meta("home").mode() & 0o7777, 0o2770);
    assert_eq!(
        (meta("home/link").uid(), meta("home/link").gid()),
        (1000, 1002)
    );
    assert_eq!(
        fs::read_link(dir.join("home/link")).unwrap(),
        Path::new("tool")
    );
}

fn filetime(p: &Path) -> (i64, i64) {
    let m = fs::symlink_metadata(p).unwrap();
    (m.mtime(), m.mtime_nsec())
}

#[test]
fn a_mount_in_the_volumes_directory_is_never_entered_by_the_emptying() {
    support::require_root("mounts");
    let t = tempfile::tempdir().unwrap();
    let (dir, outside) = (t.path().join("dir"), t.path().join("outside"));
    fs::create_dir_all(dir.join("m")).unwrap();
    fs::create_dir_all(outside.join("sub")).unwrap();
    fs::write(outside.join("sub/keep"), b"host").unwrap();
    let (dir2, t2) = (dir.clone(), t.path().to_path_buf());
    // In a thread of its own: the mount namespace goes with it.
    let e = std::thread::spawn(move || {
        private_mount_namespace();
        bind(&t2.join("outside"), &dir2.join("m")).unwrap();
        restore_volume(Path::new("/w"), &t2, &dir2, VolumeLimits::default()).unwrap_err()
    })
    .join()
    .unwrap();
    assert!(
        matches!(&e, VolumeRestoreError::Replaced { entry, .. } if entry == Path::new("/w/m")),
        "{e}"
    );
    // The mounted directory's files are still there (the emptying never went in).
    assert_eq!(walk(&outside).len(), 2, "{:?}", walk(&outside));
    assert_eq!(fs::read(outside.join("sub/keep")).unwrap(), b"host");
    assert!(e.to_string().contains("/w/m is another mount"), "{e}");
}

/// The race of `restore::volumes`' unit test with mounts instead of symlinks: as soon as the
/// refill makes a directory, a bind mount of a host directory outside every volume covers it.
/// Nothing may be created in that directory; the refill fails naming a covered entry, or
/// completes (into the directories under the mounts, which it holds open).
#[test]
fn a_mount_appearing_over_new_directories_gets_nothing_written_outside() {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    support::require_root("mounts");
    const DIRS: usize = 300;
    const MOUNTS: usize = 40;
    let t = tempfile::tempdir().unwrap();
    let (root, dir, outside) = (
        t.path().join("root"),
        t.path().join("dir"),
        t.path().join("outside"),
    );
    for i in 0..DIRS {
        let d = root.join("w").join(format!("d{i:03}"));
        fs::create_dir_all(d.join("sub")).unwrap();
        for f in 0..4 {
            fs::write(d.join(format!("f{f}")), b"x").unwrap();
        }
        fs::write(d.join("sub/g"), b"y").unwrap();
    }
    fs::create_dir(&dir).unwrap();
    // Laid out as the image's directories are: a write through a covered parent at any depth
    // lands.
    fs::create_dir_all(outside.join("sub")).unwrap();
    let (r, covered) = {
        let (dir, outside) = (dir.clone(), outside.clone());
        std::thread::spawn(move || {
            private_mount_namespace();
            let stop = Arc::new(AtomicBool::new(false));
            let covered = Arc::new(Mutex::new(Vec::<String>::new()));
            let inotify = Inotify::init(InitFlags::IN_CLOEXEC).unwrap();
            inotify.add_watch(&dir, AddWatchFlags::IN_CREATE).unwrap();
            // Spawned from this thread: in the same mount namespace.
            let co_tenant = {
                let (stop, covered, dir) = (stop.clone(), covered.clone(), dir.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        for ev in inotify.read_events().unwrap() {
                            let Some(name) = ev.name.and_then(|n| n.into_string().ok()) else {
                                continue;
                            };
                            let mut c = covered.lock().unwrap();
                            if !ev.mask.contains(AddWatchFlags::IN_ISDIR)
                                || stop.load(Ordering::SeqCst)
                                || c.len() >= MOUNTS
                            {
                                continue;
                            }
                            if bind(&outside, &dir.join(&name)).is_ok() {
                                c.push(name);
                            }
                        }
                    }
                })
            };
            let r = restore_volume(Path::new("/w"), &root, &dir, VolumeLimits::default());
            stop.store(true, Ordering::SeqCst);
            fs::write(dir.join(".wake"), b"").unwrap();
            co_tenant.join().unwrap();
            let covered = covered.lock().unwrap().clone();
            // The mounts go with this thread's namespace.
            (r, covered)
        })
        .join()
        .unwrap()
    };
    assert!(!covered.is_empty(), "no mount raced the refill");
    let leaked: Vec<_> = walk(&outside)
        .into_iter()
        .filter(|p| p != &outside.join("sub"))
        .collect();
    assert!(
        leaked.is_empty(),
        "{} entries created outside the volume (under {} mounts), e.g. {:?}",
        leaked.len(),
        covered.len(),
        &leaked[..leaked.len().min(5)]
    );
    match r {
        Ok(c) => {
            assert_eq!(c.files, 5 * DIRS as u64);
            eprintln!("completed under {} mounts: {c:?}", covered.len());
        }
        Err(e) => {
            let text = e.to_string();
            assert!(
                covered
                    .iter()
                    .any(|n| text.contains(&format!("/w/{n} is another mount"))),
                "the error names no covered entry: {text}"
            );
            eprintln!("failed under {} mounts: {text}", covered.len());
        }
    }
}
