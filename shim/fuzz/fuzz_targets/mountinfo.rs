//! `/proc/PID/mountinfo` and `/proc/PID/cgroup`, as crab reads them to find cgroups and mounts
//! (mount points and cgroup names are paths others chose).
#![no_main]

use crab_shim::sys::{cgroup, mountinfo};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mounts = mountinfo::parse(data);
    for m in &mounts {
        let _ = m.super_options().count();
    }
    let _ = mountinfo::mount_points_under(&mounts, std::path::Path::new("/run"));
    let _ = cgroup::hierarchy_mount_points(&mounts);
    if let Some(h) = cgroup::Hierarchy::unified(&mounts) {
        let text = String::from_utf8_lossy(data);
        for line in text.lines() {
            let _ = h.level_of(&h.dir_of(line));
        }
    }
});
