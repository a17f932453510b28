use std::collections::BTreeMap;

use super::*;
use crab_shim::checkpoint::store::MEDIA_TYPE_LAYER_TAR;
use crab_shim::restore::intake::{ProcessMeta, Source, META_FORMAT};

fn hexd(c: char) -> String {
    format!("sha256:{}", c.to_string().repeat(64))
}

fn agent_image() -> (Value, Value) {
    let manifest = json!({
        "schemaVersion": 2,
        "config": {"mediaType": MediaType::ImageConfig, "digest": hexd('c'), "size": 500},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": hexd('a'), "size": 1000,
                    "annotations": {"x": "y"}}],
    });
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/bin"], "Entrypoint": ["/init"], "Cmd": ["bash"], "WorkingDir": "/app", "User": "1000"},
        "rootfs": {"type": "layers", "diff_ids": [hexd('d')]},
        "history": [{"created_by": "add layer"}, {"created_by": "config", "empty_layer": true}],
    });
    (manifest, config)
}

fn layer(c: char) -> Descriptor {
    Descriptor {
        digest: hexd(c),
        diff_id: hexd(c.to_ascii_uppercase()),
        size: 10,
        media_type: MEDIA_TYPE_LAYER_ZSTD.into(),
    }
}

fn provenance() -> Provenance<'static> {
    Provenance {
        source: "ns/c@3",
        turn_id: "t3",
        created: "2026-01-01T00:00:00.000Z",
    }
}

fn checkpoint_blob() -> LayerBlob {
    LayerBlob {
        digest: hexd('e'),
        diff_id: hexd('f'),
        size: 77,
    }
}

#[test]
fn builds_on_the_base_and_keeps_its_process_settings() {
    let (manifest, config) = agent_image();
    let base = base_of(&manifest, &config).unwrap();
    assert_eq!(base.layers.len(), 1);
    assert_eq!(
        base.layers[0].annotations(),
        &Some([("x".to_string(), "y".to_string())].into())
    );
    let img = build(
        &base,
        &[layer('1'), layer('2')],
        &checkpoint_blob(),
        &provenance(),
    )
    .unwrap();
    let m: Value = serde_json::from_slice(&img.manifest).unwrap();
    let c: Value = serde_json::from_slice(&img.config).unwrap();
    assert_eq!(m["mediaType"], MediaType::ImageManifest.to_string());
    assert_eq!(m["config"]["digest"].as_str().unwrap(), img.config_digest());
    assert_eq!(m["config"]["size"], img.config.len());
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    assert_eq!(
        layers[0]["annotations"],
        json!({"x": "y"}),
        "base descriptors kept as they are"
    );
    assert_eq!(layers[1]["digest"], hexd('1'));
    assert_eq!(layers[3]["digest"], hexd('e'));
    assert_eq!(layers[3]["mediaType"], MEDIA_TYPE_LAYER_ZSTD);
    assert_eq!(
        c["rootfs"]["diff_ids"],
        json!([
            hexd('d'),
            hexd('1').to_uppercase().replace("SHA256", "sha256"),
            hexd('2').to_uppercase().replace("SHA256", "sha256"),
            hexd('f')
        ])
    );
    for key in ["Env", "Entrypoint", "Cmd", "WorkingDir", "User"] {
        assert_eq!(c["config"][key], config["config"][key], "{key}");
    }
    assert_eq!(c["config"]["Labels"][LABEL_BASE_LAYERS], "1");
    assert_eq!(c["config"]["Labels"][LABEL_SOURCE], "ns/c@3");
    assert_eq!(c["created"], "2026-01-01T00:00:00.000Z");
    let history = c["history"].as_array().unwrap();
    assert_eq!(history.len(), 2 + 3);
    assert!(history[4]["created_by"]
        .as_str()
        .unwrap()
        .contains("ns/c@3"));
    let labels = img.manifest_gc_labels();
    assert_eq!(
        labels["containerd.io/gc.ref.content.config"],
        img.config_digest()
    );
    assert_eq!(labels["containerd.io/gc.ref.content.l.3"], hexd('e'));
    assert_eq!(labels.len(), 5);
    assert_eq!(img.chain_ids()[0], hexd('d'));
    assert_eq!(img.chain_ids().len(), 4);
    // Deterministic: the same checkpoint gives the same image.
    assert_eq!(
        build(
            &base,
            &[layer('1'), layer('2')],
            &checkpoint_blob(),
            &provenance()
        )
        .unwrap(),
        img
    );
}

#[test]
fn a_files_only_image_is_a_plain_image_whole_as_a_base() {
    let (manifest, config) = agent_image();
    let base = base_of(&manifest, &config).unwrap();
    let img = build_files(&base, &[layer('1'), layer('2')], &provenance()).unwrap();
    let m: Value = serde_json::from_slice(&img.manifest).unwrap();
    let c: Value = serde_json::from_slice(&img.config).unwrap();
    let layers = m["layers"].as_array().unwrap();
    // The base and the fs layers, no checkpoint layer.
    assert_eq!(layers.len(), 3);
    assert_eq!(layers[2]["digest"], hexd('2'));
    assert_eq!(c["rootfs"]["diff_ids"].as_array().unwrap().len(), 3);
    for key in ["Env", "Entrypoint", "Cmd", "WorkingDir", "User"] {
        assert_eq!(c["config"][key], config["config"][key], "{key}");
    }
    // No crab label: nothing takes it for a checkpoint image, and as a base it is whole.
    assert!(
        c["config"]["Labels"].get(LABEL_BASE_LAYERS).is_none(),
        "{c}"
    );
    assert!(c["config"]["Labels"].get(LABEL_SOURCE).is_none(), "{c}");
    let again = base_of(&m, &c).unwrap();
    assert_eq!(again.layers.len(), 3);
    let history = c["history"].as_array().unwrap();
    assert_eq!(history.len(), 2 + 2);
    assert!(history[3]["created_by"]
        .as_str()
        .unwrap()
        .contains("files only"));
}

#[test]
fn a_checkpoint_image_as_base_contributes_only_its_base() {
    let (manifest, config) = agent_image();
    let base = base_of(&manifest, &config).unwrap();
    let first = build(&base, &[layer('1')], &checkpoint_blob(), &provenance()).unwrap();
    let m: Value = serde_json::from_slice(&first.manifest).unwrap();
    let c: Value = serde_json::from_slice(&first.config).unwrap();
    let mut again = base_of(&m, &c).unwrap();
    assert_eq!(again.config["created"], "2026-01-01T00:00:00.000Z");
    again.config.as_object_mut().unwrap().remove("created");
    assert_eq!(
        again, base,
        "crab's layers, history and labels are stripped"
    );
    let mut labelled = config.clone();
    labelled["config"]["Labels"] = json!({"keep": "me"});
    let img = build(
        &base_of(&manifest, &labelled).unwrap(),
        &[],
        &checkpoint_blob(),
        &provenance(),
    )
    .unwrap();
    let c: Value = serde_json::from_slice(&img.config).unwrap();
    assert_eq!(c["config"]["Labels"]["keep"], "me");
    let stripped = base_of(&serde_json::from_slice(&img.manifest).unwrap(), &c).unwrap();
    assert_eq!(
        config_labels(&stripped.config),
        BTreeMap::from([("keep".to_string(), "me".to_string())])
    );
}

#[test]
fn bad_bases_are_named() {
    let (manifest, mut config) = agent_image();
    config["rootfs"]["diff_ids"] = json!([]);
    assert!(base_of(&manifest, &config)
        .unwrap_err()
        .to_string()
        .contains("1 layers in the manifest but 0 diff ids"));
    let (manifest, mut config) = agent_image();
    config["config"]["Labels"] = json!({LABEL_BASE_LAYERS: "7"});
    assert!(base_of(&manifest, &config)
        .unwrap_err()
        .to_string()
        .contains(LABEL_BASE_LAYERS));
    let index = json!({"manifests": [
        {"mediaType": MediaType::ImageManifest, "digest": hexd('1'), "size": 1, "platform": {"os": "linux", "architecture": "s390x"}},
        {"mediaType": MediaType::ImageManifest, "digest": hexd('2'), "size": 1, "platform": {"os": "linux", "architecture": host_platform().1}},
    ]});
    assert_eq!(pick_manifest(&index).unwrap().digest().as_ref(), hexd('2'));
    assert!(pick_manifest(&json!({"manifests": []})).is_err());
}

#[test]
fn the_config_runs_the_containers_process() {
    let spec = json!({
        "hostname": "3f4e2b0c9d1a",
        "process": {
            "args": ["/init", "sleep", "infinity"],
            "env": ["PATH=/bin", "HOSTNAME=3f4e2b0c9d1a", "A=1", "HOSTNAME=other"],
            "cwd": "/work",
        },
    });
    // The base's Entrypoint begins the args: kept, Cmd the rest.
    let (_, mut config) = agent_image();
    set_process(&mut config, &spec);
    let c = &config["config"];
    assert_eq!(c["Entrypoint"], json!(["/init"]));
    assert_eq!(c["Cmd"], json!(["sleep", "infinity"]));
    assert_eq!(c["Env"], json!(["PATH=/bin", "A=1", "HOSTNAME=other"]));
    assert_eq!(c["WorkingDir"], "/work");
    assert_eq!(c["User"], "1000", "the rest stays");
    // Another Entrypoint is dropped: the args alone are the command.
    let mut other = spec.clone();
    other["process"]["args"] = json!(["python3", "-m", "http.server"]);
    let (_, mut config) = agent_image();
    set_process(&mut config, &other);
    assert_eq!(config["config"]["Entrypoint"], Value::Null);
    assert_eq!(config["config"]["Cmd"], other["process"]["args"]);
    // A base without any process settings (a rootfs base: Docker's) gets them all.
    let mut bare = rootfs_base(vec![]).config;
    set_process(&mut bare, &spec);
    assert_eq!(bare["config"]["Cmd"], spec["process"]["args"]);
    assert_eq!(bare["config"]["Entrypoint"], Value::Null);
    let mut not_object = json!("x");
    set_process(&mut not_object, &spec);
    assert_eq!(not_object["config"]["WorkingDir"], "/work");
    // A spec without args (or none) changes nothing; junk is ignored, never a panic.
    for junk in [
        json!({}),
        json!({"process": {"args": []}}),
        json!({"process": {"args": [1, 2]}}),
        json!({"process": "x"}),
        json!([1]),
    ] {
        let (_, mut config) = agent_image();
        let before = config.clone();
        set_process(&mut config, &junk);
        assert_eq!(config, before, "{junk}");
    }
    let mut odd = spec.clone();
    odd["process"]["cwd"] = json!("relative");
    odd["process"]["env"] = json!("PATH=/x");
    let (_, mut config) = agent_image();
    set_process(&mut config, &odd);
    assert_eq!(config["config"]["WorkingDir"], "/app");
    assert_eq!(config["config"]["Env"], json!(["PATH=/usr/bin"]));
}

#[test]
fn a_rootfs_base_and_its_compressed_layers() {
    let tar = b"not really a tar, but bytes".repeat(100);
    let mut out = Vec::new();
    let blob = compress_layer(&tar[..], &mut out).unwrap();
    assert_eq!(blob.size, out.len() as u64);
    assert_eq!(blob.digest, sha256_of(&out));
    assert_eq!(blob.diff_id, sha256_of(&tar));
    assert_eq!(zstd::decode_all(&out[..]).unwrap(), tar);
    let base_layer = |c: char| {
        (
            descriptor(MEDIA_TYPE_LAYER_ZSTD, &hexd(c), 5).unwrap(),
            hexd(c.to_ascii_uppercase()),
        )
    };
    let base = rootfs_base(vec![base_layer('1'), base_layer('2')]);
    assert_eq!(base.layers.len(), 2);
    assert_eq!(base.config["rootfs"]["diff_ids"], json!(base.diff_ids));
    assert_eq!(base.config["history"].as_array().unwrap().len(), 2);
    assert_eq!(base.config["os"], "linux");
    // A checkpoint image on it is a valid base again (history and layers agree).
    let img = build(&base, &[layer('3')], &checkpoint_blob(), &provenance()).unwrap();
    let again = base_of(
        &serde_json::from_slice(&img.manifest).unwrap(),
        &serde_json::from_slice(&img.config).unwrap(),
    )
    .unwrap();
    assert_eq!(again.layers, base.layers);
}

fn meta(process: bool) -> CheckpointMeta {
    CheckpointMeta {
        format: META_FORMAT,
        source: Source {
            namespace: "ns".into(),
            container: "c".into(),
            seq: 3,
            turn_id: "t3".into(),
        },
        fs_layers: vec![layer('1')],
        process: process.then(|| ProcessMeta { pids: vec![1, 9] }),
        created_at: "2026-01-01T00:00:00.000Z".into(),
        volumes: Vec::new(),
        annotations: Default::default(),
    }
}

fn key() -> SigningKey {
    SigningKey::from_bytes(&[3; 32])
}

fn trusted() -> provenance::TrustedKeys {
    let mut t = provenance::TrustedKeys::new();
    t.add(key().verifying_key(), "test");
    t
}

/// The layer's entries: path -> (type, mode, mtime, data).
fn entries(blob: &[u8]) -> BTreeMap<String, (tar::EntryType, u32, u64, Vec<u8>)> {
    let tar = zstd::decode_all(blob).unwrap();
    let mut out = BTreeMap::new();
    for e in tar::Archive::new(&tar[..]).entries().unwrap() {
        let mut e = e.unwrap();
        let path = e.path().unwrap().to_string_lossy().into_owned();
        let h = e.header().clone();
        let mut data = Vec::new();
        e.read_to_end(&mut data).unwrap();
        assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
        out.insert(
            path,
            (h.entry_type(), h.mode().unwrap(), h.mtime().unwrap(), data),
        );
    }
    out
}

#[test]
fn fs_only_checkpoint_layer_holds_the_description() {
    let mut out = Vec::new();
    let blob = write_checkpoint_layer(&meta(false), &[], None, &key(), &mut out).unwrap();
    assert_eq!(blob.size, out.len() as u64);
    assert_eq!(blob.digest, sha256_of(&out));
    assert_eq!(
        blob.diff_id,
        sha256_of(&zstd::decode_all(&out[..]).unwrap())
    );
    let e = entries(&out);
    assert_eq!(
        e.keys().collect::<Vec<_>>(),
        [
            ".crab-checkpoint/",
            ".crab-checkpoint/.wh..wh..opq",
            ".crab-checkpoint/checkpoint.json",
            ".crab-checkpoint/signature.json",
        ]
    );
    // Signed: the signature vouches for the description and no CRIU file.
    let statement = trusted()
        .verify(
            &e[".crab-checkpoint/signature.json"].3,
            &e[".crab-checkpoint/checkpoint.json"].3,
        )
        .unwrap();
    assert!(statement.criu.is_empty());
    assert_eq!(e[".crab-checkpoint/"].0, tar::EntryType::Directory);
    let (kind, mode, mtime, json) = &e[".crab-checkpoint/checkpoint.json"];
    assert_eq!((*kind, *mode, *mtime), (tar::EntryType::Regular, 0o600, 0));
    let parsed = CheckpointMeta::parse(Path::new("x"), json).unwrap();
    assert_eq!(parsed, meta(false));
    let v: Value = serde_json::from_slice(json).unwrap();
    assert_eq!(v["process"], Value::Null);
    assert_eq!(v["source"]["container"], "c");
    assert_eq!(v["fs_layers"][0]["diff_id"], hexd('1'));
    // Deterministic.
    let mut again = Vec::new();
    assert_eq!(
        write_checkpoint_layer(&meta(false), &[], None, &key(), &mut again).unwrap(),
        blob
    );
    assert_eq!(
        MEDIA_TYPE_LAYER_TAR,
        "application/vnd.oci.image.layer.v1.tar"
    );
}

#[test]
fn process_checkpoint_layer_carries_the_criu_image_with_pages_materialized() {
    let tmp = tempfile::tempdir().unwrap();
    let (img, chunks) = (tmp.path().join("proc"), tmp.path().join("chunks"));
    fs::create_dir_all(&img).unwrap();
    let pages_data: Vec<u8> = (0..3 * pages::CHUNK_SIZE + 5)
        .map(|i| (i % 251) as u8)
        .collect();
    fs::write(img.join("pages-1.img"), &pages_data).unwrap();
    fs::write(img.join("pagemap-1.img"), b"map").unwrap();
    fs::write(img.join("inventory.img"), b"inv").unwrap();
    fs::write(img.join("descriptors.json"), b"[]").unwrap();
    pages::dedup(&img, &chunks).unwrap();
    fs::write(img.join(".leftover.tmp"), b"x").unwrap();
    let mut out = Vec::new();
    write_checkpoint_layer(
        &meta(true),
        &[],
        Some(CriuSource {
            dir: &img,
            chunks: &chunks,
        }),
        &key(),
        &mut out,
    )
    .unwrap();
    let e = entries(&out);
    let names: Vec<&str> = e.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            ".crab-checkpoint/",
            ".crab-checkpoint/.wh..wh..opq",
            ".crab-checkpoint/checkpoint.json",
            ".crab-checkpoint/criu/",
            ".crab-checkpoint/criu/descriptors.json",
            ".crab-checkpoint/criu/inventory.img",
            ".crab-checkpoint/criu/pagemap-1.img",
            ".crab-checkpoint/criu/pages-1.img",
            ".crab-checkpoint/signature.json",
        ]
    );
    // The signature names every CRIU file as written, the pages materialized.
    let statement = trusted()
        .verify(
            &e[".crab-checkpoint/signature.json"].3,
            &e[".crab-checkpoint/checkpoint.json"].3,
        )
        .unwrap();
    let files: Vec<&str> = statement.criu.keys().map(String::as_str).collect();
    assert_eq!(
        files,
        [
            "descriptors.json",
            "inventory.img",
            "pagemap-1.img",
            "pages-1.img"
        ]
    );
    assert_eq!(statement.criu["pages-1.img"].sha256, sha256_of(&pages_data));
    assert_eq!(statement.criu["pages-1.img"].size, pages_data.len() as u64);
    assert_eq!(e[".crab-checkpoint/criu/pages-1.img"].3, pages_data);
    assert_eq!(e[".crab-checkpoint/criu/inventory.img"].3, b"inv");
    assert!(
        img.join("pages-1.img.recipe").exists() && !img.join("pages-1.img").exists(),
        "the store is unchanged"
    );
    // Materialized in place too: still one entry.
    pages::materialize(&img, &chunks).unwrap();
    let mut again = Vec::new();
    write_checkpoint_layer(
        &meta(true),
        &[],
        Some(CriuSource {
            dir: &img,
            chunks: &chunks,
        }),
        &key(),
        &mut again,
    )
    .unwrap();
    assert_eq!(again, out);
    // A missing chunk fails the layer.
    for f in fs::read_dir(&chunks).unwrap() {
        fs::remove_file(f.unwrap().path()).unwrap();
    }
    let e = write_checkpoint_layer(
        &meta(true),
        &[],
        Some(CriuSource {
            dir: &img,
            chunks: &chunks,
        }),
        &key(),
        &mut Vec::new(),
    )
    .unwrap_err();
    assert!(matches!(e, ImageError::Pages(_)), "{e}");
    // Anything but plain files is refused.
    fs::remove_file(img.join("pages-1.img.recipe")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", img.join("evil.img")).unwrap();
    let e = write_checkpoint_layer(
        &meta(true),
        &[],
        Some(CriuSource {
            dir: &img,
            chunks: &chunks,
        }),
        &key(),
        &mut Vec::new(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::NotPlain {
                found: "a symlink",
                ..
            }
        ),
        "{e}"
    );
}
