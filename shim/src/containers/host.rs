//! What the task core asks of the host itself rather than of runc: where a container's init
//! sits in the cgroup tree, and whether a dump of its tree would hold every live process of
//! the container. The shim asks the kernel ([`SystemHost`]); the core's unit tests a fake.

use std::path::{Path, PathBuf};

use crate::{
    checkpoint::process::{check_dumpable, ProcError},
    error::Result,
    sys::cgroup::Cgroups,
};

pub trait Host: Send + Sync {
    /// The cgroup2 directory of process `pid` (`None`: it has none, a cgroup v1 host).
    fn cgroup2_of(&self, pid: u32) -> Result<Option<PathBuf>>;

    /// Refused when a live process of `cgroup` does not descend from `init` (a dump of init's
    /// tree would leave it out) or `init` is gone.
    fn check_dumpable(&self, init: u32, cgroup: &Path) -> std::result::Result<(), ProcError>;
}

/// The host as the kernel describes it (`/proc/PID/cgroup`, the cgroup's `cgroup.procs`).
pub struct SystemHost;

impl Host for SystemHost {
    fn cgroup2_of(&self, pid: u32) -> Result<Option<PathBuf>> {
        Ok(Cgroups::of(pid)?.unified)
    }

    fn check_dumpable(&self, init: u32, cgroup: &Path) -> std::result::Result<(), ProcError> {
        check_dumpable(init, cgroup).map(|_| ())
    }
}
