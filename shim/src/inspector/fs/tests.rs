use super::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::time::Instant;

/// `n` nested directories `d/d/...` under `root`, made with `mkdirat` (the path grows past
/// PATH_MAX), and a file in the deepest.
fn nest(root: &Path, n: usize, name: &str) {
    use nix::sys::stat::{mkdirat, Mode};
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let mut dir = file::open(root, flags).unwrap();
    for _ in 0..n {
        mkdirat(Some(dir.as_raw_fd()), name, Mode::from_bits_truncate(0o755)).unwrap();
        dir = file::openat(dir.as_raw_fd(), name, flags).unwrap();
    }
    nix::fcntl::openat(
        Some(dir.as_raw_fd()),
        "leaf",
        OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .map(|fd| nix::unistd::close(fd).unwrap())
    .unwrap();
}

fn limits(max_entries: u64, max_path_bytes: u64, max_depth: u32) -> ScanLimits {
    ScanLimits {
        max_entries,
        max_path_bytes,
        max_depth,
    }
}

/// A tree far deeper than any stack or fd table would allow: the walk stops at the bound
/// with a clear error; within it every entry is there.
#[test]
fn walk_is_iterative_and_depth_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    nest(tmp.path(), 3000, &"x".repeat(200));
    let t = Instant::now();
    let e = TreeManifest::scan(tmp.path()).unwrap_err();
    assert!(
        matches!(
            &e,
            FsError::Limit {
                key: "max_walk_depth",
                limit: 256,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("[limits] max_walk_depth"), "{e}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    // As deep as the config allows: no stack overflow; the whole paths of 3000 levels of
    // 200-byte names (about 900 MB) are what the path bound is for.
    let e = TreeManifest::scan_with(
        tmp.path(),
        &limits(u64::MAX, 64 << 20, 4096),
        OverlayXattrs::Trusted,
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            FsError::Limit {
                key: "max_manifest_path_bytes",
                ..
            }
        ),
        "{e}"
    );

    let tmp = tempfile::tempdir().unwrap();
    nest(tmp.path(), 10, "d");
    let m = TreeManifest::scan_with(
        tmp.path(),
        &limits(100, 1 << 20, 10),
        OverlayXattrs::Trusted,
    )
    .unwrap();
    assert_eq!(m.len(), 1 + 10 + 1);
    assert!(m.get(Path::new("d/d/d/d/d/d/d/d/d/d/leaf")).is_some());
    let e = TreeManifest::scan_with(tmp.path(), &limits(100, 1 << 20, 9), OverlayXattrs::Trusted)
        .unwrap_err();
    assert!(
        matches!(
            &e,
            FsError::Limit {
                key: "max_walk_depth",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn manifest_entries_and_path_bytes_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    for i in 0..50 {
        fs::write(tmp.path().join(format!("file-{i:03}")), b"").unwrap();
    }
    fs::create_dir(tmp.path().join("sub")).unwrap();
    for i in 0..50 {
        fs::write(tmp.path().join(format!("sub/{i}")), b"").unwrap();
    }
    let ok = TreeManifest::scan_with(tmp.path(), &limits(102, 1 << 20, 8), OverlayXattrs::Trusted)
        .unwrap();
    assert_eq!(ok.len(), 102);
    for max in [101, 60, 10, 1] {
        let e =
            TreeManifest::scan_with(tmp.path(), &limits(max, 1 << 20, 8), OverlayXattrs::Trusted)
                .unwrap_err();
        assert!(
            matches!(
                &e,
                FsError::Limit {
                    key: "max_manifest_entries",
                    ..
                }
            ),
            "{max}: {e}"
        );
    }
    // 50 * 8 bytes + "sub" + 50 * ("sub/" + 1..2 digits) = 400 + 3 + 290.
    let bytes: u64 = ok.iter().map(|(p, _)| p.as_os_str().len() as u64).sum();
    assert_eq!(bytes, 693);
    TreeManifest::scan_with(tmp.path(), &limits(1000, bytes, 8), OverlayXattrs::Trusted).unwrap();
    let e = TreeManifest::scan_with(
        tmp.path(),
        &limits(1000, bytes - 1, 8),
        OverlayXattrs::Trusted,
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            FsError::Limit {
                key: "max_manifest_path_bytes",
                ..
            }
        ),
        "{e}"
    );
}

fn paths(v: &[&str]) -> Vec<PathBuf> {
    v.iter().map(PathBuf::from).collect()
}

#[track_caller]
fn assert_diff(d: &FsDiff, added: &[&str], modified: &[&str], deleted: &[&str]) {
    let want = FsDiff {
        added: paths(added),
        modified: paths(modified),
        deleted: paths(deleted),
    };
    assert_eq!(d, &want);
}

#[test]
fn tracked_volume_without_lowers() {
    let tmp = tempfile::tempdir().unwrap();
    let vol = tmp.path();
    fs::set_permissions(vol, fs::Permissions::from_mode(0o755)).unwrap();
    let m0 = TreeManifest::scan(vol).unwrap();
    assert!(diff(&TreeManifest::default(), &m0, &[]).is_empty());
    fs::create_dir(vol.join("d")).unwrap();
    fs::write(vol.join("d/f"), "f").unwrap();
    fs::write(vol.join("t"), "t").unwrap();
    fs::remove_file(vol.join("t")).unwrap();
    let m1 = TreeManifest::scan(vol).unwrap();
    assert_diff(&diff(&m0, &m1, &[]), &["/d", "/d/f"], &[], &[]);
    fs::set_permissions(vol, fs::Permissions::from_mode(0o711)).unwrap();
    fs::write(vol.join("d/f"), "g").unwrap();
    let m2 = TreeManifest::scan(vol).unwrap();
    assert_diff(&diff(&m1, &m2, &[]), &[], &["/", "/d/f"], &[]);
}

#[test]
fn scan_is_in_path_order() {
    let tmp = tempfile::tempdir().unwrap();
    for d in ["a/b", "a.txt/c", "a-b", "A", "b/a/a"] {
        fs::create_dir_all(tmp.path().join(d)).unwrap();
    }
    for f in ["a/z", "a/b.x", "a.txt/0", "\u{e9}", "b/a.x"] {
        fs::write(tmp.path().join(f), "").unwrap();
    }
    let m = TreeManifest::scan(tmp.path()).unwrap();
    assert_eq!(m.len(), 15);
    assert!(
        m.entries.windows(2).all(|w| w[0].0 < w[1].0),
        "{:?}",
        m.entries
    );
    assert_eq!(m.get(Path::new("a.txt/0")).unwrap().kind, EntryKind::File);
    assert_eq!(m.get(Path::new("")).unwrap().kind, EntryKind::Dir);
    assert!(m.get(Path::new("a/c")).is_none());
}

#[test]
fn escaping_is_reversible() {
    for raw in [
        &b""[..],
        b"plain/path",
        b"100%",
        b"%41",
        b"\xff\xfe/\xc3\xa9t\xc3",
        "é/ü".as_bytes(),
    ] {
        assert_eq!(unescape_bytes(&escape_bytes(raw)).unwrap(), raw);
    }
    assert!(unescape_bytes("%4").is_err());
    assert!(unescape_bytes("%zz").is_err());
}

#[test]
fn overlay_dirs_parses_containerd_options() {
    let o = |v: &[&str]| overlay_dirs(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    let root = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots";
    assert_eq!(
        o(&[
            "index=off",
            &format!("workdir={root}/9/work"),
            &format!("upperdir={root}/9/fs"),
            &format!("lowerdir={root}/3/fs:{root}/1/fs"),
        ]),
        Some((
            PathBuf::from(format!("{root}/9/fs")),
            paths(&[&format!("{root}/3/fs"), &format!("{root}/1/fs")])
        ))
    );
    // Compacted by containerd's mount code: relative to the snapshots directory.
    assert_eq!(
        o(&[&format!("upperdir={root}/9/fs"), "lowerdir=3/fs:1/fs"]),
        Some((
            PathBuf::from(format!("{root}/9/fs")),
            paths(&[&format!("{root}/3/fs"), &format!("{root}/1/fs")])
        ))
    );
    assert_eq!(o(&["upperdir=9/fs", "lowerdir=3/fs"]), None);
    // Escapes, data-only layers, lowerdir+.
    assert_eq!(
        o(&["upperdir=/u", r"lowerdir=/a\:b:/c::/data1::/data2"]),
        Some((PathBuf::from("/u"), paths(&["/a:b", "/c"])))
    );
    assert_eq!(
        o(&[
            "upperdir=/u",
            "lowerdir+=/l1",
            "lowerdir+=/l2",
            "datadir+=/d"
        ]),
        Some((PathBuf::from("/u"), paths(&["/l1", "/l2"])))
    );
    // A read-only rootfs (no upperdir) has nothing to track.
    assert_eq!(o(&["lowerdir=/a:/b"]), None);
}
