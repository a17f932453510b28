//! Recovery correctness (issue 6, item 5): for each trajectory, crashes injected at several
//! turns, recovery under each policy, the remaining turns replayed, and the end state compared
//! with a fault-free run's by a state digest.
//!
//! ## The runs
//! Per trajectory: two fault-free runs under `none` (no checkpoints): the first is the
//! reference, the second tells which parts of the state differ between two runs without any
//! fault (see *Nondeterminism*). Then per policy and per crash point (`K` points spread over
//! the trajectory, the same for every policy; the kind alternates between SIGKILL of every
//! process of the container, the shim living on, and SIGKILL of the container's shim, the way
//! `tests/recovery.rs` does): a fresh sandbox replays the turns before the crash point (each
//! followed by a turn end under the policies that checkpoint), waits until the last checkpoint
//! is durable (a no-op exec goes through the same gate as the agent's next action), crashes,
//! recovers, replays the remaining turns and takes the digest. Recovery per policy:
//!
//! | policy | sandbox config | recovery |
//! |---|---|---|
//! | `chat-only` | `checkpoint.enabled = false` | the crashed container removed, a fresh one from the base image (the chat history is all that is kept) |
//! | `fs-every-turn` | `checkpoint.policy = "fs-every-turn"` | `crabctl recover` (same id) |
//! | `full-every-turn` | `checkpoint.policy = "full-every-turn"` | `crabctl recover` |
//! | `crab` | `checkpoint.policy = "minimal"` | `crabctl recover` |
//!
//! ## The state digest
//! Gathered inside the sandbox by `digest.py` (one exec of `python3 -c` after the last turn),
//! then filtered here ([`noise`]) into a map of items:
//! - `file <path>` -> type, mode and content: the sha256 of every regular file under /app,
//!   /root, /home, /tmp, /var/tmp, /srv, /opt, /usr/local and /etc (where agents write: the
//!   project, homes, temp files, pip installs, config), the target of symlinks, the mode of
//!   directories; elsewhere in the root (the image's /usr, /var/lib...) type, mode and size only,
//!   which catches deletions, additions and most rewrites without hashing the image each time.
//!   Never walked: /proc, /sys, /dev, /run (kernel and runtime), /var/cache, /var/log.
//!   Not compared: times of any kind (mtime, atime, ctime), owners (root everywhere), inode
//!   numbers.
//! - `proc <command line>` -> how many live processes have it: pids are left out (a restore
//!   keeps them, a fresh start would not; both are harmless), and so are zombies (exited
//!   children the init, `sleep infinity`, never reaps: not live state) and the digest's own
//!   process.
//! - `port tcp/<n>` -> what a TCP listener on port `n` answers to `GET / HTTP/1.0` sent to
//!   127.0.0.1 (or ::1): the status line and the sha256 of the body (headers left out: `Date`
//!   and `Server` change with time and versions), or the hash of whatever else it sends, or
//!   `refused`/`no answer`.
//!
//! ## Noise: what is left out or only checked for existence, and why
//! Dropped ([`Noise::Drop`]): Python bytecode (`*.pyc`, `*.pyo`, `__pycache__/`: written or not
//! depending on timing, and it embeds source mtimes), cache directories (`.cache/`,
//! `.pytest_cache/`, `.mypy_cache/`: pip's HTTP cache and the like, keyed by time), temp names
//! that are random by design (basenames under /tmp and /var/tmp starting with `tmp` or `pip-`),
//! git's object store and reflogs (`.git/objects/`, `.git/logs/`: commits embed their time, so
//! object names differ between any two runs), shell and tool histories (`.bash_history`,
//! `.python_history`, `.lesshst`, `.viminfo`, `.wget-hsts`), and what the runtime writes
//! (`/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf`, `/etc/mtab`).
//! Existence only ([`Noise::Exists`]): the rest of `.git/` (the index holds stat times, refs and
//! `HEAD` may hold commit ids), and logs (`*.log`, `nohup.out`: their lines carry times and
//! pids, and how much a server logged depends on timing).
//!
//! ## Nondeterminism
//! Anything else that differs between the two fault-free runs (a script printing the time into
//! a file, a background pip still running, a random port) is unstable: its items are left out
//! of the comparison of that trajectory's recovered runs and reported separately (per
//! trajectory, with both values), never counted as a recovery failure. A recovered run whose
//! only differences are in unstable items counts as recovered correctly; the report says how
//! many such differences were ignored.
//!
//! ## Outcome
//! Per case: `correct` (every stable item equal), `wrong` (the differing items are listed) or
//! `error` (the replay, the crash or the recovery failed; counted as not recovered). Per
//! policy: recovered correctly / total.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::trajectory::{Trajectory, Turn};
use super::{exec, first_line, ms, Options, Policy};
use crate::sandbox::{Sandbox, SandboxOptions, TURN_END};
use crate::{CleanupGuard, ProcessSpec, StdioOptions};

/// The digest's gatherer, run inside the sandbox.
pub const DIGEST_SCRIPT: &str = include_str!("digest.py");

/// The default crash points per trajectory and policy.
pub const DEFAULT_CRASH_TURNS: usize = 3;

/// A built-in trajectory (not a recording): the agent script of `tests/recovery.rs`, reduced to
/// what the digest sees without a client of its own: a server holding state in memory that
/// answers `GET /` with it, a static file server, edits and deletes, and a time stamp written
/// into a file (nondeterministic on purpose: it checks that the detection works). The recordings replayed in
/// the generic image rarely leave a working server behind (their tasks' files and packages are
/// missing), so without it the process half of recovery would go untested.
pub const SYNTHETIC_TRIAL: &str = "crab-synthetic.memory-and-servers";

/// The default selection of the recovery mode: the synthetic trajectory and recordings of each
/// kind of work (one run of all policies takes about 4 minutes, 4 sandboxes at once). Replayed
/// in the generic image, `fix-git` (no repository) and `tmux-advanced-workflow` (no tmux)
/// change next to nothing, so even chat-only recovers them: they are in to show that.
pub const DEFAULT_SELECTION: [&str; 7] = [
    SYNTHETIC_TRIAL,
    // Files written with heredocs and rewritten.
    "grid-pattern-transform.1-of-1.2025-08-13__19-44-27",
    // Background servers (nohup ... &), killed and restarted; pip installs that time out.
    "hf-model-inference.1-of-1.2025-08-13__19-44-27",
    // A service started in the background (`python bitcoin_service.py &`).
    "get-bitcoin-nodes.1-of-1.2025-08-15__16-23-45",
    // Scripts written and run on data files.
    "raman-fitting.1-of-1.2025-08-15__16-23-45",
    "fix-git.1-of-1.2025-08-13__19-44-27",
    "tmux-advanced-workflow.1-of-1.2025-08-13__19-44-27",
];

const KV_SERVER: &str = r#"cat > kv.py <<'EOF'
import http.server, json, urllib.parse
state = {}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        u = urllib.parse.urlparse(self.path)
        for k, v in urllib.parse.parse_qsl(u.query):
            state[k] = state.get(k, "") + v
        body = json.dumps(state, sort_keys=True).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 9000), H).serve_forever()
EOF
cat > set.py <<'EOF'
import sys, time, urllib.request
for _ in range(100):
    try:
        print(urllib.request.urlopen("http://127.0.0.1:9000/?" + sys.argv[1]).read().decode())
        break
    except OSError:
        time.sleep(0.05)
EOF
mkdir -p proj && echo v1 > proj/a.txt && echo scratch > junk.txt"#;

/// The synthetic trajectory's turns (think times of 1 s, scaled like the recordings').
pub fn synthetic() -> Trajectory {
    let cmds = [
        KV_SERVER,
        "cat proj/a.txt && ls -la",
        "nohup python3 /app/kv.py >/dev/null 2>&1 & python3 /app/set.py a=1",
        "python3 /app/set.py b=2 && python3 /app/set.py a=3",
        "rm junk.txt && echo v2 >> proj/a.txt && mkdir -p proj/sub && echo deep > proj/sub/b.txt",
        "echo '<h1>crab</h1>' > index.html && (nohup python3 -m http.server 8000 --bind 127.0.0.1 --directory /app/proj >/dev/null 2>&1 &) && sleep 0.5",
        "python3 /app/set.py c=4 && grep -r v proj",
        // Nondeterministic on purpose, like a build stamp: both fault-free runs differ here, so
        // the item must come out as unstable and be left out, never counted as a failure.
        "date +%s%N > build-stamp.txt",
        "python3 /app/set.py a=5 && echo v3 >> proj/a.txt",
        "ls -la proj",
    ];
    Trajectory {
        task: "crab-synthetic".into(),
        trial: SYNTHETIC_TRIAL.into(),
        turns: cmds
            .iter()
            .enumerate()
            .map(|(i, c)| Turn {
                index: i as u64,
                cmd: c.to_string(),
                think: Duration::from_secs(1),
                recorded_status: "ok".into(),
            })
            .collect(),
    }
}

/// How a crashed sandbox is brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryPolicy {
    /// No OS state kept: a fresh container from the base image.
    ChatOnly,
    FsEveryTurn,
    FullEveryTurn,
    Crab,
}

impl RecoveryPolicy {
    pub const ALL: [RecoveryPolicy; 4] = [
        RecoveryPolicy::ChatOnly,
        RecoveryPolicy::FsEveryTurn,
        RecoveryPolicy::FullEveryTurn,
        RecoveryPolicy::Crab,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RecoveryPolicy::ChatOnly => "chat-only",
            RecoveryPolicy::FsEveryTurn => "fs-every-turn",
            RecoveryPolicy::FullEveryTurn => "full-every-turn",
            RecoveryPolicy::Crab => "crab",
        }
    }

    pub fn from_name(s: &str) -> Option<RecoveryPolicy> {
        match s {
            "minimal" => Some(RecoveryPolicy::Crab),
            _ => RecoveryPolicy::ALL.into_iter().find(|p| p.name() == s),
        }
    }

    /// The checkpoint policy the sandbox runs under.
    pub fn sandbox_policy(self) -> Policy {
        match self {
            RecoveryPolicy::ChatOnly => Policy::None,
            RecoveryPolicy::FsEveryTurn => Policy::FsEveryTurn,
            RecoveryPolicy::FullEveryTurn => Policy::FullEveryTurn,
            RecoveryPolicy::Crab => Policy::Crab,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Crash {
    /// SIGKILL of every process of the container (the task stops, the shim lives).
    Processes,
    /// SIGKILL of the container's shim (the task goes with it).
    Shim,
}

/// `k` crash points spread evenly over a trajectory of `turns` turns, as (turns replayed before
/// the crash, how): each leaves at least one turn before and one after, the kinds alternate.
pub fn crash_points(turns: usize, k: usize) -> Vec<(usize, Crash)> {
    if turns < 2 {
        return Vec::new();
    }
    let mut at: Vec<usize> = (1..=k)
        .map(|i| ((i * turns) as f64 / (k + 1) as f64).round() as usize)
        .map(|c| c.clamp(1, turns - 1))
        .collect();
    at.dedup();
    at.into_iter()
        .enumerate()
        .map(|(i, c)| {
            (
                c,
                if i % 2 == 0 {
                    Crash::Processes
                } else {
                    Crash::Shim
                },
            )
        })
        .collect()
}

/// How an item of the raw digest is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Noise {
    Keep,
    /// Only whether it exists (and its type).
    Exists,
    Drop,
}

/// The noise rules for a file path (see the module docs).
pub fn noise(path: &str) -> Noise {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let base = parts.last().copied().unwrap_or("");
    const DROP_DIRS: [&str; 4] = ["__pycache__", ".cache", ".pytest_cache", ".mypy_cache"];
    const HISTORIES: [&str; 5] = [
        ".bash_history",
        ".python_history",
        ".lesshst",
        ".viminfo",
        ".wget-hsts",
    ];
    const RUNTIME: [&str; 4] = [
        "/etc/hostname",
        "/etc/hosts",
        "/etc/resolv.conf",
        "/etc/mtab",
    ];
    if parts.iter().any(|p| DROP_DIRS.contains(p))
        || base.ends_with(".pyc")
        || base.ends_with(".pyo")
        || HISTORIES.contains(&base)
        || RUNTIME.contains(&path)
    {
        return Noise::Drop;
    }
    // Random temp names: the component right under /tmp or /var/tmp.
    let tmp_child = match parts.as_slice() {
        ["tmp", c, ..] | ["var", "tmp", c, ..] => Some(*c),
        _ => None,
    };
    if tmp_child.is_some_and(|c| c.starts_with("tmp") || c.starts_with("pip-")) {
        return Noise::Drop;
    }
    if let Some(g) = parts.iter().position(|p| *p == ".git") {
        return match parts.get(g + 1) {
            Some(&"objects") | Some(&"logs") => Noise::Drop,
            _ => Noise::Exists,
        };
    }
    if base.ends_with(".log") || base == "nohup.out" {
        return Noise::Exists;
    }
    Noise::Keep
}

/// A state digest: item -> value (see the module docs for the items).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Digest {
    pub items: BTreeMap<String, String>,
}

impl Digest {
    /// Builds the digest from `digest.py`'s output, with the noise rules applied.
    pub fn from_raw(text: &str) -> Result<Digest, String> {
        let mut items = BTreeMap::new();
        let mut procs: BTreeMap<String, usize> = BTreeMap::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
            let f: Vec<&str> = line.split('\t').collect();
            let bad = || format!("digest line {}: {line:?}", n + 1);
            match f.as_slice() {
                ["file", path, kind, mode, size, what] => {
                    let value = match (noise(path), *kind) {
                        (Noise::Drop, _) => continue,
                        (Noise::Exists, k) => k.to_string(),
                        (Noise::Keep, "f") if *what == "-" => format!("f {mode} size {size}"),
                        (Noise::Keep, "f") => format!("f {mode} {what}"),
                        (Noise::Keep, "l") => format!("l -> {what}"),
                        (Noise::Keep, k) => format!("{k} {mode}"),
                    };
                    items.insert(format!("file {path}"), value);
                }
                ["proc", cmdline] => *procs.entry(cmdline.to_string()).or_default() += 1,
                ["port", port, answer] => {
                    items.insert(format!("port {port}"), answer.to_string());
                }
                _ => return Err(bad()),
            }
        }
        for (cmdline, count) in procs {
            items.insert(format!("proc {cmdline}"), format!("x{count}"));
        }
        Ok(Digest { items })
    }
}

/// One item that differs: its value in the reference and in the other run (`None`: absent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub item: String,
    pub want: Option<String>,
    pub got: Option<String>,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = |v: &Option<String>| v.clone().unwrap_or_else(|| "(absent)".into());
        write!(
            f,
            "{}: want {}, got {}",
            self.item,
            v(&self.want),
            v(&self.got)
        )
    }
}

/// Every item whose value differs between `a` and `b`, in item order.
pub fn differences(a: &Digest, b: &Digest) -> Vec<Difference> {
    let keys: BTreeSet<&String> = a.items.keys().chain(b.items.keys()).collect();
    keys.into_iter()
        .filter(|k| a.items.get(*k) != b.items.get(*k))
        .map(|k| Difference {
            item: k.clone(),
            want: a.items.get(k).cloned(),
            got: b.items.get(k).cloned(),
        })
        .collect()
}

/// A recovered run against the reference: differences in stable items, and how many in items
/// the fault-free runs disagree on were ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Comparison {
    pub differences: Vec<Difference>,
    pub ignored_unstable: usize,
}

pub fn compare(reference: &Digest, got: &Digest, unstable: &BTreeSet<String>) -> Comparison {
    let (ignored, differences): (Vec<_>, Vec<_>) = differences(reference, got)
        .into_iter()
        .partition(|d| unstable.contains(&d.item));
    Comparison {
        differences,
        ignored_unstable: ignored.len(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    Correct,
    Wrong,
    Error,
}

#[derive(Debug, Clone, Serialize)]
pub struct Case {
    pub trial: String,
    pub policy: RecoveryPolicy,
    /// Turns replayed before the crash.
    pub crash_after: usize,
    pub crash: Crash,
    pub turns: usize,
    pub outcome: Outcome,
    pub differences: Vec<Difference>,
    pub ignored_unstable: usize,
    /// From the crash to the recovered sandbox accepting execs (`crabctl recover`, or a fresh
    /// container for chat-only).
    pub recover_ms: f64,
    pub errors: Vec<String>,
    /// Trouble after the digest was taken (removing the sandbox, leaks).
    pub warnings: Vec<String>,
}

/// A turn whose exit status differs between the two fault-free runs (`None`: timed out).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnstableTurn {
    /// Position in the replay (0-based) and the recording's index.
    pub turn: usize,
    pub index: u64,
    pub statuses: [Option<u32>; 2],
}

/// Turns whose exit statuses differ between two runs (compared as far as both got).
pub fn unstable_turns(t: &Trajectory, a: &[Option<u32>], b: &[Option<u32>]) -> Vec<UnstableTurn> {
    a.iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(n, (x, y))| UnstableTurn {
            turn: n,
            index: t.turns.get(n).map(|t| t.index).unwrap_or(n as u64),
            statuses: [*x, *y],
        })
        .collect()
}

/// The fault-free runs of one trajectory.
#[derive(Debug, Clone, Serialize)]
pub struct Reference {
    pub trial: String,
    pub turns: usize,
    pub items: usize,
    /// Items the two fault-free runs disagree on (left out of the comparisons).
    pub unstable: Vec<Difference>,
    /// Turns that ended differently in the two fault-free runs (where the nondeterminism
    /// likely comes from; their items are covered by `unstable`).
    pub unstable_turns: Vec<UnstableTurn>,
    pub errors: Vec<String>,
    pub warnings: Vec<String>,
}

/// Recovered correctly / total for one policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Tally {
    pub correct: usize,
    pub wrong: usize,
    pub errors: usize,
    pub total: usize,
    /// Correct among the cases with differences ignored as nondeterministic.
    pub correct_with_ignored: usize,
    /// correct / total (NaN, `null` in JSON, without cases).
    pub share: f64,
}

pub fn tally(cases: &[Case]) -> BTreeMap<RecoveryPolicy, Tally> {
    let mut out: BTreeMap<RecoveryPolicy, Tally> = BTreeMap::new();
    for c in cases {
        let t = out.entry(c.policy).or_default();
        t.total += 1;
        match c.outcome {
            Outcome::Correct => {
                t.correct += 1;
                if c.ignored_unstable > 0 {
                    t.correct_with_ignored += 1;
                }
            }
            Outcome::Wrong => t.wrong += 1,
            Outcome::Error => t.errors += 1,
        }
    }
    for t in out.values_mut() {
        t.share = if t.total == 0 {
            f64::NAN
        } else {
            t.correct as f64 / t.total as f64
        };
    }
    out
}

#[derive(Debug, Clone)]
pub struct RecoveryOptions {
    pub crash_turns: usize,
    /// Sandboxes at once.
    pub jobs: usize,
    pub policies: Vec<RecoveryPolicy>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RecoveryReport {
    pub references: Vec<Reference>,
    pub cases: Vec<Case>,
    pub tallies: BTreeMap<RecoveryPolicy, Tally>,
    pub wall_s: f64,
}

/// One sandbox run: a fault-free one (`crash` None) or one crashed and recovered.
#[derive(Debug, Clone)]
struct Job {
    trial: usize,
    /// `None`: a fault-free run under `none` (which of the two: `replica`).
    crash: Option<(RecoveryPolicy, usize, Crash)>,
    replica: usize,
}

struct RunResult {
    digest: Option<Digest>,
    recover_ms: f64,
    errors: Vec<String>,
    /// Exit status (None: killed at the timeout) of each turn replayed.
    statuses: Vec<Option<u32>>,
    /// Trouble after the digest (removing the sandbox, leaks): reported, not an outcome.
    warnings: Vec<String>,
}

/// Runs every fault-free and crashed run of `trajectories`, `ro.jobs` sandboxes at once.
pub async fn run(
    trajectories: &[Trajectory],
    opts: &Options,
    ro: &RecoveryOptions,
) -> RecoveryReport {
    let started = Instant::now();
    let mut jobs = Vec::new();
    for (i, _) in trajectories.iter().enumerate() {
        for replica in 0..2 {
            jobs.push(Job {
                trial: i,
                crash: None,
                replica,
            });
        }
    }
    for (i, t) in trajectories.iter().enumerate() {
        let n = t.turns.len().min(opts.max_turns.unwrap_or(usize::MAX));
        for &p in &ro.policies {
            for (at, how) in crash_points(n, ro.crash_turns) {
                jobs.push(Job {
                    trial: i,
                    crash: Some((p, at, how)),
                    replica: 0,
                });
            }
        }
    }
    let total = jobs.len();
    let queue = Arc::new(Mutex::new(jobs.into_iter().enumerate().collect::<Vec<_>>()));
    queue.lock().unwrap().reverse();
    let trajectories: Arc<Vec<Trajectory>> = Arc::new(trajectories.to_vec());
    let mut workers = Vec::new();
    for _ in 0..ro.jobs.max(1) {
        let (queue, trajectories, opts) = (queue.clone(), trajectories.clone(), opts.clone());
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let Some((k, job)) = queue.lock().unwrap().pop() else {
                    break;
                };
                let t = trajectories[job.trial].clone();
                let name = match job.crash {
                    None => format!("recov-ref{}-{k}", job.replica),
                    Some((p, at, _)) => format!("recov-{}-{at}-{k}", p.name()),
                };
                let r = match tokio::spawn(run_one(name, t.clone(), job.crash, opts.clone())).await
                {
                    Ok(r) => r,
                    Err(e) => RunResult {
                        digest: None,
                        recover_ms: f64::NAN,
                        errors: vec![format!("the run panicked: {e}")],
                        statuses: Vec::new(),
                        warnings: Vec::new(),
                    },
                };
                eprintln!(
                    "replay: recovery {}/{total}: {} {}{}",
                    k + 1,
                    t.trial,
                    match job.crash {
                        None => format!("fault-free #{}", job.replica + 1),
                        Some((p, at, how)) => format!("{} crash {how:?} after {at}", p.name()),
                    },
                    r.errors
                        .first()
                        .map(|e| format!(", ERROR: {e}"))
                        .unwrap_or_default()
                );
                out.push((job, r));
            }
            out
        }));
    }
    let mut results = Vec::new();
    for w in workers {
        results.extend(w.await.unwrap_or_default());
    }
    let mut references = Vec::new();
    let mut refs: BTreeMap<usize, (Option<Digest>, BTreeSet<String>)> = BTreeMap::new();
    for (i, t) in trajectories.iter().enumerate() {
        let runs: Vec<&RunResult> = results
            .iter()
            .filter(|(j, _)| j.trial == i && j.crash.is_none())
            .map(|(_, r)| r)
            .collect();
        let digests: Vec<&Digest> = runs.iter().filter_map(|r| r.digest.as_ref()).collect();
        let unstable = match digests.as_slice() {
            [a, b, ..] => differences(a, b),
            _ => Vec::new(),
        };
        let turns_unstable = match runs.as_slice() {
            [a, b, ..] => unstable_turns(t, &a.statuses, &b.statuses),
            _ => Vec::new(),
        };
        let mut errors: Vec<String> = runs.iter().flat_map(|r| r.errors.clone()).collect();
        if digests.len() < 2 {
            errors.push(format!(
                "{} of 2 fault-free runs gave a digest: nondeterminism not measured",
                digests.len()
            ));
        }
        references.push(Reference {
            trial: t.trial.clone(),
            turns: t.turns.len().min(opts.max_turns.unwrap_or(usize::MAX)),
            items: digests.first().map(|d| d.items.len()).unwrap_or(0),
            unstable: unstable.clone(),
            unstable_turns: turns_unstable,
            errors,
            warnings: runs.iter().flat_map(|r| r.warnings.clone()).collect(),
        });
        refs.insert(
            i,
            (
                digests.first().map(|d| (*d).clone()),
                unstable.into_iter().map(|d| d.item).collect(),
            ),
        );
    }
    let mut cases = Vec::new();
    for (job, r) in results {
        let Some((policy, at, how)) = job.crash else {
            continue;
        };
        let t = &trajectories[job.trial];
        let (reference, unstable) = &refs[&job.trial];
        let mut case = Case {
            trial: t.trial.clone(),
            policy,
            crash_after: at,
            crash: how,
            turns: t.turns.len().min(opts.max_turns.unwrap_or(usize::MAX)),
            outcome: Outcome::Error,
            differences: Vec::new(),
            ignored_unstable: 0,
            recover_ms: r.recover_ms,
            errors: r.errors,
            warnings: r.warnings,
        };
        match (reference, &r.digest) {
            (Some(want), Some(got)) if case.errors.is_empty() => {
                let c = compare(want, got, unstable);
                case.outcome = if c.differences.is_empty() {
                    Outcome::Correct
                } else {
                    Outcome::Wrong
                };
                case.differences = c.differences;
                case.ignored_unstable = c.ignored_unstable;
            }
            (None, _) => case
                .errors
                .push("no fault-free digest to compare with".into()),
            _ => {}
        }
        cases.push(case);
    }
    cases.sort_by(|a, b| {
        (a.policy, &a.trial, a.crash_after).cmp(&(b.policy, &b.trial, b.crash_after))
    });
    RecoveryReport {
        tallies: tally(&cases),
        references,
        cases,
        wall_s: started.elapsed().as_secs_f64(),
    }
}

async fn run_one(
    name: String,
    t: Trajectory,
    crash: Option<(RecoveryPolicy, usize, Crash)>,
    opts: Options,
) -> RunResult {
    let policy = crash.map(|c| c.0.sandbox_policy()).unwrap_or(Policy::None);
    let config = format!("{}{}\n", policy.config(), opts.sandbox_config);
    let sandbox_options = || SandboxOptions {
        config: &config,
        ..Default::default()
    };
    let (mut sb, guard) = Sandbox::start(&name, sandbox_options()).await;
    let mut guards: Vec<CleanupGuard> = vec![guard];
    let mut r = RunResult {
        digest: None,
        recover_ms: f64::NAN,
        errors: Vec::new(),
        statuses: Vec::new(),
        warnings: Vec::new(),
    };
    let outcome = async {
        let turns: Vec<&Turn> = t
            .turns
            .iter()
            .take(opts.max_turns.unwrap_or(usize::MAX))
            .collect();
        let mut ready_at = Instant::now();
        for (n, turn) in turns.iter().enumerate() {
            if let Some((rp, at, how)) = crash {
                if n == at {
                    if policy.checkpoints() {
                        // The last checkpoint must be durable before the crash: an exec start
                        // waits for it.
                        exec(&sb, &format!("sync{n}"), "true", Duration::from_secs(180))
                            .await
                            .map_err(|e| {
                                format!("waiting for the checkpoint of t{}: {e}", n - 1)
                            })?;
                    }
                    inject(&sb, how).await?;
                    let t0 = Instant::now();
                    match rp {
                        RecoveryPolicy::ChatOnly => {
                            // A fresh container from the base image; the old one goes (its
                            // guard removes whatever the crash left).
                            let _ = sb.h.kill(&sb.id, "", libc::SIGKILL, true).await;
                            let _ = sb.h.delete_task(&sb.id).await;
                            let _ = sb.h.delete_container(&sb.id).await;
                            let _ = std::fs::remove_dir_all(&sb.state_dir);
                            let (fresh, g) =
                                Sandbox::start(&format!("{name}-fresh"), sandbox_options()).await;
                            sb = fresh;
                            guards.push(g);
                        }
                        _ => {
                            let (code, out, err) =
                                tokio::task::block_in_place(|| sb.crabctl(&["recover", &sb.id]));
                            if code != 0 {
                                return Err(format!(
                                    "crabctl recover after {at} turns ({how:?}): exit {code}: {}{}",
                                    out.trim(),
                                    err.trim()
                                ));
                            }
                        }
                    }
                    r.recover_ms = ms(t0.elapsed());
                    ready_at = Instant::now();
                }
            }
            tokio::time::sleep_until((ready_at + turn.think.mul_f64(opts.think_scale)).into())
                .await;
            let x = exec(&sb, &format!("t{n}"), &turn.cmd, opts.cmd_timeout)
                .await
                .map_err(|e| format!("turn {} (`{}`): {e}", turn.index, first_line(&turn.cmd)))?;
            r.statuses.push(if x.timed_out { None } else { x.status });
            if policy.checkpoints() {
                let annotations =
                    std::collections::HashMap::from([(TURN_END.to_string(), format!("t{n}"))]);
                sb.h.update(&sb.id, None, annotations)
                    .await
                    .map_err(|e| format!("turn end t{n}: {e}"))?;
            }
            ready_at = Instant::now();
        }
        let raw = output(&sb, "digest", &["python3", "-c", DIGEST_SCRIPT]).await?;
        Digest::from_raw(&raw)
    }
    .await;
    match outcome {
        Ok(d) => r.digest = Some(d),
        Err(e) => r.errors.push(e),
    }
    if let Err(e) = sb.h.kill_and_remove(&sb.id).await {
        r.warnings.push(format!("removing the sandbox: {e}"));
    }
    let leaks = sb.h.leaks(&sb.id).await;
    if !leaks.is_empty() {
        r.warnings
            .push(format!("left behind: {}", leaks.join("; ")));
    }
    let _ = std::fs::remove_dir_all(&sb.state_dir);
    if let Err(e) = remove_recovery_images(&sb) {
        r.warnings.push(e);
    }
    drop(guards);
    r
}

/// Removes the internal images `crabctl recover` made for the sandbox (nothing collects them
/// yet, see docs/status.md; a run of the recovery mode makes dozens).
fn remove_recovery_images(sb: &Sandbox) -> Result<(), String> {
    let ctr = crate::ctr::Ctr::new(&sb.h.env);
    let t = Duration::from_secs(30);
    let prefix = format!("crab.local/checkpoint/{}/{}:", sb.h.env.namespace, sb.id);
    let out = tokio::task::block_in_place(|| ctr.run_with(&["images", "ls", "-q"], None, t))
        .map_err(|e| format!("listing images: {e}"))?;
    let refs: Vec<String> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .map(str::to_string)
        .collect();
    if refs.is_empty() {
        return Ok(());
    }
    let mut args = vec!["images".to_string(), "rm".to_string()];
    args.extend(refs);
    match tokio::task::block_in_place(|| ctr.run_with(&args, None, t)) {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!("{}: {}", o.command, o.stderr.trim())),
        Err(e) => Err(format!("removing the recovery images: {e}")),
    }
}

/// Runs `argv` in the sandbox; its stdout (it must exit 0).
async fn output(sb: &Sandbox, exec_id: &str, argv: &[&str]) -> Result<String, String> {
    let t = Duration::from_secs(300);
    let mut io =
        sb.h.stdio(&sb.id, exec_id, StdioOptions::default())
            .map_err(|e| e.to_string())?;
    let spec = ProcessSpec::new(argv).cwd("/app");
    sb.h.exec(&sb.id, exec_id, &spec, &io)
        .await
        .map_err(|e| format!("{exec_id}: {e}"))?;
    sb.h.start(&sb.id, exec_id)
        .await
        .map_err(|e| format!("{exec_id}: {e}"))?;
    let status =
        sb.h.wait(&sb.id, exec_id, t)
            .await
            .map_err(|e| format!("{exec_id}: {e}"))?;
    let (out, err) = tokio::task::block_in_place(|| {
        (
            io.stdout_string(Duration::from_secs(60)),
            io.stderr_string(Duration::from_secs(60)),
        )
    });
    let _ = sb.h.delete_process(&sb.id, exec_id).await;
    let out = out.map_err(|e| format!("{exec_id} stdout: {e}"))?;
    if status != 0 {
        return Err(format!(
            "{exec_id} exited {status}: {}",
            err.unwrap_or_default().trim()
        ));
    }
    Ok(out)
}

/// Crashes the sandbox (see [`Crash`]).
async fn inject(sb: &Sandbox, how: Crash) -> Result<(), String> {
    match how {
        Crash::Processes => {
            sb.h.kill(&sb.id, "", libc::SIGKILL, true)
                .await
                .map_err(|e| format!("SIGKILL of the container's processes: {e}"))?;
            sb.h.wait(&sb.id, "", Duration::from_secs(30))
                .await
                .map_err(|e| format!("waiting for the killed task: {e}"))?;
        }
        Crash::Shim => {
            let shims = crate::host::shim_processes(&sb.id);
            let [shim] = shims.as_slice() else {
                return Err(format!("one shim expected for {}: {shims:?}", sb.id));
            };
            // SAFETY: plain kill(2).
            if unsafe { libc::kill(shim.pid, libc::SIGKILL) } != 0 {
                return Err(format!(
                    "SIGKILL of shim {}: {}",
                    shim.pid,
                    std::io::Error::last_os_error()
                ));
            }
            let gone = std::path::PathBuf::from(format!("/proc/{}", shim.pid));
            for _ in 0..400 {
                if !gone.exists() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }
    Ok(())
}

/// The report's markdown.
pub fn markdown(r: &RecoveryReport) -> String {
    let mut md = String::from(
        "## Recovery correctness\n\nCrash (SIGKILL of the container's processes, or of its shim) after a durable \
         checkpoint, recovery, the remaining turns, then the state digest (files, live processes, listening \
         services' answers; noise rules in `replay/recovery.rs`) against a fault-free run's. Items that differ \
         between two fault-free runs are left out and listed below.\n\n\
         | policy | recovered correctly | wrong | errors | share | of them with nondeterministic items ignored | recovery p50 / max |\n|---|---|---|---|---|---|---|\n",
    );
    for (p, t) in &r.tallies {
        let recover: Vec<f64> = r
            .cases
            .iter()
            .filter(|c| c.policy == *p)
            .map(|c| c.recover_ms)
            .collect();
        let s = crate::bench::stats::Summary::of(&recover);
        md.push_str(&format!(
            "| {} | {}/{} | {} | {} | {:.0}% | {} | {:.0} / {:.0} ms |\n",
            p.name(),
            t.correct,
            t.total,
            t.wrong,
            t.errors,
            t.share * 100.0,
            t.correct_with_ignored,
            s.p50,
            s.max
        ));
    }
    md.push_str("\n### Fault-free runs: nondeterminism\n\n");
    for rf in &r.references {
        md.push_str(&format!(
            "- {} ({} turns, {} items): {} unstable items, turns ending differently: {}{}\n",
            rf.trial,
            rf.turns,
            rf.items,
            rf.unstable.len(),
            if rf.unstable_turns.is_empty() {
                "none".to_string()
            } else {
                rf.unstable_turns
                    .iter()
                    .map(|u| format!("{} ({:?} vs {:?})", u.index, u.statuses[0], u.statuses[1]))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            rf.errors
                .first()
                .map(|e| format!("; ERROR: {e}"))
                .unwrap_or_default()
        ));
        for d in rf.unstable.iter().take(10) {
            md.push_str(&format!("  - {d}\n"));
        }
    }
    let warnings: Vec<String> = r
        .references
        .iter()
        .flat_map(|rf| {
            rf.warnings
                .iter()
                .map(move |w| format!("{} fault-free: {w}", rf.trial))
        })
        .chain(r.cases.iter().flat_map(|c| {
            c.warnings.iter().map(move |w| {
                format!(
                    "{} {} after {}: {w}",
                    c.policy.name(),
                    c.trial,
                    c.crash_after
                )
            })
        }))
        .collect();
    if !warnings.is_empty() {
        md.push_str(&format!("\n### Cleanup warnings ({})\n\n", warnings.len()));
        for w in warnings.iter().take(20) {
            md.push_str(&format!("- {w}\n"));
        }
    }
    let failing: Vec<&Case> = r
        .cases
        .iter()
        .filter(|c| c.outcome != Outcome::Correct)
        .collect();
    md.push_str(&format!("\n### Failing cases ({})\n\n", failing.len()));
    for c in failing {
        md.push_str(&format!(
            "- {} {} crash {:?} after {}/{} turns: {}{}\n",
            c.policy.name(),
            c.trial,
            c.crash,
            c.crash_after,
            c.turns,
            match c.outcome {
                Outcome::Error => "error".to_string(),
                _ => format!("{} items differ", c.differences.len()),
            },
            c.errors
                .first()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        ));
        for d in c.differences.iter().take(5) {
            md.push_str(&format!("  - {d}\n"));
        }
        if c.differences.len() > 5 {
            md.push_str(&format!("  - ... and {} more\n", c.differences.len() - 5));
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(items: &[(&str, &str)]) -> Digest {
        Digest {
            items: items
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn noise_rules() {
        for p in [
            "/app/__pycache__/x.cpython-313.pyc",
            "/app/pkg/mod.pyc",
            "/root/.cache/pip/http/abc",
            "/app/.pytest_cache/v/cache/nodeids",
            "/tmp/tmpa8x7q2",
            "/tmp/tmpa8x7q2/file",
            "/tmp/pip-build-env-1/x",
            "/var/tmp/tmpzz",
            "/app/repo/.git/objects/ab/cdef",
            "/app/.git/logs/HEAD",
            "/root/.bash_history",
            "/etc/hosts",
            "/etc/resolv.conf",
        ] {
            assert_eq!(noise(p), Noise::Drop, "{p}");
        }
        for p in [
            "/app/.git/index",
            "/app/.git/HEAD",
            "/app/.git/refs/heads/master",
            "/app/api.log",
            "/app/nohup.out",
        ] {
            assert_eq!(noise(p), Noise::Exists, "{p}");
        }
        for p in [
            "/app/kv.py",
            "/app",
            "/tmp/whl/x.whl",
            "/tmp/mytmp",
            "/app/tmpfile",
            "/etc/passwd",
            "/app/gitignore",
            "/usr/local/lib/python3.13/dist-packages/crabdemo/__init__.py",
        ] {
            assert_eq!(noise(p), Noise::Keep, "{p}");
        }
    }

    #[test]
    fn digest_from_raw_applies_noise_and_counts_processes() {
        let raw = "file\t/app\td\t755\t-\t-\n\
                   file\t/app/a.txt\tf\t644\t3\tabc123\n\
                   file\t/usr/bin/ls\tf\t755\t1000\t-\n\
                   file\t/app/api.log\tf\t644\t55\tfff\n\
                   file\t/app/__pycache__/m.pyc\tf\t644\t9\tddd\n\
                   file\t/app/l\tl\t777\t-\ta.txt\n\
                   proc\tsleep infinity\n\
                   proc\tpython3 kv.py\n\
                   proc\tpython3 kv.py\n\
                   port\ttcp/9000\tHTTP/1.0 200 OK body sha256:0123\n";
        let got = Digest::from_raw(raw).unwrap();
        assert_eq!(
            got,
            d(&[
                ("file /app", "d 755"),
                ("file /app/a.txt", "f 644 abc123"),
                ("file /usr/bin/ls", "f 755 size 1000"),
                ("file /app/api.log", "f"),
                ("file /app/l", "l -> a.txt"),
                ("proc sleep infinity", "x1"),
                ("proc python3 kv.py", "x2"),
                ("port tcp/9000", "HTTP/1.0 200 OK body sha256:0123"),
            ])
        );
        assert!(Digest::from_raw("file\tonly\ttwo").is_err());
        assert!(Digest::from_raw("what\tever").is_err());
        assert_eq!(Digest::from_raw("").unwrap(), Digest::default());
    }

    #[test]
    fn comparison_ignores_only_unstable_items() {
        let want = d(&[
            ("file /app/a", "f 644 1"),
            ("file /app/t", "f 644 x"),
            ("proc srv", "x1"),
        ]);
        let got = d(&[
            ("file /app/a", "f 644 1"),
            ("file /app/t", "f 644 y"),
            ("file /app/new", "f 644 2"),
        ]);
        let diffs = differences(&want, &got);
        assert_eq!(
            diffs.iter().map(|d| d.item.as_str()).collect::<Vec<_>>(),
            ["file /app/new", "file /app/t", "proc srv"]
        );
        assert_eq!(diffs[0].want, None);
        assert_eq!(diffs[2].got, None);
        let unstable: BTreeSet<String> = ["file /app/t".to_string()].into();
        let c = compare(&want, &got, &unstable);
        assert_eq!(c.ignored_unstable, 1);
        assert_eq!(c.differences.len(), 2);
        let c = compare(&want, &want, &unstable);
        assert!(c.differences.is_empty() && c.ignored_unstable == 0);
        assert_eq!(diffs[2].to_string(), "proc srv: want x1, got (absent)");
    }

    #[test]
    fn crash_points_spread_and_alternate() {
        assert_eq!(
            crash_points(13, 3),
            [
                (3, Crash::Processes),
                (7, Crash::Shim),
                (10, Crash::Processes)
            ]
        );
        assert_eq!(
            crash_points(9, 2),
            [(3, Crash::Processes), (6, Crash::Shim)]
        );
        // Never before the first turn or after the last; no duplicates.
        assert_eq!(crash_points(2, 3), [(1, Crash::Processes)]);
        assert!(crash_points(1, 3).is_empty());
        assert!(crash_points(10, 0).is_empty());
        for (n, k) in [(5, 8), (30, 4)] {
            let c = crash_points(n, k);
            assert!(c.iter().all(|(at, _)| (1..n).contains(at)), "{c:?}");
            assert!(c.windows(2).all(|w| w[0].0 < w[1].0), "{c:?}");
        }
    }

    #[test]
    fn turns_ending_differently() {
        let t = synthetic();
        let u = unstable_turns(
            &t,
            &[Some(0), Some(1), None, Some(0)],
            &[Some(0), Some(2), None],
        );
        assert_eq!(
            u,
            [UnstableTurn {
                turn: 1,
                index: 1,
                statuses: [Some(1), Some(2)]
            }]
        );
        assert!(unstable_turns(&t, &[], &[Some(0)]).is_empty());
        assert_eq!(
            unstable_turns(&t, &[None], &[Some(0)])[0].statuses,
            [None, Some(0)]
        );
    }

    fn case(policy: RecoveryPolicy, outcome: Outcome, ignored: usize) -> Case {
        Case {
            trial: "t".into(),
            policy,
            crash_after: 1,
            crash: Crash::Shim,
            turns: 3,
            outcome,
            differences: Vec::new(),
            ignored_unstable: ignored,
            recover_ms: 1.0,
            errors: Vec::new(),
            warnings: Vec::new(),
        }
    }

    #[test]
    fn tallies_per_policy() {
        use RecoveryPolicy::*;
        let cases = [
            case(Crab, Outcome::Correct, 0),
            case(Crab, Outcome::Correct, 2),
            case(ChatOnly, Outcome::Wrong, 0),
            case(ChatOnly, Outcome::Correct, 0),
            case(ChatOnly, Outcome::Error, 0),
            case(ChatOnly, Outcome::Wrong, 0),
        ];
        let t = tally(&cases);
        assert_eq!(t[&Crab].correct, 2);
        assert_eq!(t[&Crab].correct_with_ignored, 1);
        assert_eq!(t[&Crab].share, 1.0);
        let c = t[&ChatOnly];
        assert_eq!((c.correct, c.wrong, c.errors, c.total), (1, 2, 1, 4));
        assert_eq!(c.share, 0.25);
        assert!(!t.contains_key(&FsEveryTurn));
    }

    #[test]
    fn policies_by_name_and_synthetic_trajectory() {
        for p in RecoveryPolicy::ALL {
            assert_eq!(RecoveryPolicy::from_name(p.name()), Some(p));
        }
        assert_eq!(RecoveryPolicy::from_name("none"), None);
        assert_eq!(RecoveryPolicy::ChatOnly.sandbox_policy(), Policy::None);
        assert!(!RecoveryPolicy::ChatOnly.sandbox_policy().checkpoints());
        let s = synthetic();
        assert_eq!(s.trial, SYNTHETIC_TRIAL);
        assert!(s.turns.len() >= 6);
        assert!(DIGEST_SCRIPT.contains("def procs"));
    }
}
