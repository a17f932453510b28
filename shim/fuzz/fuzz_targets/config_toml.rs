//! crab's TOML config (the file runtime options name: trusted for intent, not for form).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = crab_runtime_config::Config::from_toml_str(s, Path::new("/fuzz/crab.toml"));
    }
});
