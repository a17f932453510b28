//! crab's containerd shim v2 (`io.containerd.crab.v1`): the containerd Task API over runc.
//!
//! - [`service`]: the protocol edge, the only part that speaks containerd's protocol (shim
//!   lifecycle commands, ttrpc Task service, event publishing, `-info`, task metrics)
//! - [`containers`]: containers and processes, their lifecycle; what happens goes out as
//!   [`events`] (crab's own task events) and failures as [`error`]s
//! - [`rollback`]: resetting a running container's files to a checkpoint in place
//! - [`sandbox`]: one container's turn path (its inspection, turn answers and checkpoint
//!   coordinator); [`turns`]: the annotations that end turns
//! - [`runc`], [`reaper`]: running runc under the shim's reaper
//! - [`stdio`]: FIFOs, files, pipes and the pty
//! - [`bundle`], [`oom`]: the OCI bundle and OOM notifications
//! - [`idmap`]: id-mapped rootfs layers of pods with their own user namespace
//! - [`sys`]: the operating system below everything else (mount table, cgroups, files beneath a
//!   root, raw system calls)

/// The runtime name containerd knows crab by (`--runtime io.containerd.crab.v1`): the shim's
/// id, its `-info` answer's name, and how crabctl tells crab's containers from others.
pub const RUNTIME_ID: &str = "io.containerd.crab.v1";

/// The shim binary's file name, as containerd finds it for [`RUNTIME_ID`].
pub const SHIM_BINARY: &str = "containerd-shim-crab-v1";

pub mod bundle;
pub mod checkpoint;
pub mod containers;
pub mod engine;
pub mod error;
pub mod events;
pub mod grouping;
pub mod idmap;
pub mod inspector;
pub mod logdriver;
pub mod metrics;
pub mod oom;
pub mod placement;
pub mod process;
pub mod reaper;
pub mod replication;
pub mod restore;
pub mod rollback;
pub mod runc;
pub mod sandbox;
pub mod service;
pub mod shimlog;
pub mod stdio;
pub mod sys;
pub mod turns;

/// The unit tests' reproducible generator (xorshift64*), shared with the root tests.
#[cfg(test)]
#[path = "../tests/support/rng.rs"]
pub(crate) mod test_rng;
