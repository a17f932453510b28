//! One observation of a container: its bounds, and the shared-memory objects it has read.

use std::fs::File;

use serde::{Deserialize, Serialize};

use super::image::*;
use super::read::*;

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
    pub(super) budget: Budget,
    pub(super) objects: std::collections::HashMap<ShmemId, Object>,
    pub(super) buf: Vec<u8>,
}

/// What an observation has read, for the turn's answer and log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
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
    /// ([`super::super::held`]); part of the memory bound.
    pub queue_bytes: u64,
}

impl ObservationStats {
    /// Nothing read, nothing carried over.
    pub fn is_empty(&self) -> bool {
        *self == ObservationStats::default()
    }
}

pub(super) struct Budget {
    pub(super) memory_limit: u64,
    pub(super) fdinfo_limit: u64,
    /// Memory and fdinfo counted so far (read, and carried over).
    pub(super) memory: u64,
    pub(super) fdinfo: u64,
    /// A bound was passed: every later charge fails the same way.
    pub(super) spent: Option<(&'static str, u64, &'static str)>,
    pub(super) stats: ObservationStats,
}

pub(super) const MEMORY_KEY: &str = "max_memory_image_bytes";
pub(super) const FDINFO_KEY: &str = "max_fdinfo_total_bytes";

impl Budget {
    pub(super) fn fail(&self) -> Result<(), MemError> {
        match self.spent {
            Some((what, limit, key)) => Err(MemError::Limit { what, limit, key }),
            None => Ok(()),
        }
    }

    /// Counts `bytes` of memory about to be read (or carried over), or fails past the bound.
    pub(super) fn memory(&mut self, bytes: u64) -> Result<(), MemError> {
        self.fail()?;
        self.memory = self.memory.saturating_add(bytes);
        if self.memory > self.memory_limit {
            self.spent = Some(("memory images", self.memory_limit, MEMORY_KEY));
        }
        self.fail()
    }

    /// Counts `bytes` of fdinfo read (or carried over), or fails past the bound.
    pub(super) fn fdinfo(&mut self, bytes: u64) -> Result<(), MemError> {
        self.fail()?;
        self.fdinfo = self.fdinfo.saturating_add(bytes);
        if self.fdinfo > self.fdinfo_limit {
            self.spent = Some(("fdinfo", self.fdinfo_limit, FDINFO_KEY));
        }
        self.fail()
    }

    /// fdinfo bytes that may still be read.
    pub(super) fn fdinfo_left(&self) -> u64 {
        match self.spent {
            Some(_) => 0,
            None => self.fdinfo_limit - self.fdinfo,
        }
    }
}

/// The hashes of one shared-memory object read so far in an observation.
#[derive(Default)]
pub(super) struct Object {
    /// File offset ranges read, sorted and disjoint.
    pub(super) covered: Vec<(u64, u64)>,
    /// `(file offset, hash)` of the non-zero data pages in `covered`, sorted.
    pub(super) hashes: std::sync::Arc<Vec<(u64, u64)>>,
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
    pub(super) fn object_pages(
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
pub(super) struct ObjectRead {
    pub(super) hashes: std::sync::Arc<Vec<(u64, u64)>>,
    /// Pages read for it now.
    pub(super) pages_read: u64,
    /// Pages of its range read before, by an earlier image of the observation.
    pub(super) reused_pages: u64,
}

/// The parts of `[lo, hi)` that the sorted, disjoint ranges `covered` leave out.
pub(super) fn uncovered(covered: &[(u64, u64)], lo: u64, hi: u64) -> Vec<(u64, u64)> {
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
pub(super) fn cover(covered: &mut Vec<(u64, u64)>, (mut a, mut b): (u64, u64)) {
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
pub(super) fn merge_sorted(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
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
