//! A checkpoint store's manifest (`checkpoints/<seq>.json`).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = crab_shim::checkpoint::store::parse_manifest(Path::new("/fuzz/1.json"), data);
});
