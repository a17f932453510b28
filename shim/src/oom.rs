//! OOM notifications for a container's memory cgroup, v1 (eventfd on memory.oom_control)
//! or v2 (poll(2) on memory.events, which reports POLLPRI when the file changes). Hybrid hosts
//! keep the memory controller on v1. No inotify: a host allows 128 inotify instances per user
//! by default, and a node runs more containers (one shim each) than that.

use std::{
    fs,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::eventfd::{EfdFlags, EventFd},
};

use crate::error::{Error, Result};

/// Stops watching when dropped.
pub struct OomWatcher {
    stop: Arc<AtomicBool>,
    wake: EventFd,
}

impl Drop for OomWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.wake.write(1);
    }
}

enum MemoryCgroup {
    V1(PathBuf),
    V2(PathBuf),
}

/// Finds the memory cgroup of `pid`: v1 when the memory controller is there (hybrid hosts),
/// else the unified directory if it has the memory controller.
fn memory_cgroup(pid: i32) -> Result<MemoryCgroup> {
    let cgroups = crate::sys::cgroup::Cgroups::of(pid as u32)?;
    if let Some(dir) = cgroups.v1("memory") {
        return Ok(MemoryCgroup::V1(dir.clone()));
    }
    match cgroups.unified {
        Some(dir) if dir.join("memory.events").exists() => Ok(MemoryCgroup::V2(dir)),
        _ => Err(Error::NoCgroup(format!(
            "no memory cgroup found for pid {pid}"
        ))),
    }
}

/// Calls `on_oom` (from a watcher thread) each time the kernel OOM-kills in the cgroup of `pid`.
pub fn watch(pid: i32, on_oom: impl Fn() + Send + 'static) -> Result<OomWatcher> {
    let stop = Arc::new(AtomicBool::new(false));
    // Dropping the watcher writes to `wake`: the thread polls it too, so it can end.
    let wake = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)?;
    let (stop2, wake_fd) = (
        stop.clone(),
        wake.as_fd()
            .try_clone_to_owned()
            .map_err(Error::io("dup eventfd"))?,
    );
    let spawned = match memory_cgroup(pid)? {
        MemoryCgroup::V1(dir) => {
            let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)?;
            let control = fs::File::open(dir.join("memory.oom_control"))
                .map_err(Error::io("open memory.oom_control"))?;
            fs::write(
                dir.join("cgroup.event_control"),
                format!("{} {}", efd.as_fd().as_raw_fd(), control.as_raw_fd()),
            )
            .map_err(Error::io("register OOM eventfd"))?;
            std::thread::Builder::new()
                .name("oom-v1".into())
                .spawn(move || v1_loop(&dir, efd, control, wake_fd, &stop2, on_oom))
        }
        MemoryCgroup::V2(dir) => {
            let events = fs::File::open(dir.join("memory.events"))
                .map_err(Error::io("open memory.events"))?;
            std::thread::Builder::new()
                .name("oom-v2".into())
                .spawn(move || v2_loop(events, wake_fd, &stop2, on_oom))
        }
    };
    spawned.map_err(Error::io("spawn OOM watcher"))?;
    Ok(OomWatcher { stop, wake })
}

fn v1_loop(
    dir: &Path,
    efd: EventFd,
    _control: fs::File,
    wake: std::os::fd::OwnedFd,
    stop: &AtomicBool,
    on_oom: impl Fn(),
) {
    loop {
        let mut fds = [
            PollFd::new(efd.as_fd(), PollFlags::POLLIN),
            PollFd::new(wake.as_fd(), PollFlags::POLLIN),
        ];
        if poll(&mut fds, PollTimeout::NONE).is_err() || stop.load(Ordering::SeqCst) {
            return;
        }
        if fds[0]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLIN))
        {
            if efd.read().is_err() {
                return;
            }
            // The eventfd also fires when the cgroup is removed.
            if !dir.exists() || stop.load(Ordering::SeqCst) {
                return;
            }
            on_oom();
        }
    }
}

/// The `oom_kill` count of a memory.events text.
fn oom_kills(events: &str) -> Option<u64> {
    events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

/// Reads memory.events through `file` (which also tells the kernel this open file has seen
/// the change that made it poll).
fn read_events(file: &fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 4096];
    let n = file.read_at(&mut buf, 0).ok()?;
    buf.truncate(n);
    String::from_utf8(buf).ok()
}

fn v2_loop(events: fs::File, wake: std::os::fd::OwnedFd, stop: &AtomicBool, on_oom: impl Fn()) {
    let mut seen = read_events(&events)
        .and_then(|t| oom_kills(&t))
        .unwrap_or(0);
    loop {
        // POLLPRI only: kernfs files always poll readable.
        let mut fds = [
            PollFd::new(events.as_fd(), PollFlags::POLLPRI),
            PollFd::new(wake.as_fd(), PollFlags::POLLIN),
        ];
        if poll(&mut fds, PollTimeout::NONE).is_err() || stop.load(Ordering::SeqCst) {
            return;
        }
        // Counts are cumulative, so reading at most 10 times a second loses nothing, and a
        // file that kept polling ready (memory.high events under pressure, say) costs no spin.
        std::thread::sleep(std::time::Duration::from_millis(100));
        // A removed cgroup's file can no longer be read: the container is gone.
        let Some(text) = read_events(&events) else {
            return;
        };
        match oom_kills(&text) {
            Some(n) if n > seen => {
                seen = n;
                on_oom();
            }
            Some(_) => {}
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        os::unix::process::CommandExt,
        sync::atomic::AtomicUsize,
        time::{Duration, Instant},
    };

    #[test]
    fn oom_kills_are_read_from_memory_events() {
        let text = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 3\noom_group_kill 0\n";
        assert_eq!(oom_kills(text), Some(3));
        assert_eq!(oom_kills("low 0\n"), None);
        assert_eq!(oom_kills("oom_kill x\n"), None);
    }

    /// A process of a cgroup v2 with a small memory.max is OOM-killed: the watcher (no inotify)
    /// calls back, and dropping it ends its thread. Root and a v2 memory controller only.
    #[test]
    fn a_v2_oom_kill_is_seen_without_inotify() {
        let unified = Path::new("/sys/fs/cgroup");
        if !nix::unistd::geteuid().is_root()
            || !fs::read_to_string(unified.join("cgroup.subtree_control"))
                .is_ok_and(|c| c.contains("memory"))
        {
            // A hybrid host (the memory controller on v1) takes the eventfd path instead.
            eprintln!("skipped: needs root and a cgroup v2 root with the memory controller");
            return;
        }
        let cg = unified.join(format!("crab-oom-test-{}", std::process::id()));
        fs::create_dir(&cg).unwrap();
        fs::write(cg.join("memory.max"), "16M").unwrap();
        let _ = fs::write(cg.join("memory.swap.max"), "0");
        let procs = std::ffi::CString::new(cg.join("cgroup.procs").to_str().unwrap()).unwrap();
        let mut cmd = std::process::Command::new("sh");
        // tail keeps what it reads until a newline that /dev/zero never sends.
        cmd.args(["-c", "sleep 0.5; head -c 200000000 /dev/zero | tail"]);
        // SAFETY: open and write are async-signal-safe; "0" moves the calling process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        let kills = Arc::new(AtomicUsize::new(0));
        let k = kills.clone();
        let watcher = watch(child.id() as i32, move || {
            k.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let t = Instant::now();
        while kills.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        child.wait().unwrap();
        drop(watcher);
        let seen = kills.load(Ordering::SeqCst);
        let _ = fs::remove_dir(&cg);
        assert!(seen >= 1, "no OOM kill reported");
    }
}
