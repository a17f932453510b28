//! A turn end's gathering: the counters, the files, the processes and their memory since the
//! mark, each asked of [`super::decide`] where a decision is made.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Instant,
};

use super::{
    answer_kind,
    bpf::CgroupCounters,
    decide::{self, MemoryStep, NextMark},
    fs::{self, FsDiff, TreeManifest},
    memory::{self, MemError},
    procs::{self, ProcInfo},
    procs_changed, Answer, FsFinding, InspectError, Inspection, Mark, MemoryFinding, ProcFinding,
    ProcSummary, TurnImages,
};

impl Inspection {
    /// The answer of the turn since `prev` (numbered `seq`) and the mark it leaves: the present,
    /// or a fresh full observation when the present could not be observed.
    pub(super) fn observe_since(&self, prev: Option<&Mark>, seq: u64) -> (Answer, Option<Mark>) {
        let started = Instant::now();
        let mut degraded = Vec::new();
        let counters = self.observe_counters(prev, &mut degraded);

        // Filesystem: scan only when a mutating syscall (or a shared writable mapping, whose
        // writes need no syscall) happened since the mark.
        let decide::FsActivity {
            scan,
            arm,
            syscalls,
        } = decide::fs_activity(counters.as_ref(), prev.map(|m| &m.counters));
        let mut fs = FsFinding {
            syscalls,
            ..FsFinding::default()
        };
        let manifest = self.observe_fs(prev, scan, arm, &mut fs, &mut degraded);
        let volumes = self.observe_volumes(prev, scan, &mut fs, &mut degraded);

        // Processes.
        let now_procs = match self.processes() {
            Ok(p) => Some(p),
            Err(e) => {
                degraded.push(e.to_string());
                None
            }
        };
        // Images taken from here on may lack pages of a lazy restore still under way.
        let mut seen = TurnImages::new(self.pages_missing(), &self.target.limits);
        let mut procs = match (&now_procs, prev) {
            (Some(now), Some(m)) => {
                self.observe_processes(now, m, counters.as_ref(), &fs, &mut seen, &mut degraded)
            }
            _ => ProcFinding::default(),
        };
        let tmpfs = self.observe_tmpfs(prev, scan, now_procs.as_deref(), &mut procs, &mut degraded);

        for img in seen.memory_images.values_mut() {
            seen.obs.settle(img);
        }
        procs.read = seen.obs.stats().clone();
        let kind = answer_kind(&degraded, fs.changed, procs.changed);
        // The present becomes the mark; if it could not be observed, the next turn takes a
        // fresh full observation.
        let mark = match decide::next_mark(counters, manifest, now_procs, volumes, &degraded) {
            NextMark::Present(counters, manifest, processes, volumes) => Some(Mark {
                counters,
                manifest,
                processes,
                run_counts: seen.run_counts,
                memory: seen.memory_images,
                volumes,
                unproven: seen.unproven,
                over_limit: None,
                // Observed whenever `degraded` is empty (which `Present` requires).
                tmpfs: tmpfs.unwrap_or_default(),
            }),
            NextMark::Fresh(manifest) => self.observe_all(manifest.unwrap_or_default()).ok(),
        };
        let answer = Answer {
            container_id: self.target.container_id.clone(),
            seq,
            kind,
            fs,
            procs,
            degraded,
            elapsed_us: started.elapsed().as_micros() as u64,
        };
        (answer, mark)
    }

    /// The cgroup's counters now (`None`: blind, or unreadable), saying in `degraded` why the
    /// turn cannot be observed as far as they and the mark `prev` tell
    /// ([`decide::counter_reasons`]).
    fn observe_counters(
        &self,
        prev: Option<&Mark>,
        degraded: &mut Vec<String>,
    ) -> Option<CgroupCounters> {
        if let Some(why) = &self.blind {
            degraded.push(why.to_string());
        }
        let counters = match self.counters() {
            Some(Ok(c)) => Some(c),
            Some(Err(e)) => {
                degraded.push(e.to_string());
                None
            }
            None => None,
        };
        degraded.extend(decide::counter_reasons(
            counters.as_ref(),
            prev.map(|m| &m.counters),
            self.target.limits.max_bpf_processes,
        ));
        counters
    }

    /// The upperdir now and its net change since the mark `prev` (into `fs`) when `scan`
    /// (arming shared writable mappings first when `arm`, see [`decide::fs_activity`]); the
    /// mark's manifest when not. `None`: it could not be scanned (said in `degraded`, and `fs`
    /// is unobserved).
    fn observe_fs(
        &self,
        prev: Option<&Mark>,
        scan: bool,
        arm: bool,
        fs: &mut FsFinding,
        degraded: &mut Vec<String>,
    ) -> Option<TreeManifest> {
        let prev_manifest = prev.map(|m| &m.manifest);
        if !scan {
            return prev_manifest.cloned();
        }
        fs.scanned = true;
        if arm {
            degraded.extend(self.arm_shared_mappings());
        }
        match self.scan_upper() {
            Ok(now) => {
                let empty = TreeManifest::default();
                let d: FsDiff = fs::diff(
                    prev_manifest.unwrap_or(&empty),
                    &now,
                    &self.target.lowerdirs,
                );
                fs.changed = !d.is_empty();
                fs.added = d.added;
                fs.modified = d.modified;
                fs.deleted = d.deleted;
                Some(now)
            }
            Err(e) => {
                fs.unobserved = true;
                degraded.push(e.to_string());
                None
            }
        }
    }

    /// The tracked volumes now and their net change since the mark `prev` (added to `fs`, as
    /// container paths below their mount points) when `scan`; the mark's manifests when not.
    /// `None`: one could not be scanned (said in `degraded`, and `fs` is unobserved).
    fn observe_volumes(
        &self,
        prev: Option<&Mark>,
        scan: bool,
        fs: &mut FsFinding,
        degraded: &mut Vec<String>,
    ) -> Option<Vec<TreeManifest>> {
        if !scan {
            return prev.map(|m| m.volumes.clone());
        }
        match self.scan_volumes() {
            Ok(now) => {
                let empty = TreeManifest::default();
                for (i, (at, _)) in self.target.volumes.iter().enumerate() {
                    let before = prev
                        .as_ref()
                        .and_then(|m| m.volumes.get(i))
                        .unwrap_or(&empty);
                    let d = fs::diff(before, &now[i], &[]);
                    let inside = |p: PathBuf| at.join(p.strip_prefix("/").unwrap_or(&p));
                    fs.changed |= !d.is_empty();
                    fs.added.extend(d.added.into_iter().map(inside));
                    fs.modified.extend(d.modified.into_iter().map(inside));
                    fs.deleted.extend(d.deleted.into_iter().map(inside));
                }
                Some(now)
            }
            Err(e) => {
                fs.unobserved = true;
                degraded.push(e.to_string());
                None
            }
        }
    }

    /// The container's tmpfs mounts compared with the mark's when the turn made a mutating
    /// file syscall (`scan`; else the mark's are carried): any entry added, changed or removed
    /// there, or a tmpfs mount come or gone, makes the processes count as changed (class
    /// `tmpfs-entries`: a process checkpoint keeps tmpfs mounts). `None` when they could not
    /// be scanned (said in `degraded`).
    fn observe_tmpfs(
        &self,
        prev: Option<&Mark>,
        scan: bool,
        now: Option<&[ProcInfo]>,
        procs: &mut ProcFinding,
        degraded: &mut Vec<String>,
    ) -> Option<Vec<(PathBuf, TreeManifest)>> {
        let m = prev?;
        if !scan {
            return Some(m.tmpfs.clone());
        }
        let now_tmpfs = match self.scan_tmpfs(now.unwrap_or_default()) {
            Ok(t) => t,
            Err(e) => {
                degraded.push(e.to_string());
                return None;
            }
        };
        let changed = decide::tmpfs_changes(&m.tmpfs, &now_tmpfs);
        if changed > 0 {
            *procs.kernel.entry("tmpfs-entries".into()).or_default() += changed;
            procs.changed = procs_changed(procs);
        }
        Some(now_tmpfs)
    }

    /// What changed of the processes since the mark `m`, `now` being those alive now: started,
    /// ended, re-exec'd, holding a file the turn changed (`fs`), memory or kernel-held state
    /// that differs from the mark's, kernel state the counters saw change. What the next mark
    /// needs of them (run counts, images) goes into `seen`.
    fn observe_processes(
        &self,
        now: &[ProcInfo],
        m: &Mark,
        counters: Option<&CgroupCounters>,
        fs: &FsFinding,
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) -> ProcFinding {
        let events = decide::process_events(counters, &m.counters);
        let delta = procs::delta(&m.processes, now);
        let mut procs = ProcFinding {
            started: delta.started.iter().map(ProcSummary::from).collect(),
            ended: delta.ended.iter().map(ProcSummary::from).collect(),
            kernel: events.kernel,
            forks: events.forks,
            execs: events.execs,
            exits: events.exits,
            ..ProcFinding::default()
        };
        let before: HashMap<u32, &ProcInfo> = m.processes.iter().map(|p| (p.pid, p)).collect();
        let changed_paths: Vec<&Path> = fs
            .added
            .iter()
            .chain(&fs.modified)
            .chain(&fs.deleted)
            .map(PathBuf::as_path)
            .collect();
        let keep = self.keeps_self_contained();
        for p in &delta.persisted {
            if before
                .get(&p.pid)
                .is_some_and(|b| b.cmdline != p.cmdline || b.comm != p.comm)
            {
                procs.reexeced.push(ProcSummary::from(p));
            }
            // CRIU restores open and mapped files by path and checks them: a file this
            // turn changed under a persisting process needs a new process image.
            if !changed_paths.is_empty() {
                note_held_files(p.pid, &changed_paths, &mut procs.held_changed, degraded);
            }
            let ran = self.ran_or_state_changed(p.pid, m, events.foreign_writes, seen, degraded);
            let how = Ran {
                ran,
                foreign_writes: events.foreign_writes,
                keep,
            };
            self.observe_memory(p, m, how, &mut procs, seen, degraded);
        }
        self.observe_started(&delta.started, seen, degraded);
        procs.changed = procs_changed(&procs);
        procs
    }

    /// Whether persisting process `pid` may have changed since the mark `m`: it ran
    /// ([`decide::ran_since_mark`]), or it did not and what the kernel holds for it changed.
    /// Notes its run count now in `seen`.
    fn ran_or_state_changed(
        &self,
        pid: u32,
        m: &Mark,
        foreign_writes: bool,
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) -> bool {
        // Memory: a process that was not scheduled since the mark did not change it,
        // unless another process wrote into it (ptrace, process_vm_writev, /proc/PID/mem).
        let runs_now = self.run_count(pid);
        let ran = decide::ran_since_mark(foreign_writes, runs_now, m.run_counts.get(&pid).copied());
        if let Some(n) = runs_now {
            seen.run_counts.insert(pid, n);
        }
        // Idle, so its memory is the mark's; what the kernel holds for it may not be
        // (a signal left pending, bytes queued in its FIFO or socket, a counter or a
        // position moved through a shared file, stopped): read that again. A change
        // makes it count as a process that ran: its whole image is taken and compared.
        let (false, Some(img)) = (ran, m.memory.get(&pid)) else {
            return ran;
        };
        match self.held_state_of(pid, &mut seen.obs) {
            Ok(st) => {
                let changes = memory::compare_held(&img.state, &st);
                if changes.is_empty() {
                    return false;
                }
                log::debug!(
                    "pid {} of {} did not run, and its kernel state changed: {}",
                    pid,
                    self.target.container_id,
                    changes.join(", ")
                );
                true
            }
            Err(e) => {
                memory_error(degraded, pid, e);
                true
            }
        }
    }

    /// The memory of persisting process `p` against its image at the mark `m`, into `procs`,
    /// as [`decide::memory_step`] says for one that `ran` or not: carried as idle, its shared
    /// memory read again, or captured and compared. The image for the next mark goes into
    /// `seen`.
    fn observe_memory(
        &self,
        p: &ProcInfo,
        m: &Mark,
        how: Ran,
        procs: &mut ProcFinding,
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) {
        let ran = how.ran;
        let prev_img = m.memory.get(&p.pid);
        let step = decide::memory_step(ran, prev_img);
        if let MemoryStep::Carry(img) = step {
            if let Err(e) = seen.obs.carry(img) {
                memory_error(degraded, p.pid, e);
            }
            seen.memory_images.insert(p.pid, img.clone());
            if m.unproven.contains(&p.pid) {
                seen.unproven.insert(p.pid);
            }
            procs.idle.push(p.pid);
            return;
        }
        if seen.missing {
            seen.unproven.insert(p.pid);
        }
        // One that did not run but maps shared memory: only that can have changed.
        let img = match step {
            MemoryStep::RefreshShared(prev_img) => {
                match memory::refresh_shared(prev_img, &mut seen.obs) {
                    Ok(Some(img)) => Ok(img),
                    Ok(None) => self.capture(p.pid, &mut seen.obs),
                    Err(e) => Err(e),
                }
            }
            _ => self.capture(p.pid, &mut seen.obs),
        };
        // Read after the image: whatever reached it before is in this count.
        let interactions_after = self.interactions(p.pid);
        match (img, prev_img) {
            (Ok(mut img), Some(prev_img)) => {
                let mut d = memory::compare(prev_img, &img);
                let mut interactions_after = interactions_after;
                // A thread of it was not asleep when its image was read (woken and waiting
                // for a CPU on a busy host): its count cannot vouch for that image. Once it is
                // asleep again (bounded), its image and count are read again.
                if how.keep
                    && d.changed_pages + d.added_pages + d.removed_pages > 0
                    && !img.state.threads.iter().all(|t| t.sleeping)
                    && all_asleep_within(p.pid, &mut seen.asleep_budget)
                {
                    if let Ok(again) = self.capture(p.pid, &mut seen.obs) {
                        interactions_after = self.interactions(p.pid);
                        d = memory::compare(prev_img, &again);
                        img = again;
                    }
                }
                let unproven_base = m.unproven.contains(&p.pid);
                let changed = d.changed_pages + d.added_pages + d.removed_pages > 0;
                let not_own = changed.then(|| {
                    decide::not_own(&decide::OwnDoing {
                        kept: how.keep,
                        foreign_writes: how.foreign_writes,
                        before: prev_img.interactions,
                        after: interactions_after,
                        prev: prev_img,
                        now: &img,
                        state_changes: d.state_counted.len(),
                        unproven: unproven_base,
                    })
                });
                let self_contained = not_own == Some(None);
                // Why a change the policy could have kept was not: in the answer and the log.
                let not_kept = not_own.flatten().filter(|_| how.keep);
                if let Some(why) = not_kept {
                    log::info!(
                        "pid {} of {} changed {} pages, not kept: {why:?}",
                        p.pid,
                        self.target.container_id,
                        d.changed_pages + d.added_pages + d.removed_pages
                    );
                }
                if self_contained {
                    log::info!(
                        "pid {} of {} changed {} pages by its own doing alone: its last image \
                         is kept",
                        p.pid,
                        self.target.container_id,
                        d.changed_pages + d.added_pages + d.removed_pages
                    );
                }
                procs.memory.push(MemoryFinding {
                    pid: p.pid,
                    cmdline: ProcSummary::from(p).cmdline,
                    changed_pages: d.changed_pages,
                    added_pages: d.added_pages,
                    removed_pages: d.removed_pages,
                    scanned_pages: d.scanned_pages,
                    unproven_base,
                    regions: d.by_region.iter().take(3).cloned().collect(),
                    state: d.state_counted.clone(),
                    self_contained,
                    not_kept,
                });
                seen.memory_images.insert(p.pid, img);
            }
            (Ok(img), None) => {
                degraded.push(decide::no_image_reason(p.pid, m.over_limit.as_deref()));
                seen.memory_images.insert(p.pid, img);
            }
            (Err(source), _) => memory_error(degraded, p.pid, source),
        }
    }

    /// Captures the processes `started` since the mark, for the next mark (`seen`): a started
    /// process is a change by itself, its memory is not compared. A `[limits]` bound its
    /// capture passed degrades the turn; any other failure is only logged.
    fn observe_started(
        &self,
        started: &[ProcInfo],
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) {
        for p in started {
            if let Some(n) = self.run_count(p.pid) {
                seen.run_counts.insert(p.pid, n);
            }
            if seen.missing {
                seen.unproven.insert(p.pid);
            }
            match self.capture(p.pid, &mut seen.obs) {
                Ok(img) => {
                    seen.memory_images.insert(p.pid, img);
                }
                Err(e @ MemError::Limit { .. }) => memory_error(degraded, p.pid, e),
                Err(e) => log::debug!("memory of new pid {}: {e}", p.pid),
            }
        }
    }
}

/// What a turn end learnt of a persisting process before its memory is looked at.
#[derive(Debug, Clone, Copy)]
struct Ran {
    /// It may have changed since the mark ([`Inspection::ran_or_state_changed`]).
    ran: bool,
    /// Another task wrote into some process of the container since the mark.
    foreign_writes: bool,
    /// A self-contained change is kept ([`Inspection::keeps_self_contained`], once per turn).
    keep: bool,
}

/// Whether every thread of process `pid` is in interruptible sleep (`S`) within what is left of
/// `budget` (which the wait uses up), looked at every millisecond. `false` when one is not by
/// then or the process cannot be read.
pub(super) fn all_asleep_within(pid: u32, budget: &mut std::time::Duration) -> bool {
    let started = Instant::now();
    let asleep = asleep_by(pid, started + *budget);
    *budget = budget.saturating_sub(started.elapsed());
    asleep
}

fn asleep_by(pid: u32, deadline: Instant) -> bool {
    let task_dir = format!("/proc/{pid}/task");
    loop {
        let asleep = std::fs::read_dir(&task_dir).is_ok_and(|entries| {
            entries.flatten().all(|e| {
                std::fs::read_to_string(e.path().join("stat"))
                    .ok()
                    .and_then(|t| procs::parse_stat(&t))
                    .is_some_and(|st| st.state == 'S')
            })
        });
        if asleep {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Says in `degraded` why the memory of `pid` was not compared: a bound of the container's
/// (said once, whichever process passed it) or that process's own error.
fn memory_error(degraded: &mut Vec<String>, pid: u32, source: MemError) {
    match source {
        MemError::Limit { .. } => {
            let why = source.to_string();
            if !degraded.contains(&why) {
                degraded.push(why);
            }
        }
        source => degraded.push(InspectError::Memory { pid, source }.to_string()),
    }
}

/// Notes in `held_changed` the files persisting process `pid` holds (open or mapped) that the
/// turn changed (`changed_paths`) or that are deleted.
fn note_held_files(
    pid: u32,
    changed_paths: &[&Path],
    held_changed: &mut Vec<(u32, PathBuf)>,
    degraded: &mut Vec<String>,
) {
    match procs::held_files(pid) {
        Ok(held) => {
            for h in held {
                if h.deleted || changed_paths.iter().any(|c| *c == h.path) {
                    held_changed.push((pid, h.path));
                }
            }
        }
        Err(source) => degraded.push(InspectError::HeldFiles { pid, source }.to_string()),
    }
}
