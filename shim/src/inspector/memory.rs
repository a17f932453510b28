//! Exact memory images of a process: page hashes of the memory a checkpoint would have to store,
//! so that two images compare equal exactly when no byte of that memory changed.
//!
//! These kernels have no soft-dirty bits, so "did this process change its memory since the mark?"
//! is answered by hashing (xxh3-64) every page that holds process-private data and comparing with
//! the hashes taken at the mark.
//!
//! # What is covered
//! Every mapping whose contents live only in the process's memory (what CRIU dumps as pages):
//! - **private anonymous** mappings of any protection: heap, stacks, `mmap(MAP_PRIVATE|MAP_ANONYMOUS)`,
//!   `[anon:name]`. Read-only and `PROT_NONE` ones are included: JITs and GCs write pages and then
//!   mprotect them, so leaving them out would miss changes.
//! - **private file mappings**, again of any protection (library `.data`, RELRO, executables):
//!   only their copy-on-write pages are process memory; a page that was never written is the file's
//!   content, which is the filesystem side's business (the fs diff, and `procs::held_files` for
//!   files a process holds). The pagemap tells them apart, so `.data`/`.bss` of libraries are
//!   covered without hashing the libraries' code.
//! - **shared memory that is no file the fs side sees**: shared anonymous mappings, memfd, SysV
//!   shm, and shared mappings of tmpfs/hugetlbfs files (e.g. `/dev/shm`). Their contents are read
//!   from the shmem object itself (through `/proc/PID/map_files`), skipping holes, so pages another
//!   process wrote are seen and untouched ranges are not faulted in. (A *private* mapping of a
//!   tmpfs file is treated like any private file mapping: its unwritten pages are the file's.)
//!   One [`Observation`] (all the images of one turn end) reads each object's pages once,
//!   keyed by the object's device and inode (never by the name its mappers print), whatever
//!   number of processes or ranges map it: every image that maps it shares one list of hashes
//!   ([`SharedRef`]).
//! - Other **shared file mappings** contribute their layout only (range, offset, file): their pages
//!   are the file, written back to it.
//! - `[vdso]`, `[vvar]`, `[vsyscall]` and other kernel-provided mappings are left out.
//!
//! # Pages never touched (zero-page handling)
//! Pages are compared by *content*, keyed by virtual address. A page that was never faulted in reads
//! as zeros (anonymous/shmem) or as the file (private file mapping), so a region's image lists only
//! pages that differ from that default: anonymous pages that are not all-zero, and copy-on-write
//! pages of file mappings. Consequences:
//! - an untouched page and a page touched but still all-zero are equal. That is right for restore:
//!   restoring the older image yields the same bytes. It also keeps spontaneous kernel activity
//!   (khugepaged collapsing a range into a THP, which makes untouched pages present-with-zeros;
//!   KSM; swapping) from showing up as a change.
//! - pages mapped to the shared zero page (read but never written) are not read at all.
//! - a changed mapping layout (new/removed/moved/resized mapping, changed protection or backing)
//!   counts as added/removed/changed pages even where the pages themselves hold zeros: an older
//!   image without that mapping does not restore the process as it is now.
//!
//! # Beyond memory
//! A process's image is more than its pages, so the image also records cheap, stable kernel-side
//! state ([`ProcState`]): threads (tid, start time, stopped or not, the syscall each is blocked
//! in with its stack and instruction pointers, signal masks and pending sets, credentials), open
//! fds (target, `fdinfo` such as file position or an eventfd's count, and what the fd holds
//! beyond it: bytes queued in a pipe, FIFO or socket, a terminal's settings, see
//! [`super::held`]), cwd and root. A process that only opened a file, changed its signal mask
//! or had a signal left pending between two marks compares unequal too ([`compare_state`]; the
//! syscall site is described but does not count: it moves whenever the process runs, which
//! its memory tells). Registers other than those in `/proc/PID/syscall` cannot be read without
//! ptrace and are not compared: a tracer's writes count on their own (the host probes'
//! `ptrace-write` class).
//!
//! # Memory the kernel writes by itself
//! The kernel stores the current CPU (and node, mm_cid) into each thread's registered rseq area
//! (`struct rseq`, glibc 2.35+ registers one per thread) whenever the thread is scheduled after
//! a migration. A process that only woke up and went back to sleep on another CPU thus changes
//! one page per thread (seen in tests). That is no state a restore needs (the kernel rewrites it
//! after restore too), so callers that know the areas pass them as
//! [`CaptureOptions::volatile`] and they hash as zeros. Without ptrace the areas cannot be read
//! from /proc: the inspector learns them from the host probes (`task->rseq` of each thread
//! that leaves a CPU while its cgroup is watched) and, for restored processes, from the
//! checkpoint image (`thread_core.rseq_entry`), which covers a thread that went to sleep
//! before the watch began. An image taken before an area was known keeps the page's hash as
//! read; compared with one that left the area out, the bytes as read are compared.
//!
//! # Consistency
//! Capturing a *running* process reads a moving target: the image is a best-effort snapshot and will
//! most likely differ from the next one. Capture frozen processes (cgroup freezer) or blocked ones.
//!
//! Reading uses `process_vm_readv` in batches (falling back to `/proc/PID/mem` page by page when
//! it fails, which also reads `PROT_NONE` pages) and the `PAGEMAP_SCAN` ioctl (Linux 6.7+, falling
//! back to reading `/proc/PID/pagemap`) to find pages that are present or swapped. Work is spread
//! over the machine's cores. Pages that cannot be read are recorded and always count as changed.
//! Hash collisions (2^-64 per page pair) are the only inexactness.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use xxhash_rust::xxh3::xxh3_64;

use super::procs::{self, MapsLine};
use crate::sys::beneath;

mod compare;
mod image;
mod observe;
mod read;
mod scan;
mod state;

pub use compare::*;
pub use image::*;
pub use observe::*;
use read::*;
use scan::*;
pub use state::*;

/// Captures the memory image of process `pid` (see the module docs for what is covered).
pub fn capture(pid: u32) -> Result<MemoryImage, MemError> {
    capture_with(pid, &CaptureOptions::default())
}

pub fn capture_with(pid: u32, opts: &CaptureOptions) -> Result<MemoryImage, MemError> {
    capture_in(pid, opts, &mut Observation::unbounded())
}

/// The image of an idle process (one that did not run since `prev` was taken) whose only
/// possible change is in the shared memory it maps: `prev` with each shared region read
/// again from its object through `obs` (so a sleeping sharer of an object another process
/// already read costs nothing to read). `Ok(None)` when `prev` has a shared region not read
/// from its object, or the mapping no longer holds that object: take a whole image instead.
pub fn refresh_shared(
    prev: &MemoryImage,
    obs: &mut Observation,
) -> Result<Option<MemoryImage>, MemError> {
    let pid = prev.pid;
    let alive = |pid| -> Result<(), MemError> {
        match procs::identity(pid)? {
            Some((_, t)) if t == prev.start_time => Ok(()),
            _ => Err(MemError::Gone(pid)),
        }
    };
    if prev
        .regions
        .iter()
        .any(|r| r.kind == RegionKind::Shmem && r.shared.is_none())
    {
        return Ok(None);
    }
    alive(pid)?;
    obs.carry(prev)?;
    let t0 = Instant::now();
    let mut img = prev.clone();
    img.stats = CaptureStats {
        private_pages: prev.stats.private_pages,
        fdinfo_bytes: prev.stats.fdinfo_bytes,
        pagemap_scan: prev.stats.pagemap_scan,
        covered_pages: prev.stats.covered_pages,
        threads_used: 1,
        ..Default::default()
    };
    for r in &mut img.regions {
        let Some(s) = &mut r.shared else {
            continue;
        };
        let Ok(f) = open_shmem(&range_path(pid, r.start, r.end)) else {
            return Ok(None);
        };
        if shmem_id(&f).ok() != Some(s.id) {
            return Ok(None);
        }
        let read = obs.object_pages(&f, s.id, r.offset, r.offset + (r.end - r.start))?;
        s.hashes = read.hashes;
        img.stats.pages_read += read.pages_read;
        img.stats.shared_pages_reused += read.reused_pages;
    }
    alive(pid)?;
    img.stats.elapsed = t0.elapsed();
    Ok(Some(img))
}

/// Captures the memory image of process `pid` as part of the observation `obs`: shared
/// objects it has read already are not read again, and what is read counts against its
/// bounds ([`MemError::Limit`] past one, before reading more).
pub fn capture_in(
    pid: u32,
    opts: &CaptureOptions,
    obs: &mut Observation,
) -> Result<MemoryImage, MemError> {
    obs.budget.fail()?;
    let t0 = Instant::now();
    let (_, start_time) = procs::identity(pid)?.ok_or(MemError::Gone(pid))?;
    let ps = page_size();
    let maps = procs::read_maps(pid)?;
    let pagemap =
        File::open(format!("/proc/{pid}/pagemap")).map_err(io_err(pid, "open pagemap"))?;
    let mem = File::open(format!("/proc/{pid}/mem")).map_err(io_err(pid, "open mem"))?;
    let mut scanner = PresenceScanner::new(pid, &pagemap);
    let mut stats = CaptureStats::default();
    let (mut regions, jobs) = map_regions(pid, &maps, &mut scanner, obs, &mut stats)?;
    stats.pagemap_scan = scanner.ioctl_ok;

    // Read and hash the pages of the jobs, spread over threads by page count.
    let total: u64 = jobs.iter().map(|j| j.npages).sum();
    // Counted before anything is read or allocated for them.
    obs.budget.memory(total * ps)?;
    obs.budget.stats.memory_bytes += total * ps;
    stats.private_pages += total;
    let threads = match opts.threads {
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        n => n,
    }
    .clamp(1, 16);
    let threads = if total < 2048 { 1 } else { threads };
    stats.threads_used = threads;
    let mut volatile = opts.volatile.clone();
    volatile.sort_unstable();
    let (out, unreadable) = hash_jobs(pid, &mem, &jobs, total, threads, &volatile)?;
    stats.unreadable_pages += unreadable;
    stats.pages_read += total;
    place_hashes(&jobs, &out, &mut regions, ps);

    let fdinfo_budget = opts
        .max_fdinfo_bytes
        .unwrap_or(crab_runtime_config::LimitsConfig::default().max_fdinfo_bytes);
    let (state, fdinfo_read) = capture_state(pid, fdinfo_budget, &mut obs.budget)?;
    stats.fdinfo_bytes = fdinfo_read;
    // Everything above must belong to one process: a recycled pid would mix two.
    if procs::identity(pid)?.map(|i| i.1) != Some(start_time) {
        return Err(MemError::Gone(pid));
    }
    let masked = masked_pages(&mem, &volatile, ps);
    stats.elapsed = t0.elapsed();
    Ok(MemoryImage {
        pid,
        start_time,
        regions,
        state,
        stats,
        masked,
        interactions: None,
    })
}

/// The regions of process `pid`'s `maps` that an image holds, with the page ranges to read
/// through the process (jobs). Shared memory objects are read here, through `obs` (once per
/// observation); zero pages of private file mappings are hashed without reading.
fn map_regions(
    pid: u32,
    maps: &[MapsLine],
    scanner: &mut PresenceScanner<'_>,
    obs: &mut Observation,
    stats: &mut CaptureStats,
) -> Result<(Vec<Region>, Vec<Job>), MemError> {
    let ps = page_size();
    let mut regions: Vec<Region> = Vec::with_capacity(maps.len());
    let mut jobs: Vec<Job> = Vec::new();
    for m in maps {
        let Some(kind) = classify(pid, m) else {
            continue;
        };
        let mut region = Region {
            start: m.start,
            end: m.end,
            perms: String::from_utf8_lossy(&m.perms).into_owned(),
            offset: m.offset,
            dev: m.dev.clone(),
            inode: m.inode,
            name: String::from_utf8_lossy(&m.path).into_owned(),
            kind,
            pages: Vec::new(),
            shared: None,
        };
        let idx = regions.len();
        match kind {
            RegionKind::SharedFile => {}
            RegionKind::Anon | RegionKind::FilePrivate => {
                for (s, e, cats) in scanner.scan(m.start, m.end)? {
                    if cats & PAGE_IS_PFNZERO != 0 {
                        // Mapped to the zero page: zeros, no need to read.
                        if kind == RegionKind::FilePrivate {
                            obs.budget.memory(e - s)?;
                            stats.private_pages += (e - s) / ps;
                            let mut va = s;
                            while va < e {
                                region.pages.push((va, zero_hash()));
                                va += ps;
                            }
                        }
                        continue;
                    }
                    let private_copy = cats & PAGE_IS_SWAPPED != 0 || cats & PAGE_IS_FILE == 0;
                    if kind == RegionKind::FilePrivate && !private_copy {
                        continue; // the file's own page
                    }
                    push_jobs(&mut jobs, idx, s, e);
                }
            }
            RegionKind::Shmem => match shmem_file(pid, m).and_then(|f| Ok((shmem_id(&f)?, f))) {
                Ok((id, f)) => {
                    let read = obs.object_pages(&f, id, m.offset, m.offset + (m.end - m.start))?;
                    stats.pages_read += read.pages_read;
                    stats.shared_pages_reused += read.reused_pages;
                    region.shared = Some(SharedRef {
                        id,
                        hashes: read.hashes,
                    });
                }
                // A device (or anything else but a regular file) mapped shared: its `open` is
                // not the shim's to call, and reading it through the process may touch device
                // memory. Its content is unknown: the region always counts as changed.
                Err(e) if e.raw_os_error() == beneath::not_regular().raw_os_error() => {
                    log::debug!(
                        "pid {pid}: shared mapping at {:x} is no regular file: changed",
                        m.start
                    );
                    region.pages.push((m.start, UNREADABLE));
                    stats.unreadable_pages += region.page_count();
                }
                // Without map_files, read through the process (faults holes in; rare).
                Err(e) => {
                    log::debug!(
                        "pid {pid}: map_files for {:x}: {e}; reading via the process",
                        m.start
                    );
                    push_jobs(&mut jobs, idx, m.start, m.end);
                }
            },
        }
        stats.covered_pages += region.page_count();
        regions.push(region);
    }
    Ok((regions, jobs))
}

/// The hashes of the `total` pages of `jobs`, in their order, read through `mem` by `threads`
/// threads that share the jobs by page count; with the number of pages that could not be read.
fn hash_jobs(
    pid: u32,
    mem: &File,
    jobs: &[Job],
    total: u64,
    threads: usize,
    volatile: &[(u64, u64)],
) -> Result<(Vec<u64>, u64), MemError> {
    let mut out = vec![0u64; total as usize];
    let mut shares: Vec<(&[Job], &mut [u64])> = Vec::new();
    {
        let mut rest_jobs: &[Job] = jobs;
        let mut rest_out: &mut [u64] = &mut out;
        let mut done = 0u64;
        for t in 0..threads {
            let target = total * (t as u64 + 1) / threads as u64;
            let (mut n, mut pages) = (0usize, 0u64);
            while n < rest_jobs.len() && (done + pages < target || t == threads - 1) {
                pages += rest_jobs[n].npages;
                n += 1;
            }
            let (j, jr) = rest_jobs.split_at(n);
            let (o, or) = std::mem::take(&mut rest_out).split_at_mut(pages as usize);
            shares.push((j, o));
            rest_jobs = jr;
            rest_out = or;
            done += pages;
        }
    }
    let results: Vec<Result<u64, MemError>> = std::thread::scope(|s| {
        let handles: Vec<_> = shares
            .into_iter()
            .map(|(j, o)| s.spawn(move || read_jobs(pid, mem, j, o, volatile)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread panicked"))
            .collect()
    });
    let mut unreadable = 0;
    for r in results {
        unreadable += r?;
    }
    Ok((out, unreadable))
}

/// Puts the hashes read for `jobs` (`out`, in their order) into their regions, sorted by
/// address; a zero page of an anonymous region is left out (the same as untouched).
fn place_hashes(jobs: &[Job], out: &[u64], regions: &mut [Region], ps: u64) {
    let zh = zero_hash();
    let mut k = 0usize;
    for job in jobs {
        let region = &mut regions[job.region];
        for i in 0..job.npages {
            let h = out[k];
            k += 1;
            if h == zh && region.kind != RegionKind::FilePrivate {
                continue; // same as untouched
            }
            region.pages.push((job.va + i * ps, h));
        }
    }
    for r in regions {
        r.pages.sort_unstable_by_key(|p| p.0);
    }
}

/// The pages under the `volatile` ranges as read (unmasked), for comparisons with an image
/// that did not mask them: (page address, hash), sorted, one per page.
fn masked_pages(mem: &File, volatile: &[(u64, u64)], ps: u64) -> Vec<(u64, u64)> {
    let mut masked: Vec<(u64, u64)> = Vec::new();
    for &(a, l) in volatile {
        let mut va = a / ps * ps;
        while va < a.saturating_add(l) {
            if masked.last().map(|m| m.0) != Some(va) {
                let mut page = vec![0u8; ps as usize];
                if matches!(mem.read_at(&mut page, va), Ok(n) if n as u64 == ps) {
                    masked.push((va, xxh3_64(&page)));
                }
            }
            va += ps;
        }
    }
    masked.sort_unstable_by_key(|m| m.0);
    masked.dedup_by_key(|m| m.0);
    masked
}

/// Which kind of region a maps line is, or `None` to leave it out.
fn classify(pid: u32, m: &MapsLine) -> Option<RegionKind> {
    let path = &m.path[..];
    if path.starts_with(b"[")
        && !(path == b"[heap]"
            || path.starts_with(b"[stack")
            || path.starts_with(b"[anon:")
            || path.starts_with(b"[anon_shmem:"))
    {
        // [vdso], [vvar], [vvar_vclock], [vsyscall], [uprobes], ...: provided by the kernel.
        return None;
    }
    let private = m.perms[3] == b'p';
    if private {
        return Some(if m.inode == 0 {
            RegionKind::Anon
        } else {
            RegionKind::FilePrivate
        });
    }
    if m.inode == 0 || path.starts_with(b"[anon_shmem:") {
        return Some(RegionKind::Shmem);
    }
    // Shared file mapping: is the file shmem (tmpfs, memfd, SysV, shared anon) or hugetlbfs?
    use nix::sys::statfs::{statfs, HUGETLBFS_MAGIC, TMPFS_MAGIC};
    let shmem = if let Ok(sfs) = statfs(&map_files_path(pid, m)) {
        matches!(sfs.filesystem_type(), TMPFS_MAGIC | HUGETLBFS_MAGIC)
    } else {
        path.starts_with(b"/memfd:")
            || path.starts_with(b"/SYSV")
            || path.starts_with(b"/dev/zero (deleted)")
            || path.starts_with(b"/anon_hugepage")
    };
    Some(if shmem {
        RegionKind::Shmem
    } else {
        RegionKind::SharedFile
    })
}

/// The shmem object behind a shared mapping, open for reading. Through
/// `/proc/PID/map_files/<range>`, which is the mapped object itself, never through the path
/// the maps print: a memfd's "path" is a name its creator chose, and whatever the container
/// put at that name (a device node, a FIFO, a symlink to a host file) is not the memory.
/// Only a regular file is opened (memfd, SysV shm, shared anonymous memory and tmpfs or
/// hugetlbfs files all are): the link is resolved to an `O_PATH` handle, checked, and that
/// handle reopened ([`crate::sys::beneath::reopen_regular`]), so no device's `open` ever runs.
fn shmem_file(pid: u32, m: &MapsLine) -> io::Result<File> {
    open_shmem(&map_files_path(pid, m))
}

/// [`shmem_file`] of the mapping `/proc/PID/map_files/<range>` names.
fn open_shmem(map_file: &std::path::Path) -> io::Result<File> {
    let handle = beneath::open_handle(map_file)?;
    beneath::reopen_regular(handle.as_fd(), libc::O_RDONLY)
}

/// The object an open shmem file is.
fn shmem_id(f: &File) -> io::Result<ShmemId> {
    use std::os::unix::fs::MetadataExt;
    let md = f.metadata()?;
    Ok(ShmemId {
        dev: md.dev(),
        ino: md.ino(),
    })
}

fn map_files_path(pid: u32, m: &MapsLine) -> PathBuf {
    range_path(pid, m.start, m.end)
}

fn range_path(pid: u32, start: u64, end: u64) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{start:x}-{end:x}"))
}

/// What the root-only tests of real processes (`tests/root_memory.rs`) compare below
/// [`capture`]: the two ways of reading which pages are present.
#[doc(hidden)]
pub mod testing {
    use super::*;

    /// Which pages of a process are present or swapped, read through its open `pagemap`.
    pub struct PresenceScan<'a>(PresenceScanner<'a>);

    impl<'a> PresenceScan<'a> {
        pub fn new(pid: u32, pagemap: &'a File) -> Self {
            PresenceScan(PresenceScanner::new(pid, pagemap))
        }

        /// Runs of `(start, end, categories)` in `[start, end)`, by reading the pagemap.
        pub fn by_read(&mut self, start: u64, end: u64) -> Result<Vec<(u64, u64, u64)>, MemError> {
            self.0.scan_read(start, end)
        }

        /// The same with the `PAGEMAP_SCAN` ioctl (an error where the kernel lacks it).
        pub fn by_ioctl(&mut self, start: u64, end: u64) -> io::Result<Vec<(u64, u64, u64)>> {
            self.0.scan_ioctl(start, end)
        }
    }
}

#[cfg(test)]
mod tests;
