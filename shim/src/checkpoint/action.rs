//! The actions on a container that wait for the checkpoints of the turns before them.

use std::fmt;

/// An action on the container that must not change it before the checkpoints of the turns
/// before it are durable ([`super::Coordinator::wait_durable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Starting the container's init.
    Start,
    /// Starting an exec.
    ExecStart,
    /// New resources.
    Update,
    /// A signal: after the wait bound it goes ahead anyway, and a job waiting for an exec to
    /// end gives up at once (the kill would otherwise wait for the very process it ends).
    Kill,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Start => "start",
            Action::ExecStart => "exec start",
            Action::Update => "update",
            Action::Kill => "kill",
        })
    }
}
