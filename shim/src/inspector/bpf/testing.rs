//! What the root-only tests of the loaded programs (`tests/root_bpf.rs`) look at below
//! [`HostProbes`]: the embedded object's programs and links, cgroup levels, the pinned maps.

use std::collections::BTreeSet;
use std::path::Path;

use aya::maps::PerCpuValues;

use super::{pins, probes, programs, BpfError, HostProbes};

/// Names of the embedded object's programs.
pub fn program_names() -> Vec<&'static str> {
    programs::program_names().collect()
}

/// The links the programs attach.
pub fn expected_links() -> Result<BTreeSet<String>, BpfError> {
    programs::expected_links()
}

/// The level of a cgroup in the cgroup2 hierarchy, as the programs see it.
pub fn cgroup_level(cgroup_id: u64) -> Result<u64, BpfError> {
    probes::cgroup_level(cgroup_id)
}

/// Marks `cgroup_id` watched (zero counters) in the pinned version at `version_dir`,
/// as a shim of that version would.
pub fn watch_in_pins(version_dir: &Path, cgroup_id: u64) -> Result<(), BpfError> {
    let values = vec![programs::RawCounters::default(); probes::possible_cpus()?];
    let values = PerCpuValues::try_from(values).map_err(|source| BpfError::Syscall {
        op: "per-CPU counters",
        source,
    })?;
    pins::open_pinned(version_dir)?
        .watched
        .insert(cgroup_id, values, 0)
        .map_err(super::map_err("watched"))
}

/// The mask of cgroup levels `probes` watch, and the levels map's entry 0.
pub fn watched_levels(probes: &HostProbes) -> Result<(u64, u64), BpfError> {
    let maps = probes.maps();
    let mask = probes::watched_levels(&maps)?;
    let entry = maps.levels.get(&0, 0).map_err(super::map_err("levels"))?;
    Ok((mask, entry))
}
