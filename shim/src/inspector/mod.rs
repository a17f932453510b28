//! The inspector: what did a container's turn leave behind since the last mark?
//!
//! Kernel events (eBPF, [`bpf`]) say cheaply *whether* anything that could matter happened
//! (a mutating file syscall, a fork/exec/exit, a process being scheduled); user space then
//! computes the exact *net* effect only where something happened: the overlay upperdir
//! against the manifest of the mark ([`fs`]), the live processes against those of the mark
//! ([`procs`]), and the memory of processes that ran against their image at the mark
//! ([`memory`]). Anything the inspector cannot observe makes the answer "everything
//! changed" ([`Kind::Full`]), said loudly: it never skips state silently.

pub mod bpf;
mod decide;
pub use decide::NotOwn;
mod answer;
mod errors;
pub mod fs;
pub mod held;
pub mod lower;
pub mod memory;
mod observe;
pub mod procs;
mod scan;

pub use answer::*;
pub use errors::*;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::Instant,
};

use self::{
    bpf::{CgroupCounters, HostProbes},
    fs::{FsDiff, TreeManifest},
    memory::{MemError, MemoryImage, Observation},
    procs::ProcInfo,
};

/// The state a turn is compared against.
struct Mark {
    counters: CgroupCounters,
    manifest: TreeManifest,
    /// One per tracked volume, in `Target::volumes` order.
    volumes: Vec<TreeManifest>,
    processes: Vec<ProcInfo>,
    run_counts: HashMap<u32, u64>,
    memory: HashMap<u32, MemoryImage>,
    /// Pids whose memory image was taken while a lazy restore's pages were still arriving: a
    /// page not there yet reads as never touched, so a comparison with such an image cannot
    /// prove "unchanged" and counts as a change ([`MemoryFinding::unproven_base`]).
    unproven: HashSet<u32>,
    /// The `[limits]` bound the mark's observation passed: its memory images are incomplete.
    over_limit: Option<String>,
    /// The container's tmpfs mounts (`/dev`, `/dev/shm`, a `--tmpfs`) by mount point: no
    /// upperdir holds them, a process checkpoint does ([`Inspection::scan_tmpfs`]).
    tmpfs: Vec<(PathBuf, TreeManifest)>,
}

/// What a turn end gathers for the next mark while it observes the processes, and the
/// observation all its memory images share.
struct TurnImages {
    run_counts: HashMap<u32, u64>,
    memory_images: HashMap<u32, MemoryImage>,
    /// The pids whose image cannot prove "unchanged" ([`Mark::unproven`]).
    unproven: HashSet<u32>,
    /// Images taken from here on may lack pages of a lazy restore still under way.
    missing: bool,
    /// One observation for all the images: each shared object read once, the container's
    /// bounds over them all.
    obs: Observation,
    /// What is left of the turn end's wait for processes caught awake ([`ASLEEP_WAIT`], for
    /// all of them together: a container of busy processes does not hold its turn end longer).
    asleep_budget: std::time::Duration,
}

impl TurnImages {
    fn new(missing: bool, limits: &crab_runtime_config::LimitsConfig) -> TurnImages {
        TurnImages {
            run_counts: HashMap::new(),
            memory_images: HashMap::new(),
            unproven: HashSet::new(),
            missing,
            obs: Observation::within(limits),
            asleep_budget: ASLEEP_WAIT,
        }
    }
}

/// Watches one container: holds its last mark and answers turn ends.
pub struct Inspection {
    target: Target,
    probes: Option<Arc<HostProbes>>,
    cgroup_id: Option<u64>,
    mark: Option<Mark>,
    seq: u64,
    /// Why observation is impossible for this container (BPF unavailable, ...).
    blind: Option<InspectError>,
    /// Whether a lazy restore's pages may still be missing from the processes' memory (see
    /// [`Self::restored_lazily`]).
    pages_in_flight: Option<PagesInFlight>,
    /// The rseq areas of restored threads, from their checkpoint image (see
    /// [`Self::restored_rseq`]).
    rseq_seeds: RseqSeeds,
    /// While set, the container's processes are only this restored init and its descendants
    /// (at pre-resume CRIU itself, and its action script, are in the container's cgroup too:
    /// see [`Self::mark_base_held_by_criu`]).
    only_tree: Option<u32>,
    /// The host probes count the interactions of the container's processes since before its
    /// first mark (asked for when the policy keeps self-contained changes).
    counts_interactions: bool,
}

/// Host pid -> (host tid, rseq area address) of its threads, as their checkpoint image said.
type RseqSeeds = HashMap<u32, Vec<(u32, u64)>>;

/// Says whether a lazy restore's pages may still be missing from the processes' memory.
pub type PagesInFlight = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

impl Inspection {
    /// Starts watching: registers the container's cgroup with the host probes. A failure
    /// does not fail the container: the inspection is then blind and every answer `full`.
    pub fn new(target: Target, probes: Result<Arc<HostProbes>, ProbesUnavailable>) -> Inspection {
        let mut blind = None;
        let (probes, cgroup_id) = match probes {
            Ok(p) => match crate::sys::cgroup::cgroup_id(&target.cgroup2_dir)
                .map_err(WatchError::CgroupId)
                .and_then(|id| {
                    p.watch_bounded(id, Some(target.limits.max_bpf_processes))
                        .map_err(|e| WatchError::Bpf(Box::new(e)))?;
                    if let Some(dev) = target.rootfs_dev {
                        // Not seeing outside changes could miss one: blind (every turn full).
                        if let Err(e) = p.watch_rootfs(id, dev) {
                            let _ = p.unwatch(id);
                            return Err(WatchError::Bpf(Box::new(e)));
                        }
                    }
                    Ok(id)
                }) {
                Ok(id) => (Some(p), Some(id)),
                Err(source) => {
                    blind = Some(InspectError::Watch {
                        dir: target.cgroup2_dir.clone(),
                        source,
                    });
                    (None, None)
                }
            },
            Err(e) => {
                blind = Some(InspectError::ProbesUnavailable(e));
                (None, None)
            }
        };
        if let Some(why) = &blind {
            log::warn!(
                "inspector for {} is BLIND, every turn will be a full checkpoint: {why}",
                target.container_id
            );
        }
        // Before any mark: an image's count then covers everything since it was taken.
        let counts_interactions = target.keep_self_contained
            && probes
                .as_ref()
                .is_some_and(|p| match p.track_interactions() {
                    Ok(()) => true,
                    Err(e) => {
                        log::warn!(
                            "inspector for {}: cannot count interactions, self-contained changes \
                         are checkpointed: {e}",
                            target.container_id
                        );
                        false
                    }
                });
        Inspection {
            target,
            probes,
            cgroup_id,
            mark: None,
            seq: 0,
            blind,
            pages_in_flight: None,
            rseq_seeds: HashMap::new(),
            only_tree: None,
            counts_interactions,
        }
    }

    /// Until [`Self::mark_base_held_by_criu`] has taken the mark, the container's processes
    /// are only the restored `init` and its descendants.
    pub fn restored_tree(&mut self, init: u32) {
        self.only_tree = Some(init);
    }

    /// The container's processes were just restored from a checkpoint image whose threads
    /// had these rseq areas (`areas`: thread id in the container's pid namespace, address).
    /// CRIU registers them again before the threads resume, and the kernel rewrites them
    /// whenever a thread is scheduled; the host probes learn an area only when its thread
    /// leaves a CPU while the cgroup is watched, which a restored thread may have done before
    /// the watch began and then not again for long (a sleeper). Known from the image, the
    /// areas are left out of memory images from the first one on, so a sleeper woken later
    /// (by a freeze for a checkpoint) does not count as changed.
    ///
    /// A seed lasts as long as its thread; a thread that exits, or a process that execs,
    /// ends it (as in the probes).
    pub fn restored_rseq(&mut self, areas: &[(u32, u64)]) {
        if areas.is_empty() {
            return;
        }
        let by_ns_tid: HashMap<u32, u64> = areas.iter().copied().collect();
        let mut seeded = 0;
        for p in self.processes().unwrap_or_default() {
            let found: Vec<(u32, u64)> = procs::threads_by_ns_tid(p.pid)
                .into_iter()
                .filter_map(|(tid, ns_tid)| by_ns_tid.get(&ns_tid).map(|a| (tid, *a)))
                .collect();
            if !found.is_empty() {
                seeded += found.len();
                self.rseq_seeds.insert(p.pid, found);
            }
        }
        log::debug!(
            "inspector for {}: {seeded} of {} restored threads' rseq areas found",
            self.target.container_id,
            areas.len()
        );
    }

    /// The container's processes were restored lazily: until `in_flight` says otherwise, pages
    /// may be missing from their memory (they arrive on first touch or in the background), and
    /// memory images taken meanwhile cannot prove that nothing changed.
    pub fn restored_lazily(&mut self, in_flight: PagesInFlight) {
        self.pages_in_flight = Some(in_flight);
    }

    /// Whether memory images taken now may lack pages of a lazy restore.
    fn pages_missing(&self) -> bool {
        self.pages_in_flight.as_ref().is_some_and(|f| f())
    }

    /// Numbers the next answers after `seq` (the last one its store already holds).
    pub fn continue_after(&mut self, seq: u64) {
        self.seq = self.seq.max(seq);
    }

    /// Waits (bounded) until no process of the container is running: a program that just
    /// started (dynamic loading, initialisation) is still changing its memory, and the base
    /// mark should hold it as it idles, not halfway through its start.
    fn settle(&self, bound: std::time::Duration) {
        let deadline = Instant::now() + bound;
        let mut last: Option<Vec<(u32, Option<u64>)>> = None;
        let mut quiet_polls = 0;
        while Instant::now() < deadline {
            let procs = self.processes().unwrap_or_default();
            let busy = procs.iter().any(|p| {
                procs::read_stat(p.pid)
                    .ok()
                    .flatten()
                    .is_some_and(|s| matches!(s.state, 'R' | 'D'))
            });
            // Neither runnable nor scheduled since the last poll (when the probes can tell).
            let runs: Vec<(u32, Option<u64>)> = procs
                .iter()
                .map(|p| (p.pid, self.run_count(p.pid)))
                .collect();
            let quiet = !busy && last.as_ref() == Some(&runs);
            quiet_polls = if quiet { quiet_polls + 1 } else { 0 };
            if quiet_polls >= 3 {
                return;
            }
            last = Some(runs);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        log::debug!(
            "inspector for {}: processes still busy {bound:?} after start",
            self.target.container_id
        );
    }

    /// Takes the base mark (at container start): the upperdir as it is now, the processes
    /// alive now and their memory.
    ///
    /// The upperdir is not empty at start: runc creates the mount points the image lacks
    /// (a volume's `/workspace`, `/etc/resolv.conf`) in it. Those are the runtime's, not a
    /// turn's: with an empty base, the first turn that scans (any write hint, or a shared
    /// writable mapping) would report them `added` and take a needless fs checkpoint.
    pub fn mark_base(&mut self) {
        self.settle(std::time::Duration::from_secs(1));
        self.take_base_mark();
    }

    /// [`Self::mark_base`] of a restored container whose threads CRIU holds at pre-resume
    /// (ptrace-stopped at the exit of their `rt_sigreturn`, everything else as they will run):
    /// nothing moves, so nothing is settled; a thread reads stopped (`t`) only because CRIU
    /// holds it, so no thread of the mark is stopped. (A process restored stopped reads as a
    /// change at the first turn end: a checkpoint too many, never one too few.)
    pub fn mark_base_held_by_criu(&mut self) {
        self.take_base_mark();
        self.only_tree = None;
        if let Some(mark) = &mut self.mark {
            for image in mark.memory.values_mut() {
                for t in &mut image.state.threads {
                    t.stopped = false;
                }
            }
        }
    }

    /// Once a restored container marked at pre-resume ([`Self::mark_base_held_by_criu`]) has
    /// resumed and settled: its processes' memory images in the mark, and their run counts,
    /// are taken again, so that what a process writes into its own memory as it resumes (an
    /// interrupted sleep, restarted by its libc, writes `errno` and its stack) is the base, as
    /// any restore of that checkpoint would write it. Everything else stays as CRIU held it:
    /// files, tmpfs mounts, the processes alive, what the kernel holds for them, the counters
    /// (so a file written, a process started or ended, a signal sent or bytes queued as they
    /// resume are the first turn's). A process whose memory cannot be read again keeps its
    /// image from pre-resume (the turn then compares with that: a change, never a miss).
    pub fn refresh_restored_memory(&mut self) {
        let started = Instant::now();
        self.settle(std::time::Duration::from_secs(1));
        let Some(mut mark) = self.mark.take() else {
            return;
        };
        let mut obs = Observation::within(&self.target.limits);
        let mut fresh = HashMap::new();
        for &pid in mark.memory.keys() {
            match self.capture(pid, &mut obs) {
                Ok(img) => {
                    fresh.insert(pid, img);
                }
                Err(e) => log::debug!("memory of restored pid {pid}: {e}"),
            }
            if let Some(n) = self.run_count(pid) {
                mark.run_counts.insert(pid, n);
            }
        }
        for img in fresh.values_mut() {
            obs.settle(img);
        }
        if let Some(e) = obs.over_limit() {
            mark.over_limit = Some(e.to_string());
        }
        let n = fresh.len();
        for (pid, mut img) in fresh {
            if let Some(held) = mark.memory.get_mut(&pid) {
                img.state = std::mem::take(&mut held.state);
                *held = img;
            }
        }
        self.mark = Some(mark);
        log::debug!(
            "inspector for {}: memory of {n} restored processes taken again in {:?}",
            self.target.container_id,
            started.elapsed()
        );
    }

    fn take_base_mark(&mut self) {
        let started = Instant::now();
        let upper = match &self.target.upperdir {
            Some(_) => self.scan_upper().unwrap_or_else(|e| {
                log::warn!(
                    "inspector for {}: base mark without the upperdir ({e}): the first scan \
                     compares with an empty one",
                    self.target.container_id
                );
                TreeManifest::default()
            }),
            None => TreeManifest::default(),
        };
        match self.observe_all(upper) {
            Ok(mark) => self.mark = Some(mark),
            Err(e) => {
                log::warn!(
                    "inspector for {}: cannot take the base mark: {e}",
                    self.target.container_id
                );
                self.mark = None;
            }
        }
        log::debug!(
            "inspector for {}: base mark in {:?}",
            self.target.container_id,
            started.elapsed()
        );
    }

    /// The cgroup's counters now; `None` when blind (which [`Self::blind`] already says).
    fn counters(&self) -> Option<Result<CgroupCounters, InspectError>> {
        match (&self.probes, self.cgroup_id) {
            (Some(p), Some(id)) => Some(
                p.counters(id)
                    .map_err(|e| InspectError::Counters(Box::new(e))),
            ),
            _ => None,
        }
    }

    fn run_count(&self, pid: u32) -> Option<u64> {
        self.probes
            .as_ref()
            .and_then(|p| p.run_count(pid).ok().flatten())
    }

    fn processes(&self) -> Result<Vec<ProcInfo>, InspectError> {
        let all = procs::list(&self.target.cgroup2_dir).map_err(InspectError::Processes)?;
        Ok(match self.only_tree {
            Some(init) => procs::tree_of(init, all),
            None => all,
        })
    }

    /// A full observation, used when there is no usable mark.
    fn observe_all(&self, manifest: TreeManifest) -> Result<Mark, InspectError> {
        let counters = self.counters().and_then(Result::ok).unwrap_or_default();
        let processes = self.processes()?;
        let mut memory = HashMap::new();
        let mut run_counts = HashMap::new();
        let unproven = match self.pages_missing() {
            true => processes.iter().map(|p| p.pid).collect(),
            false => HashSet::new(),
        };
        let mut obs = Observation::within(&self.target.limits);
        for p in &processes {
            if let Some(n) = self.run_count(p.pid) {
                run_counts.insert(p.pid, n);
            }
            match self.capture(p.pid, &mut obs) {
                Ok(img) => {
                    memory.insert(p.pid, img);
                }
                Err(e) => log::debug!("memory of pid {}: {e}", p.pid),
            }
        }
        for img in memory.values_mut() {
            obs.settle(img);
        }
        let over_limit = obs.over_limit().map(|e| e.to_string());
        let volumes = self.scan_volumes().unwrap_or_default();
        // Unscanned, the next comparison finds every entry new: a change, never a miss.
        let tmpfs = self.scan_tmpfs(&processes).unwrap_or_else(|e| {
            log::warn!("inspector for {}: {e}", self.target.container_id);
            Vec::new()
        });
        Ok(Mark {
            counters,
            manifest,
            processes,
            run_counts,
            memory,
            volumes,
            unproven,
            over_limit,
            tmpfs,
        })
    }

    /// Process `pid`'s interactions now, when the inspection counts them.
    fn interactions(&self, pid: u32) -> Option<u64> {
        interactions_of(self.probes.as_deref(), self.counts_interactions, pid)
    }

    /// Whether a change found now may be kept as self-contained: the policy says so and the
    /// interactions program is still attached (its pins were not removed since the mark).
    fn keeps_self_contained(&self) -> bool {
        self.counts_interactions
            && self
                .probes
                .as_ref()
                .is_some_and(|p| p.interactions_tracked())
    }

    fn capture(&self, pid: u32, obs: &mut Observation) -> Result<MemoryImage, memory::MemError> {
        // Read before: whatever reached the process from here on is not in this count.
        let interactions = self.interactions(pid);
        let mut img = capture_bounded(
            pid,
            self.target.limits.max_fdinfo_bytes,
            volatile_of(self.probes.as_deref(), &self.rseq_seeds, pid),
            obs,
        )?;
        self.note_signals(pid, &mut img.state);
        img.interactions = interactions;
        Ok(img)
    }

    /// What the kernel holds for `pid` now that can change while it does not run, without its
    /// memory (see [`memory::read_held_state`]).
    fn held_state_of(
        &self,
        pid: u32,
        obs: &mut Observation,
    ) -> Result<memory::ProcState, MemError> {
        let mut st = memory::read_held_state(pid, obs)?;
        self.note_signals(pid, &mut st);
        Ok(st)
    }

    /// Notes in `st` how many signals were queued to `pid`, while some are pending.
    fn note_signals(&self, pid: u32, st: &mut memory::ProcState) {
        st.signals_while_pending = st.pending().then(|| {
            self.probes
                .as_ref()
                .and_then(|p| p.signals_queued(pid).ok().flatten())
                // No count while a signal is pending: never the same twice.
                .unwrap_or_else(|| {
                    static UNKNOWN: std::sync::atomic::AtomicU64 =
                        std::sync::atomic::AtomicU64::new(1 << 63);
                    UNKNOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                })
        });
    }

    /// What the processes' kernel-held state shows changed since `o` was observed (the
    /// container frozen by the caller): for an in-place rollback, which keeps them only when
    /// nothing did. Empty: nothing changed.
    pub fn processes_changed_since(&self, o: &Observed) -> Vec<String> {
        let mut out = Vec::new();
        let mut obs = Observation::within(&self.target.limits);
        for p in &o.0.processes {
            let Some(img) = o.0.memory.get(&p.pid) else {
                out.push(format!("pid {}: no image at the peek", p.pid));
                continue;
            };
            match self.held_state_of(p.pid, &mut obs) {
                Ok(st) => {
                    for c in memory::compare_held(&img.state, &st) {
                        out.push(format!("pid {}: {c}", p.pid));
                    }
                }
                Err(e) => out.push(format!("pid {}: {e}", p.pid)),
            }
        }
        out
    }

    /// Processes that have not been scheduled since the mark (so their memory still equals
    /// the mark's image), with their run counts now.
    pub fn idle_since_mark(&self) -> Vec<(u32, u64)> {
        let Some(m) = &self.mark else {
            return Vec::new();
        };
        m.processes
            .iter()
            .filter_map(|p| {
                let now = self.run_count(p.pid)?;
                (m.run_counts.get(&p.pid) == Some(&now)).then_some((p.pid, now))
            })
            .collect()
    }

    /// After a checkpoint froze and thawed the container: the freezer wakes every process, and
    /// waking rewrites a little of their memory (an interrupted sleep stores its remaining time,
    /// the kernel updates the rseq area). For the processes that were idle since the mark up to
    /// the freeze (`idle`, from [`Self::idle_since_mark`]), that change is crab's own, not the
    /// agent's: their images at the mark are refreshed so the next turn does not count it.
    ///
    /// A thawed process rewrites that memory when it next runs, which may be after the thaw
    /// returned: each is waited for (bounded) until it has run and gone back to sleep since the
    /// freeze (its run count, taken before the freeze, moved by two: the switch-out into the
    /// freezer and the one after the thaw), so that its image is taken after the rewrite.
    pub fn refresh_after_freeze(&mut self, idle: &[(u32, u64)]) {
        let deadline = Instant::now() + REFRESH_WAIT;
        let missing = self.pages_missing();
        let Some(mark) = self.mark.as_mut() else {
            return;
        };
        let mut obs = Observation::within(&self.target.limits);
        for &(pid, before) in idle {
            let count = || {
                self.probes
                    .as_ref()
                    .and_then(|p| p.run_count(pid).ok().flatten())
            };
            let Some(n) = (loop {
                match count() {
                    Some(n) if n < before + 2 && Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_micros(200))
                    }
                    n => break n,
                }
            }) else {
                continue;
            };
            let interactions =
                interactions_of(self.probes.as_deref(), self.counts_interactions, pid);
            match capture_bounded(
                pid,
                self.target.limits.max_fdinfo_bytes,
                volatile_of(self.probes.as_deref(), &self.rseq_seeds, pid),
                &mut obs,
            ) {
                Ok(mut img) => {
                    obs.settle(&mut img);
                    img.interactions = interactions;
                    mark.memory.insert(pid, img);
                    mark.run_counts.insert(pid, n);
                    if missing {
                        mark.unproven.insert(pid);
                    } else {
                        mark.unproven.remove(&pid);
                    }
                }
                Err(e) => log::debug!("refresh of pid {pid} after a freeze: {e}"),
            }
        }
    }

    /// Answers a turn end and makes the present the new mark.
    pub fn turn_end(&mut self) -> Answer {
        self.seq += 1;
        let prev = self.mark.take();
        let (answer, mark) = self.observe_since(prev.as_ref(), self.seq);
        self.mark = mark;
        // A seed ends with its process's image (an exec) or the process.
        for p in answer.procs.reexeced.iter().chain(&answer.procs.ended) {
            self.rseq_seeds.remove(&p.pid);
        }
        if answer.degraded.is_empty() {
            log::info!("{}", answer.summary());
        } else {
            log::warn!("{}", answer.summary());
        }
        answer
    }

    /// What a turn end would answer now, without ending a turn: the mark stays as it is. Also
    /// returns the observation of the present, which [`Self::rebase`] can make the mark.
    pub fn peek(&self) -> (Answer, Option<Observed>) {
        let (answer, mark) = self.observe_since(self.mark.as_ref(), self.seq);
        (answer, mark.map(Observed))
    }
}

/// An observation of the present ([`Inspection::peek`]) that can become the mark after the
/// container's files were reset in place ([`Inspection::rebase`]).
pub struct Observed(Mark);

/// The net change of the container's files since the mark, read with the container frozen
/// (for an in-place rollback, [`Inspection::fs_since_mark`]).
#[derive(Debug, Clone, Default)]
pub struct FsSinceMark {
    /// Container paths, as a turn answer lists them (volumes' below their mount points).
    pub changed: FsDiff,
    /// Changed directories of the upperdir that hide what the image has below them (opaque, or
    /// renamed with a redirect): their whole content must be compared, not only the paths
    /// listed.
    pub hiding: Vec<PathBuf>,
}

impl Inspection {
    /// What it watches.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Forks, execs, exits, foreign memory writes and kernel state changes ([`bpf::StateClass`]) in
    /// the container since `o` was observed;
    /// `None` when the probes cannot tell (blind).
    pub fn process_events_since(&self, o: &Observed) -> Option<u64> {
        let now = self.counters()?.ok()?;
        let then = &o.0.counters;
        Some(
            now.forks.saturating_sub(then.forks)
                + now.execs.saturating_sub(then.execs)
                + now.exits.saturating_sub(then.exits)
                + now
                    .foreign_mem_writes
                    .saturating_sub(then.foreign_mem_writes)
                + now.errors.saturating_sub(then.errors)
                + now.over_quota.saturating_sub(then.over_quota)
                + now.since(then).state_classes().map(|(_, n)| n).sum::<u64>(),
        )
    }

    /// The processes of `o` that have not been scheduled since it was observed, with their run
    /// counts now (for [`Self::refresh_after_freeze`] once a freeze that follows is over).
    pub fn idle_since(&self, o: &Observed) -> Vec<(u32, u64)> {
        o.0.processes
            .iter()
            .filter_map(|p| {
                let now = self.run_count(p.pid)?;
                (o.0.run_counts.get(&p.pid) == Some(&now)).then_some((p.pid, now))
            })
            .collect()
    }

    /// The net change of the files (upperdir and tracked volumes) since the mark, scanned now:
    /// the caller has frozen the container. An error when there is no mark or a tree cannot be
    /// scanned (the change is then unknown).
    pub fn fs_since_mark(&self) -> Result<FsSinceMark, InspectError> {
        let Some(mark) = &self.mark else {
            return Err(InspectError::NoMark);
        };
        let now = self.scan_upper()?;
        let mut out = FsSinceMark {
            changed: fs::diff(&mark.manifest, &now, &self.target.lowerdirs),
            hiding: Vec::new(),
        };
        for p in out.changed.added.iter().chain(&out.changed.modified) {
            let rel = p.strip_prefix("/").unwrap_or(p);
            if now
                .get(rel)
                .is_some_and(|m| m.kind == fs::EntryKind::Dir && (m.opaque || m.redirect.is_some()))
            {
                out.hiding.push(p.clone());
            }
        }
        let volumes = self.scan_volumes()?;
        let empty = TreeManifest::default();
        for (i, (at, _)) in self.target.volumes.iter().enumerate() {
            let before = mark.volumes.get(i).unwrap_or(&empty);
            let d = fs::diff(before, &volumes[i], &[]);
            let inside = |p: PathBuf| at.join(p.strip_prefix("/").unwrap_or(&p));
            out.changed.added.extend(d.added.into_iter().map(inside));
            out.changed
                .modified
                .extend(d.modified.into_iter().map(inside));
            out.changed
                .deleted
                .extend(d.deleted.into_iter().map(inside));
        }
        Ok(out)
    }

    /// Makes `o` the mark, with the files as they are now (scanned again, and the kernel
    /// counters read again): after the container's files were reset in place, with the
    /// container still frozen, the next turn is compared with the reset state.
    pub fn rebase(&mut self, o: Observed) -> Result<(), InspectError> {
        let counters = match self.counters() {
            Some(c) => c?,
            None => CgroupCounters::default(),
        };
        let manifest = self.scan_upper()?;
        let volumes = self.scan_volumes()?;
        self.mark = Some(Mark {
            counters,
            manifest,
            volumes,
            ..o.0
        });
        Ok(())
    }
}

/// How long [`Inspection::refresh_after_freeze`] waits, in all, for thawed processes to run.
const REFRESH_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Process `pid`'s interactions now, when `counted` (the inspection asked for them).
fn interactions_of(probes: Option<&HostProbes>, counted: bool, pid: u32) -> Option<u64> {
    probes
        .filter(|_| counted)
        .and_then(|p| p.interactions(pid).ok().flatten())
}

/// How long a turn end waits, for all processes together, for those whose change may be
/// self-contained to be asleep again ([`all_asleep_within`]).
const ASLEEP_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The memory of `pid` the kernel writes by itself: its threads' rseq areas, as the BPF side
/// saw them and as the checkpoint image it was restored from said (`seeds`, for the threads
/// that still exist) (`struct rseq`, 32 bytes; hashed as zeros, see [`memory`]).
fn volatile_of(probes: Option<&HostProbes>, seeds: &RseqSeeds, pid: u32) -> Vec<(u64, u64)> {
    const RSEQ_BYTES: u64 = 32;
    let mut areas: Vec<u64> = probes
        .and_then(|p| p.rseq_areas(pid).ok())
        .map(|(areas, _)| areas)
        .unwrap_or_default();
    if let Some(seeded) = seeds.get(&pid) {
        let live = procs::thread_ids(pid);
        areas.extend(
            seeded
                .iter()
                .filter(|(tid, _)| live.contains(tid))
                .map(|(_, a)| *a),
        );
    }
    areas.sort_unstable();
    areas.dedup();
    areas.into_iter().map(|a| (a, RSEQ_BYTES)).collect()
}

/// A memory image whose fd state keeps at most `max_fdinfo_bytes` of fdinfo text, with the
/// ranges `volatile` hashed as zeros, as part of the observation `obs` (its per-container
/// bounds, its shared objects read once).
fn capture_bounded(
    pid: u32,
    max_fdinfo_bytes: u64,
    volatile: Vec<(u64, u64)>,
    obs: &mut Observation,
) -> Result<MemoryImage, memory::MemError> {
    memory::capture_in(
        pid,
        &memory::CaptureOptions {
            max_fdinfo_bytes: Some(max_fdinfo_bytes),
            volatile,
            ..Default::default()
        },
        obs,
    )
}

impl Drop for Inspection {
    fn drop(&mut self) {
        if let (Some(p), Some(id)) = (&self.probes, self.cgroup_id) {
            if let Err(e) = p.unwatch(id) {
                log::warn!(
                    "cannot unwatch cgroup {id} of {}: {e}",
                    self.target.container_id
                );
            }
        }
    }
}

/// What the root-only tests of the inspector on the real system (`tests/root_inspector.rs`)
/// call below a turn end.
#[doc(hidden)]
pub mod testing {
    use super::Inspection;

    /// Arms the container's shared writable mappings of files (as a turn end's mark does);
    /// returns what could not be armed.
    pub fn arm_shared_mappings(inspection: &Inspection) -> Vec<String> {
        inspection.arm_shared_mappings()
    }
}

#[cfg(test)]
mod tests;
