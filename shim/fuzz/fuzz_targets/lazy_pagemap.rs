//! The files a lazy restore rewrites before it runs (`restore::eager`): a process's
//! `mm-<pid>.img` (where its command line and environment are) and its `pagemap-<pid>.img`.
//! Whatever the input, a rewritten pagemap must read back, cover the same addresses with the
//! same pages in the same order (the pages file is consumed in that order), and differ only
//! in lazy flags cleared inside the command line's pages.
//!
//! The input is the mm file, [`SEP`], then the pagemap file.
#![no_main]

use crab_shim::restore::eager;
use libfuzzer_sys::fuzz_target;

const SEP: &[u8] = b"#CRABFILE#";
const PAGE: u64 = 4096;

/// Each page of `entries` with its flags, in order (bounded: a pagemap may claim 2^64 pages).
fn pages(entries: &[eager::Entry]) -> Option<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    for e in entries {
        for i in 0..e.nr_pages {
            if out.len() > 1 << 16 {
                return None;
            }
            out.push((e.vaddr.checked_add(i.checked_mul(PAGE)?)?, e.flags));
        }
    }
    Some(out)
}

fuzz_target!(|data: &[u8]| {
    let Some(i) = data.windows(SEP.len()).position(|w| w == SEP) else {
        return;
    };
    let (mm, pagemap) = (&data[..i], &data[i + SEP.len()..]);
    let Ok(ranges) = eager::mm_command_line_pages(mm, PAGE) else {
        return;
    };
    for &(s, t) in &ranges {
        assert!(s <= t && s % PAGE == 0 && t % PAGE == 0, "{ranges:x?}");
    }
    let Ok(Some((new, changed))) = eager::rewrite_pagemap(pagemap, &ranges, PAGE) else {
        return;
    };
    let before = eager::pagemap_entries(pagemap).expect("rewritten, so it read");
    let after = eager::pagemap_entries(&new).expect("a rewritten pagemap reads back");
    let (Some(a), Some(b)) = (pages(&before), pages(&after)) else {
        return;
    };
    assert_eq!(a.len(), b.len(), "the same pages");
    let mut cleared = 0;
    for ((va, fa), (vb, fb)) in a.iter().zip(&b) {
        assert_eq!(va, vb, "in the same order");
        if fa != fb {
            assert!(eager::lazy(*fa) && !eager::lazy(*fb) && eager::present(*fa));
            assert_eq!(fa & !2, *fb, "only the lazy flag");
            assert!(ranges.iter().any(|&(s, t)| s <= *va && *va < t), "inside a range");
            cleared += 1;
        }
    }
    assert_eq!(cleared, changed);
});
