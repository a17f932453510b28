//! containerd's runtime options for crab: crab's own (`runtimeoptions.v1.Options` bytes) and
//! runc's (`containerd.runc.v1.Options`, for the runc-type registration), with what the shim
//! derives from runc's.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The options may carry the config itself (`config_body`): parsed as at Create.
    if let Ok(Some(body)) = crab_runtime_config::decode_runtime_options(data).map(|o| o.config_body)
    {
        let _ = crab_runtime_config::Config::from_toml_str(&body, Path::new("/fuzz/options"));
    }
    if let Ok(o) = crab_runtime_config::decode_runc_options(data) {
        let _ = o.apply_to(&mut crab_runtime_config::Config::default());
        let _ = o.io_owner();
    }
});
