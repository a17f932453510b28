//! containerd's runtime options for crab (protobuf `runtimeoptions.v1.Options` bytes).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The options may carry the config itself (`config_body`): parsed as at Create.
    if let Ok(Some(body)) = crab_runtime_config::decode_runtime_options(data).map(|o| o.config_body)
    {
        let _ = crab_runtime_config::Config::from_toml_str(&body, Path::new("/fuzz/options"));
    }
});
