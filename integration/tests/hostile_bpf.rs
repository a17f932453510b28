//! A sandbox that starts many processes against the inspector's eBPF programs, through
//! containerd and the crab shim: what its processes make the host-wide programs hold is bounded
//! per container (`[limits] max_bpf_processes`), so past its quota only its own turns are
//! DEGRADED, naming the key, while a neighbour with more processes than that quota keeps
//! exact, undegraded answers (its idle processes still known idle from their run counts).
//!
//! Run counts used to live in one host-wide hash of 65,536 pids: a container of that many
//! sleeping processes made every neighbour's turns `full`. They are task storage now (no shared
//! table); the quota is what remains to bound, and it is scaled down here (64) so that the test
//! needs a few hundred processes, not tens of thousands (this host's `pid_max` is 32768).

use crab_integration::sandbox::{Sandbox, SandboxOptions};
use serde_json::Value;

const QUOTA: usize = 64;

/// Starts `n` sleeping processes left behind by the exec (children of the container's init
/// once the shell exits), and waits until each has gone to sleep at least once.
fn sleepers(n: usize) -> String {
    format!(
        "for i in $(seq {n}); do sleep 1000 </dev/null >/dev/null 2>&1 & done; sleep 1; \
         test $(pgrep -c -x sleep) -ge {n}"
    )
}

fn degraded(answer: &Value) -> Vec<String> {
    answer["degraded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect()
}

/// The neighbour's turn must be of `kind` and fully observed.
async fn neighbour_turn(b: &mut Sandbox, script: &str, kind: &str) -> Value {
    b.run(script).await;
    let a = b.end_turn().await;
    assert_eq!(a["kind"], kind, "neighbour turn `{script}`: {a:#}");
    assert!(
        degraded(&a).is_empty(),
        "neighbour turn `{script}` is DEGRADED: {a:#}"
    );
    a
}

/// A filler over its quota (200 processes, quota 64) beside a neighbour with 100 processes
/// (more than the filler's quota, far below its own default): the filler's turn is `full`,
/// DEGRADED naming `[limits] max_bpf_processes (64)`; the neighbour's turns before, during and
/// after are exact (`fs` for a write, `none` for a read with its 100 sleepers reported idle)
/// and never degraded, and its checkpoints are not failed.
#[tokio::test(flavor = "multi_thread")]
async fn a_container_over_its_process_quota_degrades_only_itself() {
    let config = format!("limits.max_bpf_processes = {QUOTA}");
    let (mut filler, _gf) = Sandbox::start(
        "hostile_bpf_filler",
        SandboxOptions {
            config: &config,
            ..SandboxOptions::default()
        },
    )
    .await;
    let (mut b, _gb) = Sandbox::start("hostile_bpf_nb", SandboxOptions::default()).await;

    // The neighbour first gets more processes than the filler's quota.
    let a = neighbour_turn(&mut b, &sleepers(100), "proc").await;
    assert!(
        a["procs"]["started"].as_array().unwrap().len() >= 100,
        "{a:#}"
    );
    neighbour_turn(&mut b, "echo 1 > /app/n1", "fs").await;

    // The filler goes over its quota.
    filler.run(&sleepers(200)).await;
    let f = filler.end_turn().await;
    eprintln!(
        "filler's turn: kind {}, degraded {:?}",
        f["kind"],
        degraded(&f)
    );
    assert_eq!(f["kind"], "full", "{f:#}");
    assert!(
        degraded(&f)
            .iter()
            .any(|d| d.contains(&format!("[limits] max_bpf_processes ({QUOTA})"))),
        "{f:#}"
    );

    // The neighbour, meanwhile and after: exact and observed, its sleepers idle by their run
    // counts (none of them compared).
    neighbour_turn(&mut b, "echo 2 > /app/n2", "fs").await;
    let a = neighbour_turn(&mut b, "cat /app/n1 /app/n2 >/dev/null", "none").await;
    let idle = a["procs"]["idle"].as_array().unwrap().len();
    assert!(idle >= 100, "the neighbour's sleepers are not idle: {a:#}");
    // More processes in the filler change nothing for the neighbour.
    filler.run(&sleepers(300)).await;
    filler.end_turn().await;
    let a = neighbour_turn(&mut b, "true", "none").await;
    assert!(a["procs"]["idle"].as_array().unwrap().len() >= 100, "{a:#}");

    let m = b.wait_manifests(3).await;
    for c in &m {
        assert_ne!(c["kind"], "failed", "a neighbour checkpoint failed: {c:#}");
    }
    b.finish().await;
    filler.finish().await;
}
