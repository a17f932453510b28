use super::*;

#[test]
fn tags_are_valid_stable_and_apart() {
    let valid = |t: &str| {
        t.len() <= 128
            && t.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
    };
    for l in [
        "default/run-7",
        "team-a/agent-0/sandbox",
        &"x/".repeat(120)[..239],
    ] {
        let t = newest_tag(l);
        assert!(valid(&t), "{t}");
        assert!(
            valid(&seq_tag(l, &"c".repeat(64), u64::MAX)),
            "{}",
            seq_tag(l, "c", 1)
        );
        assert_eq!(t, newest_tag(l));
    }
    assert_ne!(newest_tag("a/b"), newest_tag("a-b"));
    assert_ne!(seq_tag("a", "c1", 1), seq_tag("a", "c2", 1));
}

fn signed_store() -> (
    tempfile::TempDir,
    LineageRecord,
    Manifest,
    Artifact,
    TrustedKeys,
) {
    use crate::checkpoint::store::Store;
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(&t.path().join("s")).unwrap();
    let mut tmp = store.temp_file("l").unwrap();
    std::io::Write::write_all(tmp.file(), b"not really a tar, a blob all the same").unwrap();
    let d = store.put_blob(tmp.path()).unwrap();
    let mut m = Manifest::child_of(None, 1, "t1", CheckpointKind::Fs);
    m.fs_layers = vec![d];
    store.publish(&m).unwrap();
    let record = LineageRecord::new("ns/p/c", Some(format!("sha256:{}", "a".repeat(64))));
    let key = SigningKey::from_bytes(&[7; 32]);
    let a = build(
        store.root(),
        "k8s.io",
        "c1",
        &record,
        &m,
        &key,
        1 << 20,
        None,
    )
    .unwrap()
    .0;
    let mut trusted = TrustedKeys::new();
    trusted.add(key.verifying_key(), "test");
    (t, record, m, a, trusted)
}

#[test]
fn a_built_artifact_verifies_and_a_tampered_one_does_not() {
    let (_t, record, m, a, trusted) = signed_store();
    let image = record.image.as_deref();
    let v = verify(&a.config, "ns/p/c", image, &trusted).unwrap();
    assert_eq!(v.meta.fs_layers, m.fs_layers);
    assert_eq!(a.layers.len(), 1);
    // Another lineage, another image, another key: refused.
    assert!(matches!(
        verify(&a.config, "ns/p/other", image, &trusted),
        Err(ReplicaError::Lineage { .. })
    ));
    assert!(matches!(
        verify(&a.config, "ns/p/c", Some("sha256:b"), &trusted),
        Err(ReplicaError::Image { .. })
    ));
    let mut stranger = TrustedKeys::new();
    stranger.add(SigningKey::from_bytes(&[8; 32]).verifying_key(), "other");
    assert!(verify(&a.config, "ns/p/c", image, &stranger).is_err());
    // checkpoint.json altered (another layer named), the lineage or image changed in the
    // config: the signature no longer holds.
    let mut c: ReplicaConfig = serde_json::from_slice(&a.config).unwrap();
    c.checkpoint_json = c.checkpoint_json.replace("sha256:", "sha256:0");
    let bytes = serde_json::to_vec(&c).unwrap();
    assert!(verify(&bytes, "ns/p/c", image, &trusted).is_err());
    let mut c: ReplicaConfig = serde_json::from_slice(&a.config).unwrap();
    c.image = format!("sha256:{}", "b".repeat(64));
    let bytes = serde_json::to_vec(&c).unwrap();
    let e = verify(&bytes, "ns/p/c", None, &trusted).unwrap_err();
    assert!(matches!(e, ReplicaError::Mismatch(_)), "{e}");
    // Unsigned: no signature, or one over nothing.
    for sig in ["", "{}"] {
        let mut c: ReplicaConfig = serde_json::from_slice(&a.config).unwrap();
        c.signature = sig.into();
        let bytes = serde_json::to_vec(&c).unwrap();
        assert!(
            verify(&bytes, "ns/p/c", image, &trusted).is_err(),
            "{sig:?}"
        );
    }
    // Garbage and oversized configs.
    assert!(verify(b"{", "ns/p/c", image, &trusted).is_err());
    let big = vec![b' '; CONFIG_MAX as usize + 1];
    assert!(verify(&big, "ns/p/c", image, &trusted).is_err());
}

#[test]
fn a_checkpoint_over_the_bound_or_without_an_image_is_not_built() {
    let (t, record, m, _, _) = signed_store();
    let key = SigningKey::from_bytes(&[7; 32]);
    let root = t.path().join("s");
    let e = build(&root, "k8s.io", "c1", &record, &m, &key, 10, None).unwrap_err();
    assert!(matches!(e, BuildError::TooLarge { max_mib: 0 }), "{e}");
    assert!(e.to_string().contains("max_mib"), "{e}");
    let blind = LineageRecord::new("ns/p/c", None);
    let e = build(&root, "k8s.io", "c1", &blind, &m, &key, 1 << 20, None).unwrap_err();
    assert!(matches!(e, BuildError::NoImage), "{e}");
    assert!(e.to_string().contains("image"), "{e}");
}

use crate::test_rng as rng;

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut r = rng::Rng(seed);
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        v.extend_from_slice(&r.next().to_le_bytes());
    }
    v.truncate(n);
    v
}

fn digests(data: &[u8]) -> Vec<String> {
    segments(data)
        .into_iter()
        .map(|r| sha256(&data[r]))
        .collect()
}

#[test]
fn segments_cover_a_file_in_whole_pages_within_their_bounds() {
    let page = SEGMENT_PAGE;
    for (seed, n) in [
        (1, 0),
        (2, 1),
        (3, page),
        (4, 3 * page + 7),
        (5, 40 << 20),
        (6, 5 << 20),
    ] {
        let data = random_bytes(seed, n);
        let segs = segments(&data);
        assert_eq!(segs.first().map(|r| r.start), Some(0), "n={n}");
        assert_eq!(segs.last().map(|r| r.end), Some(n), "n={n}");
        for w in segs.windows(2) {
            assert_eq!(w[0].end, w[1].start, "n={n}");
        }
        for (i, r) in segs.iter().enumerate() {
            assert!(r.len() <= SEGMENT_MAX_PAGES * page, "n={n}: {r:?}");
            if i + 1 < segs.len() {
                assert_eq!(r.len() % page, 0, "n={n}: {r:?}");
                assert!(r.len() >= SEGMENT_MIN_PAGES * page, "n={n}: {r:?}");
            }
        }
        assert_eq!(segments(&data), segs, "deterministic");
    }
    // 40 MiB of random pages: about 512 KiB a segment on average.
    let n = segments(&random_bytes(5, 40 << 20)).len();
    assert!((40..=160).contains(&n), "{n} segments for 40 MiB");
    // Pages all alike (zeroes) are cut at the minimum or the maximum, never per page.
    let zeros = segments(&vec![0u8; 8 << 20]);
    assert!(
        zeros.len() <= (8 << 20) / (SEGMENT_MIN_PAGES * page),
        "{}",
        zeros.len()
    );
}

#[test]
fn a_changed_page_costs_its_segment_and_an_inserted_mapping_shifts_nothing_behind_it() {
    let data = random_bytes(9, 32 << 20);
    let before = digests(&data);
    let old: std::collections::HashSet<&String> = before.iter().collect();
    let new_of = |d: &[String]| d.iter().filter(|x| !old.contains(x)).count();
    // One page changed: one segment differs (two when it moves a boundary).
    let mut changed = data.clone();
    changed[(13 << 20) + 100] ^= 1;
    let after = digests(&changed);
    assert!(new_of(&after) <= 2, "{} new segments", new_of(&after));
    // 64 pages inserted in the middle (a mapping added): the segments after the next
    // boundary are the same as before.
    let mut shifted = data[..16 << 20].to_vec();
    shifted.extend(random_bytes(10, 64 * SEGMENT_PAGE));
    shifted.extend_from_slice(&data[16 << 20..]);
    let after = digests(&shifted);
    assert!(
        new_of(&after) <= 3,
        "{} new segments of {}",
        new_of(&after),
        after.len()
    );
    // Fixed 1 MiB pieces would have resent half the file.
    let fixed = |d: &[u8]| -> Vec<String> { d.chunks(1 << 20).map(sha256).collect() };
    let old_fixed: std::collections::HashSet<String> = fixed(&data).into_iter().collect();
    let resent = fixed(&shifted)
        .iter()
        .filter(|x| !old_fixed.contains(*x))
        .count();
    assert!(resent >= 16, "{resent}");
}

/// A store whose checkpoint has a process image of `pages` bytes (and a small core file).
fn process_store(pages: usize) -> (tempfile::TempDir, LineageRecord, Manifest, Artifact) {
    use crate::checkpoint::store::{proc_image_name, ProcessImage, Store};
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(&t.path().join("s")).unwrap();
    let dir = store.proc_dir(1);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("pages-1.img"), random_bytes(11, pages)).unwrap();
    fs::write(dir.join("core-1.img"), b"core").unwrap();
    let mut m = Manifest::child_of(None, 1, "t1", CheckpointKind::Proc);
    m.process = Some(ProcessImage {
        image: proc_image_name(1),
        bytes_stored: pages as u64 + 4,
        bytes_logical: pages as u64 + 4,
        pids: vec![1],
    });
    store.publish(&m).unwrap();
    let record = LineageRecord::new("ns/p/c", Some(format!("sha256:{}", "a".repeat(64))));
    let key = SigningKey::from_bytes(&[7; 32]);
    let a = build(
        store.root(),
        "k8s.io",
        "c1",
        &record,
        &m,
        &key,
        64 << 20,
        None,
    )
    .unwrap()
    .0;
    (t, record, m, a)
}

fn refs(a: &Artifact) -> Vec<SegmentRef> {
    a.layers
        .iter()
        .filter(|b| b.file.is_some())
        .map(|b| SegmentRef {
            media_type: b.media_type.clone(),
            digest: b.digest.clone(),
            size: b.size as i64,
            file: b.file.clone(),
            offset: Some(b.offset.to_string()),
        })
        .collect()
}

#[test]
fn a_process_image_is_pushed_in_segments_that_rebuild_its_signed_files() {
    let (_t, record, _m, a) = process_store(6 << 20);
    let mut trusted = TrustedKeys::new();
    trusted.add(SigningKey::from_bytes(&[7; 32]).verifying_key(), "test");
    let v = verify(&a.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
    let refs = refs(&a);
    assert!(refs.len() >= 4, "{} blobs", refs.len());
    let plans = plan_files(&refs, &v.criu).unwrap();
    assert_eq!(plans.len(), 2);
    let crius: Vec<&Blob> = a.layers.iter().filter(|b| b.file.is_some()).collect();
    for plan in plans {
        let mut whole = Sha256::new();
        for i in plan.segments {
            let data = crius[i].data.read().unwrap();
            assert_eq!(sha256(&data), crius[i].digest);
            whole.update(&data);
        }
        assert_eq!(digest_string(whole), plan.want.sha256, "{}", plan.name);
    }
}

#[test]
fn an_fs_only_checkpoint_reuses_the_process_image_it_shares_without_reading_it() {
    use crate::checkpoint::store::Store;
    let (t, record, m, first) = process_store(3 << 20);
    let root = t.path().join("s");
    // The store keeps its pages deduplicated (a recipe and chunks), as crab writes them.
    let dir = root.join(&m.process.as_ref().unwrap().image);
    pages::dedup(&dir, &root.join("chunks")).unwrap();
    assert!(!dir.join("pages-1.img").exists());
    let key = SigningKey::from_bytes(&[7; 32]);
    let (again, digests) = build(&root, "k8s.io", "c1", &record, &m, &key, 64 << 20, None).unwrap();
    let digests = digests.expect("a process image");
    let names = |a: &Artifact| -> Vec<(String, u64)> {
        a.layers
            .iter()
            .map(|b| (b.digest.clone(), b.offset))
            .collect()
    };
    assert_eq!(
        names(&again),
        names(&first),
        "rebuilt from its chunks alike"
    );
    // The next checkpoint: a new fs layer, the same process image.
    let store = Store::open(&root).unwrap();
    let mut tmp = store.temp_file("l").unwrap();
    std::io::Write::write_all(tmp.file(), b"a layer").unwrap();
    let d = store.put_blob(tmp.path()).unwrap();
    let mut next = Manifest::child_of(Some(&m), 2, "t2", CheckpointKind::Fs);
    next.fs_layers.push(d);
    store.publish(&next).unwrap();
    let (reused, kept) = build(
        &root,
        "k8s.io",
        "c1",
        &record,
        &next,
        &key,
        64 << 20,
        Some(&digests),
    )
    .unwrap();
    let crius = |a: &Artifact| -> Vec<Blob> {
        a.layers
            .iter()
            .filter(|b| b.file.is_some())
            .cloned()
            .collect()
    };
    assert_eq!(crius(&reused).len(), crius(&first).len());
    for (r, f) in crius(&reused).iter().zip(crius(&first)) {
        assert!(matches!(r.data, BlobData::Lazy(..)), "not read up front");
        assert_eq!((&r.digest, r.offset, r.size), (&f.digest, f.offset, f.size));
        assert_eq!(
            r.data.read().unwrap(),
            f.data.read().unwrap(),
            "read when sent"
        );
    }
    assert_eq!(kept.unwrap().segments, digests.segments);
    let mut trusted = TrustedKeys::new();
    trusted.add(key.verifying_key(), "test");
    let v = verify(&reused.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
    assert_eq!(v.criu, digests.files, "signed as the image's files");
    assert_eq!(v.meta.fs_layers.len(), 1, "the new layer");
    // Another process image is built anew.
    let other = CriuDigests {
        dir: root.join("proc/000009"),
        ..digests.clone()
    };
    let (_, made) = build(
        &root,
        "k8s.io",
        "c1",
        &record,
        &next,
        &key,
        64 << 20,
        Some(&other),
    )
    .unwrap();
    assert_eq!(made.unwrap().dir, digests.dir);
    // The bound still counts the image's files.
    let e = build(
        &root,
        "k8s.io",
        "c1",
        &record,
        &next,
        &key,
        1 << 20,
        Some(&digests),
    )
    .unwrap_err();
    assert!(e.to_string().contains("max_mib"), "{e}");
}

#[test]
fn hostile_segment_lists_are_refused_before_anything_is_pulled() {
    let (_t, record, _m, a) = process_store(3 << 20);
    let mut trusted = TrustedKeys::new();
    trusted.add(SigningKey::from_bytes(&[7; 32]).verifying_key(), "test");
    let v = verify(&a.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
    let good = refs(&a);
    plan_files(&good, &v.criu).unwrap();
    let pages: Vec<usize> = (0..good.len())
        .filter(|&i| good[i].file.as_deref() == Some("pages-1.img"))
        .collect();
    assert!(pages.len() >= 2, "{good:?}");
    type Edit = Box<dyn Fn(&mut Vec<SegmentRef>)>;
    let (p0, p1) = (pages[0], pages[1]);
    let cases: Vec<(&str, Edit)> = vec![
        (
            "a segment dropped",
            Box::new(move |r| {
                r.remove(p1);
            }),
        ),
        ("two segments swapped", Box::new(move |r| r.swap(p0, p1))),
        (
            "a segment twice",
            Box::new(move |r| {
                let d = r[p0].clone();
                r.insert(p0, d);
            }),
        ),
        (
            "an offset moved",
            Box::new(move |r| r[p1].offset = Some("1".into())),
        ),
        (
            "an offset not a number",
            Box::new(move |r| r[p0].offset = Some("-0".into())),
        ),
        ("a negative size", Box::new(move |r| r[p0].size = -1)),
        ("a size too large", Box::new(move |r| r[p0].size += 4096)),
        ("no file named", Box::new(move |r| r[p0].file = None)),
        (
            "an unsigned file",
            Box::new(move |r| r[p0].file = Some("pages-2.img".into())),
        ),
        (
            "a file climbing out",
            Box::new(move |r| r[p0].file = Some("../x".into())),
        ),
        (
            "another media type",
            Box::new(move |r| r[p0].media_type = MEDIA_TYPE_LAYER_ZSTD.into()),
        ),
        (
            "a file missing",
            Box::new(|r| r.retain(|x| x.file.as_deref() != Some("core-1.img"))),
        ),
        (
            "files interleaved",
            Box::new(move |r| {
                let d = r.remove(p1);
                r.push(d.clone());
            }),
        ),
        ("nothing", Box::new(|r| r.clear())),
        (
            "a file as a thousand page-sized blobs",
            Box::new(move |r| {
                let first = r[p0].clone();
                let total: i64 = r
                    .iter()
                    .filter(|x| x.file == first.file)
                    .map(|x| x.size)
                    .sum();
                let pages: Vec<SegmentRef> = (0..total / 4096)
                    .map(|k| SegmentRef {
                        size: 4096,
                        offset: Some((k * 4096).to_string()),
                        ..first.clone()
                    })
                    .collect();
                r.retain(|x| x.file != first.file);
                r.extend(pages);
            }),
        ),
        (
            "a file twice",
            Box::new(move |r| {
                let again: Vec<SegmentRef> = r
                    .iter()
                    .filter(|x| x.file.as_deref() == Some("core-1.img"))
                    .cloned()
                    .collect();
                r.extend(again);
            }),
        ),
        (
            "one segment over the maximum",
            Box::new(move |r| {
                let total: i64 = r
                    .iter()
                    .filter(|x| x.file.as_deref() == Some("pages-1.img"))
                    .map(|x| x.size)
                    .sum();
                let first = SegmentRef {
                    size: total,
                    ..r[p0].clone()
                };
                r.retain(|x| x.file.as_deref() != Some("pages-1.img"));
                r.push(first);
            }),
        ),
    ];
    for (what, edit) in cases {
        let mut r = good.clone();
        edit(&mut r);
        assert!(plan_files(&r, &v.criu).is_err(), "{what} was accepted");
    }
    // An older crab's manifest: one blob per file, no offsets.
    let mut whole = v
        .criu
        .iter()
        .map(|(name, f)| SegmentRef {
            media_type: MEDIA_TYPE_CRIU_FILE.into(),
            digest: f.sha256.clone(),
            size: f.size as i64,
            file: Some(name.clone()),
            offset: None,
        })
        .collect::<Vec<_>>();
    plan_files(&whole, &v.criu).unwrap();
    whole[0].offset = Some("0".into());
    whole.rotate_left(0);
    let big = whole
        .iter()
        .position(|x| x.file.as_deref() == Some("pages-1.img"))
        .unwrap();
    whole[big].offset = Some("0".into());
    assert!(
        plan_files(&whole, &v.criu).is_err(),
        "a whole file over the maximum with an offset"
    );
}

/// Each refusal of a segment list says what is wrong, and of which file.
#[test]
fn segment_refusals_say_what_and_of_which_file() {
    let (_t, record, _m, a) = process_store(3 << 20);
    let mut trusted = TrustedKeys::new();
    trusted.add(SigningKey::from_bytes(&[7; 32]).verifying_key(), "test");
    let v = verify(&a.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
    let whole = v
        .criu
        .iter()
        .map(|(name, f)| SegmentRef {
            media_type: MEDIA_TYPE_CRIU_FILE.into(),
            digest: f.sha256.clone(),
            size: f.size as i64,
            file: Some(name.clone()),
            offset: None,
        })
        .collect::<Vec<_>>();
    plan_files(&whole, &v.criu).unwrap();
    let mut unnamed = whole.clone();
    unnamed[0].file = None;
    assert!(matches!(
        plan_files(&unnamed, &v.criu),
        Err(SegmentError::NoFile(d)) if d == whole[0].digest
    ));
    let mut climbing = whole.clone();
    climbing[0].file = Some("../x".into());
    assert_eq!(
        plan_files(&climbing, &v.criu),
        Err(SegmentError::FileName(BadFileName("../x".into())))
    );
    let mut wordy = whole.clone();
    wordy[0].offset = Some("zero".into());
    let name = wordy[0].file.clone().unwrap();
    assert_eq!(
        plan_files(&wordy, &v.criu).unwrap_err().to_string(),
        format!("{name}: offset \"zero\" is not a number")
    );
    let mut missing = whole.clone();
    let gone = missing.pop().unwrap().file.unwrap();
    assert_eq!(
        plan_files(&missing, &v.criu),
        Err(SegmentError::Missing(vec![gone]))
    );
}

#[test]
fn hostile_file_names_are_refused() {
    for bad in [
        "",
        "..",
        ".x",
        "a/b",
        "../../etc/passwd",
        "a\0b",
        &"a".repeat(256),
    ] {
        assert_eq!(check_file_name(bad), Err(BadFileName(bad.to_string())));
    }
    assert_eq!(
        BadFileName("a/b".into()).to_string(),
        "\"a/b\" is no CRIU image file name"
    );
    for good in ["pages-1.img", "core-42.img", "inventory.img"] {
        check_file_name(good).unwrap();
    }
}
