//! What the kernel holds behind a process's fds beyond `fdinfo`: bytes queued in the pipes,
//! FIFOs and sockets it can read, and the settings of the terminals it holds. A process that
//! sleeps while another one writes into its FIFO, sends to its socket or changes its terminal
//! does not run, and its memory does not change, but CRIU dumps that state (pipe data, unix
//! socket queues, TCP queues with established connections, termios): a turn end compares it.
//!
//! Read without consuming and without opening anything: the fd is copied out of the process
//! (`pidfd_getfd`, which shares the open file: no reader or writer is added to a FIFO, nothing
//! is woken), then
//! - a pipe or FIFO it can read: `FIONREAD`, and the queued bytes duplicated with `tee(2)` into
//!   a pipe of ours and hashed (tee takes nothing from the source);
//! - a unix or TCP stream socket: `SIOCINQ`, and the queued bytes read with `MSG_PEEK`, unless
//!   the socket has a peek offset (`SO_PEEK_OFF`, which a peek would move): then what it holds
//!   is "unprovable";
//! - a unix datagram or seqpacket socket: whether anything is queued (`MSG_PEEK` of one byte).
//!   The kernel tells the first datagram's length only, not how many there are, so a non-empty
//!   queue is "unprovable";
//! - a terminal: its `termios`.
//!
//! "Unprovable" lines differ every time they are read, so the process counts as changed at
//! every turn end while that lasts: conservative, never `none` by default. The same for queues
//! larger than [`MAX_QUEUE_BYTES`]. Other sockets (UDP, netlink, packet, ...) have no queue
//! CRIU restores and are left out.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of one queue hashed at most; a larger queue is "unprovable".
pub const MAX_QUEUE_BYTES: u64 = 4 << 20;

/// The line a held fd adds to its state, and the queued bytes read to make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub line: String,
    pub bytes_read: u64,
}

/// What fd `fd` of the process behind `pidfd` holds, for an fd whose `/proc/PID/fd` link reads
/// `target`; `None` for fds without queued state (regular files, directories, devices other
/// than terminals, write ends, sockets without a queue CRIU keeps), or gone meanwhile.
pub fn held(pidfd: BorrowedFd<'_>, fd: i32, target: &str) -> Option<Held> {
    let maybe = target.starts_with("pipe:[")
        || target.starts_with("socket:[")
        || target.starts_with("/dev/pts/")
        || target.starts_with("/dev/tty")
        || target.starts_with("/dev/console")
        || target.starts_with('/');
    if !maybe {
        return None; // anon inodes: their state is in fdinfo
    }
    let copy = crate::sys::pidfd::get_fd(pidfd, fd).ok()?;
    match file_type(&copy)? {
        libc::S_IFIFO => pipe(&copy),
        libc::S_IFSOCK => socket(&copy),
        libc::S_IFCHR => terminal(&copy),
        _ => None,
    }
}

/// The file type of `fd` as the kernel has it cached (`AT_STATX_DONT_SYNC`): a file of a
/// network or FUSE filesystem is not asked for its attributes (a hostile FUSE server could
/// hold the turn end), and a type never changes.
fn file_type(fd: &OwnedFd) -> Option<u32> {
    // SAFETY: statx is plain old data; all zeroes is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx of an fd `fd` owns (empty NUL-terminated path, AT_EMPTY_PATH) into a
    // buffer of the right type that lives across the call.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE,
            &mut stx,
        )
    };
    (rc == 0 && stx.stx_mask & libc::STATX_TYPE != 0).then_some(stx.stx_mode as u32 & libc::S_IFMT)
}

/// A line that never equals another one: what a queue holds cannot be read exactly.
fn unprovable(what: &str) -> Held {
    static NONCE: AtomicU64 = AtomicU64::new(0);
    Held {
        line: format!(
            "queue: {what}, unprovable #{}",
            NONCE.fetch_add(1, Ordering::Relaxed)
        ),
        bytes_read: 0,
    }
}

fn fionread(fd: &OwnedFd) -> io::Result<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as u64)
}

fn hashed(kind: &str, n: u64, bytes: &[u8]) -> Held {
    Held {
        line: format!(
            "queue: {kind} {n} bytes xxh3={:016x}",
            xxhash_rust::xxh3::xxh3_64(bytes)
        ),
        bytes_read: bytes.len() as u64,
    }
}

/// A pipe or FIFO: the bytes queued, if the process can read them.
fn pipe(fd: &OwnedFd) -> Option<Held> {
    // SAFETY: F_GETFL takes no argument.
    let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if fl < 0 || fl & libc::O_ACCMODE == libc::O_WRONLY {
        return None; // a write end: the reader's side holds the queue
    }
    let n = match fionread(fd) {
        Ok(n) => n,
        Err(_) => return Some(unprovable("pipe")),
    };
    if n == 0 {
        return Some(hashed("pipe", 0, &[]));
    }
    if n > MAX_QUEUE_BYTES {
        return Some(unprovable(&format!("pipe of {n} bytes")));
    }
    match tee_all(fd, n) {
        Ok(bytes) if bytes.len() as u64 == n => Some(hashed("pipe", n, &bytes)),
        _ => Some(unprovable("pipe")),
    }
}

/// The `n` bytes queued in pipe `src`, duplicated with tee(2) into a pipe of ours and read
/// from there: the source keeps them.
fn tee_all(src: &OwnedFd, n: u64) -> io::Result<Vec<u8>> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: new descriptors nothing else owns.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // Room for all of it (the source may hold up to its own size, which can exceed ours).
    let want = n.next_power_of_two().max(4096) as libc::c_int;
    // SAFETY: F_SETPIPE_SZ takes an int.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, want) };
    // SAFETY: tee between two pipes we hold, nonblocking.
    let t = unsafe {
        libc::tee(
            src.as_raw_fd(),
            w.as_raw_fd(),
            n as usize,
            libc::SPLICE_F_NONBLOCK,
        )
    };
    if t < 0 {
        return Err(io::Error::last_os_error());
    }
    drop(w);
    let mut out = vec![0u8; t as usize];
    let mut got = 0;
    while got < out.len() {
        // SAFETY: reading into the unfilled part of our buffer.
        let k = unsafe {
            libc::read(
                r.as_raw_fd(),
                out[got..].as_mut_ptr().cast(),
                out.len() - got,
            )
        };
        if k <= 0 {
            return Err(io::Error::last_os_error());
        }
        got += k as usize;
    }
    Ok(out)
}

fn sockopt(fd: &OwnedFd, name: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt of an int-sized option into an int.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(v)
}

/// `recv(MSG_PEEK | MSG_DONTWAIT)` into `buf`: bytes peeked, or the error.
fn peek(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: recv into our buffer; MSG_PEEK leaves the queue as it is.
    let k = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if k < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(k as usize)
}

fn socket(fd: &OwnedFd) -> Option<Held> {
    let domain = sockopt(fd, libc::SO_DOMAIN)?;
    let ty = sockopt(fd, libc::SO_TYPE)?;
    let proto = sockopt(fd, libc::SO_PROTOCOL).unwrap_or(0);
    let tcp = matches!(domain, libc::AF_INET | libc::AF_INET6)
        && ty == libc::SOCK_STREAM
        && proto == libc::IPPROTO_TCP;
    if domain != libc::AF_UNIX && !tcp {
        return None; // no queue CRIU restores (UDP, netlink, packet, ...)
    }
    // A peek would move a peek offset: what is queued cannot be read without changing it.
    let peek_off = sockopt(fd, libc::SO_PEEK_OFF).unwrap_or(-1);
    if domain == libc::AF_UNIX && ty != libc::SOCK_STREAM {
        let mut one = [0u8; 1];
        return match peek(fd, &mut one) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Some(hashed("datagrams", 0, &[])),
            // A listening seqpacket socket, not connected, ...: no queue of data.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOTCONN)) => None,
            _ if peek_off >= 0 => Some(unprovable("datagrams behind a peek offset")),
            _ => Some(unprovable("datagrams queued")),
        };
    }
    let n = match fionread(fd) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return None, // listening
        Err(_) => return Some(unprovable("stream")),
    };
    if n == 0 {
        return Some(hashed("stream", 0, &[]));
    }
    if peek_off >= 0 {
        return Some(unprovable("stream behind a peek offset"));
    }
    if n > MAX_QUEUE_BYTES {
        return Some(unprovable(&format!("stream of {n} bytes")));
    }
    let mut buf = vec![0u8; n as usize];
    match peek(fd, &mut buf) {
        // Short: a unix peek stops at a message carrying fds.
        Ok(k) if k as u64 == n => Some(hashed("stream", n, &buf)),
        _ => Some(unprovable("stream")),
    }
}

fn terminal(fd: &OwnedFd) -> Option<Held> {
    // SAFETY: termios is plain old data; all zeroes is a valid value.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: TCGETS fills the termios `t` points to on an fd `fd` owns; it fails with
    // ENOTTY on other character devices.
    if unsafe { libc::tcgetattr(fd.as_raw_fd(), &mut t) } != 0 {
        return None;
    }
    // SAFETY: termios is plain old data: its bytes are its value.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&t as *const libc::termios).cast::<u8>(),
            std::mem::size_of::<libc::termios>(),
        )
    };
    Some(Held {
        line: format!("termios xxh3={:016x}", xxhash_rust::xxh3::xxh3_64(bytes)),
        bytes_read: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::{UnixDatagram, UnixStream};

    fn own_pidfd() -> crate::sys::pidfd::PidFd {
        crate::sys::pidfd::PidFd::open(std::process::id()).unwrap()
    }

    fn line(fd: i32, target: &str) -> Option<String> {
        let p = own_pidfd();
        held(p.as_fd(), fd, target).map(|h| h.line)
    }

    #[test]
    fn a_pipe_is_hashed_without_taking_its_bytes() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let empty = line(r.as_raw_fd(), "pipe:[1]").unwrap();
        assert!(empty.contains("pipe 0 bytes"), "{empty}");
        nix::unistd::write(&w, b"hello").unwrap();
        let one = line(r.as_raw_fd(), "pipe:[1]").unwrap();
        assert!(one.contains("pipe 5 bytes"), "{one}");
        assert_eq!(one, line(r.as_raw_fd(), "pipe:[1]").unwrap());
        // Same length, other bytes: another line.
        let mut buf = [0u8; 5];
        nix::unistd::read(r.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf, b"hello", "the bytes were still queued");
        nix::unistd::write(&w, b"jello").unwrap();
        let other = line(r.as_raw_fd(), "pipe:[1]").unwrap();
        assert!(other.contains("pipe 5 bytes"));
        assert_ne!(one, other);
        // The write end holds no queue of its own.
        assert_eq!(line(w.as_raw_fd(), "pipe:[1]"), None);
    }

    #[test]
    fn a_stream_socket_is_peeked_and_a_datagram_queue_is_unprovable() {
        let (a, b) = UnixStream::pair().unwrap();
        let fd = b.as_raw_fd();
        let empty = line(fd, "socket:[1]").unwrap();
        (&a).write_all(b"abc").unwrap();
        let one = line(fd, "socket:[1]").unwrap();
        assert_ne!(empty, one);
        assert_eq!(
            one,
            line(fd, "socket:[1]").unwrap(),
            "peeking keeps the bytes"
        );
        let (x, y) = UnixDatagram::pair().unwrap();
        let quiet = line(y.as_raw_fd(), "socket:[2]").unwrap();
        assert_eq!(quiet, line(y.as_raw_fd(), "socket:[2]").unwrap());
        x.send(b"").unwrap(); // even an empty datagram is queued state
        let queued = line(y.as_raw_fd(), "socket:[2]").unwrap();
        assert_ne!(queued, line(y.as_raw_fd(), "socket:[2]").unwrap());
    }

    #[test]
    fn a_peek_offset_is_never_moved() {
        let (a, b) = UnixStream::pair().unwrap();
        let on: libc::c_int = 0;
        // SAFETY: setsockopt of an int.
        let rc = unsafe {
            libc::setsockopt(
                b.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEEK_OFF,
                (&on as *const libc::c_int).cast(),
                4,
            )
        };
        assert_eq!(rc, 0);
        (&a).write_all(b"abc").unwrap();
        let l = line(b.as_raw_fd(), "socket:[1]").unwrap();
        assert!(l.contains("unprovable"), "{l}");
        let mut buf = [0u8; 3];
        let k = peek(&b.try_clone().unwrap().into(), &mut buf).unwrap();
        assert_eq!((k, &buf), (3, b"abc"), "the offset was still 0");
    }

    #[test]
    fn regular_files_and_devices_hold_nothing() {
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(line(f.as_raw_fd(), "/proc/self/status"), None);
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(line(null.as_raw_fd(), "/dev/null"), None);
        assert_eq!(line(9999, "pipe:[1]"), None, "no such fd");
    }
}
