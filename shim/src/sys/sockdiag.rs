//! The TCP sockets of a network namespace, by state, through `NETLINK_SOCK_DIAG`
//! (`inet_diag`, what `ss` uses).
//!
//! Not `/proc/<pid>/net/tcp`: reading that walks the host's whole established hash in 4 KiB
//! pieces and costs ~6 ms per file on a large host even when the namespace holds nothing,
//! while a diag dump filtered by state answers in well under a millisecond. The netlink socket
//! is opened by a short-lived thread that joined the namespace (a socket stays in the network
//! namespace it was created in: [`crate::sys::netns::socket_in`]).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use nix::sys::socket::{self, AddressFamily, MsgFlags, NetlinkAddr, SockProtocol};

/// `SOCK_DIAG_BY_FAMILY`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;
/// `struct inet_diag_msg` up to its state byte: family, state.
const MSG_MIN: usize = 2;
/// How many answers a dump may hold before the caller is told "too many" (each is a socket).
const MAX_SOCKETS: usize = 100_000;

/// A TCP state (`include/net/tcp_states.h`).
pub const TCP_LISTEN: u8 = 10;
pub const TCP_CLOSE: u8 = 7;
pub const TCP_TIME_WAIT: u8 = 6;
/// States 1 (ESTABLISHED) to 12 (NEW_SYN_RECV).
pub const ALL_TCP_STATES: u32 = 0x1ffe;

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error("{op}: {source}")]
    Sys {
        op: &'static str,
        #[source]
        source: nix::Error,
    },
    #[error("a NETLINK_SOCK_DIAG socket in the network namespace: {0}")]
    Namespace(#[source] std::io::Error),
    #[error("a malformed inet_diag answer: {0}")]
    Malformed(&'static str),
    #[error("the kernel refused the inet_diag dump: errno {0}")]
    Refused(i32),
    #[error("more than {MAX_SOCKETS} sockets")]
    TooMany,
}

fn sys(op: &'static str) -> impl FnOnce(nix::Error) -> SockDiagError {
    move |source| SockDiagError::Sys { op, source }
}

/// A `NETLINK_SOCK_DIAG` socket in the network namespace `netns` (a `/proc/<pid>/ns/net`).
pub fn socket_in(netns: &Path) -> Result<OwnedFd, SockDiagError> {
    crate::sys::netns::socket_in(
        netns,
        AddressFamily::Netlink,
        socket::SockType::Datagram,
        Some(SockProtocol::NetlinkSockDiag),
    )
    .map_err(SockDiagError::Namespace)
}

/// A `NETLINK_SOCK_DIAG` socket in the calling thread's network namespace (tests).
#[cfg(test)]
fn diag_socket() -> Result<OwnedFd, SockDiagError> {
    use nix::sys::socket::SockFlag;
    socket::socket(
        AddressFamily::Netlink,
        socket::SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )
    .map_err(sys("socket(NETLINK_SOCK_DIAG)"))
}

/// The request: a dump of `family`'s TCP sockets in `states` (a bit per state).
pub fn request(family: u8, states: u32, seq: u32) -> [u8; NLMSG_HDR + REQ_LEN] {
    let mut b = [0u8; NLMSG_HDR + REQ_LEN];
    b[0..4].copy_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    b[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b[NLMSG_HDR] = family;
    b[NLMSG_HDR + 1] = libc::IPPROTO_TCP as u8;
    b[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&states.to_ne_bytes());
    b
}

/// What one datagram of a dump said.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The sockets' states; more datagrams follow.
    States(Vec<u8>),
    /// The end of the dump, with the states of the sockets before it in the same datagram.
    Done(Vec<u8>),
}

/// Parses one datagram of a dump (netlink messages, 4-byte aligned). Input from the kernel,
/// parsed as untrusted all the same: every length is checked.
pub fn parse(mut buf: &[u8]) -> Result<Answer, SockDiagError> {
    let mut states = Vec::new();
    while buf.len() >= NLMSG_HDR {
        let len = u32::from_ne_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(buf[4..6].try_into().expect("2 bytes"));
        if len < NLMSG_HDR || len > buf.len() {
            return Err(SockDiagError::Malformed("a message length out of bounds"));
        }
        let body = &buf[NLMSG_HDR..len];
        match kind {
            NLMSG_DONE => return Ok(Answer::Done(states)),
            NLMSG_ERROR => {
                let errno = body
                    .get(0..4)
                    .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
                    .ok_or(SockDiagError::Malformed("a short error message"))?;
                // The kernel sends a negative errno; `i32::MIN` has no positive (found by the
                // fuzz target: `-errno` overflowed and panicked).
                let errno = errno
                    .checked_neg()
                    .ok_or(SockDiagError::Malformed("an error number out of range"))?;
                return Err(SockDiagError::Refused(errno));
            }
            SOCK_DIAG_BY_FAMILY => {
                if body.len() < MSG_MIN {
                    return Err(SockDiagError::Malformed("a short socket message"));
                }
                states.push(body[1]);
            }
            _ => return Err(SockDiagError::Malformed("an unexpected message type")),
        }
        let aligned = (len + 3) & !3;
        buf = buf.get(aligned..).unwrap_or_default();
    }
    if !buf.is_empty() {
        return Err(SockDiagError::Malformed("a truncated message"));
    }
    Ok(Answer::States(states))
}

/// The states of the TCP sockets (IPv4 and IPv6) in `states` of the namespace `sock` was made
/// in ([`socket_in`]).
pub fn tcp_states(sock: &OwnedFd, states: u32) -> Result<Vec<u8>, SockDiagError> {
    let kernel = NetlinkAddr::new(0, 0);
    let mut found = Vec::new();
    let mut buf = vec![0u8; 32 << 10];
    for (seq, family) in [(1, libc::AF_INET as u8), (2, libc::AF_INET6 as u8)] {
        socket::sendto(
            sock.as_raw_fd(),
            &request(family, states, seq),
            &kernel,
            MsgFlags::empty(),
        )
        .map_err(sys("sending the inet_diag request"))?;
        loop {
            let n = loop {
                match socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    other => break other,
                }
            }
            .map_err(sys("reading the inet_diag answer"))?;
            let answer = parse(&buf[..n])?;
            let (more, done) = match answer {
                Answer::States(s) => (s, false),
                Answer::Done(s) => (s, true),
            };
            found.extend(more);
            if found.len() > MAX_SOCKETS {
                return Err(SockDiagError::TooMany);
            }
            if done {
                break;
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: u16, body: &[u8]) -> Vec<u8> {
        let len = NLMSG_HDR + body.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(body);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    #[test]
    fn requests_ask_for_a_dump_of_tcp_in_the_states_given() {
        let r = request(libc::AF_INET6 as u8, 1 << 1, 7);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), 20);
        assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), 0x301);
        assert_eq!(
            (r[16], r[17]),
            (libc::AF_INET6 as u8, libc::IPPROTO_TCP as u8)
        );
        assert_eq!(u32::from_ne_bytes(r[20..24].try_into().unwrap()), 2);
    }

    #[test]
    fn answers_are_parsed_and_bad_ones_refused() {
        let sock = |state: u8| msg(SOCK_DIAG_BY_FAMILY, &[2, state, 0, 0, 9, 9, 9]);
        let mut two = sock(1);
        two.extend(sock(10));
        assert_eq!(parse(&two).unwrap(), Answer::States(vec![1, 10]));
        two.extend(msg(NLMSG_DONE, &[0; 4]));
        assert_eq!(parse(&two).unwrap(), Answer::Done(vec![1, 10]));
        assert_eq!(parse(&[]).unwrap(), Answer::States(vec![]));
        let err = msg(NLMSG_ERROR, &(-libc::EPERM).to_ne_bytes());
        assert!(matches!(
            parse(&err),
            Err(SockDiagError::Refused(libc::EPERM))
        ));
        // Lengths beyond the datagram, below a header, short bodies, leftovers, other types.
        let mut long = sock(1);
        long[0] = 200;
        let mut short = sock(1);
        short[0] = 3;
        for bad in [
            long,
            short,
            msg(SOCK_DIAG_BY_FAMILY, &[2]),
            msg(NLMSG_ERROR, &[1]),
            // An errno with no positive: `-errno` would overflow (a fuzz finding).
            msg(NLMSG_ERROR, &i32::MIN.to_ne_bytes()),
            msg(99, &[]),
            vec![1, 2, 3],
        ] {
            assert!(parse(&bad).is_err(), "{bad:?}");
        }
    }

    /// The kernel's answers for this process's own namespace (joining another one needs root:
    /// the checkpoint e2e tests do that).
    #[test]
    fn the_kernel_answers_by_state() {
        let sock = diag_socket().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let states = tcp_states(&sock, 1 << TCP_LISTEN).unwrap();
        assert!(states.iter().all(|s| *s == TCP_LISTEN), "{states:?}");
        assert!(!states.is_empty());
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let states = tcp_states(&sock, ALL_TCP_STATES).unwrap();
        assert!(states.contains(&1), "an established connection: {states:?}");
        assert!(socket_in(Path::new("/nonexistent/ns/net")).is_err());
    }
}
