//! Soak benchmark: many sandboxes at once under crab, then a storm of
//! checkpoints, then everything removed and the host checked for leftovers.
//!
//! 1. Host limits: what could bound the number of sandboxes (open files of this process and of
//!    containerd, whose limits the shims inherit; pid_max and threads-max; memory; the kernel's
//!    file table, namespaces, keys and inotify instances; locked memory), printed before
//!    anything starts; this process's RLIMIT_NOFILE is raised to its hard limit. After the start
//!    the same figures again, per sandbox, with the N each limit allows.
//! 2. Start: N agent sandboxes (`sleep infinity` in `localhost/crab/agent:latest`),
//!    `--parallel` creates in flight, each with a crab store dir of its own and every one in the
//!    soak's private host engine (`$CRAB_HOME/engine/soak-<pid>`, [`Engine`]). Then the shims
//!    idle: their memory (PSS, smaps_rollup) and CPU (utime+stime from /proc/PID/stat) over
//!    `--idle-seconds`.
//! 3. Storm: one turn in each sandbox (an exec that writes a file and leaves a background
//!    `sleep`, so that crab answers `full`: a process checkpoint through CRIU), all run first;
//!    then their turn ends (`Tasks.Update` with `io.crab/turn-end`) one after another at
//!    `--rate` per second, without waiting for any checkpoint, faster than the engine's slots
//!    drain; then a wait (until `--deadline`) for every sandbox's checkpoint manifest, `full` or
//!    `failed` (a failed job publishes a manifest of kind `failed` with the reason). Latency =
//!    from the turn-end `Tasks.Update` returning to the manifest's mtime; its wait for a slot =
//!    latency minus the job's own `timings.total_ms`. Meanwhile every second: each shim's CPU
//!    (its own, and its reaped children's: runc, CRIU), the load average.
//! 4. Afterwards: the engine's `stats.json`, the shims' memory and idle CPU again, then every
//!    sandbox removed (also on failure and on Ctrl-C / SIGTERM; a second one quits at once) and
//!    the host checked: no shim of the run, no container, task or snapshot in containerd, no
//!    slot held or ticket queued in the engine, no store dir, no mount, process, cgroup or
//!    state entry named after a sandbox.
//!
//! Output: a report on stdout; `$CRAB_HOME/bench/soak-<unix time>.{json,md}` and
//! `soak-latest.{json,md}` (the JSON has every sandbox). Exit 1 when a sandbox did not start,
//! a checkpoint failed or was not published by the deadline, something was left behind, or the
//! run was interrupted.
//!
//! `make soak SOAK_ARGS="--sandboxes 200"`, or with the private containerd up and the images
//! imported (`make build containerd-up images`, then `eval "$(hack/containerd.sh env)"`):
//! `cargo run --release -p crab-integration --bin soak -- [options]`

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crab_integration::bench::sandbox::AgentSandbox;
use crab_integration::bench::stats::{ms, Summary};
use crab_integration::bench::{Bench, Host};
use crab_integration::engine::Engine;
use crab_integration::env::{TestEnv, DEFAULT_RUNTIME};
use crab_integration::harness::STEP_TIMEOUT;
use crab_integration::replay::density::{
    parse_smaps_rollup, shims_serving, EngineFigures, CRAB_SHIM,
};
use crab_integration::sandbox::AGENT_IMAGE;
use crab_integration::{host, Harness};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

const BENCH: Bench = Bench::new("soak");

const USAGE: &str = "usage: soak [options]
  --sandboxes N       sandboxes at once (default 1000)
  --parallel N        creates, turn execs and removals in flight (default 32)
  --rate X            turn ends per second (default 20)
  --deadline S        how long the checkpoints of the storm may take in all, from the first
                      turn end, in seconds (default 1200)
  --idle-seconds S    how long the idle shims' CPU is sampled (default 5)
  --engine TOML       more keys of the [engine] table, e.g. 'max_jobs = 4' (one per line)
  --sandbox-config T  more crab config for every sandbox (TOML tables, e.g.
                      '[checkpoint]\\nprocess_dump = \"runc\"')";

/// The turn of every sandbox: a file changed and a process left running, so crab answers
/// `full` (an fs layer and a process image). The background `sleep` lets go of the exec's
/// stdio, or reading its output would wait for it.
const TURN: &str = "echo $RANDOM > /app/f; (sleep 100000 </dev/null >/dev/null 2>&1 &)";
/// How long one exec, one output read or one create may take.
const T: Duration = Duration::from_secs(180);
/// The first and last turn ends compared (does a job take longer with more sandboxes?).
const EDGE: usize = 100;
/// How long teardown (shims exiting, cgroups going) gets before what is left is a leftover.
const SETTLE: Duration = Duration::from_secs(30);

/// Set on the first SIGINT/SIGTERM: every phase stops starting new work, and the sandboxes
/// are removed.
static STOP: AtomicBool = AtomicBool::new(false);

fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Options

struct Opts {
    sandboxes: usize,
    parallel: usize,
    rate: f64,
    deadline: Duration,
    idle: Duration,
    engine: String,
    config: String,
}

fn opts() -> Opts {
    let mut o = Opts {
        sandboxes: 1000,
        parallel: 32,
        rate: 20.0,
        deadline: Duration::from_secs(1200),
        idle: Duration::from_secs(5),
        engine: String::new(),
        config: String::new(),
    };
    let positive = |flag: &str, v: &str| -> f64 {
        v.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x > 0.0)
            .unwrap_or_else(|| BENCH.die(format!("{flag}: a positive number expected, got {v:?}")))
    };
    let count = |flag: &str, v: &str| -> usize {
        v.parse()
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or_else(|| BENCH.die(format!("{flag}: a positive integer expected, got {v:?}")))
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = args
            .next()
            .unwrap_or_else(|| BENCH.die(format!("{flag} needs a value (see --help)")));
        match flag.as_str() {
            "--sandboxes" => o.sandboxes = count(&flag, &v),
            "--parallel" => o.parallel = count(&flag, &v),
            "--rate" => o.rate = positive(&flag, &v),
            "--deadline" => o.deadline = Duration::from_secs_f64(positive(&flag, &v)),
            "--idle-seconds" => o.idle = Duration::from_secs_f64(positive(&flag, &v)),
            "--engine" => o.engine = v,
            "--sandbox-config" => o.config = v,
            other => BENCH.die(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    o
}

// ---------------------------------------------------------------------------------------------
// Small readers of /proc and /sys

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn unix_of(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(f64::NAN, |d| d.as_secs_f64())
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn read_u64(path: &str) -> Option<u64> {
    read_trim(path).split_whitespace().next()?.parse().ok()
}

/// A field of /proc/meminfo, in KiB.
fn meminfo_kib(field: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix(field)?.strip_prefix(':')?;
            rest.trim().strip_suffix("kB")?.trim().parse().ok()
        })
}

/// Threads on the host now (the denominator of /proc/loadavg's fourth field).
fn host_tasks() -> Option<u64> {
    read_trim("/proc/loadavg")
        .split_whitespace()
        .nth(3)?
        .split_once('/')?
        .1
        .parse()
        .ok()
}

fn load1() -> f64 {
    read_trim("/proc/loadavg")
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Open files on the host (the first field of fs.file-nr).
fn file_nr() -> Option<u64> {
    read_u64("/proc/sys/fs/file-nr")
}

fn fd_count(pid: i32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// `soft/hard` of one line of /proc/PID/limits (e.g. "Max open files").
fn proc_limit(pid: i32, name: &str) -> Option<(String, String)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with(name))?;
    let mut f = line[name.len()..].split_whitespace();
    Some((f.next()?.to_string(), f.next()?.to_string()))
}

/// The private containerd: the process whose `--config` lies under `$CRAB_HOME`.
fn containerd_pid(env: &TestEnv) -> Option<i32> {
    let home = env.crab_home.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_containerd = argv
            .first()
            .and_then(|a| Path::new(a).file_name())
            .is_some_and(|n| n == "containerd");
        let ours = argv
            .windows(2)
            .any(|w| w[0] == "--config" && w[1].starts_with(&home));
        (is_containerd && ours).then_some(pid)
    })
}

/// Bytes free for unprivileged users on the file system of `path`.
fn disk_free(path: &Path) -> Option<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; both pointers are valid for the call.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    (r == 0).then(|| s.f_bavail * s.f_frsize)
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Raises this process's RLIMIT_NOFILE soft limit to its hard limit: (before, after).
fn raise_nofile() -> (u64, u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `r`, which we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return (0, 0);
    }
    let before = r.rlim_cur;
    if r.rlim_cur < r.rlim_max {
        r.rlim_cur = r.rlim_max;
        // SAFETY: setrlimit reads `r`; raising the soft limit up to the hard one is allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
            return (before, before);
        }
    }
    (before, r.rlim_cur)
}

/// A shim's CPU so far, in clock ticks: its own threads', and its waited-for children's (runc,
/// CRIU); and its threads.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    own: u64,
    children: u64,
    threads: u64,
}

fn proc_cpu(pid: i32) -> Option<Cpu> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3.
    let rest: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    let n = |field: usize| rest.get(field - 3)?.parse::<u64>().ok();
    Some(Cpu {
        own: n(14)? + n(15)?,
        children: n(16)? + n(17)?,
        threads: n(20)?,
    })
}

fn pss_kib(pid: i32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| parse_smaps_rollup(&t))
        .map(|m| m.pss_kib)
}

// ---------------------------------------------------------------------------------------------
// Host limits

/// The figures that grow with the sandboxes, at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    tasks: Option<u64>,
    mem_available_kib: Option<u64>,
    containerd_fds: Option<u64>,
    file_nr: Option<u64>,
}

impl Usage {
    fn now(containerd: Option<i32>) -> Usage {
        Usage {
            tasks: host_tasks(),
            mem_available_kib: meminfo_kib("MemAvailable"),
            containerd_fds: containerd.and_then(fd_count),
            file_nr: file_nr(),
        }
    }
}

struct Limits {
    containerd: Option<i32>,
    nofile_before: u64,
    nofile_after: u64,
    /// (name, value, why it matters), as printed.
    rows: Vec<(String, String, &'static str)>,
    pid_max: Option<u64>,
    threads_max: Option<u64>,
    file_max: Option<u64>,
    containerd_nofile: Option<u64>,
    before: Usage,
}

impl Limits {
    fn read(env: &TestEnv) -> Limits {
        let (nofile_before, nofile_after) = raise_nofile();
        let containerd = containerd_pid(env);
        let mut rows = Vec::new();
        let mut row = |name: &str, value: String, why: &'static str| {
            rows.push((name.to_string(), value, why))
        };
        row(
            "soak: RLIMIT_NOFILE (soft)",
            format!("{nofile_before} -> {nofile_after}"),
            "this process: FIFOs of the execs in flight, the gRPC connection",
        );
        let mut containerd_nofile = None;
        match containerd {
            Some(pid) => {
                for (name, why) in [
                    (
                        "Max open files",
                        "containerd's own descriptors (shim connections), and each shim's (inherited)",
                    ),
                    ("Max processes", "per user, inherited by the shims"),
                    (
                        "Max locked memory",
                        "inherited by the shims (BPF maps are charged to memory cgroups on kernels >= 5.11)",
                    ),
                ] {
                    let v = proc_limit(pid, name);
                    if name == "Max open files" {
                        containerd_nofile = v.as_ref().and_then(|(s, _)| s.parse().ok());
                    }
                    row(
                        &format!("containerd (pid {pid}): {name}"),
                        v.map_or("?".into(), |(s, h)| format!("{s} / {h}")),
                        why,
                    );
                }
            }
            None => row("containerd", "not found".into(), "its limits are the shims'"),
        }
        let pid_max = read_u64("/proc/sys/kernel/pid_max");
        let threads_max = read_u64("/proc/sys/kernel/threads-max");
        let file_max = read_u64("/proc/sys/fs/file-max");
        let opt = |v: Option<u64>| v.map_or("?".into(), |v| v.to_string());
        row(
            "kernel.pid_max",
            opt(pid_max),
            "every thread takes a pid: shims' threads, containers' processes",
        );
        row(
            "kernel.threads-max",
            opt(threads_max),
            "threads on the host",
        );
        row(
            "threads on the host now",
            opt(host_tasks()),
            "/proc/loadavg",
        );
        row(
            "MemAvailable",
            meminfo_kib("MemAvailable")
                .map_or("?".into(), |k| format!("{:.1} GiB", k as f64 / 1048576.0)),
            "shims, containers, page cache of the stores",
        );
        row(
            "fs.file-max / file-nr",
            format!("{} / {}", opt(file_max), opt(file_nr())),
            "open files on the host",
        );
        for (key, why) in [
            (
                "fs/inotify/max_user_instances",
                "inotify instances per user (the engine's waiters use none)",
            ),
            ("fs/inotify/max_user_watches", "inotify watches per user"),
            ("user/max_pid_namespaces", "one per container"),
            ("user/max_mnt_namespaces", "one per container (+ CRIU's)"),
            ("user/max_ipc_namespaces", "one per container"),
            ("user/max_uts_namespaces", "one per container"),
            (
                "kernel/keys/root_maxkeys",
                "runc gives each container a session keyring",
            ),
            ("kernel/keys/maxkeys", "the same for a non-root user"),
        ] {
            row(
                &key.replace('/', "."),
                read_trim(&format!("/proc/sys/{key}")),
                why,
            );
        }
        row(
            "disk free under CRAB_HOME",
            disk_free(&env.crab_home).map_or("?".into(), |b| {
                format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
            }),
            "the stores: a layer and a process image per checkpoint",
        );
        Limits {
            containerd,
            nofile_before,
            nofile_after,
            rows,
            pid_max,
            threads_max,
            file_max,
            containerd_nofile,
            before: Usage::now(containerd),
        }
    }

    fn md(&self) -> String {
        let mut md = String::from("| limit | value | why it matters |\n|---|---|---|\n");
        for (name, value, why) in &self.rows {
            let _ = writeln!(md, "| {name} | {value} | {why} |");
        }
        md
    }

    /// Per sandbox, from the usage before and after `n` started: what each bound allows.
    fn bounds(&self, after: &Usage, n: usize) -> Vec<Bound> {
        let mut out = Vec::new();
        let mut add = |what: &str,
                       limit: Option<u64>,
                       before: Option<u64>,
                       after: Option<u64>,
                       down: bool| {
            let (Some(b), Some(a)) = (before, after) else {
                return;
            };
            let per = if down {
                b as f64 - a as f64
            } else {
                a as f64 - b as f64
            } / n.max(1) as f64;
            let room = match (down, limit) {
                (true, _) => b as f64,
                (false, Some(l)) => l as f64 - b as f64,
                (false, None) => f64::NAN,
            };
            out.push(Bound {
                what: what.into(),
                limit,
                before: b,
                after: a,
                per_sandbox: per,
                max_sandboxes: if per > 0.0 { room / per } else { f64::NAN },
            });
        };
        let tasks_limit = match (self.pid_max, self.threads_max) {
            (Some(p), Some(t)) => Some(p.min(t)),
            (p, t) => p.or(t),
        };
        add(
            "threads (pid_max, threads-max)",
            tasks_limit,
            self.before.tasks,
            after.tasks,
            false,
        );
        add(
            "MemAvailable KiB",
            None,
            self.before.mem_available_kib,
            after.mem_available_kib,
            true,
        );
        add(
            "containerd's open files (its RLIMIT_NOFILE)",
            self.containerd_nofile,
            self.before.containerd_fds,
            after.containerd_fds,
            false,
        );
        add(
            "open files on the host (fs.file-max)",
            self.file_max,
            self.before.file_nr,
            after.file_nr,
            false,
        );
        out
    }
}

struct Bound {
    what: String,
    limit: Option<u64>,
    before: u64,
    after: u64,
    per_sandbox: f64,
    max_sandboxes: f64,
}

// ---------------------------------------------------------------------------------------------
// The sandboxes

/// One sandbox's run, as the report has it.
#[derive(Debug, Clone)]
struct Rec {
    id: String,
    start_ms: f64,
    shim_pid: Option<i32>,
    /// Manifests in its store before its turn end.
    manifests_before: usize,
    /// Its place among the turn ends.
    end_order: Option<usize>,
    /// When the turn-end `Tasks.Update` returned (unix seconds).
    end_unix: f64,
    update_ms: f64,
    /// The turn answer's kind.
    answer: String,
    outcome: Option<Outcome>,
    error: Option<String>,
}

#[derive(Debug, Clone)]
struct Outcome {
    kind: String,
    explanation: String,
    published_unix: f64,
    /// Turn end to manifest mtime.
    latency_ms: f64,
    /// The job's own time (`timings.total_ms`).
    total_ms: f64,
}

impl Outcome {
    /// Waiting for a slot (and for anything before the job started): latency minus the job.
    fn wait_ms(&self) -> f64 {
        self.latency_ms - self.total_ms
    }
}

impl Rec {
    fn new(id: String) -> Rec {
        Rec {
            id,
            start_ms: f64::NAN,
            shim_pid: None,
            manifests_before: 0,
            end_order: None,
            end_unix: f64::NAN,
            update_ms: f64::NAN,
            answer: String::new(),
            outcome: None,
            error: None,
        }
    }

    fn json(&self) -> Value {
        let num = |x: f64| if x.is_nan() { Value::Null } else { json!(x) };
        let o = self.outcome.as_ref();
        json!({
            "id": self.id,
            "start_ms": num(self.start_ms),
            "end_order": self.end_order,
            "end_unix": num(self.end_unix),
            "update_ms": num(self.update_ms),
            "answer": self.answer,
            "kind": o.map(|o| o.kind.clone()),
            "latency_ms": o.map(|o| num(o.latency_ms)),
            "job_ms": o.map(|o| num(o.total_ms)),
            "wait_ms": o.map(|o| num(o.wait_ms())),
            "explanation": o.filter(|o| o.kind == "failed").map(|o| o.explanation.clone()),
            "error": self.error,
        })
    }
}

/// The soak's state: the sandboxes by index (taken out while a task drives one).
struct Soak {
    base: Harness,
    o: Opts,
    config: String,
    prefix: String,
    recs: Vec<Rec>,
    boxes: Vec<Option<AgentSandbox>>,
    /// How many creates were attempted (each may have left something to remove).
    attempted: usize,
}

impl Soak {
    fn id(&self, i: usize) -> String {
        format!("{}{i:05}", self.prefix)
    }

    /// Starts the sandboxes; stops launching at the first failure. Total wall time, ms.
    async fn start(&mut self) -> f64 {
        let n = self.o.sandboxes;
        let sem = Arc::new(Semaphore::new(self.o.parallel));
        let failed = Arc::new(AtomicBool::new(false));
        let mut set = JoinSet::new();
        let t0 = Instant::now();
        let mut done = 0usize;
        let mut handle = |s: &mut Soak,
                          r: Result<
            (usize, Duration, Result<AgentSandbox, String>),
            tokio::task::JoinError,
        >| {
            done += 1;
            match r {
                Ok((i, took, Ok(sb))) => {
                    s.recs[i].start_ms = ms(took);
                    s.boxes[i] = Some(sb);
                }
                Ok((i, _, Err(e))) => {
                    if !failed.swap(true, Ordering::Relaxed) {
                        BENCH.progress(format!("start failed, starting no more: {e}"));
                    }
                    s.recs[i].error = Some(format!("start: {e}"));
                }
                Err(e) => BENCH.progress(format!("a start task failed: {e}")),
            }
            if done.is_multiple_of(100) || done == n {
                BENCH.progress(format!(
                    "started {done}/{n} in {:.1} s (load {})",
                    t0.elapsed().as_secs_f64(),
                    crab_integration::bench::loadavg()
                ));
            }
        };
        for i in 0..n {
            if stopped() || failed.load(Ordering::Relaxed) {
                break;
            }
            let permit = sem.clone().acquire_owned().await.expect("never closed");
            let (base, config, id) = (self.base.clone(), self.config.clone(), self.id(i));
            self.attempted = i + 1;
            set.spawn(async move {
                let t = Instant::now();
                let r = AgentSandbox::start_with(&base, DEFAULT_RUNTIME, id, T, &config).await;
                drop(permit);
                (i, t.elapsed(), r)
            });
            while let Some(r) = set.try_join_next() {
                handle(self, r);
            }
        }
        while let Some(r) = set.join_next().await {
            handle(self, r);
        }
        ms(t0.elapsed())
    }

    /// Each started sandbox's shim pid, by its `-id`.
    fn find_shims(&mut self) {
        let by_id: HashMap<String, i32> = shims_serving(&self.base.env, CRAB_SHIM)
            .into_iter()
            .map(|(id, p)| (id, p.pid))
            .collect();
        for r in &mut self.recs {
            r.shim_pid = by_id.get(&r.id).copied();
        }
    }

    fn shim_pids(&self) -> Vec<Option<i32>> {
        self.recs.iter().map(|r| r.shim_pid).collect()
    }

    /// Runs the turn's exec in every started sandbox, `--parallel` at a time. Wall time, ms.
    async fn run_turns(&mut self) -> f64 {
        let sem = Arc::new(Semaphore::new(self.o.parallel));
        let mut set = JoinSet::new();
        let t0 = Instant::now();
        for i in 0..self.boxes.len() {
            if stopped() {
                break;
            }
            let Some(mut sb) = self.boxes[i].take() else {
                continue;
            };
            let permit = sem.clone().acquire_owned().await.expect("never closed");
            set.spawn(async move {
                let r = sb.run(TURN).await;
                let before = sb.manifest_files().len();
                drop(permit);
                (i, sb, r, before)
            });
        }
        while let Some(r) = set.join_next().await {
            let Ok((i, sb, r, before)) = r else { continue };
            self.recs[i].manifests_before = before;
            if let Err(e) = r {
                self.recs[i].error = Some(format!("turn: {e}"));
            }
            self.boxes[i] = Some(sb);
        }
        ms(t0.elapsed())
    }

    /// Ends the turns of the sandboxes whose turn ran, at `--rate` per second, each in a task
    /// of its own so that a slow `Tasks.Update` does not slow the pace. (first, last) turn end
    /// sent, unix seconds.
    async fn end_turns(&mut self) -> (f64, f64) {
        let order: Vec<usize> = (0..self.boxes.len())
            .filter(|i| self.boxes[*i].is_some() && self.recs[*i].error.is_none())
            .collect();
        let mut set = JoinSet::new();
        let t0 = tokio::time::Instant::now();
        let (mut first, mut last) = (f64::NAN, f64::NAN);
        for (k, &i) in order.iter().enumerate() {
            if stopped() {
                break;
            }
            tokio::time::sleep_until(t0 + Duration::from_secs_f64(k as f64 / self.o.rate)).await;
            let mut sb = self.boxes[i].take().expect("in the order");
            let sent = unix_now();
            if k == 0 {
                first = sent;
            }
            last = sent;
            self.recs[i].end_order = Some(k);
            set.spawn(async move {
                let t = Instant::now();
                let r = sb.end_turn().await;
                (i, sb, unix_now(), t.elapsed(), r)
            });
            if (k + 1).is_multiple_of(100) {
                BENCH.progress(format!(
                    "{} turn ends sent (load {})",
                    k + 1,
                    crab_integration::bench::loadavg()
                ));
            }
            while let Some(r) = set.try_join_next() {
                self.ended(r);
            }
        }
        while let Some(r) = set.join_next().await {
            self.ended(r);
        }
        (first, last)
    }

    #[allow(clippy::type_complexity)]
    fn ended(
        &mut self,
        r: Result<
            (
                usize,
                AgentSandbox,
                f64,
                Duration,
                Result<(Duration, Value), String>,
            ),
            tokio::task::JoinError,
        >,
    ) {
        let Ok((i, sb, at, took, r)) = r else { return };
        let rec = &mut self.recs[i];
        rec.end_unix = at;
        rec.update_ms = ms(took);
        match r {
            Ok((_, answer)) => rec.answer = answer["kind"].as_str().unwrap_or("?").to_string(),
            Err(e) => rec.error = Some(format!("turn end: {e}")),
        }
        self.boxes[i] = Some(sb);
    }

    /// Waits until every ended turn's checkpoint is published (or `deadline` passes, or the
    /// run is interrupted). How many are still missing.
    async fn wait_published(&mut self, deadline: Instant) -> usize {
        let mut last_note = Instant::now();
        loop {
            let mut missing = 0;
            let mut failed = 0;
            for (sb, rec) in self.boxes.iter().zip(self.recs.iter_mut()) {
                let Some(sb) = sb else { continue };
                if rec.end_unix.is_nan() || rec.error.is_some() {
                    continue;
                }
                if let Some(o) = &rec.outcome {
                    failed += usize::from(o.kind == "failed");
                    continue;
                }
                let files = sb.manifest_files();
                let Some(path) = files.get(rec.manifests_before) else {
                    missing += 1;
                    continue;
                };
                match read_outcome(path, rec.end_unix) {
                    Ok(o) => {
                        failed += usize::from(o.kind == "failed");
                        rec.outcome = Some(o);
                    }
                    // Not whole yet (a manifest is renamed into place, so this is rare).
                    Err(_) => missing += 1,
                }
            }
            if missing == 0 || stopped() || Instant::now() >= deadline {
                return missing;
            }
            if last_note.elapsed() >= Duration::from_secs(10) {
                last_note = Instant::now();
                BENCH.progress(format!(
                    "checkpoints: {missing} still to come, {failed} failed (load {})",
                    crab_integration::bench::loadavg()
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Removes every sandbox the run attempted, `--parallel` at a time, whatever state it got
    /// to. Wall time (ms) and the errors.
    async fn remove_all(&mut self) -> (f64, Vec<String>) {
        let t0 = Instant::now();
        let sem = Arc::new(Semaphore::new(self.o.parallel));
        let mut set = JoinSet::new();
        self.boxes.iter_mut().for_each(|b| drop(b.take()));
        for i in 0..self.attempted {
            let permit = sem.clone().acquire_owned().await.expect("never closed");
            let (h, id) = (self.base.clone(), self.id(i));
            set.spawn(async move {
                let r = remove(&h, &id).await;
                drop(permit);
                r
            });
        }
        let mut errors = Vec::new();
        let mut done = 0usize;
        while let Some(r) = set.join_next().await {
            done += 1;
            if let Ok(Err(e)) = r {
                errors.push(e);
            }
            if done.is_multiple_of(200) {
                BENCH.progress(format!("removed {done}/{}", self.attempted));
            }
        }
        (ms(t0.elapsed()), errors)
    }
}

fn read_outcome(path: &Path, end_unix: f64) -> Result<Outcome, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    let published = meta.modified().map(unix_of).unwrap_or(f64::NAN);
    let m: Value = serde_json::from_slice(&std::fs::read(path).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    Ok(Outcome {
        kind: m["kind"].as_str().unwrap_or("?").to_string(),
        explanation: m["explanation"].as_str().unwrap_or("").to_string(),
        published_unix: published,
        latency_ms: (published - end_unix) * 1e3,
        total_ms: m["timings"]["total_ms"].as_f64().unwrap_or(0.0),
    })
}

/// Kills and deletes task and container `id` (what exists of them), its store dir and FIFOs.
async fn remove(h: &Harness, id: &str) -> Result<(), String> {
    let gone = |e: &crab_integration::Error| e.grpc_code() == Some(tonic::Code::NotFound);
    let mut errors = Vec::new();
    match h.kill(id, "", libc::SIGKILL, true).await {
        Ok(()) => {
            if let Err(e) = h.wait(id, "", STEP_TIMEOUT).await {
                errors.push(format!("wait: {e}"));
            }
        }
        Err(e) if gone(&e) => {}
        Err(e) => errors.push(format!("kill: {e}")),
    }
    match h.delete_task(id).await {
        Err(e) if !gone(&e) => errors.push(format!("delete task: {e}")),
        _ => {}
    }
    match h.delete_container(id).await {
        Err(e) if !gone(&e) => errors.push(format!("delete container: {e}")),
        _ => {}
    }
    let _ = std::fs::remove_dir_all(h.env.crab_home.join("state").join(id));
    let _ = std::fs::remove_dir_all(h.env.fifo_root().join(id));
    match errors.is_empty() {
        true => Ok(()),
        false => Err(format!("{id}: {}", errors.join("; "))),
    }
}

// ---------------------------------------------------------------------------------------------
// Sampling the shims

/// Every shim's CPU at one moment, by sandbox index.
struct Sample {
    unix: f64,
    load1: f64,
    cpu: Vec<Option<Cpu>>,
}

fn sample(pids: &[Option<i32>]) -> Sample {
    Sample {
        unix: unix_now(),
        load1: load1(),
        cpu: pids.iter().map(|p| p.and_then(proc_cpu)).collect(),
    }
}

/// Samples every `every` until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    fn start(pids: Vec<Option<i32>>, every: Duration) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let pids = Arc::new(pids);
        let task = tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let p = pids.clone();
                if let Ok(v) = tokio::task::spawn_blocking(move || sample(&p)).await {
                    out.push(v);
                }
                if s.load(Ordering::Relaxed) {
                    return out;
                }
                tokio::time::sleep(every).await;
            }
        });
        Sampler { stop, task }
    }

    async fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

/// CPU between two samples, in CPUs (1.0 = one CPU busy): the shims' own and their children's.
fn cpu_between(a: &Sample, b: &Sample, tck: f64, pick: impl Fn(usize) -> bool) -> (f64, f64) {
    let dt = (b.unix - a.unix).max(1e-6);
    let (mut own, mut children) = (0u64, 0u64);
    for (i, (x, y)) in a.cpu.iter().zip(&b.cpu).enumerate() {
        if let (Some(x), Some(y), true) = (x, y, pick(i)) {
            own += y.own.saturating_sub(x.own);
            children += y.children.saturating_sub(x.children);
        }
    }
    (own as f64 / tck / dt, children as f64 / tck / dt)
}

/// Idle shims: CPU over `idle` with nothing happening, and memory.
#[derive(Debug, Clone)]
struct Idle {
    shims: usize,
    seconds: f64,
    /// All shims together, in CPUs.
    cpu_total: f64,
    /// All shims together over the window, CPU ms (clock-tick resolution).
    cpu_ms: f64,
    pss_kib: Summary,
    pss_total_kib: u64,
    threads: Summary,
}

async fn idle(pids: &[Option<i32>], idle: Duration) -> Idle {
    let a = sample(pids);
    tokio::time::sleep(idle).await;
    let b = sample(pids);
    let tck = clock_ticks();
    let (own, children) = cpu_between(&a, &b, tck, |_| true);
    let live: Vec<i32> = pids.iter().flatten().copied().collect();
    let pss: Vec<u64> = live.iter().filter_map(|p| pss_kib(*p)).collect();
    let threads: Vec<f64> = b.cpu.iter().flatten().map(|c| c.threads as f64).collect();
    Idle {
        shims: live.len(),
        seconds: b.unix - a.unix,
        cpu_total: own + children,
        cpu_ms: (own + children) * (b.unix - a.unix) * 1e3,
        pss_kib: Summary::of(&pss.iter().map(|k| *k as f64).collect::<Vec<_>>()),
        pss_total_kib: pss.iter().sum(),
        threads: Summary::of(&threads),
    }
}

impl Idle {
    fn json(&self) -> Value {
        json!({"shims": self.shims, "seconds": self.seconds, "cpu_total_cpus": self.cpu_total, "cpu_ms": self.cpu_ms,
               "cpu_per_shim_pct": self.per_shim_pct(),
               "pss_kib_per_shim": self.pss_kib, "pss_total_kib": self.pss_total_kib,
               "threads_per_shim": self.threads})
    }

    fn per_shim_pct(&self) -> f64 {
        self.cpu_total / self.shims.max(1) as f64 * 100.0
    }
}

/// The shims' CPU during the storm (from the first turn end until the last checkpoint).
#[derive(Debug, Clone, Default)]
struct StormCpu {
    seconds: f64,
    /// The shims' own threads, mean over the storm, in CPUs.
    own: f64,
    /// Their reaped children (runc, CRIU), in CPUs.
    children: f64,
    /// The shims whose sandbox's job waited for a slot (turn ended, job not started) for a
    /// whole sampling interval: their own CPU per shim, as % of one CPU, and in all at the
    /// interval where most waited.
    waiting_shim_seconds: f64,
    waiting_pct_per_shim: f64,
    waiting_peak_shims: usize,
    waiting_peak_cpus: f64,
    load1_max: f64,
    load1_end: f64,
}

fn storm_cpu(samples: &[Sample], recs: &[Rec]) -> StormCpu {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return StormCpu::default();
    };
    let tck = clock_ticks();
    let (own, children) = cpu_between(first, last, tck, |_| true);
    // A shim waits from its turn end until its job starts (publish - the job's own time).
    let windows: Vec<Option<(f64, f64)>> = recs
        .iter()
        .map(|r| {
            let o = r.outcome.as_ref()?;
            Some((r.end_unix, o.published_unix - o.total_ms / 1e3))
        })
        .collect();
    let (mut ticks, mut secs) = (0u64, 0.0);
    let (mut peak_n, mut peak_cpus) = (0usize, 0.0f64);
    for w in samples.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let waiting = |i: usize| windows[i].is_some_and(|(s, e)| s <= a.unix && b.unix <= e);
        let n = (0..recs.len()).filter(|i| waiting(*i)).count();
        let (cpus, _) = cpu_between(a, b, tck, waiting);
        for (i, (x, y)) in a.cpu.iter().zip(&b.cpu).enumerate() {
            if let (Some(x), Some(y), true) = (x, y, waiting(i)) {
                ticks += y.own.saturating_sub(x.own);
                secs += b.unix - a.unix;
            }
        }
        if n > peak_n {
            (peak_n, peak_cpus) = (n, cpus);
        }
    }
    StormCpu {
        seconds: last.unix - first.unix,
        own,
        children,
        waiting_shim_seconds: secs,
        waiting_pct_per_shim: if secs > 0.0 {
            ticks as f64 / tck / secs * 100.0
        } else {
            f64::NAN
        },
        waiting_peak_shims: peak_n,
        waiting_peak_cpus: peak_cpus,
        load1_max: samples.iter().map(|s| s.load1).fold(f64::NAN, f64::max),
        load1_end: last.load1,
    }
}

// ---------------------------------------------------------------------------------------------
// Leftovers

/// What the run left on the host: one line each; empty means clean.
async fn leftovers(h: &Harness, prefix: &str, engine_root: &Path) -> Vec<String> {
    let mut l = Vec::new();
    let ours = |s: &str| s.starts_with(prefix);
    for (id, p) in host::shims_of(&h.env.address) {
        if ours(&id) {
            l.push(format!("shim {p}"));
        }
    }
    match h.inventory().await {
        Ok(inv) => {
            for ns in inv.iter().filter(|n| n.name == h.env.namespace) {
                l.extend(
                    ns.containers
                        .iter()
                        .filter(|c| ours(c))
                        .map(|c| format!("container {c}")),
                );
                l.extend(
                    ns.tasks
                        .iter()
                        .filter(|(t, _)| ours(t))
                        .map(|(t, s)| format!("task {t} ({s:?})")),
                );
            }
        }
        Err(e) => l.push(format!("containerd's inventory unreadable: {e}")),
    }
    let ctr = h.ctr();
    match tokio::task::spawn_blocking(move || ctr.run(&["snapshots", "ls"])).await {
        Ok(Ok(out)) => l.extend(
            out.stdout
                .lines()
                .filter_map(|line| line.split_whitespace().next())
                .filter(|k| ours(k))
                .map(|k| format!("snapshot {k}")),
        ),
        Ok(Err(e)) => l.push(format!("ctr snapshots ls: {e}")),
        Err(e) => l.push(format!("ctr snapshots ls: {e}")),
    }
    if engine_root.exists() {
        let engine = crab_shim::engine::Engine::new(&crab_runtime_config::EngineConfig {
            root: engine_root.to_path_buf(),
            ..Default::default()
        });
        match engine.snapshot() {
            Ok(s) => {
                for slot in s.slots {
                    if let Some(h) = slot.holder {
                        l.push(format!(
                            "engine slot {} held by {}/{} (pid {})",
                            slot.index, h.namespace, h.sandbox, h.pid
                        ));
                    }
                }
                for q in s.queue {
                    l.push(format!("engine ticket {} of {}", q.ticket, q.info.sandbox));
                }
            }
            Err(e) => l.push(format!("engine snapshot: {e}")),
        }
    }
    let env = h.env.clone();
    let prefix = prefix.to_string();
    if let Ok(found) = tokio::task::spawn_blocking(move || host_leftovers(&env, &prefix)).await {
        l.extend(found);
    }
    l
}

/// Store dirs, FIFO dirs, mounts, processes, cgroups and state entries named after a sandbox.
fn host_leftovers(env: &TestEnv, prefix: &str) -> Vec<String> {
    let mut l = Vec::new();
    let named = |p: &Path| p.iter().any(|c| c.to_string_lossy().starts_with(prefix));
    for (what, dir) in [
        ("store dir", env.crab_home.join("state")),
        ("FIFO dir", env.fifo_root()),
    ] {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(prefix) {
                l.push(format!("{what} {}", e.path().display()));
            }
        }
    }
    for m in host::mountinfo() {
        if named(&m.mount_point) {
            l.push(format!("mount {}", m.mount_point.display()));
        }
    }
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let inside = cg
            .lines()
            .filter_map(|line| line.splitn(3, ':').nth(2))
            .any(|path| named(Path::new(path)));
        if inside {
            l.push(format!(
                "process {pid} ({}) in a sandbox's cgroup",
                read_trim(&format!("/proc/{pid}/comm"))
            ));
        }
    }
    let mut found = Vec::new();
    for root in host::cgroup_mounts() {
        find_prefixed(&root, prefix, 4, &mut found);
    }
    for root in [
        env.containerd_state(),
        PathBuf::from("/run/containerd/runc").join(&env.namespace),
        crab_runtime_config::RuncConfig::default()
            .root
            .join(&env.namespace),
    ] {
        find_prefixed(&root, prefix, 6, &mut found);
    }
    l.extend(found.iter().map(|p| format!("entry {}", p.display())));
    l
}

/// Entries whose name starts with `prefix`, `depth` levels down (no symlinks, no rootfs).
fn find_prefixed(dir: &Path, prefix: &str, depth: usize, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(prefix) {
            out.push(e.path());
        } else if depth > 1 && name != "rootfs" && e.file_type().is_ok_and(|t| t.is_dir()) {
            find_prefixed(&e.path(), prefix, depth - 1, out);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Main

#[tokio::main]
async fn main() {
    let o = opts();
    let env = BENCH.crab_env("checkpoints");
    let limits = Limits::read(&env);
    BENCH.progress(format!(
        "host limits that could bound the sandboxes:\n{}",
        limits.md()
    ));
    let base = Harness::connect_env(env)
        .await
        .unwrap_or_else(|e| BENCH.die(e));
    watch_signals();
    let pid = std::process::id();
    let engine = Engine::new("soak", "");
    let config = format!(
        "[engine]\nroot = \"{}\"\n{}\n{}\n",
        engine.root.display(),
        o.engine,
        o.config
    );
    let n = o.sandboxes;
    let mut soak = Soak {
        base,
        prefix: format!("soak-{pid}-"),
        recs: Vec::new(),
        boxes: (0..n).map(|_| None).collect(),
        attempted: 0,
        config,
        o,
    };
    soak.recs = (0..n).map(|i| Rec::new(soak.id(i))).collect();
    let host = Host::now();
    let load_before = crab_integration::bench::loadavg();
    let started_at = Instant::now();

    // 2. Start.
    BENCH.progress(format!(
        "starting {n} sandboxes, {} at a time, engine root {}",
        soak.o.parallel,
        engine.root.display()
    ));
    let start_total_ms = soak.start().await;
    let started = soak.boxes.iter().filter(|b| b.is_some()).count();
    soak.find_shims();
    let after_start = Usage::now(limits.containerd);
    let bounds = limits.bounds(&after_start, started);
    let all_started = started == n && !stopped();

    let mut run = Run {
        start_total_ms,
        started,
        ..Default::default()
    };
    if all_started {
        // Idle: a moment to settle, then CPU and memory.
        tokio::time::sleep(Duration::from_secs(2)).await;
        BENCH.progress(format!("{n} sandboxes idle for {:?}", soak.o.idle));
        run.idle_before = Some(idle(&soak.shim_pids(), soak.o.idle).await);
        storm(&mut soak, &mut run).await;
        if !stopped() {
            run.idle_after = Some(idle(&soak.shim_pids(), soak.o.idle).await);
        }
    }
    run.engine = Some(EngineFigures::read(&engine.root));
    run.engine_raw = std::fs::read(engine.root.join("stats.json"))
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok());

    // Removal, and what is left; the same check first sees the live sandboxes (it is not blind).
    run.seen_before_removal = leftovers(&soak.base, &soak.prefix, &engine.root)
        .await
        .len();
    BENCH.progress(format!("removing {} sandboxes", soak.attempted));
    (run.remove_ms, run.remove_errors) = soak.remove_all().await;
    let settle = Instant::now() + SETTLE;
    run.leftovers = loop {
        let l = leftovers(&soak.base, &soak.prefix, &engine.root).await;
        if l.is_empty() || Instant::now() >= settle {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Whatever the removal missed, so that the next run starts clean (reported above).
    BENCH.remove_state_dirs(&soak.base.env.crab_home.join("state"), pid);
    engine.remove();
    run.interrupted = stopped();
    run.total_s = started_at.elapsed().as_secs_f64();

    let ok = report(&soak, &run, &limits, &bounds, &host, &load_before);
    std::process::exit(if ok { 0 } else { 1 });
}

/// Figures of one run.
#[derive(Default)]
struct Run {
    start_total_ms: f64,
    started: usize,
    idle_before: Option<Idle>,
    idle_after: Option<Idle>,
    exec_ms: f64,
    ends_first_last: (f64, f64),
    missing: usize,
    storm: StormCpu,
    engine: Option<Result<EngineFigures, String>>,
    engine_raw: Option<crab_shim::engine::Stats>,
    remove_ms: f64,
    remove_errors: Vec<String>,
    leftovers: Vec<String>,
    /// What the leftover check found before the removal.
    seen_before_removal: usize,
    interrupted: bool,
    total_s: f64,
}

/// 3. The turns, their ends at the rate, and the wait for every checkpoint.
async fn storm(soak: &mut Soak, run: &mut Run) {
    BENCH.progress(format!(
        "running the turn in every sandbox: `{TURN}`, {} at a time",
        soak.o.parallel
    ));
    run.exec_ms = soak.run_turns().await;
    if stopped() {
        return;
    }
    BENCH.progress(format!(
        "ending the turns at {}/s, then waiting for every checkpoint (deadline {:?})",
        soak.o.rate, soak.o.deadline
    ));
    let sampler = Sampler::start(soak.shim_pids(), Duration::from_secs(1));
    let deadline = Instant::now() + soak.o.deadline;
    run.ends_first_last = soak.end_turns().await;
    run.missing = soak.wait_published(deadline).await;
    let samples = sampler.finish().await;
    run.storm = storm_cpu(&samples, &soak.recs);
}

// ---------------------------------------------------------------------------------------------
// Report

/// `x` with `d` decimals, `-` when missing.
fn num(x: f64, d: usize) -> String {
    if x.is_finite() {
        format!("{x:.d$}")
    } else {
        "-".into()
    }
}

fn jnum(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

/// p50, p99 and max of a sample, for a table row.
fn cols(s: &Summary) -> String {
    format!("{} | {} | {}", num(s.p50, 0), num(s.p99, 0), num(s.max, 0))
}

fn counts<'a>(it: impl Iterator<Item = &'a str>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for k in it {
        *m.entry(k.to_string()).or_insert(0) += 1;
    }
    m
}

fn counts_str(m: &BTreeMap<String, usize>) -> String {
    let v: Vec<String> = m.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(", ")
    }
}

/// Latency, wait and job time of a set of turn ends (the published, not failed, ones).
struct Latencies {
    n: usize,
    latency: Summary,
    wait: Summary,
    job: Summary,
}

impl Latencies {
    fn of(recs: &[&Rec]) -> Latencies {
        let ok: Vec<&Outcome> = recs
            .iter()
            .filter_map(|r| r.outcome.as_ref())
            .filter(|o| o.kind != "failed")
            .collect();
        let s = |f: fn(&Outcome) -> f64| Summary::of(&ok.iter().map(|o| f(o)).collect::<Vec<_>>());
        Latencies {
            n: recs.len(),
            latency: s(|o| o.latency_ms),
            wait: s(|o| o.wait_ms()),
            job: s(|o| o.total_ms),
        }
    }

    fn json(&self) -> Value {
        json!({"turn_ends": self.n, "latency_ms": self.latency, "wait_ms": self.wait,
               "job_ms": self.job})
    }
}

/// Prints and writes the report; whether the run was clean.
fn report(
    soak: &Soak,
    run: &Run,
    limits: &Limits,
    bounds: &[Bound],
    host: &Host,
    load_before: &str,
) -> bool {
    let n = soak.o.sandboxes;
    let recs = &soak.recs;
    let mut ended: Vec<&Rec> = recs.iter().filter(|r| r.end_order.is_some()).collect();
    ended.sort_by_key(|r| r.end_order);
    let failed: Vec<&Rec> = recs
        .iter()
        .filter(|r| r.outcome.as_ref().is_some_and(|o| o.kind == "failed"))
        .collect();
    let missing: Vec<&Rec> = ended
        .iter()
        .copied()
        .filter(|r| r.outcome.is_none() && r.error.is_none())
        .collect();
    let errors: Vec<&Rec> = recs.iter().filter(|r| r.error.is_some()).collect();
    let all = Latencies::of(&ended);
    let first = Latencies::of(&ended[..ended.len().min(EDGE)]);
    let last = Latencies::of(&ended[ended.len().saturating_sub(EDGE)..]);
    let starts = Summary::of(&recs.iter().map(|r| r.start_ms).collect::<Vec<_>>());
    let updates = Summary::of(&ended.iter().map(|r| r.update_ms).collect::<Vec<_>>());
    let kinds = counts(
        recs.iter()
            .filter_map(|r| r.outcome.as_ref())
            .map(|o| o.kind.as_str()),
    );
    let answers = counts(
        ended
            .iter()
            .map(|r| r.answer.as_str())
            .filter(|a| !a.is_empty()),
    );
    let (f0, f1) = run.ends_first_last;
    let rate = if ended.len() > 1 && f1 > f0 {
        (ended.len() - 1) as f64 / (f1 - f0)
    } else {
        f64::NAN
    };
    let clean = run.started == n
        && !run.interrupted
        && errors.is_empty()
        && failed.is_empty()
        && missing.is_empty()
        && ended.len() == n
        && run.remove_errors.is_empty()
        && run.leftovers.is_empty()
        && run.seen_before_removal >= run.started;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Soak: {n} sandboxes, a checkpoint storm\n\n\
         kernel {}, {} CPUs, unix time {}, total {:.0} s, loadavg before {load_before} / after {}. \
         Image {AGENT_IMAGE}, runtime {DEFAULT_RUNTIME} through the private containerd, namespace {}, \
         a private host engine ({}). Options: --sandboxes {n} --parallel {} --rate {} --deadline {} \
         --idle-seconds {}{}{}.\n\n**{}**\n",
        host.kernel,
        host.cpus,
        host.unix_time,
        run.total_s,
        crab_integration::bench::loadavg(),
        soak.base.env.namespace,
        if soak.o.engine.trim().is_empty() {
            "default [engine] settings".to_string()
        } else {
            format!("[engine] {}", soak.o.engine.trim().replace('\n', "; "))
        },
        soak.o.parallel,
        soak.o.rate,
        soak.o.deadline.as_secs_f64(),
        soak.o.idle.as_secs_f64(),
        if soak.o.config.trim().is_empty() { "" } else { " --sandbox-config " },
        soak.o.config.trim().replace('\n', "; "),
        if clean {
            "Clean: every sandbox started, every checkpoint published, nothing left behind."
        } else if run.interrupted {
            "INTERRUPTED: partial figures; the sandboxes were removed (leftovers below)."
        } else {
            "NOT CLEAN: see the failures below."
        }
    );

    let _ = writeln!(md, "## Host limits\n\n{}", limits.md());
    if !bounds.is_empty() {
        let _ = writeln!(
            md,
            "What the {} started sandboxes took, and how many the limit allows at that rate \
             (memory: MemAvailable as it was before):\n\n\
             | bound | limit | before | after | per sandbox | sandboxes at the limit |\n|---|---:|---:|---:|---:|---:|",
            run.started
        );
        for b in bounds {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                b.what,
                b.limit.map_or("-".into(), |l| l.to_string()),
                b.before,
                b.after,
                num(b.per_sandbox, 1),
                num(b.max_sandboxes, 0)
            );
        }
        md.push('\n');
    }

    let _ = writeln!(
        md,
        "## Start\n\n{} of {n} started ({} at a time) in {:.1} s ({} per second); per sandbox (create + \
         task create + start) p50 {} ms, p99 {} ms, max {} ms.\n",
        run.started,
        soak.o.parallel,
        run.start_total_ms / 1e3,
        num(run.started as f64 / (run.start_total_ms / 1e3), 1),
        num(starts.p50, 0),
        num(starts.p99, 0),
        num(starts.max, 0)
    );

    let idle_row = |what: &str, i: &Idle| {
        format!(
            "| {what} | {} | {} | {} | {:.1} | {:.0} | {} | {} |",
            i.shims,
            num(i.pss_kib.p50 / 1024.0, 2),
            num(i.pss_kib.max / 1024.0, 2),
            i.pss_total_kib as f64 / 1024.0,
            i.cpu_ms,
            num(i.cpu_total * 100.0, 2),
            num(i.per_shim_pct(), 4),
        )
    };
    if run.idle_before.is_some() || run.idle_after.is_some() {
        let _ = writeln!(
            md,
            "## Idle shims\n\nMemory: PSS from smaps_rollup (shared pages divided among the shims). \
             CPU: utime+stime of every crab shim (and its reaped children) over {:.0} s with nothing \
             happening: CPU ms in all (the kernel counts in ticks of 1/CLK_TCK s), and in % of one CPU.\n\n\
             | when | shims | PSS p50 MiB | PSS max MiB | PSS total MiB | CPU ms, all shims | CPU all shims % | CPU per shim % |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|",
            soak.o.idle.as_secs_f64()
        );
        if let Some(i) = &run.idle_before {
            let _ = writeln!(md, "{}", idle_row("after the start", i));
        }
        if let Some(i) = &run.idle_after {
            let _ = writeln!(md, "{}", idle_row("after the storm", i));
        }
        if let Some(i) = &run.idle_before {
            let _ = writeln!(
                md,
                "\nThreads per shim: p50 {}, max {}.",
                num(i.threads.p50, 0),
                num(i.threads.max, 0)
            );
        }
        md.push('\n');
    }

    if !ended.is_empty() {
        let _ = writeln!(
            md,
            "## Checkpoint storm\n\nThe turn (`{TURN}`) ran in every sandbox first ({:.1} s, {} at a time); \
             then {} turn ends at {} per second (achieved {}/s over {:.1} s), none waiting for a checkpoint. \
             `Tasks.Update` of a turn end: p50 {} ms, p99 {} ms, max {} ms. Turn answers: {}. \
             Checkpoints: {}; {} failed, {} not published by the deadline.\n\n\
             Latency = from the turn end's `Tasks.Update` returning to the manifest's mtime; job = the \
             manifest's `timings.total_ms` (the job in its slot); wait = latency - job (queued for a \
             slot). Published checkpoints only (failed ones are counted above).\n\n\
             | turn ends | n | latency p50 ms | p99 | max | wait p50 ms | p99 | max | job p50 ms | p99 | max |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            run.exec_ms / 1e3,
            soak.o.parallel,
            ended.len(),
            soak.o.rate,
            num(rate, 1),
            f1 - f0,
            num(updates.p50, 1),
            num(updates.p99, 1),
            num(updates.max, 1),
            counts_str(&answers),
            counts_str(&kinds),
            failed.len(),
            missing.len()
        );
        for (what, l) in [("all", &all), ("first 100", &first), ("last 100", &last)] {
            let _ = writeln!(
                md,
                "| {what} | {} | {} | {} | {} |",
                l.latency.n,
                cols(&l.latency),
                cols(&l.wait),
                cols(&l.job)
            );
        }
        md.push('\n');
        if !failed.is_empty() {
            let _ = writeln!(
                md,
                "Failed checkpoints ({}), the first few:\n",
                failed.len()
            );
            for r in failed.iter().take(5) {
                let o = r.outcome.as_ref().expect("failed ones have one");
                let _ = writeln!(
                    md,
                    "- {} (turn end #{}, after {:.1} s): {}",
                    r.id,
                    r.end_order.unwrap_or(0),
                    o.latency_ms / 1e3,
                    o.explanation.replace('\n', " ")
                );
            }
            md.push('\n');
        }
        if !missing.is_empty() {
            let ids: Vec<&str> = missing.iter().take(5).map(|r| r.id.as_str()).collect();
            let _ = writeln!(
                md,
                "Not published within {:.0} s: {} ({}{}).\n",
                soak.o.deadline.as_secs_f64(),
                missing.len(),
                ids.join(", "),
                if missing.len() > 5 { ", ..." } else { "" }
            );
        }
        let s = &run.storm;
        let _ = writeln!(
            md,
            "Shim CPU during the storm ({:.0} s, sampled every second from the first turn end until the \
             last checkpoint): the shims' own threads {}% of one CPU, their reaped children (runc, CRIU) \
             {}%. Shims waiting for a slot (turn ended, job not started, for a whole sampling interval; \
             {:.0} shim-seconds in all): {}% of one CPU per waiting shim (own threads); at the interval \
             where most waited ({}), together {}% of one CPU. Load average (1 min): max {} during the storm, \
             {} at its end, on {} CPUs.\n",
            s.seconds,
            num(s.own * 100.0, 1),
            num(s.children * 100.0, 1),
            s.waiting_shim_seconds,
            num(s.waiting_pct_per_shim, 4),
            s.waiting_peak_shims,
            num(s.waiting_peak_cpus * 100.0, 2),
            num(s.load1_max, 2),
            num(s.load1_end, 2),
            host.cpus
        );
    }

    let _ = writeln!(md, "## Host engine (the soak's own root, stats.json)\n");
    let mut engine_json = Value::Null;
    match &run.engine {
        Some(Ok(e)) => {
            let raw = run.engine_raw.as_ref();
            let wait_max_ms = raw.map_or(f64::NAN, |r| r.wait_us_max as f64 / 1e3);
            let recent_run: Vec<f64> = raw
                .map(|r| r.recent.iter().map(|j| j.run_us as f64 / 1e3).collect())
                .unwrap_or_default();
            let recent = Summary::of(&recent_run);
            let _ = writeln!(
                md,
                "{} jobs ({} urgent), {:.1} MiB written. Wait for a slot (newest {} jobs): p50 {} ms, p95 {} ms, \
                 p99 {} ms, max {} ms (max of all jobs {} ms). Run time per job: mean {} ms; the newest {}: \
                 p50 {} ms, max {} ms.\n",
                e.jobs,
                e.urgent_jobs,
                e.bytes as f64 / 1048576.0,
                e.wait_ms.n,
                num(e.wait_ms.p50, 0),
                num(e.wait_ms.p95, 0),
                num(e.wait_ms.p99, 0),
                num(e.wait_ms.max, 0),
                num(wait_max_ms, 0),
                num(e.run_ms_mean, 0),
                recent.n,
                num(recent.p50, 0),
                num(recent.max, 0)
            );
            engine_json = json!({"jobs": e.jobs, "urgent_jobs": e.urgent_jobs, "bytes": e.bytes,
                "wait_ms": e.wait_ms, "wait_max_ms_all": jnum(wait_max_ms),
                "run_ms_mean": jnum(e.run_ms_mean), "recent_run_ms": recent});
        }
        Some(Err(e)) => {
            let _ = writeln!(md, "stats.json unreadable: {e}\n");
            engine_json = json!({"error": e});
        }
        None => {}
    }

    let _ = writeln!(
        md,
        "## Removal and leftovers\n\n{} sandboxes removed ({} at a time) in {:.1} s; {} removal errors. \
         Checked after (up to {} s for teardown): crab shims of the run, containers, tasks and snapshots \
         in containerd, engine slots and tickets, store and FIFO dirs, mounts named after a sandbox (its \
         bundle's rootfs among them), processes in a sandbox's cgroup, cgroup dirs, state entries. Before the removal \
         the same check found {} items of the {} live sandboxes{}.\n",
        soak.attempted,
        soak.o.parallel,
        run.remove_ms / 1e3,
        run.remove_errors.len(),
        SETTLE.as_secs(),
        run.seen_before_removal,
        run.started,
        if run.seen_before_removal < run.started {
            " (FEWER THAN THE SANDBOXES: the check is blind)"
        } else {
            ""
        }
    );
    for e in run.remove_errors.iter().take(5) {
        let _ = writeln!(md, "- removal: {e}");
    }
    if run.leftovers.is_empty() {
        let _ = writeln!(md, "Nothing left behind.\n");
    } else {
        let _ = writeln!(md, "Left behind ({}):\n", run.leftovers.len());
        for l in run.leftovers.iter().take(20) {
            let _ = writeln!(md, "- {l}");
        }
        md.push('\n');
    }
    if !errors.is_empty() {
        let _ = writeln!(md, "## Errors ({})\n", errors.len());
        for r in errors.iter().take(5) {
            let _ = writeln!(md, "- {}", r.error.as_deref().unwrap_or(""));
        }
        md.push('\n');
    }
    if run.interrupted {
        let _ = writeln!(
            md,
            "Interrupted (SIGINT/SIGTERM): the figures are partial.\n"
        );
    }

    let result = json!({
        "benchmark": "soak",
        "unix_time": host.unix_time,
        "total_s": run.total_s,
        "clean": clean,
        "interrupted": run.interrupted,
        "host": {"kernel": host.kernel, "cpus": host.cpus, "loadavg_before": load_before,
                 "loadavg_after": crab_integration::bench::loadavg()},
        "containerd_address": soak.base.env.address,
        "namespace": soak.base.env.namespace,
        "image": AGENT_IMAGE,
        "options": {"sandboxes": n, "parallel": soak.o.parallel, "rate": soak.o.rate,
                    "deadline_s": soak.o.deadline.as_secs_f64(), "idle_s": soak.o.idle.as_secs_f64(),
                    "engine": soak.o.engine, "sandbox_config": soak.o.config, "turn": TURN},
        "limits": {
            "rows": limits.rows.iter().map(|(k, v, _)| json!({"limit": k, "value": v})).collect::<Vec<_>>(),
            "nofile_before": limits.nofile_before, "nofile_after": limits.nofile_after,
            "bounds": bounds.iter().map(|b| json!({"bound": b.what, "limit": b.limit,
                "before": b.before, "after": b.after, "per_sandbox": jnum(b.per_sandbox),
                "max_sandboxes": jnum(b.max_sandboxes)})).collect::<Vec<_>>(),
        },
        "start": {"started": run.started, "total_ms": run.start_total_ms,
                  "per_sandbox_ms": starts},
        "idle_after_start": run.idle_before.as_ref().map(Idle::json),
        "idle_after_storm": run.idle_after.as_ref().map(Idle::json),
        "storm": {
            "exec_phase_ms": run.exec_ms,
            "turn_ends": ended.len(),
            "rate_achieved": jnum(rate),
            "update_ms": updates,
            "answers": answers,
            "kinds": kinds,
            "failed": failed.len(),
            "failed_first": failed.iter().take(5).map(|r| json!({"id": r.id,
                "explanation": r.outcome.as_ref().map(|o| o.explanation.clone())})).collect::<Vec<_>>(),
            "not_published": missing.len(),
            "all": all.json(),
            "first_100": first.json(),
            "last_100": last.json(),
            "shim_cpu": {"seconds": run.storm.seconds, "own_cpus": run.storm.own,
                "children_cpus": run.storm.children,
                "waiting_shim_seconds": run.storm.waiting_shim_seconds,
                "waiting_pct_per_shim": jnum(run.storm.waiting_pct_per_shim),
                "waiting_peak_shims": run.storm.waiting_peak_shims,
                "waiting_peak_cpus": run.storm.waiting_peak_cpus},
            "load1_max": jnum(run.storm.load1_max),
            "load1_end": jnum(run.storm.load1_end),
        },
        "engine": engine_json,
        "removal": {"ms": run.remove_ms, "errors": run.remove_errors,
                    "leftover_check_before_removal": run.seen_before_removal},
        "leftovers": run.leftovers,
        "errors": errors.iter().map(|r| r.error.clone()).collect::<Vec<_>>(),
        "sandboxes": recs.iter().map(Rec::json).collect::<Vec<_>>(),
    });
    BENCH.finish(
        &soak.base.env.bench_dir(),
        "soak",
        host.unix_time,
        &result,
        &md,
    );
    clean
}

/// The first SIGINT or SIGTERM stops the run (the sandboxes are removed and the report
/// written); a second one exits at once.
fn watch_signals() {
    tokio::spawn(async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            BENCH.progress("cannot watch SIGINT/SIGTERM: an interrupt leaves the sandboxes");
            return;
        };
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            if STOP.swap(true, Ordering::Relaxed) {
                BENCH.progress(
                    "interrupted again: quitting; `hack/containerd.sh stop` removes what is left",
                );
                std::process::exit(130);
            }
            BENCH.progress("interrupted: removing the sandboxes (interrupt again to quit at once)");
        }
    });
}
