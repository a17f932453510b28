//! crab's containerd shim v2 (`io.containerd.crab.v1`): the containerd Task API over runc.
//!
//! - [`service`]: the protocol edge (shim lifecycle commands, ttrpc Task service)
//! - [`containers`]: containers and processes, their lifecycle and events
//! - [`runc`], [`reaper`]: running runc under the shim's reaper
//! - [`stdio`]: FIFOs, files, pipes and the pty
//! - [`bundle`], [`oom`]: the OCI bundle and OOM notifications
//! - [`idmap`]: id-mapped rootfs layers of pods with their own user namespace
//! - [`info`]: `-info`, the runtime features containerd's introspection asks for
//! - [`sys`]: the operating system below everything else (mount table, cgroups, files beneath a
//!   root, raw system calls)

pub mod bundle;
pub mod checkpoint;
pub mod containers;
pub mod engine;
pub mod error;
pub mod idmap;
pub mod info;
pub mod inspector;
pub mod logdriver;
pub mod oom;
pub mod placement;
pub mod process;
pub mod reaper;
pub mod runc;
pub mod service;
pub mod stats;
pub mod stdio;
pub mod sys;
pub mod turns;

/// The runtime's name as containerd knows it (the shim's id, and the runtime name crab's
/// container records carry).
pub use service::RUNTIME_ID;
