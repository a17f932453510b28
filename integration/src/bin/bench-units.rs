//! Benchmark of the shim's parts alone, below containerd: prints figures, asserts nothing
//! about them (a run that gets a wrong answer stops with an error).
//!
//! 1. fs inspector: [`TreeManifest::scan`] of an upperdir of 1 000 and 10 000 new files (100
//!    per directory, in directories the image has: every file needs a lower lookup), a bare
//!    `std` walk of the same tree as the floor, and [`diff`] when nothing changed and when
//!    every file is new; the manifest's JSON size.
//! 2. memory inspector: [`capture_with`] of a forked child holding 10 / 100 / 500 MB of
//!    distinct pages, with one thread and with the default (or `CRAB_BENCH_THREADS`), and
//!    [`compare`] of the two (equal); then an idle python3 interpreter.
//! 3. page deduplication: [`dedup`] of a 50 MB pages file of random bytes into a fresh chunk
//!    store (every chunk new) and again (every chunk known), each followed by [`materialize`].
//!
//! The end-to-end figures of the same parts (fs and process checkpoints versus size, through
//! containerd and the shim) are `bench-checkpoint`'s.
//!
//! Output: a table on stdout; `$CRAB_HOME/bench/units-<unix time>.{json,md}` and
//! `units-latest.{json,md}`. Needs no containerd.
//!
//! `cargo run --release -p crab-integration --bin bench-units [-- --reps N]` (N: samples per
//! figure, default 15 for the fs inspector, 3 for captures and dedup runs).

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crab_integration::bench::stats::{ms, Summary};
use crab_integration::bench::{parse_counts, Bench, Host};
use crab_integration::env::TestEnv;
use crab_shim::checkpoint::pages::{dedup, materialize};
use crab_shim::inspector::fs::{diff, TreeManifest};
use crab_shim::inspector::memory::{capture, capture_with, compare, page_size, CaptureOptions};
use serde_json::{json, Value};

const BENCH: Bench = Bench::new("bench-units");

fn main() {
    let mut reps = 0usize;
    parse_counts(
        BENCH.name,
        "[--reps N]   (samples per figure; default 15 for fs, 3 for memory and pages)",
        &mut [("--reps", &mut reps)],
    );
    let load_before = crab_integration::bench::loadavg();
    let started = Instant::now();
    let mut md = String::new();
    let fs_json = fs_inspector(if reps > 0 { reps } else { 15 }, &mut md);
    let mem_json = memory_inspector(if reps > 0 { reps } else { 3 }, &mut md);
    let pages_json = page_dedup(if reps > 0 { reps } else { 3 }, &mut md);
    let host = Host::now();
    let head = format!(
        "# Benchmark of the shim's parts\n\nkernel {}, {} CPUs, unix time {}, total {:.0} s, \
         loadavg before {load_before} / after {}. Milliseconds, nearest-rank percentiles (with \
         few samples p95 = max).\n",
        host.kernel,
        host.cpus,
        host.unix_time,
        started.elapsed().as_secs_f64(),
        host.loadavg
    );
    let json = json!({
        "host": host.json(),
        "loadavg_before": load_before,
        "fs_inspector": fs_json,
        "memory_inspector": mem_json,
        "page_dedup": pages_json,
    });
    BENCH.finish(
        &TestEnv::from_env().bench_dir(),
        "units",
        host.unix_time,
        &json,
        &(head + &md),
    );
}

/// `reps` timings of `f`, in milliseconds.
fn time_ms(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            ms(t.elapsed())
        })
        .collect()
}

/// The same walk as a scan with `std`, lstat only, nothing kept: the floor.
fn bare_walk(dir: &Path) -> usize {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let md = e.metadata().unwrap();
            1 + if md.is_dir() { bare_walk(&e.path()) } else { 0 }
        })
        .sum()
}

fn fs_inspector(reps: usize, md: &mut String) -> Value {
    let _ = writeln!(
        md,
        "\n## 1. fs inspector (upperdir of new files, {reps} samples)\n\n\
         | files | entries | scan p50 | bare std walk p50 | diff unchanged p50 | diff all new p50 | \
         scan+diff unchanged | scan+diff all new | manifest JSON KiB |\n|---|---|---|---|---|---|---|---|---|"
    );
    let mut out = serde_json::Map::new();
    for n in [1_000usize, 10_000] {
        BENCH.progress(format!("1/3 fs inspector: {n} files"));
        let tmp = tempfile::tempdir().unwrap_or_else(|e| BENCH.die(format!("temp dir: {e}")));
        let (lower, upper) = (tmp.path().join("lower"), tmp.path().join("upper"));
        for i in 0..n {
            let dir = format!("srv/d{:03}", i / 100);
            if i % 100 == 0 {
                fs::create_dir_all(lower.join(&dir)).unwrap();
                fs::create_dir_all(upper.join(&dir)).unwrap();
            }
            fs::write(upper.join(&dir).join(format!("file{i}.py")), "x = 1\n").unwrap();
        }
        let lowers = vec![lower];
        let empty = TreeManifest::default();
        let now = TreeManifest::scan(&upper).unwrap_or_else(|e| BENCH.die(format!("scan: {e}")));
        let scan = time_ms(reps, || {
            TreeManifest::scan(&upper).unwrap();
        });
        let floor = time_ms(reps, || {
            if bare_walk(&upper) + 1 != now.len() {
                BENCH.die("the bare walk and the scan disagree");
            }
        });
        let same = time_ms(reps, || {
            if !diff(&now, &now, &lowers).is_empty() {
                BENCH.die("an unchanged tree diffs as changed");
            }
        });
        let all = time_ms(reps, || {
            if diff(&empty, &now, &lowers).len() != n {
                BENCH.die("not every new file is in the diff");
            }
        });
        let json_kib = serde_json::to_vec(&now).unwrap().len() / 1024;
        let p50 = |v: &[f64]| Summary::of(v).p50;
        let _ = writeln!(
            md,
            "| {n} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {json_kib} |",
            now.len(),
            p50(&scan),
            p50(&floor),
            p50(&same),
            p50(&all),
            p50(&scan) + p50(&same),
            p50(&scan) + p50(&all),
        );
        out.insert(
            format!("{n}_files"),
            json!({"entries": now.len(), "scan_ms": Summary::json(&scan),
                   "bare_walk_ms": Summary::json(&floor), "diff_unchanged_ms": Summary::json(&same),
                   "diff_all_new_ms": Summary::json(&all), "manifest_json_kib": json_kib}),
        );
    }
    Value::Object(out)
}

/// A forked copy of this (single-threaded) process holding `mb` MB of distinct, non-zero pages,
/// paused until killed on drop.
struct Holder(u32);

impl Holder {
    fn spawn(mb: usize) -> Holder {
        let len = mb << 20;
        // SAFETY: a fresh anonymous mapping of `len` bytes, written only within it and unmapped
        // in the parent after the fork; the child calls only pause(2) (async-signal-safe) in a
        // loop until it is killed. This process has no other threads at this point.
        let pid = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as *mut u64;
            if p as *mut libc::c_void == libc::MAP_FAILED {
                BENCH.die(format!("mmap of {mb} MB failed"));
            }
            for i in 0..len / 8 {
                *p.add(i) = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            }
            let pid = libc::fork();
            if pid == 0 {
                loop {
                    libc::pause();
                }
            }
            libc::munmap(p as *mut libc::c_void, len);
            if pid < 0 {
                BENCH.die("fork failed");
            }
            pid as u32
        };
        std::thread::sleep(Duration::from_millis(50));
        Holder(pid)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // SAFETY: kill and waitpid of our own child; a null status pointer is allowed.
        unsafe {
            libc::kill(self.0 as i32, libc::SIGKILL);
            libc::waitpid(self.0 as i32, std::ptr::null_mut(), 0);
        }
    }
}

/// An idle python3 interpreter (blocked reading stdin), killed on drop.
struct Python(Child);

impl Python {
    fn spawn() -> Python {
        let mut c = Command::new("python3")
            .args([
                "-c",
                "import sys; print('ready', flush=True); sys.stdin.readline()",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| BENCH.die(format!("python3: {e}")));
        let mut line = String::new();
        BufReader::new(c.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        if line != "ready\n" {
            BENCH.die(format!("python3 said {line:?}"));
        }
        wait_blocked_in_read(c.id());
        Python(c)
    }
}

/// Waits until `pid` sleeps in read(2), so that its memory holds still for the captures.
fn wait_blocked_in_read(pid: u32) {
    let want = format!("{} ", libc::SYS_read);
    for _ in 0..5000 {
        let syscall = fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the command name's closing parenthesis.
        let state = stat.rsplit_once(") ").map(|(_, rest)| &rest[..1]);
        if syscall.starts_with(&want) && state == Some("S") {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    BENCH.die(format!("process {pid} did not block in read(2)"));
}

impl Drop for Python {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn memory_inspector(reps: usize, md: &mut String) -> Value {
    let threads: usize = std::env::var("CRAB_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let _ = writeln!(
        md,
        "\n## 2. memory inspector (best of {reps} captures; {} threads = {})\n\n\
         | resident | capture 1 thread | capture {} threads | compare | pages read |\n|---|---|---|---|---|",
        if threads == 0 { "default" } else { "CRAB_BENCH_THREADS" },
        if threads == 0 { cpus } else { threads },
        if threads == 0 { cpus } else { threads },
    );
    let mut out = serde_json::Map::new();
    for mb in [10usize, 100, 500] {
        BENCH.progress(format!("2/3 memory inspector: {mb} MB"));
        let holder = Holder::spawn(mb);
        let best = |threads: usize| {
            (0..reps)
                .map(|_| {
                    capture_with(
                        holder.0,
                        &CaptureOptions {
                            threads,
                            ..Default::default()
                        },
                    )
                    .unwrap_or_else(|e| BENCH.die(format!("capture: {e}")))
                })
                .min_by_key(|i| i.stats.elapsed)
                .unwrap()
        };
        let one = best(1);
        let many = best(threads);
        let t = Instant::now();
        let d = compare(&one, &many);
        let cmp = ms(t.elapsed());
        if !d.is_empty() {
            BENCH.die(format!("two captures of a paused process differ: {d}"));
        }
        let _ = writeln!(
            md,
            "| {mb} MB | {:.1} | {:.1} | {cmp:.2} | {} |",
            ms(one.stats.elapsed),
            ms(many.stats.elapsed),
            many.stats.pages_read
        );
        out.insert(
            format!("{mb}MB"),
            json!({"capture_1_thread_ms": ms(one.stats.elapsed),
                   "capture_threads_ms": ms(many.stats.elapsed), "compare_ms": cmp,
                   "pages_read": many.stats.pages_read}),
        );
    }
    BENCH.progress("2/3 memory inspector: idle python3");
    let py = Python::spawn();
    let imgs: Vec<_> = (0..reps.max(2))
        .map(|_| capture(py.0.id()).unwrap_or_else(|e| BENCH.die(format!("capture: {e}"))))
        .collect();
    let best = imgs.iter().map(|i| i.stats.elapsed).min().unwrap();
    let t = Instant::now();
    let d = compare(&imgs[0], &imgs[1]);
    let cmp = ms(t.elapsed());
    if !d.is_empty() {
        BENCH.die(format!("two captures of an idle python3 differ: {d}"));
    }
    let read_mb = (imgs[0].stats.pages_read * page_size()) >> 20;
    let _ = writeln!(
        md,
        "| idle python3 ({read_mb} MB read, {} regions) | | {:.1} | {cmp:.2} | {} |",
        imgs[0].regions.len(),
        ms(best),
        imgs[0].stats.pages_read
    );
    out.insert(
        "idle_python3".into(),
        json!({"capture_ms": ms(best), "compare_ms": cmp, "pages_read": imgs[0].stats.pages_read,
               "regions": imgs[0].regions.len()}),
    );
    Value::Object(out)
}

fn page_dedup(reps: usize, md: &mut String) -> Value {
    BENCH.progress("3/3 page deduplication: 50 MB");
    let mut data = vec![0u8; 50 << 20];
    let mut x = 88_172_645_463_325_252u64;
    for w in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    let mut runs: Vec<(&str, Vec<f64>, Vec<f64>, u64)> = Vec::new();
    for run in 0..reps {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| BENCH.die(format!("temp dir: {e}")));
        let chunks = tmp.path().join("chunks");
        for (i, kind) in ["cold", "warm"].into_iter().enumerate() {
            let img = tmp.path().join(kind);
            fs::create_dir_all(&img).unwrap();
            fs::write(img.join("pages-1.img"), &data).unwrap();
            let t = Instant::now();
            let s = dedup(&img, &chunks).unwrap_or_else(|e| BENCH.die(format!("dedup: {e}")));
            let d = ms(t.elapsed());
            let t = Instant::now();
            materialize(&img, &chunks).unwrap_or_else(|e| BENCH.die(format!("materialize: {e}")));
            let m = ms(t.elapsed());
            if fs::read(img.join("pages-1.img")).unwrap() != data {
                BENCH.die("materialized pages differ from the original");
            }
            if run == 0 {
                runs.push((kind, Vec::new(), Vec::new(), s.chunks_new));
            }
            runs[i].1.push(d);
            runs[i].2.push(m);
        }
    }
    let _ = writeln!(
        md,
        "\n## 3. page deduplication (50 MB of random pages, {reps} runs)\n\n\
         | store | new chunks | dedup p50 | materialize p50 |\n|---|---|---|---|"
    );
    let mut out = serde_json::Map::new();
    for (kind, d, m, new) in &runs {
        let _ = writeln!(
            md,
            "| {kind} | {new} | {:.1} | {:.1} |",
            Summary::of(d).p50,
            Summary::of(m).p50
        );
        out.insert(
            kind.to_string(),
            json!({"chunks_new": new, "dedup_ms": Summary::json(d), "materialize_ms": Summary::json(m)}),
        );
    }
    Value::Object(out)
}
