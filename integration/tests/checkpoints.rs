//! Turn-end checkpoints through containerd and the crab shim: the kind each turn gets, the
//! layer holding exactly the turn's net change, process images, and the next action waiting
//! for the checkpoint (so it cannot change what is being captured).

use std::{
    collections::{BTreeMap, HashMap},
    io::Read,
    path::{Path, PathBuf},
    time::Duration,
};

use crab_integration::{api::crab_runtime_options, env::TestEnv, Harness, ProcessSpec, StdioOptions};
use serde_json::Value;

const AGENT_IMAGE: &str = "localhost/crab/agent:latest";
const T: Duration = Duration::from_secs(60);

struct Sandbox {
    h: Harness,
    id: String,
    state_dir: PathBuf,
    turn: u64,
}

impl Sandbox {
    async fn start(name: &str) -> (Sandbox, crab_integration::CleanupGuard) {
        Self::start_annotated(name, &[]).await
    }

    async fn start_annotated(name: &str, annotations: &[(&str, &str)]) -> (Sandbox, crab_integration::CleanupGuard) {
        Self::start_in(name, annotations, None).await
    }

    /// With `state_dir`, the store lives there (e.g. a tiny filesystem).
    async fn start_in(name: &str, annotations: &[(&str, &str)], state_dir: Option<PathBuf>) -> (Sandbox, crab_integration::CleanupGuard) {
        let env = TestEnv { image: AGENT_IMAGE.into(), ..TestEnv::from_env() };
        assert_eq!(env.runtime, "io.containerd.crab.v1", "checkpoints are crab's own: run with CRAB_RUNTIME unset");
        let h = Harness::connect_env(env).await.unwrap_or_else(|e| panic!("integration test setup failed: {e}"));
        let id = h.unique_id(name);
        let guard = h.guard(&[&id]);
        let state_dir = state_dir.unwrap_or_else(|| h.env.crab_home.join("state").join(&id));
        let config = format!("[store]\nstate_dir = \"{}\"\n", state_dir.display());
        let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
        let mut spec = crab_integration::spec::container_spec(&id, &h.env.namespace, process);
        for (k, v) in annotations {
            spec["annotations"][*k] = Value::String(v.to_string());
        }
        h.create_container_with_spec_and_options(&id, &spec, Some(crab_runtime_options(None, Some(&config))))
            .await
            .unwrap();
        h.create_task(&id, None).await.unwrap();
        h.start(&id, "").await.unwrap();
        (Sandbox { h, id, state_dir, turn: 0 }, guard)
    }

    async fn run(&mut self, script: &str) {
        self.turn += 1;
        let exec_id = format!("turn-{}", self.turn);
        let mut io = self.h.stdio(&self.id, &exec_id, StdioOptions::default()).unwrap();
        self.h.exec(&self.id, &exec_id, &ProcessSpec::new(&["bash", "-c", script]).cwd("/app"), &io).await.unwrap();
        self.h.start(&self.id, &exec_id).await.unwrap();
        let status = self.h.wait(&self.id, &exec_id, T).await.unwrap();
        let out = io.stdout_string(T).unwrap() + &io.stderr_string(T).unwrap();
        self.h.delete_process(&self.id, &exec_id).await.unwrap();
        assert_eq!(status, 0, "`{script}`: {out}");
    }

    async fn end_turn(&self) {
        let annotations = HashMap::from([("io.crab/turn-end".to_string(), format!("t{}", self.turn))]);
        self.h.update(&self.id, None, annotations).await.unwrap();
    }

    fn store(&self) -> PathBuf {
        self.state_dir.join(&self.h.env.namespace).join(&self.id)
    }

    /// The published manifests, oldest first.
    fn manifests(&self) -> Vec<Value> {
        let dir = self.store().join("checkpoints");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        files.retain(|p| p.extension().is_some_and(|x| x == "json") && !p.file_name().unwrap().to_string_lossy().starts_with('.'));
        files.sort();
        files.iter().map(|f| serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap()).collect()
    }

    /// Waits until `n` manifests are published (checkpoints run in the background).
    async fn wait_manifests(&self, n: usize) -> Vec<Value> {
        for _ in 0..600 {
            let m = self.manifests();
            if m.len() >= n {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} manifests expected, have {:#?}", n, self.manifests());
    }

    /// The entries of a layer blob: path -> (kind, content for files).
    fn layer(&self, desc: &Value) -> BTreeMap<String, (String, Vec<u8>)> {
        let digest = desc["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap();
        let blob = std::fs::read(self.store().join("blobs/sha256").join(digest)).unwrap();
        let tar = zstd::decode_all(&blob[..]).unwrap();
        let mut out = BTreeMap::new();
        for e in tar::Archive::new(&tar[..]).entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().to_string_lossy().trim_end_matches('/').to_string();
            let kind = format!("{:?}", e.header().entry_type());
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            out.insert(path, (kind, data));
        }
        out
    }

    async fn finish(self) {
        self.h.kill_and_remove(&self.id).await.unwrap();
        self.h.assert_no_leaks(&self.id).await;
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fs_turns_store_exactly_the_net_change() {
    let (mut s, _g) = Sandbox::start("ckpt_fs").await;

    // A read-only turn stores nothing.
    s.run("cat /etc/os-release >/dev/null").await;
    s.end_turn().await;
    // An edit turn: one layer with the file, a whiteout for the removed image file, no temp file.
    s.run("echo hello > /app/a.txt; chmod 640 /app/a.txt; rm /etc/debian_version; echo t > /tmp/tmp; rm /tmp/tmp").await;
    s.end_turn().await;
    let m = s.wait_manifests(1).await;
    assert_eq!(m.len(), 1, "the read-only turn stored a checkpoint: {m:#?}");
    assert_eq!(m[0]["kind"], "fs", "{:#}", m[0]);
    assert_eq!(m[0]["turn_id"], "t2");
    let layers = m[0]["fs_layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    let l = s.layer(&layers[0]);
    assert_eq!(l.get("app/a.txt").map(|(_, d)| d.as_slice()), Some(&b"hello\n"[..]), "{:?}", l.keys().collect::<Vec<_>>());
    assert!(l.contains_key("etc/.wh.debian_version"), "{:?}", l.keys().collect::<Vec<_>>());
    assert!(!l.keys().any(|k| k.contains("tmp/tmp")), "{:?}", l.keys().collect::<Vec<_>>());
    assert!(m[0]["timings"]["freeze_ms"].as_f64().unwrap() > 0.0, "{:#}", m[0]);

    // crabctl lists the lineage.
    let config = s.state_dir.with_extension("toml");
    std::fs::write(&config, format!("[store]\nstate_dir = \"{}\"\n", s.state_dir.display())).unwrap();
    let out = std::process::Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl"))
        .args(["--namespace", &s.h.env.namespace, "--config"])
        .arg(&config)
        .args(["checkpoints", &s.id])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{listing}{}", String::from_utf8_lossy(&out.stderr));
    assert!(listing.lines().any(|l| l.contains(" t2 ") && l.contains(" fs ")), "{listing}");
    let _ = std::fs::remove_file(&config);

    // The next turn's layer is relative to the previous one: only its own change.
    s.run("echo more >> /app/a.txt").await;
    s.end_turn().await;
    let m = s.wait_manifests(2).await;
    let layers = m[1]["fs_layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "the chain grows: {:#}", m[1]);
    assert_eq!(m[1]["parent"], m[0]["seq"]);
    let l = s.layer(&layers[1]);
    assert_eq!(l.get("app/a.txt").map(|(_, d)| d.as_slice()), Some(&b"hello\nmore\n"[..]));
    assert!(!l.contains_key("etc/.wh.debian_version"), "only this turn's change: {:?}", l.keys().collect::<Vec<_>>());
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_next_action_waits_for_the_checkpoint() {
    let (mut s, _g) = Sandbox::start("ckpt_gate").await;
    s.run("head -c 20000000 /dev/urandom > /app/big.bin; echo v1 > /app/state.txt").await;
    s.end_turn().await;
    // The very next action rewrites the file: it must not start before the layer holds v1.
    s.run("echo v2 > /app/state.txt").await;
    let m = s.wait_manifests(1).await;
    let l = s.layer(&m[0]["fs_layers"][0]);
    assert_eq!(l.get("app/state.txt").map(|(_, d)| d.as_slice()), Some(&b"v1\n"[..]), "the layer saw the next turn's write");
    assert_eq!(l.get("app/big.bin").map(|(_, d)| d.len()), Some(20_000_000));
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn process_turns_store_a_process_image() {
    let (mut s, _g) = Sandbox::start("ckpt_proc").await;
    s.run("nohup sleep 3000 >/dev/null 2>&1 & sleep 0.2").await;
    s.end_turn().await;
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "proc", "{:#}", m[0]);
    let p = &m[0]["process"];
    let image = s.store().join(p["image"].as_str().unwrap());
    assert!(Path::new(&image).join("pstree.img").exists() || std::fs::read_dir(&image).unwrap().count() > 0, "{}", image.display());
    assert_eq!(p["pids"].as_array().unwrap().len(), 2, "init and the sleep: {p:#}");
    // An fs-only turn keeps the process image (C_i = (P_j, F_k)).
    s.run("echo x > /app/x").await;
    s.end_turn().await;
    let m = s.wait_manifests(2).await;
    assert_eq!(m[1]["kind"], "fs");
    assert_eq!(m[1]["process"], m[0]["process"], "{:#}", m[1]);
    // A listening TCP server (needs CRIU 4.2+ on Linux 6.16+) is dumped too.
    s.run("nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1").await;
    s.end_turn().await;
    let m = s.wait_manifests(3).await;
    assert_eq!(m[2]["kind"], "proc", "{:#}", m[2]);
    assert_eq!(m[2]["process"]["pids"].as_array().unwrap().len(), 3, "{:#}", m[2]);
    s.finish().await;
}

/// Zero-integration mode: each exec that finishes while no other runs ends a turn.
#[tokio::test(flavor = "multi_thread")]
async fn exec_boundaries_end_turns_without_a_harness() {
    let (mut s, _g) = Sandbox::start_annotated("ckpt_exec", &[("io.crab/turn-boundary", "exec")]).await;
    s.run("echo one > /app/one").await;
    s.run("cat /app/one").await;
    s.run("echo two > /app/two").await;
    let m = s.wait_manifests(2).await;
    assert_eq!(m.len(), 2, "the read-only exec stored a checkpoint: {m:#?}");
    assert_eq!(m[0]["turn_id"], "exec-turn-1");
    assert_eq!(m[1]["turn_id"], "exec-turn-3");
    let l = s.layer(&m[1]["fs_layers"][1]);
    assert!(l.contains_key("app/two") && !l.contains_key("app/one"), "{:?}", l.keys().collect::<Vec<_>>());
    s.finish().await;
}

/// A bad turn-boundary annotation fails the container's creation clearly.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_turn_boundary_annotation_fails_create() {
    let env = TestEnv { image: AGENT_IMAGE.into(), ..TestEnv::from_env() };
    let h = Harness::connect_env(env).await.unwrap();
    let id = h.unique_id("ckpt_badboundary");
    let _g = h.guard(&[&id]);
    let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
    let mut spec = crab_integration::spec::container_spec(&id, &h.env.namespace, process);
    spec["annotations"]["io.crab/turn-boundary"] = Value::String("sometimes".into());
    h.create_container_with_spec(&id, &spec).await.unwrap();
    let err = h.create_task(&id, None).await.expect_err("create with a bad annotation");
    assert!(err.to_string().contains("io.crab/turn-boundary"), "{err}");
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

/// A store on a filesystem that fills up: the checkpoint fails clearly, the container keeps
/// running, the failure is in the lineage when it fits, and the next turn takes a full one.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_store_fails_the_checkpoint_not_the_container() {
    let tiny = TestEnv::from_env().crab_home.join(format!("tiny-store-{}", std::process::id()));
    std::fs::create_dir_all(&tiny).unwrap();
    let mount = |opts: &str| {
        let st = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", opts, "tmpfs"]).arg(&tiny).status().unwrap();
        assert!(st.success(), "mount tmpfs {opts}");
    };
    mount("size=512k");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _unmount = Unmount(tiny.clone());
    let (mut s, _g) = Sandbox::start_in("ckpt_enospc", &[], Some(tiny.clone())).await;
    s.run("head -c 3000000 /dev/urandom > /app/big.bin").await;
    s.end_turn().await;
    // The job fails in the background; the container must keep working meanwhile and after.
    s.run("echo alive > /app/alive").await;
    let failed = s.manifests();
    assert!(failed.iter().all(|m| m["kind"] == "failed"), "nothing but a failure fits: {failed:#?}");
    // Room again: the next turn takes everything (a full checkpoint with a new fs chain).
    let st = std::process::Command::new("mount").args(["-o", "remount,size=64m"]).arg(&tiny).status().unwrap();
    assert!(st.success());
    s.run("echo next > /app/next").await;
    s.end_turn().await;
    let m = s.wait_manifests(failed.len() + 1).await;
    let last = m.last().unwrap();
    assert_eq!(last["kind"], "full", "{last:#}");
    let layers = last["fs_layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "a new chain: {last:#}");
    let l = s.layer(&layers[0]);
    for f in ["app/big.bin", "app/alive", "app/next"] {
        assert!(l.contains_key(f), "{f} missing from the full layer: {:?}", l.keys().collect::<Vec<_>>());
    }
    s.finish().await;
}
