//! What a shim does with the host-wide programs: [`HostProbes`] watches its container's cgroup,
//! reads the cgroup's counters and the run counts of its processes, and unwatches it again.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aya::maps::{MapData, MapError, PerCpuArray, PerCpuValues};
use log::{info, warn};
use nix::sys::statfs::BPF_FS_MAGIC;

use super::pins::{
    collect_stale_versions_locked, ensure_filesystems, fs_type, load_and_pin, open_pinned,
    pinned_map_id, DirLock, Maps,
};
use super::programs::{version_dir_name, RawCounters, RawQuota};
use super::{
    io_err, map_err, BpfError, CgroupCounters, ProgramStats, DEFAULT_PIN_ROOT, MAX_LEVELS,
};
use crate::sys::cgroup;

/// Bit set in an `oncpu` slot once its CPU has written it (inspector.h).
const ONCPU_VALID: u64 = 1 << 32;

/// Handle on the host-wide inspector programs (maps opened from bpffs).
pub struct HostProbes {
    root: PathBuf,
    maps: Mutex<Maps>,
    loaded_here: bool,
}

impl std::fmt::Debug for HostProbes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostProbes")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl HostProbes {
    /// Opens the host-wide programs pinned under `/sys/fs/bpf/crab/<version>/`,
    /// loading and attaching them first if absent (first shim on the host).
    /// Concurrent first shims serialize on `flock` of the pin root, so only one
    /// attaches. Mounts bpffs and tracefs if missing.
    pub fn open_or_load() -> Result<HostProbes, BpfError> {
        Self::open_or_load_at(Path::new(DEFAULT_PIN_ROOT))
    }

    /// [`Self::open_or_load`] with another pin root (tests, side-by-side
    /// installs). The root must be inside a bpf filesystem.
    pub fn open_or_load_at(root: &Path) -> Result<HostProbes, BpfError> {
        ensure_filesystems()?;
        fs::create_dir_all(root).map_err(io_err("creating", root))?;
        if fs_type(root).map_err(io_err("statfs", root))? != BPF_FS_MAGIC {
            return Err(BpfError::NotBpfFs {
                path: root.to_path_buf(),
            });
        }
        // bpffs refuses names with dots: none below.
        let dir = root.join(version_dir_name());
        if dir.exists() {
            // Fast path, no lock. It fails only if the pins go away meanwhile
            // (collect_stale_versions); then take the slow path.
            if let Ok(maps) = open_pinned(&dir) {
                return Ok(HostProbes::new(root, maps, false));
            }
        }
        let _lock = DirLock::exclusive(root)?;
        // Another shim may have published while we waited for the lock.
        let loaded_here = !dir.exists();
        if loaded_here {
            load_and_pin(root, &dir)?;
            collect_stale_versions_locked(root);
        }
        Ok(HostProbes::new(root, open_pinned(&dir)?, loaded_here))
    }

    fn new(root: &Path, maps: Maps, loaded_here: bool) -> HostProbes {
        HostProbes {
            root: root.to_path_buf(),
            maps: Mutex::new(maps),
            loaded_here,
        }
    }

    /// Whether this call loaded and attached the programs (first on the host)
    /// rather than opening existing pins.
    pub fn loaded_here(&self) -> bool {
        self.loaded_here
    }

    /// The directory holding this version's pins.
    pub fn pin_dir(&self) -> PathBuf {
        self.maps().dir.clone()
    }

    /// Attaches the program that counts the interactions of watched processes
    /// ([`Self::interactions`]) unless some shim already did: from then on it runs at every
    /// syscall's return on the host (a look at the task's storage, empty for every task outside
    /// the watched containers) until the version's pins are removed. Serialized with loads on
    /// the root lock.
    pub fn track_interactions(&self) -> Result<(), BpfError> {
        if self.interactions_tracked() {
            return Ok(());
        }
        let dir = self.pin_dir();
        let _lock = DirLock::exclusive(&self.root)?;
        if self.interactions_tracked() {
            return Ok(());
        }
        super::programs::attach_quiet(&dir)?;
        info!(
            "inspector: counting the interactions of watched processes ({})",
            dir.display()
        );
        Ok(())
    }

    /// Whether the interactions program is attached (its link is pinned): only then do
    /// [`Self::interactions`] counts move.
    pub fn interactions_tracked(&self) -> bool {
        self.pin_dir()
            .join("links")
            .join(super::programs::quiet_link_name())
            .exists()
    }

    /// What reached process `pid` (of a watched cgroup) from outside itself or went out of it,
    /// as the kernel saw it, since its entry was made: its syscalls other than the quiet ones
    /// (`quiet_syscall` in inspector.bpf.c) while the interactions program is attached, plus
    /// the signals queued to it. Two equal `Some(n)` mean nothing of the kind happened in
    /// between, provided the program was attached throughout; `None` (no entry) cannot say.
    pub fn interactions(&self, pid: u32) -> Result<Option<u64>, BpfError> {
        Ok(self
            .maps()
            .runs
            .get(pid)?
            .map(|run| run.interactions.wrapping_add(run.signals)))
    }

    pub(super) fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        // A panic while holding the lock leaves the maps themselves intact
        // (they live in the kernel): keep going.
        self.maps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts counting for a cgroup (zeroed, also if it was watched already), with no bound on
    /// the run entries its processes hold.
    pub fn watch(&self, cgroup_id: u64) -> Result<(), BpfError> {
        self.watch_bounded(cgroup_id, None)
    }

    /// [`Self::watch`], with at most `max_processes` processes of the cgroup holding a run
    /// entry at once (`None`: unbounded). The programs keep an entry per process with their
    /// task (no host-wide table to fill), but its memory is charged to the shim that loaded
    /// them: the quota bounds what one container makes them hold. Processes beyond it get no
    /// run count (their memory is compared at every turn) and are counted in
    /// [`CgroupCounters::over_quota`]. Watching again keeps the count of entries held.
    pub fn watch_bounded(
        &self,
        cgroup_id: u64,
        max_processes: Option<u64>,
    ) -> Result<(), BpfError> {
        let level = cgroup_level(cgroup_id)?;
        if level >= MAX_LEVELS {
            return Err(BpfError::TooDeep {
                id: cgroup_id,
                level,
            });
        }
        let mut maps = self.maps();
        for _ in 0..3 {
            let misses_base = maps.recursion_misses()?;
            // The level bit goes in first so that tasks of child cgroups are
            // matched from the moment the entry exists.
            let mask = watched_levels(&maps)? | (1 << level);
            maps.levels.set(0, mask, 0).map_err(map_err("levels"))?;
            // The quota before the counters: programs never see the cgroup watched without it.
            set_quota(&mut maps, cgroup_id, max_processes)?;
            let value = RawCounters {
                level,
                misses_base,
                ..Default::default()
            };
            let per_cpu = PerCpuValues::try_from(vec![value; possible_cpus()?]).map_err(|e| {
                BpfError::Syscall {
                    op: "per-CPU counters",
                    source: e,
                }
            })?;
            maps.watched
                .insert(cgroup_id, per_cpu, 0)
                .map_err(map_err("watched"))?;
            // A newer shim may have retired these pins while nothing was
            // watched through them (collect_stale_versions: it renames the
            // directory, then checks `watched` is still empty), and the
            // directory may even hold a fresh load by now. Checked after the
            // insert, so one of the two sees the other.
            if pinned_map_id(&maps.dir).ok() == Some(maps.watched_id) {
                info!("inspector: watching cgroup {cgroup_id} (level {level})");
                return Ok(());
            }
            warn!(
                "inspector: pins {} were retired; opening or loading them again",
                maps.dir.display()
            );
            let _ = maps.watched.remove(&cgroup_id);
            let _ = remove_quota(&mut maps, cgroup_id);
            *maps = HostProbes::open_or_load_at(&self.root)?
                .maps
                .into_inner()
                .unwrap_or_else(|e| e.into_inner());
        }
        Err(BpfError::Incomplete {
            path: maps.dir.clone(),
            detail: "pins keep disappearing".into(),
        })
    }

    /// Counts, for watched cgroup `cgroup_id`, the file changes that tasks outside every
    /// watched cgroup make on the filesystem whose `st_dev` is `dev` (the container's overlay
    /// rootfs, mounted: [`FsClass::Outside`](super::FsClass::Outside)): `docker cp` into the
    /// container, a host tool chrooted or nsentered into it, a write through the rootfs's host
    /// path. Only for a filesystem of the container's own (an overlay mount): registering the
    /// host's root filesystem would count every host process. Undone by [`Self::unwatch`].
    pub fn watch_rootfs(&self, cgroup_id: u64, dev: u64) -> Result<(), BpfError> {
        let key = kernel_dev(dev);
        let mut maps = self.maps();
        maps.rootfs
            .insert(key, cgroup_id, 0)
            .map_err(map_err("rootfs"))?;
        maps.rootfs_any
            .set(0, 1, 0)
            .map_err(map_err("rootfs_any"))?;
        info!("inspector: cgroup {cgroup_id} counts outside changes of its rootfs (dev {key:#x})");
        Ok(())
    }

    /// The rootfs registrations: kernel dev -> cgroup id (tests, diagnostics).
    pub fn rootfs_registrations(&self) -> Result<Vec<(u64, u64)>, BpfError> {
        self.maps()
            .rootfs
            .iter()
            .map(|kv| kv.map_err(map_err("rootfs")))
            .collect()
    }

    /// Run entries the processes of a watched cgroup hold and may hold (`None`: unbounded).
    pub fn quota(&self, cgroup_id: u64) -> Result<Option<(i64, i64)>, BpfError> {
        match self.maps().quotas.get(&cgroup_id, 0) {
            Ok(q) => Ok(Some((q.used, q.max))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(map_err("quotas")(e)),
        }
    }

    /// Stops counting for a cgroup and removes every entry that belongs to it
    /// (its counters, run counts of its processes).
    /// Not watched is not an error.
    pub fn unwatch(&self, cgroup_id: u64) -> Result<(), BpfError> {
        {
            let mut maps = self.maps();
            match maps.watched.remove(&cgroup_id) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err("watched")(e)),
            }
            let mask = watched_levels(&maps)?;
            maps.levels.set(0, mask, 0).map_err(map_err("levels"))?;
            remove_quota(&mut maps, cgroup_id)?;
            remove_rootfs(&mut maps, cgroup_id)?;
            sweep(&mut maps, cgroup_id)?;
        }
        // A program that found the entry just before its removal may still
        // insert a run count; programs run for microseconds, so a second
        // sweep a moment later catches it.
        std::thread::sleep(std::time::Duration::from_millis(2));
        sweep(&mut self.maps(), cgroup_id)?;
        info!("inspector: unwatched cgroup {cgroup_id}");
        Ok(())
    }

    /// Counters since [`Self::watch`].
    pub fn counters(&self, cgroup_id: u64) -> Result<CgroupCounters, BpfError> {
        let per_cpu = match self.maps().watched.get(&cgroup_id, 0) {
            Ok(values) => values,
            Err(e) if is_not_found(&e) => return Err(BpfError::NotWatched(cgroup_id)),
            Err(e) => return Err(map_err("watched")(e)),
        };
        let mut total = CgroupCounters::default();
        for cpu in per_cpu.iter() {
            for (sum, n) in total.fs_by_class.iter_mut().zip(cpu.fs_by_class) {
                *sum += n;
            }
            total.shared_writable_mmaps += cpu.shared_writable_mmaps;
            total.forks += cpu.forks;
            total.threads += cpu.threads;
            total.execs += cpu.execs;
            total.exits += cpu.exits;
            total.foreign_mem_writes += cpu.foreign_mem_writes;
            for (sum, n) in total.state_by_class.iter_mut().zip(cpu.state_by_class) {
                *sum += n;
            }
            total.errors += cpu.errors;
            total.over_quota += cpu.over_quota;
        }
        total.fs_mutations = total.fs_by_class.iter().sum();
        // Recursion misses are host-wide (any skipped program may have been
        // about this cgroup): charge them to everyone watching.
        let misses_base = per_cpu.first().map_or(0, |c| c.misses_base);
        total.errors += self.recursion_misses()?.saturating_sub(misses_base);
        Ok(total)
    }

    /// How many times the threads of process `pid` (of a watched cgroup) left
    /// a CPU since it was first seen. Contract: if two calls return
    /// `Some(n)` with the same `n`, the process did not run in between (so
    /// its own writes did not change its memory). `None` means "cannot say":
    /// the process is on a CPU right now (its count moves only when it stops),
    /// or it was never scheduled out since its cgroup is watched — treat as
    /// "ran". The count restarts if the pid is reused: compare per
    /// (pid, start time).
    pub fn run_count(&self, pid: u32) -> Result<Option<u64>, BpfError> {
        let maps = self.maps();
        // Order matters: "not on a CPU" first, then the count. A run that
        // overlaps the check either shows here or ends with a switch-out that
        // the count (read after) or the next call sees.
        if running_now(&maps.oncpu, pid)? {
            return Ok(None);
        }
        Ok(maps.runs.get(pid)?.map(|run| run.switches_out))
    }

    /// How many signals were queued to process `pid` (of a watched cgroup) since its entry was
    /// made (by its first switch-out or signal). Two equal `Some(n)` mean no signal was queued in
    /// between; `None` (no entry) cannot say. An entry made again (the pid reused, or an exec
    /// from another thread) starts again at 0: compare per (pid, start time).
    pub fn signals_queued(&self, pid: u32) -> Result<Option<u64>, BpfError> {
        Ok(self.maps().runs.get(pid)?.map(|run| run.signals))
    }

    /// The rseq areas (`struct rseq`, where the kernel writes the CPU a thread runs on) of
    /// the live threads of process `pid` seen leaving a CPU since its last exec (a thread that
    /// exits or unregisters its area takes it out), by user address; and whether that is all of them (`false`: more threads ran than
    /// the map has room for, or the process is not known). For
    /// [`crate::inspector::memory::CaptureOptions::volatile`].
    pub fn rseq_areas(&self, pid: u32) -> Result<(Vec<u64>, bool), BpfError> {
        let maps = self.maps();
        match maps.runs.get(pid)? {
            Some(run) => Ok((
                run.rseq.iter().copied().filter(|a| *a != 0).collect(),
                run.flags & super::programs::RUN_RSEQ_MORE == 0,
            )),
            None => Ok((Vec::new(), false)),
        }
    }

    /// Ids of all watched cgroups (of every shim on the host).
    pub fn watched(&self) -> Result<Vec<u64>, BpfError> {
        let maps = self.maps();
        let mut ids = Vec::new();
        for key in maps.watched.keys() {
            ids.push(key.map_err(map_err("watched"))?);
        }
        Ok(ids)
    }

    /// Unwatches cgroups that no longer exist: a shim killed with SIGKILL never unwatches its
    /// container, so every new shim sweeps what such shims left. Returns the ids removed.
    pub fn sweep_dead(&self) -> Result<Vec<u64>, BpfError> {
        let mount = cgroup::cgroup2_mount().map_err(|source| BpfError::Syscall {
            op: "find the cgroup2 mount",
            source,
        })?;
        let mut removed = Vec::new();
        for id in self.watched()? {
            match cgroup::cgroup_path_by_id(&mount.mount_point, id) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESTALE)) => {
                    self.unwatch(id)?;
                    removed.push(id);
                }
                _ => {}
            }
        }
        Ok(removed)
    }

    /// Sum of the kernel's recursion-miss counters of our programs: runs the
    /// kernel skipped, i.e. events nobody counted.
    pub fn recursion_misses(&self) -> Result<u64, BpfError> {
        self.maps().recursion_misses()
    }

    /// Kernel statistics of every inspector program (diagnostics, benchmarks).
    pub fn program_stats(&self) -> Result<Vec<ProgramStats>, BpfError> {
        self.maps().program_stats()
    }

    /// Run entries of the processes now in cgroup `cgroup_id` (or below it) that were made
    /// for it (diagnostics and tests: zero after [`Self::unwatch`]). An entry lives with its
    /// process (task storage): an exited process has none.
    pub fn entries_of(&self, cgroup_id: u64) -> Result<usize, BpfError> {
        let maps = self.maps();
        Ok(runs_of(&maps, cgroup_id)?.len())
    }
}

/// A key that is not (or no longer) there; aya reports it several ways.
fn is_not_found(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound | MapError::ElementNotFound => true,
        MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Number of possible CPUs: the length of every per-CPU value.
pub(super) fn possible_cpus() -> Result<usize, BpfError> {
    aya::util::nr_cpus().map_err(|(what, source)| BpfError::Io {
        what: "reading",
        path: PathBuf::from(what),
        source,
    })
}

pub(super) fn watched_levels(maps: &Maps) -> Result<u64, BpfError> {
    let mut mask = 0u64;
    for item in maps.watched.iter() {
        let (_, per_cpu) = match item {
            Ok(entry) => entry,
            Err(e) if is_not_found(&e) => continue,
            Err(e) => return Err(map_err("watched")(e)),
        };
        if let Some(level) = per_cpu.first().map(|c| c.level).filter(|l| *l < MAX_LEVELS) {
            mask |= 1 << level;
        }
    }
    Ok(mask)
}

/// The processes of cgroup `cgroup_id` (and of the cgroups below it) whose run entry was made
/// for that cgroup. Task storage cannot be listed: the cgroup's processes are asked one by one.
/// A cgroup that is gone has none.
fn runs_of(maps: &Maps, cgroup_id: u64) -> Result<Vec<u32>, BpfError> {
    let mut pids = Vec::new();
    for pid in cgroup_pids(cgroup_id)? {
        if maps
            .runs
            .get(pid)?
            .is_some_and(|run| run.cgroup_id == cgroup_id)
        {
            pids.push(pid);
        }
    }
    Ok(pids)
}

/// Bounds the run entries of `cgroup_id`'s processes (`None`: no bound), keeping the count of
/// those already held.
fn set_quota(maps: &mut Maps, cgroup_id: u64, max: Option<u64>) -> Result<(), BpfError> {
    let Some(max) = max else {
        return remove_quota(maps, cgroup_id);
    };
    let used = match maps.quotas.get(&cgroup_id, 0) {
        Ok(q) => q.used,
        Err(e) if is_not_found(&e) => 0,
        Err(e) => return Err(map_err("quotas")(e)),
    };
    let max = i64::try_from(max).unwrap_or(i64::MAX);
    maps.quotas
        .insert(cgroup_id, RawQuota { used, max }, 0)
        .map_err(map_err("quotas"))
}

fn remove_quota(maps: &mut Maps, cgroup_id: u64) -> Result<(), BpfError> {
    match maps.quotas.remove(&cgroup_id) {
        Ok(()) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(map_err("quotas")(e)),
    }
}

/// Removes the rootfs registrations of `cgroup_id` ([`HostProbes::watch_rootfs`]).
fn remove_rootfs(maps: &mut Maps, cgroup_id: u64) -> Result<(), BpfError> {
    let keys: Vec<u64> = maps
        .rootfs
        .iter()
        .filter_map(|kv| kv.ok())
        .filter(|(_, cg)| *cg == cgroup_id)
        .map(|(dev, _)| dev)
        .collect();
    for dev in keys {
        match maps.rootfs.remove(&dev) {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(map_err("rootfs")(e)),
        }
    }
    Ok(())
}

/// `st_dev` as user space sees it (glibc's encoding: major in bits 8-19 and 32-63, minor in
/// bits 0-7 and 20-31) in the kernel's internal `dev_t` (major << 20 | minor), which BPF reads
/// from `super_block::s_dev`.
pub(super) fn kernel_dev(dev: u64) -> u64 {
    let (major, minor) = (libc::major(dev) as u64, libc::minor(dev) as u64);
    (major << 20) | (minor & 0xf_ffff)
}

fn sweep(maps: &mut Maps, cgroup_id: u64) -> Result<(), BpfError> {
    for pid in runs_of(maps, cgroup_id)? {
        maps.runs.remove(pid)?;
    }
    Ok(())
}

/// The processes in cgroup `cgroup_id` and its descendants (`cgroup.procs`), walked
/// iteratively; nothing if the cgroup is gone.
fn cgroup_pids(cgroup_id: u64) -> Result<Vec<u32>, BpfError> {
    let mount = cgroup::cgroup2_mount().map_err(io_err(
        "finding the cgroup2 mount",
        Path::new("/proc/self/mountinfo"),
    ))?;
    let root = match cgroup::cgroup_path_by_id(&mount.mount_point, cgroup_id) {
        Ok(path) => path,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESTALE)) => {
            return Ok(Vec::new())
        }
        Err(e) => return Err(io_err("resolving a cgroup id under", &mount.mount_point)(e)),
    };
    let mut pids = Vec::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        // A cgroup removed meanwhile has no processes left.
        let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) else {
            continue;
        };
        pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        dirs.extend(
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
    }
    Ok(pids)
}

/// Is any thread of `pid` on a CPU (or is some online CPU's slot not yet
/// written, so we cannot tell)?
fn running_now(oncpu: &PerCpuArray<MapData, u64>, pid: u32) -> Result<bool, BpfError> {
    let slots = oncpu.get(&0, 0).map_err(map_err("oncpu"))?;
    let online = fs::read_to_string("/sys/devices/system/cpu/online").map_err(io_err(
        "reading",
        Path::new("/sys/devices/system/cpu/online"),
    ))?;
    for cpu in parse_cpu_list(&online) {
        match slots.get(cpu) {
            Some(slot) if slot & ONCPU_VALID == 0 => return Ok(true),
            Some(slot) if (slot & 0xffff_ffff) as u32 == pid => return Ok(true),
            _ => {}
        }
    }
    Ok(false)
}

/// Parses a kernel CPU list such as "0-3,8,10-11".
pub(super) fn parse_cpu_list(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let mut bounds = part.splitn(2, '-').map(|n| n.trim().parse::<usize>());
        match (bounds.next(), bounds.next()) {
            (Some(Ok(a)), None) => cpus.push(a),
            (Some(Ok(a)), Some(Ok(b))) if a <= b => cpus.extend(a..=b),
            _ => {}
        }
    }
    cpus
}

/// Depth of a cgroup in the cgroup2 tree, found from its id through the
/// kernel's file handles (also proves the id names a live cgroup).
pub(super) fn cgroup_level(cgroup_id: u64) -> Result<u64, BpfError> {
    let mount = cgroup::cgroup2_mount().map_err(io_err(
        "finding the cgroup2 mount",
        Path::new("/proc/self/mountinfo"),
    ))?;
    let path = cgroup::cgroup_path_by_id(&mount.mount_point, cgroup_id).map_err(|source| {
        BpfError::Io {
            what: "resolving cgroup id under",
            path: mount.mount_point.clone(),
            source: io::Error::new(source.kind(), format!("cgroup id {cgroup_id}: {source}")),
        }
    })?;
    Ok(mount.level_of(&path))
}
