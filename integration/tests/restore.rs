//! Restore = start (issue 5): checkpoint images exported by `crabctl export` and containers
//! started from them under crab (`ctr run`, `crabctl fork`, `crabctl rollback`).
//!
//! Every test drives an agent [`Sandbox`] through real turns, then checks what a container
//! started from one of its checkpoints sees against what the sandbox saw at that turn.
//! Helpers first, then one function per behaviour; process-restore tests go at the end.

use std::{collections::HashMap, path::PathBuf, time::Duration};

use containerd_client::services::v1::{
    content_client::ContentClient, images_client::ImagesClient, GetImageRequest, ReadContentRequest,
};
use crab_integration::{
    sandbox::{Sandbox, SandboxOptions},
    stdio::StdioOptions,
    Harness, ProcessSpec, TaskStatus,
};
use serde_json::Value;

const T: Duration = Duration::from_secs(120);
const CRAB: &str = "io.containerd.crab.v1";
/// Where CRIU looks for its kernel probe cache.
const KDAT_LINK: &str = crab_shim::checkpoint::criu_rpc::KDAT_FILE;

/// The cache crab's dumps keep where `/run` is not a tmpfs (the shim's own path).
fn kdat_cache() -> PathBuf {
    std::path::Path::new(crab_shim::checkpoint::criu_rpc::KDAT_DIR).join("criu.kdat")
}

/// What a container's files look like, comparable across containers: the tree under /app
/// (directories, then every other entry with type, mode and size, then file digests), whether
/// an image file the turns delete is there, and whether crab's reserved directory shows.
const LISTING: &str = "cd / && find app -type d | sort && find app ! -type d -exec stat -c '%n %F %a %s' {} + | sort \
    && find app -type f -exec md5sum {} + | sort \
    && { test -e etc/debian_version && echo 'debian_version present' || echo 'debian_version absent'; }";
const RESERVED_SHOWS: &str =
    "test -e /.crab-checkpoint && echo 'reserved dir visible' || echo 'reserved dir hidden'";

// ---------------------------------------------------------------- helpers

/// crabctl must succeed; returns its stdout.
fn crabctl_ok(s: &Sandbox, args: &[&str]) -> String {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(
        code,
        0,
        "crabctl {args:?} failed:\nstdout: {out}\nstderr: {err}\n{}",
        s.h.log_excerpt(args.get(1).copied().unwrap_or(""))
    );
    out
}

/// crabctl's exit statuses (`crabctl --help`).
const NOT_FOUND: i32 = 3;
const REFUSED: i32 = 4;

/// crabctl must fail with exit status `status` and a message containing `needle`.
fn crabctl_fails(s: &Sandbox, args: &[&str], status: i32, needle: &str) {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(
        code, status,
        "crabctl {args:?} must fail with {status}:\nstdout: {out}\nstderr: {err}"
    );
    assert!(
        err.contains(needle),
        "crabctl {args:?}: the error does not say {needle:?}:\nstdout: {out}\nstderr: {err}"
    );
}

/// Ends the turn and waits until its checkpoint is published; returns the turn id.
async fn end_turn_checkpointed(s: &Sandbox) -> String {
    let turn = format!("t{}", s.turn);
    s.end_turn().await;
    for _ in 0..1200 {
        if s.manifests().iter().any(|m| m["turn_id"] == turn.as_str()) {
            return turn;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no checkpoint for turn {turn}: {:#?}", s.manifests());
}

/// The published manifest of turn `turn` (the first one: the turn's own checkpoint).
fn manifest_of(s: &Sandbox, turn: &str) -> Value {
    s.manifests()
        .into_iter()
        .find(|m| m["turn_id"] == turn)
        .unwrap_or_else(|| panic!("no manifest of {turn}"))
}

/// The listing of the sandbox's files as they are now.
async fn listing(s: &mut Sandbox) -> String {
    s.run(LISTING).await.stdout
}

async fn read_blob(h: &Harness, digest: &str) -> Vec<u8> {
    let mut stream = ContentClient::new(h.channel())
        .read(h.request(ReadContentRequest {
            digest: digest.into(),
            offset: 0,
            size: 0,
        }))
        .await
        .unwrap_or_else(|s| panic!("Content.Read {digest}: {s}"))
        .into_inner();
    let mut data = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        data.extend_from_slice(&chunk.data);
    }
    data
}

/// An image in containerd: its record's labels, manifest and config; `None` if there is none.
async fn image(h: &Harness, name: &str) -> Option<(HashMap<String, String>, Value, Value)> {
    let image = match ImagesClient::new(h.channel())
        .get(h.request(GetImageRequest { name: name.into() }))
        .await
    {
        Ok(r) => r.into_inner().image.unwrap(),
        Err(s) if s.code() == tonic::Code::NotFound => return None,
        Err(s) => panic!("Images.Get {name}: {s}"),
    };
    let target = image.target.unwrap();
    let manifest: Value = serde_json::from_slice(&read_blob(h, &target.digest).await).unwrap();
    let config: Value =
        serde_json::from_slice(&read_blob(h, manifest["config"]["digest"].as_str().unwrap()).await)
            .unwrap();
    Some((image.labels, manifest, config))
}

/// Removes images when dropped (also on panic): the names given, and the checkpoint images
/// crabctl made for containers started from the given sandboxes' checkpoints.
struct ImageGuard {
    h: Harness,
    names: Vec<String>,
    internal_of: Vec<String>,
}

impl ImageGuard {
    fn new(h: &Harness, names: &[&str], internal_of: &[&str]) -> ImageGuard {
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        ImageGuard {
            h: h.clone(),
            names: owned(names),
            internal_of: owned(internal_of),
        }
    }
}

impl Drop for ImageGuard {
    fn drop(&mut self) {
        let mut names = self.names.clone();
        for c in &self.internal_of {
            names.extend(self.h.internal_images(c));
        }
        for name in names {
            let _ = self.h.ctr().run(&["images", "rm", &name]);
        }
    }
}

/// Runs containerd's garbage collector now (removing an image with --sync collects everything
/// unreferenced before it returns).
fn force_gc(h: &Harness, tag: &str) {
    let dummy = format!("localhost/crab-test/gc-{tag}:x");
    h.ctr()
        .run(&["images", "tag", &h.image.name, &dummy])
        .unwrap()
        .ok()
        .unwrap();
    h.ctr()
        .run(&["images", "rm", "--sync", &dummy])
        .unwrap()
        .ok()
        .unwrap();
}

/// `ctr run --rm` of `image` under crab with `bash -c script`; returns its stdout. The
/// container's crab state goes to a directory of its own, removed afterwards; it trusts the
/// signing key of `signer`, the sandbox that exported the image.
/// A crab config for container `id` that trusts `signer`'s key, with its own state dir:
/// (config file, state dir).
fn trusting_config(h: &Harness, signer: &Sandbox, id: &str) -> (PathBuf, PathBuf) {
    let state = h.env.crab_home.join("state").join(id);
    let config = state.with_extension("toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(
        &config,
        format!(
            "[store]\nstate_dir = \"{}\"\n[restore]\ntrusted_keys = [\"{}\"]\n",
            state.display(),
            signer
                .state_dir
                .join("keys/checkpoint-signing.pub")
                .display()
        ),
    )
    .unwrap();
    (config, state)
}

fn ctr_run(h: &Harness, signer: &Sandbox, image: &str, id: &str, script: &str) -> String {
    let _g = h.guard(&[id]);
    let (config, state) = trusting_config(h, signer, id);
    let out = h.ctr().run_with(
        &[
            "run",
            "--rm",
            "--runtime",
            CRAB,
            "--runtime-config-path",
            config.to_str().unwrap(),
            image,
            id,
            "bash",
            "-c",
            script,
        ],
        None,
        T,
    );
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_dir_all(&state);
    let out = out.unwrap();
    assert!(
        out.status.success(),
        "ctr run {image}: {} {}\n{}",
        out.stdout,
        out.stderr,
        h.log_excerpt(id)
    );
    out.stdout
}

/// A sandbox of container `id` (a fork or the rolled-back container), for running turns in it.
fn sandbox_for(s: &Sandbox, id: &str) -> Sandbox {
    Sandbox {
        h: s.h.clone(),
        id: id.to_string(),
        state_dir: s.state_dir.clone(),
        turn: 0,
    }
}

fn reserved_dir_hidden(out: &str, what: &str) {
    assert!(
        out.contains("reserved dir hidden"),
        "{what}: /.crab-checkpoint is visible inside the container (the shim must hide it on Create): {out}"
    );
}

/// Three fs turns (an edit, a delete of an image file and of a file of turn 1, a directory
/// removed); returns each turn's id with the listing the sandbox showed right after it.
async fn three_fs_turns(s: &mut Sandbox) -> Vec<(String, String)> {
    let mut turns = Vec::new();
    for script in [
        "mkdir -p /app/src && echo one > /app/src/a.txt && echo keep > /app/keep.txt && chmod 640 /app/keep.txt",
        "echo two >> /app/src/a.txt && rm /app/keep.txt /etc/debian_version && ln -s src/a.txt /app/link",
        "rm -r /app/src && echo three > /app/b.txt && head -c 300000 /dev/urandom > /app/blob.bin",
    ] {
        s.run(script).await;
        let turn = end_turn_checkpointed(s).await;
        turns.push((turn, listing(s).await));
    }
    turns
}

// ---------------------------------------------------------------- export

/// `crabctl export` of an fs-only chain: the image in containerd has the base layers, the
/// chain and one checkpoint layer, runs the container's process, carries crab's
/// labels, and `ctr run` of it under crab shows exactly the files of that turn (also of an
/// earlier turn with --turn).
#[tokio::test(flavor = "multi_thread")]
async fn export_of_an_fs_chain_runs_as_that_turn() {
    let (mut s, _g) = Sandbox::start("restore_export", SandboxOptions::default()).await;
    let h = s.h.clone();
    let turns = three_fs_turns(&mut s).await;
    let (latest_ref, first_ref) = (
        format!("localhost/crab-test/{}:latest", s.id),
        format!("localhost/crab-test/{}:first", s.id),
    );
    let _images = ImageGuard::new(&h, &[&latest_ref, &first_ref], &[]);

    let out = crabctl_ok(&s, &["export", &s.id, &latest_ref]);
    assert!(out.contains("files only"), "{out}");
    let (labels, manifest, config) = image(&h, &latest_ref)
        .await
        .expect("the image record exists");
    let (_, base_manifest, base_config) = image(&h, &h.image.name).await.unwrap();
    let base_layers = base_manifest["layers"].as_array().unwrap().len();
    let m = manifest_of(&s, &turns[2].0);
    let chain = m["fs_layers"].as_array().unwrap().len();
    assert_eq!(chain, 3, "three fs turns make a chain of three: {m:#}");
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), base_layers + chain + 1, "{manifest:#}");
    assert_eq!(
        layers[..base_layers],
        base_manifest["layers"].as_array().unwrap()[..],
        "the base layers are the image's"
    );
    for (i, l) in m["fs_layers"].as_array().unwrap().iter().enumerate() {
        assert_eq!(layers[base_layers + i]["digest"], l["digest"]);
    }
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        config["rootfs"]["diff_ids"].as_array().unwrap().len(),
        layers.len()
    );
    // The config runs the container's process (`sleep infinity`, with the image's env and
    // working directory here); the rest is the base's.
    assert_eq!(
        config["config"]["Cmd"],
        serde_json::json!(["sleep", "infinity"]),
        "the container's args"
    );
    assert!(
        base_config["config"]["Entrypoint"].is_null() && config["config"]["Entrypoint"].is_null(),
        "{config:#}"
    );
    for key in ["Env", "WorkingDir", "User"] {
        assert_eq!(
            config["config"][key], base_config["config"][key],
            "config {key} kept"
        );
    }
    let source = format!("{}/{}@{}", h.env.namespace, s.id, m["seq"]);
    assert_eq!(
        config["config"]["Labels"]["io.crab.checkpoint.base-layers"],
        base_layers.to_string()
    );
    assert_eq!(
        config["config"]["Labels"]["io.crab.checkpoint.source"],
        source.as_str()
    );
    assert_eq!(labels.get("io.crab.checkpoint.source"), Some(&source));

    // The image holds on to its content by itself (crabctl's lease is gone): a synchronous
    // garbage collection keeps every blob.
    force_gc(&h, &s.id);
    for l in layers {
        let digest = l["digest"].as_str().unwrap();
        assert_eq!(
            read_blob(&h, digest).await.len() as u64,
            l["size"].as_u64().unwrap(),
            "layer {digest} after GC"
        );
    }

    let restored = ctr_run(
        &h,
        &s,
        &latest_ref,
        &format!("{}-run-latest", s.id),
        &format!("{LISTING}; {RESERVED_SHOWS}"),
    );
    assert!(
        restored.starts_with(&turns[2].1),
        "the latest export shows other files than turn {}:\nsandbox:\n{}\nrestored:\n{restored}",
        turns[2].0,
        turns[2].1
    );

    crabctl_ok(&s, &["export", &s.id, "--turn", &turns[0].0, &first_ref]);
    let (_, manifest, _) = image(&h, &first_ref).await.unwrap();
    assert_eq!(
        manifest["layers"].as_array().unwrap().len(),
        base_layers + 1 + 1
    );
    let restored_first = ctr_run(
        &h,
        &s,
        &first_ref,
        &format!("{}-run-first", s.id),
        &format!("{LISTING}; {RESERVED_SHOWS}"),
    );
    assert!(
        restored_first.starts_with(&turns[0].1),
        "--turn {}: other files:\nsandbox:\n{}\nrestored:\n{restored_first}",
        turns[0].0,
        turns[0].1
    );

    // Exporting the same checkpoint again gives the same image.
    let again = format!("localhost/crab-test/{}:again", s.id);
    let _again = ImageGuard::new(&h, &[&again], &[]);
    crabctl_ok(&s, &["export", &s.id, "--turn", &turns[0].0, &again]);
    assert_eq!(
        image(&h, &again).await.unwrap().1,
        manifest,
        "exports are reproducible"
    );

    reserved_dir_hidden(&restored, "ctr run of the exported image");
    s.finish().await;
}

// ---------------------------------------------------------------- fork

/// `crabctl fork --count 8` of an fs checkpoint: eight running containers with the
/// checkpoint's files, each changed differently, none seeing another's files or processes,
/// and the source untouched.
#[tokio::test(flavor = "multi_thread")]
async fn fork_8_of_an_fs_checkpoint_are_independent() {
    let (mut s, _g) = Sandbox::start("restore_fork", SandboxOptions::default()).await;
    let h = s.h.clone();
    let _images = ImageGuard::new(&h, &[], &[&s.id]);
    s.run("echo base > /app/base.txt && mkdir /app/shared")
        .await;
    let turn = end_turn_checkpointed(&s).await;
    let expected = listing(&mut s).await;

    let out = crabctl_ok(&s, &["fork", &s.id, "--at", &turn, "--count", "8"]);
    let ids: Vec<String> = out.lines().map(str::to_string).collect();
    let want: Vec<String> = (1..=8).map(|i| format!("{}-fork-{i}", s.id)).collect();
    assert_eq!(ids, want, "{out}");
    let mut guard = h.guard(&[]);
    for id in &ids {
        guard.add(id);
    }
    let mut forks: Vec<Sandbox> = ids.iter().map(|id| sandbox_for(&s, id)).collect();

    // Each starts from the checkpoint, then changes its files and starts a process of its own.
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut f) in forks.drain(..).enumerate() {
        let expected = expected.clone();
        tasks.spawn(async move {
            let seen = listing(&mut f).await;
            assert_eq!(seen, expected, "fork {} does not start from the checkpoint", f.id);
            let hidden = f.run(RESERVED_SHOWS).await.stdout;
            f.run(&format!(
                "echo fork-{i} > /app/mine-{i}.txt && echo {i} >> /app/base.txt && touch /app/shared/{i} && \
                 (nohup sleep {} >/dev/null 2>&1 &) && sleep 0.2",
                100_000 + i
            ))
            .await;
            (i, f, hidden)
        });
    }
    let mut forks = Vec::new();
    while let Some(r) = tasks.join_next().await {
        forks.push(r.unwrap());
    }
    forks.sort_by_key(|(i, _, _)| *i);
    for (i, f, _) in forks.iter_mut() {
        let files = f
            .run("ls /app /app/shared && cat /app/base.txt")
            .await
            .stdout;
        let procs = f.run("ps -eo args").await.stdout;
        for j in 0..8 {
            let own = j == *i;
            assert_eq!(
                files.contains(&format!("mine-{j}.txt")),
                own,
                "fork {i} and mine-{j}.txt:\n{files}"
            );
            assert_eq!(
                procs.contains(&format!("sleep {}", 100_000 + j)),
                own,
                "fork {i} and sleep of {j}:\n{procs}"
            );
        }
        assert!(
            files.ends_with(&format!("base\n{i}\n")),
            "fork {i}: {files}"
        );
        let (_, pid) = h.status(&f.id, "").await.unwrap();
        assert_ne!(pid, 0);
    }
    let source = listing(&mut s).await;
    assert_eq!(source, expected, "the source saw its forks' changes");

    // Forking again numbers on.
    let more = crabctl_ok(&s, &["fork", &s.id, "--at", &turn, "--count", "1"]);
    assert_eq!(more.trim(), format!("{}-fork-9", s.id));
    guard.add(more.trim());
    h.kill_and_remove(more.trim()).await.unwrap();

    for (_, f, hidden) in &forks {
        reserved_dir_hidden(hidden, &format!("fork {}", f.id));
    }
    for (_, f, _) in forks {
        h.kill_and_remove(&f.id).await.unwrap();
        h.assert_no_leaks(&f.id).await;
    }
    s.finish().await;
}

/// `crabctl fork --count 3` of a process checkpoint: each fork has the process back, the
/// shims verified and copied the CRIU image once (the host's restore cache: one shim verified
/// it into the cache, the others linked that copy), the forks' stores share the one pack of
/// its deduplicated pages, and each fork checkpoints on its own afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn fork_3_of_a_process_checkpoint_share_one_verified_image() {
    let (mut s, _g) = Sandbox::start("restore_forkproc", SandboxOptions::default()).await;
    let h = s.h.clone();
    let _images = ImageGuard::new(&h, &[], &[&s.id]);
    s.run("(nohup sleep 424242 >/dev/null 2>&1 &) && sleep 0.2")
        .await;
    let turn = end_turn_checkpointed(&s).await;
    assert!(
        !manifest_of(&s, &turn)["process"].is_null(),
        "a process turn: {:#}",
        manifest_of(&s, &turn)
    );
    // The link to CRIU's cache is made again by these restores (only crab's own link goes:
    // where /run is a tmpfs this is CRIU's own cache file, left alone).
    if std::fs::read_link(KDAT_LINK).is_ok_and(|t| t == kdat_cache()) {
        std::fs::remove_file(KDAT_LINK).unwrap();
    }
    let from = h.env.containerd_log_len();
    let out = crabctl_ok(
        &s,
        &["fork", &s.id, "--at", &turn, "--count", "3", "-o", "json"],
    );
    let report: Value = serde_json::from_str(&out).unwrap();
    let ids: Vec<String> = report["forks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["id"].as_str().unwrap().to_string())
        .collect();
    let mut guard = h.guard(&[]);
    for id in &ids {
        guard.add(id);
    }
    assert_eq!(ids.len(), 3, "{out}");
    runc_s_criu_loads_the_kernel_probe_cache();
    assert_eq!(
        report["image_reused"], false,
        "the first fork builds it: {out}"
    );
    for id in &ids {
        let mut f = sandbox_for(&s, id);
        f.turn = 1;
        let procs = f.run("ps -eo args").await.stdout;
        assert!(procs.contains("sleep 424242"), "fork {id}: {procs}");
    }
    // How each shim got the image: one verified it into the cache, the others linked it.
    let verified = |text: &str| {
        ids.iter()
            .all(|id| text.contains(&format!("checkpoint image of {id} verified in ")))
    };
    let text =
        crab_integration::harness::log_once(&h.env, from, Duration::from_secs(15), verified).await;
    let how: Vec<&str> = ids
        .iter()
        .map(|id| {
            let needle = format!("checkpoint image of {id} verified in ");
            let line = text
                .lines()
                .find(|l| l.contains(&needle))
                .unwrap_or_else(|| panic!("no verification logged for {id}"));
            if line.contains("verified into the restore cache") {
                "built"
            } else if line.contains("the restore cache's verified copy") {
                "linked"
            } else {
                "other"
            }
        })
        .collect();
    assert_eq!(how.iter().filter(|h| **h == "built").count(), 1, "{how:?}");
    assert_eq!(how.iter().filter(|h| **h == "linked").count(), 2, "{how:?}");
    let entries = s.state_dir.join(".restore-cache/entries");
    assert_eq!(
        std::fs::read_dir(&entries).unwrap().count(),
        1,
        "one cached image in {}",
        entries.display()
    );
    // No restore wrote to the cached image (CRIU writes its statistics into the directory it
    // restores from: each restore's own copy): its files still hash to its key.
    let entry = std::fs::read_dir(&entries)
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let mut files = std::collections::BTreeMap::new();
    for f in std::fs::read_dir(entry.path().join("image"))
        .unwrap()
        .flatten()
    {
        let mut r = crab_shim::checkpoint::provenance::HashingReader::new(
            std::fs::File::open(f.path()).unwrap(),
        );
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        files.insert(f.file_name().into_string().unwrap(), r.finish());
    }
    assert_eq!(
        crab_shim::restore::cache::RestoreCache::key(&files),
        entry.file_name().to_string_lossy(),
        "the cached image changed: {files:#?}"
    );
    // Each fork's store imports the image (in the background): the same pack in all three.
    let mut packs = Vec::new();
    for id in &ids {
        let store = s.state_dir.join(&h.env.namespace).join(id);
        let mut pack = None;
        for _ in 0..200 {
            let origin = std::fs::read_dir(store.join("checkpoints"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    serde_json::from_slice::<Value>(&std::fs::read(e.path()).ok()?).ok()
                })
                .find(|m| m["kind"] == "restored");
            if origin.is_some_and(|m| !m["process"].is_null()) {
                pack = std::fs::read_dir(store.join("chunks"))
                    .unwrap()
                    .flatten()
                    .find(|e| e.file_name().to_string_lossy().ends_with(".pack"))
                    .map(|e| {
                        use std::os::unix::fs::MetadataExt;
                        e.metadata().unwrap().ino()
                    });
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        packs.push(pack.unwrap_or_else(|| panic!("{id}: no imported process image")));
    }
    assert!(packs.iter().all(|p| *p == packs[0]), "{packs:?}");
    // A fork checkpoints on its own: a process turn of its own, published in its store.
    let mut f = sandbox_for(&s, &ids[0]);
    f.turn = 2;
    f.run("(nohup sleep 434343 >/dev/null 2>&1 &) && sleep 0.2")
        .await;
    let t = end_turn_checkpointed(&f).await;
    assert!(!manifest_of(&f, &t)["process"].is_null());
    // Forking the same checkpoint again takes the image built the first time, as it is.
    let again = crabctl_ok(
        &s,
        &["fork", &s.id, "--at", &turn, "--count", "1", "-o", "json"],
    );
    let again: Value = serde_json::from_str(&again).unwrap();
    let id = again["forks"][0]["id"].as_str().unwrap().to_string();
    guard.add(&id);
    assert_eq!(again["image_reused"], true, "{again:#}");
    assert_eq!(again["image"], report["image"]);
    let mut f = sandbox_for(&s, &id);
    f.turn = 1;
    let procs = f.run("ps -eo args").await.stdout;
    assert!(procs.contains("sleep 424242"), "fork {id}: {procs}");
    for id in ids.iter().chain([&id]) {
        h.kill_and_remove(id).await.unwrap();
        h.assert_no_leaks(id).await;
    }
    drop(guard);
    s.finish().await;
}

/// The host pid of the child of `init` (a host pid) whose command line contains `needle`.
fn child_of(init: u32, needle: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(init) && String::from_utf8_lossy(&cmdline).contains(needle)
        })
}

/// A process's proportional set size (`/proc/PID/smaps_rollup`), in KiB.
fn pss_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no Pss in {text}"))
}

/// 40 MB of random bytes; SIGUSR1 writes their digest to /tmp/held-sha, SIGUSR2 changes the
/// first page and writes it again.
const KSM_HOLDER: &str = r#"cat > /app/ksm-holder.py <<'EOF'
import hashlib, os, signal, time
data = bytearray(os.urandom(40 << 20))
def say(*_):
    with open("/tmp/held-sha.new", "w") as f:
        f.write(hashlib.sha256(data).hexdigest())
    os.rename("/tmp/held-sha.new", "/tmp/held-sha")
def change(*_):
    data[0:4096] = b"x" * 4096
    say()
signal.signal(signal.SIGUSR1, say)
signal.signal(signal.SIGUSR2, change)
say()
while True:
    time.sleep(3600)
EOF
(nohup python3 /app/ksm-holder.py >/dev/null 2>&1 &) && for i in $(seq 100); do test -e /tmp/held-sha && break; sleep 0.1; done"#;

/// Signals the holder (`USR1`: say, `USR2`: change and say) and prints what it said.
fn ask_holder(signal: &str) -> String {
    format!(
        "rm -f /tmp/held-sha && pkill -{signal} -f '[k]sm-holder' && for i in $(seq 100); do \
         test -e /tmp/held-sha && break; sleep 0.1; done && cat /tmp/held-sha"
    )
}

/// `crabctl fork --merge-memory` of a process checkpoint: the forks' processes are marked for
/// the kernel's same-page merging (a fork without the flag is not), and while the host's ksmd
/// runs their memory, restored by copying, becomes one copy again: the summed PSS of three
/// forks' 40 MB holders falls to under twice one unmerged fork's. Merged pages stay private
/// to each fork in what it sees: each holds the checkpoint's bytes, and a write in one fork
/// changes that fork's memory alone.
#[tokio::test(flavor = "multi_thread")]
async fn forks_with_merge_memory_share_their_identical_pages() {
    assert!(
        crab_shim::sys::ksm::merge_any_supported() && crab_shim::sys::ksm::ksmd_running().is_some(),
        "this kernel has no KSM or no PR_SET_MEMORY_MERGE (Linux 6.4): the test needs both"
    );
    let (mut s, _g) = Sandbox::start("restore_ksm", SandboxOptions::default()).await;
    let h = s.h.clone();
    let _images = ImageGuard::new(&h, &[], &[&s.id]);
    s.run(KSM_HOLDER).await;
    let original = s.run("cat /tmp/held-sha").await.stdout;
    assert_eq!(original.len(), 64, "{original:?}");
    let turn = end_turn_checkpointed(&s).await;
    assert!(!manifest_of(&s, &turn)["process"].is_null());

    let fork = |merge: bool, count: &str| {
        let mut args = vec!["fork", &s.id, "--at", &turn, "--count", count, "-o", "json"];
        if merge {
            args.push("--merge-memory");
        }
        let out = crabctl_ok(&s, &args);
        let report: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["merge_memory"], merge, "{out}");
        report["forks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["id"].as_str().unwrap().to_string(),
                    f["pid"].as_u64().unwrap() as u32,
                )
            })
            .collect::<Vec<_>>()
    };
    let merged = fork(true, "3");
    let plain = fork(false, "1");
    let mut guard = h.guard(&[]);
    for (id, _) in merged.iter().chain(&plain) {
        guard.add(id);
    }
    let holder = |init: u32| {
        child_of(init, "ksm-holder.py").unwrap_or_else(|| panic!("no holder under {init}"))
    };
    let merged_pids: Vec<u32> = merged.iter().map(|(_, init)| holder(*init)).collect();
    let plain_pid = holder(plain[0].1);
    for pid in &merged_pids {
        let st = crab_shim::sys::ksm::stat(*pid).unwrap();
        assert!(
            st.merge_any,
            "a --merge-memory fork's process is marked: {st:?}"
        );
    }
    let st = crab_shim::sys::ksm::stat(plain_pid).unwrap();
    assert!(!st.merge_any, "a plain fork's process is not: {st:?}");

    // ksmd at a test's pace: 5,000 pages every 20 ms.
    let ksm = crab_integration::ksm::KsmPace::set(5000, 20).expect("the host's KSM settings");
    let one = pss_kib(plain_pid);
    assert!(
        one > 40 << 10,
        "a restored holder holds its 40 MB: {one} KiB"
    );
    let mut summed = 0;
    for _ in 0..600 {
        summed = merged_pids.iter().map(|p| pss_kib(*p)).sum::<u64>();
        if summed <= 2 * one {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let merging: Vec<u64> = merged_pids
        .iter()
        .map(|p| crab_shim::sys::ksm::stat(*p).unwrap().merging_pages)
        .collect();
    eprintln!(
        "three merged forks: summed PSS {summed} KiB against {one} KiB for one unmerged; \
         merged pages {merging:?}"
    );
    assert!(
        summed <= 2 * one,
        "summed PSS of three merged forks {summed} KiB, one unmerged fork {one} KiB"
    );
    assert!(merging.iter().all(|m| *m > 0), "{merging:?}");
    assert_eq!(
        crab_shim::sys::ksm::stat(plain_pid).unwrap().merging_pages,
        0,
        "the plain fork merged nothing"
    );

    // What the forks see: the checkpoint's bytes; a write in one changes only its own.
    let mut forks: Vec<Sandbox> = merged.iter().map(|(id, _)| sandbox_for(&s, id)).collect();
    for f in forks.iter_mut() {
        assert_eq!(
            f.run(&ask_holder("USR1")).await.stdout,
            original,
            "{}",
            f.id
        );
    }
    let changed = forks[0].run(&ask_holder("USR2")).await.stdout;
    assert_eq!(changed.len(), 64, "{changed:?}");
    assert_ne!(changed, original, "the write changed fork {}", forks[0].id);
    for f in forks.iter_mut().skip(1) {
        assert_eq!(
            f.run(&ask_holder("USR1")).await.stdout,
            original,
            "{}",
            f.id
        );
    }
    drop(ksm);
    for (id, _) in merged.iter().chain(&plain) {
        h.kill_and_remove(id).await.unwrap();
        h.assert_no_leaks(id).await;
    }
    drop(guard);
    s.finish().await;
}

// ---------------------------------------------------------------- rollback

/// `crabctl rollback` across fs turns, backwards then forwards then to the middle: the same
/// container id with a new task whose files are those of the turn; a running exec ends and is
/// reported; the sandbox keeps taking checkpoints afterwards and the lineage records the
/// rollbacks.
#[tokio::test(flavor = "multi_thread")]
async fn rollback_across_fs_turns_backwards_and_forwards() {
    let (mut s, _g) = Sandbox::start("restore_rollback", SandboxOptions::default()).await;
    let h = s.h.clone();
    let _images = ImageGuard::new(&h, &[], &[&s.id]);
    let turns = three_fs_turns(&mut s).await;
    let (_, pid_before) = h.status(&s.id, "").await.unwrap();

    // An exec still running when the rollback comes.
    let io = h.stdio(&s.id, "long", StdioOptions::default()).unwrap();
    h.exec(&s.id, "long", &ProcessSpec::new(&["sleep", "1000"]), &io)
        .await
        .unwrap();
    h.start(&s.id, "long").await.unwrap();

    let out = crabctl_ok(&s, &["rollback", &s.id, "--to", &turns[0].0]);
    assert!(
        out.contains("ended 1 running execs") && out.contains("long"),
        "{out}"
    );
    drop(io);
    let (_, pid_after) = h.status(&s.id, "").await.unwrap();
    assert_ne!(pid_after, pid_before, "a new task");
    let mut s2 = sandbox_for(&s, &s.id);
    s2.turn = 100;
    assert_eq!(
        listing(&mut s2).await,
        turns[0].1,
        "backwards to {}",
        turns[0].0
    );
    reserved_dir_hidden(&s2.run(RESERVED_SHOWS).await.stdout, "after rollback");

    // Forwards again, past the turn rolled back to, then to the middle.
    for (turn, expected) in [&turns[2], &turns[1]] {
        let out = crabctl_ok(&s, &["rollback", &s.id, "--to", turn]);
        assert!(!out.contains("running execs"), "{out}");
        assert_eq!(&listing(&mut s2).await, expected, "rollback to {turn}");
    }

    // Each rollback dropped the checkpoint image the previous one started from.
    let seq_of = |turn: &str| manifest_of(&s, turn)["seq"].as_u64().unwrap();
    assert_eq!(
        h.internal_images(&s.id),
        [format!(
            "crab.local/checkpoint/{}/{}:{}",
            h.env.namespace,
            s.id,
            seq_of(&turns[1].0)
        )]
    );

    // The sandbox goes on: a new turn is checkpointed on top of the restored chain.
    s2.run("echo after > /app/after.txt").await;
    let after = end_turn_checkpointed(&s2).await;
    let m = manifest_of(&s2, &after);
    let middle = manifest_of(&s, &turns[1].0);
    let chain = m["fs_layers"].as_array().unwrap();
    assert_eq!(
        chain.len(),
        middle["fs_layers"].as_array().unwrap().len() + 1,
        "{m:#}"
    );
    assert_eq!(
        chain[..chain.len() - 1],
        middle["fs_layers"].as_array().unwrap()[..]
    );
    // After a garbage collection, the rolled-back container still exports: its image (one of
    // crabctl's) says where its base ends, its store has the rest.
    force_gc(&h, &s.id);
    let reference = format!("localhost/crab-test/{}:after", s.id);
    let _after = ImageGuard::new(&h, &[&reference], &[]);
    crabctl_ok(&s, &["export", &s.id, &reference]);
    let (_, exported, _) = image(&h, &reference).await.unwrap();
    let (_, base, _) = image(&h, &h.image.name).await.unwrap();
    assert_eq!(
        exported["layers"].as_array().unwrap().len(),
        base["layers"].as_array().unwrap().len() + chain.len() + 1,
        "{exported:#}"
    );

    // The lineage records each rollback as a `restored` checkpoint of the turn it returned to.
    let restored: Vec<Value> = s
        .lineage()
        .into_iter()
        .filter(|m| m["kind"] == "restored")
        .collect();
    assert_eq!(restored.len(), 3, "{:#?}", s.lineage());
    assert_eq!(
        restored[2]["turn_id"],
        turns[1].0.as_str(),
        "{:#}",
        restored[2]
    );
    s.finish().await;
}

/// `crabctl recover` after the container's processes were SIGKILLed, and of a paused
/// container: back at the newest checkpoint, same id, running again.
#[tokio::test(flavor = "multi_thread")]
async fn recover_after_the_processes_were_killed() {
    let (mut s, _g) = Sandbox::start("restore_recover", SandboxOptions::default()).await;
    let h = s.h.clone();
    let _images = ImageGuard::new(&h, &[], &[&s.id]);
    s.run("echo kept > /app/kept.txt").await;
    end_turn_checkpointed(&s).await;
    let expected = listing(&mut s).await;
    h.kill(&s.id, "", libc::SIGKILL, true).await.unwrap();
    h.wait(&s.id, "", T).await.unwrap();
    let out = crabctl_ok(&s, &["recover", &s.id]);
    assert!(out.starts_with("recovered"), "{out}");
    let mut again = sandbox_for(&s, &s.id);
    again.turn = 100;
    assert_eq!(listing(&mut again).await, expected);

    // A paused (frozen) sandbox: its processes are thawed so that they can die.
    h.pause(&s.id).await.unwrap();
    let out = crabctl_ok(&s, &["recover", &s.id]);
    assert!(out.starts_with("recovered"), "{out}");
    assert_eq!(h.status(&s.id, "").await.unwrap().0, TaskStatus::Running);
    assert_eq!(listing(&mut again).await, expected);
    s.finish().await;
}

/// After a restore, the CRIU `runc restore` starts (the host's `criu`, in the host's mount
/// namespace) loads the kernel probe cache crab's dumps keep: where `/run` is not a tmpfs,
/// `/run/criu.kdat` links to it, and a CRIU run as runc runs it says it loaded the cache
/// instead of probing the kernel. Where `/run` is a tmpfs, CRIU keeps its own there and crab
/// makes no link.
fn runc_s_criu_loads_the_kernel_probe_cache() {
    let out = |cmd: &mut std::process::Command| {
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{cmd:?}: {o:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    let run_fs = out(std::process::Command::new("stat").args(["-f", "-c", "%T", "/run"]));
    let link = std::fs::read_link(KDAT_LINK).ok();
    if run_fs.trim() == "tmpfs" {
        assert_ne!(
            link.as_deref(),
            Some(kdat_cache().as_path()),
            "crab linked CRIU's cache on a host that keeps it itself"
        );
        return;
    }
    assert_eq!(
        link.as_deref(),
        Some(kdat_cache().as_path()),
        "/run is {run_fs}: a restore links /run/criu.kdat to crab's CRIU cache"
    );
    let work = tempfile::tempdir().unwrap();
    out(std::process::Command::new("criu")
        .args(["check", "-v4", "-o", "check.log", "-W"])
        .arg(work.path()));
    let log = std::fs::read_to_string(work.path().join("check.log")).unwrap();
    assert!(
        log.contains("Loaded kdat cache from /run/criu.kdat"),
        "CRIU probed the kernel instead of loading crab's cache:\n{log}"
    );
}

// ---------------------------------------------------------------- bad input

/// Unknown containers, unknown turns and failed checkpoints: a clear error, and nothing is
/// created (no image, no fork) or stopped (the sandbox keeps its task).
#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_and_changes_nothing() {
    let (mut s, _g) = Sandbox::start("restore_bad", SandboxOptions::default()).await;
    let h = s.h.clone();
    s.run("echo x > /app/x").await;
    let turn = end_turn_checkpointed(&s).await;
    let (_, pid) = h.status(&s.id, "").await.unwrap();
    let reference = format!("localhost/crab-test/{}:bad", s.id);
    let _images = ImageGuard::new(&h, &[&reference], &[&s.id]);
    let unknown = format!("{}-nosuch", s.id);

    crabctl_fails(
        &s,
        &["export", &unknown, &reference],
        NOT_FOUND,
        &format!("no container {unknown}"),
    );
    crabctl_fails(
        &s,
        &["fork", &unknown, "--at", &turn, "--count", "2"],
        NOT_FOUND,
        "no container",
    );
    crabctl_fails(
        &s,
        &["rollback", &unknown, "--to", &turn],
        NOT_FOUND,
        "no container",
    );
    crabctl_fails(&s, &["recover", &unknown], NOT_FOUND, "no container");
    crabctl_fails(
        &s,
        &["export", &s.id, "--turn", "t999", &reference],
        NOT_FOUND,
        "has no checkpoint t999",
    );
    crabctl_fails(
        &s,
        &["export", &s.id, "--turn", "999", &reference],
        NOT_FOUND,
        "has no checkpoint 999",
    );
    crabctl_fails(
        &s,
        &["fork", &s.id, "--at", "t999", "--count", "2"],
        NOT_FOUND,
        "has no checkpoint t999",
    );
    crabctl_fails(
        &s,
        &["rollback", &s.id, "--to", "t999"],
        NOT_FOUND,
        "has no checkpoint t999",
    );
    let (code, _, err) = s.crabctl(&["fork", &s.id, "--at", &turn, "--count", "0"]);
    assert_eq!(code, 2, "a usage error: {err}");

    // A failed checkpoint (as the shim records one when its store is full) is no recovery point.
    let last = s.manifests().last().cloned().unwrap();
    let seq = last["seq"].as_u64().unwrap() + 1;
    let mut failed = last.clone();
    failed["seq"] = seq.into();
    failed["parent"] = last["seq"].clone();
    failed["kind"] = "failed".into();
    failed["turn_id"] = "tfailed".into();
    failed["explanation"] = "injected by the test: a failed checkpoint".into();
    std::fs::write(
        s.store().join(format!("checkpoints/{seq:06}.json")),
        serde_json::to_vec(&failed).unwrap(),
    )
    .unwrap();
    let seq_arg = seq.to_string();
    for args in [
        vec![
            "export",
            s.id.as_str(),
            "--turn",
            "tfailed",
            reference.as_str(),
        ],
        vec![
            "export",
            s.id.as_str(),
            "--turn",
            seq_arg.as_str(),
            reference.as_str(),
        ],
        vec!["rollback", s.id.as_str(), "--to", "tfailed"],
        vec!["fork", s.id.as_str(), "--at", "tfailed", "--count", "1"],
    ] {
        crabctl_fails(&s, &args, REFUSED, "failed: it is not a recovery point");
    }
    // Without --turn, the newest recovery point before the failure is taken.
    let out = crabctl_ok(&s, &["export", &s.id, &reference]);
    assert!(
        out.contains(&format!("checkpoint {}", last["seq"])),
        "{out}"
    );
    h.ctr().run(&["images", "rm", &reference]).unwrap();

    assert!(
        image(&h, &reference).await.is_none(),
        "an image was left behind"
    );
    let containers = h.inventory().await.unwrap();
    let leftovers: Vec<&String> = containers
        .iter()
        .flat_map(|n| &n.containers)
        .filter(|c| c.starts_with(&s.id) && **c != s.id)
        .collect();
    assert!(
        leftovers.is_empty(),
        "containers were created: {leftovers:?}"
    );
    assert_eq!(
        h.status(&s.id, "").await.unwrap().1,
        pid,
        "the sandbox was touched"
    );
    assert!(!h.env.crab_home.join("state").join(&unknown).exists());
    s.finish().await;
}

// ---------------------------------------------------------------- terminals

/// Creates and starts container `id` of `h`'s image running `bash` on a terminal of its own
/// (as `ctr run -t` and `docker run -t` do), with crab's store in `state_dir` trusting the
/// signing key under `trusted` (if any); returns its stdio.
async fn start_on_a_terminal(
    h: &Harness,
    id: &str,
    state_dir: &std::path::Path,
    trusted: Option<&std::path::Path>,
) -> crab_integration::Stdio {
    let process = ProcessSpec::new(&["bash"])
        .terminal(true)
        .to_oci(&h.image.env, &h.image.cwd);
    let spec = crab_integration::spec::container_spec(id, &h.env.namespace, process);
    let mut config = format!("[store]\nstate_dir = \"{}\"\n", state_dir.display());
    if let Some(key) = trusted {
        config.push_str(&format!(
            "[restore]\ntrusted_keys = [\"{}\"]\n",
            key.display()
        ));
    }
    h.create_container_with_spec_and_options(
        id,
        &spec,
        Some(crab_integration::api::crab_runtime_options(
            None,
            Some(&config),
        )),
    )
    .await
    .unwrap();
    let io = h
        .stdio(
            id,
            "init",
            StdioOptions {
                stdin: true,
                terminal: true,
            },
        )
        .unwrap();
    h.create_task(id, Some(&io)).await.unwrap();
    h.start(id, "").await.unwrap();
    io
}

/// What the restored shell's terminal says about itself: its standard input, its size.
const TTY_PROBE: &str = "readlink /proc/1/fd/0; stty size < /proc/1/fd/0; cat /app/tty.txt; \
    pgrep -x sleep >/dev/null && echo 'sleep alive'";

/// A sandbox whose shell runs on a terminal: its checkpoints hold a tty, which CRIU recreates
/// on a new terminal. Recovery in place gives it one that the shim holds (ResizePty reaches
/// it); a container started from the exported image with a terminal of its own gets the
/// restored shell on it, and what is typed there runs in the restored shell.
#[tokio::test(flavor = "multi_thread")]
async fn a_terminal_survives_recovery_and_export() {
    let h = Harness::connect_env(crab_integration::TestEnv {
        image: crab_integration::sandbox::AGENT_IMAGE.into(),
        ..crab_integration::TestEnv::from_env()
    })
    .await
    .unwrap_or_else(|e| panic!("integration test setup failed: {e}"));
    if !h.runs_crab_only(
        "a_terminal_survives_recovery_and_export",
        "turns and checkpoints are crab's own",
    ) {
        return;
    }
    let id = h.unique_id("restore_tty");
    let _g = h.guard(&[&id]);
    let state_dir = h.env.crab_home.join("state").join(&id);
    let _io = start_on_a_terminal(&h, &id, &state_dir, None).await;
    let mut s = Sandbox {
        h: h.clone(),
        id: id.clone(),
        state_dir: state_dir.clone(),
        turn: 0,
    };
    let _images = ImageGuard::new(&h, &[], &[&id]);
    s.run("echo on-a-tty > /app/tty.txt; (sleep 4000 </dev/null >/dev/null 2>&1 &)")
        .await;
    let turn = end_turn_checkpointed(&s).await;
    assert_eq!(
        manifest_of(&s, &turn)["kind"],
        "full",
        "{:#?}",
        s.manifests()
    );

    // Recovery in place: the shell and the sleep come back, the shell on a new terminal.
    h.kill(&id, "", libc::SIGKILL, true).await.unwrap();
    h.wait(&id, "", T).await.unwrap();
    let out = crabctl_ok(&s, &["recover", &id]);
    assert!(out.starts_with("recovered"), "{out}");
    h.resize_pty(&id, "", 91, 27).await.unwrap();
    let mut again = sandbox_for(&s, &id);
    again.turn = 100;
    let seen = again.run(TTY_PROBE).await.stdout;
    assert_eq!(
        seen,
        "/dev/pts/0\n27 91\non-a-tty\nsleep alive\n",
        "after recovery:\n{}",
        h.log_excerpt(&id)
    );

    // Export, and a new container with a terminal of its own from the image.
    let reference = format!("localhost/crab-test/{id}:tty");
    let _exported = ImageGuard::new(&h, &[&reference], &[]);
    crabctl_ok(&s, &["export", &id, &reference]);
    // Unpacked into the snapshotter (a mount of the image does it; `ctr run` would too).
    let mnt = h.env.crab_home.join("tmp").join(format!("{id}-mnt"));
    std::fs::create_dir_all(&mnt).unwrap();
    let m = mnt.to_str().unwrap();
    h.ctr().run(&["images", "mount", &reference, m]).unwrap();
    h.ctr().run(&["images", "unmount", "--rm", m]).unwrap();
    let _ = std::fs::remove_dir(&mnt);
    let h2 = Harness::connect_env(crab_integration::TestEnv {
        image: reference.clone(),
        ..crab_integration::TestEnv::from_env()
    })
    .await
    .unwrap();
    let copy = format!("{id}-copy");
    let _g2 = h2.guard(&[&copy]);
    let copy_state = h.env.crab_home.join("state").join(&copy);
    let key = state_dir.join("keys/checkpoint-signing.pub");
    let io = start_on_a_terminal(&h2, &copy, &copy_state, Some(&key)).await;
    io.write_stdin(b"echo typed-at-the-terminal > /app/typed.txt\n", T)
        .unwrap();
    let mut in_copy = sandbox_for(&s, &copy);
    in_copy.turn = 200;
    let mut typed = String::new();
    for _ in 0..100 {
        typed = in_copy
            .run("cat /app/typed.txt 2>/dev/null; true")
            .await
            .stdout;
        if !typed.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        typed,
        "typed-at-the-terminal\n",
        "{}",
        h2.log_excerpt(&copy)
    );
    let seen = in_copy.run("readlink /proc/1/fd/0; cat /app/tty.txt; pgrep -x sleep >/dev/null && echo 'sleep alive'").await.stdout;
    assert_eq!(seen, "/dev/pts/0\non-a-tty\nsleep alive\n");
    h2.kill(&copy, "", libc::SIGKILL, true).await.unwrap();
    h2.wait(&copy, "", T).await.unwrap();
    h2.delete_task(&copy).await.unwrap();
    h2.delete_container(&copy).await.unwrap();
    let _ = std::fs::remove_dir_all(&copy_state);
    s.finish().await;
}

/// The sandbox's turn boundary travels with its checkpoint image (issue 26): a container
/// started from the image with no `io.crab/turn-boundary` of its own (as `docker run IMAGE`
/// or `ctr run IMAGE` start it) ends a turn at each exec as its source did, and checkpoints
/// it, instead of silently never ending one.
#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_image_keeps_its_sandboxs_turn_boundary() {
    let (mut s, _g) = Sandbox::start(
        "restore_boundary",
        SandboxOptions {
            annotations: &[("io.crab/turn-boundary", "exec")],
            ..Default::default()
        },
    )
    .await;
    let h = s.h.clone();
    s.run("echo one > /app/one").await;
    // The next exec ends that turn (and waits for its checkpoint).
    s.run("true").await;
    let image_ref = format!("localhost/crab-test/{}:boundary", s.id);
    let _images = ImageGuard::new(&h, &[&image_ref], &[]);
    crabctl_ok(&s, &["export", &s.id, &image_ref]);
    let id = format!("{}-run", s.id);
    let _guard = h.guard(&[&id]);
    let (config, state) = trusting_config(&h, &s, &id);
    let out = h
        .ctr()
        .run_with(
            &[
                "run",
                "-d",
                "--runtime",
                CRAB,
                "--runtime-config-path",
                config.to_str().unwrap(),
                &image_ref,
                &id,
                "sleep",
                "infinity",
            ],
            None,
            T,
        )
        .unwrap();
    assert!(
        out.status.success(),
        "ctr run: {out:?}\n{}",
        h.log_excerpt(&id)
    );
    assert!(
        h.log_excerpt(&id)
            .contains("keeps its checkpoint image's io.crab/turn-boundary"),
        "{}",
        h.log_excerpt(&id)
    );
    let mut r = sandbox_for(&s, &id);
    r.run("cat /app/one && echo two > /app/two").await;
    r.run("true").await;
    r.run("true").await;
    let turns: Value =
        serde_json::from_str(&crabctl_ok(&r, &["turns", &id, "-o", "json"])).unwrap();
    let kinds: Vec<&str> = turns
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["kind"].as_str().unwrap_or(""))
        .collect();
    assert!(
        kinds.first() == Some(&"fs"),
        "the restored sandbox's first exec ended a turn that wrote /app/two: {turns:#}"
    );
    let _ = h.ctr().run(&["tasks", "kill", "-s", "SIGKILL", &id]);
    drop(_guard);
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_dir_all(&state);
}
