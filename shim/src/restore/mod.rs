//! Restore: everything that brings processes and files back from a checkpoint image, apart
//! from capture (`checkpoint/`), which makes the images.
//!
//! - [`intake`]: a checkpoint image or containerd's checkpoint taken in, bounded, verified
//!   against its signature and copied out of the rootfs; the origin of the new lineage;
//! - [`trust`]: the one trust decision every process restore goes through (crab's images,
//!   containerd's checkpoint path, the internal images of fork, rollback and recover);
//! - [`privilege`]: what a new container's OCI spec grants, and the image's claims against it;
//! - [`kernel`]: what the kernel actually restored, read at CRIU's pre-resume stage (every
//!   process recreated, none has run an instruction of its own) and compared with the spec:
//!   the decision that matters;
//! - [`gate`]: CRIU's action script that holds the restored processes at post-restore (page
//!   files verified) and pre-resume (the kernel check) until the shim's verdict;
//! - [`layers`]: which layers the engine unpacked a checkpoint image's rootfs from, against
//!   the layers its signature names;
//! - [`cache`]: verified process images kept on disk for the next restore of the same image;
//! - [`scratch`]: each restore's own copy of its CRIU image, on disk in the store (never in the
//!   bundle's tmpfs), removed at Delete or when Create fails;
//! - [`rw`]: what a container's read-write layer changes in its image, the digest a
//!   containerd checkpoint's signature binds its rw layer with;
//! - [`volumes`]: the tracked volumes a checkpoint holds, refilled into their host directories.
//!
//! CRIU's image decoding (`checkpoint::criu_image`), the signature format
//! (`checkpoint::provenance`) and lazy page transfer (`checkpoint::lazy`) stay with capture,
//! which shares them; restore depends on checkpoint, never the other way round.

pub mod cache;
pub mod eager;
pub mod gate;
pub mod intake;
pub mod kernel;
pub mod layers;
pub mod privilege;
pub mod rw;
pub mod scratch;
pub mod seccomp;
pub mod trust;
pub mod volumes;
