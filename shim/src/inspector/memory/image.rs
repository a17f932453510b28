//! What a memory image is: its regions, pages, the kernel-held state of the process, and the
//! errors of taking one.

use std::io;
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::super::procs::ProcfsError;

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

pub(super) fn io_err(pid: u32, what: impl Into<String>) -> impl FnOnce(io::Error) -> MemError {
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
pub(super) const UNREADABLE: u64 = u64::MAX;

pub fn page_size() -> u64 {
    static PS: OnceLock<u64> = OnceLock::new();
    *PS.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .unwrap_or(4096) as u64
    })
}

pub(super) fn zero_hash() -> u64 {
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
    /// beyond them ([`super::super::held`]: queued bytes, terminal settings).
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
