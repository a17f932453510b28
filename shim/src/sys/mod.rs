//! The operating system as crab uses it, below everything else: nothing here depends on the
//! rest of crab, and the inspector depends on nothing of crab but this.
//!
//! - [`mountinfo`]: the one parser of `/proc/PID/mountinfo` (hostile input)
//! - [`cgroup`]: a process's cgroup directories (v1, v2, hybrid), cgroup ids, the freezer
//! - [`beneath`]: opening files a container controls without being led elsewhere
//! - [`netns`], [`sockdiag`]: sockets in a container's network namespace; its TCP sockets by
//!   state (`inet_diag`)
//! - [`file`], [`xattr`], [`bpf`]: descriptor-owning wrappers over nix's `open*`, and the calls
//!   nix 0.29 lacks (`sync_file_range`, xattrs, a few `bpf(2)` commands); every other system
//!   call goes through nix directly
//! - [`pidfd`]: killing a child by pidfd, never a reused pid
//! - [`uffd`]: whether userfaultfd serves CRIU's lazy restore here
//! - [`ksm`]: marking a container's processes for the kernel's same-page merging
//! - [`procfs`]: the pids of the host

pub mod beneath;
pub mod bpf;
pub mod cgroup;
pub mod file;
pub mod ksm;
pub mod mountinfo;
pub mod netns;
pub mod pidfd;
pub mod procfs;
pub mod sockdiag;
pub mod uffd;
pub mod xattr;
