//! `checkpoint.json` of a checkpoint image (untrusted: it travels through registries).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = crab_shim::restore::intake::CheckpointMeta::parse(
        Path::new("/fuzz/checkpoint.json"),
        data,
    );
});
