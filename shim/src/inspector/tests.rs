use super::*;
use std::{
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

use super::{
    bpf::BpfError,
    observe::all_asleep_within,
    scan::{locate_mapping, Mapped},
};
use crate::sys::beneath;

#[test]
fn answer_kind_table() {
    let none: &[String] = &[];
    let lost = &["3 kernel events lost since the mark".to_string()][..];
    #[rustfmt::skip]
        let rows = [
            // (degraded, fs changed, procs changed, kind)
            (none, false, false, Kind::None),
            (none, true, false, Kind::Fs),
            (none, false, true, Kind::Proc),
            (none, true, true, Kind::Full),
            // Degraded: full whatever was found, nothing found included.
            (lost, false, false, Kind::Full),
            (lost, true, false, Kind::Full),
            (lost, false, true, Kind::Full),
            (lost, true, true, Kind::Full),
        ];
    for (degraded, fs, procs, kind) in rows {
        assert_eq!(
            answer_kind(degraded, fs, procs),
            kind,
            "{degraded:?} fs {fs} procs {procs}"
        );
    }
}

#[test]
fn a_sleeping_process_is_asleep_and_a_busy_one_is_not() {
    let mut sleeper = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let mut busy = std::process::Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()
        .unwrap();
    let ms = std::time::Duration::from_millis;
    let asleep = all_asleep_within(sleeper.id(), &mut ms(5000));
    let mut budget = ms(500);
    let busy_asleep = all_asleep_within(busy.id(), &mut budget);
    assert_eq!(budget, ms(0), "a busy process uses up the budget");
    let gone = all_asleep_within(u32::MAX - 1, &mut ms(5));
    // The budget is used up: a second busy process waits no more (one look, not 500 ms; the
    // bound is loose for a busy host).
    let t = Instant::now();
    assert!(!all_asleep_within(busy.id(), &mut budget));
    assert!(t.elapsed() < ms(250), "{:?}", t.elapsed());
    for c in [&mut sleeper, &mut busy] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    assert!(asleep, "sleep(1) never read as asleep");
    assert!(!busy_asleep, "a busy loop read as asleep");
    assert!(!gone, "no such process");
}

#[test]
fn procs_changed_table() {
    let summary = |pid| ProcSummary {
        pid,
        cmdline: "sh".into(),
    };
    let memory = |f: fn(&mut MemoryFinding)| {
        let mut m = MemoryFinding {
            pid: 7,
            scanned_pages: 100,
            ..MemoryFinding::default()
        };
        f(&mut m);
        ProcFinding {
            memory: vec![m],
            ..ProcFinding::default()
        }
    };
    #[rustfmt::skip]
        let rows: Vec<(&str, ProcFinding, bool)> = vec![
            ("nothing", ProcFinding::default(), false),
            ("idle processes only", ProcFinding { idle: vec![1, 2], ..Default::default() }, false),
            ("ran without change", memory(|_| {}), false),
            ("counts alone", ProcFinding { forks: 3, execs: 2, exits: 3, ..Default::default() }, false),
            ("started", ProcFinding { started: vec![summary(9)], ..Default::default() }, true),
            ("ended", ProcFinding { ended: vec![summary(9)], ..Default::default() }, true),
            ("re-exec'd", ProcFinding { reexeced: vec![summary(9)], ..Default::default() }, true),
            ("holds a changed file",
             ProcFinding { held_changed: vec![(9, PathBuf::from("/a"))], ..Default::default() }, true),
            ("kernel state",
             ProcFinding { kernel: [("tmpfs".to_string(), 1)].into(), ..Default::default() }, true),
            ("changed pages", memory(|m| m.changed_pages = 1), true),
            ("added pages", memory(|m| m.added_pages = 1), true),
            ("removed pages", memory(|m| m.removed_pages = 1), true),
            ("kernel-held state", memory(|m| m.state = vec!["cwd".into()]), true),
            ("same memory, unproven base", memory(|m| m.unproven_base = true), true),
            ("changed pages, self-contained",
             memory(|m| { m.changed_pages = 3; m.self_contained = true }), false),
        ];
    for (name, finding, changed) in rows {
        assert_eq!(procs_changed(&finding), changed, "{name}");
    }
}

/// A target over plain directories: a fake cgroup listing this test process, an upperdir.
fn target(dir: &Path) -> Target {
    let cgroup = dir.join("cgroup");
    let upper = dir.join("upper");
    std::fs::create_dir_all(&cgroup).unwrap();
    std::fs::create_dir_all(&upper).unwrap();
    std::fs::write(
        cgroup.join("cgroup.procs"),
        format!("{}\n", std::process::id()),
    )
    .unwrap();
    Target {
        container_id: "c1".into(),
        cgroup2_dir: cgroup,
        upperdir: Some(upper),
        lowerdirs: Vec::new(),
        volumes: Vec::new(),
        overlay_xattrs: fs::OverlayXattrs::Trusted,
        rootfs_dev: None,
        limits: Default::default(),
        keep_self_contained: false,
    }
}

fn no_probes() -> ProbesUnavailable {
    ProbesUnavailable::Bpf(Arc::new(BpfError::Syscall {
        op: "no probes in this test",
        source: std::io::Error::from_raw_os_error(libc::ENOSYS),
    }))
}

#[test]
fn what_the_upperdir_holds_at_start_is_not_a_turn_change() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path());
    // runc made the mount point of a volume the image lacks before the container started.
    std::fs::create_dir(t.upperdir.as_ref().unwrap().join("workspace")).unwrap();
    let upper = t.upperdir.clone().unwrap();
    let mut i = Inspection::new(t, Err(no_probes()));
    i.mark_base();
    let since = i.fs_since_mark().unwrap();
    assert!(since.changed.added.is_empty(), "{:?}", since.changed);
    std::fs::write(upper.join("new"), "x").unwrap();
    let since = i.fs_since_mark().unwrap();
    assert_eq!(since.changed.added, vec![PathBuf::from("/new")]);
}

#[test]
fn without_probes_every_turn_is_full_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let refused = BpfError::Syscall {
        op: "bpf(2)",
        source: std::io::Error::from_raw_os_error(libc::EPERM),
    };
    let mut i = Inspection::new(
        target(dir.path()),
        Err(ProbesUnavailable::Bpf(Arc::new(refused))),
    );
    i.mark_base();
    for _ in 0..2 {
        let a = i.turn_end();
        assert_eq!(a.kind, Kind::Full, "{a:?}");
        assert!(
            a.degraded
                .iter()
                .any(|d| d.contains("eBPF probes unavailable") && d.contains("not permitted")),
            "{a:?}"
        );
        assert!(a.summary().contains("DEGRADED"), "{}", a.summary());
    }
}

fn dev_ino(p: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.dev(), m.ino())
}

/// `locate_mapping` over a directory that is both the process's view and the upperdir (as
/// the merged view and the upper coincide for files written in the container).
#[test]
fn mappings_are_located_by_identity_not_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("app")).unwrap();
    std::fs::create_dir_all(root.join("vol")).unwrap();
    std::fs::write(root.join("app/data"), "x").unwrap();
    std::fs::write(root.join("vol/v"), "x").unwrap();
    std::fs::write(root.join("app/unlinked"), "x").unwrap();
    // Held open, as by the process that maps it (a freed inode number could be reused).
    let _held = std::fs::File::open(root.join("app/unlinked")).unwrap();
    let unlinked = dev_ino(&root.join("app/unlinked"));
    std::fs::remove_file(root.join("app/unlinked")).unwrap();
    nix::unistd::mkfifo(
        &root.join("app/unlinked (deleted)"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    std::os::unix::fs::symlink("app", root.join("link")).unwrap();
    let view = beneath::open_root(&root).unwrap();
    let upper = beneath::open_root(&root).unwrap();
    let vol = beneath::open_root(&root.join("vol")).unwrap();
    let dev = dev_ino(&root).0;
    let tracked = [
        (Path::new("/"), upper.as_fd(), Some(dev)),
        (Path::new("/vol"), vol.as_fd(), Some(dev)),
    ];
    let locate = |path: &str, (d, i): (u64, u64)| {
        locate_mapping(view.as_fd(), Path::new(path), Some(d), i, &tracked)
    };

    let data = dev_ino(&root.join("app/data"));
    assert!(
        matches!(locate("/app/data", data), Mapped::Tracked(_, rel) if rel == Path::new("app/data"))
    );
    // The longest tracked prefix wins: the volume's own root, path relative to it.
    let v = dev_ino(&root.join("vol/v"));
    assert!(
        matches!(locate("/vol/v", v), Mapped::Tracked(fd, rel) if rel == Path::new("v") && fd.as_raw_fd() == vol.as_raw_fd())
    );
    // A name that leads elsewhere (here a FIFO planted at the unlinked file's printed name)
    // on a tracked device: cannot be armed, reported.
    assert!(matches!(
        locate("/app/unlinked (deleted)", unlinked),
        Mapped::Unreachable
    ));
    // A symlink on the way to the right file is not followed: reported too.
    assert!(matches!(locate("/link/data", data), Mapped::Unreachable));
    // A memfd (shmem device 0:1) named after a planted node: not a tracked file at all.
    assert!(matches!(
        locate("/app/unlinked (deleted)", (libc::makedev(0, 1), 3)),
        Mapped::Untracked
    ));
    assert!(matches!(
        locate_mapping(view.as_fd(), Path::new("/app/data"), None, data.1, &tracked),
        Mapped::Untracked
    ));
}

#[test]
fn an_unreadable_upperdir_makes_the_turn_full() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = target(dir.path());
    t.upperdir = Some(dir.path().join("missing"));
    let mut i = Inspection::new(t, Err(no_probes()));
    let a = i.turn_end();
    assert_eq!(a.kind, Kind::Full);
    assert!(
        a.degraded
            .iter()
            .any(|d| d.contains("cannot scan upperdir")),
        "{a:?}"
    );
}
