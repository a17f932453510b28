//! Issue 24, item 6: per-process bounds did not bound a container. One filled 128 MiB memfd
//! mapped shared by 64 children that `pause()`: every turn end read and hashed the object once
//! per process that mapped it (64 × 128 MiB), and kept 64 lists of its hashes in the mark (a
//! no-change turn took 1.85 s, the shim's RSS went 15 → 93 MB). Through containerd and the crab
//! shim, here: the object is read once per turn end however many processes map it, and however
//! they split it into ranges (each child also maps its own 64 MiB window of it, at its own
//! offset); a no-change turn stays `none`, its answer counts ~128 MiB of shared memory read,
//! and the shim's memory does not grow with the sharers. With `[limits]
//! max_memory_image_bytes` below the object, and `max_fdinfo_total_bytes` below what the
//! container's fds hold, each turn is `full` naming the key, its checkpoint is taken (full),
//! the shim and container stay up, and turns are exact again once the container is back under
//! the bounds.

use std::time::{Duration, Instant};

use crab_integration::{
    host,
    sandbox::{Sandbox, SandboxOptions},
    TaskStatus,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 128 * MIB;
const SHARERS: usize = 64;

/// Fills a 128 MiB memfd (every page data, none zero), maps it shared and forks `N` children
/// that map their own 64 MiB window of it too (child i at offset i MiB) and `pause()`; the
/// parent then says so in /dev/shm (a tmpfs: no file of the sandbox) and pauses too.
const SHARERS_PY: &str = r#"
import mmap, os, signal, sys
n, size = int(sys.argv[1]), 128 << 20
fd = os.memfd_create("sharers")
os.ftruncate(fd, size)
m = mmap.mmap(fd, size, mmap.MAP_SHARED)
page = bytes(range(1, 256)) * 17
for off in range(0, size, 1 << 20):
    m[off:off + (1 << 20)] = (page * 257)[: 1 << 20]
for i in range(n):
    if os.fork() == 0:
        w = mmap.mmap(fd, 64 << 20, mmap.MAP_SHARED, offset=i << 20)
        signal.pause()
        os._exit(0)
open("/dev/shm/sharers-ready", "w").close()
signal.pause()
"#;

/// Writes 7 bytes at 5 MiB into the sharers' memfd, through a sharer's fd of it.
const WRITE_PY: &str = r#"
import os
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        fds = [os.path.join("/proc", p, "fd", fd) for fd in os.listdir("/proc/%s/fd" % p)]
        fd = next(fd for fd in fds if "memfd:sharers" in os.readlink(fd))
    except (OSError, StopIteration):
        continue
    os.pwrite(os.open(fd, os.O_WRONLY), b"changed", 5 << 20)
    raise SystemExit(0)
raise SystemExit("no sharer")
"#;

/// Waits until no python3 process is left but zombies (`sleep` as init reaps none; a zombie
/// has left the cgroup), and fails if one is.
const GONE: &str = "live() { ps -eo stat=,comm= | awk '$2 == \"python3\" && $1 !~ /^Z/'; }; \
                    for i in $(seq 100); do test -z \"$(live)\" && break; sleep 0.1; done; test -z \"$(live)\"";

/// Starts the sharers in the background of one turn and waits until they are all there.
async fn start_sharers(s: &mut Sandbox, n: usize) {
    s.run(&format!(
        "cat > /tmp/sharers.py <<'EOF'\n{SHARERS_PY}\nEOF\n\
         nohup python3 /tmp/sharers.py {n} >/dev/null 2>&1 &\n\
         for i in $(seq 600); do test -e /dev/shm/sharers-ready && break; sleep 0.1; done\n\
         test -e /dev/shm/sharers-ready && rm /tmp/sharers.py"
    ))
    .await;
}

/// The shim serving `s`: its pid and VmRSS in KiB.
fn shim_rss(s: &Sandbox) -> (i32, u64) {
    let shims = host::shim_processes(&s.id);
    assert_eq!(shims.len(), 1, "one shim for {}: {shims:?}", s.id);
    let pid = shims[0].pid;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"));
    (pid, rss)
}

/// Pages the answer says were read for the memory of the processes it compared.
fn scanned_pages(answer: &Value) -> u64 {
    answer["procs"]["memory"]
        .as_array()
        .map(|m| m.iter().filter_map(|f| f["scanned_pages"].as_u64()).sum())
        .unwrap_or(0)
}

/// A no-change turn: an exec that changes nothing, then the turn end (answer, time it took).
async fn quiet_turn(s: &mut Sandbox) -> (Value, Duration) {
    s.run("true").await;
    let t = Instant::now();
    let answer = s.end_turn().await;
    (answer, t.elapsed())
}

async fn assert_running(s: &Sandbox) {
    let (status, _) = s.h.status(&s.id, "").await.unwrap();
    assert_eq!(status, TaskStatus::Running, "{} is not running", s.id);
}

/// 64 sleeping sharers of one filled 128 MiB memfd (each mapping it whole and a window of its
/// own): no-change turns read the object once each, keep one list of its hashes, and stay
/// `none`; a write into the object by another process is still seen, in every sharer.
#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_sharers_of_one_memfd_are_read_once_per_turn() {
    let (mut s, _g) = Sandbox::start("hostile_shm", SandboxOptions::default()).await;
    start_sharers(&mut s, SHARERS).await;
    let first = s.end_turn().await;
    assert_eq!(
        first["procs"]["started"].as_array().map(Vec::len),
        Some(SHARERS + 1),
        "{first:#}"
    );
    // Their checkpoint; the freeze wakes them once, after which no-change turns are `none`.
    let mut durable = 1;
    s.wait_manifests(durable).await;
    let mut settled = false;
    for _ in 0..5 {
        let (answer, _) = quiet_turn(&mut s).await;
        if answer["kind"] == "none" {
            settled = true;
            break;
        }
        eprintln!("a turn after the checkpoint: {}", answer["kind"]);
        durable += 1;
        s.wait_manifests(durable).await;
    }
    assert!(settled, "no-change turns never came back to `none`");

    let (pid, rss_before) = shim_rss(&s);
    let mut figures = Vec::new();
    for _ in 0..3 {
        let (answer, took) = quiet_turn(&mut s).await;
        let read = &answer["procs"]["read"];
        eprintln!(
            "no-change turn with {SHARERS} sharers: {took:?} (answer in {} us), read {read}, \
             {} pages scanned, shim VmRSS {} KiB (was {rss_before})",
            answer["elapsed_us"],
            scanned_pages(&answer),
            shim_rss(&s).1
        );
        assert_eq!(answer["kind"], "none", "{answer:#}");
        assert!(
            answer["degraded"].as_array().unwrap().is_empty(),
            "{answer:#}"
        );
        // One object, read once: 128 MiB, not 65 × (128 + 64) MiB; every other mapping of
        // it (65 whole ones and 64 windows) reused what was read.
        assert_eq!(read["shared_objects"], 1, "{answer:#}");
        let shared = read["shared_bytes"].as_u64().unwrap();
        assert!(
            (OBJECT..=OBJECT + MIB).contains(&shared),
            "shared memory read: {shared} bytes"
        );
        let reused = read["shared_bytes_reused"].as_u64().unwrap();
        assert!(
            reused >= (SHARERS as u64) * (OBJECT + 64 * MIB),
            "shared memory reused: {reused} bytes"
        );
        let memory = read["memory_bytes"].as_u64().unwrap();
        assert!(memory < 2 * OBJECT, "memory read in all: {memory} bytes");
        assert!(
            scanned_pages(&answer) < 2 * OBJECT / 4096,
            "{} pages scanned",
            scanned_pages(&answer)
        );
        figures.push(took);
    }
    let (pid_after, rss_after) = shim_rss(&s);
    eprintln!(
        "shim VmRSS {rss_before} KiB before 3 no-change turns, {rss_after} KiB after; turns took {figures:?}"
    );
    assert_eq!(pid_after, pid, "the shim was replaced");
    // 65 lists of 32768 hashes would be ~32 MiB in the mark alone (64 MiB while two marks
    // live); one is 512 KiB.
    assert!(
        rss_after < rss_before + 16 * 1024,
        "the shim grew from {rss_before} to {rss_after} KiB"
    );
    assert!(
        figures.iter().all(|t| *t < Duration::from_secs(10)),
        "{figures:?}"
    );

    // Another process writes one page of the object: each of its 65 sharers changed (the
    // parent and every child map that page), so the turn is a process turn.
    s.run(&format!("python3 -c '{WRITE_PY}'")).await;
    let answer = s.end_turn().await;
    assert_eq!(answer["kind"], "proc", "{answer:#}");
    let changed: Vec<u64> = answer["procs"]["memory"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["changed_pages"].as_u64() > Some(0))
        .map(|m| m["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(changed.len(), SHARERS + 1, "{answer:#}");
    assert_eq!(answer["procs"]["read"]["shared_objects"], 1, "{answer:#}");
    assert_running(&s).await;
    s.finish().await;
}

/// Below the object, `max_memory_image_bytes` makes each turn `full` naming the key (its
/// checkpoint taken, full); below what the container's fds hold, `max_fdinfo_total_bytes`
/// does the same; back under both, turns are exact again. The shim and container stay up.
#[tokio::test(flavor = "multi_thread")]
async fn per_container_totals_make_the_turn_full_naming_the_key() {
    let opts = SandboxOptions {
        config: "limits.max_memory_image_bytes = 67108864\nlimits.max_fdinfo_total_bytes = 16384",
        ..Default::default()
    };
    let (mut s, _g) = Sandbox::start("hostile_shm_limit", opts).await;
    s.run("echo ok > small").await;
    let answer = s.end_turn().await;
    assert_eq!(answer["kind"], "fs", "{answer:#}");
    let (pid, _) = shim_rss(&s);

    // 8 sharers of 128 MiB: over 64 MiB.
    start_sharers(&mut s, 8).await;
    // The turn that started them (manifest 2), then a no-change one (manifest 3).
    for n in [2, 3] {
        let t = Instant::now();
        let answer = match n {
            2 => s.end_turn().await,
            _ => quiet_turn(&mut s).await.0,
        };
        eprintln!(
            "over max_memory_image_bytes: answered in {:?}: {}",
            t.elapsed(),
            answer["degraded"]
        );
        assert_eq!(answer["kind"], "full", "{answer:#}");
        let degraded = answer["degraded"].to_string();
        assert!(
            degraded.contains("[limits] max_memory_image_bytes") && degraded.contains("67108864"),
            "{answer:#}"
        );
        // Counted before reading: no more than the bound (and a chunk) was read.
        let read = answer["procs"]["read"]["memory_bytes"].as_u64().unwrap();
        assert!(read <= 64 * MIB + MIB, "read {read} bytes");
        let m = s.wait_manifests(n).await;
        assert_eq!(m[n - 1]["kind"], "full", "{:#}", m[n - 1]);
        assert!(
            m[n - 1]["explanation"]
                .as_str()
                .unwrap()
                .contains("max_memory_image_bytes"),
            "{:#}",
            m[n - 1]
        );
        assert_running(&s).await;
    }

    // Back under: the sharers gone, the turn is exact (processes ended) and not degraded.
    s.run(&format!(
        "pkill -f 'sharers[.]py'; {GONE}; rm -f /dev/shm/sharers-ready"
    ))
    .await;
    let answer = s.end_turn().await;
    assert!(
        answer["degraded"].as_array().unwrap().is_empty(),
        "{answer:#}"
    );
    assert_eq!(answer["kind"], "proc", "{answer:#}");
    let (answer, _) = quiet_turn(&mut s).await;
    assert_eq!(answer["kind"], "none", "{answer:#}");

    // A process holding 900 fds: their fdinfo (~40 bytes each) is over 16 KiB.
    s.run(
        "nohup python3 -c 'import os, signal\nfds = [os.open(\"/dev/null\", os.O_RDONLY) for _ in range(900)]\nopen(\"/dev/shm/fds-ready\", \"w\").close()\nsignal.pause()' >/dev/null 2>&1 &\n\
         for i in $(seq 100); do test -e /dev/shm/fds-ready && break; sleep 0.1; done; test -e /dev/shm/fds-ready",
    )
    .await;
    let answer = s.end_turn().await;
    assert_eq!(answer["kind"], "full", "{answer:#}");
    assert!(
        answer["degraded"]
            .to_string()
            .contains("[limits] max_fdinfo_total_bytes"),
        "{answer:#}"
    );
    let fdinfo = answer["procs"]["read"]["fdinfo_bytes"].as_u64().unwrap();
    assert!(fdinfo <= 16384 + 1, "read {fdinfo} bytes of fdinfo");
    assert_running(&s).await;
    s.run(&format!("pkill -f 'fds[-]ready'; {GONE}")).await;
    // The mark after the full turn was taken over the bound too: this turn may still say so
    // (nothing else), depending on whether the mark was read before the process left.
    let answer = s.end_turn().await;
    assert!(
        answer["degraded"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d.to_string().contains("[limits] max_fdinfo_total_bytes")),
        "{answer:#}"
    );
    let (answer, _) = quiet_turn(&mut s).await;
    assert_eq!(answer["kind"], "none", "{answer:#}");
    let (pid_after, rss) = shim_rss(&s);
    assert_eq!(pid_after, pid, "the shim was replaced");
    eprintln!("shim VmRSS after: {rss} KiB");
    s.finish().await;
}
