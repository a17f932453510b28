//! A process held by a pidfd (`pidfd_open`, `pidfd_send_signal`, `pidfd_getfd`, which nix 0.29
//! lacks): the one wrapper of these calls in the shim.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A process held by a pidfd: signals never reach a reused pid.
pub struct PidFd(OwnedFd);

impl PidFd {
    pub fn open(pid: u32) -> io::Result<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags, no pointers.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        Ok(PidFd(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    /// Sends SIGKILL; whether it was delivered.
    pub fn kill(&self) -> bool {
        self.signal(libc::SIGKILL).is_ok()
    }

    /// Sends `signal` to the process (never to another that reuses its pid).
    pub fn signal(&self, signal: libc::c_int) -> io::Result<()> {
        // SAFETY: pidfd_send_signal with a descriptor we own, a signal number, no siginfo and
        // no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// A copy of descriptor `fd` of the process behind `pidfd` (`pidfd_getfd`: the same open
/// file, as `dup` would give; needs ptrace access to the process).
pub fn get_fd(pidfd: BorrowedFd<'_>, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes two descriptors and flags, no pointers.
    let rc = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

impl AsFd for PidFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for PidFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}
