//! Checkpoints running out of disk space and restores meeting device nodes: on a tiny tmpfs
//! and with `mknod`, so these need root; they fail without (see `support`).

mod support;

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::Write as _,
    path::Path,
};

use crab_runtime_config::UnsignedImages;
use crab_shim::checkpoint::criu_image::ns;
use crab_shim::checkpoint::pages::{dedup, CHUNK_SIZE};
use crab_shim::checkpoint::provenance::{self, sign, Statement, TrustedKeys, SIGNATURE_FILE};
use crab_shim::checkpoint::store::{CheckpointKind, Manifest, Store};
use crab_shim::restore::intake::{
    take_from_rootfs, ImageLimits, RestoreError, RestoreGuard, META_FILE, RESERVED_DIR,
};
use crab_shim::restore::privilege::Granted;
use ed25519_dalek::SigningKey;
use support::{files::files_under, Tmpfs};

#[test]
fn full_disk_on_publish_leaves_nothing_partial() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let _fs = Tmpfs::mount(&root, "64k");
    let store = Store::open(&root).unwrap();
    let m1 = Manifest::child_of(
        None,
        store.next_seq().unwrap(),
        "turn-1",
        CheckpointKind::Failed,
    );
    store.publish(&m1).unwrap();
    // Fill the filesystem.
    let mut filler = File::create(root.join("filler")).unwrap();
    let chunk = vec![1u8; 4096];
    while filler.write_all(&chunk).is_ok() {}
    drop(filler);
    let mut m2 = Manifest::child_of(Some(&m1), 2, "t2", CheckpointKind::Failed);
    m2.explanation = "x".repeat(8192);
    let e = store.publish(&m2).unwrap_err();
    assert!(e.is_no_space(), "{e}");
    assert!(e.to_string().contains("no space left"), "{e}");
    assert_eq!(store.list().unwrap(), vec![m1.clone()]);
    assert!(
        !files_under(&root)
            .iter()
            .any(|p| p.to_string_lossy().ends_with(".tmp")),
        "{:?}",
        files_under(&root)
    );
    fs::remove_file(root.join("filler")).unwrap();
    store.publish(&m2).unwrap();
    assert_eq!(store.latest().unwrap(), Some(m2));
}

/// A chunk of the chunk store's size, distinct per `fill`.
fn page(fill: u8) -> Vec<u8> {
    let mut p = vec![fill; CHUNK_SIZE];
    p[0] = fill.wrapping_mul(7);
    p
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// A chunk store that runs out of space mid-pack keeps neither the partial pack nor a temp
/// file (left behind, they kept the disk full), and the image is left as it was.
#[test]
fn a_full_disk_leaves_no_temp_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let (img, chunks) = (tmp.path().join("img"), tmp.path().join("chunks"));
    fs::create_dir_all(&img).unwrap();
    let _fs = Tmpfs::mount(&chunks, "256k");
    let pages: Vec<u8> = (0..200).flat_map(|i| page(i as u8)).collect();
    fs::write(img.join("pages-1.img"), &pages).unwrap();
    let e = dedup(&img, &chunks).unwrap_err();
    assert!(e.to_string().contains("No space left"), "{e}");
    assert!(files(&chunks).is_empty(), "{:?}", files(&chunks));
    assert_eq!(fs::read(img.join("pages-1.img")).unwrap(), pages);
}

/// A restore refuses a checkpoint description or signature that is a device node without
/// opening it (a device's `open` runs driver code).
#[test]
fn restore_never_opens_a_device() {
    support::require_root("makes a device node");
    let key = SigningKey::from_bytes(&[7; 32]);
    let mut trusted = TrustedKeys::new();
    trusted.add(key.verifying_key(), "test");
    let trusted = || Ok(trusted.clone());
    const DEFAULT_CAPS: u64 = 0xa804_25fb;
    let granted = Granted {
        gids: vec![0],
        bounding: DEFAULT_CAPS,
        effective: DEFAULT_CAPS,
        permitted: DEFAULT_CAPS,
        namespaces: ns::PID | ns::NET | ns::MNT,
        ..Granted::default()
    };
    let guard = RestoreGuard {
        container: "test",
        trusted: &trusted,
        unsigned: UnsignedImages::Refuse,
        limits: ImageLimits::NONE,
        granted: &granted,
        cache: None,
        defer_pages: false,
        // Never consulted: each image is refused before its signature is read.
        unpacked: &Err(crab_shim::restore::layers::LayersError::NotAsked),
    };
    let meta = format!(
        r#"{{"format":1,"source":{{"namespace":"ns","container":"c","seq":3,"turn_id":"t3"}},
        "fs_layers":[{{"digest":"sha256:{h}","diff_id":"sha256:{h}","size":10,"media_type":"application/vnd.oci.image.layer.v1.tar+zstd"}}],
        "process":null,"created_at":"2026-01-01T00:00:00Z"}}"#,
        h = "ab".repeat(32),
    );
    for file in [META_FILE, SIGNATURE_FILE] {
        // A signed checkpoint (fs only), whose `file` is then replaced by /dev/null's numbers.
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(RESERVED_DIR);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(META_FILE), &meta).unwrap();
        let statement = Statement {
            checkpoint_json: provenance::sha256(meta.as_bytes()),
            criu: BTreeMap::new(),
            layers: Some(Vec::new()),
            rootfs: None,
        };
        fs::write(dir.join(SIGNATURE_FILE), sign(&key, statement)).unwrap();
        let path = dir.join(file);
        fs::remove_file(&path).unwrap();
        nix::sys::stat::mknod(
            &path,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::S_IRWXU,
            nix::sys::stat::makedev(1, 3),
        )
        .unwrap();
        // Refused without being opened (a device's `open` would already have run).
        let watch =
            nix::sys::inotify::Inotify::init(nix::sys::inotify::InitFlags::IN_NONBLOCK).unwrap();
        watch
            .add_watch(&path, nix::sys::inotify::AddWatchFlags::IN_OPEN)
            .unwrap();
        let dest = tempfile::tempdir().unwrap();
        let err = take_from_rootfs(root.path(), &dest.path().join("criu"), &guard).unwrap_err();
        assert!(
            matches!(err, RestoreError::NotPlain { .. }),
            "{file}: {err}"
        );
        let opened = watch.read_events().unwrap_or_default();
        assert!(opened.is_empty(), "{file} was opened: {opened:?}");
        assert!(dir.exists());
        assert!(!dest.path().join("criu").exists());
    }
}
