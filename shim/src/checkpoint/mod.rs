//! Checkpoints: the smallest sufficient one at each turn end, off the agent's critical path.
//!
//! - [`coordinator`]: a turn's answer becomes a background job; the next action on the
//!   container waits until that job is durable (bounded), and turn ends that arrive while a
//!   job runs are coalesced into the next job; [`jobs`]: what a job captures of a running
//!   container; [`policy`]: which checkpoint a turn end takes; [`deadline`]: a job aborted
//!   past its time; [`error`]: what can go wrong, typed;
//! - [`store`]: the per-sandbox store (manifests `C_i = (P_j, F_k)`, blobs, atomic publish,
//!   retention); [`layer`]: fs diff layers (OCI tar+zstd, container frozen only while read);
//! - [`process`]: process images with CRIU via runc (the trap check, image verification);
//!   [`pages`]: their page data, content-addressed so unchanged pages are stored once;
//! - [`restore`]: a container started from a checkpoint image (the reserved directory in its
//!   rootfs) and the origin manifests that begin each container's lineage; before anything
//!   of such an image runs, [`provenance`] checks who signed it and [`privilege`] (reading
//!   the CRIU image with [`criu_image`]) that it asks for no more than the spec grants;
//!   [`restore_cache`] keeps a verified image for the next restores of the same checkpoint.

pub mod action;
mod capture;
pub mod coordinator;
pub mod criu_image;
pub mod criu_proto;
pub mod criu_rpc;
pub mod deadline;
pub mod error;
pub mod jobs;
pub mod layer;
pub mod lazy;
pub mod lineage;
pub mod netns;
pub mod pages;
pub mod policy;
pub mod process;
pub mod provenance;
pub mod store;
pub(crate) mod tar;

/// What the root-only tests of layers captured from real overlays (`tests/root_capture.rs`)
/// compare a layer with: the xattrs a layer records for a file.
#[doc(hidden)]
pub mod testing {
    use std::{ffi::CString, io, os::unix::ffi::OsStrExt, path::Path};

    use crate::{inspector::fs::OverlayXattrs, sys::xattr};

    /// The xattrs of `path` (not followed) a layer records, by name: overlayfs' own state
    /// (under the mount's prefix, `overlay`) left out.
    pub fn recorded_xattrs(
        path: &Path,
        overlay: OverlayXattrs,
    ) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let c = CString::new(path.as_os_str().as_bytes())?;
        Ok(super::capture::Xattrs::read(&xattr::Target::Path(&c), overlay)?.other)
    }
}

pub use self::{
    action::Action, coordinator::Coordinator, error::CheckpointError, jobs::ContainerCapture,
};
