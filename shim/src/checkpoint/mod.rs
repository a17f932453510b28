//! Checkpoints (issue 4). The lead owns this file; it only declares the submodules so far.

pub mod pages;
pub mod process;
pub mod layer;
pub mod store;
