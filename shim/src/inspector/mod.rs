//! The inspector: what did a container's turn leave behind since the last mark?

pub mod bpf;
pub mod fs;
pub mod memory;
pub mod procs;
