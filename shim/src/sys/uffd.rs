//! Whether this kernel gives userfaultfd with what CRIU's lazy restore needs (its
//! `uffd-noncoop` feature: the fork, remap, unmap and remove events), asked once per process.

use std::sync::OnceLock;

/// `UFFD_API` and the event features CRIU's lazy-pages daemon asks for
/// (`linux/userfaultfd.h`).
const UFFD_API: u64 = 0xAA;
const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// The features CRIU's lazy restore of a process tree needs.
pub const NONCOOP: u64 = UFFD_FEATURE_EVENT_FORK
    | UFFD_FEATURE_EVENT_REMAP
    | UFFD_FEATURE_EVENT_REMOVE
    | UFFD_FEATURE_EVENT_UNMAP;

/// Whether a userfaultfd with [`NONCOOP`] can be made here (cached: the kernel does not
/// change under a running process).
pub fn noncoop_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| probe(NONCOOP).is_ok())
}

/// Makes a userfaultfd and asks for `features`; the error says why not.
pub fn probe(features: u64) -> std::io::Result<()> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: userfaultfd(2) takes flags only and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which `api` is, on a
    // userfaultfd descriptor we own.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            UFFDIO_API,
            &mut api as *mut UffdioApi,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if api.features & features != features {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!("userfaultfd lacks features {:#x}", features & !api.features),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_unknown_feature_is_refused() {
        // Bit 63 is no feature: the kernel refuses the API call (or userfaultfd is absent).
        assert!(super::probe(1 << 63).is_err());
    }
}
