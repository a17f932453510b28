//! What the task core asks of the host itself rather than of runc: where a container's init
//! sits in the cgroup tree, whether a dump of its tree would hold every live process of the
//! container, and, for the restore at Start ([`super::restore`]), the kernel check of the
//! restored processes, the kill of what a refused restore left in the container's cgroup and
//! the loopback interface of a restored network namespace. The shim asks the kernel
//! ([`SystemHost`]); the core's unit tests a fake.

use std::path::{Path, PathBuf};

use oci_spec::runtime::Spec;

use crate::{
    checkpoint::process::{check_dumpable, ProcError},
    error::Result,
    restore::{kernel, seccomp},
    sys::cgroup::Cgroups,
};

pub trait Host: Send + Sync {
    /// The cgroup2 directory of process `pid` (`None`: it has none, a cgroup v1 host).
    fn cgroup2_of(&self, pid: u32) -> Result<Option<PathBuf>>;

    /// Refused when a live process of `cgroup` does not descend from `init` (a dump of init's
    /// tree would leave it out) or `init` is gone.
    fn check_dumpable(&self, init: u32, cgroup: &Path) -> std::result::Result<(), ProcError>;

    /// Readies what the kernel check reads restored threads' seccomp filters with, while CRIU
    /// restores (a failure is only logged: the check then fails on it).
    fn preload_kernel_check(&self);

    /// The kernel check of a tree CRIU restored and holds at pre-resume (`script`: the pid of
    /// the gate's action script, `init`: the restored init) against `expected`. On an error
    /// the restored tree (and CRIU) have been killed before this returns.
    fn check_restored(
        &self,
        expected: &kernel::Expected,
        script: u32,
        init: u32,
    ) -> std::result::Result<kernel::Passed, kernel::CheckError>;

    /// SIGKILLs every process in container `id`'s cgroup (from `spec`'s `cgroupsPath`);
    /// returns how many.
    fn kill_cgroup_members(&self, spec: &Spec, id: &str) -> usize;

    /// Brings up the loopback interface of the network namespace of process `pid`.
    fn bring_up_loopback(&self, pid: u32) -> std::io::Result<()>;

    /// Lets the CRIU that `runc restore` starts load the kernel probe cache crab's dumps keep
    /// (on a host whose `/run` is not a tmpfs it would probe the kernel again, ~50-70 ms).
    fn share_criu_cache(&self);
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

    fn preload_kernel_check(&self) {
        if let Err(e) = seccomp::preload() {
            log::warn!("loading the kernel check's task iterator: {e}");
        }
    }

    fn check_restored(
        &self,
        expected: &kernel::Expected,
        script: u32,
        init: u32,
    ) -> std::result::Result<kernel::Passed, kernel::CheckError> {
        kernel::check_restored(expected, script, init)
    }

    fn kill_cgroup_members(&self, spec: &Spec, id: &str) -> usize {
        super::restore::kill_cgroup_members(spec, id)
    }

    fn bring_up_loopback(&self, pid: u32) -> std::io::Result<()> {
        crate::sys::netns::bring_up_loopback(pid)
    }

    fn share_criu_cache(&self) {
        crate::checkpoint::criu_rpc::link_kdat_cache();
    }
}
