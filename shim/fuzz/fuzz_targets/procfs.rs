//! `/proc/PID/stat` and `/proc/PID/maps` of a sandbox's processes, as the inspector reads them
//! (a process names itself, and maps files of any name).
#![no_main]

use crab_shim::inspector::procs;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = procs::parse_stat(&String::from_utf8_lossy(data));
    for line in data.split(|&b| b == b'\n') {
        let _ = procs::parse_maps_line(line);
    }
});
