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
//! state: threads (tid, start time, the syscall each is blocked in with its stack and
//! instruction pointers, signal masks, credentials), open fds (target and `fdinfo` such as file
//! position), cwd and root. A process that only opened a file or changed its signal mask between two
//! marks compares unequal too. Registers other than those in `/proc/PID/syscall` cannot be read
//! without ptrace and are not compared.
//!
//! # Memory the kernel writes by itself
//! The kernel stores the current CPU (and node, mm_cid) into each thread's registered rseq area
//! (`struct rseq`, glibc 2.35+ registers one per thread) whenever the thread is scheduled after
//! a migration. A process that only woke up and went back to sleep on another CPU thus changes
//! one page per thread (seen in tests). That is no state a restore needs (the kernel rewrites it
//! after restore too), so callers that know the areas pass them as
//! [`CaptureOptions::volatile`] and they hash as zeros. Without ptrace the areas cannot be read
//! from /proc; the BPF side can record `task->rseq` per thread.
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
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::{lseek, Pid, Whence};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::procs::{self, MapsLine, ProcfsError};
use crate::sys::beneath;

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    /// The process exited (or its pid was recycled) before or while it was captured.
    #[error("process {0} is gone")]
    Gone(u32),
    #[error("{what} of process {pid}: {source}")]
    Io {
        pid: u32,
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Proc(ProcfsError),
}

impl From<ProcfsError> for MemError {
    fn from(e: ProcfsError) -> Self {
        match e {
            ProcfsError::Gone(pid) => MemError::Gone(pid),
            e => MemError::Proc(e),
        }
    }
}

fn io_err(pid: u32, what: impl Into<String>) -> impl FnOnce(io::Error) -> MemError {
    let what = what.into();
    move |source| {
        if source.kind() == io::ErrorKind::NotFound || source.raw_os_error() == Some(libc::ESRCH) {
            MemError::Gone(pid)
        } else {
            MemError::Io { pid, what, source }
        }
    }
}

/// Page hash recorded for a page that could not be read; it compares unequal to everything.
const UNREADABLE: u64 = u64::MAX;

pub fn page_size() -> u64 {
    static PS: OnceLock<u64> = OnceLock::new();
    *PS.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .unwrap_or(4096) as u64
    })
}

fn zero_hash() -> u64 {
    static ZH: OnceLock<u64> = OnceLock::new();
    *ZH.get_or_init(|| xxh3_64(&vec![0u8; page_size() as usize]))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionKind {
    /// Private anonymous: heap, stacks, anonymous mmaps. Default page content: zeros.
    Anon,
    /// Private file mapping. Default page content: the file's; listed pages are copy-on-write ones.
    FilePrivate,
    /// Shared anonymous, memfd, SysV shm, tmpfs/hugetlbfs files. Default page content: zeros.
    Shmem,
    /// Shared mapping of a regular file: layout only.
    SharedFile,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    /// "rw-p" etc.
    pub perms: String,
    /// File offset in bytes (maps field 3).
    pub offset: u64,
    pub dev: String,
    pub inode: u64,
    /// Path or pseudo name from maps (`[heap]`, `/usr/lib/x.so`, empty for anonymous).
    pub name: String,
    pub kind: RegionKind,
    /// `(page address, xxh3-64)` of the pages whose content differs from the kind's default,
    /// sorted by address. Empty for `SharedFile`.
    pub pages: Vec<(u64, u64)>,
}

impl Region {
    pub fn page_count(&self) -> u64 {
        (self.end - self.start) / page_size()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ThreadState {
    pub tid: u32,
    pub start_time: u64,
    pub comm: String,
    /// From `/proc/PID/task/TID/syscall`: syscall number, sp, pc (or "running").
    pub syscall: String,
    /// Signal masks, pending signals, credentials, capabilities, seccomp (from status).
    pub status: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FdState {
    pub fd: i32,
    pub target: String,
    /// `fdinfo` lines (position, flags, epoll/inotify/eventfd state), minus timerfd's
    /// remaining time which changes by itself.
    pub info: Vec<String>,
}

/// Kernel-side process state that is cheap to read and stable while the process does nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ProcState {
    pub threads: Vec<ThreadState>,
    pub fds: Vec<FdState>,
    pub cwd: String,
    pub root: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureStats {
    /// Pages read and hashed.
    pub pages_read: u64,
    pub unreadable_pages: u64,
    /// Pages covered by the image's regions (untouched ones included).
    pub covered_pages: u64,
    /// Whether the PAGEMAP_SCAN ioctl was available (else /proc/PID/pagemap was read).
    pub pagemap_scan: bool,
    pub threads_used: usize,
    pub elapsed: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryImage {
    pub pid: u32,
    pub start_time: u64,
    pub regions: Vec<Region>,
    pub state: ProcState,
    pub stats: CaptureStats,
}

#[derive(Debug, Clone, Default)]
pub struct CaptureOptions {
    /// Reader/hasher threads; 0 = the number of CPUs.
    pub threads: usize,
    /// Byte ranges `(address, length)` hashed as zeros: memory the *kernel* rewrites on its own
    /// and restores by itself, such as each thread's rseq area (`struct rseq`, 32 bytes: the
    /// kernel stores the current CPU, node and mm_cid there whenever the thread is scheduled, so
    /// a thread that merely ran on another CPU would otherwise show a changed page). Use the
    /// same ranges for the images you compare.
    pub volatile: Vec<(u64, u64)>,
    /// Bytes of `fdinfo` text kept for the whole process (`[limits] max_fdinfo_bytes`;
    /// `None`: its default). Beyond it an fd's info is kept as a hash ([`fdinfo_lines`]).
    pub max_fdinfo_bytes: Option<u64>,
}

/// Captures the memory image of process `pid` (see the module docs for what is covered).
pub fn capture(pid: u32) -> Result<MemoryImage, MemError> {
    capture_with(pid, &CaptureOptions::default())
}

pub fn capture_with(pid: u32, opts: &CaptureOptions) -> Result<MemoryImage, MemError> {
    let t0 = Instant::now();
    let (_, start_time) = procs::identity(pid)?.ok_or(MemError::Gone(pid))?;
    let ps = page_size();
    let maps = procs::read_maps(pid)?;
    let pagemap =
        File::open(format!("/proc/{pid}/pagemap")).map_err(io_err(pid, "open pagemap"))?;
    let mem = File::open(format!("/proc/{pid}/mem")).map_err(io_err(pid, "open mem"))?;
    let mut scanner = PresenceScanner::new(pid, &pagemap);

    let mut regions: Vec<Region> = Vec::with_capacity(maps.len());
    let mut jobs: Vec<Job> = Vec::new();
    let mut stats = CaptureStats::default();
    let mut buf = vec![0u8; SHMEM_CHUNK];

    for m in &maps {
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
        };
        let idx = regions.len();
        match kind {
            RegionKind::SharedFile => {}
            RegionKind::Anon | RegionKind::FilePrivate => {
                for (s, e, cats) in scanner.scan(m.start, m.end)? {
                    if cats & PAGE_IS_PFNZERO != 0 {
                        // Mapped to the zero page: zeros, no need to read.
                        if kind == RegionKind::FilePrivate {
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
            RegionKind::Shmem => match shmem_file(pid, m) {
                Ok(f) => {
                    stats.pages_read += hash_shmem(&f, m, &mut region.pages, &mut buf);
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
    stats.pagemap_scan = scanner.ioctl_ok;

    // Read and hash the pages of the jobs, spread over threads by page count.
    let total: u64 = jobs.iter().map(|j| j.npages).sum();
    let threads = match opts.threads {
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        n => n,
    }
    .clamp(1, 16);
    let threads = if total < 2048 { 1 } else { threads };
    stats.threads_used = threads;
    let mut out = vec![0u64; total as usize];
    let mut shares: Vec<(&[Job], &mut [u64])> = Vec::new();
    {
        let mut rest_jobs: &[Job] = &jobs;
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
    let mut volatile = opts.volatile.clone();
    volatile.sort_unstable();
    let results: Vec<Result<u64, MemError>> = std::thread::scope(|s| {
        let handles: Vec<_> = shares
            .into_iter()
            .map(|(j, o)| {
                let (mem, volatile) = (&mem, &volatile[..]);
                s.spawn(move || read_jobs(pid, mem, j, o, volatile))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread panicked"))
            .collect()
    });
    for r in results {
        stats.unreadable_pages += r?;
    }
    stats.pages_read += total;

    let zh = zero_hash();
    let mut k = 0usize;
    for job in &jobs {
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
    for r in &mut regions {
        r.pages.sort_unstable_by_key(|p| p.0);
    }

    let fdinfo_budget = opts
        .max_fdinfo_bytes
        .unwrap_or(crab_runtime_config::LimitsConfig::default().max_fdinfo_bytes);
    let state = capture_state(pid, fdinfo_budget)?;
    // Everything above must belong to one process: a recycled pid would mix two.
    if procs::identity(pid)?.map(|i| i.1) != Some(start_time) {
        return Err(MemError::Gone(pid));
    }
    stats.elapsed = t0.elapsed();
    Ok(MemoryImage {
        pid,
        start_time,
        regions,
        state,
        stats,
    })
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
    let handle = beneath::open_handle(&map_files_path(pid, m))?;
    beneath::reopen_regular(handle.as_fd(), libc::O_RDONLY)
}

fn map_files_path(pid: u32, m: &MapsLine) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
}

/// A run of pages to read from the process.
#[derive(Debug, Clone, Copy)]
struct Job {
    region: usize,
    va: u64,
    npages: u64,
}

/// Jobs are kept small so that threads get even shares.
const JOB_PAGES: u64 = 256;

fn push_jobs(jobs: &mut Vec<Job>, region: usize, start: u64, end: u64) {
    let ps = page_size();
    let mut va = start;
    while va < end {
        let n = ((end - va) / ps).min(JOB_PAGES);
        jobs.push(Job {
            region,
            va,
            npages: n,
        });
        va += n * ps;
    }
}

/// Bytes read per process_vm_readv call: small enough to stay in cache while it is hashed.
const BATCH_BYTES: u64 = 512 * 1024;
const MAX_IOV: usize = 1024;

/// Reads and hashes the pages of `jobs` in order into `out`; returns the number of unreadable pages.
/// Hash of the page at `va` whose bytes are `page`, with the volatile ranges zeroed.
fn hash_page(page: &mut [u8], va: u64, volatile: &[(u64, u64)]) -> u64 {
    let end = va + page.len() as u64;
    // Ranges are few (one per thread) and sorted by address.
    let first = volatile.partition_point(|r| r.0 + r.1 <= va);
    for &(a, l) in volatile[first..].iter().take_while(|r| r.0 < end) {
        let (s, e) = (a.max(va), (a + l).min(end));
        if s < e {
            page[(s - va) as usize..(e - va) as usize].fill(0);
        }
    }
    xxh3_64(page)
}

fn read_jobs(
    pid: u32,
    mem: &File,
    jobs: &[Job],
    out: &mut [u64],
    volatile: &[(u64, u64)],
) -> Result<u64, MemError> {
    let ps = page_size();
    let mut buf = vec![0u8; BATCH_BYTES as usize];
    let mut unreadable = 0u64;
    // Runs of (address, pages) still to read in the current batch.
    let mut runs: Vec<(u64, u64)> = Vec::with_capacity(MAX_IOV);
    let mut k = 0usize; // next output slot
    let mut ji = 0usize;
    let mut job_off = 0u64; // pages of jobs[ji] already put into batches
    loop {
        // Fill a batch.
        runs.clear();
        let mut batch_pages = 0u64;
        while ji < jobs.len() && runs.len() < MAX_IOV && batch_pages * ps < BATCH_BYTES {
            let j = jobs[ji];
            let take = (j.npages - job_off).min(BATCH_BYTES / ps - batch_pages);
            let va = j.va + job_off * ps;
            match runs.last_mut() {
                Some(last) if last.0 + last.1 * ps == va => last.1 += take,
                _ => runs.push((va, take)),
            }
            batch_pages += take;
            job_off += take;
            if job_off == j.npages {
                ji += 1;
                job_off = 0;
            }
        }
        if batch_pages == 0 {
            break;
        }
        // Read it, retrying past pages that fail.
        let mut first = 0usize; // index into runs
        let mut skip = 0u64; // pages of runs[first] already done
        while first < runs.len() {
            let iov: Vec<RemoteIoVec> = runs[first..]
                .iter()
                .enumerate()
                .map(|(i, (va, n))| {
                    let (va, n) = if i == 0 {
                        (va + skip * ps, n - skip)
                    } else {
                        (*va, *n)
                    };
                    RemoteIoVec {
                        base: va as usize,
                        len: (n * ps) as usize,
                    }
                })
                .collect();
            let want: u64 = iov.iter().map(|v| v.len as u64).sum();
            // Remote addresses are only read by the kernel on the other process's behalf.
            let read = process_vm_readv(
                Pid::from_raw(pid as libc::pid_t),
                &mut [io::IoSliceMut::new(&mut buf[..want as usize])],
                &iov,
            );
            let got = match read {
                Ok(n) => n as u64,
                Err(Errno::ESRCH) => return Err(MemError::Gone(pid)),
                Err(Errno::EFAULT | Errno::EIO | Errno::ENOMEM) => 0,
                Err(e) => {
                    return Err(MemError::Io {
                        pid,
                        what: "process_vm_readv".into(),
                        source: e.into(),
                    })
                }
            };
            let full = got / ps;
            let mut va = runs[first].0 + skip * ps;
            let mut r = first;
            let mut left = runs[first].1 - skip;
            for p in 0..full as usize {
                if left == 0 {
                    r += 1;
                    va = runs[r].0;
                    left = runs[r].1;
                }
                out[k] = hash_page(
                    &mut buf[p * ps as usize..(p + 1) * ps as usize],
                    va,
                    volatile,
                );
                k += 1;
                va += ps;
                left -= 1;
            }
            // Advance the cursor by `full` pages.
            let mut adv = full;
            while adv > 0 {
                let left = runs[first].1 - skip;
                if adv >= left {
                    adv -= left;
                    first += 1;
                    skip = 0;
                } else {
                    skip += adv;
                    adv = 0;
                }
            }
            if got == want {
                break;
            }
            // The next page failed: PROT_NONE, or unmapped meanwhile. /proc/PID/mem reads with
            // FOLL_FORCE, so it gets PROT_NONE pages that still hold data.
            let va = runs[first].0 + skip * ps;
            let page = &mut buf[..ps as usize];
            out[k] = match mem.read_at(page, va) {
                Ok(n) if n as u64 == ps => hash_page(page, va, volatile),
                _ => {
                    log::debug!("pid {pid}: page {va:#x} unreadable");
                    unreadable += 1;
                    UNREADABLE
                }
            };
            k += 1;
            skip += 1;
            if skip == runs[first].1 {
                first += 1;
                skip = 0;
            }
        }
    }
    debug_assert_eq!(k, out.len());
    Ok(unreadable)
}

const SHMEM_CHUNK: usize = 1 << 20;

/// Hashes the data (non-hole) pages of a shmem-backed mapping from the shmem file itself.
/// Returns the number of pages read. Pages past the file's end read as zeros (the process
/// would get SIGBUS there, there is no data).
fn hash_shmem(f: &File, m: &MapsLine, pages: &mut Vec<(u64, u64)>, buf: &mut [u8]) -> u64 {
    let ps = page_size();
    let zh = zero_hash();
    let (lo, hi) = (m.offset, m.offset + (m.end - m.start));
    let mut read = 0u64;
    let mut pos = lo;
    while pos < hi {
        let Ok(data) = lseek(f.as_raw_fd(), pos as libc::off_t, Whence::SeekData) else {
            break; // ENXIO: no data after pos (EINVAL: no SEEK_DATA: handled by the else below)
        };
        let data = (data as u64 / ps) * ps;
        if data >= hi {
            break;
        }
        let hole = match lseek(f.as_raw_fd(), data as libc::off_t, Whence::SeekHole) {
            Ok(hole) => (hole as u64).div_ceil(ps) * ps,
            Err(_) => hi,
        }
        .min(hi);
        let mut off = data.max(pos);
        while off < hole {
            let len = ((hole - off) as usize).min(buf.len());
            let chunk = &mut buf[..len];
            let mut n = 0usize;
            while n < len {
                match f.read_at(&mut chunk[n..], off + n as u64) {
                    Ok(0) => break, // past EOF of a file shorter than the mapping
                    Ok(r) => n += r,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            chunk[n..].fill(0);
            for p in 0..len / ps as usize {
                let h = xxh3_64(&chunk[p * ps as usize..(p + 1) * ps as usize]);
                read += 1;
                if h != zh {
                    pages.push((m.start + (off - lo) + p as u64 * ps, h));
                }
            }
            off += len as u64;
        }
        pos = hole;
    }
    read
}

// PAGEMAP_SCAN (linux/fs.h, 6.7+).
const PAGE_IS_FILE: u64 = 1 << 2;
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;
const PAGE_IS_PFNZERO: u64 = 1 << 5;

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

// _IOWR('f', 16, struct pm_scan_arg)
const PAGEMAP_SCAN: libc::c_ulong = (3 << 30)
    | ((std::mem::size_of::<PmScanArg>() as libc::c_ulong) << 16)
    | ((b'f' as libc::c_ulong) << 8)
    | 16;

/// Finds the pages of a range that are present or swapped, with their PAGE_IS_* categories.
struct PresenceScanner<'a> {
    pid: u32,
    pagemap: &'a File,
    ioctl_ok: bool,
    vec: Vec<PageRegion>,
    raw: Vec<u8>,
}

impl<'a> PresenceScanner<'a> {
    fn new(pid: u32, pagemap: &'a File) -> Self {
        PresenceScanner {
            pid,
            pagemap,
            ioctl_ok: true,
            vec: vec![PageRegion::default(); 1024],
            raw: Vec::new(),
        }
    }

    /// Runs of `(start, end, categories)` in `[start, end)` that are present or swapped.
    fn scan(&mut self, start: u64, end: u64) -> Result<Vec<(u64, u64, u64)>, MemError> {
        if self.ioctl_ok {
            match self.scan_ioctl(start, end) {
                Ok(v) => return Ok(v),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY) | Some(libc::EINVAL)) => {
                    log::debug!("PAGEMAP_SCAN unavailable ({e}); reading pagemap");
                    self.ioctl_ok = false;
                }
                Err(e) => return Err(io_err(self.pid, "PAGEMAP_SCAN")(e)),
            }
        }
        self.scan_read(start, end)
    }

    fn scan_ioctl(&mut self, start: u64, end: u64) -> io::Result<Vec<(u64, u64, u64)>> {
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        let mut pos = start;
        while pos < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                start: pos,
                end,
                vec: self.vec.as_mut_ptr() as u64,
                vec_len: self.vec.len() as u64,
                category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE | PAGE_IS_PFNZERO,
                ..Default::default()
            };
            // SAFETY: arg and vec are valid for the kernel to write; sizes given.
            let n = unsafe { libc::ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            for r in &self.vec[..n as usize] {
                match out.last_mut() {
                    Some(l) if l.1 == r.start && l.2 == r.categories => l.1 = r.end,
                    _ => out.push((r.start, r.end, r.categories)),
                }
            }
            if arg.walk_end <= pos {
                break; // no progress: should not happen
            }
            pos = arg.walk_end;
        }
        Ok(out)
    }

    fn scan_read(&mut self, start: u64, end: u64) -> Result<Vec<(u64, u64, u64)>, MemError> {
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE_OR_SHARED: u64 = 1 << 61;
        const PFN_MASK: u64 = (1 << 55) - 1;
        let ps = page_size();
        let zero_pfn = zero_pfn();
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        let mut va = start;
        const CHUNK: u64 = 32 * 1024;
        while va < end {
            let n = ((end - va) / ps).min(CHUNK);
            self.raw.resize((n * 8) as usize, 0);
            self.pagemap
                .read_exact_at(&mut self.raw, va / ps * 8)
                .map_err(io_err(self.pid, "pagemap"))?;
            for (i, e) in self.raw.chunks_exact(8).enumerate() {
                let e = u64::from_ne_bytes(e.try_into().unwrap());
                let mut cats = 0;
                if e & PRESENT != 0 {
                    cats |= PAGE_IS_PRESENT;
                    if zero_pfn.is_some_and(|z| z == e & PFN_MASK) {
                        cats |= PAGE_IS_PFNZERO;
                    }
                }
                if e & SWAPPED != 0 {
                    cats |= PAGE_IS_SWAPPED;
                }
                if e & FILE_OR_SHARED != 0 {
                    cats |= PAGE_IS_FILE;
                }
                if cats & (PAGE_IS_PRESENT | PAGE_IS_SWAPPED) == 0 {
                    continue;
                }
                let a = va + i as u64 * ps;
                match out.last_mut() {
                    Some(l) if l.1 == a && l.2 == cats => l.1 = a + ps,
                    _ => out.push((a, a + ps, cats)),
                }
            }
            va += n * ps;
        }
        Ok(out)
    }
}

/// The PFN of the kernel's shared zero page, read once from our own pagemap (pagemap fallback only).
fn zero_pfn() -> Option<u64> {
    static Z: OnceLock<Option<u64>> = OnceLock::new();
    *Z.get_or_init(|| {
        let ps = page_size() as usize;
        // SAFETY: anonymous private mapping, read once to map the zero page, then unmapped.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                ps,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return None;
            }
            std::ptr::read_volatile(p as *const u8);
            let f = File::open("/proc/self/pagemap").ok();
            let mut e = [0u8; 8];
            let r = f.and_then(|f| f.read_exact_at(&mut e, p as u64 / ps as u64 * 8).ok());
            libc::munmap(p, ps);
            r?;
            let e = u64::from_ne_bytes(e);
            (e >> 63 == 1 && e & ((1 << 55) - 1) != 0).then_some(e & ((1 << 55) - 1))
        }
    })
}

/// Where a thread waits: `/proc/PID/task/TID/syscall` reduced to the syscall number, stack
/// pointer and instruction pointer. The six argument registers are left out: the kernel prints
/// all six whatever the syscall takes, so unused ones hold leftovers of earlier user code (seen:
/// a `read` whose r8-r10 differed after an unrelated store), and the used ones point into memory
/// that is hashed anyway.
fn syscall_site(line: &str) -> String {
    let f: Vec<&str> = line.split_whitespace().collect();
    match f.len() {
        9 => format!("{} sp={} pc={}", f[0], f[7], f[8]),
        _ => f.join(" "), // "running", or "-1 sp pc" when not in a syscall
    }
}

const STATUS_KEYS: &[&str] = &[
    "Umask:",
    "Uid:",
    "Gid:",
    "Groups:",
    "SigPnd:",
    "ShdPnd:",
    "SigBlk:",
    "SigIgn:",
    "SigCgt:",
    "CapInh:",
    "CapPrm:",
    "CapEff:",
    "CapBnd:",
    "CapAmb:",
    "NoNewPrivs:",
    "Seccomp:",
    "Seccomp_filters:",
];

fn read_opt(path: &str) -> Option<String> {
    std::fs::read(path)
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn readlink_opt(path: &str) -> String {
    std::fs::read_link(path)
        .map(|p| String::from_utf8_lossy(p.as_os_str().as_bytes()).into_owned())
        .unwrap_or_default()
}

/// An fd's `fdinfo` as a mark keeps it: its lines (whitespace normalised, timerfd's
/// self-changing `it_value` left out) while `budget` lasts, each line's bytes taken from it;
/// once it is spent, one line `xxh3 <hash> <bytes>` of the rest, read in bounded chunks. An epoll
/// fd watching a million fds then costs the shim a few bytes, and a change still shows.
fn fdinfo_lines(mut src: impl io::Read, budget: &mut u64) -> Vec<String> {
    const MAX_LINE: usize = 4096;
    let mut lines = Vec::new();
    let mut hash: Option<(xxhash_rust::xxh3::Xxh3, u64)> = None;
    let mut keep = |line: &[u8],
                    lines: &mut Vec<String>,
                    hash: &mut Option<(xxhash_rust::xxh3::Xxh3, u64)>| {
        if line.starts_with(b"it_value:") {
            return;
        }
        let text = String::from_utf8_lossy(line)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if hash.is_none() && (text.len() as u64) < *budget {
            *budget -= text.len() as u64 + 1;
            lines.push(text);
            return;
        }
        let (h, n) = hash.get_or_insert_with(|| (xxhash_rust::xxh3::Xxh3::new(), 0));
        h.update(text.as_bytes());
        h.update(b"\n");
        *n += text.len() as u64 + 1;
    };
    let mut buf = vec![0u8; 64 << 10];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        carry.extend_from_slice(&buf[..n]);
        let mut start = 0;
        while let Some(i) = carry[start..].iter().position(|b| *b == b'\n') {
            keep(&carry[start..start + i], &mut lines, &mut hash);
            start += i + 1;
        }
        carry.drain(..start);
        if carry.len() > MAX_LINE {
            // No line is this long in a real fdinfo: hash it in pieces.
            keep(&carry, &mut lines, &mut hash);
            carry.clear();
        }
    }
    if !carry.is_empty() {
        keep(&carry, &mut lines, &mut hash);
    }
    if let Some((h, n)) = hash {
        lines.push(format!("xxh3 {:016x} {n}", h.digest()));
    }
    lines
}

fn capture_state(pid: u32, mut fdinfo_budget: u64) -> Result<ProcState, MemError> {
    let mut st = ProcState::default();
    let task_dir = format!("/proc/{pid}/task");
    let mut tids: Vec<u32> = std::fs::read_dir(&task_dir)
        .map_err(io_err(pid, "task list"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    for tid in tids {
        let base = format!("/proc/{pid}/task/{tid}");
        // A thread that exits while we read it just goes missing, which shows as a change.
        let Some(stat) = read_opt(&format!("{base}/stat")).and_then(|s| procs::parse_stat(&s))
        else {
            continue;
        };
        let syscall = syscall_site(&read_opt(&format!("{base}/syscall")).unwrap_or_default());
        let status = read_opt(&format!("{base}/status"))
            .unwrap_or_default()
            .lines()
            .filter(|l| STATUS_KEYS.iter().any(|k| l.starts_with(k)))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        st.threads.push(ThreadState {
            tid,
            start_time: stat.start_time,
            comm: stat.comm,
            syscall,
            status,
        });
    }
    let fd_dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&fd_dir)
        .map_err(io_err(pid, "fd list"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    for fd in fds {
        let target = readlink_opt(&format!("{fd_dir}/{fd}"));
        let info = std::fs::File::open(format!("/proc/{pid}/fdinfo/{fd}"))
            .map(|f| fdinfo_lines(f, &mut fdinfo_budget))
            .unwrap_or_default();
        st.fds.push(FdState { fd, target, info });
    }
    st.cwd = readlink_opt(&format!("/proc/{pid}/cwd"));
    st.root = readlink_opt(&format!("/proc/{pid}/root"));
    Ok(st)
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemDelta {
    /// Pages at addresses covered by both images whose content (or mapping) differs.
    pub changed_pages: u64,
    /// Pages at addresses covered now but not before (new or grown mappings).
    pub added_pages: u64,
    /// Pages at addresses covered before but not now.
    pub removed_pages: u64,
    /// Pages read and hashed for the newer image.
    pub scanned_pages: u64,
    /// Non-memory process state that differs (threads, fds, cwd, ...), described for logs.
    pub state_changes: Vec<String>,
    /// Changed pages per region of the newer image (`name` or "anon@start"), most first, for
    /// explanations.
    pub by_region: Vec<(String, u64)>,
}

impl MemDelta {
    pub fn is_empty(&self) -> bool {
        self.changed_pages == 0
            && self.added_pages == 0
            && self.removed_pages == 0
            && self.state_changes.is_empty()
    }
}

impl std::fmt::Display for MemDelta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} pages changed, {} added, {} removed ({} scanned)",
            self.changed_pages, self.added_pages, self.removed_pages, self.scanned_pages
        )?;
        if !self.by_region.is_empty() {
            let top: Vec<String> = self
                .by_region
                .iter()
                .take(5)
                .map(|(n, c)| format!("{n}: {c}"))
                .collect();
            write!(f, " [{}]", top.join(", "))?;
        }
        if !self.state_changes.is_empty() {
            write!(f, "; {}", self.state_changes.join("; "))?;
        }
        Ok(())
    }
}

/// Same mapping for the pages both regions cover?
fn same_mapping(a: &Region, b: &Region) -> bool {
    if a.kind != b.kind || a.perms != b.perms || a.name != b.name {
        return false;
    }
    match a.kind {
        // Anonymous memory has no identity beyond its address (offsets are the creation address).
        RegionKind::Anon => true,
        _ => {
            a.dev == b.dev
                && a.inode == b.inode
                && a.offset.wrapping_sub(a.start) == b.offset.wrapping_sub(b.start)
        }
    }
}

/// Pages in `[lo, hi)` whose entries differ (a missing entry is the default content).
fn differing_pages(a: &[(u64, u64)], b: &[(u64, u64)], lo: u64, hi: u64) -> u64 {
    let range = |v: &[(u64, u64)]| {
        let s = v.partition_point(|p| p.0 < lo);
        let e = v.partition_point(|p| p.0 < hi);
        (s, e)
    };
    let (mut i, ie) = range(a);
    let (mut j, je) = range(b);
    let mut n = 0;
    while i < ie || j < je {
        if j >= je || (i < ie && a[i].0 < b[j].0) {
            n += 1;
            i += 1;
        } else if i >= ie || b[j].0 < a[i].0 {
            n += 1;
            j += 1;
        } else {
            if a[i].1 != b[j].1 || a[i].1 == UNREADABLE {
                n += 1;
            }
            i += 1;
            j += 1;
        }
    }
    n
}

/// Compares two images of (normally) the same process. Pages are keyed by virtual address, so
/// mappings that split, merge or grow compare page by page.
pub fn compare(prev: &MemoryImage, now: &MemoryImage) -> MemDelta {
    let ps = page_size();
    let mut d = MemDelta {
        scanned_pages: now.stats.pages_read,
        ..Default::default()
    };
    let total = |img: &MemoryImage| img.regions.iter().map(Region::page_count).sum::<u64>();
    if (prev.pid, prev.start_time) != (now.pid, now.start_time) {
        d.removed_pages = total(prev);
        d.added_pages = total(now);
        d.state_changes.push(format!(
            "different process ({} started {} vs {} started {})",
            prev.pid, prev.start_time, now.pid, now.start_time
        ));
        return d;
    }
    let (p, n) = (&prev.regions, &now.regions);
    let (mut i, mut j) = (0, 0);
    let mut covered = 0u64;
    let mut by_region: Vec<(String, u64)> = Vec::new();
    while i < p.len() && j < n.len() {
        let (a, b) = (&p[i], &n[j]);
        let (lo, hi) = (a.start.max(b.start), a.end.min(b.end));
        if lo < hi {
            let pages = (hi - lo) / ps;
            covered += pages;
            let changed = if same_mapping(a, b) {
                differing_pages(&a.pages, &b.pages, lo, hi)
            } else {
                pages
            };
            if changed > 0 {
                let name = if b.name.is_empty() {
                    format!("anon@{:x}", b.start)
                } else {
                    b.name.clone()
                };
                match by_region.iter_mut().find(|r| r.0 == name) {
                    Some(r) => r.1 += changed,
                    None => by_region.push((name, changed)),
                }
            }
            d.changed_pages += changed;
        }
        if a.end <= b.end {
            i += 1;
        } else {
            j += 1;
        }
    }
    d.added_pages = total(now) - covered;
    d.removed_pages = total(prev) - covered;
    d.state_changes = compare_state(&prev.state, &now.state);
    by_region.sort_by_key(|r| std::cmp::Reverse(r.1));
    d.by_region = by_region;
    d
}

fn compare_state(a: &ProcState, b: &ProcState) -> Vec<String> {
    let mut out = Vec::new();
    if a.cwd != b.cwd {
        out.push(format!("cwd {} -> {}", a.cwd, b.cwd));
    }
    if a.root != b.root {
        out.push("root changed".to_string());
    }
    let ids = |s: &ProcState| {
        s.threads
            .iter()
            .map(|t| (t.tid, t.start_time))
            .collect::<Vec<_>>()
    };
    if ids(a) != ids(b) {
        out.push(format!(
            "threads {} -> {}",
            a.threads.len(),
            b.threads.len()
        ));
    } else {
        for (x, y) in a.threads.iter().zip(&b.threads) {
            if x.syscall != y.syscall {
                out.push(format!(
                    "thread {}: syscall {:?} -> {:?}",
                    x.tid, x.syscall, y.syscall
                ));
            }
            if x.status != y.status {
                out.push(format!("thread {}: signal/credential state", x.tid));
            }
            if x.comm != y.comm {
                out.push(format!(
                    "thread {}: comm {:?} -> {:?}",
                    x.tid, x.comm, y.comm
                ));
            }
        }
    }
    fn fdmap(s: &ProcState) -> std::collections::BTreeMap<i32, &FdState> {
        s.fds.iter().map(|f| (f.fd, f)).collect()
    }
    let (fa, fb) = (fdmap(a), fdmap(b));
    for (fd, x) in &fa {
        match fb.get(fd) {
            None => out.push(format!("fd {fd} closed ({})", x.target)),
            Some(y) if y.target != x.target => {
                out.push(format!("fd {fd}: {} -> {}", x.target, y.target))
            }
            Some(y) if y.info != x.info => {
                out.push(format!("fd {fd} ({}): position/flags/state", x.target))
            }
            _ => {}
        }
    }
    for (fd, y) in &fb {
        if !fa.contains_key(fd) {
            out.push(format!("fd {fd} opened ({})", y.target));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    //! Real processes (we are root): forked children that do exactly what they are told, and
    //! python3 interpreters, captured twice around an action.
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::process::{Child, Command, Stdio};

    #[test]
    fn fdinfo_is_kept_within_the_budget_then_hashed() {
        let small = "pos:\t0\nflags:\t02\nit_value: (0,5)\n";
        let mut budget = 1 << 20;
        assert_eq!(
            fdinfo_lines(small.as_bytes(), &mut budget),
            vec!["pos: 0", "flags: 02"]
        );
        assert_eq!(budget, (1 << 20) - 7 - 10);
        // An epoll fd watching 200000 fds: a few KiB kept, then one hash line.
        let big: String = (0..200_000)
            .map(|i| format!("tfd: {i:8} events: 19 data: {i:16x} pos:0 ino:1 sdev:e\n"))
            .collect();
        let mut budget = 4096;
        let lines = fdinfo_lines(big.as_bytes(), &mut budget);
        let kept: usize = lines.iter().map(|l| l.len() + 1).sum();
        assert!(kept < 4096 + 100, "{kept}");
        assert!(
            lines.last().unwrap().starts_with("xxh3 "),
            "{:?}",
            lines.last()
        );
        // Exact enough: one changed watch shows.
        let changed = big.replacen("tfd:   199999 events: 19", "tfd:   199999 events: 1b", 1);
        assert_ne!(changed, big);
        assert_ne!(fdinfo_lines(changed.as_bytes(), &mut 4096), lines);
        assert_eq!(fdinfo_lines(big.as_bytes(), &mut 4096), lines);
        // A spent budget hashes everything, it-value lines still left out.
        let mut spent = 0;
        let a = fdinfo_lines("x: 1\nit_value: (0,1)\n".as_bytes(), &mut spent);
        let b = fdinfo_lines("x: 1\nit_value: (0,2)\n".as_bytes(), &mut spent);
        assert_eq!(a, b);
        assert_eq!(a.len(), 1);
    }

    /// Waits until `pid` sleeps in syscall `nr` (so that its state is quiescent for a capture).
    fn wait_blocked(pid: u32, nr: u32) {
        let want = format!("{nr} ");
        for _ in 0..2000 {
            let sc = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
            let stat = procs::read_stat(pid).unwrap().expect("process alive");
            if sc.starts_with(&want) && stat.state == 'S' {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("process {pid} did not block in syscall {nr}");
    }

    const PAGES: usize = 64;

    /// A forked copy of the test process that runs a tiny command loop using raw syscalls only
    /// (async-signal-safe after fork in a threaded harness). Commands, one byte each:
    /// 'n' nothing, 'p' flip one byte of page 5 of `data`, 'm' mmap 16 anonymous pages and touch
    /// one, 'u' munmap them again. It acks each command with one byte.
    struct Forked {
        // A fork inherits every mapping of the test process, including the shared ones other
        // tests' children use, so forked tests run one at a time.
        _serial: std::sync::MutexGuard<'static, ()>,
        pid: u32,
        cmd: File,
        ack: File,
        data: *mut u8,
        shared: *mut u8,
        /// The child's rseq area (that of the thread that forked it).
        rseq: Option<(u64, u64)>,
    }

    extern "C" {
        static __rseq_offset: isize;
        static __rseq_size: u32;
    }

    /// This thread's `struct rseq` as registered by glibc (thread pointer + `__rseq_offset`).
    fn my_rseq() -> Option<(u64, u64)> {
        let tp: u64;
        // SAFETY: reads the thread pointer (x86_64: %fs:0 holds the TCB's own address).
        unsafe { std::arch::asm!("mov {}, fs:0", out(reg) tp) };
        // SAFETY: glibc (2.35+) exports both; size 0 means rseq is not registered.
        let (off, size) = unsafe { (__rseq_offset, __rseq_size) };
        (size > 0).then(|| (tp.wrapping_add_signed(off as i64), 32))
    }

    impl Forked {
        fn capture(&self) -> MemoryImage {
            capture_with(
                self.pid,
                &CaptureOptions {
                    volatile: self.rseq.into_iter().collect(),
                    ..Default::default()
                },
            )
            .unwrap()
        }

        fn capture_unmasked(&self) -> MemoryImage {
            capture(self.pid).unwrap()
        }

        fn spawn() -> Forked {
            static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
            let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
            let ps = page_size() as usize;
            // SAFETY: fresh anonymous mappings (no address hint), written only within their
            // lengths; the child after fork(2) calls only async-signal-safe functions
            // (open, dup2, then child_loop's read/write) before it exits; the descriptors
            // taken into OwnedFd are the pipe ends this process just created and owns.
            unsafe {
                let data = libc::mmap(
                    std::ptr::null_mut(),
                    PAGES * ps,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                ) as *mut u8;
                assert_ne!(data as *mut libc::c_void, libc::MAP_FAILED);
                // Half the pages hold data, the other half were never touched.
                for i in 0..PAGES / 2 {
                    std::ptr::write_bytes(data.add(i * ps), (i + 1) as u8, ps);
                }
                // A page that holds data and is then made inaccessible (as GCs and JITs do).
                let hidden = libc::mmap(
                    std::ptr::null_mut(),
                    ps,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                ) as *mut u8;
                std::ptr::write_bytes(hidden, 0xab, ps);
                assert_eq!(
                    libc::mprotect(hidden as *mut libc::c_void, ps, libc::PROT_NONE),
                    0
                );
                let shared = libc::mmap(
                    std::ptr::null_mut(),
                    16 * ps,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                ) as *mut u8;
                let (mut c, mut a) = ([0i32; 2], [0i32; 2]);
                assert_eq!(libc::pipe2(c.as_mut_ptr(), libc::O_CLOEXEC), 0);
                assert_eq!(libc::pipe2(a.as_mut_ptr(), libc::O_CLOEXEC), 0);
                let rseq = my_rseq();
                let pid = libc::fork();
                assert!(pid >= 0);
                if pid == 0 {
                    // Away from the test runner's stdout/stderr, whose shared file positions
                    // move when anything else writes to them (CI logs to a file).
                    let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                    libc::dup2(null, 1);
                    libc::dup2(null, 2);
                    child_loop(c[0], a[1], data);
                }
                libc::close(c[0]);
                libc::close(a[1]);
                libc::munmap(data as *mut libc::c_void, PAGES * ps);
                libc::munmap(hidden as *mut libc::c_void, ps);
                let f = Forked {
                    _serial: serial,
                    pid: pid as u32,
                    cmd: File::from(OwnedFd::from_raw_fd(c[1])),
                    ack: File::from(OwnedFd::from_raw_fd(a[0])),
                    data,
                    shared,
                    rseq,
                };
                wait_blocked(f.pid, libc::SYS_read as u32);
                f
            }
        }

        /// The child's stack pointer while it waits for a command.
        fn sp(&self) -> u64 {
            let sc = std::fs::read_to_string(format!("/proc/{}/syscall", self.pid)).unwrap();
            let f: Vec<&str> = sc.split_whitespace().collect();
            u64::from_str_radix(f[7].trim_start_matches("0x"), 16).unwrap()
        }

        fn send(&mut self, c: u8) {
            use std::io::Read;
            self.cmd.write_all(&[c]).unwrap();
            let mut b = [0u8];
            self.ack.read_exact(&mut b).unwrap();
            assert_eq!(b[0], c);
            wait_blocked(self.pid, libc::SYS_read as u32);
        }
    }

    impl Drop for Forked {
        fn drop(&mut self) {
            // SAFETY: kill and waitpid of our own child take no pointers we own (a null
            // status is allowed); `shared` is the mapping of 16 pages made in `spawn`, and
            // nothing refers into it after `self`.
            unsafe {
                libc::kill(self.pid as i32, libc::SIGKILL);
                libc::waitpid(self.pid as i32, std::ptr::null_mut(), 0);
                libc::munmap(self.shared as *mut libc::c_void, 16 * page_size() as usize);
            }
        }
    }

    fn child_loop(cmd: i32, ack: i32, data: *mut u8) -> ! {
        // Drop the fds inherited from other tests running in the harness (BPF maps, pipes):
        // their state is not ours to watch.
        let (lo, hi) = (cmd.min(ack) as u32, cmd.max(ack) as u32);
        // SAFETY: close_range takes no pointers; it closes descriptors of this forked child
        // that nothing in it uses (everything but the two pipe ends it talks over).
        unsafe {
            libc::syscall(libc::SYS_close_range, 3u32, lo - 1, 0u32);
            libc::syscall(libc::SYS_close_range, lo + 1, hi - 1, 0u32);
            libc::syscall(libc::SYS_close_range, hi + 1, u32::MAX, 0u32);
        }
        let ps = page_size() as usize;
        let mut extra: *mut libc::c_void = std::ptr::null_mut();
        loop {
            let mut c = 0u8;
            // SAFETY: raw syscalls and plain memory accesses only (we are a fork of a threaded
            // process: no allocation, no locks).
            unsafe {
                if libc::syscall(libc::SYS_read, cmd, &mut c as *mut u8, 1) != 1 {
                    libc::_exit(0);
                }
                match c {
                    b'p' => {
                        let p = data.add(5 * ps + 123);
                        std::ptr::write_volatile(p, std::ptr::read_volatile(p) ^ 0xff);
                    }
                    b'm' => {
                        extra = libc::mmap(
                            std::ptr::null_mut(),
                            16 * ps,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                            -1,
                            0,
                        );
                        std::ptr::write_volatile(extra as *mut u8, 1);
                    }
                    b'u' => {
                        libc::munmap(extra, 16 * ps);
                    }
                    _ => {}
                }
                libc::syscall(libc::SYS_write, ack, &c as *const u8, 1);
            }
        }
    }

    /// Addresses of pages whose listed hashes differ (for tests on same-layout images).
    fn changed_addresses(a: &MemoryImage, b: &MemoryImage) -> Vec<u64> {
        let set = |i: &MemoryImage| {
            i.regions
                .iter()
                .flat_map(|r| r.pages.iter().copied())
                .collect::<std::collections::BTreeMap<u64, u64>>()
        };
        let (x, y) = (set(a), set(b));
        let mut v: Vec<u64> = x
            .keys()
            .chain(y.keys())
            .filter(|k| x.get(k) != y.get(k))
            .copied()
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Is `va` covered by both images (not a page of an added or removed mapping)?
    fn compare_is_same_layout(a: &MemoryImage, b: &MemoryImage, va: u64) -> bool {
        let has = |i: &MemoryImage| i.regions.iter().any(|r| r.start <= va && va < r.end);
        has(a) && has(b)
    }

    #[test]
    fn forked_child_ran_but_changed_nothing_is_equal() {
        let mut f = Forked::spawn();
        f.send(b'n');
        let a = f.capture();
        assert_eq!(a.stats.unreadable_pages, 0);
        let b = f.capture();
        assert!(compare(&a, &b).is_empty(), "idle: {}", compare(&a, &b));
        // It runs (reads a command, acks it) but leaves every byte as it was.
        f.send(b'n');
        f.send(b'n');
        let c = f.capture();
        let d = compare(&a, &c);
        assert!(d.is_empty(), "ran, changed nothing: {d}");
        assert!(d.scanned_pages >= (PAGES / 2) as u64, "{d}");
    }

    #[test]
    fn forked_child_one_byte_is_one_page() {
        let mut f = Forked::spawn();
        f.send(b'n');
        let a = f.capture();
        f.send(b'p');
        f.send(b'n'); // so that the command byte on its stack is the same again
        let b = f.capture();
        let d = compare(&a, &b);
        // The flipped page; in a debug build the 'p' arm may also leave a spilled temporary in
        // a stack slot that 'n' does not overwrite: that is a real change too.
        let poked = f.data as u64 + 5 * page_size();
        let changed = changed_addresses(&a, &b);
        assert!(changed.contains(&poked), "{d} {changed:x?}");
        assert_eq!(d.changed_pages, changed.len() as u64, "{d}");
        let sp = f.sp();
        for va in changed.iter().filter(|va| **va != poked) {
            assert!(
                va.abs_diff(sp) < 16 * page_size(),
                "{va:#x} is not on the stack (sp {sp:#x}): {d}"
            );
        }
        assert_eq!((d.added_pages, d.removed_pages), (0, 0), "{d}");
        assert!(d.state_changes.is_empty(), "{d}");
        // Flipping it back restores the image.
        f.send(b'p');
        f.send(b'n');
        let c = f.capture();
        assert!(!changed_addresses(&a, &c).contains(&poked));
        assert!(compare(&b, &c).changed_pages >= 1);
    }

    #[test]
    fn forked_child_mmap_and_munmap_are_layout_changes() {
        let mut f = Forked::spawn();
        f.send(b'n');
        let a = f.capture();
        f.send(b'm');
        f.send(b'n');
        let b = f.capture();
        let d = compare(&a, &b);
        // The 16 new pages (one touched); the pointer stored on the child's stack (and debug-build
        // spills) change its stack.
        assert_eq!(d.added_pages, 16, "{d}");
        assert_eq!(d.removed_pages, 0, "{d}");
        let sp = f.sp();
        for va in changed_addresses(&a, &b)
            .iter()
            .filter(|va| compare_is_same_layout(&a, &b, **va))
        {
            assert!(
                va.abs_diff(sp) < 16 * page_size(),
                "{va:#x} is not on the stack (sp {sp:#x}): {d}"
            );
        }
        f.send(b'u');
        f.send(b'n');
        let c = f.capture();
        let d = compare(&b, &c);
        assert_eq!((d.added_pages, d.removed_pages), (0, 16), "{d}");
    }

    fn pin(pid: u32, cpu: usize) {
        // SAFETY: an all-zero cpu_set_t is a valid empty set, CPU_SET writes inside it, and
        // sched_setaffinity reads exactly its size from a live local.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(
                libc::sched_setaffinity(pid as i32, std::mem::size_of_val(&set), &set),
                0
            );
        }
    }

    /// The kernel writes the current CPU into each thread's rseq area when the thread runs: a
    /// process that only ran on another CPU shows exactly that page changed unless the area is
    /// declared volatile.
    #[test]
    fn rseq_area_is_written_by_the_kernel_on_migration() {
        if std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            < 2
        {
            eprintln!("needs two CPUs");
            return;
        }
        let mut f = Forked::spawn();
        let Some((rseq, _)) = f.rseq else {
            eprintln!("glibc did not register rseq");
            return;
        };
        pin(f.pid, 0);
        f.send(b'n');
        let (a, am) = (f.capture_unmasked(), f.capture());
        pin(f.pid, 1);
        f.send(b'n');
        let (b, bm) = (f.capture_unmasked(), f.capture());
        let changed = changed_addresses(&a, &b);
        let ps = page_size();
        assert_eq!(changed, vec![rseq / ps * ps], "{}", compare(&a, &b));
        assert!(compare(&am, &bm).is_empty(), "{}", compare(&am, &bm));
    }

    #[test]
    fn prot_none_pages_are_read_and_untouched_pages_are_not() {
        let f = Forked::spawn();
        let img = f.capture();
        assert_eq!(img.stats.unreadable_pages, 0);
        let hidden: Vec<&Region> = img
            .regions
            .iter()
            .filter(|r| r.perms == "---p" && !r.pages.is_empty())
            .collect();
        assert!(
            hidden.iter().any(|r| r
                .pages
                .iter()
                .any(|p| p.1 == xxh3_64(&vec![0xab; page_size() as usize]))),
            "the PROT_NONE page with data is in the image"
        );
        let data = img
            .regions
            .iter()
            .find(|r| r.start <= f.data as u64 && (f.data as u64) < r.end)
            .unwrap();
        let ps = page_size();
        let listed = data
            .pages
            .iter()
            .filter(|p| p.0 >= f.data as u64 && p.0 < f.data as u64 + PAGES as u64 * ps)
            .count();
        assert_eq!(listed, PAGES / 2, "only the pages with data are listed");
    }

    #[test]
    fn shared_anonymous_memory_written_by_another_process() {
        let mut f = Forked::spawn();
        f.send(b'n');
        let a = f.capture();
        assert!(a
            .regions
            .iter()
            .any(|r| r.kind == RegionKind::Shmem && r.start == f.shared as u64));
        // We (another process) write into the shared mapping; the child's page tables never
        // see it, the shmem object does.
        // SAFETY: page 3 of the 16-page shared mapping `f` holds until it is dropped.
        unsafe { std::ptr::write_volatile(f.shared.add(3 * page_size() as usize), 7) };
        let b = f.capture();
        let d = compare(&a, &b);
        assert_eq!(
            (d.changed_pages, d.added_pages, d.removed_pages),
            (1, 0, 0),
            "{d}"
        );
        f.send(b'n');
    }

    #[test]
    fn pagemap_fallback_agrees_with_pagemap_scan() {
        let f = Forked::spawn();
        let pm = File::open(format!("/proc/{}/pagemap", f.pid)).unwrap();
        let mut s = PresenceScanner::new(f.pid, &pm);
        for m in procs::read_maps(f.pid).unwrap() {
            if m.path.starts_with(b"[v") {
                continue;
            }
            let by_read = s.scan_read(m.start, m.end).unwrap();
            match s.scan_ioctl(m.start, m.end) {
                Ok(by_ioctl) => assert_eq!(by_read, by_ioctl, "{:x}-{:x}", m.start, m.end),
                Err(e) => {
                    eprintln!("PAGEMAP_SCAN unavailable here: {e}");
                    return;
                }
            }
        }
    }

    #[test]
    fn gone_process_is_an_error() {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert!(matches!(capture(pid), Err(MemError::Gone(p)) if p == pid));
    }

    /// A python3 interpreter reading commands from stdin, answering "ok" to each.
    struct Py {
        child: Child,
        out: BufReader<std::process::ChildStdout>,
    }

    const PY: &str = r#"
import sys
buf = bytearray(4 << 20)
for i in range(0, len(buf), 4096):
    buf[i] = 1
data = list(range(100000))
blob = bytes(range(256)) * 4096
def ok():
    sys.stdout.write("ok\n"); sys.stdout.flush()
ok()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    cmd = line.split()
    if cmd[0] == "touch":
        for i in range(int(cmd[1])):
            buf[i * 4096 + 7] = 2
    elif cmd[0] == "alloc":
        extra = bytearray(int(cmd[1]) << 20)
        for i in range(0, len(extra), 4096):
            extra[i] = 3
    elif cmd[0] == "loop":
        s = 0
        for x in data:
            s += x
    elif cmd[0] == "count":
        blob.count(b"\xff")
    ok()
"#;

    impl Py {
        fn spawn() -> Py {
            let mut child = Command::new("python3")
                .args(["-c", PY])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                // Not the test runner's stderr: under CI it is a log file other processes
                // append to, whose shared position would (rightly) count as a change.
                .stderr(Stdio::null())
                .spawn()
                .expect("python3");
            let mut out = BufReader::new(child.stdout.take().unwrap());
            let mut l = String::new();
            out.read_line(&mut l).unwrap();
            assert_eq!(l, "ok\n");
            let p = Py { child, out };
            wait_blocked(p.pid(), libc::SYS_read as u32);
            p
        }
        fn pid(&self) -> u32 {
            self.child.id()
        }
        fn send(&mut self, line: &str) {
            let stdin = self.child.stdin.as_mut().unwrap();
            stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
            stdin.flush().unwrap();
            let mut l = String::new();
            self.out.read_line(&mut l).unwrap();
            assert_eq!(l, "ok\n");
            wait_blocked(self.pid(), libc::SYS_read as u32);
        }
    }

    impl Drop for Py {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    #[test]
    fn python_blocked_on_stdin_is_equal() {
        let py = Py::spawn();
        let a = capture(py.pid()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let b = capture(py.pid()).unwrap();
        let d = compare(&a, &b);
        assert!(d.is_empty(), "{d}");
        assert!(
            a.stats.pages_read > 1024,
            "4 MiB bytearray and the interpreter: {:?}",
            a.stats
        );
    }

    #[test]
    fn python_modifying_a_bytearray_changes_those_pages() {
        let mut py = Py::spawn();
        let a = capture(py.pid()).unwrap();
        py.send("touch 100");
        let b = capture(py.pid()).unwrap();
        let d = compare(&a, &b);
        eprintln!("python touch 100 pages: {d}");
        // The 100 pages plus what the interpreter itself wrote (stdin buffer, frames, allocator).
        assert!(d.changed_pages >= 100 && d.changed_pages < 100 + 200, "{d}");

        py.send("alloc 8");
        let c = capture(py.pid()).unwrap();
        let d = compare(&b, &c);
        eprintln!("python alloc 8 MiB: {d}");
        assert!(d.added_pages + d.changed_pages >= 2048, "{d}");
    }

    #[test]
    fn python_reading_only_still_writes_memory() {
        // Observed (python 3.11): a pure-Python loop over a list changes pages (the loop's ints
        // are allocated and freed: allocator free lists; frames; the readline buffer), while a
        // single C-level read of a bytes object changes a handful of interpreter pages (the
        // command line, refcounts, the evaluation stack). Only what is net-changed counts:
        // refcounts that go up and down again leave no trace.
        let mut py = Py::spawn();
        py.send("loop");
        let a = capture(py.pid()).unwrap();
        py.send("loop");
        let b = capture(py.pid()).unwrap();
        let d_loop = compare(&a, &b);
        py.send("count");
        let c = capture(py.pid()).unwrap();
        py.send("count");
        let e = capture(py.pid()).unwrap();
        let d_count = compare(&c, &e);
        eprintln!("python read-only loop twice: {d_loop}");
        eprintln!("python bytes.count twice: {d_count}");
        assert!(d_loop.changed_pages < 100, "{d_loop}");
        assert!(d_count.changed_pages < 100, "{d_count}");
    }

    #[test]
    fn sleep_captured_twice_is_equal() {
        let mut c = Command::new("sleep")
            .arg("100")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_blocked(c.id(), libc::SYS_clock_nanosleep as u32);
        let a = capture(c.id()).unwrap();
        let b = capture(c.id()).unwrap();
        let _ = c.kill();
        let _ = c.wait();
        let d = compare(&a, &b);
        assert!(d.is_empty(), "{d}");
        assert!(a.regions.iter().any(|r| r.name == "[stack]"));
        assert!(!a
            .regions
            .iter()
            .any(|r| r.name == "[vdso]" || r.name == "[vvar]"));
    }

    #[test]
    fn different_process_is_all_change() {
        let mut c1 = Command::new("sleep")
            .arg("100")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut c2 = Command::new("sleep")
            .arg("100")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_blocked(c1.id(), libc::SYS_clock_nanosleep as u32);
        wait_blocked(c2.id(), libc::SYS_clock_nanosleep as u32);
        let a = capture(c1.id()).unwrap();
        let b = capture(c2.id()).unwrap();
        for c in [&mut c1, &mut c2] {
            let _ = c.kill();
            let _ = c.wait();
        }
        let d = compare(&a, &b);
        assert!(
            !d.is_empty() && d.removed_pages > 0 && d.added_pages > 0,
            "{d}"
        );
    }

    /// Capture + compare cost versus resident size. Not a test: run with
    /// `cargo test --release -p crab-shim inspector::memory::tests::bench_capture -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn bench_capture() {
        let ps = page_size() as usize;
        eprintln!(
            "| resident | capture 1 thread | capture {} threads | compare | pages read |",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        );
        eprintln!("|---|---|---|---|---|");
        for mb in [10usize, 100, 500] {
            let len = mb << 20;
            // SAFETY: a fresh anonymous mapping of `len` bytes, written only within it; the
            // forked child only calls pause(2) in a loop (async-signal-safe) until killed.
            let pid = unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                ) as *mut u64;
                assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
                // Distinct, non-zero contents in every page.
                for i in 0..len / 8 {
                    *p.add(i) = (i as u64).wrapping_mul(0x9e3779b97f4a7c15) | 1;
                }
                let pid = libc::fork();
                if pid == 0 {
                    loop {
                        libc::pause();
                    }
                }
                libc::munmap(p as *mut libc::c_void, len);
                pid as u32
            };
            let _ = ps;
            std::thread::sleep(Duration::from_millis(50));
            let best = |threads: usize| {
                (0..3)
                    .map(|_| {
                        capture_with(
                            pid,
                            &CaptureOptions {
                                threads,
                                ..Default::default()
                            },
                        )
                        .unwrap()
                    })
                    .min_by_key(|i| i.stats.elapsed)
                    .unwrap()
            };
            let one = best(1);
            let many = best(
                std::env::var("CRAB_BENCH_THREADS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            );
            let t = Instant::now();
            let d = compare(&one, &many);
            let cmp = t.elapsed();
            assert!(d.is_empty(), "{d}");
            eprintln!(
                "| {mb} MB | {:.1} ms | {:.1} ms | {:.2} ms | {} |",
                one.stats.elapsed.as_secs_f64() * 1e3,
                many.stats.elapsed.as_secs_f64() * 1e3,
                cmp.as_secs_f64() * 1e3,
                many.stats.pages_read
            );
            // SAFETY: kill and waitpid of our own child; a null status pointer is allowed.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
                libc::waitpid(pid as i32, std::ptr::null_mut(), 0);
            }
        }
        let py = Py::spawn();
        let imgs: Vec<MemoryImage> = (0..3).map(|_| capture(py.pid()).unwrap()).collect();
        let best = imgs.iter().map(|i| i.stats.elapsed).min().unwrap();
        let t = Instant::now();
        let d = compare(&imgs[0], &imgs[1]);
        eprintln!(
            "| idle python3 ({} MB read, {} regions) | | {:.1} ms | {:.2} ms | {} |",
            (imgs[0].stats.pages_read * page_size()) >> 20,
            imgs[0].regions.len(),
            best.as_secs_f64() * 1e3,
            t.elapsed().as_secs_f64() * 1e3,
            imgs[0].stats.pages_read
        );
        assert!(d.is_empty(), "{d}");
    }
}
