//! Issue 25, item 6: an adversarial corpus. A turn can change what the kernel holds for a
//! long-lived process without that process running and without a counted file write: memory
//! written through io_uring, a signal it blocks, bytes queued in a FIFO or a socket it holds, an
//! eventfd count or a file offset changed through `pidfd_getfd`, its scheduling attributes, a
//! SysV queue of the container's IPC namespace, a core dump. crab's promise is that a turn
//! answered `none` changed nothing a recovery or a rollback needs; each test here holds it to
//! that against one such route, end to end (real containerd, runc, CRIU and eBPF):
//!
//! 1. t1 writes the adversary's scripts and starts the **holder** (a python process that blocks
//!    SIGUSR1, holds a FIFO read-write, a bound unix datagram socket it never reads, an eventfd,
//!    a file open at offset 0, an anonymous page with a marker string and an idle second
//!    thread; see [`HOLDER_PY`]) and sleeps: answered `full`, checkpointed with its processes.
//! 2. t2 is one short exec taking the route ([`ADV_PY`]); its answer must not be `none` (`proc`
//!    or `full`; `fs` or `full` for a core dump).
//! 3. `crabctl rollback --to t1` must undo it: the holder's state is t1's again, and (for a
//!    process-state route) the rollback recreated the container (keeping the processes would
//!    keep the change).
//! 4. t3 takes the route again, then a crash (SIGKILL of every process of the container) and
//!    `crabctl recover` must bring the changed state back.
//!
//! The state is read from the host, never through the container (an exec would be part of the
//! next turn), and without changing it ([`digest`]): the marker through `/proc/PID/mem`, pending
//! and blocked signals, state and scheduling from `/proc/PID/{status,stat,limits}`, FIFO bytes
//! with `tee(2)` on a `pidfd_getfd` copy, datagrams peeked one by one (`SO_PEEK_OFF`), eventfd
//! count and file offset from `fdinfo`, SysV queues from the container's IPC namespace, the
//! files the turns wrote by hash, the container's processes by namespace pid and command line.
//!
//! A test collects every way its route is lost (the answer, the rollback, the recovery) and
//! fails with all of them; a route that does not take effect at all (the adversary's own
//! failure) fails at once, as a broken test. Two controls passed before the kernel-state mark
//! too: the same scenario through `process_vm_writev` (counted all along), and every state at
//! once under the `full-every-turn` policy (what CRIU brings back when the inspector is out of the way: all of
//! it, SIGSTOP aside: see [`holder_stopped_by_sigstop`]). Three routes have scenarios of their
//! own: a userfaultfd (which CRIU cannot dump at all), a core dump (written by the kernel, in
//! turns with and without an exec) and a change a restored process makes before the shim's
//! first mark of the restored container.
//! [`a_random_adversary_never_loses_state_across_a_crash`] draws turns from the routes mixed
//! with file and process work, crashing and recovering after each turn.
//!
//! Run: `cargo test --release -p crab-integration --test adversary` (with `hack/containerd.sh
//! env` evaluated). The tests run in parallel:
//! each has its own sandbox; only the core dump test touches the host (`kernel.core_pattern`,
//! see [`PlainCorePattern`]).

use std::{
    collections::BTreeMap,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    os::unix::fs::{FileExt, OpenOptionsExt},
    path::PathBuf,
    time::{Duration, Instant},
};

use crab_integration::{
    host,
    sandbox::{Sandbox, SandboxOptions},
    ProcessSpec, StdioOptions,
};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

/// The holder: started in t1, sleeps forever holding the state the routes change. It writes
/// where that state is (its pid and descriptors in the container, the marker's address, its
/// second thread's id) to `holder.json`. With `--uffd` it also registers a page of its own
/// with a userfaultfd (user-mode faults only), which it never touches.
const HOLDER_PY: &str = r#"import ctypes, fcntl, json, mmap, os, signal, socket, struct, sys, threading

D = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
fifo = os.path.join(D, "fifo")
if not os.path.exists(fifo):
    os.mkfifo(fifo)
fifo_fd = os.open(fifo, os.O_RDWR)
sock_path = os.path.join(D, "dgram.sock")
if os.path.exists(sock_path):
    os.unlink(sock_path)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind(sock_path)
efd = os.eventfd(0)
data = os.open(os.path.join(D, "data.txt"), os.O_RDONLY)
region = mmap.mmap(-1, 4096, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
region[:20] = b"CRAB-MARKER-ORIGINAL"
state = {"pid": os.getpid(), "addr": ctypes.addressof(ctypes.c_char.from_buffer(region)),
         "fifo": fifo_fd, "dgram": sock.fileno(), "eventfd": efd, "data": data}
# An idle second thread (it inherits the blocked SIGUSR1): the target of thread-directed signals.
started = threading.Event()
def idle():
    state["tid"] = threading.get_native_id()
    started.set()
    threading.Event().wait()
threading.Thread(target=idle, daemon=True).start()
started.wait()
if "--uffd" in sys.argv:
    uffd = libc.syscall(ctypes.c_long(323), ctypes.c_long(os.O_CLOEXEC | os.O_NONBLOCK | 1))  # userfaultfd(UFFD_USER_MODE_ONLY)
    if uffd < 0:
        raise OSError(ctypes.get_errno(), "userfaultfd")
    fcntl.ioctl(uffd, 0xC018AA3F, struct.pack("QQQ", 0xAA, 0, 0))  # UFFDIO_API
    lazy = mmap.mmap(-1, 4096, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    lazy_addr = ctypes.addressof(ctypes.c_char.from_buffer(lazy))
    fcntl.ioctl(uffd, 0xC020AA00, struct.pack("QQQQ", lazy_addr, 4096, 1, 0))  # UFFDIO_REGISTER, MISSING
    state.update(uffd=uffd, uffd_addr=lazy_addr)
with open(os.path.join(D, "holder.pid"), "w") as f:
    f.write("%d\n" % os.getpid())
tmp = os.path.join(D, ".holder.json")
with open(tmp, "w") as f:
    json.dump(state, f)
os.rename(tmp, os.path.join(D, "holder.json"))
while True:
    signal.pause()
"#;

/// The adversary: `adv.py DIR ROUTE ARG` takes one route into the holder's state (x86_64
/// syscall numbers, through ctypes).
const ADV_PY: &str = r#"import ctypes, fcntl, json, mmap, os, resource, socket, struct, sys

D, route, arg = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
h = json.load(open(os.path.join(D, "holder.json")))
pid = h["pid"]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def sys_(nr, *args):
    """syscall(2) with every integer argument passed as a long (the call is variadic: an int
    would leave the upper half of its register undefined)."""
    return libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])


def check(r, what):
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))
    return r


def getfd(fd):
    """A copy of the holder's descriptor `fd` (pidfd_open + pidfd_getfd)."""
    pidfd = check(sys_(434, pid, 0), "pidfd_open")
    return check(sys_(438, pidfd, fd, 0), "pidfd_getfd")


def uring_write(fd, buf, off):
    """One IORING_OP_WRITE of `buf` at offset `off` of `fd`, through a ring of one entry: no
    write-family syscall."""
    params = ctypes.create_string_buffer(120)
    ring = check(sys_(425, 1, params), "io_uring_setup")
    p = struct.unpack_from("10I", params, 0)
    sq_entries, cq_entries, features = p[0], p[1], p[5]
    sq_off = struct.unpack_from("8IQ", params, 40)  # head tail mask entries flags dropped array resv1 user_addr
    cq_off = struct.unpack_from("8IQ", params, 80)  # head tail mask entries overflow cqes flags resv1 user_addr
    sq_size = sq_off[6] + sq_entries * 4
    cq_size = cq_off[5] + cq_entries * 16
    if features & 1:  # IORING_FEAT_SINGLE_MMAP
        sq_size = cq_size = max(sq_size, cq_size)
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x8000  # MAP_POPULATE
    failed = ctypes.c_void_p(-1).value
    sq = libc.mmap(None, sq_size, prot, flags, ring, 0)
    cq = sq if features & 1 else libc.mmap(None, cq_size, prot, flags, ring, 0x8000000)
    sqes = libc.mmap(None, sq_entries * 64, prot, flags, ring, 0x10000000)
    if failed in (sq, cq, sqes):
        raise OSError(ctypes.get_errno(), "mmap of the io_uring rings")
    data = ctypes.create_string_buffer(buf, len(buf))
    # IORING_OP_WRITE (23): opcode flags ioprio fd off addr len rw_flags user_data
    sqe = struct.pack("BBHiQQIIQ", 23, 0, 0, fd, off, ctypes.addressof(data), len(buf), 0, 7)
    ctypes.memmove(sqes, sqe + bytes(64 - len(sqe)), 64)
    u32 = lambda base, o: ctypes.c_uint32.from_address(base + o)
    tail = u32(sq, sq_off[1])
    u32(sq, sq_off[6] + 4 * (tail.value & u32(sq, sq_off[2]).value)).value = 0
    tail.value += 1
    check(sys_(426, ring, 1, 1, 1, None, 0), "io_uring_enter")  # IORING_ENTER_GETEVENTS
    head = u32(cq, cq_off[0]).value
    cqe = cq + cq_off[5] + 16 * (head & u32(cq, cq_off[2]).value)
    _, res = struct.unpack_from("Qi", ctypes.string_at(cqe, 12))
    if res != len(buf):
        raise OSError(-res if res < 0 else 0, "IORING_OP_WRITE returned %d" % res)


if route == "uring-mem":
    uring_write(os.open("/proc/%d/mem" % pid, os.O_RDWR), arg.encode(), h["addr"])
elif route == "vm-write":
    data = ctypes.create_string_buffer(arg.encode(), len(arg))
    local = struct.pack("QQ", ctypes.addressof(data), len(arg))
    remote = struct.pack("QQ", h["addr"], len(arg))
    n = check(sys_(311, pid, local, 1, remote, 1, 0), "process_vm_writev")
    assert n == len(arg), n
elif route == "signal":
    os.kill(pid, int(arg))
elif route == "tgkill":
    check(sys_(234, pid, h["tid"], int(arg)), "tgkill")
elif route == "renice":
    os.setpriority(os.PRIO_PROCESS, pid, int(arg))
elif route == "sched":
    os.sched_setscheduler(pid, int(arg), os.sched_param(0))
elif route == "nofile":
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (int(arg), resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
elif route == "fifo":
    fd = os.open(os.path.join(D, "fifo"), os.O_WRONLY | os.O_NONBLOCK)
    assert os.write(fd, arg.encode()) == len(arg)
elif route == "dgram":
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(arg.encode(), os.path.join(D, "dgram.sock"))
elif route == "eventfd":
    assert os.write(getfd(h["eventfd"]), struct.pack("Q", int(arg))) == 8
elif route == "seek":
    os.lseek(getfd(h["data"]), int(arg), os.SEEK_SET)
elif route == "uffd-copy":
    uffd = getfd(h["uffd"])
    page = mmap.mmap(-1, 4096, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    page[: len(arg)] = arg.encode()
    src = ctypes.addressof(ctypes.c_char.from_buffer(page))
    out = fcntl.ioctl(uffd, 0xC028AA03, struct.pack("QQQQq", h["uffd_addr"], src, 4096, 0, 0))  # UFFDIO_COPY
    assert struct.unpack("QQQQq", out)[4] == 4096, out
elif route == "msg":
    key, text = arg.split(":", 1)
    libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    q = check(libc.msgget(int(key), 0o1600), "msgget")  # IPC_CREAT | 0600
    msg = struct.pack("q", 1) + text.encode()
    check(libc.msgsnd(q, msg, len(text), 0), "msgsnd")
else:
    raise SystemExit("unknown route " + route)
"#;

/// The adversary's directory in the container.
const DIR: &str = "/app/adv";
/// The setup's directory on the container's `/dev/shm`, a tmpfs mount ([`tmpfs_entries_renamed_removed_and_made`]).
const SHM: &str = "/dev/shm/crab-adv";

/// t1: the scripts, the holder's data file, the holder (with `holder_args`), waiting until it
/// has written `holder.json`. Python runs with `-B` here and in every route: a byte-code file
/// written on the way would be a counted file change and hide what the route is.
fn setup(holder_args: &str) -> String {
    format!(
        "set -e; mkdir -p {DIR} /app/work\n\
         cat > {DIR}/holder.py <<'EOF'\n{HOLDER_PY}EOF\n\
         cat > {DIR}/adv.py <<'EOF'\n{ADV_PY}EOF\n\
         echo 0123456789abcdef > {DIR}/data.txt\n\
         mkdir -p {SHM} && echo a > {SHM}/kept-a && echo b > {SHM}/kept-b\n\
         nohup python3 -B {DIR}/holder.py {DIR} {holder_args} >/dev/null 2>&1 &\n\
         for i in $(seq 400); do [ -e {DIR}/holder.json ] && break; sleep 0.05; done\n\
         test -e {DIR}/holder.json"
    )
}

/// The exec of a route: `adv.py ROUTE ARG`.
fn adv(route: &str, arg: &str) -> String {
    format!("python3 -B {DIR}/adv.py {DIR} {route} {arg}")
}

/// A digest of the sandbox's live state, read from the host without changing it: key -> value.
type Digest = BTreeMap<String, String>;

/// The keys of `a` and `b` whose values differ, with both values.
fn diff(a: &Digest, b: &Digest) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |d: &Digest| {
                d.get(k)
                    .map_or("(absent)".to_string(), |v| format!("{v:?}"))
            };
            format!("{k}: {} vs {}", show(a), show(b))
        })
        .collect()
}

fn ns_pid(pid: i32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last().map(str::to_string))
}

/// `/proc/PID/status` as key -> value.
fn status(path: &str) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// The fields of `/proc/PID/stat` from field 3 (state) on.
fn stat(pid: i32) -> Vec<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    s.rsplit_once(") ")
        .map(|(_, rest)| rest.split(' ').map(str::to_string).collect())
        .unwrap_or_default()
}

fn os_err(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A copy of descriptor `fd` of process `pid` (pidfd_open + pidfd_getfd).
fn getfd(pid: i32, fd: i64) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscalls; each returned descriptor is owned once.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(os_err("pidfd_open"));
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let copy = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd as i32, 0);
        if copy < 0 {
            return Err(os_err("pidfd_getfd"));
        }
        Ok(OwnedFd::from_raw_fd(copy as i32))
    }
}

/// The bytes queued in a pipe or FIFO, left in place (`tee` into a pipe of our own).
fn pipe_bytes(fifo: &OwnedFd) -> std::io::Result<Vec<u8>> {
    let mut p = [0i32; 2];
    // SAFETY: pipe2 fills `p`, tee and read work on descriptors we own, into a buffer we own.
    unsafe {
        if libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) != 0 {
            return Err(os_err("pipe2"));
        }
        let (r, w) = (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1]));
        let n = libc::tee(
            fifo.as_raw_fd(),
            w.as_raw_fd(),
            1 << 20,
            libc::SPLICE_F_NONBLOCK,
        );
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(Vec::new()),
                _ => Err(os_err("tee")),
            };
        }
        let mut buf = vec![0u8; n as usize];
        let got = libc::read(r.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len());
        if got != n {
            return Err(os_err("read of the tee"));
        }
        Ok(buf)
    }
}

/// The datagrams queued on a socket, oldest first, left in place: peeked one after the other
/// with a peek offset, which is then reset to its default (-1, off).
fn queued_datagrams(sock: &OwnedFd) -> std::io::Result<Vec<Vec<u8>>> {
    let set = |v: i32| {
        // SAFETY: setsockopt with an int option.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEEK_OFF,
                (&v as *const i32).cast(),
                4,
            )
        };
        match rc {
            0 => Ok(()),
            _ => Err(os_err("SO_PEEK_OFF")),
        }
    };
    set(0)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let result = loop {
        // SAFETY: recv into a buffer we own.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            break match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(()),
                _ => Err(os_err("recv")),
            };
        }
        out.push(buf[..n as usize].to_vec());
        if out.len() > 10_000 {
            break Err(std::io::Error::other("more than 10000 datagrams queued"));
        }
    };
    set(-1)?;
    result.map(|()| out)
}

/// A field of `/proc/PID/fdinfo/FD` (e.g. `pos`, `eventfd-count`).
fn fdinfo(pid: i32, fd: i64, field: &str) -> String {
    status(&format!("/proc/{pid}/fdinfo/{fd}"))
        .remove(field)
        .unwrap_or_else(|| "(none)".into())
}

/// The host pid of the thread whose id in the container's pid namespace is `ns_tid`.
fn host_tid(pid: i32, ns_tid: i64) -> Option<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
        .find(|tid| {
            status(&format!("/proc/{pid}/task/{tid}/status"))
                .get("NSpid")
                .and_then(|v| v.split_whitespace().last().map(str::to_string))
                == Some(ns_tid.to_string())
        })
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The holder's state, under `holder.*` keys (nothing when there is no holder).
fn holder_digest(s: &Sandbox, d: &mut Digest) {
    let holders: Vec<host::Proc> = host::container_processes(&s.id)
        .into_iter()
        .filter(|p| p.argv.iter().any(|a| a == &format!("{DIR}/holder.py")))
        .collect();
    assert!(holders.len() <= 1, "one holder at most: {holders:?}");
    let Some(p) = holders.first() else {
        d.insert("holder".into(), "(none)".into());
        return;
    };
    let pid = p.pid;
    let h: Value = serde_json::from_slice(
        &std::fs::read(format!("/proc/{pid}/root{DIR}/holder.json")).unwrap(),
    )
    .unwrap();
    let fd = |k: &str| h[k].as_i64().unwrap_or_else(|| panic!("no {k} in {h}"));
    let mut put = |k: &str, v: String| {
        d.insert(format!("holder.{k}"), v);
    };
    put("pid", ns_pid(pid).unwrap_or_default());
    // A sleeper is `S`; it may be seen running for a moment (woken by the thaw of a checkpoint).
    let mut st = stat(pid);
    for _ in 0..100 {
        if st.first().map(String::as_str) != Some("R") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        st = stat(pid);
    }
    put("state", st.first().cloned().unwrap_or_default());
    put("nice", st.get(16).cloned().unwrap_or_default());
    put("policy", st.get(38).cloned().unwrap_or_default());
    let stopped = st.first().map(String::as_str) == Some("T");
    let fields = status(&format!("/proc/{pid}/status"));
    for k in ["SigPnd", "ShdPnd", "SigBlk", "SigIgn"] {
        let v = fields.get(k).cloned().unwrap_or_default();
        put(k, pending_as_it_acts(k, v, stopped));
    }
    let thread = host_tid(pid, fd("tid")).map(|t| status(&format!("/proc/{pid}/task/{t}/status")));
    put(
        "thread.SigPnd",
        thread
            .and_then(|t| t.get("SigPnd").cloned())
            .map(|v| pending_as_it_acts("SigPnd", v, stopped))
            .unwrap_or_else(|| "(no thread)".into()),
    );
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
    put(
        "nofile",
        limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default(),
    );
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let read_mem = |addr: u64| {
        let mut buf = [0u8; 20];
        match mem.read_at(&mut buf, addr) {
            Ok(20) => String::from_utf8_lossy(&buf).into_owned(),
            r => format!("(unreadable: {r:?})"),
        }
    };
    put("marker", read_mem(fd("addr") as u64));
    if let Some(a) = h["uffd_addr"].as_u64() {
        put("uffd_page", read_mem(a));
    }
    put(
        "fifo",
        getfd(pid, fd("fifo"))
            .and_then(|f| pipe_bytes(&f))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("({e})")),
    );
    put(
        "dgram",
        getfd(pid, fd("dgram"))
            .and_then(|f| queued_datagrams(&f))
            .map(|q| {
                q.iter()
                    .map(|m| String::from_utf8_lossy(m).into_owned())
                    .collect::<Vec<_>>()
                    .join("|")
            })
            .unwrap_or_else(|e| format!("({e})")),
    );
    put("eventfd", fdinfo(pid, fd("eventfd"), "eventfd-count"));
    put("data_pos", fdinfo(pid, fd("data"), "pos"));
}

/// The live state of the sandbox: the holder's, the container's SysV message queues, the files
/// under /app/work and core files in /app (by hash), and its processes (namespace pid and
/// command line; zombies have none and are left out).
/// A pending set (`SigPnd`, `ShdPnd`; other keys as they are) as it can still act: a stop
/// signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) pending in a process that is stopped changes
/// nothing, since the SIGCONT that resumes it discards every pending stop signal. CRIU leaves
/// one there when it dumps a stopped process (it stops it again as it lets go) and restores
/// the process stopped without it.
fn pending_as_it_acts(key: &str, hex: String, stopped: bool) -> String {
    const STOP_SIGNALS: u64 = (1 << 18) | (1 << 19) | (1 << 20) | (1 << 21);
    match (key, u64::from_str_radix(&hex, 16)) {
        ("SigPnd" | "ShdPnd", Ok(set)) if stopped => format!("{:016x}", set & !STOP_SIGNALS),
        _ => hex,
    }
}

async fn digest(s: &Sandbox) -> Digest {
    let (_, init) = s.h.status(&s.id, "").await.unwrap();
    let mut d = Digest::new();
    holder_digest(s, &mut d);
    let mut procs: Vec<String> = host::container_processes(&s.id)
        .iter()
        .map(|p| format!("{} {}", ns_pid(p.pid).unwrap_or_default(), p.argv.join(" ")))
        .collect();
    procs.sort();
    d.insert("procs".into(), procs.join("; "));
    let out = std::process::Command::new("nsenter")
        .args(["-t", &init.to_string(), "-i", "cat", "/proc/sysvipc/msg"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run nsenter: {e}"));
    assert!(out.status.success(), "nsenter: {out:?}");
    // key, perms, cbytes, qnum (not ids, pids or times).
    let msg: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{} {} {} {}", f[0], f[2], f[3], f[4])
        })
        .collect();
    d.insert("sysv.msg".into(), msg.join("; "));
    let root = PathBuf::from(format!("/proc/{init}/root/app"));
    let mut files = Vec::new();
    for e in std::fs::read_dir(root.join("work"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let data = std::fs::read(e.path()).unwrap_or_default();
        files.push(format!(
            "work/{} {}",
            e.file_name().to_string_lossy(),
            hex(&data)
        ));
    }
    for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("core") {
            let data = std::fs::read(e.path()).unwrap_or_default();
            files.push(format!("{name} {}", hex(&data)));
        }
    }
    files.sort();
    d.insert("files".into(), files.join("; "));
    // The entries of the setup's directory on the container's /dev/shm (a tmpfs mount):
    // name, type and mode.
    let mut shm: Vec<String> = std::fs::read_dir(format!("/proc/{init}/root{SHM}"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let m = e.metadata().map(|m| {
                (
                    m.is_dir(),
                    std::os::unix::fs::MetadataExt::mode(&m) & 0o7777,
                )
            });
            format!("{} {m:?}", e.file_name().to_string_lossy())
        })
        .collect();
    shm.sort();
    d.insert("shm".into(), shm.join("; "));
    d
}

/// SIGKILL of every process of the container (the task stops, the shim lives), as in
/// `recovery.rs`.
async fn crash(s: &Sandbox) {
    s.h.kill(&s.id, "", libc::SIGKILL, true).await.unwrap();
    s.h.wait(&s.id, "", Duration::from_secs(60)).await.unwrap();
}

/// `crabctl recover`: (exit code, output).
fn recover(s: &Sandbox) -> (i32, String) {
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    (code, format!("{out}{err}"))
}

/// `crabctl rollback --to TURN -o json`: the report, or the failure's output.
fn rollback(s: &Sandbox, turn: &str) -> Result<Value, String> {
    let (code, out, err) = s.crabctl(&["rollback", &s.id, "--to", turn, "-o", "json"]);
    match code {
        0 => Ok(serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))),
        _ => Err(format!("exit {code}: {out}{err}")),
    }
}

/// Ends the turn and returns its stored answer (checked to be this turn's).
async fn end_turn(s: &mut Sandbox) -> Value {
    let a = s.end_turn().await;
    assert_eq!(
        a["turn_id"].as_str(),
        Some(format!("t{}", s.turn).as_str()),
        "the newest answer is this turn's: {a:#}"
    );
    a
}

fn kind(a: &Value) -> &str {
    a["kind"].as_str().unwrap_or("?")
}

/// One line of an answer for reports: its kind and why.
fn why(a: &Value) -> String {
    let p = &a["procs"];
    format!(
        "{} (fs changed {}, scanned {}, syscalls {}; procs changed {}, idle {}, memory {})",
        kind(a),
        a["fs"]["changed"],
        a["fs"]["scanned"],
        a["fs"]["syscalls"],
        p["changed"],
        p["idle"],
        p["memory"]
    )
}

/// What a route test found wrong; it fails with all of them at the end.
#[derive(Default)]
struct Findings(Vec<String>);

impl Findings {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            let w = what();
            eprintln!("FINDING: {w}");
            self.0.push(w);
        }
    }

    fn assert_none(self, test: &str) {
        assert!(
            self.0.is_empty(),
            "{test}: {} finding(s):\n- {}",
            self.0.len(),
            self.0.join("\n- ")
        );
    }
}

/// One route, end to end.
struct Route {
    name: &'static str,
    /// The turn's one exec.
    exec: String,
    /// Digest keys the exec changes (checked on the live state: a route that changes nothing
    /// is a broken test, not a finding).
    changes: &'static [&'static str],
    /// The answers that keep the change: `proc`/`full` for process state, `fs`/`full` for files.
    kinds: &'static [&'static str],
    /// A change of process state: a rollback that keeps the processes keeps it.
    recreate: bool,
}

fn process_route(name: &'static str, exec: String, changes: &'static [&'static str]) -> Route {
    Route {
        name,
        exec,
        changes,
        kinds: &["proc", "full"],
        recreate: true,
    }
}

/// Waits until the checkpoint of the turn just ended is durable, through the gate of the
/// agent's next action (a no-op exec, as [`Sandbox::sync`]), but says why instead of panicking
/// when that action is refused: the checkpoint still runs at `action_wait_timeout_ms`.
async fn try_sync(s: &Sandbox) -> Result<(), String> {
    let exec_id = format!("sync-{}", s.turn);
    let io =
        s.h.stdio(&s.id, &exec_id, StdioOptions::default())
            .map_err(|e| e.to_string())?;
    s.h.exec(&s.id, &exec_id, &ProcessSpec::new(&["true"]), &io)
        .await
        .map_err(|e| e.to_string())?;
    let started = s.h.start(&s.id, &exec_id).await;
    if started.is_ok() {
        let _ = s.h.wait(&s.id, &exec_id, Duration::from_secs(60)).await;
    }
    let _ = s.h.delete_process(&s.id, &exec_id).await;
    started.map(|_| ()).map_err(|e| {
        format!(
            "the checkpoint of t{} is not durable when the next action comes: {e}",
            s.turn
        )
    })
}

/// The scenario of the module doc for `r`, in a fresh sandbox.
async fn run_route(r: Route) {
    let started = Instant::now();
    let mut f = Findings::default();
    let (mut s, _guard) =
        Sandbox::start(&format!("adv-{}", r.name), SandboxOptions::default()).await;
    if let Err(e) = route_steps(&r, &mut s, &mut f).await {
        f.check(false, || e);
    }
    s.finish().await;
    eprintln!("{}: {:.1} s", r.name, started.elapsed().as_secs_f64());
    f.assert_none(r.name);
}

/// The steps of [`run_route`]; an `Err` ends the scenario early (a checkpoint that never
/// became durable).
async fn route_steps(r: &Route, s: &mut Sandbox, f: &mut Findings) -> Result<(), String> {
    s.run(&setup("")).await;
    let t1 = end_turn(s).await;
    assert!(
        matches!(kind(&t1), "proc" | "full"),
        "t1 starts the holder: {t1:#}"
    );
    s.sync().await;
    let m = s.manifests().last().cloned().unwrap();
    assert!(
        m["turn_id"] == "t1" && m["kind"] != "failed" && !m["process"].is_null(),
        "t1 is checkpointed with its processes: {m:#}"
    );
    let before = digest(s).await;
    eprintln!("{}: t1 state {before:#?}", r.name);

    // t2: the route; its answer must keep it.
    s.run(&r.exec).await;
    let t2 = end_turn(s).await;
    f.check(r.kinds.contains(&kind(&t2)), || {
        format!(
            "t2 ({}) answered {}, expected one of {:?}",
            r.exec,
            why(&t2),
            r.kinds
        )
    });
    try_sync(s).await?;
    let changed = digest(s).await;
    let d = diff(&before, &changed);
    eprintln!("{}: t2 answered {}; changed: {d:#?}", r.name, why(&t2));
    for k in r.changes {
        assert_ne!(
            before.get(*k),
            changed.get(*k),
            "the route `{}` did not change {k}: the test is broken ({d:?})",
            r.exec
        );
    }

    // The rollback to t1 undoes it.
    match rollback(s, "t1") {
        Ok(rb) => {
            eprintln!("{}: rollback to t1: {rb}", r.name);
            if r.recreate {
                f.check(rb["way"] == "recreated", || {
                    format!(
                        "the rollback to t1 kept the processes (way {}, {} paths): the change survives it",
                        rb["way"], rb["paths"]
                    )
                });
            }
            let now = digest(s).await;
            let d = diff(&before, &now);
            f.check(d.is_empty(), || {
                format!("after the rollback to t1 the state is not t1's: {d:?}")
            });
        }
        Err(e) => f.check(false, || format!("rollback to t1 failed: {e}")),
    }

    // t3: the route again, then a crash; the recovery brings it back.
    s.run(&r.exec).await;
    let t3 = end_turn(s).await;
    f.check(r.kinds.contains(&kind(&t3)), || {
        format!(
            "t3 ({}, after the rollback) answered {}, expected one of {:?}",
            r.exec,
            why(&t3),
            r.kinds
        )
    });
    try_sync(s).await?;
    let live = digest(s).await;
    crash(s).await;
    let (code, out) = recover(s);
    eprintln!("{}: recover: {out}", r.name);
    if code == 0 {
        let recovered = digest(s).await;
        let d = diff(&live, &recovered);
        f.check(d.is_empty(), || {
            format!(
                "the recovery after t3 lost the turn's state (live vs recovered): {d:?}; recover said: {}",
                out.trim()
            )
        });
    } else {
        f.check(false, || format!("recover failed: {out}"));
    }
    Ok(())
}

/// Control: `process_vm_writev` into the holder's marker page is a foreign write the inspector
/// counted before the kernel-state mark; the scenario passed then, which shows the harness itself
/// (digest, rollback, recovery) sees a kept change as kept.
#[tokio::test(flavor = "multi_thread")]
async fn control_process_vm_writev_is_seen_undone_and_recovered() {
    run_route(process_route(
        "vm-write",
        adv("vm-write", "CRAB-MARKER-INJECTED"),
        &["holder.marker"],
    ))
    .await;
}

/// Route 1: an io_uring `IORING_OP_WRITE` into `/proc/HOLDER/mem` (the marker page): no
/// write-family syscall, and the holder does not run.
#[tokio::test(flavor = "multi_thread")]
async fn io_uring_write_into_proc_pid_mem() {
    run_route(process_route(
        "uring-mem",
        adv("uring-mem", "CRAB-MARKER-INJECTED"),
        &["holder.marker"],
    ))
    .await;
}

/// Route 2: `kill -USR1` of the holder, which blocks it: pending (ShdPnd 0x200), the holder
/// never wakes.
#[tokio::test(flavor = "multi_thread")]
async fn blocked_signal_left_pending() {
    run_route(process_route(
        "signal",
        "kill -USR1 $(cat /app/adv/holder.pid)".into(),
        &["holder.ShdPnd"],
    ))
    .await;
}

/// Route 2b: a thread-directed signal (`tgkill`) to the holder's idle second thread, which
/// blocks it: pending on that thread only (its SigPnd).
#[tokio::test(flavor = "multi_thread")]
async fn blocked_thread_directed_signal_left_pending() {
    run_route(process_route(
        "tgkill",
        adv("tgkill", "10"),
        &["holder.thread.SigPnd"],
    ))
    .await;
}

/// Route 3: bytes written into the FIFO the holder holds read-write (and never reads).
#[tokio::test(flavor = "multi_thread")]
async fn bytes_queued_in_a_held_fifo() {
    run_route(process_route(
        "fifo",
        adv("fifo", "queued-in-the-fifo"),
        &["holder.fifo"],
    ))
    .await;
}

/// Route 4: a datagram sent to the unix datagram socket the holder bound (and never reads).
#[tokio::test(flavor = "multi_thread")]
async fn datagram_queued_on_a_held_unix_socket() {
    run_route(process_route(
        "dgram",
        adv("dgram", "queued-datagram"),
        &["holder.dgram"],
    ))
    .await;
}

/// Route 5: `pidfd_open` + `pidfd_getfd` of the holder's eventfd, then a write of 8 bytes: its
/// count goes from 0 to 5.
#[tokio::test(flavor = "multi_thread")]
async fn eventfd_count_through_pidfd_getfd() {
    run_route(process_route(
        "eventfd",
        adv("eventfd", "5"),
        &["holder.eventfd"],
    ))
    .await;
}

/// A route not in the issue: `pidfd_getfd` of a file the holder holds open, then `lseek`: the
/// shared file offset moves (CRIU dumps and restores it), and `lseek` is no file change.
#[tokio::test(flavor = "multi_thread")]
async fn file_offset_moved_through_pidfd_getfd() {
    run_route(process_route(
        "seek",
        adv("seek", "7"),
        &["holder.data_pos"],
    ))
    .await;
}

/// Route 7a: SIGSTOP of the holder: it stops (state T) without running.
///
/// Found here: on a host whose freezer is cgroup v1 (this one), a process checkpoint of a
/// sandbox holding a stopped process used to hang: crab froze the cgroup, then CRIU's
/// `PTRACE_SEIZE` of the stopped task made the kernel wake it to move it to a trap stop and
/// wait (`ptrace_attach`, killable) for it to get there, which a frozen task never does; CRIU
/// sat in D state until its 60 s timeout and the turn was recorded `failed`. The dump now
/// finds the stopped task with the container frozen (a frozen stopped task reads `D`, blocked
/// in `do_signal_stop`), thaws it and lets CRIU seize every task with ptrace
/// (`checkpoint::process::seize_for`); CRIU restores the process stopped. (The control test
/// and the random adversary still leave SIGSTOP out: a stopped holder would stop their later
/// routes that need it to run.) Not run on a cgroup-v2 freezer here.
#[tokio::test(flavor = "multi_thread")]
async fn holder_stopped_by_sigstop() {
    run_route(process_route(
        "sigstop",
        adv("signal", "19"),
        &["holder.state"],
    ))
    .await;
}

/// Route 9: entries of a tmpfs mount (`/dev/shm`) renamed, removed and made as a directory,
/// nothing written: no upperdir holds them (a process checkpoint keeps tmpfs mounts), and the
/// probes see only syscalls that name a path whose filesystem they do not resolve. The turn
/// end compares manifests of the container's tmpfs mounts whenever a mutating file syscall was
/// counted.
#[tokio::test(flavor = "multi_thread")]
async fn tmpfs_entries_renamed_removed_and_made() {
    run_route(process_route(
        "tmpfs",
        format!("mv {SHM}/kept-a {SHM}/moved-a && rm {SHM}/kept-b && mkdir {SHM}/made && chmod 700 {SHM}/made"),
        &["shm"],
    ))
    .await;
}

/// Route 7b: `renice -n 5` of the holder (setpriority on another process).
#[tokio::test(flavor = "multi_thread")]
async fn holder_reniced() {
    run_route(process_route(
        "renice",
        "renice -n 5 -p $(cat /app/adv/holder.pid)".into(),
        &["holder.nice"],
    ))
    .await;
}

/// Route 7b': `sched_setscheduler(SCHED_BATCH)` of the holder (another process's policy).
#[tokio::test(flavor = "multi_thread")]
async fn holder_scheduling_policy_changed() {
    run_route(process_route(
        "sched",
        adv("sched", "3"),
        &["holder.policy"],
    ))
    .await;
}

/// Route 7b'': `prlimit` of the holder's RLIMIT_NOFILE (another process's limits).
#[tokio::test(flavor = "multi_thread")]
async fn holder_rlimit_changed_by_prlimit() {
    run_route(process_route(
        "prlimit",
        adv("nofile", "100"),
        &["holder.nofile"],
    ))
    .await;
}

/// Route 7c: a SysV message queue left behind by a turn (`msgget(IPC_CREAT)` + `msgsnd`): held
/// by the container's IPC namespace, which CRIU dumps with the processes.
#[tokio::test(flavor = "multi_thread")]
async fn sysv_message_queue_left_behind() {
    run_route(process_route(
        "msgq",
        adv("msg", "4242:left-in-the-queue"),
        &["sysv.msg"],
    ))
    .await;
}

/// Control: CRIU's side, with the inspector out of the way. Under the `full-every-turn` policy
/// every turn is checkpointed whole whatever the answer; one turn takes every route above that
/// leaves the holder running (SIGSTOP aside: see [`holder_stopped_by_sigstop`]), and a
/// crash + recovery must
/// bring each of those states back. A key that differs here is a state CRIU (or crab's dump and
/// restore) does not keep, which no inspector can fix.
#[tokio::test(flavor = "multi_thread")]
async fn control_criu_restores_every_route_state_under_full_every_turn() {
    let (mut s, _guard) = Sandbox::start(
        "adv-criu",
        SandboxOptions {
            config: "checkpoint.policy = \"full-every-turn\"",
            ..Default::default()
        },
    )
    .await;
    s.run(&setup("")).await;
    end_turn(&mut s).await;
    s.sync().await;
    let before = digest(&s).await;
    let all = [
        adv("uring-mem", "CRAB-MARKER-INJECTED"),
        adv("signal", "10"),
        adv("tgkill", "10"),
        adv("fifo", "queued-in-the-fifo"),
        adv("dgram", "first-datagram"),
        adv("dgram", "second-datagram"),
        adv("eventfd", "5"),
        adv("seek", "7"),
        adv("renice", "5"),
        adv("sched", "3"),
        adv("nofile", "100"),
        adv("msg", "4242:left-in-the-queue"),
        "printf one > /app/work/one".into(),
    ];
    s.run(&all.join(" && ")).await;
    let t2 = end_turn(&mut s).await;
    s.sync().await;
    let live = digest(&s).await;
    let d = diff(&before, &live);
    eprintln!("t2 answered {}; changed {d:#?}", why(&t2));
    for k in [
        "holder.marker",
        "holder.ShdPnd",
        "holder.thread.SigPnd",
        "holder.fifo",
        "holder.dgram",
        "holder.eventfd",
        "holder.data_pos",
        "holder.nice",
        "holder.policy",
        "holder.nofile",
        "sysv.msg",
        "files",
    ] {
        assert_ne!(
            before.get(k),
            live.get(k),
            "the turn did not change {k}: {d:?}"
        );
    }
    let m = s.manifests().last().cloned().unwrap();
    assert!(
        m["turn_id"] == "t2" && m["kind"] == "full",
        "t2 is checkpointed whole: {m:#}"
    );
    crash(&s).await;
    let (code, out) = recover(&s);
    assert_eq!(code, 0, "recover: {out}");
    let recovered = digest(&s).await;
    let d = diff(&live, &recovered);
    assert!(
        d.is_empty(),
        "state CRIU did not bring back (live vs recovered): {d:#?}"
    );
    s.finish().await;
}

/// Route 6: userfaultfd. A variant holder registers a page with a userfaultfd (user-mode faults
/// only, no privilege needed) and sleeps; t2 takes a copy of its userfaultfd (`pidfd_getfd`)
/// and fills the page with `UFFDIO_COPY`, the holder not running.
///
/// What CRIU does (4.2, found here): it refuses to dump a process holding a userfaultfd
/// (`Error (criu/files-ext.c:94): Can't dump file N of that type [600] (anon
/// anon_inode:[userfaultfd])`, then `Dumping FAILED`), so no process checkpoint of the
/// sandbox can be taken while the holder lives, t1's included. The honest outcome, asserted
/// here: t2's answer is still not `none`; the checkpoints of t1 and t2 are recorded `failed`;
/// no rollback to t1 or t2 is offered; and the recovery does not claim to bring back t1 or t2
/// (it goes back to a point before the holder, saying which, or refuses), never a silent
/// success that lacks the copy.
#[tokio::test(flavor = "multi_thread")]
async fn userfaultfd_copy_into_a_registered_page() {
    let mut f = Findings::default();
    let (mut s, _guard) = Sandbox::start("adv-uffd", SandboxOptions::default()).await;
    s.run(&setup("--uffd")).await;
    let t1 = end_turn(&mut s).await;
    assert!(
        matches!(kind(&t1), "proc" | "full"),
        "t1 starts the holder: {t1:#}"
    );
    s.sync().await;
    let m1 = s.manifests().last().cloned().unwrap();
    eprintln!("t1's checkpoint: {m1:#}");
    assert!(
        m1["turn_id"] == "t1" && m1["kind"] == "failed",
        "CRIU cannot dump a process holding a userfaultfd: t1's checkpoint fails: {m1:#}"
    );
    let before = digest(&s).await;
    s.run(&adv("uffd-copy", "CRAB-UFFD-PAGE-COPY!")).await;
    let t2 = end_turn(&mut s).await;
    s.sync().await;
    let live = digest(&s).await;
    let d = diff(&before, &live);
    eprintln!("t2 answered {}; changed {d:#?}", why(&t2));
    assert_eq!(
        live.get("holder.uffd_page").map(String::as_str),
        Some("CRAB-UFFD-PAGE-COPY!"),
        "the copy landed in the holder's page: {d:?}"
    );
    f.check(matches!(kind(&t2), "proc" | "full"), || {
        format!("t2 (UFFDIO_COPY) answered {}", why(&t2))
    });
    let m2 = s.manifests().last().cloned().unwrap();
    eprintln!("t2's checkpoint: {m2:#}");
    f.check(m2["turn_id"] == "t2" && m2["kind"] == "failed", || {
        format!("t2's checkpoint is not recorded failed: {m2:#}")
    });
    for turn in ["t1", "t2"] {
        if let Ok(rb) = rollback(&s, turn) {
            f.check(false, || {
                format!("a rollback to {turn}, whose checkpoint failed, was done: {rb}")
            });
        }
    }
    crash(&s).await;
    let (code, out) = recover(&s);
    eprintln!("recover (exit {code}): {out}");
    let claims = |t: &str| out.contains(&format!("(turn \"{t}\""));
    f.check(!claims("t1") && !claims("t2"), || {
        format!("the recovery claims a turn whose checkpoint failed: {out}")
    });
    if code == 0 {
        let recovered = digest(&s).await;
        f.check(!recovered.contains_key("holder.uffd_page"), || {
            format!("a holder came back from a checkpoint CRIU could not take: {recovered:?}")
        });
    }
    s.finish().await;
    f.assert_none("userfaultfd_copy_into_a_registered_page");
}

/// `kernel.core_pattern` is the host's: the core dump test needs a plain relative pattern
/// (`core`, written into the crashing process's working directory). If the host has another,
/// it is set to `core` for the test and put back when this is dropped (also when the test
/// fails). A lock file in CRAB_HOME serializes the tests that do this (another run of this
/// binary in parallel); other tests (this binary's, or other binaries' run at the same time)
/// never dump core, so the window changes nothing for them.
struct PlainCorePattern {
    _lock: std::fs::File,
    restore: Option<String>,
}

const CORE_PATTERN: &str = "/proc/sys/kernel/core_pattern";

impl PlainCorePattern {
    fn set(crab_home: &std::path::Path) -> PlainCorePattern {
        let lock = std::fs::File::create(crab_home.join(".adversary-core-pattern.lock")).unwrap();
        // SAFETY: flock on a descriptor we own.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        let now = std::fs::read_to_string(CORE_PATTERN).unwrap();
        let now = now.trim_end_matches('\n').to_string();
        let restore = (now != "core").then(|| {
            std::fs::write(CORE_PATTERN, "core").unwrap();
            eprintln!("kernel.core_pattern was {now:?}: set to \"core\" for the test");
            now
        });
        PlainCorePattern {
            _lock: lock,
            restore,
        }
    }
}

impl Drop for PlainCorePattern {
    fn drop(&mut self) {
        if let Some(p) = &self.restore {
            if let Err(e) = std::fs::write(CORE_PATTERN, p) {
                eprintln!("cannot put kernel.core_pattern back to {p:?}: {e}");
            }
        }
    }
}

/// The crasher of [`core_dump_of_a_crashing_process`]: started with RLIMIT_CORE unlimited in
/// /app, it holds a FIFO in /dev/shm (a tmpfs, no file of the sandbox) read-write and, on the
/// first byte written into it, kills itself with SIGSEGV.
const CRASHER: &str =
    "ulimit -c unlimited || { echo 'the hard RLIMIT_CORE here is not unlimited' >&2; exit 1; }
mkfifo /dev/shm/crash-now
cd /app
nohup python3 -B -c 'import os, signal
fd = os.open(\"/dev/shm/crash-now\", os.O_RDWR)
os.read(fd, 1)
os.kill(os.getpid(), signal.SIGSEGV)' >/dev/null 2>&1 &";

/// Wakes the crasher from the host (no exec: nothing of the container's runs but the crasher)
/// and waits until it has dumped core and is gone.
async fn trigger_crash(s: &Sandbox) -> Result<(), String> {
    let (_, init) = s.h.status(&s.id, "").await.unwrap();
    let crasher = || {
        host::container_processes(&s.id)
            .into_iter()
            .any(|p| p.argv.iter().any(|a| a.contains("SIGSEGV")))
    };
    if !crasher() {
        return Err("no crasher waits in the container".into());
    }
    let fifo = format!("/proc/{init}/root/dev/shm/crash-now");
    let mut w = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .map_err(|e| format!("{fifo}: {e}"))?;
    std::io::Write::write_all(&mut w, b"x").unwrap();
    let core = PathBuf::from(format!("/proc/{init}/root/app/core"));
    for _ in 0..1200 {
        if !crasher() && core.exists() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!(
        "the crasher did not dump {} within 60 s",
        core.display()
    ))
}

/// Waits until turn `turn`'s checkpoint is published, when its answer asks for one, without
/// an exec (which would count in the next turn).
async fn published(s: &Sandbox, turn: &str, answer: &Value) {
    if kind(answer) == "none" {
        return;
    }
    for _ in 0..1200 {
        if s.manifests().iter().any(|m| m["turn_id"] == turn) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no checkpoint of {turn}: {:#?}", s.manifests());
}

/// Lets a container just restored (recovered, or rolled back by recreating it) settle: its
/// base mark is taken before its processes run (at CRIU's pre-resume), but a restore that
/// falls back to marking after they run (a lazy one) takes it in the background.
async fn settle() {
    tokio::time::sleep(Duration::from_secs(3)).await;
}

/// A route found here: a change made by a restored process right after the restore. The shim
/// used to take a restored container's base mark in the background once its processes ran
/// again (after Start), so what they did before that mark was part of no turn: the next turn
/// end compared with a mark that already held it. The mark is now taken at CRIU's
/// pre-resume, while CRIU holds every restored thread (`sandbox::inspection_before_resume`). Here t1 starts a worker
/// that waits for a wall-clock deadline (polling every 10 ms) and then writes 8 random bytes
/// (hex) into `/app/work/fired` and exits; t1 is checkpointed, the sandbox crashes before the
/// deadline and is recovered after it, so the worker fires within 10 ms of the restore. t2
/// (no exec) must not be `none` (a process ended, a file appeared), and a second crash +
/// recovery must bring back that state, not the worker (which would fire again, other bytes).
#[tokio::test(flavor = "multi_thread")]
async fn a_change_right_after_a_recovery_is_seen() {
    const WAIT_S: u64 = 10;
    let mut f = Findings::default();
    let (mut s, _guard) = Sandbox::start("adv-after-restore", SandboxOptions::default()).await;
    s.run(&format!(
        "mkdir -p /app/work\nnohup python3 -B -c 'import os, sys, time
deadline = float(sys.argv[1])
while time.time() < deadline:
    time.sleep(0.01)
with open(\"/app/work/fired\", \"a\") as f:
    f.write(os.urandom(8).hex())' $(( $(date +%s) + {WAIT_S} )) >/dev/null 2>&1 &"
    ))
    .await;
    let started = Instant::now();
    let t1 = end_turn(&mut s).await;
    assert!(matches!(kind(&t1), "proc" | "full"), "{t1:#}");
    s.sync().await;
    crash(&s).await;
    let (_, init) = s.h.status(&s.id, "").await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(WAIT_S - 2),
        "t1's checkpoint and the crash took {:?}: the worker's deadline is too near to test          anything (init {init})",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(WAIT_S) - started.elapsed() + Duration::from_secs(1))
        .await;
    let (code, out) = recover(&s);
    assert_eq!(code, 0, "recover: {out}");
    // The worker fires at once; then t2 ends, with no exec.
    let (_, init) = s.h.status(&s.id, "").await.unwrap();
    let fired = PathBuf::from(format!("/proc/{init}/root/app/work/fired"));
    for _ in 0..600 {
        if fired.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(fired.exists(), "the restored worker did not fire");
    settle().await;
    s.turn += 1;
    let t2 = end_turn(&mut s).await;
    published(&s, "t2", &t2).await;
    eprintln!("t2 answered {}", why(&t2));
    f.check(kind(&t2) != "none", || {
        format!(
            "t2 (the restored worker fired: a file written, the worker ended) answered {}",
            why(&t2)
        )
    });
    let live = digest(&s).await;
    assert!(live["files"].contains("work/fired"), "{live:?}");
    crash(&s).await;
    let (code, out) = recover(&s);
    assert_eq!(code, 0, "recover: {out}");
    settle().await;
    let d = diff(&live, &digest(&s).await);
    f.check(d.is_empty(), || {
        format!("the second recovery is not the state after t2 (live vs recovered): {d:?}; recover said: {}", out.trim())
    });
    s.finish().await;
    f.assert_none("a_change_right_after_a_recovery_is_seen");
}

/// Route 8: a core dump. The kernel writes the core file itself, through no syscall of the
/// container: a file change of the turn (`fs` or `full`), whether or not anything else of the
/// turn triggers the scan of the files.
///
/// 1. t1 starts the crasher ([`CRASHER`]); t2 has no exec at all: the crasher, woken from the
///    host, dies of SIGSEGV and the kernel writes `/app/core`. The rollback to t1 removes it
///    (and brings the crasher back); t3 is t2 again, then a crash + recovery brings the core
///    back.
/// 2. After that recovery, t4 is an exec whose child dies of SIGSEGV (`sh -c 'kill -SEGV $$'`),
///    the kernel replacing `/app/core`; a crash + recovery brings that core back.
///
/// Found here: before the kernel-state mark, an exec turn's core was seen only by accident, in a
/// container the shim created (runc's own writes while it starts an exec count as file
/// writes there, so every exec turn scans the files: `syscalls {"write": 142}` for a bare
/// `kill`); in a container restored from a checkpoint they do not count, and the same exec is
/// answered `none` with `syscalls {}` (step 2).
#[tokio::test(flavor = "multi_thread")]
async fn core_dump_of_a_crashing_process() {
    let env = crab_integration::TestEnv::from_env();
    let _pattern = PlainCorePattern::set(&env.crab_home);
    let mut f = Findings::default();
    let (mut s, _guard) = Sandbox::start("adv-core", SandboxOptions::default()).await;
    if let Err(e) = core_steps(&mut s, &mut f).await {
        f.check(false, || e);
    }
    s.finish().await;
    f.assert_none("core_dump_of_a_crashing_process");
}

async fn core_steps(s: &mut Sandbox, f: &mut Findings) -> Result<(), String> {
    let file_kinds = ["fs", "full"];
    s.run(CRASHER).await;
    let t1 = end_turn(s).await;
    assert!(matches!(kind(&t1), "proc" | "full"), "{t1:#}");
    s.sync().await;
    let before = digest(s).await;

    // t2: no exec; the crasher dumps core.
    s.turn += 1;
    trigger_crash(s).await?;
    let t2 = end_turn(s).await;
    published(s, "t2", &t2).await;
    let live = digest(s).await;
    eprintln!(
        "core: t2 answered {}; changed {:?}",
        why(&t2),
        diff(&before, &live)
    );
    assert_ne!(
        before.get("files"),
        live.get("files"),
        "no core was written"
    );
    f.check(file_kinds.contains(&kind(&t2)), || {
        format!("t2 (a core dump, no exec) answered {}", why(&t2))
    });
    match rollback(s, "t1") {
        Ok(rb) => {
            eprintln!("core: rollback to t1: {rb}");
            let now = digest(s).await;
            let d = diff(&before, &now);
            f.check(d.is_empty(), || {
                format!("after the rollback to t1 the state is not t1's: {d:?}")
            });
        }
        Err(e) => f.check(false, || format!("rollback to t1 failed: {e}")),
    }

    // t3: t2 again, then a crash and a recovery. (A change right after the restore is what
    // `a_change_right_after_a_recovery_is_seen` covers, not this route.)
    settle().await;
    s.turn += 1;
    trigger_crash(s).await?;
    let t3 = end_turn(s).await;
    published(s, "t3", &t3).await;
    f.check(file_kinds.contains(&kind(&t3)), || {
        format!(
            "t3 (a core dump, no exec, after the rollback) answered {}",
            why(&t3)
        )
    });
    let live = digest(s).await;
    crash(s).await;
    let (code, out) = recover(s);
    if code != 0 {
        return Err(format!("recover failed: {out}"));
    }
    let d = diff(&live, &digest(s).await);
    f.check(d.is_empty(), || {
        format!(
            "the recovery after t3 lost the core (live vs recovered): {d:?}; recover said: {}",
            out.trim()
        )
    });

    // t4: an exec whose child dumps core, in the recovered container.
    settle().await;
    s.run("ulimit -c unlimited && (sh -c 'kill -SEGV $$' || true) && test -e /app/core")
        .await;
    let t4 = end_turn(s).await;
    f.check(file_kinds.contains(&kind(&t4)), || {
        format!(
            "t4 (an exec's child dumps core, after a recovery) answered {}",
            why(&t4)
        )
    });
    try_sync(s).await?;
    let live = digest(s).await;
    crash(s).await;
    let (code, out) = recover(s);
    if code != 0 {
        return Err(format!("recover failed: {out}"));
    }
    let d = diff(&live, &digest(s).await);
    f.check(d.is_empty(), || {
        format!(
            "the recovery after t4 lost the core (live vs recovered): {d:?}; recover said: {}",
            out.trim()
        )
    });
    Ok(())
}

/// splitmix64: the random adversary's generator (reproducible from its seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the random adversary knows of the sandbox, to draw operations that can be done.
#[derive(Default)]
struct Model {
    nice: u64,
    batch: bool,
    bg: Vec<u64>,
    bg_started: u64,
}

/// One operation for turn `turn`: (what, the shell to run).
fn draw(rng: &mut Rng, m: &mut Model, turn: u64) -> (String, String) {
    let text = |rng: &mut Rng, p: &str| format!("{p}{turn}-{}", rng.below(1000));
    loop {
        let op = rng.below(16);
        let (what, sh) = match op {
            0 | 1 => {
                let k = rng.below(4);
                let t = text(rng, "file");
                (
                    format!("write work/f{k}"),
                    format!("printf '%s' {t} > /app/work/f{k}"),
                )
            }
            2 => {
                let k = rng.below(4);
                (format!("rm work/f{k}"), format!("rm -f /app/work/f{k}"))
            }
            3 => {
                m.bg_started += 1;
                let n = 1_000_000 + m.bg_started;
                m.bg.push(n);
                (
                    format!("start sleep {n}"),
                    format!("nohup sleep {n} >/dev/null 2>&1 &"),
                )
            }
            4 if !m.bg.is_empty() => {
                let n = m.bg.remove(rng.below(m.bg.len() as u64) as usize);
                (
                    format!("stop sleep {n}"),
                    format!("pkill -xf 'sleep {n}' || true"),
                )
            }
            5 | 6 => {
                let mark = format!("M{:019}", rng.below(10u64.pow(18)));
                let route = if op == 5 { "uring-mem" } else { "vm-write" };
                (format!("{route} {mark}"), adv(route, &mark))
            }
            7 => ("kill -USR1".into(), adv("signal", "10")),
            8 => ("tgkill USR1".into(), adv("tgkill", "10")),
            9 => {
                let t = text(rng, "fifo");
                (format!("fifo {t}"), adv("fifo", &t))
            }
            10 => {
                let t = text(rng, "dgram");
                (format!("dgram {t}"), adv("dgram", &t))
            }
            11 => {
                let n = 1 + rng.below(9);
                (format!("eventfd +{n}"), adv("eventfd", &n.to_string()))
            }
            12 => {
                let n = rng.below(16);
                (format!("seek {n}"), adv("seek", &n.to_string()))
            }
            // Without CAP_SYS_NICE a nice value only goes up.
            13 if m.nice < 19 => {
                m.nice += 1 + rng.below(19 - m.nice);
                (
                    format!("renice {}", m.nice),
                    adv("renice", &m.nice.to_string()),
                )
            }
            14 => {
                m.batch = !m.batch;
                let p = if m.batch { "3" } else { "0" };
                (format!("sched {p}"), adv("sched", p))
            }
            15 => {
                let n = 64 + rng.below(960);
                (format!("nofile {n}"), adv("nofile", &n.to_string()))
            }
            _ => continue,
        };
        return (what, sh);
    }
}

/// Randomized: after t1 (the holder), `CRAB_ADVERSARY_TURNS` turns (default 10) of one or
/// two operations each, drawn from the routes that leave the holder running and
/// checkpointable (not SIGSTOP: see [`holder_stopped_by_sigstop`]; not userfaultfd), file
/// writes and removals, and background processes started and stopped; after each turn end,
/// the live state's digest, a crash, a recovery, and the recovered state's digest, which must
/// be the live one. The seed is printed; `CRAB_ADVERSARY_SEED` replays it. Every mismatch is
/// reported with the seed and the turn.
#[tokio::test(flavor = "multi_thread")]
async fn a_random_adversary_never_loses_state_across_a_crash() {
    random_adversary("adv-random", &[]).await;
}

/// The same with `io.crab/self-contained-changes: keep` (issue 29 item 5): a change kept as the
/// holder's own doing must never be one the adversary made.
#[tokio::test(flavor = "multi_thread")]
async fn a_random_adversary_never_loses_state_with_self_contained_changes_kept() {
    random_adversary(
        "adv-random-keep",
        &[("io.crab/self-contained-changes", "keep")],
    )
    .await;
}

async fn random_adversary(name: &str, annotations: &[(&str, &str)]) {
    let seed = std::env::var("CRAB_ADVERSARY_SEED")
        .ok()
        .map(|s| s.parse::<u64>().expect("CRAB_ADVERSARY_SEED is a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let turns: u64 = std::env::var("CRAB_ADVERSARY_TURNS")
        .ok()
        .map(|s| s.parse().expect("CRAB_ADVERSARY_TURNS is a number"))
        .unwrap_or(10);
    eprintln!("adversary seed {seed} (CRAB_ADVERSARY_SEED={seed} replays it), {turns} turns");
    let started = Instant::now();
    let mut rng = Rng(seed);
    let mut model = Model::default();
    let opts = SandboxOptions {
        annotations,
        ..SandboxOptions::default()
    };
    let (mut s, _guard) = Sandbox::start(name, opts).await;
    s.run(&setup("")).await;
    end_turn(&mut s).await;
    s.sync().await;
    let mut failures = Vec::new();
    for _ in 0..turns {
        let turn = s.turn + 1;
        let ops: Vec<(String, String)> = (0..1 + rng.below(2))
            .map(|_| draw(&mut rng, &mut model, turn))
            .collect();
        let what: Vec<&str> = ops.iter().map(|(w, _)| w.as_str()).collect();
        let script: Vec<&str> = ops.iter().map(|(_, sh)| sh.as_str()).collect();
        s.run(&format!("set -e\n{}", script.join("\n"))).await;
        let a = end_turn(&mut s).await;
        s.sync().await;
        let live = digest(&s).await;
        crash(&s).await;
        let (code, out) = recover(&s);
        if code != 0 {
            failures.push(format!(
                "seed {seed}, t{turn} ({what:?}): recover failed: {out}"
            ));
            break;
        }
        let recovered = digest(&s).await;
        let d = diff(&live, &recovered);
        eprintln!(
            "t{turn} {what:?}: answered {}; {}",
            kind(&a),
            match d.is_empty() {
                true => "recovered whole".to_string(),
                false => format!("LOST {d:?}"),
            }
        );
        if !d.is_empty() {
            failures.push(format!(
                "seed {seed}, t{turn} ({what:?}) answered {}: the recovery lost {d:?}",
                why(&a)
            ));
        }
    }
    s.finish().await;
    eprintln!("{turns} turns in {:.1} s", started.elapsed().as_secs_f64());
    assert!(
        failures.is_empty(),
        "{} of {turns} turns lost state across a crash (replay: CRAB_ADVERSARY_SEED={seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
