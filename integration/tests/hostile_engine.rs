//! Issue 16 (items 4 and 5) through containerd and the crab shim: what one sandbox, or any
//! process of the host, can do to the checkpoints of the others and of the next container with
//! its id.
//!
//! - The engine's directory is root's alone (`0700`, files `0600`), also when it existed wider.
//! - A slot locked by a process that is no crab job holds a checkpoint job only until
//!   `[engine] wait_timeout_ms`: the turn is recorded `failed` naming the lock, the container
//!   runs on, and the next turn takes a full checkpoint once the slot is free.
//! - A job past `[engine] job_timeout_ms` is aborted: `runc checkpoint` and CRIU killed, the
//!   container thawed, the turn recorded `failed`, the container's processes alive. An fs
//!   capture (a blocking copy of the turn's files) stops at the deadline too: its temporary
//!   files go and the store stops growing at once, and the next turn is checkpointed.
//! - A sandbox writing a huge layer every turn and another writing small ones share one slot:
//!   the small one's checkpoints are durable within a bound (the huge one's jobs are aborted at
//!   their deadline and queue behind it).
//! - A container created with the id of a removed one (same image or another) starts its own
//!   lineage: the old checkpoints are neither listed nor restorable; a rollback of the new
//!   container keeps its lineage; `crabctl prune` removes the store set aside.
//!
//! Every test has its own engine root under `$CRAB_HOME/engine` (never the host's).

use std::{
    collections::BTreeSet,
    fs,
    os::unix::{fs::PermissionsExt, io::AsRawFd, process::CommandExt},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crab_integration::{
    engine::Engine,
    env::BUSYBOX_IMAGE,
    sandbox::{Sandbox, SandboxOptions},
    CleanupGuard, ProcessSpec, StdioOptions,
};
const T: Duration = Duration::from_secs(60);

async fn start(name: &str, e: &Engine) -> (Sandbox, CleanupGuard) {
    Sandbox::start(
        name,
        SandboxOptions {
            config: &e.toml,
            ..Default::default()
        },
    )
    .await
}

/// Every directory and file under `root` with its mode.
fn modes(root: &Path) -> Vec<(String, bool, u32)> {
    let mut out = vec![(
        root.display().to_string(),
        true,
        fs::metadata(root).unwrap().permissions().mode() & 0o7777,
    )];
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let md = fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                dirs.push(p.clone());
            }
            out.push((
                p.display().to_string(),
                md.is_dir(),
                md.permissions().mode() & 0o7777,
            ));
        }
    }
    out
}

/// Runs `argv` as user and group nobody: (success, stderr).
fn as_nobody(argv: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(argv[0])
        .args(&argv[1..])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_engine_directory_is_roots_alone() {
    let e = Engine::new("private", "engine.max_jobs = 1\n");
    // As an older crab left it: world-readable.
    fs::create_dir_all(&e.root).unwrap();
    fs::set_permissions(&e.root, fs::Permissions::from_mode(0o755)).unwrap();
    let (mut s, _g) = start("hostile_private", &e).await;
    s.run("echo x > /app/x").await;
    s.end_turn().await;
    assert_eq!(s.wait_manifests(1).await[0]["kind"], "fs");
    s.sync().await;
    let found = modes(&e.root);
    for name in ["slots/0", "stats.json", "usage.json", "state.lock"] {
        assert!(
            found
                .iter()
                .any(|(p, _, _)| p.ends_with(&format!("/{name}"))),
            "no {name}: {found:?}"
        );
    }
    for (path, is_dir, mode) in &found {
        let want = if *is_dir { 0o700 } else { 0o600 };
        assert_eq!(*mode, want, "{path} is {mode:o}: {found:?}");
    }
    // Nobody else can read the stats, list the queue or lock a slot.
    let slot = e.root.join("slots/0");
    for argv in [
        vec!["cat", e.root.join("stats.json").to_str().unwrap()],
        vec!["ls", e.root.join("queue").to_str().unwrap()],
        vec!["flock", "-n", slot.to_str().unwrap(), "true"],
    ] {
        let (ok, err) = as_nobody(&argv);
        assert!(!ok, "{argv:?} succeeded as nobody");
        assert!(err.contains("Permission denied"), "{argv:?}: {err}");
    }
    eprintln!(
        "engine root {}: {} entries, all 0700/0600",
        e.root.display(),
        found.len()
    );
    s.finish().await;
    e.remove();
}

/// The slot is locked by a process that is no crab job (here: this test): the checkpoint job
/// gives up after `wait_timeout_ms` and the turn is recorded `failed`, naming the lock; the
/// container runs on; once the lock is gone the next turn takes a full checkpoint.
#[tokio::test(flavor = "multi_thread")]
async fn a_foreign_slot_lock_fails_the_job_at_the_wait_deadline() {
    let e = Engine::new(
        "foreign",
        "engine.max_jobs = 1\nengine.wait_timeout_ms = 2000\n",
    );
    fs::create_dir_all(e.root.join("slots")).unwrap();
    let slot = fs::File::create(e.root.join("slots/0")).unwrap();
    // SAFETY: flock on a file we own.
    assert_eq!(unsafe { libc::flock(slot.as_raw_fd(), libc::LOCK_EX) }, 0);
    let (mut s, _g) = start("hostile_foreign", &e).await;
    s.run("echo one > /app/one").await;
    let ended = Instant::now();
    s.end_turn().await;
    // The next action waits for the job, which fails at the deadline.
    s.sync().await;
    let waited = ended.elapsed();
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "failed", "{m:#?}");
    let why = m[0]["explanation"].as_str().unwrap();
    assert!(
        why.contains("wait_timeout_ms")
            && why.contains("slot 0 is locked by a process that is not a crab job"),
        "{why}"
    );
    assert!(
        (Duration::from_millis(1900)..Duration::from_secs(15)).contains(&waited),
        "the job failed after {waited:?}"
    );
    // The container runs on, its turn's file in place; the queue is empty.
    assert_eq!(s.run("cat /app/one").await.stdout, "one\n");
    let (_, snap) = e.crabctl(&s, true);
    assert!(snap["queue"].as_array().unwrap().is_empty(), "{snap:#}");
    eprintln!("a job blocked by a foreign lock failed after {waited:?}: {why}");

    drop(slot);
    s.run("echo two > /app/two").await;
    s.end_turn().await;
    let m = s.wait_manifests(2).await;
    assert_eq!(m[1]["kind"], "full", "after a failure: {m:#?}");
    s.finish().await;
    e.remove();
}

/// The process dump of a process holding 400 MB takes longer than the job deadline (CRIU's
/// own run is ~300 ms on an idle 2-CPU host, 224 ms at 300 MB, which outran a 300 ms deadline
/// once the dump lost its fixed costs): CRIU is killed, the container thawed, the turn
/// recorded `failed`; the process lives on and the container answers execs.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_past_its_deadline_is_aborted_and_the_container_runs_on() {
    let e = Engine::new("deadline", "engine.job_timeout_ms = 150\n");
    let (mut s, _g) = start("hostile_deadline", &e).await;
    s.run(
        "nohup python3 -c 'import os, time
b = bytearray(os.urandom(400_000_000))
open(\"/app/ready\", \"w\").close()
time.sleep(100000)' >/dev/null 2>&1 </dev/null & echo $! > /app/pid
         while [ ! -e /app/ready ]; do sleep 0.1; done",
    )
    .await;
    let ended = Instant::now();
    s.end_turn().await;
    s.sync().await;
    let took = ended.elapsed();
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "failed", "{m:#?}");
    let why = m[0]["explanation"].as_str().unwrap();
    assert!(
        why.contains("job_timeout_ms") && why.contains("killed the process dump: CRIU"),
        "{why}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    // The process is alive and not stopped or traced; the container is not frozen (the exec
    // itself would hang).
    let state = s
        .run("grep -E '^(State|TracerPid)' /proc/$(cat /app/pid)/status")
        .await
        .stdout;
    assert!(
        state.contains("State:\tS") && state.contains("TracerPid:\t0"),
        "{state}"
    );
    // Nothing of the dump is left: no runc checkpoint of the container, no process image (only
    // CRIU's work directory with its log, a `.tmp` the store sweeps).
    let id = s.id.clone();
    let left: Vec<String> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| fs::read(p.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(" checkpoint ") && c.trim_end().ends_with(&id))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let images: Vec<_> = fs::read_dir(s.store().join("proc"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".work.tmp"))
        .collect();
    assert!(images.is_empty(), "{images:?}");
    eprintln!("aborted after {took:?}: {why}");
    s.finish().await;
    e.remove();
}

/// What the store's `blobs/` held at one moment: bytes of every file in it (temporary files
/// included), and whether a temporary file was there.
fn blobs_now(store: &Path) -> (u64, bool) {
    let (mut bytes, mut tmp) = (0, false);
    let mut dirs = vec![store.join("blobs")];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                dirs.push(e.path());
                continue;
            }
            // Disk use, not the length: what the capture really wrote.
            bytes += std::os::unix::fs::MetadataExt::blocks(&md) * 512;
            tmp |= e.file_name().to_string_lossy().ends_with(".tmp");
        }
    }
    (bytes, tmp)
}

/// A turn writes 3 GiB of data (random blocks, neither zeros nor holes): its fs capture (a
/// copy into a temporary tar in the store, then compression) takes longer than the 1.5 s job
/// deadline. At the deadline the capture stops: the turn is recorded `failed` naming the
/// deadline and the stopped capture; the temporary tar lives no longer than the deadline and a
/// margin, and the store does not grow after the failure (sampled every 10 ms); the container
/// runs on with its file; the next turn's checkpoint (full, after a failure) is taken.
#[tokio::test(flavor = "multi_thread")]
async fn an_fs_capture_past_its_deadline_stops_writing() {
    // Room for the next turn's full checkpoint (~400 ms on an idle 2-CPU host).
    const DEADLINE: Duration = Duration::from_millis(1500);
    const GIB: u64 = 3;
    let e = Engine::new(
        "capture_deadline",
        &format!(
            "engine.job_timeout_ms = {}
",
            DEADLINE.as_millis()
        ),
    );
    let (mut s, _g) = start("hostile_capture_deadline", &e).await;
    s.run(&format!(
        "python3 -c 'import os
blocks = [os.urandom(1 << 20) for _ in range(64)]
with open(\"/app/big.bin\", \"wb\") as f:
    for i in range({GIB} << 10):
        f.write(blocks[i % 64])'"
    ))
    .await;
    // The store's blobs, sampled every 10 ms from before the turn end on.
    let store = s.store();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let (bytes, tmp) = blobs_now(&store);
                samples.push((Instant::now(), bytes, tmp));
                std::thread::sleep(Duration::from_millis(10));
            }
            samples
        })
    };
    let ended = Instant::now();
    s.end_turn().await;
    let m = s.wait_manifests(1).await;
    let failed_at = Instant::now();
    assert_eq!(m[0]["kind"], "failed", "{m:#?}");
    let why = m[0]["explanation"].as_str().unwrap().to_string();
    assert!(
        why.contains("job_timeout_ms") && why.contains("the fs capture was stopped after writing"),
        "{why}"
    );
    // Watch the store for a second after the failure is recorded.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.join().unwrap();
    let with_tmp: Vec<Instant> = samples.iter().filter(|s| s.2).map(|s| s.0).collect();
    let (first_tmp, last_tmp) = (
        *with_tmp.first().expect("the capture never began"),
        *with_tmp.last().unwrap(),
    );
    let tmp_lived = last_tmp.duration_since(first_tmp);
    let peak = samples.iter().map(|s| s.1).max().unwrap();
    let after: Vec<(u64, bool)> = samples
        .iter()
        .filter(|s| s.0 >= failed_at)
        .map(|s| (s.1, s.2))
        .collect();
    let written: u64 = why
        .split("stopped after writing ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {why}"));
    eprintln!(
        "{GIB} GiB turn: failed {:?} after the turn end; temporary tar seen for {tmp_lived:?} \
         (deadline {DEADLINE:?}), {written} bytes written into it, peak store blobs {} MiB, \
         after the failure {} samples at {:?} MiB: {why}",
        failed_at.duration_since(ended),
        peak >> 20,
        after.len(),
        after.iter().map(|a| a.0 >> 20).collect::<BTreeSet<_>>(),
    );
    // Stopped while it copied or compressed, with something written: not before it began.
    assert!(written > 0, "{why}");
    assert!(
        tmp_lived < DEADLINE + Duration::from_millis(500),
        "the capture wrote for {tmp_lived:?}"
    );
    assert!(
        after.len() >= 50,
        "{} samples after the failure",
        after.len()
    );
    assert!(
        after
            .iter()
            .all(|&(bytes, tmp)| !tmp && bytes == after[0].0),
        "the store changed after the failure: {after:?}"
    );
    assert!(
        after[0].0 < 1 << 20,
        "nothing of the layer is left: {} bytes of blobs",
        after[0].0
    );

    // The container runs on (not frozen) with its file.
    assert_eq!(
        s.run("stat -c %s /app/big.bin").await.stdout.trim(),
        (GIB << 30).to_string()
    );
    // The next turn's checkpoint is taken (full, after the failure).
    s.run("rm /app/big.bin && echo after > /app/after").await;
    s.end_turn().await;
    let m = s.wait_manifests(2).await;
    assert_eq!(m[1]["kind"], "full", "{:#}", m[1]);
    eprintln!(
        "the next turn: a full checkpoint in {} ms",
        m[1]["timings"]["total_ms"]
    );
    let l = s.layer(m[1]["fs_layers"].as_array().unwrap().last().unwrap());
    assert_eq!(
        l.get("app/after").map(|(_, d)| d.as_slice()),
        Some(&b"after\n"[..])
    );
    s.finish().await;
    e.remove();
}

/// One slot, two sandboxes: one writes a 1 GB file every turn, the other a small one. The
/// huge jobs are aborted at the deadline (1.5 s) and the small sandbox's checkpoints are
/// durable within the deadline, the abort grace and a margin after each turn end.
#[tokio::test(flavor = "multi_thread")]
async fn huge_layers_of_one_sandbox_do_not_hold_up_anothers_checkpoints() {
    const DEADLINE: Duration = Duration::from_millis(1500);
    const BOUND: Duration = Duration::from_millis(1500 + 1000 + 3000);
    let e = Engine::new(
        "fair",
        &format!(
            // The huge sandbox's turns come faster than its jobs.
            "engine.max_jobs = 1\nengine.job_timeout_ms = {}\ncheckpoint.action_wait_timeout_ms = 120000\n",
            DEADLINE.as_millis()
        ),
    );
    let ((mut huge, _gh), (mut small, _gs)) =
        tokio::join!(start("hostile_huge", &e), start("hostile_small", &e));
    let huge_id = huge.id.clone();
    let huge_turns = async {
        for _ in 0..4 {
            huge.run("rm -f /app/h*.bin; head -c 1000000000 /dev/urandom > /app/h$RANDOM.bin")
                .await;
            huge.end_turn().await;
        }
        huge.sync().await;
    };
    let small_turns = async {
        // Once the huge sandbox's first job holds the slot.
        let deadline = Instant::now() + T;
        loop {
            let (_, snap) = e.crabctl(&small, true);
            if snap["slots"][0]["holder"]["sandbox"] == huge_id.as_str() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the huge job never started: {snap:#}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut latencies = Vec::new();
        for i in 0..6 {
            small.run(&format!("echo {i} > /app/s{i}")).await;
            let t = Instant::now();
            small.end_turn().await;
            small.sync().await;
            latencies.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        latencies
    };
    let ((), latencies) = tokio::join!(huge_turns, small_turns);
    let small_m = small.wait_manifests(6).await;
    assert!(
        small_m.iter().all(|m| m["kind"] == "fs"),
        "every small checkpoint is durable: {small_m:#?}"
    );
    let huge_m = huge.manifests();
    let aborted = huge_m
        .iter()
        .filter(|m| {
            m["kind"] == "failed"
                && m["explanation"]
                    .as_str()
                    .is_some_and(|x| x.contains("job_timeout_ms"))
        })
        .count();
    assert!(
        aborted >= 1,
        "the huge jobs ran into their deadline: {huge_m:#?}"
    );
    let (_, snap) = e.crabctl(&small, true);
    let waits: Vec<u64> = snap["stats"]["recent"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["sandbox"] == small.id.as_str())
        .map(|r| r["wait_us"].as_u64().unwrap() / 1000)
        .collect();
    let huge_runs: Vec<u64> = snap["stats"]["recent"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["sandbox"] == huge.id.as_str())
        .map(|r| r["run_us"].as_u64().unwrap() / 1000)
        .collect();
    let max = latencies.iter().max().unwrap();
    eprintln!(
        "small sandbox: turn end to durable {:?} (max {max:?}, bound {BOUND:?}); its engine waits {waits:?} ms; \
         huge sandbox: {} checkpoints, {aborted} aborted at the deadline, slot held {huge_runs:?} ms",
        latencies,
        huge_m.len()
    );
    assert!(
        *max <= BOUND,
        "a small checkpoint took {max:?} (> {BOUND:?}): {latencies:?}"
    );
    // An aborted capture stops at its deadline: no temporary file of the huge sandbox is left.
    let blobs = huge.store().join("blobs");
    let deadline = Instant::now() + Duration::from_secs(10);
    while fs::read_dir(&blobs)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
    {
        assert!(Instant::now() < deadline, "the aborted capture never ended");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    huge.finish().await;
    small.finish().await;
    e.remove();
}

/// Runs `sh -c script` in a sandbox of an image without bash or /app (a turn, like
/// [`Sandbox::run`]); returns its stdout.
async fn sh(s: &mut Sandbox, script: &str) -> String {
    s.turn += 1;
    let exec_id = format!("sh-{}", s.turn);
    let mut io = s.h.stdio(&s.id, &exec_id, StdioOptions::default()).unwrap();
    s.h.exec(
        &s.id,
        &exec_id,
        &ProcessSpec::new(&["sh", "-c", script]),
        &io,
    )
    .await
    .unwrap();
    s.h.start(&s.id, &exec_id).await.unwrap();
    let status = s.h.wait(&s.id, &exec_id, T).await.unwrap();
    let out = io.stdout_string(T).unwrap();
    let err = io.stderr_string(T).unwrap();
    s.h.delete_process(&s.id, &exec_id).await.unwrap();
    assert_eq!(status, 0, "`{script}`: {out}{err}");
    out
}

fn crabctl_ok(s: &Sandbox, args: &[&str]) -> String {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(code, 0, "crabctl {args:?}: {out}{err}");
    out
}

/// The turn column of `crabctl checkpoints`.
fn listed_turns(out: &str) -> Vec<String> {
    out.lines()
        // The lineage line, then the header.
        .skip_while(|l| l.starts_with("lineage "))
        .skip(1)
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            // SEQ PARENT TURN KIND ...: an origin has an empty turn.
            match cols.len() {
                n if n >= 9 => cols[2].to_string(),
                _ => String::new(),
            }
        })
        .collect()
}

/// The stores set aside next to `store`.
fn set_aside(store: &Path) -> Vec<std::path::PathBuf> {
    let name = store.file_name().unwrap().to_str().unwrap();
    fs::read_dir(store.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&format!(".replaced-{name}-")))
        })
        .map(|e| e.path())
        .collect()
}

/// Create `c`, an fs turn t1 writes /app/v; remove `c`; create `c` again (from `image`), a
/// turn t2: only t2 is `c`'s, t1 cannot be rolled back to, a rollback to t2 keeps the new
/// lineage, and prune removes the old store.
async fn recreated_with_the_same_id(name: &str, image: Option<&str>) {
    let e = Engine::new(name, "");
    let (mut old, _g1) = start(name, &e).await;
    old.run("echo old > /app/v").await;
    old.end_turn().await;
    assert_eq!(old.wait_manifests(1).await[0]["turn_id"], "t1");
    old.sync().await;
    old.h.kill_and_remove(&old.id).await.unwrap();

    let (mut s, _g2) = Sandbox::start(
        name,
        SandboxOptions {
            config: &e.toml,
            image,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(s.id, old.id, "the same id");
    s.turn = 1;
    let (write, has_v, has_w) = match image {
        None => (
            "echo new > /app/w",
            "test -e /app/v && echo yes || echo no",
            "cat /app/w",
        ),
        Some(_) => (
            "echo new > /w",
            "test -e /app/v && echo yes || echo no",
            "cat /w",
        ),
    };
    sh(&mut s, write).await;
    s.end_turn().await;
    let m = s.wait_manifests(1).await;
    assert_eq!(
        (m.len(), m[0]["turn_id"].as_str()),
        (1, Some("t2")),
        "{m:#?}"
    );
    let lineage = s.lineage();
    assert_eq!(
        (lineage[0]["seq"].as_u64(), lineage[0]["kind"].as_str()),
        (Some(1), Some("created")),
        "{lineage:#?}"
    );
    let out = crabctl_ok(&s, &["checkpoints", &s.id]);
    assert_eq!(listed_turns(&out), ["", "t2"], "{out}");
    let (code, out, err) = s.crabctl(&["rollback", &s.id, "--to", "t1"]);
    assert_ne!(
        code, 0,
        "rolled back to the removed container's turn: {out}{err}"
    );
    assert!(err.contains("t1"), "{err}");
    assert_eq!(sh(&mut s, has_v).await, "no\n", "the old container's file");
    let aside = set_aside(&s.store());
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(aside[0].join("checkpoints/000002.json").is_file());

    // A rollback of the new container keeps its lineage.
    crabctl_ok(&s, &["rollback", &s.id, "--to", "t2"]);
    assert_eq!(sh(&mut s, has_w).await, "new\n");
    let out = crabctl_ok(&s, &["checkpoints", &s.id]);
    let turns = listed_turns(&out);
    assert_eq!(&turns[..2], ["", "t2"], "{out}");
    assert!(out.contains("restored"), "{out}");
    assert_eq!(set_aside(&s.store()), aside, "set aside again: {out}");

    // Prune removes the store set aside and keeps the container's.
    let config = s.state_dir.with_extension("prune.toml");
    fs::write(
        &config,
        format!("[store]\nstate_dir = \"{}\"\n", s.state_dir.display()),
    )
    .unwrap();
    let out = crabctl_ok(&s, &["--config", config.to_str().unwrap(), "prune"]);
    assert!(set_aside(&s.store()).is_empty(), "{out}");
    assert!(s.store().join("checkpoints/000001.json").is_file(), "{out}");
    let _ = fs::remove_file(&config);
    let h = s.h.clone();
    let id = s.id.clone();
    s.finish().await;
    for image in h.internal_images(&id) {
        let _ = h.ctr().run(&["images", "rm", &image]);
    }
    let _ = fs::remove_dir_all(&old.state_dir);
    e.remove();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_container_with_a_removed_ones_id_starts_its_own_lineage() {
    recreated_with_the_same_id("hostile_reuse", None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_container_of_another_image_with_a_removed_ones_id_starts_its_own_lineage() {
    recreated_with_the_same_id("hostile_reuse_busybox", Some(BUSYBOX_IMAGE)).await;
}
