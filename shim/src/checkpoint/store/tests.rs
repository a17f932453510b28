use super::test_support::{files_under, noise};
use super::*;
use sha2::{Digest, Sha256};
use std::{io::Write, time::Duration};

/// Puts a small plain-tar blob (bytes unique per `seed`) and returns its descriptor.
fn blob(store: &Store, seed: u64) -> Descriptor {
    let mut t = store.temp_file("test").unwrap();
    t.file().write_all(&noise(1024, seed)).unwrap();
    let path = t.path().to_path_buf();
    let d = store.put_blob(&path).unwrap();
    drop(t);
    d
}

/// Publishes checkpoint `seq` on top of the latest: fs layers get a new blob when `fs`,
/// a process image is made when `proc`.
fn checkpoint(store: &Store, fs: bool, proc: bool) -> Manifest {
    let prev = store.latest().unwrap();
    let seq = store.next_seq().unwrap();
    let kind = match (fs, proc) {
        (true, true) => CheckpointKind::Full,
        (true, false) => CheckpointKind::Fs,
        (false, true) => CheckpointKind::Proc,
        (false, false) => CheckpointKind::Failed,
    };
    let mut m = Manifest::child_of(prev.as_ref(), seq, &format!("turn-{seq}"), kind);
    if fs {
        m.fs_layers.push(blob(store, seq));
    }
    if proc {
        fs::create_dir_all(store.proc_dir(seq)).unwrap();
        fs::write(store.proc_dir(seq).join("pstree.img"), b"x").unwrap();
        m.process = Some(ProcessImage {
            image: proc_image_name(seq),
            bytes_stored: 1,
            bytes_logical: 1,
            pids: vec![1],
        });
    }
    store.publish(&m).unwrap();
    m
}

#[test]
fn publish_get_list_latest() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.latest().unwrap(), None);
    assert_eq!(store.next_seq().unwrap(), 1);
    assert!(store.list().unwrap().is_empty());
    let m1 = checkpoint(&store, true, false);
    let m2 = checkpoint(&store, false, true);
    let m3 = checkpoint(&store, true, false);
    assert_eq!((m1.seq, m2.seq, m3.seq), (1, 2, 3));
    // C_i = (P_j, F_k): proc-only keeps the layers, fs-only keeps the process image.
    assert_eq!(m2.fs_layers, m1.fs_layers);
    assert_eq!(m3.process, m2.process);
    assert_eq!(m3.fs_layers.len(), 2);
    assert_eq!(m3.parent, Some(2));
    assert_eq!(
        store.list().unwrap(),
        vec![m1.clone(), m2.clone(), m3.clone()]
    );
    assert_eq!(store.latest().unwrap(), Some(m3.clone()));
    assert_eq!(store.get(2).unwrap(), m2);
    assert!(matches!(
        store.get(9),
        Err(StoreError::NotFound { seq: 9, .. })
    ));
    assert!(dir.path().join("checkpoints/000003.json").is_file());
    let json: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.path().join("checkpoints/000003.json")).unwrap())
            .unwrap();
    assert_eq!(json["format"], 1);
    assert_eq!(json["kind"], "fs");
    assert_eq!(json["process"]["image"], "proc/000002");
    assert!(json["fs_layers"][0]["digest"]
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
    // Never over an existing manifest.
    assert!(matches!(
        store.publish(&m2),
        Err(StoreError::Exists { seq: 2, .. })
    ));
    assert_eq!(files_under(&dir.path().join("checkpoints")).len(), 3);
}

#[test]
fn publish_refuses_what_is_not_in_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let mut m = Manifest::child_of(None, 1, "t", CheckpointKind::Fs);
    m.fs_layers.push(Descriptor {
        digest: format!("sha256:{}", "ab".repeat(32)),
        diff_id: format!("sha256:{}", "cd".repeat(32)),
        size: 1,
        media_type: MEDIA_TYPE_LAYER_ZSTD.into(),
    });
    let e = store.publish(&m).unwrap_err();
    assert!(matches!(e, StoreError::Invalid { .. }), "{e}");
    m.fs_layers.clear();
    m.process = Some(ProcessImage {
        image: "proc/000001".into(),
        bytes_stored: 0,
        bytes_logical: 0,
        pids: vec![],
    });
    assert!(matches!(store.publish(&m), Err(StoreError::Invalid { .. })));
    m.process.as_mut().unwrap().image = "../outside".into();
    assert!(matches!(store.publish(&m), Err(StoreError::Invalid { .. })));
    assert!(store.list().unwrap().is_empty());
    assert!(files_under(&dir.path().join("checkpoints")).is_empty());
}

#[test]
fn unknown_newer_format_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    checkpoint(&store, true, false);
    fs::write(
        dir.path().join("checkpoints/000002.json"),
        br#"{"format": 7, "seq": 2, "something": "new"}"#,
    )
    .unwrap();
    let e = store.get(2).unwrap_err();
    assert!(
        matches!(e, StoreError::UnknownFormat { format: 7, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("format 7"), "{e}");
    assert!(matches!(
        store.list(),
        Err(StoreError::UnknownFormat { format: 7, .. })
    ));
    // Retention deletes nothing when it cannot read every manifest.
    assert!(store.apply_retention(Some(1), None).is_err());
    assert!(dir.path().join("checkpoints/000001.json").exists());
    fs::write(dir.path().join("checkpoints/000003.json"), b"{not json").unwrap();
    assert!(matches!(store.get(3), Err(StoreError::Corrupt { .. })));
}

/// A new container with the id of a removed one gets a store of its own; the old one is
/// set aside whole (checkpoints and turns); a restore from the store's own checkpoint
/// carries on with it.
#[test]
fn a_new_container_sets_a_removed_ones_store_aside() {
    let ns = tempfile::tempdir().unwrap();
    let root = ns.path().join("c");
    let open = |continues: bool| {
        Store::open_for_container(&root, |s| {
            assert_eq!(s.root(), root);
            continues
        })
        .unwrap()
    };
    // Nothing there, or a store that holds no lineage yet: used as it is.
    let (store, aside) = open(false);
    assert_eq!(aside, None);
    drop(store);
    let (store, aside) = open(false);
    assert_eq!(aside, None);
    let m1 = checkpoint(&store, true, true);
    fs::create_dir_all(root.join("turns")).unwrap();
    fs::write(root.join("turns/000001.json"), b"{}").unwrap();
    drop(store);
    // Restored from its own checkpoint: the same lineage.
    let (store, aside) = open(true);
    assert_eq!(aside, None);
    assert_eq!(store.list().unwrap(), vec![m1.clone()]);
    drop(store);
    // A new container: a new store; the old one is set aside in one piece.
    let (store, aside) = open(false);
    let aside = aside.expect("set aside");
    assert_eq!(aside.parent(), Some(ns.path()));
    let name = aside.file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with(".replaced-c-"), "{name}");
    assert!(store.list().unwrap().is_empty());
    assert_eq!(store.next_seq().unwrap(), 1);
    assert!(!root.join("turns").exists());
    assert_eq!(Store::open(&aside).unwrap().list().unwrap(), vec![m1]);
    assert!(aside.join("turns/000001.json").is_file());
    assert!(aside.join(proc_image_name(1)).is_dir());
    // Turns alone are a lineage too.
    fs::create_dir_all(root.join("turns")).unwrap();
    fs::write(root.join("turns/000001.json"), b"{}").unwrap();
    drop(store);
    let (_, aside) = open(false);
    assert!(aside.is_some());
    assert!(!root.join("turns").exists());
    // A symlink where the store belongs is set aside, never followed.
    let elsewhere = tempfile::tempdir().unwrap();
    fs::remove_dir_all(&root).unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), &root).unwrap();
    let (store, aside) = open(true);
    assert!(aside.is_some());
    assert!(fs::symlink_metadata(&root).unwrap().is_dir());
    drop(store);
    assert!(fs::read_dir(elsewhere.path()).unwrap().next().is_none());
}

/// A corrupt manifest no longer stops retention for good; turn answers are retained with
/// the checkpoints; a turn answer's temp file is swept.
#[test]
fn retention_survives_a_corrupt_manifest_and_retains_turns() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::open(root).unwrap();
    let turns = root.join("turns");
    fs::create_dir_all(&turns).unwrap();
    let answer = |n: u64, turn: &str| {
        fs::write(
            turns.join(format!("{n:06}.json")),
            format!("{{\"turn_id\": \"{turn}\", \"seq\": {n}}}"),
        )
        .unwrap();
    };
    // Turn answers 1..=3 come before checkpoint 1 (turn-1; 2 and 3 needed none).
    answer(1, "turn-1");
    answer(2, "chat-2");
    answer(3, "chat-3");
    std::thread::sleep(Duration::from_millis(20));
    checkpoint(&store, true, false);
    std::thread::sleep(Duration::from_millis(20));
    answer(4, "turn-2");
    checkpoint(&store, true, false);
    fs::write(root.join("checkpoints/000001.json"), b"{not json").unwrap();
    answer(5, "turn-3");
    std::thread::sleep(Duration::from_millis(20));
    checkpoint(&store, true, false);
    answer(6, "turn-4");
    let r = store.apply_retention(Some(1), None).unwrap();
    assert_eq!(r.removed_manifests, [2]);
    assert!(root.join("checkpoints/000001.json.corrupt").is_file());
    assert_eq!(
        store
            .list()
            .unwrap()
            .iter()
            .map(|m| m.seq)
            .collect::<Vec<_>>(),
        [3]
    );
    // Kept: the answer of the kept checkpoint's turn (turn-3) and those after it.
    let mut left: Vec<String> = fs::read_dir(&turns)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["000005.json", "000006.json"]);
    // Retention goes on working.
    checkpoint(&store, true, false);
    assert_eq!(
        store
            .apply_retention(Some(1), None)
            .unwrap()
            .removed_manifests,
        [3]
    );
    drop(store);
    fs::write(turns.join(".000007.json.tmp"), b"{").unwrap();
    drop(Store::open(root).unwrap());
    assert!(!turns.join(".000007.json.tmp").exists());
}

/// What retention removes goes on counting in the figures of `crabctl metrics`: its
/// manifests' and answers' figures are in `retired.json` before they go.
#[test]
fn retention_keeps_the_figures_of_what_it_removes() {
    use crate::metrics::{scan_store, Retired, ScanCache, SeqSet};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::open(root).unwrap();
    let turns = root.join("turns");
    fs::create_dir_all(&turns).unwrap();
    let answer = |n: u64, kind: &str| {
        let a = serde_json::json!({"turn_id": format!("turn-{n}"), "seq": n, "kind": kind,
                "degraded": [], "elapsed_us": 100 * n});
        fs::write(turns.join(format!("{n:06}.json")), a.to_string()).unwrap();
    };
    for (n, (f, p)) in [(true, false), (false, true), (true, true), (true, false)]
        .into_iter()
        .enumerate()
    {
        let n = n as u64 + 1;
        answer(
            n,
            if f && p {
                "full"
            } else if f {
                "fs"
            } else {
                "proc"
            },
        );
        std::thread::sleep(Duration::from_millis(20));
        checkpoint(&store, f, p);
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = scan_store(root, &mut ScanCache::default());
    assert_eq!(before.unreadable, 0, "{:?}", before.warnings);
    let r = store
        .apply_retention_with(Some(1), None, |m, a| {
            crate::metrics::retire(root, m, a).unwrap()
        })
        .unwrap();
    assert_eq!(r.removed_manifests, [1, 2, 3]);
    assert_eq!(store.list().unwrap().len(), 1);
    let left = fs::read_dir(&turns).unwrap().count();
    assert_eq!(left, 1, "the answer of the kept checkpoint");
    let after = scan_store(root, &mut ScanCache::default());
    assert_eq!(after.tally, before.tally);
    assert_eq!(after.tally.checkpoints.full.ok, 1);
    assert_eq!(after.tally.answers.fs, 2);
    let retired = Retired::load(root).unwrap();
    assert_eq!(retired.manifests, SeqSet(vec![(1, 3)]));
    assert_eq!(retired.turns, SeqSet(vec![(1, 3)]));
    // A shim carrying the lineage on numbers its answers after these.
    assert_eq!(crate::metrics::last_answer_seq(root), 4);
}

/// While `crabctl prune` holds the namespace directory's lock, a store is neither created
/// nor set aside.
#[test]
fn stores_are_created_under_the_namespace_lock() {
    let ns = tempfile::tempdir().unwrap();
    let root = ns.path().join("c");
    let lock = lock_namespace_dir(ns.path()).unwrap();
    let opener = std::thread::spawn({
        let root = root.clone();
        move || Store::open_for_container(&root, |_| true).map(|_| ())
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(!opener.is_finished());
    assert!(
        !root.exists(),
        "nothing is created while prune holds the lock"
    );
    drop(lock);
    opener.join().unwrap().unwrap();
    assert!(root.join("checkpoints").is_dir());
}

#[test]
fn crash_leftovers_are_swept_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let first = Store::open(dir.path()).unwrap();
    let (m1, m2) = (
        checkpoint(&first, true, true),
        checkpoint(&first, true, false),
    );
    // A crash mid-publish, mid-blob, mid-layer, and after a blob and an image were stored
    // but before the manifest naming them was published.
    let root = dir.path();
    fs::write(root.join("checkpoints/.000003.json.tmp"), b"{\"format\":1,").unwrap();
    fs::write(root.join("blobs/.layer.tar-1-0.tmp"), b"partial").unwrap();
    fs::write(root.join("blobs/sha256/.x.tmp"), b"partial").unwrap();
    fs::create_dir_all(root.join("proc/000003")).unwrap();
    fs::write(root.join("proc/000003/pages-1.img"), b"p").unwrap();
    fs::create_dir_all(root.join("proc/000004.tmp")).unwrap();
    fs::write(root.join("chunks/ab.tmp"), b"c").unwrap();
    let orphan = format!("{:x}", Sha256::digest(b"orphan"));
    fs::write(root.join("blobs/sha256").join(&orphan), b"orphan").unwrap();

    // A second store while the first is open must not sweep anything.
    drop(Store::open(root).unwrap());
    assert!(root.join("checkpoints/.000003.json.tmp").exists());
    drop(first);

    let store = Store::open(root).unwrap();
    assert_eq!(store.list().unwrap(), vec![m1.clone(), m2.clone()]);
    let mut expect: Vec<PathBuf> = vec![
        ".lock".into(),
        "checkpoints/000001.json".into(),
        "checkpoints/000002.json".into(),
    ];
    expect.extend(
        m2.fs_layers
            .iter()
            .map(|d| Path::new("blobs/sha256").join(d.hex())),
    );
    expect.push("proc/000001/pstree.img".into());
    expect.sort();
    assert_eq!(files_under(root), expect);
    assert!(!root.join("proc/000003").exists());
    assert_eq!(store.next_seq().unwrap(), 3);
}

#[test]
fn retention_keeps_last_and_every_and_what_they_reference() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    // 1 fs, 2 proc, 3 fs, 4 full, 5 fs, 6 proc, 7 fs, 8 fs
    let ms: Vec<Manifest> = [
        (true, false),
        (false, true),
        (true, false),
        (true, true),
        (true, false),
        (false, true),
        (true, false),
        (true, false),
    ]
    .into_iter()
    .map(|(f, p)| checkpoint(&store, f, p))
    .collect();
    assert_eq!(
        store.apply_retention(None, None).unwrap(),
        Retention::default()
    );
    let r = store.apply_retention(Some(2), Some(3)).unwrap();
    assert_eq!(r.removed_manifests, vec![1, 2, 4, 5]);
    let kept: Vec<u64> = store.list().unwrap().iter().map(|m| m.seq).collect();
    assert_eq!(kept, vec![3, 6, 7, 8]);
    // 8's chain is every layer ever made: nothing of it may go.
    for d in &ms[7].fs_layers {
        assert!(store.blob_path(&d.digest).is_file(), "{} removed", d.digest);
    }
    assert!(r.removed_blobs.is_empty());
    // Process images: 6 is named by 6, 7, 8; 2 only by 2, 3 (3 kept!); 4 only by 4, 5.
    assert!(store.proc_dir(6).is_dir());
    assert!(store.proc_dir(2).is_dir(), "named by kept checkpoint 3");
    assert!(!store.proc_dir(4).exists());
    assert_eq!(r.removed_proc, vec![store.proc_dir(4)]);

    // A fresh chain: an fs layer no kept manifest names goes.
    let dir2 = tempfile::tempdir().unwrap();
    let store2 = Store::open(dir2.path()).unwrap();
    let a = checkpoint(&store2, true, false);
    let mut b = Manifest::child_of(Some(&a), 2, "rebased", CheckpointKind::Fs);
    b.fs_layers = vec![blob(&store2, 99)];
    store2.publish(&b).unwrap();
    // A blob put for a checkpoint not yet published is not garbage.
    let pending = blob(&store2, 100);
    let r = store2.apply_retention(Some(1), None).unwrap();
    assert_eq!(r.removed_manifests, vec![1]);
    assert_eq!(r.removed_blobs, vec![a.fs_layers[0].digest.clone()]);
    assert!(store2.blob_path(&pending.digest).is_file());
    assert!(store2.blob_path(&b.fs_layers[0].digest).is_file());
    // Keep-last 0 still keeps the newest.
    let r = store2.apply_retention(Some(0), None).unwrap();
    assert!(r.removed_manifests.is_empty());
}

#[test]
fn put_blob_hashes_zstd_and_plain() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let raw = noise(10_000, 7);
    let outside = tempfile::tempdir().unwrap();
    let zpath = outside.path().join("layer.zst");
    fs::write(&zpath, zstd::encode_all(&raw[..], 3).unwrap()).unwrap();
    let d = store.put_blob(&zpath).unwrap();
    assert_eq!(d.media_type, MEDIA_TYPE_LAYER_ZSTD);
    assert_eq!(d.diff_id, format!("sha256:{:x}", Sha256::digest(&raw)));
    let stored = fs::read(store.blob_path(&d.digest)).unwrap();
    assert_eq!(d.digest, format!("sha256:{:x}", Sha256::digest(&stored)));
    assert_eq!(d.size, stored.len() as u64);
    assert!(!zpath.exists(), "consumed");
    let ppath = dir.path().join("plain.tmp");
    fs::write(&ppath, &raw).unwrap();
    let p = store.put_blob(&ppath).unwrap();
    assert_eq!(
        (p.media_type.as_str(), &p.digest),
        (MEDIA_TYPE_LAYER_TAR, &p.diff_id)
    );
    assert_eq!(files_under(&dir.path().join("blobs")).len(), 2);
}

#[test]
fn rfc3339_dates() {
    assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
    assert_eq!(
        rfc3339(UNIX_EPOCH + Duration::from_millis(951_782_400_123)),
        "2000-02-29T00:00:00.123Z"
    );
    assert_eq!(
        rfc3339(UNIX_EPOCH + Duration::from_secs(1_777_777_777)),
        "2026-05-03T03:09:37.000Z"
    );
    assert_eq!(
        rfc3339_nanos(UNIX_EPOCH + Duration::new(1_796_279_993, 931_792_054)),
        "2026-12-03T06:39:53.931792054Z"
    );
    // Before the epoch and past year 9999: clamped, never a panic.
    assert_eq!(
        rfc3339(UNIX_EPOCH - Duration::from_secs(5)),
        "1970-01-01T00:00:00.000Z"
    );
    assert_eq!(
        rfc3339(UNIX_EPOCH + Duration::from_secs(400_000_000_000)),
        "9999-12-31T23:59:59.000Z"
    );
}
