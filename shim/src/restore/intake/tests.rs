use super::*;
use crate::checkpoint::criu_image::testing::with_caps as creds;
use crate::checkpoint::criu_image::{ns, testing, Creds};
use crate::checkpoint::provenance::{sign, Statement};
use crate::restore::layers::{LayersError, SnapshotError};
use ed25519_dalek::SigningKey;

fn meta_json(format: u32, process: bool) -> String {
    format!(
        r#"{{"format":{format},"source":{{"namespace":"ns","container":"c","seq":3,"turn_id":"t3"}},
            "fs_layers":[{{"digest":"sha256:{h}","diff_id":"sha256:{h}","size":10,"media_type":"application/vnd.oci.image.layer.v1.tar+zstd"}}],
            "process":{p},"created_at":"2026-01-01T00:00:00Z"}}"#,
        h = "ab".repeat(32),
        p = if process { r#"{"pids":[1,7]}"# } else { "null" }
    )
}

fn key() -> SigningKey {
    SigningKey::from_bytes(&[7; 32])
}

const DEFAULT_CAPS: u64 = 0xa804_25fb;

fn unprivileged() -> Granted {
    Granted {
        gids: vec![0],
        bounding: DEFAULT_CAPS,
        effective: DEFAULT_CAPS,
        permitted: DEFAULT_CAPS,
        namespaces: ns::PID | ns::NET | ns::MNT,
        ..Granted::default()
    }
}

struct Fixture {
    trusted: TrustedKeys,
    granted: Granted,
    unsigned: UnsignedImages,
    limits: ImageLimits,
    cache: Option<RestoreCache>,
    defer: bool,
    /// What the engine says it unpacked (`None`: the rootfs itself is the top layer, a
    /// one-layer image, which is what the signed statements here name).
    unpacked: Option<Result<super::super::layers::Unpacked, LayersError>>,
}

impl Fixture {
    fn new() -> Fixture {
        let mut trusted = TrustedKeys::new();
        trusted.add(key().verifying_key(), "test");
        Fixture {
            trusted,
            granted: unprivileged(),
            unsigned: UnsignedImages::Refuse,
            limits: ImageLimits::NONE,
            cache: None,
            defer: false,
            unpacked: None,
        }
    }

    /// With a restore cache at `dir`.
    fn cached(dir: &Path) -> Fixture {
        Fixture {
            cache: Some(RestoreCache::new(dir, 1 << 30)),
            ..Fixture::new()
        }
    }

    fn take(&self, root: &Path, dest: &Path) -> Result<Option<Taken>, RestoreError> {
        let trusted = || Ok(self.trusted.clone());
        let one_layer = Ok(super::super::layers::Unpacked {
            below_top: None,
            top_dir: root.to_path_buf(),
            source: "test rootfs".into(),
            top: "sha256:test".into(),
        });
        let unpacked = self.unpacked.as_ref().unwrap_or(&one_layer);
        take_from_rootfs(
            root,
            dest,
            &RestoreGuard {
                container: "test",
                trusted: &trusted,
                unsigned: self.unsigned,
                limits: self.limits,
                granted: &self.granted,
                cache: self.cache.as_ref(),
                defer_pages: self.defer,
                unpacked,
            },
        )
    }
}

/// Signs what `dir` (a reserved directory) holds, as `crabctl export` does.
fn sign_dir(dir: &Path, key: &SigningKey) {
    let meta = fs::read(dir.join(META_FILE)).unwrap_or_default();
    let mut criu = BTreeMap::new();
    if let Ok(entries) = fs::read_dir(dir.join(CRIU_DIR)) {
        for e in entries {
            let e = e.unwrap();
            let mut r = HashingReader::new(File::open(e.path()).unwrap());
            io::copy(&mut r, &mut io::sink()).unwrap();
            criu.insert(e.file_name().to_string_lossy().into_owned(), r.finish());
        }
    }
    let statement = Statement {
        checkpoint_json: provenance::sha256(&meta),
        criu,
        layers: Some(Vec::new()),
        rootfs: None,
    };
    fs::write(dir.join(SIGNATURE_FILE), sign(key, statement)).unwrap();
}

/// A rootfs with a signed checkpoint: `meta`, and with `image_creds` a CRIU image of
/// init (pid 1) and pid 7 with those credentials, plus `extra` files.
fn rootfs_with(
    meta: &str,
    image_creds: Option<&Creds>,
    extra: &[(&str, &[u8])],
) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join(RESERVED_DIR);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(META_FILE), meta).unwrap();
    if let Some(c) = image_creds {
        testing::write_image(&dir.join(CRIU_DIR), &[(1, &[]), (7, &[])], c, ns::USER);
    }
    for (name, data) in extra {
        fs::create_dir_all(dir.join(CRIU_DIR)).unwrap();
        fs::write(dir.join(CRIU_DIR).join(name), data).unwrap();
    }
    sign_dir(&dir, &key());
    root
}

#[test]
fn no_reserved_dir_means_no_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let out = Fixture::new()
        .take(root.path(), &root.path().join("x"))
        .unwrap();
    assert!(out.is_none());
}

#[test]
fn takes_the_image_out_and_hides_the_reserved_dir() {
    let root = rootfs_with(
        &meta_json(1, true),
        Some(&creds(DEFAULT_CAPS)),
        &[("pages-1.img", b"pages")],
    );
    let dest = tempfile::tempdir().unwrap();
    let out = Fixture::new()
        .take(root.path(), &dest.path().join("criu"))
        .unwrap()
        .unwrap();
    assert_eq!(out.meta.source.seq, 3);
    assert_eq!(out.meta.process.unwrap().pids, vec![1, 7]);
    let criu = out.criu_dir.unwrap();
    assert_eq!(fs::read(criu.join("pages-1.img")).unwrap(), b"pages");
    assert!(criu.join("core-7.img").is_file());
    assert!(!root.path().join(RESERVED_DIR).exists());
}

#[test]
fn fs_only_checkpoint_has_no_process_image() {
    let root = rootfs_with(&meta_json(1, false), None, &[]);
    let dest = tempfile::tempdir().unwrap();
    let out = Fixture::new()
        .take(root.path(), &dest.path().join("criu"))
        .unwrap()
        .unwrap();
    assert!(out.criu_dir.is_none());
    assert_eq!(out.meta.fs_layers.len(), 1);
    assert!(!root.path().join(RESERVED_DIR).exists());
}

#[test]
fn the_signed_layers_must_be_the_unpacked_ones() {
    use super::super::layers::{chain_ids, Unpacked};
    let sha = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    // Signed over no layer below the checkpoint layer; the engine unpacked one.
    let root = rootfs_with(&meta_json(1, false), None, &[]);
    let f = Fixture {
        unpacked: Some(Ok(Unpacked {
            below_top: chain_ids(&[sha('a')]).pop(),
            top_dir: root.path().to_path_buf(),
            source: "overlayfs snapshot S".into(),
            top: "sha256:test".into(),
        })),
        ..Fixture::new()
    };
    let err = refused(&f, &root);
    assert!(
        matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("not unpacked from the signed layers"),
        "{err}"
    );
    // The engine cannot tell: refused, with its reason.
    let f = Fixture {
        unpacked: Some(Err(LayersError::Engine(SnapshotError::NoRecord(
            "c".into(),
        )))),
        ..Fixture::new()
    };
    let err = refused(&f, &root);
    assert!(
        matches!(err, RestoreError::Provenance(ProvenanceError::Layers(_))),
        "{err}"
    );
    assert!(
        err.to_string().contains("no record of container c"),
        "{err}"
    );
    // A file beside the reserved directory in the top layer.
    fs::write(root.path().join("evil.so"), b"x").unwrap();
    let err = refused(&Fixture::new(), &root);
    assert!(err.to_string().contains("not a checkpoint layer"), "{err}");
    fs::remove_file(root.path().join("evil.so")).unwrap();
    // Signed by an older crab: no layers in the statement.
    let dir = root.path().join(RESERVED_DIR);
    let statement = Statement {
        checkpoint_json: provenance::sha256(&fs::read(dir.join(META_FILE)).unwrap()),
        criu: BTreeMap::new(),
        layers: None,
        rootfs: None,
    };
    fs::write(dir.join(SIGNATURE_FILE), sign(&key(), statement)).unwrap();
    let err = refused(&Fixture::new(), &root);
    assert!(
        err.to_string().contains("export the checkpoint again"),
        "{err}"
    );
    // Unsigned, restored on the kernel check alone: nothing vouched for, no layers asked.
    let unsigned = rootfs_with(&meta_json(1, false), None, &[]);
    fs::remove_file(unsigned.path().join(RESERVED_DIR).join(SIGNATURE_FILE)).unwrap();
    let f = Fixture {
        unsigned: UnsignedImages::KernelCheck,
        unpacked: Some(Err(LayersError::EngineTimedOut)),
        ..Fixture::new()
    };
    let dest = tempfile::tempdir().unwrap();
    assert!(f
        .take(unsigned.path(), &dest.path().join("criu"))
        .unwrap()
        .is_some());
}

/// A refusal leaves the rootfs as it was and nothing at the destination.
fn refused(f: &Fixture, root: &tempfile::TempDir) -> RestoreError {
    let dest = tempfile::tempdir().unwrap();
    let out = dest.path().join("criu");
    let err = f.take(root.path(), &out).unwrap_err();
    assert!(
        root.path().join(RESERVED_DIR).join(META_FILE).exists(),
        "{err}"
    );
    assert!(!out.exists(), "{err}");
    err
}

#[test]
fn a_newer_format_is_refused_and_nothing_is_removed() {
    let root = rootfs_with(
        &meta_json(2, false).replace("\"source\"", "\"future\":1,\"source\""),
        None,
        &[],
    );
    let err = refused(&Fixture::new(), &root);
    assert!(
        matches!(err, RestoreError::NewerFormat { format: 2 }),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade crab"), "{err}");
}

#[test]
fn malformed_descriptions_are_refused() {
    for bad in [
        "not json".to_string(),
        r#"{"source":{}}"#.to_string(),
        r#"{"format":"1"}"#.to_string(),
        meta_json(1, false).replace("\"digest\":\"sha256:abab", "\"digest\":\"sha256:zzzz"),
        meta_json(1, false).replace("\"diff_id\":\"sha256:", "\"diff_id\":\"md5:"),
        meta_json(1, false).replace("tar+zstd", "tar+evil"),
        meta_json(1, false).replace("\"size\":10", "\"size\":0"),
        r#"{"format":1,"source":{"namespace":"n"},"process":null}"#.to_string(),
    ] {
        let root = rootfs_with(&bad, None, &[]);
        let err = refused(&Fixture::new(), &root);
        assert!(
            matches!(
                err,
                RestoreError::BadMeta { .. } | RestoreError::BadLayer { .. }
            ),
            "{bad}: {err}"
        );
    }
}

#[test]
fn a_named_process_image_must_be_there_and_complete() {
    let root = rootfs_with(&meta_json(1, true), None, &[]);
    let err = refused(&Fixture::new(), &root);
    assert!(matches!(err, RestoreError::MissingImage { .. }), "{err}");
    let root = rootfs_with(&meta_json(1, true), None, &[("pages-1.img", b"p")]);
    let err = refused(&Fixture::new(), &root);
    assert!(matches!(err, RestoreError::MissingImage { .. }), "{err}");
}

/// Devices are refused the same way, by the root-only `tests/root_checkpoint.rs`
/// (`restore_never_opens_a_device`): making one needs root.
#[test]
fn symlinks_and_fifos_are_never_followed_or_opened() {
    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("inventory.img"), b"host file").unwrap();
    fs::write(outside.path().join("secret"), meta_json(1, true)).unwrap();
    let f = Fixture::new();
    // The image directory is a symlink to a host directory.
    let root = rootfs_with(&meta_json(1, true), None, &[]);
    std::os::unix::fs::symlink(
        outside.path(),
        root.path().join(RESERVED_DIR).join(CRIU_DIR),
    )
    .unwrap();
    let err = refused(&f, &root);
    assert!(
        matches!(
            err,
            RestoreError::NotPlain {
                found: "a symlink",
                ..
            }
        ),
        "{err}"
    );
    // A file of the image is a symlink.
    let root = rootfs_with(&meta_json(1, true), Some(&creds(DEFAULT_CAPS)), &[]);
    std::os::unix::fs::symlink(
        outside.path().join("secret"),
        root.path().join(RESERVED_DIR).join(CRIU_DIR).join("x.img"),
    )
    .unwrap();
    let err = refused(&f, &root);
    assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
    // The description is a symlink, a FIFO (which would block a plain open forever); so is
    // the signature; so is the reserved directory itself.
    for file in [META_FILE, SIGNATURE_FILE] {
        for kind in ["symlink", "fifo"] {
            let root = rootfs_with(&meta_json(1, false), None, &[]);
            let path = root.path().join(RESERVED_DIR).join(file);
            fs::remove_file(&path).unwrap();
            match kind {
                "symlink" => {
                    std::os::unix::fs::symlink(outside.path().join("secret"), &path).unwrap()
                }
                _ => nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap(),
            }
            // Refused without being opened (a device's `open` would already have run).
            let watch = nix::sys::inotify::Inotify::init(nix::sys::inotify::InitFlags::IN_NONBLOCK)
                .unwrap();
            watch
                .add_watch(&path, nix::sys::inotify::AddWatchFlags::IN_OPEN)
                .unwrap();
            let dest = tempfile::tempdir().unwrap();
            let err = f.take(root.path(), &dest.path().join("criu")).unwrap_err();
            assert!(
                matches!(err, RestoreError::NotPlain { .. }),
                "{file} {kind}: {err}"
            );
            if kind != "symlink" {
                let opened = watch.read_events().unwrap_or_default();
                assert!(opened.is_empty(), "{file} {kind} was opened: {opened:?}");
            }
            assert!(root.path().join(RESERVED_DIR).exists());
        }
    }
    let root = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), root.path().join(RESERVED_DIR)).unwrap();
    let err = f.take(root.path(), &root.path().join("out")).unwrap_err();
    assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
    assert!(outside.path().join("secret").exists());
}

#[test]
fn an_unsigned_image_is_refused_or_started_fresh_as_configured() {
    let root = rootfs_with(&meta_json(1, true), Some(&creds(DEFAULT_CAPS)), &[]);
    fs::remove_file(root.path().join(RESERVED_DIR).join(SIGNATURE_FILE)).unwrap();
    let mut f = Fixture::new();
    let err = refused(&f, &root);
    assert!(
        err.to_string()
            .contains("checkpoint image not signed by a trusted key: it carries no signature"),
        "{err}"
    );
    // Signed, but by a key this host does not trust.
    sign_dir(
        &root.path().join(RESERVED_DIR),
        &SigningKey::from_bytes(&[8; 32]),
    );
    let err = refused(&f, &root);
    assert!(
        err.to_string().contains("not among the 1 trusted key")
            && err.to_string().contains(" from test")
            && err
                .to_string()
                .contains("[restore] trusted_keys in this one"),
        "{err}"
    );
    // start-fresh: the reserved directory goes, the container starts as an ordinary image.
    f.unsigned = UnsignedImages::StartFresh;
    let dest = tempfile::tempdir().unwrap();
    let out = f.take(root.path(), &dest.path().join("criu")).unwrap();
    assert!(out.is_none());
    assert!(!root.path().join(RESERVED_DIR).exists());
    assert!(!dest.path().join("criu").exists());
}

#[test]
fn an_image_altered_after_signing_is_refused_whatever_the_config() {
    let mut f = Fixture::new();
    f.unsigned = UnsignedImages::StartFresh;
    type Alteration = (&'static str, Box<dyn Fn(&Path)>);
    let alter: [Alteration; 4] = [
        (
            "criu/pages-1.img is 5 bytes",
            Box::new(|d: &Path| fs::write(d.join(CRIU_DIR).join("pages-1.img"), b"PAGES").unwrap()),
        ),
        (
            "not signed",
            Box::new(|d: &Path| fs::write(d.join(CRIU_DIR).join("pages-2.img"), b"x").unwrap()),
        ),
        (
            "missing",
            Box::new(|d: &Path| fs::remove_file(d.join(CRIU_DIR).join("pages-1.img")).unwrap()),
        ),
        (
            "checkpoint.json is",
            Box::new(|d: &Path| {
                fs::write(d.join(META_FILE), meta_json(1, true).replace("t3", "t4")).unwrap()
            }),
        ),
    ];
    for (want, change) in alter {
        let root = rootfs_with(
            &meta_json(1, true),
            Some(&creds(DEFAULT_CAPS)),
            &[("pages-1.img", b"pages")],
        );
        change(&root.path().join(RESERVED_DIR));
        let err = refused(&f, &root);
        assert!(
            matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
            "{want}: {err}"
        );
        assert!(err.to_string().contains(want), "{want}: {err}");
    }
}

/// With the restore cache: the second restore of an image links the verified copy; an image
/// whose files are not the signed ones by name or size is still refused, one altered in
/// place (same size) restores the verified bytes, never its own; privileges are checked
/// on every restore.
#[test]
fn with_the_restore_cache_each_image_is_verified_once_and_hostile_ones_still_fail() {
    let cache_dir = tempfile::tempdir().unwrap();
    let f = Fixture::cached(cache_dir.path());
    let image = || {
        rootfs_with(
            &meta_json(1, true),
            Some(&creds(DEFAULT_CAPS)),
            &[("pages-1.img", b"pages")],
        )
    };
    let dest = tempfile::tempdir().unwrap();
    let first = f
        .take(image().path(), &dest.path().join("1"))
        .unwrap()
        .unwrap();
    let (cache, files) = first.cached.clone().unwrap();
    let key = RestoreCache::key(&files);
    let cached = super::super::cache::testing::image_dir(&cache, &key);
    let ino = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(p).unwrap().ino()
    };
    let second = f
        .take(image().path(), &dest.path().join("2"))
        .unwrap()
        .unwrap();
    let criu = second.criu_dir.clone().unwrap();
    assert_eq!(
        ino(&criu.join("pages-1.img")),
        ino(&cached.join("pages-1.img"))
    );
    assert!(criu.join("core-7.img").is_file());
    // Altered in place after signing, same size: the verified bytes restore, not these.
    let root = image();
    fs::write(
        root.path()
            .join(RESERVED_DIR)
            .join(CRIU_DIR)
            .join("pages-1.img"),
        b"PAGES",
    )
    .unwrap();
    let taken = f
        .take(root.path(), &dest.path().join("3"))
        .unwrap()
        .unwrap();
    assert_eq!(
        fs::read(taken.criu_dir.unwrap().join("pages-1.img")).unwrap(),
        b"pages"
    );
    // Cut short, planted or missing files are refused, as without the cache.
    type Alteration = (&'static str, Box<dyn Fn(&Path)>);
    let alter: [Alteration; 3] = [
        (
            "criu/pages-1.img is 2 bytes, the signed one 5 bytes",
            Box::new(|d: &Path| fs::write(d.join(CRIU_DIR).join("pages-1.img"), b"pa").unwrap()),
        ),
        (
            "criu/pages-2.img was not signed",
            Box::new(|d: &Path| fs::write(d.join(CRIU_DIR).join("pages-2.img"), b"x").unwrap()),
        ),
        (
            "criu/pages-1.img was signed but is missing",
            Box::new(|d: &Path| fs::remove_file(d.join(CRIU_DIR).join("pages-1.img")).unwrap()),
        ),
    ];
    for (want, change) in alter {
        let root = image();
        change(&root.path().join(RESERVED_DIR));
        let err = refused(&f, &root);
        assert!(
            matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
            "{want}: {err}"
        );
        assert!(err.to_string().contains(want), "{want}: {err}");
    }
    // Over the bounds: refused before the cache is asked.
    let mut bounded = Fixture::cached(cache_dir.path());
    bounded.limits = ImageLimits {
        max_bytes: 4,
        max_files: 100,
    };
    let err = refused(&bounded, &image());
    assert!(err.to_string().contains("max_image_mib"), "{err}");
    // A privileged image cached by a privileged restore is refused under a spec that does
    // not grant it.
    let privileged = || rootfs_with(&meta_json(1, true), Some(&creds(0x1ff_ffff_ffff)), &[]);
    let mut p = Fixture::cached(cache_dir.path());
    p.granted.bounding = 0x1ff_ffff_ffff;
    p.granted.permitted = 0x1ff_ffff_ffff;
    p.take(privileged().path(), &dest.path().join("4"))
        .unwrap()
        .unwrap();
    let err = refused(&f, &privileged());
    assert!(err.to_string().contains("CAP_SYS_ADMIN"), "{err}");
    // The stores of the restored containers import the cached image: both rebuild it byte
    // for byte, from one pack.
    for (i, ns) in ["a", "b"].iter().enumerate() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let t = if i == 0 { &first } else { &second };
        let m = restored_manifest(&store, ns, "fork", t).unwrap();
        let p = m.process.unwrap();
        let dir = store.root().join(&p.image);
        assert!(dir.join("pages-1.img.recipe").is_file());
        pages::materialize(&dir, &store.chunks_dir()).unwrap();
        assert_eq!(fs::read(dir.join("pages-1.img")).unwrap(), b"pages");
        assert_eq!(p.bytes_logical, files.values().map(|d| d.size).sum::<u64>());
    }
}

/// Page data of `n` bytes, different for each `seed`.
fn page_data(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

#[test]
fn large_page_files_are_verified_while_the_restore_goes_on() {
    let big = DEFER_MIN_BYTES as usize + 4096;
    assert!(deferrable("pages-1.img", big as u64));
    assert!(!deferrable("pages-1.img", DEFER_MIN_BYTES - 1));
    assert!(!deferrable("core-1.img", big as u64) && !deferrable("pstree.img", big as u64));
    for cached in [false, true] {
        let cache_dir = tempfile::tempdir().unwrap();
        let mut f = match cached {
            true => Fixture::cached(cache_dir.path()),
            false => Fixture::new(),
        };
        f.defer = true;
        // Signed as it is: taken at once, its large page file checked on the side.
        let good = page_data(big, 1);
        let root = rootfs_with(
            &meta_json(1, true),
            Some(&creds(DEFAULT_CAPS)),
            &[("pages-1.img", &good), ("pages-2.img", b"small")],
        );
        let dest = tempfile::tempdir().unwrap();
        let t = f
            .take(root.path(), &dest.path().join("img"))
            .unwrap()
            .unwrap();
        let v = t
            .verification
            .clone()
            .expect("the large page file is deferred");
        assert_eq!(v.bytes(), big as u64);
        assert!(v.wait().result.is_ok());
        assert_eq!(
            fs::read(dest.path().join("img/pages-1.img")).unwrap(),
            good,
            "copied whole"
        );
        if let Some(cache) = &f.cache {
            // Published once it passed: a second restore takes the cached copy.
            let key = RestoreCache::key(&t.cached.as_ref().unwrap().1);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !restore_cache::testing::image_dir(cache, &key).exists() {
                assert!(Instant::now() < deadline, "never published");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        // Altered after signing (a rootfs each time: a taken image leaves it).
        let altered = |len: usize| {
            let root = rootfs_with(
                &meta_json(1, true),
                Some(&creds(DEFAULT_CAPS)),
                &[("pages-1.img", &page_data(big, 2))],
            );
            let path = root
                .path()
                .join(RESERVED_DIR)
                .join(CRIU_DIR)
                .join("pages-1.img");
            fs::write(path, page_data(len, 3)).unwrap();
            root
        };
        // At the same size (what the sizes cannot show): taken, but the verdict refuses
        // it, naming the file; and nothing enters the cache.
        for attempt in 0..2 {
            let dest = tempfile::tempdir().unwrap();
            let t = f
                .take(altered(big).path(), &dest.path().join("img"))
                .unwrap()
                .unwrap();
            let why = t.verification.clone().unwrap().wait().result.unwrap_err();
            assert!(
                matches!(*why, RestoreError::Provenance(ProvenanceError::Altered(_))),
                "{why}"
            );
            let why = why.to_string();
            assert!(
                why.contains("altered after signing") && why.contains("criu/pages-1.img"),
                "{why}"
            );
            if let Some(cache) = &f.cache {
                // Verified again at the second attempt (and refused again).
                assert_eq!(
                    t.cached.as_ref().map(|_| ()),
                    Some(()),
                    "attempt {attempt}: built into the cache, not published"
                );
                let key = RestoreCache::key(&t.cached.as_ref().unwrap().1);
                std::thread::sleep(Duration::from_millis(50));
                assert!(!restore_cache::testing::image_dir(cache, &key).exists());
            }
        }
        // A size that does not match is still refused before anything is taken.
        let err = refused(&f, &altered(big + 1));
        assert!(
            matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
            "{err}"
        );
        // Without deferral, the same altered image is refused at once.
        f.defer = false;
        let err = refused(&f, &altered(big));
        assert!(err.to_string().contains("criu/pages-1.img"), "{err}");
    }
}

#[test]
fn a_signed_image_asking_for_more_than_the_spec_grants_is_refused() {
    // Signed by a trusted key (crab's own export of a privileged container), yet refused.
    let root = rootfs_with(&meta_json(1, true), Some(&creds(0x1ff_ffff_ffff)), &[]);
    let err = refused(&Fixture::new(), &root);
    assert!(matches!(err, RestoreError::Privilege(_)), "{err}");
    assert!(err.to_string().contains("CAP_SYS_ADMIN"), "{err}");
    // Under a privileged spec the same image restores.
    let mut f = Fixture::new();
    f.granted.bounding = 0x1ff_ffff_ffff;
    f.granted.permitted = 0x1ff_ffff_ffff;
    let dest = tempfile::tempdir().unwrap();
    f.take(root.path(), &dest.path().join("criu"))
        .unwrap()
        .unwrap();
}

#[test]
fn image_bounds_are_checked_before_copying() {
    let root = rootfs_with(
        &meta_json(1, true),
        Some(&creds(DEFAULT_CAPS)),
        &[("pages-1.img", &[0u8; 4096])],
    );
    let mut f = Fixture::new();
    f.limits = ImageLimits {
        max_bytes: 4096,
        max_files: 100,
    };
    let err = refused(&f, &root);
    assert!(err.to_string().contains("max_image_mib"), "{err}");
    f.limits = ImageLimits {
        max_bytes: u64::MAX,
        max_files: 3,
    };
    let err = refused(&f, &root);
    assert!(err.to_string().contains("max_image_files"), "{err}");
}

#[test]
fn origin_manifests() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let m = created_manifest(&store, " from image x").unwrap();
    assert_eq!(
        (m.seq, m.kind, m.parent),
        (1, CheckpointKind::Created, None)
    );
    assert!(m.fs_layers.is_empty() && m.process.is_none());
    store.publish(&m).unwrap();

    // Restored from another container: the chain is inherited, the image imported.
    let root = rootfs_with(
        &meta_json(1, true),
        Some(&creds(DEFAULT_CAPS)),
        &[("pages-1.img", &[7u8; 8192])],
    );
    let taken = Fixture::new()
        .take(root.path(), &root.path().join("out"))
        .unwrap()
        .unwrap();
    let r = restored_manifest(&store, "ns", "other", &taken).unwrap();
    assert_eq!(
        (r.seq, r.kind, r.parent),
        (2, CheckpointKind::Restored, None)
    );
    assert_eq!(r.fs_layers, taken.meta.fs_layers);
    let p = r.process.clone().unwrap();
    assert_eq!(p.pids, vec![1, 7]);
    assert!(store.root().join(&p.image).join("inventory.img").is_file());
    assert!(
        r.explanation.contains("ns/c checkpoint 3"),
        "{}",
        r.explanation
    );
}
