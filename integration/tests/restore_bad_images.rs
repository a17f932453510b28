//! Bad checkpoint images: each is a real checkpoint image (exported by crabctl) with one thing
//! broken, re-imported with `ctr images import`, then started with `ctr run` under crab. Each
//! must fail with a clear error and leave nothing half-started (no task, no container, no
//! mounts or cgroups), and nothing may be written outside the container's rootfs:
//! - a checkpoint description of an unknown newer format;
//! - a CRIU image that does not match (files of it missing or cut short);
//! - a truncated layer (its digest no longer matches);
//! - layer entries with `..`, absolute paths, or through a symlink that points out of the rootfs
//!   (containerd's layer applier resolves every entry inside the rootfs: crab applies no layer
//!   itself, so this checks the path crab depends on);
//! - a truncated layer blob or a corrupted manifest in crab's own store (crabctl export).

use std::{
    collections::HashMap,
    io::{Read, Write},
    path::{Path, PathBuf},
};

use crab_integration::{
    sandbox::{Sandbox, SandboxOptions},
    Harness,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn sha256(data: &[u8]) -> String {
    format!(
        "sha256:{}",
        Sha256::digest(data)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

/// An OCI image archive (`ctr images export`): its files by path.
struct Archive {
    files: HashMap<String, Vec<u8>>,
}

impl Archive {
    /// The archive at `path`, if it is a whole one (an index and readable entries).
    fn try_read(path: &Path) -> Result<Archive, String> {
        let data = std::fs::read(path).map_err(|e| e.to_string())?;
        let mut files = HashMap::new();
        for e in tar::Archive::new(&data[..])
            .entries()
            .map_err(|e| e.to_string())?
        {
            let mut e = e.map_err(|e| e.to_string())?;
            let name = e
                .path()
                .map_err(|e| e.to_string())?
                .to_string_lossy()
                .into_owned();
            let mut buf = Vec::new();
            e.read_to_end(&mut buf).map_err(|e| e.to_string())?;
            files.insert(name, buf);
        }
        if !files.contains_key("index.json") {
            return Err(format!("no index.json among {} entries", files.len()));
        }
        Ok(Archive { files })
    }

    /// `ctr images export` of `reference` to `path` (checked whole, see
    /// [`crab_integration::ctr::Ctr::export_image`]), read back.
    fn export(h: &Harness, reference: &str, path: &Path) -> Archive {
        h.ctr()
            .export_image(reference, path)
            .unwrap_or_else(|e| panic!("{e}"));
        Archive::try_read(path).unwrap_or_else(|e| panic!("{reference}: {e}"))
    }

    fn blob(&self, digest: &str) -> &[u8] {
        &self.files[&format!("blobs/sha256/{}", digest.strip_prefix("sha256:").unwrap())]
    }

    fn put_blob(&mut self, data: Vec<u8>) -> String {
        let digest = sha256(&data);
        self.files.insert(
            format!("blobs/sha256/{}", digest.strip_prefix("sha256:").unwrap()),
            data,
        );
        digest
    }

    fn manifest(&self) -> Value {
        let index: Value = serde_json::from_slice(&self.files["index.json"]).unwrap();
        serde_json::from_slice(self.blob(index["manifests"][0]["digest"].as_str().unwrap()))
            .unwrap()
    }

    /// Replaces the last layer with `tar` (uncompressed), or its blob with `raw_blob` kept under
    /// the old digest (a corrupt download), and names the result `name`.
    fn with_last_layer(
        &self,
        name: &str,
        tar: Option<Vec<u8>>,
        raw_blob: Option<Vec<u8>>,
    ) -> Archive {
        self.with_layers(name, |layers, a| {
            let last = layers.len() - 1;
            if let Some(tar) = tar {
                layers[last] = a.add_layer(tar);
            }
            if let Some(raw) = raw_blob {
                let digest = layers[last].0["digest"].as_str().unwrap().to_string();
                a.files.insert(
                    format!("blobs/sha256/{}", digest.strip_prefix("sha256:").unwrap()),
                    raw,
                );
            }
        })
    }

    /// The image with its layers edited: `edit` gets (descriptor, diff_id) of every layer,
    /// oldest first; named `name`.
    fn with_layers(
        &self,
        name: &str,
        edit: impl FnOnce(&mut Vec<(Value, String)>, &mut Archive),
    ) -> Archive {
        let mut out = Archive {
            files: self.files.clone(),
        };
        let mut manifest = self.manifest();
        let mut config: Value =
            serde_json::from_slice(self.blob(manifest["config"]["digest"].as_str().unwrap()))
                .unwrap();
        let mut layers: Vec<(Value, String)> = manifest["layers"]
            .as_array()
            .unwrap()
            .iter()
            .cloned()
            .zip(
                config["rootfs"]["diff_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_str().unwrap().to_string()),
            )
            .collect();
        edit(&mut layers, &mut out);
        manifest["layers"] = Value::Array(layers.iter().map(|(d, _)| d.clone()).collect());
        config["rootfs"]["diff_ids"] =
            json!(layers.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>());
        let config = serde_json::to_vec(&config).unwrap();
        let (config_size, config_digest) = (config.len(), out.put_blob(config));
        manifest["config"]["digest"] = config_digest.into();
        manifest["config"]["size"] = config_size.into();
        let manifest = serde_json::to_vec(&manifest).unwrap();
        let (manifest_size, manifest_digest) = (manifest.len(), out.put_blob(manifest));
        let index = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest_size,
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": "bad"}
        }]});
        out.files
            .insert("index.json".into(), serde_json::to_vec(&index).unwrap());
        out
    }

    /// A plain-tar layer of `tar`: (descriptor, diff_id), its blob added.
    fn add_layer(&mut self, tar: Vec<u8>) -> (Value, String) {
        let diff_id = sha256(&tar);
        let size = tar.len();
        let digest = self.put_blob(tar);
        (
            json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size}),
            diff_id,
        )
    }

    fn write(&self, path: &Path) {
        let mut b = tar::Builder::new(Vec::new());
        let mut names: Vec<&String> = self.files.keys().collect();
        names.sort();
        for name in names {
            let data = &self.files[name];
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, &data[..]).unwrap();
        }
        std::fs::File::create(path)
            .unwrap()
            .write_all(&b.into_inner().unwrap())
            .unwrap();
    }

    /// The entries of the last layer (zstd or plain tar): (header, data) in order.
    fn last_layer_entries(&self) -> Vec<(tar::Header, Vec<u8>)> {
        let manifest = self.manifest();
        let layers = manifest["layers"].as_array().unwrap();
        let blob = self.blob(layers.last().unwrap()["digest"].as_str().unwrap());
        let tar = zstd::decode_all(blob).unwrap_or_else(|_| blob.to_vec());
        let mut out = Vec::new();
        for e in tar::Archive::new(&tar[..]).entries().unwrap() {
            let mut e = e.unwrap();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            out.push((e.header().clone(), data));
        }
        out
    }
}

/// A tar of `entries`; a `Some(target)` makes a symlink. Paths are written raw (no
/// sanitising by the tar crate): that is the point.
fn raw_tar(entries: &[(&str, &[u8], Option<&str>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (path, data, link) in entries {
        let mut h = tar::Header::new_ustar();
        {
            let raw = h.as_ustar_mut().unwrap();
            raw.name[..path.len()].copy_from_slice(path.as_bytes());
            if let Some(l) = link {
                raw.linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
        }
        h.set_entry_type(if link.is_some() {
            tar::EntryType::Symlink
        } else {
            tar::EntryType::Regular
        });
        h.set_size(if link.is_some() { 0 } else { data.len() as u64 });
        h.set_mode(0o644);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        if link.is_none() {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
    }
    out.resize(out.len() + 1024, 0);
    out
}

/// Layer entries re-packed into a plain tar, with `edit` applied to (path, data). The
/// signature is left as it was: the image no longer matches it.
fn repack(
    entries: &[(tar::Header, Vec<u8>)],
    edit: impl Fn(&str, &[u8]) -> Option<Vec<u8>>,
) -> Vec<u8> {
    repack_signed(entries, edit, None)
}

/// [`repack`], then, with `key`, `signature.json` made anew over what the layer now holds
/// (someone who holds a trusted key: the image is corrupt, yet signed).
fn repack_signed(
    entries: &[(tar::Header, Vec<u8>)],
    edit: impl Fn(&str, &[u8]) -> Option<Vec<u8>>,
    key: Option<&Path>,
) -> Vec<u8> {
    let mut edited = Vec::new();
    for (h, data) in entries {
        let path = h.path().unwrap().to_string_lossy().into_owned();
        let Some(data) = (if h.entry_type().is_file() {
            edit(&path, data)
        } else {
            Some(data.clone())
        }) else {
            continue;
        };
        edited.push((h.clone(), path, data));
    }
    if let Some(key) = key {
        let find = |suffix: &str| {
            edited
                .iter()
                .position(|(_, p, _)| p.ends_with(suffix))
                .unwrap()
        };
        let meta = &edited[find(".crab-checkpoint/checkpoint.json")].2;
        let criu: serde_json::Map<String, Value> = edited
            .iter()
            .filter(|(h, p, _)| h.entry_type().is_file() && p.contains(".crab-checkpoint/criu/"))
            .map(|(_, p, d)| {
                (
                    p.rsplit('/').next().unwrap().to_string(),
                    json!({"sha256": sha256(d), "size": d.len()}),
                )
            })
            .collect();
        let i = find(".crab-checkpoint/signature.json");
        // The layers below stay the ones the export signed.
        let layers =
            serde_json::from_slice::<Value>(&edited[i].2).unwrap()["statement"]["layers"].clone();
        edited[i].2 = sign(
            key,
            &json!({"checkpoint_json": sha256(meta), "criu": criu, "layers": layers}),
        );
    }
    let mut b = tar::Builder::new(Vec::new());
    for (mut h, path, data) in edited {
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append_data(&mut h, &path, &data[..]).unwrap();
    }
    b.into_inner().unwrap()
}

/// `signature.json` for `statement` with the signing key file at `key`, written from the format
/// crab documents (docs/security.md): ed25519 over a domain line and the statement's compact
/// JSON with sorted keys.
fn sign(key: &Path, statement: &Value) -> Vec<u8> {
    use ed25519_dalek::Signer;
    let text = std::fs::read_to_string(key).unwrap();
    let hex = text.trim().strip_prefix("ed25519-private:").unwrap();
    let seed: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let key = ed25519_dalek::SigningKey::from_bytes(&seed.try_into().unwrap());
    let mut message = b"crab checkpoint image signature v1\n".to_vec();
    message.extend(serde_json::to_vec(statement).unwrap());
    let hexs = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
    serde_json::to_vec(&json!({
        "format": 1,
        "key": format!("ed25519:{}", hexs(key.verifying_key().as_bytes())),
        "statement": statement,
        "signature": hexs(&key.sign(&message).to_bytes()),
    }))
    .unwrap()
}

struct Fixture {
    s: Sandbox,
    _guard: crab_integration::CleanupGuard,
    h: Harness,
    dir: tempfile::TempDir,
    good: Archive,
}

/// A sandbox with an fs turn and a process turn, exported and re-exported as an archive.
async fn fixture(name: &str) -> Fixture {
    fixture_with(name, SandboxOptions::default()).await
}

async fn fixture_with(name: &str, options: SandboxOptions<'_>) -> Fixture {
    fixture_running(name, options, "nohup sleep 100000 >/dev/null 2>&1 &").await
}

/// A fixture whose process image is of `background`, started in the second turn.
async fn fixture_running(name: &str, options: SandboxOptions<'_>, background: &str) -> Fixture {
    let (mut s, guard) = Sandbox::start(name, options).await;
    s.run("echo data > /app/file").await;
    s.end_turn().await;
    s.run(background).await;
    s.end_turn().await;
    s.sync().await;
    let h = s.h.clone();
    let reference = format!("localhost/crab-bad/{}:good", s.id);
    let (code, out, err) = s.crabctl(&["export", &s.id, &reference]);
    assert_eq!(code, 0, "export: {out}{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("good.tar");
    let good = Archive::export(&h, &reference, &path);
    h.ctr()
        .run(&["images", "rm", "--sync", &reference])
        .unwrap()
        .ok()
        .unwrap();
    Fixture {
        s,
        _guard: guard,
        h,
        dir,
        good,
    }
}

impl Fixture {
    /// The signing key of the sandbox's crab, which signed the export.
    fn key(&self) -> PathBuf {
        self.s.state_dir.join("keys/checkpoint-signing.key")
    }

    fn name(&self, label: &str) -> String {
        format!("localhost/crab-bad/{}:{label}", self.s.id)
    }

    /// A crab config (written under the fixture's directory) that trusts the sandbox's key,
    /// with `more` TOML appended; its path.
    fn config(&self, label: &str, more: &str) -> PathBuf {
        let config = self.dir.path().join(format!("crab-{label}.toml"));
        std::fs::write(
            &config,
            format!(
                "[store]\nstate_dir = \"{}\"\n[checkpoint]\nrestore_timeout_ms = 5000\n[restore]\ntrusted_keys = [\"{}\"]\n{more}",
                self.dir.path().join("state").display(),
                self.key().with_extension("pub").display()
            ),
        )
        .unwrap();
        config
    }

    /// Imports `image` (named by [`Fixture::name`] of `label`) and starts it under crab with `config` (`ctr run -d`, extra ctr flags
    /// first, `sleep infinity` as the command where no process is restored), then runs
    /// `probe` in it with `bash -c`: (exit code, output) of the start if it failed, else of
    /// the probe. The container is removed after.
    fn run(
        &self,
        label: &str,
        image: &Archive,
        config: &Path,
        flags: &[&str],
        probe: &str,
    ) -> (i32, String) {
        let name = self.name(label);
        let path = self.dir.path().join(format!("{label}.tar"));
        image.write(&path);
        let ctr = self.h.ctr();
        ctr.run(&["images", "import", path.to_str().unwrap()])
            .unwrap()
            .ok()
            .unwrap();
        let id = format!("{}-{label}", self.s.id);
        let _g = self.h.guard(&[&id]);
        let mut cmd = vec![
            "run",
            "-d",
            "--runtime",
            "io.containerd.crab.v1",
            "--runtime-config-path",
            config.to_str().unwrap(),
        ];
        cmd.extend_from_slice(flags);
        cmd.extend_from_slice(&[&name, &id, "sleep", "infinity"]);
        let started = ctr.run(&cmd).unwrap();
        let out = if started.code() != 0 {
            (
                started.code(),
                format!("{}{}", started.stdout, started.stderr),
            )
        } else {
            let probed = ctr
                .run(&[
                    "tasks",
                    "exec",
                    "--exec-id",
                    "probe",
                    &id,
                    "bash",
                    "-c",
                    probe,
                ])
                .unwrap();
            let _ = ctr.run(&["tasks", "kill", "-s", "SIGKILL", &id]);
            (probed.code(), format!("{}{}", probed.stdout, probed.stderr))
        };
        drop(_g);
        let _ = ctr.run(&["images", "rm", "--sync", &name]);
        out
    }

    /// Imports `bad` and runs it: returns ctr's failure output (the run must fail), after
    /// checking nothing of it is left.
    async fn run_fails(&self, label: &str, bad: &Archive) -> String {
        self.run_fails_with(label, bad, "").await
    }

    /// [`Fixture::run_fails`] with `restore` keys added to the config's `[restore]` table.
    async fn run_fails_with(&self, label: &str, bad: &Archive, restore: &str) -> String {
        let name = self.name(label);
        let path = self.dir.path().join(format!("{label}.tar"));
        bad.write(&path);
        let ctr = self.h.ctr();
        let import = ctr
            .run(&["images", "import", path.to_str().unwrap()])
            .unwrap();
        let id = format!("{}-{label}", self.s.id);
        let out = if import.code() != 0 {
            format!("{}{}", import.stdout, import.stderr)
        } else {
            // A corrupt CRIU image can make CRIU spin: the restore is bounded (short here).
            let config = self.config("fails", restore);
            let run = ctr
                .run(&[
                    "run",
                    "-d",
                    "--runtime",
                    "io.containerd.crab.v1",
                    "--runtime-config-path",
                    config.to_str().unwrap(),
                    &name,
                    &id,
                    "sleep",
                    "1",
                ])
                .unwrap();
            let _ = ctr.run(&["images", "rm", "--sync", &name]);
            assert_ne!(run.code(), 0, "{label}: the bad image started: {run:?}");
            format!("{}{}", run.stdout, run.stderr)
        };
        // Nothing runs. ctr keeps what it made of a failed `run -d` (the container record, and
        // the task when Start failed: stopped, as after any failed start); deleting them, as a
        // user would, must work and release everything.
        let tasks = ctr.run(&["tasks", "ls"]).unwrap().ok().unwrap();
        if let Some(line) = tasks
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(id.as_str()))
        {
            assert!(
                line.contains("STOPPED"),
                "{label}: a task was left running: {line}"
            );
            ctr.run(&["tasks", "rm", &id]).unwrap().ok().unwrap();
        }
        let _ = ctr.run(&["containers", "rm", &id]);
        let leftovers: Vec<String> = self
            .h
            .inventory()
            .await
            .unwrap()
            .into_iter()
            .flat_map(|n| n.containers)
            .filter(|c| c == &id)
            .collect();
        assert!(
            leftovers.is_empty(),
            "{label}: the container cannot be deleted"
        );
        self.h.assert_no_leaks(&id).await;
        out
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_checkpoint_images_fail_cleanly() {
    let f = fixture("badimg").await;
    let entries = f.good.last_layer_entries();
    assert!(
        entries.iter().any(|(h, _)| h
            .path()
            .unwrap()
            .ends_with(".crab-checkpoint/checkpoint.json")),
        "the last layer is crab's"
    );

    // An unknown newer format.
    let newer = repack(&entries, |p, d| {
        Some(if p.ends_with("checkpoint.json") {
            let mut v: Value = serde_json::from_slice(d).unwrap();
            v["format"] = 99.into();
            serde_json::to_vec(&v).unwrap()
        } else {
            d.to_vec()
        })
    });
    let out = f
        .run_fails(
            "newer",
            &f.good.with_last_layer(&f.name("newer"), Some(newer), None),
        )
        .await;
    assert!(
        out.contains("format 99") && out.contains("upgrade crab"),
        "{out}"
    );

    // A CRIU image that does not match: its process tree is gone, or its pages are cut short.
    // Changed after signing, each is refused before CRIU sees it.
    let no_pstree_edit = |p: &str, d: &[u8]| (!p.ends_with("pstree.img")).then(|| d.to_vec());
    let short_pages_edit = |p: &str, d: &[u8]| {
        Some(if p.contains("/pages-") {
            d[..d.len() / 2].to_vec()
        } else {
            d.to_vec()
        })
    };
    let no_pstree = repack(&entries, no_pstree_edit);
    let out = f
        .run_fails(
            "nopstree-unsigned",
            &f.good
                .with_last_layer(&f.name("nopstree-unsigned"), Some(no_pstree), None),
        )
        .await;
    assert!(
        out.contains("altered after signing")
            && out.contains("pstree.img was signed but is missing"),
        "{out}"
    );
    let short_pages = repack(&entries, short_pages_edit);
    let out = f
        .run_fails(
            "shortpages-unsigned",
            &f.good
                .with_last_layer(&f.name("shortpages-unsigned"), Some(short_pages), None),
        )
        .await;
    assert!(
        out.contains("altered after signing") && out.contains("pages-"),
        "{out}"
    );
    // Signed anew by the trusted key, a corrupt image reaches CRIU, which fails (bounded).
    let no_pstree = repack_signed(&entries, no_pstree_edit, Some(&f.key()));
    let out = f
        .run_fails(
            "nopstree",
            &f.good
                .with_last_layer(&f.name("nopstree"), Some(no_pstree), None),
        )
        .await;
    assert!(
        out.contains("cannot start") && out.contains("pstree.img"),
        "{out}"
    );
    let short_pages = repack_signed(&entries, short_pages_edit, Some(&f.key()));
    let out = f
        .run_fails(
            "shortpages",
            &f.good
                .with_last_layer(&f.name("shortpages"), Some(short_pages), None),
        )
        .await;
    assert!(
        out.contains("cannot restore") && out.contains("restore_timeout_ms"),
        "{out}"
    );

    // A CRIU image larger than the config allows (a file of zeros: tiny once compressed) is
    // refused before a byte of it is copied, even when a trusted key signed it.
    let zeros = vec![0u8; 3 << 20];
    let mut big = entries.clone();
    let (mut h, _) = big
        .iter()
        .find(|(h, _)| h.path().unwrap().to_string_lossy().contains("/pages-"))
        .unwrap()
        .clone();
    h.set_path(".crab-checkpoint/criu/pages-99.img").unwrap();
    big.push((h, zeros));
    let big = repack_signed(&big, |_, d| Some(d.to_vec()), Some(&f.key()));
    let out = f
        .run_fails_with(
            "toobig",
            &f.good.with_last_layer(&f.name("toobig"), Some(big), None),
            "max_image_mib = 1\n",
        )
        .await;
    assert!(
        out.contains("max_image_mib") && out.contains("more than"),
        "{out}"
    );

    // A truncated layer: its content no longer matches its digest.
    let blob = f
        .good
        .blob(
            f.good.manifest()["layers"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()["digest"]
                .as_str()
                .unwrap(),
        )
        .to_vec();
    let out = f
        .run_fails(
            "truncated",
            &f.good.with_last_layer(
                &f.name("truncated"),
                None,
                Some(blob[..blob.len() / 2].to_vec()),
            ),
        )
        .await;
    assert!(
        out.to_lowercase().contains("digest")
            || out.contains("unexpected EOF")
            || out.contains("size"),
        "{out}"
    );

    // Entries that try to leave the rootfs.
    let tag = std::process::id();
    let host = |what: &str| PathBuf::from(format!("/tmp/crab-escape-{what}-{tag}"));
    let escape = raw_tar(&[
        (
            &format!("../../../../../../../../tmp/crab-escape-dotdot-{tag}"),
            b"out",
            None,
        ),
        (&format!("/tmp/crab-escape-abs-{tag}"), b"out", None),
        ("hostlink", b"", Some("/tmp")),
        (&format!("hostlink/crab-escape-symlink-{tag}"), b"out", None),
    ]);
    // (On an fs-only checkpoint, so that the container runs `ls` rather than a restored init.)
    let mut tar = repack_signed(
        &entries,
        |p, d| match p {
            _ if p.contains("/criu/") => None,
            _ if p.ends_with("checkpoint.json") => {
                let mut v: Value = serde_json::from_slice(d).unwrap();
                v["process"] = Value::Null;
                Some(serde_json::to_vec(&v).unwrap())
            }
            _ => Some(d.to_vec()),
        },
        Some(&f.key()),
    );
    tar.truncate(tar.len() - 1024);
    tar.extend_from_slice(&escape);
    let name = f.name("escape");
    let path = f.dir.path().join("escape.tar");
    f.good
        .with_last_layer(&f.name("escape"), Some(tar), None)
        .write(&path);
    let ctr = f.h.ctr();
    let import = ctr
        .run(&["images", "import", path.to_str().unwrap()])
        .unwrap();
    let id = format!("{}-escape", f.s.id);
    if import.code() == 0 {
        // Either refused, or applied inside the rootfs: never outside it (checked below).
        let run = ctr
            .run(&[
                "run",
                "--rm",
                "--runtime",
                "io.containerd.crab.v1",
                &name,
                &id,
                "ls",
                "/tmp",
            ])
            .unwrap();
        eprintln!(
            "escape image: exit {}: {}{}",
            run.code(),
            run.stdout,
            run.stderr
        );
        let _ = ctr.run(&["images", "rm", "--sync", &name]);
    }
    for what in ["dotdot", "abs", "symlink"] {
        assert!(
            !host(what).exists(),
            "a layer entry escaped the rootfs to {}",
            host(what).display()
        );
    }
    f.h.assert_no_leaks(&id).await;

    // crab's own store: a truncated layer blob and a corrupted manifest are refused by export.
    // (A new layer, so that containerd's content store does not have it from the first export.)
    let mut f = f;
    f.s.run("echo more > /app/more").await;
    f.s.end_turn().await;
    f.s.sync().await;
    let store = f.s.store();
    let manifests: Vec<PathBuf> = {
        let mut v: Vec<PathBuf> = std::fs::read_dir(store.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    let newest: Value =
        serde_json::from_slice(&std::fs::read(manifests.last().unwrap()).unwrap()).unwrap();
    let layer = newest["fs_layers"].as_array().unwrap().last().unwrap()["digest"]
        .as_str()
        .unwrap()
        .strip_prefix("sha256:")
        .unwrap()
        .to_string();
    let blob_path = store.join("blobs/sha256").join(&layer);
    let original = std::fs::read(&blob_path).unwrap();
    std::fs::write(&blob_path, &original[..original.len() / 2]).unwrap();
    let reference = format!("localhost/crab-bad/{}:store", f.s.id);
    let (code, out, err) = f.s.crabctl(&["export", &f.s.id, &reference]);
    assert_ne!(code, 0, "export of a truncated blob succeeded: {out}");
    assert!(
        err.contains(&layer[..12]) || err.contains("digest") || err.contains("size"),
        "{err}"
    );
    std::fs::write(&blob_path, &original).unwrap();
    let manifest_bytes = std::fs::read(manifests.last().unwrap()).unwrap();
    std::fs::write(
        manifests.last().unwrap(),
        &manifest_bytes[..manifest_bytes.len() / 2],
    )
    .unwrap();
    let (code, out, err) = f.s.crabctl(&["export", &f.s.id, &reference]);
    assert_ne!(code, 0, "export from a corrupted manifest succeeded: {out}");
    assert!(
        err.contains("checkpoint")
            && (err.contains("json")
                || err.contains("corrupt")
                || err.contains("parse")
                || err.contains("EOF")),
        "{err}"
    );
    std::fs::write(manifests.last().unwrap(), &manifest_bytes).unwrap();
    let ours = format!("localhost/crab-bad/{}:", f.s.id);
    let images = f.h.ctr().run(&["images", "ls", "-q"]).unwrap().stdout;
    assert!(
        images.lines().all(|l| !l.starts_with(&ours)),
        "images left behind: {images}"
    );

    // The sandbox itself never noticed.
    let mut s = f.s;
    assert_eq!(s.run("cat /app/file").await.stdout, "data\n");
    s.finish().await;
}

/// What the container's init runs with: its capability sets.
const INIT_CAPS: &str = "grep -E '^Cap(Eff|Prm|Bnd)' /proc/1/status";
/// The capabilities this process holds: what `ctr run --privileged` grants.
fn host_caps() -> u64 {
    cap_line(
        &std::fs::read_to_string("/proc/self/status").unwrap(),
        "CapBnd",
    )
}

fn cap_line(out: &str, name: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in {out}"));
    u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
}

/// Issue 16, item 1: a checkpoint image is a request to run processes with whatever
/// credentials it records. An image dumped from a privileged container, signed by crab
/// itself, is refused under an unprivileged spec (it would otherwise run with every
/// capability: host root), and restores under a privileged one.
#[tokio::test(flavor = "multi_thread")]
async fn a_privileged_dump_is_refused_under_an_unprivileged_spec() {
    // As `ctr run --privileged`: every capability this process holds (on some hosts one is
    // withheld from everyone, which a spec may then not ask for either).
    let all = host_caps();
    let privileged = |spec: &mut Value| {
        let names: Vec<String> = (0..64)
            .filter(|bit| all & (1 << bit) != 0)
            .map(cap_name)
            .collect();
        for set in ["bounding", "effective", "permitted"] {
            spec["process"]["capabilities"][set] = json!(names);
        }
    };
    let mut f = fixture_with(
        "hostile_priv",
        SandboxOptions {
            spec_edit: Some(&privileged),
            ..Default::default()
        },
    )
    .await;
    let source = f.s.run(INIT_CAPS).await.stdout;
    assert_eq!(
        cap_line(&source, "CapEff"),
        all,
        "the source runs privileged: {source}"
    );
    let config = f.config("priv", "");

    // Unprivileged (ctr's defaults): refused before CRIU runs, with the reason.
    let out = f
        .run_fails(
            "unprivileged",
            &f.good.with_last_layer(&f.name("unprivileged"), None, None),
        )
        .await;
    assert!(
        out.contains("asks for more privilege than the container's spec grants"),
        "{out}"
    );
    assert!(
        out.contains("CAP_SYS_ADMIN") && out.contains("bounding"),
        "{out}"
    );
    // The same image under a privileged spec restores its processes with their capabilities.
    let (code, out) = f.run("good", &f.good, &config, &["--privileged"], INIT_CAPS);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        cap_line(&out, "CapEff"),
        all,
        "restored under --privileged: {out}"
    );

    // The source never noticed.
    let s = &mut f.s;
    assert_eq!(s.run("cat /app/file").await.stdout, "data\n");
    f.s.finish().await;
}

/// The capability's name for `bit` (`include/uapi/linux/capability.h`).
fn cap_name(bit: u32) -> String {
    [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_DAC_READ_SEARCH",
        "CAP_FOWNER",
        "CAP_FSETID",
        "CAP_KILL",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETPCAP",
        "CAP_LINUX_IMMUTABLE",
        "CAP_NET_BIND_SERVICE",
        "CAP_NET_BROADCAST",
        "CAP_NET_ADMIN",
        "CAP_NET_RAW",
        "CAP_IPC_LOCK",
        "CAP_IPC_OWNER",
        "CAP_SYS_MODULE",
        "CAP_SYS_RAWIO",
        "CAP_SYS_CHROOT",
        "CAP_SYS_PTRACE",
        "CAP_SYS_PACCT",
        "CAP_SYS_ADMIN",
        "CAP_SYS_BOOT",
        "CAP_SYS_NICE",
        "CAP_SYS_RESOURCE",
        "CAP_SYS_TIME",
        "CAP_SYS_TTY_CONFIG",
        "CAP_MKNOD",
        "CAP_LEASE",
        "CAP_AUDIT_WRITE",
        "CAP_AUDIT_CONTROL",
        "CAP_SETFCAP",
        "CAP_MAC_OVERRIDE",
        "CAP_MAC_ADMIN",
        "CAP_SYSLOG",
        "CAP_WAKE_ALARM",
        "CAP_BLOCK_SUSPEND",
        "CAP_AUDIT_READ",
        "CAP_PERFMON",
        "CAP_BPF",
        "CAP_CHECKPOINT_RESTORE",
    ]
    .get(bit as usize)
    .map_or_else(|| format!("CAP_{bit}"), |n| n.to_string())
}

/// Issue 16, item 1: provenance. An image without a signature, or signed by a key the host
/// does not trust, is refused by default; with `unsigned_images = "start-fresh"` it starts as
/// an ordinary image (its entrypoint, none of its processes, the reserved directory hidden).
/// A properly signed image restores its processes as they were.
#[tokio::test(flavor = "multi_thread")]
async fn unsigned_and_untrusted_images_are_refused() {
    let f = fixture("hostile_sig").await;
    let entries = f.good.last_layer_entries();

    let unsigned = repack(&entries, |p, d| {
        (!p.ends_with("signature.json")).then(|| d.to_vec())
    });
    let unsigned = f
        .good
        .with_last_layer(&f.name("unsigned"), Some(unsigned), None);
    let out = f.run_fails("unsigned", &unsigned).await;
    assert!(
        out.contains("checkpoint image not signed by a trusted key: it carries no signature"),
        "{out}"
    );

    // Signed by a key of the attacker's own.
    let stranger = f.dir.path().join("stranger.key");
    std::fs::write(&stranger, format!("ed25519-private:{}\n", "5a".repeat(32))).unwrap();
    let foreign = repack_signed(&entries, |_, d| Some(d.to_vec()), Some(&stranger));
    let out = f
        .run_fails(
            "stranger",
            &f.good
                .with_last_layer(&f.name("stranger"), Some(foreign), None),
        )
        .await;
    assert!(
        out.contains("not signed by a trusted key")
            && out.contains("not among the 1 trusted key")
            // What to do about it: which keys this config trusts, and the two ways out.
            && out.contains("ed25519:")
            && out.contains("start it with the runtime (and crab config) whose signing key made it")
            && out.contains("[restore] trusted_keys"),
        "{out}"
    );

    // start-fresh: the unsigned image starts its command as an ordinary image would.
    let config = f.config("fresh", "unsigned_images = \"start-fresh\"\n");
    let probe = "ls -a / | grep -c crab-checkpoint; ps -eo args --no-headers | grep -c '^sleep 100000' ; cat /app/file";
    let (code, out) = f.run("unsigned", &unsigned, &config, &[], probe);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("0\n0\ndata\n"),
        "reserved dir hidden, no restored process, the files of the image: {out}"
    );

    // The good image restores its processes (the sleep left by the process turn).
    let config = f.config("good", "");
    let (code, out) = f.run(
        "good",
        &f.good,
        &config,
        &[],
        "ps -eo args --no-headers | grep -c '^sleep 100000'; grep CapEff /proc/1/status",
    );
    assert_eq!(code, 0, "a signed image within the spec: {out}");
    assert!(
        out.starts_with("1\n"),
        "the process turn's sleep is restored: {out}"
    );
    assert_eq!(
        cap_line(&out, "CapEff"),
        0xa804_25fb,
        "with ctr's default capabilities: {out}"
    );
    f.s.finish().await;
}

/// Issue 16, item 4: a FIFO named `checkpoint.json` in an image must not hang Create (a
/// blocking open would, leaking a thread and a mount per retry); the reserved directory is
/// opaque in an export, so files the agent planted there through its own fs layers never
/// merge into the checkpoint.
#[tokio::test(flavor = "multi_thread")]
async fn planted_files_in_the_reserved_directory() {
    let mut f = fixture("hostile_planted").await;
    let entries = f.good.last_layer_entries();
    let mut fifo = tar::Builder::new(Vec::new());
    for (h, data) in &entries {
        let mut h = h.clone();
        let path = h.path().unwrap().to_string_lossy().into_owned();
        if path.ends_with("checkpoint.json") {
            h.set_entry_type(tar::EntryType::Fifo);
            h.set_size(0);
            h.set_cksum();
            fifo.append_data(&mut h, &path, std::io::empty()).unwrap();
        } else {
            fifo.append_data(&mut h, &path, &data[..]).unwrap();
        }
    }
    let started = std::time::Instant::now();
    let out = f
        .run_fails(
            "fifo",
            &f.good
                .with_last_layer(&f.name("fifo"), Some(fifo.into_inner().unwrap()), None),
        )
        .await;
    assert!(
        out.contains("must be a plain file") && out.contains("a fifo"),
        "{out}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "Create took {:?}",
        started.elapsed()
    );

    // The agent plants files, a symlink and a directory in the reserved directory; a process
    // turn; the export restores cleanly (an unsigned file merged in would be refused).
    f.s.run("mkdir -p /.crab-checkpoint/criu/sub && echo evil > /.crab-checkpoint/criu/planted.img \
             && ln -s /etc/shadow /.crab-checkpoint/criu/link.img && echo '{}' > /.crab-checkpoint/signature.json")
        .await;
    f.s.end_turn().await;
    f.s.run("nohup sleep 100001 >/dev/null 2>&1 &").await;
    f.s.end_turn().await;
    f.s.sync().await;
    let reference = f.name("planted");
    let (code, out, err) = f.s.crabctl(&["export", &f.s.id, &reference]);
    assert_eq!(code, 0, "export: {out}{err}");
    let path = f.dir.path().join("planted-export.tar");
    let planted = Archive::export(&f.h, &reference, &path);
    f.h.ctr()
        .run(&["images", "rm", "--sync", &reference])
        .unwrap()
        .ok()
        .unwrap();
    let layer = planted.last_layer_entries();
    assert!(
        layer
            .iter()
            .any(|(h, _)| h.path().unwrap().to_string_lossy() == ".crab-checkpoint/.wh..wh..opq"),
        "the reserved directory is opaque in the checkpoint layer"
    );
    let config = f.config("planted", "");
    let probe =
        "ls -a / | grep -c crab-checkpoint; ps -eo args --no-headers | grep -c '^sleep 10000[01]'";
    let (code, out) = f.run("planted", &planted, &config, &[], probe);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("0\n2\n"),
        "reserved dir hidden, both sleeps restored: {out}"
    );
    f.s.finish().await;
}

/// Page files large enough to be verified while CRIU restores (the shim's post-restore gate):
/// the signed image restores, its process running again; the same image with one byte of its
/// largest page file changed (same size: what the listed sizes cannot show) is refused, naming
/// the file, with nothing of it left running.
#[tokio::test(flavor = "multi_thread")]
async fn page_files_verified_while_criu_restores_are_refused_when_altered() {
    let f = fixture_running(
        "bigpages",
        SandboxOptions::default(),
        "nohup python3 -c 'import os, time; b = bytearray(os.urandom(24 << 20)); \
         open(\"/tmp/held\", \"w\").close(); time.sleep(10 ** 6)' >/dev/null 2>&1 & \
         while [ ! -e /tmp/held ]; do sleep 0.05; done",
    )
    .await;
    let entries = f.good.last_layer_entries();
    let pages: Vec<(String, usize)> = entries
        .iter()
        .filter_map(|(h, d)| {
            let p = h.path().unwrap().to_string_lossy().into_owned();
            p.contains("/pages-").then_some((p, d.len()))
        })
        .collect();
    let largest = pages.iter().max_by_key(|(_, n)| *n).unwrap().clone();
    assert!(
        largest.1 > 16 << 20,
        "the holder's pages are in one large file: {pages:?}"
    );
    // One byte of the largest page file changed after signing: refused, and (the restore
    // cache is on, this image not in it yet) nothing of it enters the cache.
    let altered = repack(&entries, |p, d| {
        let mut d = d.to_vec();
        if p == largest.0 {
            let m = d.len() / 2;
            d[m] ^= 0x5a;
        }
        Some(d)
    });
    let out = f
        .run_fails(
            "bigpages-altered",
            &f.good
                .with_last_layer(&f.name("bigpages-altered"), Some(altered), None),
        )
        .await;
    let file = largest.0.rsplit('/').next().unwrap();
    assert!(
        out.contains("altered after signing") && out.contains(&format!("criu/{file}")),
        "{out}"
    );
    eprintln!("altered: {out}");
    let from = f.h.env.containerd_log_len();
    // Signed as exported: restores, its page files verified alongside (the cache entry is
    // built by this restore, not taken from the refused one).
    let config = f.config("bigpages", "");
    let (code, out) = f.run(
        "good",
        &f.good,
        &config,
        &[],
        "pgrep -f 'python3 -c import os' >/dev/null && echo held",
    );
    assert_eq!((code, out.trim()), (0, "held"), "{out}");
    let id = format!("{}-good", f.s.id);
    let needle = format!("checkpoint image of {id}: its page files (");
    let text = crab_integration::harness::log_once(
        &f.h.env,
        from,
        std::time::Duration::from_secs(15),
        |t| t.contains(&needle),
    )
    .await;
    let line = text
        .lines()
        .find(|l| l.contains(&format!("checkpoint image of {id}: its page files (")))
        .unwrap_or_else(|| panic!("no verification of the page files was logged"));
    assert!(line.contains("verified in"), "{line}");
    eprintln!("{line}");
    let built = text
        .lines()
        .find(|l| l.contains(&format!("checkpoint image of {id} verified in ")))
        .unwrap();
    assert!(built.contains("verified into the restore cache"), "{built}");
}

/// A small editor of CRIU image files, for crafting hostile images from a real dump: an image
/// file is a magic header (the common magic and the file's own, or the file's alone) and
/// entries, each a little-endian u32 length and a protobuf message.
mod criu_edit {
    const COMMON_MAGIC: u32 = 0x5456_4319;

    /// (header bytes, entries).
    pub fn entries(file: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
        let first = u32::from_le_bytes(file[..4].try_into().unwrap());
        let head = if first == COMMON_MAGIC { 8 } else { 4 };
        let (mut out, mut pos) = (Vec::new(), head);
        while pos < file.len() {
            let n = u32::from_le_bytes(file[pos..pos + 4].try_into().unwrap()) as usize;
            out.push(file[pos + 4..pos + 4 + n].to_vec());
            pos += 4 + n;
        }
        (file[..head].to_vec(), out)
    }

    pub fn file(head: &[u8], entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out = head.to_vec();
        for e in entries {
            out.extend_from_slice(&(e.len() as u32).to_le_bytes());
            out.extend_from_slice(e);
        }
        out
    }

    /// A field's value: a varint or length-delimited bytes (CRIU's images use no others in
    /// the messages edited here).
    #[derive(Debug, Clone, PartialEq)]
    pub enum V {
        Varint(u64),
        Bytes(Vec<u8>),
    }

    fn varint(b: &[u8], pos: &mut usize) -> u64 {
        let mut v = 0u64;
        for i in 0..10 {
            let byte = b[*pos];
            *pos += 1;
            v |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                break;
            }
        }
        v
    }

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    pub fn fields(msg: &[u8]) -> Vec<(u32, V)> {
        let (mut out, mut pos) = (Vec::new(), 0);
        while pos < msg.len() {
            let key = varint(msg, &mut pos);
            let value = match key & 7 {
                0 => V::Varint(varint(msg, &mut pos)),
                2 => {
                    let n = varint(msg, &mut pos) as usize;
                    pos += n;
                    V::Bytes(msg[pos - n..pos].to_vec())
                }
                t => panic!("wire type {t} in an edited message"),
            };
            out.push(((key >> 3) as u32, value));
        }
        out
    }

    pub fn encode(fields: &[(u32, V)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (n, v) in fields {
            match v {
                V::Varint(x) => {
                    put_varint(&mut out, u64::from(*n) << 3);
                    put_varint(&mut out, *x);
                }
                V::Bytes(b) => {
                    put_varint(&mut out, (u64::from(*n) << 3) | 2);
                    put_varint(&mut out, b.len() as u64);
                    out.extend_from_slice(b);
                }
            }
        }
        out
    }

    /// Applies `edit` to the embedded message in field `number` of `msg` (each occurrence).
    pub fn edit_message(msg: &[u8], number: u32, edit: &dyn Fn(&[u8]) -> Vec<u8>) -> Vec<u8> {
        let f: Vec<(u32, V)> = fields(msg)
            .into_iter()
            .map(|(n, v)| match (n, v) {
                (n, V::Bytes(b)) if n == number => (n, V::Bytes(edit(&b))),
                other => other,
            })
            .collect();
        encode(&f)
    }
}

/// `mountpoints-*.img` with the read-only flag of the mount at `at` cleared.
fn mount_made_writable(data: &[u8], at: &str) -> Vec<u8> {
    use criu_edit::V;
    let (head, entries) = criu_edit::entries(data);
    let mut found = false;
    let entries: Vec<Vec<u8>> = entries
        .into_iter()
        .map(|e| {
            let mut f = criu_edit::fields(&e);
            let here = f
                .iter()
                .any(|(n, v)| *n == 7 && *v == V::Bytes(at.as_bytes().to_vec()));
            if here {
                for (n, v) in f.iter_mut() {
                    if let (5, V::Varint(flags)) = (*n, v) {
                        assert!(*flags & 1 != 0, "{at} is read-only in the dump");
                        *flags &= !1;
                        found = true;
                    }
                }
            }
            criu_edit::encode(&f)
        })
        .collect();
    assert!(found, "no mount at {at} in the image");
    criu_edit::file(&head, &entries)
}

/// `core-*.img` whose task has the hard limit of `resource` raised to `hard`.
fn rlimit_raised(data: &[u8], resource: usize, hard: u64) -> Vec<u8> {
    use criu_edit::V;
    let (head, entries) = criu_edit::entries(data);
    let core = criu_edit::edit_message(&entries[0], 3, &|tc| {
        criu_edit::edit_message(tc, 8, &|rlimits| {
            let mut f = criu_edit::fields(rlimits);
            let V::Bytes(entry) = &f[resource].1 else {
                panic!("rlimit {resource} is not a message")
            };
            let mut e = criu_edit::fields(entry);
            for (n, v) in e.iter_mut() {
                if *n == 2 {
                    *v = V::Varint(hard);
                }
            }
            f[resource].1 = V::Bytes(criu_edit::encode(&e));
            criu_edit::encode(&f)
        })
    });
    criu_edit::file(&head, &[core])
}

/// Issue 24, items 2 and 3: what CRIU restored is compared with the new container's spec by
/// the kernel check, before any restored process runs. Two images signed by a trusted key
/// (someone holds it, or a privileged source), each asking for something crab's reading of
/// the image never looks at, each refused at CRIU's pre-resume stage naming what: `/proc/sys`
/// mounted read-write (an ordinary exec could then write the host's `kernel.core_pattern`),
/// and a hard RLIMIT_NOFILE above what the spec grants. The same images under
/// `unsigned_images = "kernel-check"` with their signatures removed meet the same check. Nothing
/// runs, nothing is left, and the untouched image still restores.
#[tokio::test(flavor = "multi_thread")]
async fn the_kernel_check_refuses_what_the_image_claims_do_not_show() {
    let f = fixture("kernel_check").await;
    let entries = f.good.last_layer_entries();
    let key = f.key();

    let writable = repack_signed(
        &entries,
        |p, d| {
            Some(match p.rsplit('/').next().unwrap() {
                name if name.starts_with("mountpoints-") => mount_made_writable(d, "/proc/sys"),
                _ => d.to_vec(),
            })
        },
        Some(&key),
    );
    let out = f
        .run_fails(
            "rwprocsys",
            &f.good
                .with_last_layer(&f.name("rwprocsys"), Some(writable), None),
        )
        .await;
    assert!(
        out.contains("the restored processes have more than the container's spec grants")
            && out.contains("/proc/sys is mounted read-write"),
        "{out}"
    );

    // ctr's spec sets RLIMIT_NOFILE to 1024:1024; the image raises init's hard limit (to one
    // below the runtime's own: CRIU's restorer cannot raise a hard limit above what it
    // inherited, and ignores that failure, so a larger request shows as the inherited limit).
    let raised = repack_signed(
        &entries,
        |p, d| {
            Some(match p.rsplit('/').next().unwrap() {
                "core-1.img" => rlimit_raised(d, 7, 4096),
                _ => d.to_vec(),
            })
        },
        Some(&key),
    );
    let out = f
        .run_fails(
            "nofile",
            &f.good
                .with_last_layer(&f.name("nofile"), Some(raised), None),
        )
        .await;
    assert!(
        out.contains("hard RLIMIT_NOFILE of 4096") && out.contains("the spec grants 1024"),
        "{out}"
    );

    // Unsigned, on the kernel check alone: the same refusal.
    let unsigned = repack(&entries, |p, d| {
        let name = p.rsplit('/').next().unwrap();
        match name {
            "signature.json" => None,
            name if name.starts_with("mountpoints-") => Some(mount_made_writable(d, "/proc/sys")),
            _ => Some(d.to_vec()),
        }
    });
    let out = f
        .run_fails_with(
            "rwunsigned",
            &f.good
                .with_last_layer(&f.name("rwunsigned"), Some(unsigned), None),
            "unsigned_images = \"kernel-check\"\n",
        )
        .await;
    assert!(out.contains("/proc/sys is mounted read-write"), "{out}");

    // The image as dumped passes the same check and runs.
    let config = f.config("good", "");
    let (code, out) = f.run(
        "good",
        &f.good,
        &config,
        &[],
        // The restored `sleep 100000` (the pattern does not match grep's own command line).
        "grep -l '1000[0]0' /proc/[0-9]*/cmdline | wc -l",
    );
    assert_eq!(
        (code, out.trim()),
        (0, "1"),
        "the signed image restores: {out}"
    );
    let mut s = f.s;
    assert_eq!(s.run("cat /app/file").await.stdout, "data\n");
    s.finish().await;
}

/// Issue 24, item 2: an allow-all seccomp filter in place of runc's. The source ran under a
/// profile that allows everything (its spec is the image maker's to choose), so every process of
/// the image has one filter, seccomp mode 2: all the image and `/proc` show. Restored into a
/// container whose spec has containerd's default profile (`ctr run --seccomp`), that filter is
/// not runc's program for the default profile: the kernel check refuses it at pre-resume,
/// naming the thread. The same image under a spec without a profile restores (nothing to
/// compare; the processes keep their own filter).
#[tokio::test(flavor = "multi_thread")]
async fn an_allow_all_seccomp_filter_does_not_pass_for_runc_s() {
    let allow_all = |spec: &mut Value| {
        spec["linux"]["seccomp"] = serde_json::json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        });
    };
    let f = fixture_with(
        "allow_all",
        SandboxOptions {
            spec_edit: Some(&allow_all),
            ..Default::default()
        },
    )
    .await;
    let config = f.config("seccomp", "");
    let (code, out) = f.run(
        "seccomp",
        &f.good.with_last_layer(&f.name("seccomp"), None, None),
        &config,
        &["--seccomp"],
        "grep -l '1000[0]0' /proc/[0-9]*/cmdline | wc -l",
    );
    assert_ne!(code, 0, "the allow-all filter passed for runc's: {out}");
    assert!(
        out.contains("does not run under the seccomp filter runc installs")
            && out.contains("\"sleep\""),
        "{out}"
    );
    let (code, out) = f.run(
        "plain",
        &f.good.with_last_layer(&f.name("plain"), None, None),
        &config,
        &[],
        "grep -c '^Seccomp_filters:.1$' /proc/$(pgrep -f 'sleep 10000[0]')/status",
    );
    assert_eq!(
        (code, out.trim()),
        (0, "1"),
        "restored without a profile, with its own filter: {out}"
    );
    f.s.finish().await;
}

/// A plain tar holding `files` (with their parent directories), as an attacker's layer.
fn files_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for (path, _) in files {
        let mut at = Path::new(path).parent();
        while let Some(d) = at.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(d.to_path_buf());
            at = d.parent();
        }
    }
    for d in dirs {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        h.set_cksum();
        b.append_data(&mut h, &d, std::io::empty()).unwrap();
    }
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o755);
        h.set_cksum();
        b.append_data(&mut h, path, &data[..]).unwrap();
    }
    b.into_inner().unwrap()
}

/// Issue 24, item 4: the signature binds the layers below the checkpoint layer, and the shim
/// checks them against what containerd unpacked. Layers swapped, slipped in below or stacked
/// on top of a signed checkpoint (its signed files untouched) are refused; so is a checkpoint
/// layer that carries more than the reserved directory.
#[tokio::test(flavor = "multi_thread")]
async fn layers_swapped_under_a_signed_checkpoint_are_refused() {
    let f = fixture("layers").await;
    let config = f.config("layers", "");
    // The image as signed runs, its process and its files back (the refusals below are the
    // layers', nothing else).
    let (code, out) = f.run("good", &f.good, &config, &[], "cat /app/file");
    assert_eq!((code, out.trim()), (0, "data"), "{out}");

    let evil = files_tar(&[("app/file", b"evil\n"), ("usr/lib/evil.so", b"\x7fELF")]);
    let n = f.good.manifest()["layers"].as_array().unwrap().len();
    assert!(n >= 2, "an export has layers below its checkpoint layer");

    // The layer right below the checkpoint layer (the agent's files) replaced.
    let swapped = f.good.with_layers(&f.name("swapped"), |layers, a| {
        layers[n - 2] = a.add_layer(evil.clone());
    });
    let out = f.run_fails("swapped", &swapped).await;
    assert!(
        out.contains("altered after signing")
            && out.contains("not unpacked from the signed layers"),
        "{out}"
    );
    // A layer slipped in below the checkpoint layer; and the base image's layers left out.
    let inserted = f.good.with_layers(&f.name("inserted"), |layers, a| {
        layers.insert(n - 1, a.add_layer(evil.clone()));
    });
    let out = f.run_fails("inserted", &inserted).await;
    assert!(out.contains("not unpacked from the signed layers"), "{out}");
    let bare = f.good.with_layers(&f.name("bare"), |layers, _| {
        layers.drain(..n - 2);
    });
    let out = f.run_fails("bare", &bare).await;
    assert!(out.contains("not unpacked from the signed layers"), "{out}");

    // A layer stacked on top of the checkpoint layer: below the top is then the checkpoint
    // layer, never part of the signed chain.
    let stacked = f.good.with_layers(&f.name("stacked"), |layers, a| {
        layers.push(a.add_layer(evil.clone()));
    });
    let out = f.run_fails("stacked", &stacked).await;
    assert!(out.contains("not unpacked from the signed layers"), "{out}");

    // The checkpoint layer itself carrying a library beside the reserved directory (its signed
    // files as they were: the signature still verifies).
    let mut grown = tar::Builder::new(Vec::new());
    for (h, data) in f.good.last_layer_entries() {
        let mut h = h.clone();
        let path = h.path().unwrap().to_string_lossy().into_owned();
        grown.append_data(&mut h, &path, &data[..]).unwrap();
    }
    let mut h = tar::Header::new_gnu();
    h.set_size(4);
    h.set_mode(0o755);
    h.set_cksum();
    grown
        .append_data(&mut h, "evil.so", &b"\x7fELF"[..])
        .unwrap();
    let grown = f
        .good
        .with_last_layer(&f.name("grown"), Some(grown.into_inner().unwrap()), None);
    let out = f.run_fails("grown", &grown).await;
    assert!(
        out.contains("is not a checkpoint layer") && out.contains("evil.so"),
        "{out}"
    );
}
