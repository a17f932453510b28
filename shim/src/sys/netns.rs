//! Sockets in another process's network namespace.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use nix::sched::CloneFlags;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockProtocol, SockType};

/// A socket (close-on-exec) made in the network namespace `netns` (a `/proc/<pid>/ns/net`),
/// by a short-lived thread that joined it: a thread's network namespace is its own, and a
/// socket stays in the namespace it was made in (its ioctls and netlink requests act there).
pub fn socket_in(
    netns: &Path,
    family: AddressFamily,
    kind: SockType,
    protocol: Option<SockProtocol>,
) -> io::Result<OwnedFd> {
    let ns = crate::sys::file::open(
        netns,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET)?;
            socket::socket(family, kind, SockFlag::SOCK_CLOEXEC, protocol)
        })
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
        .map_err(io::Error::from)
    })
}
