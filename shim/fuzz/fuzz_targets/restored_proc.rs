//! What the kernel check reads of a restored process at CRIU's pre-resume stage:
//! `/proc/PID/task/TID/status` (whose `Name:` the process chose), `/proc/PID/limits` and the
//! id maps. Never a panic; ids are only ever mapped through a map that covers them.
#![no_main]

use crab_shim::restore::kernel::{parse_id_map, parse_limits, parse_status};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let identity = [(0, 0, u32::MAX)];
    let _ = parse_status(&text, &identity, &identity);
    if let Ok(map) = parse_id_map(&text) {
        let _ = parse_status(&text, &map, &map);
    }
    if let Ok(limits) = parse_limits(&text) {
        assert_eq!(limits.len(), 16);
    }
});
