//! Turn-end checkpoints through containerd and the crab shim: the kind each turn gets, the
//! layer holding exactly the turn's net change, process images, and the next action waiting
//! for the checkpoint (so it cannot change what is being captured).

use std::path::{Path, PathBuf};

use crab_integration::{
    env::TestEnv,
    sandbox::{Sandbox, SandboxOptions, AGENT_IMAGE},
    Harness, ProcessSpec,
};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread")]
async fn fs_turns_store_exactly_the_net_change() {
    let (mut s, _g) = Sandbox::start("ckpt_fs", SandboxOptions::default()).await;

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
    let (mut s, _g) = Sandbox::start("ckpt_gate", SandboxOptions::default()).await;
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
    let (mut s, _g) = Sandbox::start("ckpt_proc", SandboxOptions::default()).await;
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
    let (mut s, _g) = Sandbox::start("ckpt_exec", SandboxOptions { annotations: &[("io.crab/turn-boundary", "exec")], ..Default::default() }).await;
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
    let (mut s, _g) = Sandbox::start("ckpt_enospc", SandboxOptions { state_dir: Some(tiny.clone()), ..Default::default() }).await;
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
