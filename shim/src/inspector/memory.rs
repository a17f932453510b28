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
    /// One observation of the container would read more than `[limits] key` allows.
    #[error(
        "{what} of the container's processes exceed the limit of {limit} bytes per observation ([limits] {key}): not compared"
    )]
    Limit {
        what: &'static str,
        limit: u64,
        key: &'static str,
    },
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
    /// sorted by address. Empty for `SharedFile`, and for a `Shmem` region read from its
    /// object (then [`Region::shared`] holds them; [`Region::page_hashes`] gives either).
    pub pages: Vec<(u64, u64)>,
    /// A `Shmem` region read from the object itself: the object's hashes, shared with every
    /// image of the same observation that maps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedRef>,
}

impl Region {
    pub fn page_count(&self) -> u64 {
        (self.end - self.start) / page_size()
    }

    /// `(page address, xxh3-64)` of the pages whose content differs from the kind's default,
    /// sorted by address, whether they are the region's own or its shared object's.
    pub fn page_hashes(&self) -> std::borrow::Cow<'_, [(u64, u64)]> {
        self.page_hashes_in(self.start, self.end)
    }

    /// [`Region::page_hashes`] of the addresses `[lo, hi)` only.
    pub fn page_hashes_in(&self, lo: u64, hi: u64) -> std::borrow::Cow<'_, [(u64, u64)]> {
        let (lo, hi) = (lo.max(self.start), hi.min(self.end));
        let slice = |v: &[(u64, u64)], a: u64, b: u64| {
            (
                v.partition_point(|p| p.0 < a),
                v.partition_point(|p| p.0 < b),
            )
        };
        let (f, t) = slice(&self.pages, lo, hi);
        match &self.shared {
            None => std::borrow::Cow::Borrowed(&self.pages[f..t]),
            Some(s) if lo < hi => {
                // File offset of address va: va - start + offset.
                let at = |va: u64| va - self.start + self.offset;
                let (from, to) = slice(&s.hashes, at(lo), at(hi));
                let mut v: Vec<(u64, u64)> = s.hashes[from..to]
                    .iter()
                    .map(|&(off, h)| (off - self.offset + self.start, h))
                    .collect();
                if f < t {
                    v.extend_from_slice(&self.pages[f..t]);
                    v.sort_unstable_by_key(|p| p.0);
                }
                std::borrow::Cow::Owned(v)
            }
            Some(_) => std::borrow::Cow::Borrowed(&[]),
        }
    }
}

/// A shared-memory object: the device and inode of the object itself (`fstat` of what
/// `/proc/PID/map_files` opens), not of any name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShmemId {
    pub dev: u64,
    pub ino: u64,
}

/// A `Shmem` region's pages, as its object holds them: `(file offset, xxh3-64)` of the data
/// pages that are not all zeros, sorted by offset (at least over the region's range).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedRef {
    pub id: ShmemId,
    #[serde(with = "arc_pages")]
    pub hashes: std::sync::Arc<Vec<(u64, u64)>>,
}

mod arc_pages {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer>(v: &Arc<Vec<(u64, u64)>>, s: S) -> Result<S::Ok, S::Error> {
        v.as_slice().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Vec<(u64, u64)>>, D::Error> {
        Vec::deserialize(d).map(Arc::new)
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
    /// Stopped (`T`) or stopped by a tracer (`t`): a SIGSTOP leaves no other trace.
    #[serde(default)]
    pub stopped: bool,
    /// In interruptible sleep (`S`) when read: neither on a CPU nor waiting for one, nor
    /// stopped. Not compared: it says how far the image's counts can be trusted
    /// ([`super::decide::not_own`]).
    #[serde(default)]
    pub sleeping: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FdState {
    pub fd: i32,
    pub target: String,
    /// `fdinfo` lines (position, flags, epoll/inotify/eventfd state), minus timerfd's
    /// remaining time and expiry count which change by themselves; then what the fd holds
    /// beyond them ([`super::held`]: queued bytes, terminal settings).
    pub info: Vec<String>,
}

/// Kernel-side process state that is cheap to read and stable while the process does nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ProcState {
    pub threads: Vec<ThreadState>,
    pub fds: Vec<FdState>,
    pub cwd: String,
    pub root: String,
    /// Signals queued to the process so far (the host probes' count), noted only while some
    /// are pending: the pending sets alone do not show a second real-time signal of one
    /// number. Set by the inspection, which has the probes.
    #[serde(default)]
    pub signals_while_pending: Option<u64>,
}

impl ProcState {
    /// Whether any thread (or the process) has a signal pending.
    pub fn pending(&self) -> bool {
        self.threads.iter().any(|t| {
            t.status.iter().any(|l| {
                (l.starts_with("SigPnd:") || l.starts_with("ShdPnd:"))
                    && l.split_whitespace()
                        .nth(1)
                        .is_some_and(|v| v.chars().any(|c| c != '0'))
            })
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureStats {
    /// Pages read and hashed for this image (a shared object's pages only by the first image
    /// of an observation that maps them).
    pub pages_read: u64,
    /// Pages of the process's own memory the image holds an entry for (read through the
    /// process): what carrying the image over to another observation costs.
    #[serde(default)]
    pub private_pages: u64,
    /// Pages of shared-memory mappings whose hashes an earlier image of the same observation
    /// had read already.
    #[serde(default)]
    pub shared_pages_reused: u64,
    /// Bytes of `fdinfo` read for the image.
    #[serde(default)]
    pub fdinfo_bytes: u64,
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
    /// `(page address, xxh3-64 of its bytes as read)` of the pages whose hash in `regions`
    /// has volatile ranges zeroed ([`CaptureOptions::volatile`]), sorted by address: where
    /// one image masked a page and the other did not (an rseq area learnt between the two),
    /// [`compare`] compares the bytes as read instead.
    #[serde(default)]
    pub masked: Vec<(u64, u64)>,
    /// The process's interactions ([`super::bpf::HostProbes::interactions`]) read just before
    /// the image was taken, when the inspection counts them; `None`: unknown.
    #[serde(default)]
    pub interactions: Option<u64>,
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

/// What one observation of a container (the images of all its processes at one turn end, a
/// mark, a refresh) may read, and the shared-memory objects it has read so far.
///
/// Bounds are per container, not per process (`[limits] max_memory_image_bytes`,
/// `max_fdinfo_total_bytes`): each shared-memory object's pages are read and hashed once,
/// by the first image that maps them, and every later image of the same observation
/// refers to the same hashes ([`SharedRef`]); an image carried over unread from an earlier
/// observation (an idle process) counts with what it read then ([`Observation::carry`]).
/// Past a bound every capture fails with [`MemError::Limit`] before reading more.
pub struct Observation {
    budget: Budget,
    objects: std::collections::HashMap<ShmemId, Object>,
    buf: Vec<u8>,
}

/// What an observation has read, for the turn's answer and log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservationStats {
    /// Bytes of memory read and hashed: the processes' own and each shared object's once.
    pub memory_bytes: u64,
    /// Shared-memory objects read (their bytes are part of `memory_bytes`).
    pub shared_objects: u64,
    pub shared_bytes: u64,
    /// Bytes of shared mappings whose hashes were already read by this observation.
    pub shared_bytes_reused: u64,
    /// Bytes of memory and of `fdinfo` of images carried over from the mark unread.
    pub carried_memory_bytes: u64,
    pub carried_fdinfo_bytes: u64,
    /// Bytes of `fdinfo` read.
    pub fdinfo_bytes: u64,
    /// Bytes queued in pipes and sockets the processes hold, read and hashed
    /// ([`super::held`]); part of the memory bound.
    #[serde(default)]
    pub queue_bytes: u64,
}

impl ObservationStats {
    /// Nothing read, nothing carried over.
    pub fn is_empty(&self) -> bool {
        *self == ObservationStats::default()
    }
}

struct Budget {
    memory_limit: u64,
    fdinfo_limit: u64,
    /// Memory and fdinfo counted so far (read, and carried over).
    memory: u64,
    fdinfo: u64,
    /// A bound was passed: every later charge fails the same way.
    spent: Option<(&'static str, u64, &'static str)>,
    stats: ObservationStats,
}

const MEMORY_KEY: &str = "max_memory_image_bytes";
const FDINFO_KEY: &str = "max_fdinfo_total_bytes";

impl Budget {
    fn fail(&self) -> Result<(), MemError> {
        match self.spent {
            Some((what, limit, key)) => Err(MemError::Limit { what, limit, key }),
            None => Ok(()),
        }
    }

    /// Counts `bytes` of memory about to be read (or carried over), or fails past the bound.
    fn memory(&mut self, bytes: u64) -> Result<(), MemError> {
        self.fail()?;
        self.memory = self.memory.saturating_add(bytes);
        if self.memory > self.memory_limit {
            self.spent = Some(("memory images", self.memory_limit, MEMORY_KEY));
        }
        self.fail()
    }

    /// Counts `bytes` of fdinfo read (or carried over), or fails past the bound.
    fn fdinfo(&mut self, bytes: u64) -> Result<(), MemError> {
        self.fail()?;
        self.fdinfo = self.fdinfo.saturating_add(bytes);
        if self.fdinfo > self.fdinfo_limit {
            self.spent = Some(("fdinfo", self.fdinfo_limit, FDINFO_KEY));
        }
        self.fail()
    }

    /// fdinfo bytes that may still be read.
    fn fdinfo_left(&self) -> u64 {
        match self.spent {
            Some(_) => 0,
            None => self.fdinfo_limit - self.fdinfo,
        }
    }
}

/// The hashes of one shared-memory object read so far in an observation.
#[derive(Default)]
struct Object {
    /// File offset ranges read, sorted and disjoint.
    covered: Vec<(u64, u64)>,
    /// `(file offset, hash)` of the non-zero data pages in `covered`, sorted.
    hashes: std::sync::Arc<Vec<(u64, u64)>>,
}

impl Observation {
    /// An observation bounded by `limits` (bytes of memory, bytes of fdinfo).
    pub fn new(max_memory_bytes: u64, max_fdinfo_bytes: u64) -> Observation {
        Observation {
            budget: Budget {
                memory_limit: max_memory_bytes,
                fdinfo_limit: max_fdinfo_bytes,
                memory: 0,
                fdinfo: 0,
                spent: None,
                stats: ObservationStats::default(),
            },
            objects: Default::default(),
            buf: Vec::new(),
        }
    }

    /// An observation under a container's `[limits]`.
    pub fn within(limits: &crab_runtime_config::LimitsConfig) -> Observation {
        Observation::new(limits.max_memory_image_bytes, limits.max_fdinfo_total_bytes)
    }

    /// An observation of one image, bounded by nothing but the per-process caps.
    pub fn unbounded() -> Observation {
        Observation::new(u64::MAX, u64::MAX)
    }

    pub fn stats(&self) -> &ObservationStats {
        &self.budget.stats
    }

    /// The bound this observation passed, if any (the error every capture now returns).
    pub fn over_limit(&self) -> Option<MemError> {
        self.budget.fail().err()
    }

    /// Counts an image taken by an earlier observation that this one keeps unread (a process
    /// that did not run): its memory and fdinfo as it read them.
    pub fn carry(&mut self, img: &MemoryImage) -> Result<(), MemError> {
        let mem = img.stats.private_pages * page_size();
        self.budget.memory(mem)?;
        self.budget.fdinfo(img.stats.fdinfo_bytes)?;
        self.budget.stats.carried_memory_bytes += mem;
        self.budget.stats.carried_fdinfo_bytes += img.stats.fdinfo_bytes;
        Ok(())
    }

    /// The hashes of object `id` (open as `f`) over the file offsets `[lo, hi)`: read now
    /// where this observation has not read them yet (counted against the bound), and the
    /// number of pages read for it.
    fn object_pages(
        &mut self,
        f: &File,
        id: ShmemId,
        lo: u64,
        hi: u64,
    ) -> Result<ObjectRead, MemError> {
        let Observation {
            budget,
            objects,
            buf,
        } = self;
        let obj = objects.entry(id).or_default();
        let gaps = uncovered(&obj.covered, lo, hi);
        let missing: u64 = gaps.iter().map(|g| g.1 - g.0).sum();
        let reused = (hi - lo) - missing;
        budget.stats.shared_bytes_reused += reused;
        if gaps.is_empty() {
            return Ok(ObjectRead {
                hashes: obj.hashes.clone(),
                pages_read: 0,
                reused_pages: reused / page_size(),
            });
        }
        if buf.is_empty() {
            buf.resize(SHMEM_CHUNK, 0);
        }
        let mut new = Vec::new();
        let mut read = 0u64;
        if obj.covered.is_empty() {
            budget.stats.shared_objects += 1;
        }
        // Counted chunk by chunk before it is read: a read stopped by the bound shows.
        let mut charge = |bytes| {
            budget.memory(bytes)?;
            budget.stats.shared_bytes += bytes;
            budget.stats.memory_bytes += bytes;
            Ok(())
        };
        for &(a, b) in &gaps {
            read += hash_shmem(f, a, b, &mut new, buf, &mut charge)?;
        }
        obj.hashes = std::sync::Arc::new(merge_sorted(&obj.hashes, &new));
        for g in gaps {
            cover(&mut obj.covered, g);
        }
        Ok(ObjectRead {
            hashes: obj.hashes.clone(),
            pages_read: read,
            reused_pages: reused / page_size(),
        })
    }

    /// Points the shared regions of `img` (an image of this observation) at their objects'
    /// final hashes: an object read further by a later image got a new list, and the older
    /// one (a subset, equal over the region) is then freed.
    pub fn settle(&self, img: &mut MemoryImage) {
        for r in &mut img.regions {
            if let Some(s) = &mut r.shared {
                if let Some(o) = self.objects.get(&s.id) {
                    if !std::sync::Arc::ptr_eq(&s.hashes, &o.hashes) {
                        s.hashes = o.hashes.clone();
                    }
                }
            }
        }
    }
}

/// What [`Observation::object_pages`] gives a region.
struct ObjectRead {
    hashes: std::sync::Arc<Vec<(u64, u64)>>,
    /// Pages read for it now.
    pages_read: u64,
    /// Pages of its range read before, by an earlier image of the observation.
    reused_pages: u64,
}

/// The parts of `[lo, hi)` that the sorted, disjoint ranges `covered` leave out.
fn uncovered(covered: &[(u64, u64)], lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pos = lo;
    for &(a, b) in covered {
        if b <= pos {
            continue;
        }
        if a >= hi {
            break;
        }
        if a > pos {
            out.push((pos, a));
        }
        pos = pos.max(b);
        if pos >= hi {
            break;
        }
    }
    if pos < hi {
        out.push((pos, hi));
    }
    out
}

/// Adds `[a, b)` to the sorted, disjoint ranges `covered`, merging where they touch.
fn cover(covered: &mut Vec<(u64, u64)>, (mut a, mut b): (u64, u64)) {
    let first = covered.partition_point(|r| r.1 < a);
    let mut last = first;
    while last < covered.len() && covered[last].0 <= b {
        a = a.min(covered[last].0);
        b = b.max(covered[last].1);
        last += 1;
    }
    covered.splice(first..last, [(a, b)]);
}

/// Two lists sorted by key, with no key in both, as one sorted list.
fn merge_sorted(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i].0 <= b[j].0 {
            out.push(a[i]);
            i += 1;
        } else {
            out.push(b[j]);
            j += 1;
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

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

/// Hashes the data (non-hole) pages of the file offsets `[lo, hi)` of a shmem object from the
/// object itself, appending `(file offset, hash)` of those that are not all zeros to `pages`;
/// `charge` is told the bytes of each chunk before it is read (and may refuse them). Returns
/// the number of pages read. Pages past the file's end read as zeros (a process would get
/// SIGBUS there, there is no data).
fn hash_shmem(
    f: &File,
    lo: u64,
    hi: u64,
    pages: &mut Vec<(u64, u64)>,
    buf: &mut [u8],
    charge: &mut dyn FnMut(u64) -> Result<(), MemError>,
) -> Result<u64, MemError> {
    let ps = page_size();
    let zh = zero_hash();
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
            charge(len as u64)?;
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
                    pages.push((off + p as u64 * ps, h));
                }
            }
            off += len as u64;
        }
        pos = hole;
    }
    Ok(read)
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
        // A timerfd's remaining time and its expiries not yet read move with the clock alone.
        if line.starts_with(b"it_value:") || line.starts_with(b"ticks:") {
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

/// The process's kernel-side state, and the bytes of fdinfo read for it (counted against
/// `total`, the observation's bound).
fn capture_state(
    pid: u32,
    fdinfo_budget: u64,
    total: &mut Budget,
) -> Result<(ProcState, u64), MemError> {
    read_proc_state(pid, fdinfo_budget, total, Depth::Whole)
}

/// How much of a process's kernel-held state to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Depth {
    /// Everything [`ProcState`] holds.
    Whole,
    /// What can change while the process does not run, by a route no probe counts: signals
    /// (pending, stopped), the fd table as seen from outside (targets), and what the fds that
    /// anyone may open by name or reach through their peer hold (queued bytes of pipes, FIFOs
    /// and sockets; terminal settings). Not: fdinfo (a position, an eventfd's count, an epoll
    /// set change only through the open file itself, which another process reaches only by
    /// sharing it: it then holds it too and shows the change in its own state, or it got it by
    /// a counted route: pidfd_getfd), the syscall sites, cwd and root.
    Held,
}

/// Bytes of the fdinfo bound an fd costs in a [`Depth::Held`] read, which reads no fdinfo: a
/// process of a million fds must not cost a million reads per turn end unbounded.
const HELD_FD_COST: u64 = 64;

fn read_proc_state(
    pid: u32,
    mut fdinfo_budget: u64,
    total: &mut Budget,
    depth: Depth,
) -> Result<(ProcState, u64), MemError> {
    let whole = depth == Depth::Whole;
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
        let syscall = match whole {
            true => syscall_site(&read_opt(&format!("{base}/syscall")).unwrap_or_default()),
            false => String::new(),
        };
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
            // A frozen cgroup (a mark taken while the container is frozen) reads `D` for a
            // stopped task too: the wait channel tells.
            stopped: stat.state == 't'
                || super::procs::in_job_stop(stat.state, || read_opt(&format!("{base}/wchan"))),
            sleeping: stat.state == 'S',
        });
    }
    let fd_dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&fd_dir)
        .map_err(io_err(pid, "fd list"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    let mut fdinfo_read = 0u64;
    // What the fds hold beyond fdinfo (queued bytes, terminal settings) is read through a
    // copy of each fd; a process gone meanwhile shows as its fds missing.
    let pidfd = crate::sys::pidfd::PidFd::open(pid).ok();
    for fd in fds {
        let target = readlink_opt(&format!("{fd_dir}/{fd}"));
        if !whole {
            total.stats.fdinfo_bytes += HELD_FD_COST;
            total.fdinfo(HELD_FD_COST)?;
        }
        let fdinfo = match whole {
            true => std::fs::File::open(format!("/proc/{pid}/fdinfo/{fd}")).ok(),
            false => None,
        };
        let info = match fdinfo {
            None => Vec::new(),
            Some(f) => {
                // Read at most one byte past what the observation may still read.
                let left = total.fdinfo_left();
                let mut src = Counted {
                    inner: io::Read::take(f, left.saturating_add(1)),
                    n: 0,
                };
                let info = fdinfo_lines(&mut src, &mut fdinfo_budget);
                fdinfo_read += src.n;
                total.stats.fdinfo_bytes += src.n;
                total.fdinfo(src.n)?;
                info
            }
        };
        let mut info = info;
        if let Some(h) = pidfd
            .as_ref()
            .and_then(|p| super::held::held(p.as_fd(), fd, &target))
        {
            total.memory(h.bytes_read)?;
            total.stats.queue_bytes += h.bytes_read;
            info.push(h.line);
        }
        st.fds.push(FdState { fd, target, info });
    }
    if whole {
        st.cwd = readlink_opt(&format!("/proc/{pid}/cwd"));
        st.root = readlink_opt(&format!("/proc/{pid}/root"));
    }
    Ok((st, fdinfo_read))
}

/// What the kernel holds for process `pid` now that can change while it does not run (see
/// `Depth::Held`: signals, stopped, fd targets, queued bytes, terminal settings), without its
/// memory: for a process that did not run since its image was taken, to compare with that
/// image's state ([`compare_held`]). Counts against `obs`'s bounds.
pub fn read_held_state(pid: u32, obs: &mut Observation) -> Result<ProcState, MemError> {
    obs.budget.fail()?;
    let (state, _) = read_proc_state(pid, 0, &mut obs.budget, Depth::Held)?;
    Ok(state)
}

/// The line of an fd's state that says what it holds ([`super::held`]), if any.
fn held_line(f: &FdState) -> Option<&str> {
    f.info
        .iter()
        .find(|l| l.starts_with("queue: ") || l.starts_with("termios "))
        .map(String::as_str)
}

/// What differs between a whole state `prev` and a [`read_held_state`] `now` of one process:
/// [`compare_state`] of what the latter reads (`prev` seen at that depth).
pub fn compare_held(prev: &ProcState, now: &ProcState) -> Vec<String> {
    let held = ProcState {
        threads: prev
            .threads
            .iter()
            .map(|t| ThreadState {
                syscall: String::new(),
                ..t.clone()
            })
            .collect(),
        fds: prev
            .fds
            .iter()
            .map(|f| FdState {
                fd: f.fd,
                target: f.target.clone(),
                info: held_line(f).map(str::to_string).into_iter().collect(),
            })
            .collect(),
        cwd: String::new(),
        root: String::new(),
        signals_while_pending: prev.signals_while_pending,
    };
    compare_state(&held, now, false)
}

/// A reader that counts the bytes read through it.
struct Counted<R> {
    inner: R,
    n: u64,
}

impl<R: io::Read> io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
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
    /// Those of them that make the process count as changed: all but the syscall sites.
    pub state_counted: Vec<String>,
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
/// Pages in `[lo, hi)` whose hashes differ between `a` and `b` (a page absent from a list has
/// its kind's default content) and that `same` does not find equal after all (given the
/// address and each side's hash, if present).
fn differing_pages(
    a: &[(u64, u64)],
    b: &[(u64, u64)],
    lo: u64,
    hi: u64,
    same: &dyn Fn(u64, Option<u64>, Option<u64>) -> bool,
) -> u64 {
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
            if !same(a[i].0, Some(a[i].1), None) {
                n += 1;
            }
            i += 1;
        } else if i >= ie || b[j].0 < a[i].0 {
            if !same(b[j].0, None, Some(b[j].1)) {
                n += 1;
            }
            j += 1;
        } else {
            if a[i].1 == UNREADABLE
                || (a[i].1 != b[j].1 && !same(a[i].0, Some(a[i].1), Some(b[j].1)))
            {
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
    // A page one image masked and the other did not: equal if its bytes as read are.
    let zh = zero_hash();
    let raw = |m: &[(u64, u64)], va: u64| m.binary_search_by_key(&va, |e| e.0).ok().map(|k| m[k].1);
    let same = |va: u64, x: Option<u64>, y: Option<u64>| {
        let (xm, ym) = (raw(&prev.masked, va), raw(&now.masked, va));
        if xm.is_some() == ym.is_some() {
            return false;
        }
        let xr = xm.unwrap_or(x.unwrap_or(zh));
        let yr = ym.unwrap_or(y.unwrap_or(zh));
        xr == yr && xr != UNREADABLE
    };
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
                differing_pages(
                    &a.page_hashes_in(lo, hi),
                    &b.page_hashes_in(lo, hi),
                    lo,
                    hi,
                    &same,
                )
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
    d.state_changes = compare_state(&prev.state, &now.state, true);
    d.state_counted = compare_state(&prev.state, &now.state, false);
    by_region.sort_by_key(|r| std::cmp::Reverse(r.1));
    d.by_region = by_region;
    d
}

/// What differs between two states of one process, described. `sites`: whether the syscall
/// each thread is blocked in counts (it moves whenever the process runs, which its memory
/// tells; only a tracer could move it otherwise, and ptrace writes count on their own).
pub fn compare_state(a: &ProcState, b: &ProcState, sites: bool) -> Vec<String> {
    let mut out = Vec::new();
    if a.signals_while_pending != b.signals_while_pending {
        out.push(match (a.signals_while_pending, b.signals_while_pending) {
            (_, None) => "its pending signals were taken".to_string(),
            (None, Some(_)) => "signals queued and pending".to_string(),
            (Some(x), Some(y)) => {
                format!("{} more signals queued while pending", y.wrapping_sub(x))
            }
        });
    }
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
            if x.stopped != y.stopped {
                out.push(format!(
                    "thread {}: {}",
                    x.tid,
                    if y.stopped { "stopped" } else { "continued" }
                ));
            }
            if sites && x.syscall != y.syscall {
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
            Some(y) if y.info != x.info => match (held_line(x), held_line(y)) {
                (a, b) if a != b => out.push(format!(
                    "fd {fd} ({}): {} -> {}",
                    x.target,
                    a.unwrap_or("-"),
                    b.unwrap_or("-")
                )),
                _ => out.push(format!("fd {fd} ({}): position/flags/state", x.target)),
            },
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
