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

/// Brings the loopback interface of `pid`'s network namespace up. `runc create` does that for
/// a network namespace it creates, `runc restore` does not (CRIU restores into the namespace
/// runc made, and the image holds no network devices of its own), so a restored server would
/// answer nobody on 127.0.0.1. A namespace given by path (a pod's, set up by CNI) is not ours
/// to touch: the caller only asks for namespaces runc created.
pub fn bring_up_loopback(pid: u32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = socket_in(
        Path::new(&format!("/proc/{pid}/ns/net")),
        AddressFamily::Inet,
        SockType::Datagram,
        None,
    )?;
    // SAFETY: ifreq is plain old data; the ioctls read and write only it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    let fd = sock.as_raw_fd();
    // SAFETY: see above.
    if unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS as _, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the flags member of the union is the one SIOCGIFFLAGS filled.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: see above.
    if unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS as _, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
