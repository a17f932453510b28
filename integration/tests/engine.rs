//! The host engine through containerd and the crab shim: checkpoint jobs of separate shims
//! (one per sandbox) share one bounded scheduler, run one at a time with `max_jobs = 1`, and a
//! job whose sandbox's next action waits for it overtakes a queued one. Each test has its own
//! engine root, so tests running at the same time (and other shims of the host) don't mix.

use std::time::{Duration, Instant};

use crab_integration::{
    engine::Engine,
    sandbox::{Sandbox, SandboxOptions},
};
use serde_json::Value;

fn ms(r: &Value, key: &str) -> u64 {
    r[key].as_u64().unwrap_or_else(|| panic!("{key} in {r:#}"))
}

async fn start(name: &str, e: &Engine) -> (Sandbox, crab_integration::CleanupGuard) {
    Sandbox::start(
        name,
        SandboxOptions {
            config: &e.toml,
            ..Default::default()
        },
    )
    .await
}

/// Two sandboxes end turns with big file changes at the same moment: with `max_jobs = 1`
/// their checkpoint jobs run one after the other (the stats show it), and both complete.
#[tokio::test(flavor = "multi_thread")]
async fn jobs_of_two_sandboxes_run_one_at_a_time() {
    let e = Engine::new("one-at-a-time", "engine.max_jobs = 1\n");
    let ((mut a, _ga), (mut b, _gb)) = tokio::join!(start("engine_a", &e), start("engine_b", &e));
    let big = "head -c 40000000 /dev/urandom > /app/big.bin";
    tokio::join!(a.run(big), b.run(big));
    tokio::join!(a.end_turn(), b.end_turn());
    let (ma, mb) = tokio::join!(a.wait_manifests(1), b.wait_manifests(1));
    for m in [&ma[0], &mb[0]] {
        assert_eq!(m["kind"], "fs", "{m:#}");
        assert!(
            m["fs_layers"][0]["size"].as_u64().unwrap() > 39_000_000,
            "{m:#}"
        );
    }
    // A job's stats are recorded when its slot is released, after its manifest is published
    // (without an I/O budget nothing waits for them): seen soon after, not at once (on a busy
    // host the second one was not there yet).
    let snap = crab_integration::host::eventually(Duration::from_secs(10), || {
        let (_, snap) = e.crabctl(&a, true);
        (snap["stats"]["jobs"] == 2).then_some(snap)
    })
    .unwrap_or_else(|| e.crabctl(&a, true).1);
    let stats = &snap["stats"];
    assert_eq!(stats["jobs"], 2, "{snap:#}");
    let (ra, rb) = (Engine::record(stats, &a.id), Engine::record(stats, &b.id));
    let (first, second) = if ms(ra, "started_unix_ms") <= ms(rb, "started_unix_ms") {
        (ra, rb)
    } else {
        (rb, ra)
    };
    assert!(
        ms(second, "started_unix_ms") >= ms(first, "ended_unix_ms"),
        "the jobs overlapped: {first:#} {second:#}"
    );
    // The second job was queued while the first ran (the turn ends were at the same moment).
    assert!(
        ms(second, "wait_us") * 2 >= ms(first, "run_us"),
        "the second job did not wait for the first: {first:#} {second:#}"
    );
    assert!(
        ms(first, "bytes") > 39_000_000 && ms(second, "bytes") > 39_000_000,
        "{stats:#}"
    );
    assert_eq!(stats["bytes"], ms(first, "bytes") + ms(second, "bytes"));
    let (text, _) = e.crabctl(&a, false);
    assert!(
        text.contains("max_jobs 1")
            && text.contains("queue: 0 waiting")
            && text.contains("stats: 2 jobs"),
        "{text}"
    );
    eprintln!("{text}");
    eprintln!(
        "first job ran {} ms; the second waited {} ms, ran {} ms",
        ms(first, "run_us") / 1000,
        ms(second, "wait_us") / 1000,
        ms(second, "run_us") / 1000
    );
    a.finish().await;
    b.finish().await;
    e.remove();
}

/// With one slot and an I/O budget that a big checkpoint overdrew, B's and then C's job wait
/// in the queue; C's next exec waits for C's checkpoint, so C's job goes before B's.
#[tokio::test(flavor = "multi_thread")]
async fn an_urgent_job_overtakes_a_queued_one() {
    let e = Engine::new(
        "urgent",
        "engine.max_jobs = 1\nengine.io_budget_mb_s = 10\n",
    );
    let ((mut a, _ga), (mut b, _gb), (mut c, _gc)) = tokio::join!(
        start("engine_ua", &e),
        start("engine_ub", &e),
        start("engine_uc", &e)
    );
    // 40 MB against a bucket of 10 MB at 10 MB/s: about 3 s before the next job is admitted.
    a.run("head -c 40000000 /dev/urandom > /app/big.bin").await;
    a.end_turn().await;
    a.wait_manifests(1).await;
    let overdrawn = Instant::now();
    b.run("echo b > /app/b.txt").await;
    b.end_turn().await;
    c.run("echo c > /app/c.txt").await;
    c.end_turn().await;
    let queued = wait_queue(&e, &a, 2).await;
    let order: Vec<(&str, bool)> = queued
        .iter()
        .map(|q| {
            (
                q["info"]["sandbox"].as_str().unwrap(),
                q["urgent"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        order,
        [(b.id.as_str(), false), (c.id.as_str(), false)],
        "FIFO while nobody waits"
    );
    let (text, _) = e.crabctl(&a, false);
    assert!(
        text.contains("queue: 2 waiting") && text.contains("I/O budget 10.0 MB/s"),
        "{text}"
    );
    eprintln!("{text}");
    assert!(
        overdrawn.elapsed() < Duration::from_secs(2),
        "too slow to test the order: {:?}",
        overdrawn.elapsed()
    );

    // C's next action waits for C's checkpoint: C goes first.
    let t = Instant::now();
    c.sync().await;
    let c_waited = t.elapsed();
    let mb = b.wait_manifests(1).await;
    assert_eq!(mb[0]["kind"], "fs");
    assert_eq!(c.manifests()[0]["kind"], "fs");
    // Stats come with the slot's release, after the manifest (see above).
    let snap = crab_integration::host::eventually(Duration::from_secs(10), || {
        let (_, snap) = e.crabctl(&a, true);
        (snap["stats"]["jobs"] == 3).then_some(snap)
    })
    .unwrap_or_else(|| e.crabctl(&a, true).1);
    let stats = &snap["stats"];
    assert_eq!(
        (stats["jobs"].as_u64(), stats["urgent_jobs"].as_u64()),
        (Some(3), Some(1)),
        "{stats:#}"
    );
    let (rb, rc) = (Engine::record(stats, &b.id), Engine::record(stats, &c.id));
    assert!(
        ms(rc, "enqueued_unix_ms") >= ms(rb, "enqueued_unix_ms"),
        "{rb:#} {rc:#}"
    );
    assert!(
        ms(rc, "started_unix_ms") <= ms(rb, "started_unix_ms"),
        "C did not overtake B: {rb:#} {rc:#}"
    );
    assert_eq!(
        (rc["urgent"].as_bool(), rb["urgent"].as_bool()),
        (Some(true), Some(false))
    );
    let order: Vec<&str> = stats["recent"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["sandbox"].as_str().unwrap())
        .collect();
    assert_eq!(order, [a.id.as_str(), c.id.as_str(), b.id.as_str()]);
    eprintln!(
        "C's exec waited {c_waited:?} for its checkpoint (C queued {} ms, B {} ms)",
        ms(rc, "wait_us") / 1000,
        ms(rb, "wait_us") / 1000
    );
    a.finish().await;
    b.finish().await;
    c.finish().await;
    e.remove();
}

/// Waits until `n` jobs are queued; returns the queue.
async fn wait_queue(e: &Engine, s: &Sandbox, n: usize) -> Vec<Value> {
    for _ in 0..100 {
        let (_, snap) = e.crabctl(s, true);
        let queue = snap["queue"].as_array().unwrap().clone();
        if queue.len() >= n {
            return queue;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{n} queued jobs expected: {:#}", e.crabctl(s, true).1);
}
