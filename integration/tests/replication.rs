//! Sandboxes that survive their node: with `[replication]`, every durable checkpoint is pushed
//! to a registry (Debian's `docker-registry` on 127.0.0.1) in the background, and a container
//! of the lineage created on another node with `io.crab/resume: newest` comes back from it.
//! Two private containerds stand for two nodes (separate state, separate crab stores); node A
//! is destroyed (its container's processes, its shim and its containerd SIGKILLed, its crab
//! store deleted) before node B resumes. On the way: the registry killed and restarted while
//! turns go on (turns stay durable, replication catches up), and tampered checkpoints in the
//! registry refused with the reason.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crab_integration::{
    ctr::Ctr,
    node::Node,
    registry::Registry,
    sandbox::{Sandbox, SandboxOptions, KV_SCRIPTS},
    TestEnv,
};

const PROJECT: &str = "mkdir -p /app/proj && echo v1 > /app/proj/a.txt && cd /app/proj && git init -q && git -c user.email=a@b -c user.name=a add a.txt && git -c user.email=a@b -c user.name=a commit -qm one";

const STATE: &str =
    "cat /app/proj/a.txt; git -C /app/proj log --format=%s; python3 /app/cli.py 'x'";

/// The agent image's archive as `make images` built it (imported into each node).
fn agent_tar() -> PathBuf {
    let images = TestEnv::from_env().crab_home.join("images");
    let mut tars: Vec<PathBuf> = std::fs::read_dir(&images)
        .unwrap_or_else(|e| panic!("{}: {e} (make images builds it)", images.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("agent-") && n.ends_with(".tar"))
        })
        .collect();
    tars.sort();
    tars.pop().expect("the agent image's archive (make images)")
}

fn node(name: &str) -> Node {
    let home = TestEnv::from_env()
        .crab_home
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(home.join("state"));
    let n = Node::start(&home);
    Ctr::new(&n.env)
        .run(&["images", "import", agent_tar().to_str().unwrap()])
        .unwrap()
        .ok()
        .unwrap();
    n
}

fn config(state: &Path, registry: &str, trusted: Option<&Path>) -> String {
    let mut c = format!(
        "replication.registry = \"{registry}/crab/checkpoints\"\nreplication.insecure = true\n\
         replication.retry_max_ms = 1000\n"
    );
    if let Some(t) = trusted {
        c.push_str(&format!("restore.trusted_keys = [\"{}\"]\n", t.display()));
    }
    let _ = state;
    c
}

fn status(store: &Path) -> serde_json::Value {
    std::fs::read(store.join("replication.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// Waits until the replicator of `s` pushed its newest durable checkpoint.
async fn replicated(s: &Sandbox, within: Duration) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let newest = s
            .lineage()
            .into_iter()
            .filter(|m| m["kind"] != "failed")
            .map(|m| m["seq"].as_u64().unwrap())
            .max();
        let st = status(&s.store());
        if newest.is_some() && st["pushed_seq"].as_u64() == newest {
            return st;
        }
        assert!(
            start.elapsed() < within,
            "not replicated after {within:?}: newest {newest:?}, status {st:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn turn(s: &mut Sandbox, script: &str) -> Duration {
    s.run(script).await;
    let t = Instant::now();
    s.end_turn().await;
    s.sync().await;
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_comes_back_on_another_node_after_its_node_is_lost() {
    let mut registry = Registry::start();
    let node_a = node("node-a");
    let node_b = node("node-b");
    let state_a = node_a.env.crab_home.join("state");
    let state_b = node_b.env.crab_home.join("state");
    let lineage = format!("test/replicated-{}", std::process::id());
    let annotations = [
        ("io.crab/lineage", lineage.as_str()),
        ("io.crab/resume", "newest"),
    ];
    let config_a = config(&state_a, &registry.addr, None);
    let (mut a, guard_a) = Sandbox::start(
        "repl-a",
        SandboxOptions {
            annotations: &annotations,
            state_dir: Some(state_a.clone()),
            config: &config_a,
            env: Some(&node_a.env),
            ..SandboxOptions::default()
        },
    )
    .await;
    a.run(KV_SCRIPTS).await;
    turn(&mut a, PROJECT).await;
    turn(
        &mut a,
        "(nohup python3 /app/kv.py >/dev/null 2>&1 &) ; python3 /app/cli.py 'x = 41'",
    )
    .await;
    let first = replicated(&a, Duration::from_secs(30)).await;
    eprintln!(
        "replicated, registry up: lags {} ms, {} bytes sent, {} skipped",
        first["lags_ms"], first["bytes_sent"], first["bytes_skipped"]
    );
    assert!(first["bytes_sent"].as_u64().unwrap() > 0, "{first:#}");
    // The recovery point's age: from the turn end (before the checkpoint was durable) to the
    // push.
    let (turn_lag, lag) = (
        first["turn_lag_ms"]
            .as_f64()
            .expect("the turn end is known"),
        first["lag_ms"].as_f64().unwrap(),
    );
    assert!(
        turn_lag + 5.0 >= lag && turn_lag < 30_000.0,
        "turn end to pushed {turn_lag} ms, durable to pushed {lag} ms"
    );

    // The registry is killed in the middle of a push (96 MiB of fresh memory to send: its
    // push takes a while), then stays down: turns go on, durable on the node, not slowed by
    // it.
    turn(
        &mut a,
        "python3 /app/cli.py 'import os; big = os.urandom(96 << 20)'",
    )
    .await;
    let big = a.lineage().last().unwrap()["seq"].as_u64().unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    registry.kill();
    // Building and sending 96 MiB takes far longer than 150 ms: the push of `big` was cut
    // short (it is recorded as failed once the replicator notices).
    let start = Instant::now();
    let cut = loop {
        let st = status(&a.store());
        if st["newest_seq"].as_u64() >= Some(big) || start.elapsed() > Duration::from_secs(20) {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("registry killed 150 ms after checkpoint {big} was durable: {cut:#}");
    assert!(
        cut["pushed_seq"].as_u64() < Some(big) && cut["last_error"].is_string(),
        "the push of checkpoint {big} was cut short: {cut:#}"
    );
    let mut down = Vec::new();
    for i in 0..3 {
        down.push(
            turn(
                &mut a,
                &format!(
                    "python3 /app/cli.py 'x += 1' >/dev/null && echo d{i} >> /app/proj/a.txt && \
                     git -C /app/proj -c user.email=a@b -c user.name=a commit -qam d{i}"
                ),
            )
            .await,
        );
    }
    eprintln!("turn end to durable with the registry down: {down:?}");
    let newest = a.lineage().last().unwrap()["seq"].as_u64().unwrap();
    let st = status(&a.store());
    assert!(
        st["pushed_seq"].as_u64() < Some(newest) && st["last_error"].is_string(),
        "the pushes failed while it was down: {st:#}"
    );
    // Back: replication catches up, dropping the superseded checkpoints.
    let registry = registry.restart();
    let caught_up = replicated(&a, Duration::from_secs(60)).await;
    assert!(caught_up["last_error"].is_null(), "{caught_up:#}");
    // The cut push and the turns while down: all but the newest were superseded.
    let superseded = caught_up["superseded"].as_u64().unwrap();
    assert!((1..=3).contains(&superseded), "{caught_up:#}");
    eprintln!(
        "caught up after the restart: lags {} ms, {} pushes, {} failed attempts, {} superseded, \
         {} bytes sent, {} skipped",
        caught_up["lags_ms"],
        caught_up["pushes"],
        caught_up["failures"],
        caught_up["superseded"],
        caught_up["bytes_sent"],
        caught_up["bytes_skipped"]
    );
    assert!(
        caught_up["bytes_skipped"].as_u64().unwrap() > 0,
        "blobs already there are not sent again: {caught_up:#}"
    );
    // A turn that changes a few of the server's pages (it holds 96 MiB) sends the segments
    // holding them, not its whole pages file again.
    let pages = a
        .lineage()
        .last()
        .and_then(|m| m["process"]["bytes_logical"].as_u64())
        .unwrap_or(0);
    let before = caught_up["bytes_sent"].as_u64().unwrap();
    turn(&mut a, "python3 /app/cli.py 'y = 1'").await;
    let after = replicated(&a, Duration::from_secs(30)).await;
    let sent = after["bytes_sent"].as_u64().unwrap() - before;
    let kind = a.lineage().last().unwrap()["kind"].clone();
    eprintln!(
        "a turn changing a few pages ({kind}): {sent} bytes sent of a process image of \
         {pages} bytes"
    );
    assert!(
        pages > 96 << 20,
        "the server's image holds its 96 MiB: {pages}"
    );
    assert!(
        sent < 16 << 20,
        "{sent} bytes sent for a few changed pages of a {pages}-byte image: {after:#}"
    );
    // What operators see.
    let (code, out, err) = a.crabctl(&["replication", &lineage, "-o", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let store = &rows[0]["stores"][0];
    assert_eq!(
        store["replication"]["pushed_seq"], store["newest_seq"],
        "{rows:#}"
    );
    assert!(
        store["replication"]["failures"].as_u64().unwrap() > 0,
        "{rows:#}"
    );
    let (code, out, err) = a.crabctl(&["replication"]);
    assert!(code == 0 && out.contains(&lineage), "{out}{err}");
    let metrics_config = node_a.env.crab_home.join("metrics.toml");
    std::fs::write(
        &metrics_config,
        format!("[store]\nstate_dir = \"{}\"\n", state_a.display()),
    )
    .unwrap();
    let (code, out, err) = a.crabctl(&["--config", metrics_config.to_str().unwrap(), "metrics"]);
    assert_eq!(code, 0, "{out}{err}");
    let pushed = out
        .lines()
        .find_map(|l| l.strip_prefix("crab_replication_pushes_total{outcome=\"ok\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(pushed.is_some_and(|n| n >= 3.0), "{out}");
    assert!(out.contains("crab_replication_lag_seconds_count"), "{out}");
    let want = a.run(STATE).await.stdout;
    assert!(want.contains("44") && want.contains("d2"), "{want}");
    // Node A's key, which node B trusts (a cluster would share it through a Secret).
    let key_a = node_b.env.crab_home.join("node-a.pub");
    std::fs::copy(state_a.join("keys/checkpoint-signing.pub"), &key_a).unwrap();

    // Node A is lost: its container's processes, shims and containerd killed, its store gone.
    a.h.kill(&a.id, "", libc::SIGKILL, true).await.unwrap();
    let a_id = a.id.clone();
    drop(a);
    drop(guard_a);
    for pattern in [
        format!("containerd-shim-crab-v1 .*-id {a_id}"),
        format!("containerd .*{}", node_a.env.crab_home.display()),
    ] {
        let _ = std::process::Command::new("pkill")
            .args(["-KILL", "-f", &pattern])
            .status();
    }
    std::fs::remove_dir_all(&state_a).unwrap();

    // Node B: the same lineage resumes from the registry.
    let untrusting = config(&state_b, &registry.addr, None);
    let refused = Sandbox::try_start(
        "repl-untrusted",
        SandboxOptions {
            annotations: &annotations,
            state_dir: Some(state_b.clone()),
            config: &untrusting,
            env: Some(&node_b.env),
            ..SandboxOptions::default()
        },
    )
    .await;
    let e = refused
        .err()
        .expect("a checkpoint signed by an untrusted key was resumed");
    assert!(e.contains("cannot resume") && e.contains("trusted"), "{e}");
    let config_b = config(&state_b, &registry.addr, Some(&key_a));
    let (mut b, guard_b) = Sandbox::start(
        "repl-b",
        SandboxOptions {
            annotations: &annotations,
            state_dir: Some(state_b.clone()),
            config: &config_b,
            env: Some(&node_b.env),
            ..SandboxOptions::default()
        },
    )
    .await;
    assert_eq!(b.run(STATE).await.stdout, want, "as of node A's last turn");
    // It goes on, and replicates from node B.
    turn(&mut b, "echo b >> /app/proj/a.txt").await;
    replicated(&b, Duration::from_secs(30)).await;

    // Tampering: a blob of the newest checkpoint altered in the registry's storage.
    let blobs = registry.data_dir().join("docker/registry/v2/blobs/sha256");
    let mut altered = 0;
    for entry in walk(&blobs) {
        if entry.file_name().is_some_and(|n| n == "data") {
            let data = std::fs::read(&entry).unwrap();
            if data.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
                let mut bad = data.clone();
                let mid = bad.len() / 2;
                bad[mid] ^= 0xff;
                std::fs::write(&entry, bad).unwrap();
                altered += 1;
            }
        }
    }
    assert!(altered > 0, "no layer blob in {}", blobs.display());
    let node_c_state = node_b.env.crab_home.join("state-c");
    let config_c = config(&node_c_state, &registry.addr, Some(&key_a));
    let refused = Sandbox::try_start(
        "repl-tampered",
        SandboxOptions {
            annotations: &annotations,
            state_dir: Some(node_c_state.clone()),
            config: &config_c,
            env: Some(&node_b.env),
            ..SandboxOptions::default()
        },
    )
    .await;
    let e = refused.err().expect("a tampered checkpoint was resumed");
    assert!(e.contains("cannot resume"), "{e}");
    b.finish().await;
    drop(guard_b);
    let _ = std::fs::remove_dir_all(&node_c_state);
    let homes = [node_a.env.crab_home.clone(), node_b.env.crab_home.clone()];
    drop(node_b);
    drop(node_a);
    for home in homes {
        let _ = std::fs::remove_dir_all(home);
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// A checkpoint taken right before its container is removed (a pod drained or deleted) still
/// leaves the node: the shim's Shutdown waits (bounded) for its replicator's last push.
#[tokio::test(flavor = "multi_thread")]
async fn the_last_checkpoint_is_pushed_before_the_shim_ends() {
    let registry = Registry::start();
    let lineage = format!("test/drained-{}", std::process::id());
    let annotations = [("io.crab/lineage", lineage.as_str())];
    let config = config(Path::new("/unused"), &registry.addr, None);
    let (mut s, guard) = Sandbox::start(
        "repl-drain",
        SandboxOptions {
            annotations: &annotations,
            config: &config,
            ..SandboxOptions::default()
        },
    )
    .await;
    s.run(KV_SCRIPTS).await;
    turn(
        &mut s,
        "(nohup python3 /app/kv.py >/dev/null 2>&1 &) ; python3 /app/cli.py 'x = 1'",
    )
    .await;
    replicated(&s, Duration::from_secs(30)).await;
    // 32 MiB of fresh memory: its push takes longer than the removal (without the wait the
    // shim was gone 53 ms after it), and well under the wait's bound on a busy host.
    turn(
        &mut s,
        "python3 /app/cli.py 'import os; big = os.urandom(32 << 20)'",
    )
    .await;
    let newest = s.lineage().last().unwrap()["seq"].as_u64().unwrap();
    let store = s.store();
    let removing = Instant::now();
    s.h.kill_and_remove(&s.id).await.unwrap();
    let removed = removing.elapsed();
    let shim = format!("containerd-shim-crab-v1 .*-id {}", s.id);
    let gone = loop {
        let alive = std::process::Command::new("pgrep")
            .args(["-f", &shim])
            .output()
            .unwrap()
            .status
            .success();
        if !alive {
            break removing.elapsed();
        }
        assert!(
            removing.elapsed() < Duration::from_secs(60),
            "the shim did not end"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let st = status(&store);
    eprintln!(
        "removed in {removed:?}, shim gone after {gone:?}: pushed {} of {newest}",
        st["pushed_seq"]
    );
    assert_eq!(
        st["pushed_seq"].as_u64(),
        Some(newest),
        "the checkpoint taken before the removal was pushed: {st:#}"
    );
    let _ = std::fs::remove_dir_all(&s.state_dir);
    drop(guard);
}
