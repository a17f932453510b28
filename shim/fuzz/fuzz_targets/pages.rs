//! Page recipes (`*.recipe`) and pack indexes (`pack-*.idx`) of the chunk store.
#![no_main]

use std::path::Path;

use crab_shim::checkpoint::pages;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = pages::parse_recipe(Path::new("/fuzz/pages-1.img.recipe"), data) {
        assert_eq!(r.digests.len() as u64, r.len.div_ceil(r.chunk_size as u64));
    }
    if let Some((pack_len, entries)) = pages::parse_index(data) {
        for (_, off, len) in entries {
            assert!(off + u64::from(len) <= pack_len);
        }
    }
});
