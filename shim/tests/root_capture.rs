//! Filesystem layers captured from real overlays: what a layer holds, how it applies
//! (GNU tar, Go's archive/tar, umoci), sparse files, bounds, xattrs, freezing and failures.
//! Needs root and overlayfs; fails without (see `support`).

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{self, Write as _},
    os::unix::{
        ffi::OsStrExt,
        fs::{symlink, MetadataExt, PermissionsExt},
    },
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use crab_shim::checkpoint::layer::{
    write_fs_layer, write_fs_layer_with, write_tree_tar, FsDiffPaths, LayerError, LayerOptions,
};
use crab_shim::checkpoint::store::{Descriptor, Store};
use crab_shim::checkpoint::testing::recorded_xattrs;
use crab_shim::inspector::fs::{diff, EntryKind, FsDiff, OverlayXattrs, TreeManifest};
use crab_shim::sys::cgroup::freezer::Freezer;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use sha2::{Digest, Sha256};
use support::files::{files_under, noise};
use support::tar::{names, parse_tar, TarItem};
use support::Tmpfs;

/// A real overlay in a temp dir: lower/upper/work/merged.
struct Overlay {
    lower: PathBuf,
    upper: PathBuf,
    merged: PathBuf,
    _dir: tempfile::TempDir,
}

impl Overlay {
    fn new(populate: impl FnOnce(&Path)) -> Overlay {
        support::require_root("mounts an overlay");
        support::require_filesystem("overlay");
        let dir = tempfile::tempdir().unwrap();
        let [lower, upper, work, merged] =
            ["lower", "upper", "work", "merged"].map(|n| dir.path().join(n));
        for d in [&lower, &upper, &work, &merged] {
            fs::create_dir(d).unwrap();
        }
        populate(&lower);
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        mount(
            Some("overlay"),
            &merged,
            Some("overlay"),
            MsFlags::empty(),
            Some(opts.as_str()),
        )
        .unwrap_or_else(|e| panic!("mount overlay: {e} (tests run as root)"));
        Overlay {
            lower,
            upper,
            merged,
            _dir: dir,
        }
    }

    fn m(&self, p: &str) -> PathBuf {
        self.merged.join(p)
    }

    fn scan(&self) -> TreeManifest {
        TreeManifest::scan(&self.upper).unwrap()
    }

    fn diff(&self, prev: &TreeManifest) -> (TreeManifest, FsDiff) {
        let now = self.scan();
        let d = diff(prev, &now, std::slice::from_ref(&self.lower));
        (now, d)
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        let _ = umount2(&self.merged, MntFlags::MNT_DETACH);
    }
}

#[derive(Default)]
struct CountingFreezer {
    freezes: AtomicU32,
    thaws: AtomicU32,
    fail: bool,
}

impl Freezer for CountingFreezer {
    fn freeze(&self) -> io::Result<()> {
        if self.fail {
            return Err(io::Error::other("refused"));
        }
        self.freezes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn thaw(&self) -> io::Result<()> {
        self.thaws.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl CountingFreezer {
    fn counts(&self) -> (u32, u32) {
        (
            self.freezes.load(Ordering::SeqCst),
            self.thaws.load(Ordering::SeqCst),
        )
    }
}

fn write(p: &Path, data: &[u8], mode: u32) {
    if let Some(parent) = p.parent() {
        fs::create_dir_all(parent).unwrap();
    }
    fs::write(p, data).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    support::lsetxattr(p, name, value);
}

fn lxattrs(p: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    recorded_xattrs(p, OverlayXattrs::Trusted).unwrap()
}

fn mknod(p: &Path, kind: libc::mode_t, mode: u32, dev: libc::dev_t) {
    use nix::sys::stat::{Mode, SFlag};
    nix::sys::stat::mknod(
        p,
        SFlag::from_bits_truncate(kind),
        Mode::from_bits_truncate(mode),
        dev,
    )
    .unwrap_or_else(|e| panic!("mknod {}: {e}", p.display()));
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

/// CAP_NET_BIND_SERVICE, effective (vfs_cap_data revision 2).
fn capability() -> Vec<u8> {
    [0x0200_0001u32, 1 << 10, 0, 0, 0]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

/// Reads a stored layer back (checking its digests) with an independent tar parser:
/// name -> item, in archive order.
fn read_layer(store: &Store, d: &Descriptor) -> Vec<(String, TarItem)> {
    let blob = fs::read(store.blob_path(&d.digest)).unwrap();
    assert_eq!(d.digest, format!("sha256:{:x}", Sha256::digest(&blob)));
    assert_eq!(d.size, blob.len() as u64);
    assert_eq!(d.media_type, "application/vnd.oci.image.layer.v1.tar+zstd");
    let tar = zstd::decode_all(&blob[..]).unwrap();
    assert_eq!(d.diff_id, format!("sha256:{:x}", Sha256::digest(&tar)));
    parse_tar(&tar)
}

fn item<'a>(items: &'a [(String, TarItem)], name: &str) -> &'a TarItem {
    &items
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} not in the layer: {:?}", names(items)))
        .1
}

/// A tar item agrees with what the merged view shows at `p`.
fn assert_matches_merged(items: &[(String, TarItem)], name: &str, p: &Path) {
    let it = item(items, name);
    let md = fs::symlink_metadata(p).unwrap();
    assert_eq!(it.mode, md.mode() & 0o7777, "{name} mode");
    assert_eq!(
        (it.uid, it.gid),
        (u64::from(md.uid()), u64::from(md.gid())),
        "{name} owner"
    );
    if it.kind != b'1' {
        let nsec = md.mtime_nsec();
        let want = if nsec == 0 {
            md.mtime().to_string()
        } else {
            format!("{}.{:09}", md.mtime(), nsec)
        };
        assert_eq!(it.mtime, want, "{name} mtime");
        assert_eq!(it.xattrs, lxattrs(p), "{name} xattrs");
    }
    match it.kind {
        b'0' => assert_eq!(it.data, fs::read(p).unwrap(), "{name} content"),
        b'2' => assert_eq!(
            it.link.as_deref(),
            Some(fs::read_link(p).unwrap().as_os_str().as_bytes()),
            "{name} target"
        ),
        b'3' | b'4' => assert_eq!(
            it.dev,
            Some((libc::major(md.rdev()), libc::minor(md.rdev()))),
            "{name} device"
        ),
        _ => {}
    }
}

const LONG_DIR: &str = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd";
const LONG_FILE: &str =
    "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff";

fn deep_path() -> String {
    format!(
        "deep/{}/{}/{}/file",
        "a".repeat(100),
        "b".repeat(100),
        "c".repeat(100)
    )
}

fn populate_lower(l: &Path) {
    write(&l.join("etc/a"), b"A\n", 0o644);
    write(&l.join("etc/b"), b"B\n", 0o644);
    write(&l.join("bin/tool"), b"#!/bin/sh\n", 0o755);
    write(&l.join("data/dir/x"), b"x", 0o644);
    write(&l.join("data/dir/y"), b"y", 0o644);
    write(&l.join("data/keep"), b"keep", 0o644);
    write(&l.join("gone/g1"), b"g1", 0o644);
    write(&l.join("gone/sub/g2"), b"g2", 0o644);
    write(&l.join("keep/k"), b"k", 0o600);
    std::os::unix::fs::chown(l.join("keep/k"), Some(1000), Some(1000)).unwrap();
}

/// Round one of changes, all through the merged view.
fn change_round_one(o: &Overlay) {
    write(&o.m("new.txt"), b"hello\n", 0o640);
    setxattr(&o.m("new.txt"), "user.test", b"v1");
    fs::OpenOptions::new()
        .append(true)
        .open(o.m("etc/a"))
        .unwrap()
        .write_all(b"more\n")
        .unwrap();
    fs::set_permissions(o.m("bin/tool"), fs::Permissions::from_mode(0o700)).unwrap();
    setxattr(&o.m("bin/tool"), "security.capability", &capability());
    symlink("etc/a", o.m("link")).unwrap();
    fs::hard_link(o.m("new.txt"), o.m("hard.txt")).unwrap();
    write(&o.m("p/q/r/f"), b"f", 0o644);
    fs::remove_file(o.m("etc/b")).unwrap();
    fs::remove_dir_all(o.m("data/dir")).unwrap();
    fs::create_dir(o.m("data/dir")).unwrap();
    write(&o.m("data/dir/z"), b"z", 0o644);
    fs::remove_dir_all(o.m("gone")).unwrap();
    mknod(&o.m("mydev"), libc::S_IFCHR, 0o600, libc::makedev(1, 3));
    mknod(&o.m("myfifo"), libc::S_IFIFO, 0o644, 0);
    fs::create_dir(o.m("emptydir")).unwrap();
    fs::set_permissions(o.m("emptydir"), fs::Permissions::from_mode(0o751)).unwrap();
    write(
        &o.m(&format!("long/{LONG_DIR}/{LONG_FILE}")),
        b"long",
        0o644,
    );
    write(&o.m(&deep_path()), b"deep", 0o644);
    write(&o.m("bigid"), b"big owner", 0o644);
    std::os::unix::fs::chown(o.m("bigid"), Some(3_000_000), Some(3_000_001)).unwrap();
}

#[test]
fn layer_holds_exactly_the_net_change() {
    let o = Overlay::new(populate_lower);
    let base = o.scan();
    change_round_one(&o);
    let (_, d) = o.diff(&base);
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let freezer = CountingFreezer::default();
    let (desc, stats) = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &freezer).unwrap();
    assert_eq!(freezer.counts(), (1, 1));
    let items = read_layer(&store, &desc);

    let deep = deep_path();
    let deep_dirs: Vec<String> = (1..4)
        .map(|n| deep.split('/').take(n + 1).collect::<Vec<_>>().join("/") + "/")
        .collect();
    let long_dir = format!("long/{LONG_DIR}/");
    let long_file = format!("long/{LONG_DIR}/{LONG_FILE}");
    // Every directory above a change has its own entry (bin/, data/, etc/: their modes and
    // owners travel with the layer, as in `docker commit`'s layers).
    let mut expect: Vec<&str> = vec![
        ".wh.gone",
        "bigid",
        "bin/",
        "bin/tool",
        "data/",
        "data/dir/",
        "data/dir/.wh..wh..opq",
        "data/dir/z",
        "deep/",
        &deep_dirs[0],
        &deep_dirs[1],
        &deep_dirs[2],
        &deep,
        "emptydir/",
        "etc/",
        "etc/.wh.b",
        "etc/a",
        "hard.txt",
        "link",
        "long/",
        &long_dir,
        &long_file,
        "mydev",
        "myfifo",
        "new.txt",
        "p/",
        "p/q/",
        "p/q/r/",
        "p/q/r/f",
    ];
    let mut got = names(&items);
    got.sort();
    expect.sort();
    assert_eq!(got, expect, "diff was {d:?}");
    assert_eq!(stats.entries, items.len() as u64);

    // Contents, modes, owners, mtimes and xattrs are the merged view's.
    for (name, it) in &items {
        if it.kind == b'0'
            && it.data.is_empty()
            && name.rsplit('/').next().unwrap().starts_with(".wh.")
        {
            assert_eq!((it.mode, it.uid, it.gid), (0, 0, 0), "{name}");
            continue;
        }
        let rel = name.trim_end_matches('/');
        assert_matches_merged(&items, name, &o.merged.join(rel));
    }
    assert_eq!(item(&items, "etc/a").data, b"A\nmore\n");
    assert_eq!(item(&items, "bin/tool").mode, 0o700);
    assert_eq!(
        item(&items, "bin/tool").xattrs,
        vec![(b"security.capability".to_vec(), capability())]
    );
    assert_eq!(
        item(&items, "hard.txt").xattrs,
        vec![(b"user.test".to_vec(), b"v1".to_vec())]
    );
    assert_eq!(item(&items, "link").link.as_deref(), Some(&b"etc/a"[..]));
    let nt = item(&items, "new.txt");
    assert_eq!(
        (nt.kind, nt.link.as_deref()),
        (b'1', Some(&b"hard.txt"[..])),
        "a hardlink to the first name"
    );
    assert_eq!(item(&items, "mydev").dev, Some((1, 3)));
    assert_eq!(item(&items, "myfifo").kind, b'6');
    assert_eq!(item(&items, "emptydir/").mode, 0o751);
    assert_eq!(
        (item(&items, "bigid").uid, item(&items, "bigid").gid),
        (3_000_000, 3_000_001)
    );
    assert_eq!(item(&items, &deep).data, b"deep");
    // The opaque marker comes right after its directory, before the directory's content.
    let pos = |n: &str| names(&items).iter().position(|x| *x == n).unwrap();
    assert_eq!(pos("data/dir/.wh..wh..opq"), pos("data/dir/") + 1);
    assert!(pos("hard.txt") < pos("new.txt"));
    // Nothing left behind but the blob.
    assert_eq!(
        files_under(store_dir.path()),
        vec![
            PathBuf::from(".lock"),
            Path::new("blobs/sha256").join(desc.hex())
        ]
    );
}

#[test]
fn symlinks_in_the_upperdir_are_never_followed() {
    let host = tempfile::tempdir().unwrap();
    write(&host.path().join("secret.txt"), b"SECRET", 0o600);
    let o = Overlay::new(|l| write(&l.join("etc/passwd"), b"root", 0o644));
    let base = o.scan();
    symlink(host.path(), o.m("esc")).unwrap();
    symlink(host.path().join("secret.txt"), o.m("esc-file")).unwrap();
    let (_, d) = o.diff(&base);
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    // A stale diff that still thinks /esc is a directory with content.
    let stale = [PathBuf::from("/esc/secret.txt"), PathBuf::from("/esc-file")];
    for paths in [
        FsDiffPaths::from(&d),
        FsDiffPaths {
            added: &stale,
            modified: &[],
            deleted: &[],
        },
    ] {
        let (desc, _) =
            write_fs_layer(&store, &o.upper, &paths, &CountingFreezer::default()).unwrap();
        let items = read_layer(&store, &desc);
        assert!(
            items.iter().all(|(_, it)| it.data != b"SECRET"),
            "{items:?}"
        );
        assert!(
            items.iter().all(|(n, _)| !n.starts_with("esc/")),
            "{:?}",
            names(&items)
        );
        assert_eq!(item(&items, "esc-file").kind, b'2');
    }
}

#[test]
fn capture_errors_thaw_and_leave_nothing() {
    let o = Overlay::new(|l| write(&l.join("big"), &[7u8; 100_000], 0o644));
    let base = o.scan();
    fs::set_permissions(o.m("big"), fs::Permissions::from_mode(0o600)).unwrap();
    let (_, d) = o.diff(&base);
    // overlayfs metacopy: the upper file has metadata only, its data is below.
    setxattr(&o.upper.join("big"), "trusted.overlay.metacopy", b"");
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let freezer = CountingFreezer::default();
    let e = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &freezer).unwrap_err();
    assert!(matches!(e, LayerError::Unsupported { .. }), "{e}");
    assert_eq!(freezer.counts(), (1, 1), "thawed after the failed capture");
    assert_eq!(files_under(store_dir.path()), vec![PathBuf::from(".lock")]);

    let refusing = CountingFreezer {
        fail: true,
        ..Default::default()
    };
    let e = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &refusing).unwrap_err();
    assert!(matches!(e, LayerError::Freeze(_)), "{e}");
    assert_eq!(files_under(store_dir.path()), vec![PathBuf::from(".lock")]);

    let bad = [PathBuf::from("/a/../../etc")];
    let e = write_fs_layer(
        &store,
        &o.upper,
        &FsDiffPaths {
            added: &bad,
            modified: &[],
            deleted: &[],
        },
        &freezer,
    )
    .unwrap_err();
    assert!(matches!(e, LayerError::InvalidPath(_)), "{e}");
}

#[test]
fn full_store_gives_a_clear_error_and_no_partial_blob() {
    let o = Overlay::new(|_| {});
    let base = o.scan();
    let root = tempfile::tempdir().unwrap();
    let store_root = root.path().join("store");
    let _tmpfs = Tmpfs::mount(&store_root, "64k");
    let store = Store::open(&store_root).unwrap();
    let free = || {
        nix::sys::statvfs::statvfs(&store_root)
            .unwrap()
            .blocks_available()
    };
    let empty = free();
    // An unlinked temp file's space returns only once every fd of it is closed, and a process
    // that another test forks meanwhile (without exec) holds copies of this process's fds: each
    // case needs the tmpfs empty again (seen under load: the last one found it still full).
    let emptied = || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while free() < empty && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    // 1 MB does not fit the temporary tar; 40 KB fits the tar but not tar + blob.
    for (size, stage) in [(1 << 20, "layer.tar-"), (40 << 10, "layer.tar.zst-")] {
        emptied();
        write(&o.m("f"), &noise(size, size as u64), 0o644);
        let (_, d) = o.diff(&base);
        let freezer = CountingFreezer::default();
        let e = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &freezer).unwrap_err();
        assert!(e.is_no_space(), "{size}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("no space left on device") && msg.contains(stage),
            "{size}: {msg}"
        );
        assert_eq!(freezer.counts(), (1, 1), "thawed");
        assert_eq!(
            files_under(&store_root),
            vec![PathBuf::from(".lock")],
            "{size}: nothing partial"
        );
        assert!(store.list().unwrap().is_empty());
    }
    // Small changes still fit.
    emptied();
    write(&o.m("f"), b"small", 0o644);
    let (_, d) = o.diff(&base);
    let (desc, _) = write_fs_layer(
        &store,
        &o.upper,
        &FsDiffPaths::from(&d),
        &CountingFreezer::default(),
    )
    .unwrap();
    assert_eq!(item(&read_layer(&store, &desc), "f").data, b"small");
}

// ---- applying the layers with an independent implementation (umoci) ----

#[derive(Debug, PartialEq)]
struct Node {
    kind: u32,
    mode: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    data: Vec<u8>,
    link: Option<PathBuf>,
    mtime: Option<(i64, i64)>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Everything under `root` but `root` itself (directory mtimes are not state).
fn tree(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let md = fs::symlink_metadata(&p).unwrap();
            let kind = md.mode() & libc::S_IFMT;
            if kind == libc::S_IFDIR {
                stack.push(p.clone());
            }
            let node = Node {
                kind,
                mode: md.mode() & 0o7777,
                uid: md.uid(),
                gid: md.gid(),
                rdev: md.rdev(),
                data: if kind == libc::S_IFREG {
                    fs::read(&p).unwrap()
                } else {
                    Vec::new()
                },
                link: (kind == libc::S_IFLNK).then(|| fs::read_link(&p).unwrap()),
                mtime: (kind != libc::S_IFDIR).then(|| (md.mtime(), md.mtime_nsec())),
                xattrs: lxattrs(&p)
                    .into_iter()
                    .filter(|(n, _)| !n.starts_with(b"security.selinux"))
                    .collect(),
            };
            out.insert(p.strip_prefix(root).unwrap().to_path_buf(), node);
        }
    }
    out
}

fn sha256_hex(b: &[u8]) -> String {
    format!("{:x}", Sha256::digest(b))
}

/// An OCI image layout holding uncompressed `layers` (umoci 0.4 reads no zstd), unpacked
/// by umoci into `<dir>/bundle/rootfs`.
fn umoci_unpack(dir: &Path, layers: &[Vec<u8>]) -> PathBuf {
    let layout = dir.join("layout");
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |b: &[u8]| {
        let h = sha256_hex(b);
        fs::write(blobs.join(&h), b).unwrap();
        (format!("sha256:{h}"), b.len())
    };
    let mut descs = Vec::new();
    for l in layers {
        let (digest, size) = put(l);
        descs.push(serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size}));
    }
    let diff_ids: Vec<_> = descs.iter().map(|d| d["digest"].clone()).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let (cdigest, csize) = put(&config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest, "size": csize},
        "layers": descs,
    }))
    .unwrap();
    let (mdigest, msize) = put(&manifest);
    fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest, "size": msize,
                           "annotations": {"org.opencontainers.image.ref.name": "test"}}],
        }))
        .unwrap(),
    )
    .unwrap();
    let bundle = dir.join("bundle");
    let out = Command::new("umoci")
        .arg("unpack")
        .arg("--image")
        .arg(format!("{}:test", layout.display()))
        .arg(&bundle)
        .output()
        .expect("umoci (installed by hack/install-deps.sh)");
    assert!(
        out.status.success(),
        "umoci unpack: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bundle.join("rootfs")
}

fn base_layer(lower: &Path) -> Vec<u8> {
    let out = Command::new("tar")
        .args([
            "--format=posix",
            "--pax-option=delete=atime,delete=ctime",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "-C",
        ])
        .arg(lower)
        .args(["-cf", "-", "."])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tar: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn plain_tar(store: &Store, d: &Descriptor) -> Vec<u8> {
    zstd::decode_all(&fs::read(store.blob_path(&d.digest)).unwrap()[..]).unwrap()
}

/// base image + layer 1 + layer 2 applied by umoci == the merged view, after each turn.
#[test]
fn layer_chain_applies_to_the_merged_view() {
    let o = Overlay::new(populate_lower);
    let base = base_layer(&o.lower);
    let m0 = o.scan();
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let freezer = CountingFreezer::default();

    change_round_one(&o);
    let (m1, d1) = o.diff(&m0);
    let (l1, _) = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d1), &freezer).unwrap();
    let work = tempfile::tempdir().unwrap();
    let rootfs = umoci_unpack(
        &work.path().join("one"),
        &[base.clone(), plain_tar(&store, &l1)],
    );
    assert_eq!(tree(&rootfs), tree(&o.merged), "after layer 1");
    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    assert_eq!(
        ino(&rootfs.join("new.txt")),
        ino(&rootfs.join("hard.txt")),
        "hardlink kept"
    );

    // Turn two: undo some of turn one, touch the opaque directory again, revive a deleted path.
    fs::remove_file(o.m("new.txt")).unwrap();
    fs::set_permissions(o.m("data/dir"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::remove_dir_all(o.m("p")).unwrap();
    write(&o.m("etc/b"), b"B2\n", 0o644);
    fs::rename(o.m("etc/a"), o.m("etc/a2")).unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(o.m(&format!("long/{LONG_DIR}/{LONG_FILE}")))
        .unwrap()
        .write_all(b"er")
        .unwrap();
    write(&o.m("keep/k2"), b"k2", 0o644);
    let (_, d2) = o.diff(&m1);
    let (l2, _) = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d2), &freezer).unwrap();
    let items = read_layer(&store, &l2);
    let mut got = names(&items);
    got.sort();
    let long_file = format!("long/{LONG_DIR}/{LONG_FILE}");
    let long_dir = format!("long/{LONG_DIR}/");
    let mut expect = vec![
        ".wh.new.txt",
        ".wh.p",
        "data/",
        "data/dir/",
        "data/dir/.wh..wh..opq",
        "data/dir/z",
        "etc/",
        "etc/.wh.a",
        "etc/a2",
        "etc/b",
        "hard.txt",
        "keep/",
        "keep/k2",
        "long/",
        &long_dir,
        &long_file,
    ];
    expect.sort();
    assert_eq!(got, expect, "diff was {d2:?}");
    let rootfs = umoci_unpack(
        &work.path().join("two"),
        &[base, plain_tar(&store, &l1), plain_tar(&store, &l2)],
    );
    assert_eq!(tree(&rootfs), tree(&o.merged), "after layer 2");
    assert_eq!(freezer.counts(), (2, 2));
}

// ---- bounds: sparse files, the layer's size, depth, overlay xattrs ----

/// A file of `size` bytes with `chunks` written at their offsets, holes elsewhere.
fn sparse(p: &Path, size: u64, chunks: &[(u64, &[u8])]) {
    use std::os::unix::fs::FileExt;
    let f = fs::File::create(p).unwrap();
    f.set_len(size).unwrap();
    for (off, data) in chunks {
        f.write_all_at(data, *off).unwrap();
    }
    f.sync_all().unwrap();
}

/// Extracts a plain tar with GNU tar (which restores holes) into `dir`.
fn gnu_extract(tar: &[u8], dir: &Path) {
    fs::write(dir.join("layer.tar"), tar).unwrap();
    fs::create_dir(dir.join("x")).unwrap();
    let out = Command::new("tar")
        .args(["--numeric-owner", "-xf"])
        .arg(dir.join("layer.tar"))
        .arg("-C")
        .arg(dir.join("x"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fs::remove_file(dir.join("layer.tar")).unwrap();
}

fn read_at(p: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    fs::File::open(p)
        .unwrap()
        .read_exact_at(&mut buf, off)
        .unwrap();
    buf
}

/// `truncate -s 1T` plus a few bytes: the layer holds the bytes, not the terabyte, and GNU
/// tar gives back a file of the same size, data and holes (under an apparent-size bound that
/// lets a terabyte through: the default, 64 GiB, does not).
#[test]
fn sparse_files_are_stored_with_their_holes() {
    const TB: u64 = 1 << 40;
    let o = Overlay::new(|l| write(&l.join("keep"), b"k", 0o644));
    let base = o.scan();
    let chunks: [(u64, &[u8]); 3] = [
        (0, b"head"),
        (300 << 30, b"in the middle"),
        (TB - 4, b"tail"),
    ];
    sparse(&o.m("big"), TB, &chunks);
    sparse(&o.m("hole-at-end"), 10 << 20, &[(0, &[7u8; 8192])]);
    sparse(&o.m("all-hole"), 5 << 30, &[]);
    write(&o.m("dense"), &noise(100_000, 3), 0o600);
    let (_, d) = o.diff(&base);
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let t = Instant::now();
    let opts = LayerOptions {
        max_apparent_bytes: 2 << 40,
        ..LayerOptions::default()
    };
    let (desc, stats) = write_fs_layer_with(
        &store,
        &o.upper,
        &FsDiffPaths::from(&d),
        &CountingFreezer::default(),
        &opts,
    )
    .unwrap();
    eprintln!(
        "1 TB sparse file: layer in {:?}, {} tar bytes, {} stored",
        t.elapsed(),
        stats.bytes,
        desc.size
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(stats.bytes < 1 << 20, "{stats:?}");
    let tar = plain_tar(&store, &desc);
    let dir = tempfile::tempdir().unwrap();
    gnu_extract(&tar, dir.path());
    let x = dir.path().join("x");
    let big = fs::metadata(x.join("big")).unwrap();
    assert_eq!(big.len(), TB);
    assert!(
        big.blocks() * 512 < 1 << 20,
        "extracted sparse: {} blocks",
        big.blocks()
    );
    for (off, data) in chunks {
        assert_eq!(read_at(&x.join("big"), off, data.len()), data);
    }
    assert_eq!(read_at(&x.join("big"), 1 << 30, 4), [0u8; 4]);
    assert_eq!(fs::metadata(x.join("hole-at-end")).unwrap().len(), 10 << 20);
    assert_eq!(read_at(&x.join("hole-at-end"), 0, 8192), vec![7u8; 8192]);
    assert_eq!(read_at(&x.join("hole-at-end"), (10 << 20) - 1, 1), [0]);
    assert_eq!(fs::metadata(x.join("all-hole")).unwrap().len(), 5 << 30);
    assert_eq!(fs::read(x.join("dense")).unwrap(), noise(100_000, 3));
    // Modes survive the sparse form too.
    assert_eq!(
        fs::metadata(x.join("big")).unwrap().mode() & 0o7777,
        fs::metadata(o.m("big")).unwrap().mode() & 0o7777
    );
}

/// Go's archive/tar (umoci's unpacker, like containerd's differ) reads the sparse entries:
/// same size and bytes as the merged view.
#[test]
fn sparse_layer_applies_with_go_archive_tar() {
    let o = Overlay::new(populate_lower);
    let base = o.scan();
    sparse(
        &o.m("s"),
        64 << 20,
        &[(1 << 20, b"one"), ((40 << 20) + 5, &noise(9000, 1))],
    );
    sparse(&o.m("z"), 3 << 20, &[]);
    let (_, d) = o.diff(&base);
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let (desc, _) = write_fs_layer(
        &store,
        &o.upper,
        &FsDiffPaths::from(&d),
        &CountingFreezer::default(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rootfs = umoci_unpack(
        dir.path(),
        &[base_layer(&o.lower), plain_tar(&store, &desc)],
    );
    for name in ["s", "z"] {
        assert_eq!(
            fs::read(rootfs.join(name)).unwrap(),
            fs::read(o.m(name)).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn layer_over_its_byte_bound_fails_before_copying_and_thaws() {
    let o = Overlay::new(|l| write(&l.join("keep"), b"k", 0o644));
    let base = o.scan();
    write(&o.m("a"), &noise(600 << 10, 1), 0o644);
    write(&o.m("b"), &noise(600 << 10, 2), 0o644);
    // Holes are free: a 1 TB sparse file fits in a 1 MiB bound.
    sparse(&o.m("c"), 1 << 40, &[(5, b"x")]);
    let (_, d) = o.diff(&base);
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let freezer = CountingFreezer::default();
    let opts = LayerOptions {
        max_bytes: 1 << 20,
        max_apparent_bytes: 2 << 40,
        ..LayerOptions::default()
    };
    let e =
        write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &opts).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            LayerError::Limit {
                key: "max_layer_bytes",
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("[limits] max_layer_bytes") && msg.contains("1048576"),
        "{msg}"
    );
    assert_eq!(freezer.counts(), (1, 1));
    assert!(
        files_under(store_dir.path())
            .iter()
            .all(|f| !f.to_string_lossy().contains("blobs/sha256/")),
        "{:?}",
        files_under(store_dir.path())
    );
    fs::remove_file(o.m("b")).unwrap();
    let (_, d) = o.diff(&base);
    write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &opts).unwrap();
}

/// An opaque directory is written whole with an explicit stack: a tree deeper than the
/// bound is a clear error (never a stack overflow), within it the layer is complete.
#[test]
fn opaque_subtree_walk_is_depth_bounded() {
    let o = Overlay::new(|l| write(&l.join("d/old"), b"o", 0o644));
    let base = o.scan();
    fs::remove_dir_all(o.m("d")).unwrap();
    let mut p = o.m("d");
    for _ in 0..12 {
        p.push("n");
    }
    fs::create_dir_all(&p).unwrap();
    write(&p.join("leaf"), b"l", 0o644);
    let (_, d) = o.diff(&base);
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let freezer = CountingFreezer::default();
    let shallow = LayerOptions {
        max_depth: 8,
        ..LayerOptions::default()
    };
    let e = write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &shallow)
        .unwrap_err();
    assert!(
        matches!(
            e,
            LayerError::Limit {
                key: "max_walk_depth",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(freezer.counts(), (1, 1));
    let deep = LayerOptions {
        max_depth: 12,
        ..LayerOptions::default()
    };
    let (desc, _) =
        write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &deep).unwrap();
    let items = read_layer(&store, &desc);
    let leaf = format!("d/{}leaf", "n/".repeat(12));
    assert_eq!(item(&items, &leaf).data, b"l");
    assert!(names(&items).contains(&"d/.wh..wh..opq"));
}

/// Without `userxattr`, `user.overlay.*` is the container's own xattr (overlayfs ignores
/// it): it neither hides the image (opaque on `/` or a directory), nor turns a file into a
/// whiteout, nor fails the layer (redirect, metacopy); it is kept as a plain xattr. With
/// `userxattr` it is overlay state.
#[test]
fn user_overlay_xattrs_are_overlay_state_only_with_userxattr() {
    let o = Overlay::new(|l| {
        write(&l.join("etc/conf"), b"c", 0o644);
        write(&l.join("lib/x"), b"x", 0o644);
    });
    let base = o.scan();
    setxattr(&o.merged, "user.overlay.opaque", b"y");
    setxattr(&o.m("etc"), "user.overlay.opaque", b"y");
    setxattr(&o.m("lib"), "user.overlay.redirect", b"/elsewhere");
    write(&o.m("w"), b"", 0o644);
    setxattr(&o.m("w"), "user.overlay.whiteout", b"");
    write(&o.m("m"), b"data", 0o644);
    setxattr(&o.m("m"), "user.overlay.metacopy", b"");
    // The overlay itself ignores them: the image is all still there.
    assert_eq!(fs::read(o.m("etc/conf")).unwrap(), b"c");
    assert_eq!(fs::read(o.m("lib/x")).unwrap(), b"x");
    let now = o.scan();
    assert!(!now.get(Path::new("")).unwrap().opaque);
    assert!(!now.get(Path::new("etc")).unwrap().opaque);
    assert!(now.get(Path::new("lib")).unwrap().redirect.is_none());
    assert_eq!(now.get(Path::new("w")).unwrap().kind, EntryKind::File);
    let (_, d) = o.diff(&base);
    assert!(
        d.added.contains(&PathBuf::from("/w")) && d.deleted.is_empty(),
        "{d:?}"
    );
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let (desc, _) = write_fs_layer(
        &store,
        &o.upper,
        &FsDiffPaths::from(&d),
        &CountingFreezer::default(),
    )
    .unwrap();
    let items = read_layer(&store, &desc);
    let n = names(&items);
    assert!(!n.iter().any(|n| n.contains(".wh.")), "{n:?}");
    assert_eq!(item(&items, "w").kind, b'0');
    assert_eq!(item(&items, "m").data, b"data");
    let opaque_xattr = (b"user.overlay.opaque".to_vec(), b"y".to_vec());
    assert!(
        item(&items, "./").xattrs.contains(&opaque_xattr),
        "{:?}",
        item(&items, "./").xattrs
    );
    assert!(item(&items, "etc/").xattrs.contains(&opaque_xattr));

    // The same names on a `userxattr` mount are overlay state.
    let user = LayerOptions {
        xattrs: OverlayXattrs::User,
        ..LayerOptions::default()
    };
    let e = write_fs_layer_with(
        &store,
        &o.upper,
        &FsDiffPaths::from(&d),
        &CountingFreezer::default(),
        &user,
    )
    .unwrap_err();
    assert!(matches!(e, LayerError::Unsupported { .. }), "{e}");
    let trusted_scan =
        TreeManifest::scan_with(&o.upper, &Default::default(), OverlayXattrs::User).unwrap();
    assert!(trusted_scan.get(Path::new("etc")).unwrap().opaque);
    assert_eq!(
        trusted_scan.get(Path::new("w")).unwrap().kind,
        EntryKind::Whiteout
    );
}
#[test]
fn a_whole_layer_directory_becomes_a_tar_with_its_whiteouts_and_opaque_dirs() {
    let o = Overlay::new(|lower| {
        fs::create_dir_all(lower.join("etc/old")).unwrap();
        fs::write(lower.join("etc/old/x"), b"x").unwrap();
        fs::write(lower.join("gone"), b"g").unwrap();
    });
    // Through the overlay: a file, a symlink, a deletion (whiteout), a replaced
    // directory (opaque), nested directories.
    fs::create_dir_all(o.m("app/a/b")).unwrap();
    fs::write(o.m("app/a/b/f"), b"data").unwrap();
    symlink("/etc/passwd", o.m("app/link")).unwrap();
    fs::remove_file(o.m("gone")).unwrap();
    fs::remove_dir_all(o.m("etc/old")).unwrap();
    fs::create_dir(o.m("etc/old")).unwrap();
    fs::write(o.m("etc/old/new"), b"n").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("tree.tar");
    let out = fs::File::create(&out_path).unwrap();
    let (entries, bytes) =
        write_tree_tar(&o.upper, out, &out_path, &LayerOptions::default()).unwrap();
    let tar = fs::read(&out_path).unwrap();
    assert_eq!(bytes, tar.len() as u64);
    let items = parse_tar(&tar);
    assert_eq!(entries, items.len() as u64);
    let mut got = names(&items);
    got.sort();
    assert_eq!(
        got,
        [
            "app/",
            "app/a/",
            "app/a/b/",
            "app/a/b/f",
            "app/link",
            "etc/",
            "etc/old/",
            "etc/old/.wh..wh..opq",
            "etc/old/new",
            ".wh.gone",
        ]
        .iter()
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect::<Vec<_>>()
    );
    let item = |n: &str| &items.iter().find(|(name, _)| name == n).unwrap().1;
    assert_eq!(item("app/a/b/f").data, b"data");
    assert_eq!(item("app/link").link.as_deref(), Some(&b"/etc/passwd"[..]));
    // A lower layer directory (no whiteouts) is captured whole too.
    let out = fs::File::create(&out_path).unwrap();
    write_tree_tar(&o.lower, out, &out_path, &LayerOptions::default()).unwrap();
    let mut got = names(&parse_tar(&fs::read(&out_path).unwrap()))
        .into_iter()
        .map(str::to_string)
        .collect::<Vec<_>>();
    got.sort();
    assert_eq!(got, ["etc/", "etc/old/", "etc/old/x", "gone"]);
    // Bounded like any layer.
    let out = fs::File::create(&out_path).unwrap();
    let tight = LayerOptions {
        max_bytes: 2,
        ..LayerOptions::default()
    };
    let e = write_tree_tar(&o.upper, out, &out_path, &tight).unwrap_err();
    assert!(matches!(e, LayerError::Limit { .. }), "{e}");
}
