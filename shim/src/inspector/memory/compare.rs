//! Comparing two memory images of one process.

use serde::{Deserialize, Serialize};

use super::image::*;
use super::state::*;

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
pub(super) fn same_mapping(a: &Region, b: &Region) -> bool {
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
pub(super) fn differing_pages(
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
