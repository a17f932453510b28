//! The host engine: the checkpoint jobs of every sandbox on the host go through one bounded
//! scheduler, without a daemon of its own.
//!
//! Shims are separate processes (one per container or pod), so the scheduler is a directory
//! they share (`[engine] root`, default `/run/crab/engine`, a tmpfs) and the kernel's `flock`:
//!
//! - `slots/<i>`, `i < max_jobs`: a job runs while it holds the lock of one slot file. A shim
//!   that dies (SIGKILL included) loses its locks with its file descriptors, so no slot stays
//!   taken. The holder describes itself in `slots/<i>.json` (for `crabctl engine`; it may be
//!   stale, only the lock says whether the slot is taken).
//! - `queue/<ticket>`: one file per waiting job (sandbox, job, enqueue time, urgent), locked by
//!   its waiter; a ticket whose lock is free belongs to a dead shim and is removed by whoever
//!   sees it. `queue/<ticket>.urgent` marks a ticket urgent after it entered the queue.
//! - Order ([`plan`]): urgent tickets first (a ticket is urgent when its sandbox's next action
//!   already waits for the job: [`Admission::urgent`]), then by enqueue time (the host's
//!   monotonic clock) plus the sandbox's recent use of the slots ([`plan::Usage`], in
//!   `usage.json`: slot time, halved every [`USAGE_HALF_LIFE`], at most [`MAX_PENALTY`]). A
//!   job takes a slot only while it is among the first `free slots` of that order. So among
//!   sandboxes that wait at the same time, the one that used the slots least goes first: a
//!   sandbox whose jobs write huge layers, or keep running into their deadline, waits behind
//!   the others instead of taking turns with them, and never for longer than its penalty. A
//!   sandbox has at most one job at a time (the coordinator coalesces turn ends that arrive
//!   while its job runs or waits).
//! - Deadlines: a job waits at most `[engine] wait_timeout_ms` for a slot
//!   ([`EngineError::WaitTimeout`], naming the slots' holders; the coordinator records the
//!   turn `failed`), and holds it at most `job_timeout_ms` (enforced by the coordinator, which
//!   kills `runc checkpoint` and CRIU and thaws the container; [`Admission::job_timeout`]).
//! - Permissions: the root and its directories are `0700`, its files `0600` (an existing root
//!   is tightened). Anyone who could open a slot file could `flock` it and stall every
//!   sandbox's checkpoints until the wait deadline; a sandbox that sees the host's `/run`
//!   as root is beyond what permissions can stop, and the deadlines bound what it can do.
//! - Waiting, without polling: a job among the first `max_jobs` of the order (a contender)
//!   sleeps in poll(2) on the bells of the slots; any other job sleeps on the bell of the
//!   ticket `max_jobs` places ahead of it. So a job that leaves the queue wakes exactly one
//!   waiter (the one that may now contend), a released slot wakes at most `max_jobs`, and the
//!   jobs further back use no CPU at all however long the queue. A bell (`bells/t-<ticket>`,
//!   `bells/s-<slot>`) is a FIFO its owner holds open for writing while it owns the ticket or
//!   the slot: poll(2) reports POLLHUP to a reader once no writer is left, when the owner closes
//!   it or dies. No inotify: a host allows 128 inotify instances per user by default, fewer
//!   than the shims it runs, and a waiter without one had to poll (at 1,000 sandboxes the
//!   waiters' polling starved the running checkpoints). The order of two queued tickets never
//!   changes (a sandbox's penalty is fixed when its ticket enters the queue) except when one is
//!   made urgent, and then its own waiter is woken ([`Waker`]): a sleeper's ticket is always
//!   behind the one it sleeps on, so no two waiters ever wait for each other. Whoever finds a
//!   dead shim's ticket removes it. A contender looks again every [`FALLBACK_POLL`] and a
//!   sleeper every [`BLOCKED_RECHECK`] at the latest, for what rings no bell (a shim that died
//!   holding a slot before it opened the slot's bell, a shim of an older crab). With nothing
//!   queued and a slot free, admission is a handful of syscalls, and a released slot reaches
//!   the next job at once (the `idle_admission_is_fast` and
//!   `a_released_slot_passes_to_the_next_job_at_once` tests print their timings). The root
//!   belongs on a tmpfs, as `/run` normally is.
//! - I/O budget (`io_budget_mb_s`): a token bucket shared by the host (`budget.json`), applied
//!   at admission: a job is admitted only while the bucket is not in debt, and a job's written
//!   bytes (given to [`Permit::finish`]: its layer plus its process image as CRIU wrote it) are
//!   debited when it ends. The bucket refills at the budget and holds at most one second of
//!   it. So a running job is never slowed (its freeze must stay short), and over any interval
//!   `t` the jobs started write at most `budget * (t + 1 s)` plus what the jobs running at the
//!   end still write (at most `max_jobs` jobs). The budget applies to urgent jobs too: urgency
//!   changes the order, not the budget.
//! - Stats (`stats.json`, rewritten atomically under `state.lock` by each job that ends): jobs,
//!   waits (total, max, the newest [`WAIT_SAMPLES`] for percentiles), bytes, run time, and the
//!   newest [`RECENT_JOBS`] jobs one by one. `crabctl engine` shows them with the slots and
//!   the queue ([`Engine::snapshot`]).
//!
//! The engine fails open: a job whose admission fails (the root not writable, say) runs
//! anyway and the failure is logged; a broken scheduler must not cost a recovery point.

use std::{
    collections::{HashMap, HashSet},
    fs::{self, File, OpenOptions},
    io::{self, Read, Write},
    os::{fd::AsFd, unix::fs::OpenOptionsExt},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use crab_runtime_config::EngineConfig;
use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
    poll::{PollFd, PollFlags, PollTimeout},
    sys::{
        eventfd::{EfdFlags, EventFd},
        stat::Mode,
    },
};

mod files;
pub mod plan;
mod records;

pub use files::*;
pub use records::*;

/// How often a contender looks again without a bell (see the module docs).
pub const FALLBACK_POLL: Duration = Duration::from_millis(100);
/// How often a job further back looks again without a bell.
pub const BLOCKED_RECHECK: Duration = Duration::from_secs(5);
/// How soon a job that was entitled to a slot but lost the race for it tries again.
const RETRY: Duration = Duration::from_millis(1);
/// Restores by outcome (`crabctl metrics`).
const RESTORES: &str = "restores.json";
/// A sandbox's recorded slot time halves in this long.
pub const USAGE_HALF_LIFE: Duration = Duration::from_secs(30);
/// The most a sandbox's recent slot time delays its next job in the order.
pub const MAX_PENALTY: Duration = Duration::from_secs(60);
/// At most this many sandboxes are remembered in `usage.json` (the most used ones).
const USAGE_ENTRIES: usize = 4096;

/// One host engine (a root directory and this shim's settings for it).
#[derive(Debug, Clone)]
pub struct Engine {
    root: PathBuf,
    max_jobs: u32,
    /// Bytes per second.
    budget: Option<f64>,
    wait_timeout: Duration,
    job_timeout: Duration,
    /// How many times this process's waiters read the queue (tests count them).
    looks: Arc<AtomicU64>,
}

impl Engine {
    pub fn new(c: &EngineConfig) -> Engine {
        Engine {
            root: c.root.clone(),
            max_jobs: c.max_jobs,
            budget: c.io_budget_mb_s.map(|mb| f64::from(mb) * 1e6),
            wait_timeout: Duration::from_millis(c.wait_timeout_ms),
            job_timeout: Duration::from_millis(c.job_timeout_ms),
            looks: Arc::default(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn queue_dir(&self) -> PathBuf {
        self.root.join("queue")
    }

    fn slots_dir(&self) -> PathBuf {
        self.root.join("slots")
    }

    fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    fn slot(&self, i: u32) -> PathBuf {
        self.slots_dir().join(i.to_string())
    }

    fn bells_dir(&self) -> PathBuf {
        self.root.join("bells")
    }

    /// The bell of a ticket (see the module docs).
    fn ticket_bell(&self, ticket: &str) -> PathBuf {
        self.bells_dir().join(format!("t-{ticket}"))
    }

    /// The bell of a slot.
    fn slot_bell(&self, i: u32) -> PathBuf {
        self.bells_dir().join(format!("s-{i}"))
    }

    fn usage_path(&self) -> PathBuf {
        self.root.join("usage.json")
    }

    /// The root and its directories, `0700` (an existing one that is wider is tightened).
    fn ensure_dirs(&self) -> Result<()> {
        if let Some(parent) = self.root.parent() {
            fs::create_dir_all(parent).map_err(io_err("create", parent))?;
        }
        for dir in [
            self.root.clone(),
            self.queue_dir(),
            self.slots_dir(),
            self.bells_dir(),
            self.tmp_dir(),
        ] {
            ensure_private_dir(&dir)?;
        }
        Ok(())
    }

    /// Writes `data` to `path` atomically (a temp file renamed; no fsync: a tmpfs).
    fn write_atomic(&self, path: &Path, data: &[u8]) -> Result<()> {
        let tmp = self.tmp_dir().join(unique("w-"));
        let written = private_file(OpenOptions::new().write(true).create_new(true))
            .open(&tmp)
            .and_then(|mut f| f.write_all(data));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("write", &tmp)(e));
        }
        fs::rename(&tmp, path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err("publish", path)(e)
        })
    }

    /// Queues a job of `sandbox`; [`Ticket::wait`] waits for its slot.
    pub fn enqueue(
        &self,
        sandbox: &str,
        namespace: &str,
        job: &str,
        urgent: bool,
    ) -> Result<Ticket> {
        self.ensure_dirs()?;
        let name = unique("");
        let enqueued_ns = name[..20].parse().unwrap_or_else(|_| mono_ns());
        let penalty = self
            .usage()
            .get(&usage_key(namespace, sandbox))
            .map_or(Duration::ZERO, |u| {
                u.penalty(enqueued_ns, USAGE_HALF_LIFE, MAX_PENALTY)
            });
        let info = TicketInfo {
            sandbox: sandbox.to_string(),
            namespace: namespace.to_string(),
            job: job.to_string(),
            pid: std::process::id(),
            enqueued_ns,
            enqueued_unix_ms: unix_ms(),
            urgent,
            penalty_ns: Some(penalty.as_nanos() as u64),
        };
        let wake = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| io_err("create eventfd", &self.root)(e.into()))?;
        // Held before the ticket is queued: whoever sees the ticket may sleep on its bell.
        let bell_path = self.ticket_bell(&name);
        let bell = hold_bell(&bell_path).map_err(io_err("create bell", &bell_path))?;
        // Locked and complete before it enters the queue: a ticket in the queue without a lock
        // is a dead shim's.
        let tmp = self.tmp_dir().join(format!("t-{name}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&tmp)
            .map_err(io_err("create ticket", &tmp))?;
        let path = self.queue_dir().join(&name);
        let result = (|| {
            let Ok(mut file) = try_lock(file, FlockArg::LockExclusiveNonblock)
                .map_err(io_err("lock ticket", &tmp))?
            else {
                return Err(io_err("lock ticket", &tmp)(
                    io::ErrorKind::WouldBlock.into(),
                ));
            };
            let json = serde_json::to_vec(&info).expect("ticket serializes");
            file.write_all(&json)
                .map_err(io_err("write ticket", &tmp))?;
            fs::rename(&tmp, &path).map_err(io_err("queue ticket", &path))?;
            Ok(file)
        })();
        let file = match result {
            Ok(file) => file,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                let _ = fs::remove_file(&bell_path);
                return Err(e);
            }
        };
        Ok(Ticket {
            engine: self.clone(),
            name,
            path,
            file: Some(file),
            bell: Some(bell),
            wake: Arc::new(wake),
            info,
        })
    }

    /// The tickets in the order jobs will start. With `probe` (a snapshot), only the live ones
    /// and nothing is changed; without, every ticket listed (each waiter probes those that
    /// matter to it: [`Engine::ticket_alive`]) and markers that outlived their ticket are
    /// removed. `own` is a ticket this process holds; `cache` keeps the tickets already read
    /// (a ticket is never rewritten).
    fn read_queue(
        &self,
        own: Option<&str>,
        cache: &mut HashMap<String, TicketInfo>,
        probe: bool,
    ) -> Result<Vec<(plan::Queued, TicketInfo)>> {
        let dir = self.queue_dir();
        let mut tickets = Vec::new();
        let mut markers = HashSet::new();
        let entries = match fs::read_dir(&dir) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("list", &dir)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(io_err("list", &dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            match name.strip_suffix(".urgent") {
                Some(ticket) => {
                    markers.insert(ticket.to_string());
                }
                None => tickets.push(name),
            }
        }
        let listed: HashSet<&str> = tickets.iter().map(String::as_str).collect();
        cache.retain(|name, _| listed.contains(name.as_str()));
        let mut live = Vec::new();
        for name in &tickets {
            let path = dir.join(name);
            if own != Some(name.as_str()) && (probe || !cache.contains_key(name)) {
                let mut file = match File::open(&path) {
                    Ok(f) => f,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io_err("open ticket", &path)(e)),
                };
                if probe {
                    match try_lock(file, FlockArg::LockSharedNonblock)
                        .map_err(io_err("probe ticket", &path))?
                    {
                        Ok(_free) => continue,
                        Err(held) => file = held,
                    }
                }
                if !cache.contains_key(name) {
                    let mut data = Vec::new();
                    file.read_to_end(&mut data)
                        .map_err(io_err("read ticket", &path))?;
                    match serde_json::from_slice(&data) {
                        Ok(info) => {
                            cache.insert(name.clone(), info);
                        }
                        Err(e) => {
                            // Ours are complete before they are queued: not in the order, so
                            // nobody else would ever probe it.
                            if !probe {
                                // Removed while the lock is ours.
                                if let Ok(Ok(_free)) = try_lock(file, FlockArg::LockSharedNonblock)
                                {
                                    let _ = fs::remove_file(&path);
                                }
                            }
                            log::warn!("engine: unreadable ticket {}: {e}", path.display());
                            continue;
                        }
                    }
                }
            }
            if let Some(info) = cache.get(name) {
                live.push((name.clone(), info.clone()));
            }
        }
        if !probe {
            for orphan in markers.iter().filter(|m| !listed.contains(m.as_str())) {
                let _ = fs::remove_file(dir.join(format!("{orphan}.urgent")));
            }
        }
        // Tickets of an older crab carry no penalty: theirs is computed now.
        let now = mono_ns();
        let usage = match live.iter().any(|(_, i)| i.penalty_ns.is_none()) {
            true => self.usage(),
            false => HashMap::new(),
        };
        let mut order: Vec<plan::Queued> = live
            .iter()
            .map(|(name, info)| plan::Queued {
                name: name.clone(),
                enqueued_ns: info.enqueued_ns,
                urgent: info.urgent || markers.contains(name),
                penalty_ns: info.penalty_ns.unwrap_or_else(|| {
                    usage
                        .get(&usage_key(&info.namespace, &info.sandbox))
                        .map_or(0, |u| {
                            u.penalty(now, USAGE_HALF_LIFE, MAX_PENALTY).as_nanos() as u64
                        })
                }),
            })
            .collect();
        plan::order(&mut order);
        let mut by_name: HashMap<String, TicketInfo> = live.into_iter().collect();
        Ok(order
            .into_iter()
            .filter_map(|q| by_name.remove(&q.name).map(|i| (q, i)))
            .collect())
    }

    /// Whether the ticket `name` still waits: `false` once it left the queue or its shim died
    /// (its lock is free: then the ticket, its marker and its bell are removed).
    fn ticket_alive(&self, name: &str, cache: &mut HashMap<String, TicketInfo>) -> Result<bool> {
        let path = self.queue_dir().join(name);
        match is_locked(&path).map_err(io_err("probe ticket", &path))? {
            Some(true) => Ok(true),
            None => Ok(false),
            Some(false) => {
                log::info!(
                    "engine: removing the ticket of a dead shim: {}",
                    path.display()
                );
                let _ = fs::remove_file(&path);
                let _ = fs::remove_file(marker_of(&path));
                let _ = fs::remove_file(self.ticket_bell(name));
                cache.remove(name);
                Ok(false)
            }
        }
    }

    /// Sleeps on the bell of the queued ticket `ahead` until it leaves (or its shim dies), `wake`
    /// is rung, or `timeout`. Whether the bell rang.
    fn sleep_behind(
        &self,
        ahead: &str,
        wake: &EventFd,
        timeout: Duration,
        cache: &mut HashMap<String, TicketInfo>,
    ) -> Result<bool> {
        let bell_path = self.ticket_bell(ahead);
        // Opened before the probe: if the ticket is alive after, its owner still holds the bell
        // and closes it after this look (see `listen`).
        let bell = listen(&bell_path).map_err(io_err("open bell", &bell_path))?;
        if !self.ticket_alive(ahead, cache)? {
            return Ok(false);
        }
        Ok(match bell {
            Some(bell) => sleep_on(&[bell], wake, timeout),
            // A ticket of an older crab, or one being queued: no bell to sleep on.
            None => sleep_on(&[], wake, timeout.min(FALLBACK_POLL)),
        })
    }

    /// The bells of this config's slots, open for listening (those that exist).
    fn slot_bells(&self) -> Vec<File> {
        (0..self.max_jobs)
            .filter_map(|i| listen(&self.slot_bell(i)).ok().flatten())
            .collect()
    }

    /// Which of this config's slots are free.
    fn free_slots(&self) -> Result<Vec<u32>> {
        let mut free = Vec::new();
        for i in 0..self.max_jobs {
            let path = self.slot(i);
            // Read-only: closing a file opened for writing in `slots/` wakes every waiter.
            let locked = match is_locked(&path).map_err(io_err("probe slot", &path))? {
                Some(locked) => locked,
                None => {
                    private_file(OpenOptions::new().create(true).append(true))
                        .open(&path)
                        .map_err(io_err("create slot", &path))?;
                    false
                }
            };
            if !locked {
                free.push(i);
            }
        }
        Ok(free)
    }

    fn take_slot(&self, i: u32) -> Result<Option<Flock<File>>> {
        let path = self.slot(i);
        let file = File::open(&path).map_err(io_err("open slot", &path))?;
        Ok(try_lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(io_err("lock slot", &path))?
            .ok())
    }

    fn read_bucket(&self, rate: f64) -> plan::Bucket {
        fs::read(self.root.join("budget.json"))
            .ok()
            .and_then(|d| serde_json::from_slice(&d).ok())
            .unwrap_or_else(|| plan::Bucket::full(rate, mono_ns()))
    }

    fn budget_wait(&self) -> Duration {
        match self.budget {
            Some(rate) => self.read_bucket(rate).wait(rate, mono_ns()),
            None => Duration::ZERO,
        }
    }

    /// Each sandbox's recent use of the slots (empty if none was written or it is unreadable).
    fn usage(&self) -> HashMap<String, plan::Usage> {
        fs::read(self.usage_path())
            .ok()
            .and_then(|d| serde_json::from_slice(&d).ok())
            .unwrap_or_default()
    }

    /// Takes `state.lock` (released when the file is dropped).
    fn lock_state(&self) -> Result<Flock<File>> {
        let lock_path = self.root.join("state.lock");
        let lock = private_file(OpenOptions::new().create(true).append(true))
            .open(&lock_path)
            .map_err(io_err("open", &lock_path))?;
        Flock::lock(lock, FlockArg::LockExclusive)
            .map_err(|(_, e)| io_err("lock", &lock_path)(e.into()))
    }

    /// Counts a restore of a container from a checkpoint (`restores.json`, host-wide, for
    /// `crabctl metrics`): `ok` once its processes run again (or, without a process image,
    /// once it is created from the checkpoint), failed when its create or start failed.
    pub fn count_restore(&self, ok: bool) -> Result<()> {
        self.ensure_dirs()?;
        let _lock = self.lock_state()?;
        let mut counts = self.restores();
        match ok {
            true => counts.ok = counts.ok.saturating_add(1),
            false => counts.failed = counts.failed.saturating_add(1),
        }
        let json = serde_json::to_vec(&counts).expect("counts serialize");
        self.write_atomic(&self.root.join(RESTORES), &json)
    }

    /// The restores counted so far (none if none were or the file is unreadable).
    pub fn restores(&self) -> crate::metrics::Restores {
        fs::read(self.root.join(RESTORES))
            .ok()
            .and_then(|d| serde_json::from_slice(&d).ok())
            .unwrap_or_default()
    }

    /// Records a finished job: stats, its sandbox's slot time, and the budget's debit.
    fn record(&self, r: JobRecord) -> Result<()> {
        let _lock = self.lock_state()?;
        if let Some(rate) = self.budget {
            let mut bucket = self.read_bucket(rate);
            bucket.debit(rate, mono_ns(), r.bytes);
            let json = serde_json::to_vec(&bucket).expect("bucket serializes");
            self.write_atomic(&self.root.join("budget.json"), &json)?;
        }
        let now = mono_ns();
        let mut usage = self.usage();
        usage
            .entry(usage_key(&r.namespace, &r.sandbox))
            .or_default()
            .charge(now, r.run_us, USAGE_HALF_LIFE);
        // Sandboxes whose use has faded no longer matter; the map stays small.
        usage.retain(|_, u| u.decayed(now, USAGE_HALF_LIFE) >= 1000.0);
        if usage.len() > USAGE_ENTRIES {
            let mut by_use: Vec<(String, plan::Usage)> = usage.drain().collect();
            by_use.sort_by(|a, b| {
                b.1.decayed(now, USAGE_HALF_LIFE)
                    .total_cmp(&a.1.decayed(now, USAGE_HALF_LIFE))
            });
            by_use.truncate(USAGE_ENTRIES);
            usage = by_use.into_iter().collect();
        }
        let json = serde_json::to_vec(&usage).expect("usage serializes");
        self.write_atomic(&self.usage_path(), &json)?;
        let mut stats = self.stats();
        stats.record(r);
        let json = serde_json::to_vec(&stats).expect("stats serialize");
        self.write_atomic(&self.root.join("stats.json"), &json)
    }

    fn record_or_warn(&self, r: Option<JobRecord>) {
        if let Some(Err(e)) = r.map(|r| self.record(r)) {
            log::warn!("engine: cannot record a job: {e}");
        }
    }

    /// The cumulative stats (empty if none were written yet or they are unreadable).
    pub fn stats(&self) -> Stats {
        fs::read(self.root.join("stats.json"))
            .ok()
            .and_then(|d| serde_json::from_slice(&d).ok())
            .unwrap_or_default()
    }

    /// Who holds the slots, for a job that gave up waiting.
    fn describe_holders(&self) -> String {
        let slots = match self.snapshot() {
            Ok(s) => s.slots,
            Err(e) => return format!("the slots cannot be read: {e}"),
        };
        let held: Vec<String> = slots
            .iter()
            .filter_map(|s| {
                let h = s.holder.as_ref()?;
                Some(match h.pid {
                    // A lock without a holder record: not taken by a crab job.
                    0 => format!(
                        "slot {} is locked by a process that is not a crab job",
                        s.index
                    ),
                    pid => format!(
                        "slot {} is held by {}/{} job {} (pid {pid}) since {} ms ago",
                        s.index,
                        h.namespace,
                        h.sandbox,
                        h.job,
                        unix_ms().saturating_sub(h.since_unix_ms)
                    ),
                })
            })
            .collect();
        match held.is_empty() {
            true => "the slots went to jobs ahead of it in the queue".into(),
            false => held.join("; "),
        }
    }

    /// The slots, the queue and the stats, without changing anything.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut indices: Vec<u32> = (0..self.max_jobs).collect();
        // Shims with a larger max_jobs may use more slots.
        if let Ok(entries) = fs::read_dir(self.slots_dir()) {
            for e in entries.flatten() {
                if let Ok(i) = e.file_name().to_string_lossy().parse::<u32>() {
                    if !indices.contains(&i) {
                        indices.push(i);
                    }
                }
            }
        }
        indices.sort_unstable();
        let mut slots = Vec::new();
        for index in indices {
            let path = self.slot(index);
            let taken = is_locked(&path).map_err(io_err("probe slot", &path))?;
            let holder = (taken == Some(true)).then(|| {
                fs::read(path.with_extension("json"))
                    .ok()
                    .and_then(|d| serde_json::from_slice(&d).ok())
                    .unwrap_or(SlotHolder {
                        sandbox: "?".into(),
                        namespace: "?".into(),
                        job: "?".into(),
                        pid: 0,
                        urgent: false,
                        since_unix_ms: 0,
                        waited_us: 0,
                    })
            });
            slots.push(SlotView { index, holder });
        }
        let now = mono_ns();
        let queue = self
            .read_queue(None, &mut HashMap::new(), true)?
            .into_iter()
            .map(|(q, info)| QueuedView {
                waiting_us: now.saturating_sub(info.enqueued_ns) / 1000,
                ticket: q.name,
                urgent: q.urgent,
                info,
            })
            .collect();
        Ok(Snapshot {
            root: self.root.clone(),
            max_jobs: self.max_jobs,
            io_budget_bytes_s: self.budget.map(|b| b as u64),
            budget_level: self
                .budget
                .map(|rate| self.read_bucket(rate).level(rate, now)),
            slots,
            queue,
            stats: self.stats(),
        })
    }
}

/// A queued job. Dropping it leaves the queue.
pub struct Ticket {
    engine: Engine,
    name: String,
    path: PathBuf,
    /// Holds the ticket's lock: the ticket is alive while it is open.
    file: Option<Flock<File>>,
    /// Held open for writing while the ticket waits: closing it wakes the job behind.
    bell: Option<File>,
    /// Rung when the ticket is made urgent ([`Waker`]).
    wake: Arc<EventFd>,
    info: TicketInfo,
}

impl Ticket {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What makes this ticket urgent while it waits.
    pub fn waker(&self) -> Waker {
        Waker {
            marker: marker_of(&self.path),
            wake: self.wake.clone(),
        }
    }

    /// Blocks until the job may run: it holds a slot, nobody before it in the queue waits for
    /// one, and the budget is not in debt. Gives up ([`EngineError::WaitTimeout`]) once the
    /// ticket has waited `[engine] wait_timeout_ms`. Sleeps in between (see the module docs).
    pub fn wait(self) -> Result<Permit> {
        let deadline_ns = self
            .info
            .enqueued_ns
            .saturating_add(self.engine.wait_timeout.as_nanos() as u64);
        let mut cache = HashMap::from([(self.name.clone(), self.info.clone())]);
        let contenders = self.engine.max_jobs.max(1) as usize;
        // The ticket whose bell rang last: a dying shim's files are released in no set order,
        // so its bell may ring while its lock still looks held, and then never ring again.
        let mut rang: Option<String> = None;
        loop {
            let Some(left) = plan::remaining(deadline_ns, mono_ns()) else {
                return Err(EngineError::WaitTimeout {
                    waited: Duration::from_nanos(mono_ns().saturating_sub(self.info.enqueued_ns)),
                    holders: self.engine.describe_holders(),
                });
            };
            self.engine.looks.fetch_add(1, Ordering::Relaxed);
            let queue = self
                .engine
                .read_queue(Some(&self.name), &mut cache, false)?;
            let Some(rank) = queue.iter().position(|(q, _)| q.name == self.name) else {
                return Err(EngineError::TicketLost(self.path.clone()));
            };
            if rank >= contenders {
                let ahead = &queue[rank - contenders].0.name;
                let timeout = match rang.as_deref() == Some(ahead.as_str()) {
                    true => FALLBACK_POLL,
                    false => BLOCKED_RECHECK,
                };
                rang = self
                    .engine
                    .sleep_behind(ahead, &self.wake, left.min(timeout), &mut cache)?
                    .then(|| ahead.clone());
                continue;
            }
            // A contender. Bells opened before the probes: a slot taken, or a ticket ahead still
            // waiting, at the probe rings its bell when it is released or leaves.
            let mut bells = self.engine.slot_bells();
            let mut dead = false;
            for (q, _) in &queue[..rank] {
                let bell = self.engine.ticket_bell(&q.name);
                bells.extend(listen(&bell).ok().flatten());
                dead |= !self.engine.ticket_alive(&q.name, &mut cache)?;
            }
            if dead {
                continue;
            }
            let urgent = queue[rank].0.urgent;
            let free = self.engine.free_slots()?;
            let poll = FALLBACK_POLL.min(left);
            match plan::decide(rank, free.len(), self.engine.budget_wait(), poll) {
                plan::Decision::Start => {
                    for &i in &free {
                        if let Some(lock) = self.engine.take_slot(i)? {
                            return Ok(self.admitted(i, lock, urgent));
                        }
                    }
                    // Another job took the slot first (or a probe held it for a moment).
                    std::thread::sleep(RETRY);
                }
                plan::Decision::Wait(timeout) => {
                    sleep_on(&bells, &self.wake, timeout);
                }
            }
        }
    }

    fn admitted(mut self, slot: u32, lock: Flock<File>, urgent: bool) -> Permit {
        let started_ns = mono_ns();
        let waited_us = started_ns.saturating_sub(self.info.enqueued_ns) / 1000;
        let holder = SlotHolder {
            sandbox: self.info.sandbox.clone(),
            namespace: self.info.namespace.clone(),
            job: self.info.job.clone(),
            pid: self.info.pid,
            urgent,
            since_unix_ms: unix_ms(),
            waited_us,
        };
        let holder_path = self.engine.slot(slot).with_extension("json");
        let json = serde_json::to_vec(&holder).expect("holder serializes");
        if let Err(e) = self.engine.write_atomic(&holder_path, &json) {
            log::warn!("{e}");
        }
        let bell_path = self.engine.slot_bell(slot);
        let bell = hold_bell(&bell_path)
            .map_err(|e| log::warn!("engine: {}: {e}", bell_path.display()))
            .ok();
        self.leave();
        Permit {
            held: Some(Held {
                engine: self.engine.clone(),
                slot,
                lock,
                bell,
                info: self.info.clone(),
                urgent,
                started_ns,
                started_unix_ms: holder.since_unix_ms,
                waited_us,
            }),
        }
    }

    fn leave(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.path);
            let _ = fs::remove_file(marker_of(&self.path));
            let _ = fs::remove_file(self.engine.ticket_bell(&self.name));
        }
        // After the lock: the job woken finds the ticket gone.
        self.bell.take();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.leave();
    }
}

fn marker_of(ticket: &Path) -> PathBuf {
    let mut m = ticket.as_os_str().to_owned();
    m.push(".urgent");
    PathBuf::from(m)
}

/// Makes a queued ticket urgent (it goes before every non-urgent one) and wakes its waiter,
/// which may now have to contend for a slot. Cloned into the sandbox's [`Admission`].
#[derive(Clone)]
pub struct Waker {
    marker: PathBuf,
    wake: Arc<EventFd>,
}

impl Waker {
    pub fn urgent(&self) -> io::Result<()> {
        OpenOptions::new()
            .mode(FILE_MODE)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.marker)?;
        self.wake.write(1).map_err(io::Error::from)?;
        Ok(())
    }
}

/// Creates the bell `path` if needed (a FIFO; anything else there is replaced) and opens it for
/// writing (and reading, so that the open never blocks), which its owner holds.
fn hold_bell(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::FileTypeExt;
    match nix::unistd::mkfifo(path, Mode::from_bits_truncate(FILE_MODE)) {
        Ok(()) => {}
        Err(Errno::EEXIST) => {
            if !fs::symlink_metadata(path)?.file_type().is_fifo() {
                fs::remove_file(path)?;
                nix::unistd::mkfifo(path, Mode::from_bits_truncate(FILE_MODE))?;
            }
        }
        Err(e) => return Err(e.into()),
    }
    let bell = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)?;
    if !bell.metadata()?.file_type().is_fifo() {
        return Err(io::Error::other("not a FIFO"));
    }
    Ok(bell)
}

/// Opens the bell `path` for listening (`None`: there is none, or it is not a FIFO). poll(2)
/// reports POLLHUP on it once its owner closes it: if it had a writer when it was opened, when
/// no writer is left; if not, once a writer came and went.
fn listen(path: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::FileTypeExt;
    let bell = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => return Ok(None),
        Err(e) => return Err(e),
    };
    // Anything else would always poll readable: a busy loop.
    Ok(bell.metadata()?.file_type().is_fifo().then_some(bell))
}

/// Sleeps until one of `bells` has no writer left, `wake` is rung, or `timeout`. Whether a bell
/// rang.
fn sleep_on(bells: &[File], wake: &EventFd, timeout: Duration) -> bool {
    let ms = u16::try_from(timeout.as_millis().max(1)).unwrap_or(u16::MAX);
    // No events asked of the bells: poll(2) reports POLLHUP regardless, and bytes someone
    // wrote into one must not wake its readers forever.
    let mut fds: Vec<PollFd> = bells
        .iter()
        .map(|b| PollFd::new(b.as_fd(), PollFlags::empty()))
        .collect();
    fds.push(PollFd::new(wake.as_fd(), PollFlags::POLLIN));
    match nix::poll::poll(&mut fds, PollTimeout::from(ms)) {
        Ok(_) | Err(Errno::EINTR) => {
            let (wake_fd, bells) = fds.split_last().expect("the wake fd is there");
            if wake_fd
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLIN))
            {
                let _ = wake.read();
            }
            bells
                .iter()
                .any(|b| b.revents().is_some_and(|r| !r.is_empty()))
        }
        Err(e) => {
            log::warn!("engine: poll: {e}");
            std::thread::sleep(timeout.min(FALLBACK_POLL));
            false
        }
    }
}

/// A running job's slot. [`Permit::finish`] records the job and releases the slot; dropping
/// it releases the slot too (recording no bytes). An engine that failed gives an empty permit.
pub struct Permit {
    held: Option<Held>,
}

struct Held {
    engine: Engine,
    slot: u32,
    lock: Flock<File>,
    /// The slot's bell, closed after the lock is released: wakes the contenders.
    bell: Option<File>,
    info: TicketInfo,
    urgent: bool,
    started_ns: u64,
    started_unix_ms: u64,
    waited_us: u64,
}

impl Permit {
    /// A permit for a job the engine could not admit (it runs anyway).
    pub fn none() -> Permit {
        Permit { held: None }
    }

    pub fn slot(&self) -> Option<u32> {
        self.held.as_ref().map(|h| h.slot)
    }

    pub fn waited(&self) -> Option<Duration> {
        self.held
            .as_ref()
            .map(|h| Duration::from_micros(h.waited_us))
    }

    /// The job ended having written `bytes`: records it, releases the slot.
    pub fn finish(mut self, bytes: u64) {
        self.release(bytes);
    }

    fn release(&mut self, bytes: u64) {
        let Some(h) = self.held.take() else {
            return;
        };
        let run_us = mono_ns().saturating_sub(h.started_ns) / 1000;
        let record = JobRecord {
            sandbox: h.info.sandbox.clone(),
            namespace: h.info.namespace.clone(),
            job: h.info.job.clone(),
            slot: h.slot,
            urgent: h.urgent,
            enqueued_unix_ms: h.info.enqueued_unix_ms,
            started_unix_ms: h.started_unix_ms,
            ended_unix_ms: unix_ms(),
            wait_us: h.waited_us,
            run_us,
            bytes,
        };
        // With a budget, the next job's admission must see this job's bytes: record first.
        // Without one, the next job need not wait for the stats.
        let mut record = Some(record);
        if h.engine.budget.is_some() {
            h.engine.record_or_warn(record.take());
        }
        let slot = h.engine.slot(h.slot);
        let _ = fs::remove_file(slot.with_extension("json"));
        drop(h.lock);
        drop(h.bell);
        h.engine.record_or_warn(record);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.release(0);
    }
}

/// One sandbox's way into the engine, owned by its checkpoint coordinator: its jobs queue one
/// at a time, and they are urgent while one of its actions waits for them.
pub struct Admission {
    engine: Engine,
    sandbox: String,
    namespace: String,
    state: Mutex<AdmissionState>,
}

#[derive(Default)]
struct AdmissionState {
    /// Actions of the sandbox waiting for its checkpoint now.
    urgent: usize,
    /// What makes the job waiting now urgent, if one waits.
    queued: Option<Waker>,
}

impl Admission {
    pub fn new(c: &EngineConfig, namespace: &str, sandbox: &str) -> Arc<Admission> {
        Arc::new(Admission {
            engine: Engine::new(c),
            sandbox: sandbox.to_string(),
            namespace: namespace.to_string(),
            state: Mutex::new(AdmissionState::default()),
        })
    }

    /// How long a job may hold its slot (`[engine] job_timeout_ms`).
    pub fn job_timeout(&self) -> Duration {
        self.engine.job_timeout
    }

    /// Waits for a slot for `job` (the turns it covers). Fails only when the wait deadline
    /// passes ([`EngineError::WaitTimeout`]): if the engine does not work, the job runs anyway
    /// (logged).
    pub async fn admit(self: &Arc<Self>, job: &str) -> Result<Permit> {
        let (this, job) = (self.clone(), job.to_string());
        let result = tokio::task::spawn_blocking(move || {
            let ticket = {
                let mut st = this.state.lock().unwrap();
                let ticket =
                    this.engine
                        .enqueue(&this.sandbox, &this.namespace, &job, st.urgent > 0)?;
                st.queued = Some(ticket.waker());
                ticket
            };
            let permit = ticket.wait();
            this.state.lock().unwrap().queued = None;
            permit
        })
        .await;
        match result {
            Ok(Ok(permit)) => {
                if let Some(w) = permit.waited().filter(|w| *w >= Duration::from_millis(10)) {
                    log::info!(
                        "checkpoint of {} waited {w:?} for the host engine (slot {})",
                        self.sandbox,
                        permit.slot().unwrap_or_default()
                    );
                }
                Ok(permit)
            }
            Ok(Err(e @ EngineError::WaitTimeout { .. })) => Err(e),
            Ok(Err(e)) => {
                log::warn!(
                    "checkpoint of {} runs outside the host engine: {e}",
                    self.sandbox
                );
                Ok(Permit::none())
            }
            Err(e) => {
                log::warn!(
                    "checkpoint of {} runs outside the host engine: {e}",
                    self.sandbox
                );
                Ok(Permit::none())
            }
        }
    }

    /// While the guard lives, the sandbox's queued or next job is urgent.
    pub fn urgent(&self) -> Urgent<'_> {
        let mut st = self.state.lock().unwrap();
        st.urgent += 1;
        if let Some(waker) = &st.queued {
            if let Err(e) = waker.urgent() {
                log::warn!("engine: cannot mark {} urgent: {e}", waker.marker.display());
            }
        }
        Urgent(self)
    }
}

/// See [`Admission::urgent`]. A ticket marked urgent stays urgent: the sandbox did wait.
pub struct Urgent<'a>(&'a Admission);

impl Drop for Urgent<'_> {
    fn drop(&mut self) {
        self.0.state.lock().unwrap().urgent -= 1;
    }
}

#[cfg(test)]
mod tests;
