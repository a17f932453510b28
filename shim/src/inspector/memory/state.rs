//! The kernel-held state of a process (threads, fds, signals, credentials, cwd), read from
//! `/proc` and compared.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;

use super::super::procs::{self};
use super::image::*;
use super::observe::*;

/// Where a thread waits: `/proc/PID/task/TID/syscall` reduced to the syscall number, stack
/// pointer and instruction pointer. The six argument registers are left out: the kernel prints
/// all six whatever the syscall takes, so unused ones hold leftovers of earlier user code (seen:
/// a `read` whose r8-r10 differed after an unrelated store), and the used ones point into memory
/// that is hashed anyway.
pub(super) fn syscall_site(line: &str) -> String {
    let f: Vec<&str> = line.split_whitespace().collect();
    match f.len() {
        9 => format!("{} sp={} pc={}", f[0], f[7], f[8]),
        _ => f.join(" "), // "running", or "-1 sp pc" when not in a syscall
    }
}

pub(super) const STATUS_KEYS: &[&str] = &[
    "Umask:",
    "Uid:",
    "Gid:",
    "Groups:",
    "SigPnd:",
    "ShdPnd:",
    "SigBlk:",
    "SigIgn:",
    "SigCgt:",
    "CapInh:",
    "CapPrm:",
    "CapEff:",
    "CapBnd:",
    "CapAmb:",
    "NoNewPrivs:",
    "Seccomp:",
    "Seccomp_filters:",
];

pub(super) fn read_opt(path: &str) -> Option<String> {
    std::fs::read(path)
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

pub(super) fn readlink_opt(path: &str) -> String {
    std::fs::read_link(path)
        .map(|p| String::from_utf8_lossy(p.as_os_str().as_bytes()).into_owned())
        .unwrap_or_default()
}

/// An fd's `fdinfo` as a mark keeps it: its lines (whitespace normalised, timerfd's
/// self-changing `it_value` left out) while `budget` lasts, each line's bytes taken from it;
/// once it is spent, one line `xxh3 <hash> <bytes>` of the rest, read in bounded chunks. An epoll
/// fd watching a million fds then costs the shim a few bytes, and a change still shows.
pub(super) fn fdinfo_lines(mut src: impl io::Read, budget: &mut u64) -> Vec<String> {
    const MAX_LINE: usize = 4096;
    let mut lines = Vec::new();
    let mut hash: Option<(xxhash_rust::xxh3::Xxh3, u64)> = None;
    let mut keep = |line: &[u8],
                    lines: &mut Vec<String>,
                    hash: &mut Option<(xxhash_rust::xxh3::Xxh3, u64)>| {
        // A timerfd's remaining time and its expiries not yet read move with the clock alone.
        if line.starts_with(b"it_value:") || line.starts_with(b"ticks:") {
            return;
        }
        let text = String::from_utf8_lossy(line)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if hash.is_none() && (text.len() as u64) < *budget {
            *budget -= text.len() as u64 + 1;
            lines.push(text);
            return;
        }
        let (h, n) = hash.get_or_insert_with(|| (xxhash_rust::xxh3::Xxh3::new(), 0));
        h.update(text.as_bytes());
        h.update(b"\n");
        *n += text.len() as u64 + 1;
    };
    let mut buf = vec![0u8; 64 << 10];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        carry.extend_from_slice(&buf[..n]);
        let mut start = 0;
        while let Some(i) = carry[start..].iter().position(|b| *b == b'\n') {
            keep(&carry[start..start + i], &mut lines, &mut hash);
            start += i + 1;
        }
        carry.drain(..start);
        if carry.len() > MAX_LINE {
            // No line is this long in a real fdinfo: hash it in pieces.
            keep(&carry, &mut lines, &mut hash);
            carry.clear();
        }
    }
    if !carry.is_empty() {
        keep(&carry, &mut lines, &mut hash);
    }
    if let Some((h, n)) = hash {
        lines.push(format!("xxh3 {:016x} {n}", h.digest()));
    }
    lines
}

/// The process's kernel-side state, and the bytes of fdinfo read for it (counted against
/// `total`, the observation's bound).
pub(super) fn capture_state(
    pid: u32,
    fdinfo_budget: u64,
    total: &mut Budget,
) -> Result<(ProcState, u64), MemError> {
    read_proc_state(pid, fdinfo_budget, total, Depth::Whole)
}

/// How much of a process's kernel-held state to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Depth {
    /// Everything [`ProcState`] holds.
    Whole,
    /// What can change while the process does not run, by a route no probe counts: signals
    /// (pending, stopped), the fd table as seen from outside (targets), and what the fds that
    /// anyone may open by name or reach through their peer hold (queued bytes of pipes, FIFOs
    /// and sockets; terminal settings). Not: fdinfo (a position, an eventfd's count, an epoll
    /// set change only through the open file itself, which another process reaches only by
    /// sharing it: it then holds it too and shows the change in its own state, or it got it by
    /// a counted route: pidfd_getfd), the syscall sites, cwd and root.
    Held,
}

/// Bytes of the fdinfo bound an fd costs in a [`Depth::Held`] read, which reads no fdinfo: a
/// process of a million fds must not cost a million reads per turn end unbounded.
pub(super) const HELD_FD_COST: u64 = 64;

pub(super) fn read_proc_state(
    pid: u32,
    mut fdinfo_budget: u64,
    total: &mut Budget,
    depth: Depth,
) -> Result<(ProcState, u64), MemError> {
    let whole = depth == Depth::Whole;
    let mut st = ProcState::default();
    let task_dir = format!("/proc/{pid}/task");
    let mut tids: Vec<u32> = std::fs::read_dir(&task_dir)
        .map_err(io_err(pid, "task list"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    for tid in tids {
        let base = format!("/proc/{pid}/task/{tid}");
        // A thread that exits while we read it just goes missing, which shows as a change.
        let Some(stat) = read_opt(&format!("{base}/stat")).and_then(|s| procs::parse_stat(&s))
        else {
            continue;
        };
        let syscall = match whole {
            true => syscall_site(&read_opt(&format!("{base}/syscall")).unwrap_or_default()),
            false => String::new(),
        };
        let status = read_opt(&format!("{base}/status"))
            .unwrap_or_default()
            .lines()
            .filter(|l| STATUS_KEYS.iter().any(|k| l.starts_with(k)))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        st.threads.push(ThreadState {
            tid,
            start_time: stat.start_time,
            comm: stat.comm,
            syscall,
            status,
            // A frozen cgroup (a mark taken while the container is frozen) reads `D` for a
            // stopped task too: the wait channel tells.
            stopped: stat.state == 't'
                || super::procs::in_job_stop(stat.state, || read_opt(&format!("{base}/wchan"))),
            sleeping: stat.state == 'S',
        });
    }
    let fd_dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&fd_dir)
        .map_err(io_err(pid, "fd list"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    let mut fdinfo_read = 0u64;
    // What the fds hold beyond fdinfo (queued bytes, terminal settings) is read through a
    // copy of each fd; a process gone meanwhile shows as its fds missing.
    let pidfd = crate::sys::pidfd::PidFd::open(pid).ok();
    for fd in fds {
        let target = readlink_opt(&format!("{fd_dir}/{fd}"));
        if !whole {
            total.stats.fdinfo_bytes += HELD_FD_COST;
            total.fdinfo(HELD_FD_COST)?;
        }
        let fdinfo = match whole {
            true => std::fs::File::open(format!("/proc/{pid}/fdinfo/{fd}")).ok(),
            false => None,
        };
        let info = match fdinfo {
            None => Vec::new(),
            Some(f) => {
                // Read at most one byte past what the observation may still read.
                let left = total.fdinfo_left();
                let mut src = Counted {
                    inner: io::Read::take(f, left.saturating_add(1)),
                    n: 0,
                };
                let info = fdinfo_lines(&mut src, &mut fdinfo_budget);
                fdinfo_read += src.n;
                total.stats.fdinfo_bytes += src.n;
                total.fdinfo(src.n)?;
                info
            }
        };
        let mut info = info;
        if let Some(h) = pidfd
            .as_ref()
            .and_then(|p| super::super::held::held(p.as_fd(), fd, &target))
        {
            total.memory(h.bytes_read)?;
            total.stats.queue_bytes += h.bytes_read;
            info.push(h.line);
        }
        st.fds.push(FdState { fd, target, info });
    }
    if whole {
        st.cwd = readlink_opt(&format!("/proc/{pid}/cwd"));
        st.root = readlink_opt(&format!("/proc/{pid}/root"));
    }
    Ok((st, fdinfo_read))
}

/// What the kernel holds for process `pid` now that can change while it does not run (see
/// `Depth::Held`: signals, stopped, fd targets, queued bytes, terminal settings), without its
/// memory: for a process that did not run since its image was taken, to compare with that
/// image's state ([`compare_held`]). Counts against `obs`'s bounds.
pub fn read_held_state(pid: u32, obs: &mut Observation) -> Result<ProcState, MemError> {
    obs.budget.fail()?;
    let (state, _) = read_proc_state(pid, 0, &mut obs.budget, Depth::Held)?;
    Ok(state)
}

/// The line of an fd's state that says what it holds ([`super::super::held`]), if any.
pub(super) fn held_line(f: &FdState) -> Option<&str> {
    f.info
        .iter()
        .find(|l| l.starts_with("queue: ") || l.starts_with("termios "))
        .map(String::as_str)
}

/// What differs between a whole state `prev` and a [`read_held_state`] `now` of one process:
/// [`compare_state`] of what the latter reads (`prev` seen at that depth).
pub fn compare_held(prev: &ProcState, now: &ProcState) -> Vec<String> {
    let held = ProcState {
        threads: prev
            .threads
            .iter()
            .map(|t| ThreadState {
                syscall: String::new(),
                ..t.clone()
            })
            .collect(),
        fds: prev
            .fds
            .iter()
            .map(|f| FdState {
                fd: f.fd,
                target: f.target.clone(),
                info: held_line(f).map(str::to_string).into_iter().collect(),
            })
            .collect(),
        cwd: String::new(),
        root: String::new(),
        signals_while_pending: prev.signals_while_pending,
    };
    compare_state(&held, now, false)
}

/// A reader that counts the bytes read through it.
pub(super) struct Counted<R> {
    pub(super) inner: R,
    pub(super) n: u64,
}

impl<R: io::Read> io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// What differs between two states of one process, described. `sites`: whether the syscall
/// each thread is blocked in counts (it moves whenever the process runs, which its memory
/// tells; only a tracer could move it otherwise, and ptrace writes count on their own).
pub fn compare_state(a: &ProcState, b: &ProcState, sites: bool) -> Vec<String> {
    let mut out = Vec::new();
    if a.signals_while_pending != b.signals_while_pending {
        out.push(match (a.signals_while_pending, b.signals_while_pending) {
            (_, None) => "its pending signals were taken".to_string(),
            (None, Some(_)) => "signals queued and pending".to_string(),
            (Some(x), Some(y)) => {
                format!("{} more signals queued while pending", y.wrapping_sub(x))
            }
        });
    }
    if a.cwd != b.cwd {
        out.push(format!("cwd {} -> {}", a.cwd, b.cwd));
    }
    if a.root != b.root {
        out.push("root changed".to_string());
    }
    let ids = |s: &ProcState| {
        s.threads
            .iter()
            .map(|t| (t.tid, t.start_time))
            .collect::<Vec<_>>()
    };
    if ids(a) != ids(b) {
        out.push(format!(
            "threads {} -> {}",
            a.threads.len(),
            b.threads.len()
        ));
    } else {
        for (x, y) in a.threads.iter().zip(&b.threads) {
            if x.stopped != y.stopped {
                out.push(format!(
                    "thread {}: {}",
                    x.tid,
                    if y.stopped { "stopped" } else { "continued" }
                ));
            }
            if sites && x.syscall != y.syscall {
                out.push(format!(
                    "thread {}: syscall {:?} -> {:?}",
                    x.tid, x.syscall, y.syscall
                ));
            }
            if x.status != y.status {
                out.push(format!("thread {}: signal/credential state", x.tid));
            }
            if x.comm != y.comm {
                out.push(format!(
                    "thread {}: comm {:?} -> {:?}",
                    x.tid, x.comm, y.comm
                ));
            }
        }
    }
    fn fdmap(s: &ProcState) -> std::collections::BTreeMap<i32, &FdState> {
        s.fds.iter().map(|f| (f.fd, f)).collect()
    }
    let (fa, fb) = (fdmap(a), fdmap(b));
    for (fd, x) in &fa {
        match fb.get(fd) {
            None => out.push(format!("fd {fd} closed ({})", x.target)),
            Some(y) if y.target != x.target => {
                out.push(format!("fd {fd}: {} -> {}", x.target, y.target))
            }
            Some(y) if y.info != x.info => match (held_line(x), held_line(y)) {
                (a, b) if a != b => out.push(format!(
                    "fd {fd} ({}): {} -> {}",
                    x.target,
                    a.unwrap_or("-"),
                    b.unwrap_or("-")
                )),
                _ => out.push(format!("fd {fd} ({}): position/flags/state", x.target)),
            },
            _ => {}
        }
    }
    for (fd, y) in &fb {
        if !fa.contains_key(fd) {
            out.push(format!("fd {fd} opened ({})", y.target));
        }
    }
    out
}
