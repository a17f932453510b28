//! The system layer on the real system: cgroup freezers (v1 and v2) stopping a real process,
//! cgroup ids, and files beneath a root that are devices, FIFOs or sockets. Needs root and a
//! cgroup2 hierarchy (and the v1 freezer hierarchy for its test); fails without (see `support`).

mod support;

use std::{
    io,
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crab_shim::sys::beneath::{open_regular_beneath, open_root};
use crab_shim::sys::cgroup::freezer::{testing, CgroupFreezer, CgroupVersion, Freezer};
use crab_shim::sys::cgroup::{cgroup2_dir_of, cgroup2_mount, cgroup_id, cgroup_path_by_id};
use std::os::fd::AsFd;
use support::counter::Counter;

fn exercise(counter: &Counter, f: &CgroupFreezer) {
    assert!(counter.is_counting(), "counts before the freeze");
    let t = Instant::now();
    f.freeze().unwrap();
    eprintln!("{:?} froze in {:?}", f.version(), t.elapsed());
    assert!(!counter.is_counting(), "stopped while frozen");
    // Nested use keeps it frozen until the outermost thaw.
    f.freeze().unwrap();
    f.thaw().unwrap();
    assert!(!counter.is_counting(), "still frozen after a nested thaw");
    f.thaw().unwrap();
    assert!(counter.is_counting(), "counts again after the thaw");
    // Frozen by someone else (a user's pause): left frozen.
    testing::request(f, true).unwrap();
    testing::wait_frozen(f).unwrap();
    f.freeze().unwrap();
    f.thaw().unwrap();
    assert!(
        !counter.is_counting(),
        "a pause from outside survives our thaw"
    );
    testing::request(f, false).unwrap();
    assert!(counter.is_counting());
}

#[test]
fn cgroup_v1_freezer_stops_a_real_process() {
    support::require_root("creates a cgroup and freezes it");
    let root = Path::new("/sys/fs/cgroup/freezer");
    assert!(
        root.join("freezer.state").exists() || root.join("cgroup.procs").exists(),
        "cannot run: no cgroup v1 freezer hierarchy at {}",
        root.display()
    );
    let counter = Counter::start(root, "v1").expect("v1 freezer cgroup");
    let f = CgroupFreezer::for_pid(counter.child.id()).unwrap();
    assert_eq!(
        (f.version(), f.dir()),
        (CgroupVersion::V1, counter.cgroup.as_path())
    );
    exercise(&counter, &f);
}

#[test]
fn cgroup_v2_freezer_stops_a_real_process() {
    support::require_root("creates a cgroup and freezes it");
    let mount = cgroup2_mount().unwrap_or_else(|e| panic!("cannot run: no cgroup2 mount: {e}"));
    let mp = &mount.mount_point;
    let Some(counter) = Counter::start(mp, "v2") else {
        panic!("cannot create a cgroup2 cgroup under {}", mp.display());
    };
    let f = CgroupFreezer::new(counter.cgroup.clone(), CgroupVersion::V2);
    exercise(&counter, &f);
}

#[test]
fn this_process_has_a_cgroup2_directory() {
    support::require_root("resolves cgroup ids (open_by_handle_at)");
    let mount = cgroup2_mount().unwrap();
    let dir = cgroup2_dir_of(std::process::id()).unwrap();
    assert!(dir.starts_with(&mount.mount_point), "{}", dir.display());
    let id = cgroup_id(&dir).unwrap();
    assert_eq!(cgroup_path_by_id(&mount.mount_point, id).unwrap(), dir);
    // v1 directories have inode numbers too, but not cgroup ids.
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if v1.is_dir() {
        assert!(cgroup_id(v1).is_err());
    }
    let e = cgroup_path_by_id(&mount.mount_point, u64::MAX).unwrap_err();
    assert!(
        matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESTALE)),
        "{e}"
    );
}

fn mknod(path: &Path, kind: nix::sys::stat::SFlag, dev: libc::dev_t) {
    nix::sys::stat::mknod(
        path,
        kind,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        dev,
    )
    .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
}

/// A host directory outside the "container" root; `root` is the container's.
struct Scene {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

fn scene() -> Scene {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("app/sub")).unwrap();
    std::fs::write(root.join("app/data"), "container data").unwrap();
    Scene { _dir: dir, root }
}

fn open(s: &Scene, rel: &str) -> io::Result<std::fs::File> {
    let root = open_root(&s.root).unwrap();
    open_regular_beneath(root.as_fd(), Path::new(rel), libc::O_RDONLY)
}

#[test]
fn devices_fifos_and_sockets_are_never_opened() {
    support::require_root("makes a device node");
    let s = scene();
    // A FIFO: an ordinary open for reading would block until a writer came.
    nix::unistd::mkfifo(
        &s.root.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    // A character device: /dev/null's numbers, harmless, so the test is safe to get wrong.
    mknod(
        &s.root.join("chr"),
        nix::sys::stat::SFlag::S_IFCHR,
        libc::makedev(1, 3),
    );
    let _sock = std::os::unix::net::UnixListener::bind(s.root.join("sock")).unwrap();
    let started = Instant::now();
    for rel in ["fifo", "chr", "sock", "app"] {
        let e = open(&s, rel).expect_err(rel);
        assert_eq!(e.raw_os_error(), Some(libc::ENXIO), "{rel}: {e}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "an open blocked"
    );
    assert!(std::fs::symlink_metadata(s.root.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
}
