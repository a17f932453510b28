//! The CRIU image files crab decodes before a restore (`inventory.img`, `pstree.img`, the root
//! task's `ids-<pid>.img`, each thread's `core-<tid>.img`), then the least-privilege check
//! against two specs' grants; and the `pstree.img` reader of `checkpoint::process`.
//!
//! The input is the files in the order they are asked for, separated by [`SEP`]; a file asked
//! for past the last one is missing.
#![no_main]

use std::path::Path;

use crab_shim::checkpoint::{
    criu_image::{self, CriuImageError},
    process,
};
use crab_shim::restore::privilege::{self, Granted};
use libfuzzer_sys::fuzz_target;

const SEP: &[u8] = b"#CRABFILE#";

fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(SEP.len()).position(|w| w == SEP) {
        out.push(&rest[..i]);
        rest = &rest[i + SEP.len()..];
    }
    out.push(rest);
    out
}

fuzz_target!(|data: &[u8]| {
    let files = split(data);
    if let Some(pstree) = files.get(1) {
        let _ = process::parse_pstree(pstree);
    }
    let mut next = files.into_iter();
    let facts = criu_image::facts_from(Path::new("/fuzz/criu"), &mut |path: &Path| {
        next.next()
            .map(<[u8]>::to_vec)
            .ok_or_else(|| CriuImageError::Malformed {
                path: path.to_path_buf(),
                reason: "missing".into(),
            })
    });
    if let Ok(facts) = facts {
        let _ = privilege::check(&facts, &Granted::default());
        let all = Granted {
            bounding: u64::MAX,
            permitted: u64::MAX,
            inheritable: u64::MAX,
            ..Granted::default()
        };
        let _ = privilege::check(&facts, &all);
    }
});
