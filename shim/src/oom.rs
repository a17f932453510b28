//! OOM notifications for a container's memory cgroup, v1 (eventfd on memory.oom_control)
//! or v2 (inotify on memory.events). Hybrid hosts keep the memory controller on v1.

use std::{
    fs,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use nix::sys::{
    eventfd::{EfdFlags, EventFd},
    inotify::{AddWatchFlags, InitFlags, Inotify},
};

use crate::error::{Error, Result};

/// Stops watching when dropped.
pub struct OomWatcher {
    stop: Arc<AtomicBool>,
    wake: Option<EventFd>,
}

impl Drop for OomWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(wake) = &self.wake {
            let _ = wake.write(1);
        }
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
    match memory_cgroup(pid)? {
        MemoryCgroup::V1(dir) => {
            let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)?;
            let control = fs::File::open(dir.join("memory.oom_control"))
                .map_err(Error::io("open memory.oom_control"))?;
            fs::write(
                dir.join("cgroup.event_control"),
                format!("{} {}", efd.as_fd().as_raw_fd(), control.as_raw_fd()),
            )
            .map_err(Error::io("register OOM eventfd"))?;
            let wake = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)?;
            // Dropping the watcher writes to `wake`: poll both so it can end the thread.
            let (stop2, wake_fd) = (
                stop.clone(),
                wake.as_fd()
                    .try_clone_to_owned()
                    .map_err(Error::io("dup eventfd"))?,
            );
            std::thread::Builder::new()
                .name("oom-v1".into())
                .spawn(move || v1_loop(&dir, efd, control, wake_fd, &stop2, on_oom))
                .map_err(Error::io("spawn OOM watcher"))?;
            Ok(OomWatcher {
                stop,
                wake: Some(wake),
            })
        }
        MemoryCgroup::V2(dir) => {
            let inotify = Inotify::init(InitFlags::IN_CLOEXEC)?;
            inotify.add_watch(&dir.join("memory.events"), AddWatchFlags::IN_MODIFY)?;
            let stop2 = stop.clone();
            std::thread::Builder::new()
                .name("oom-v2".into())
                .spawn(move || v2_loop(&dir, inotify, &stop2, on_oom))
                .map_err(Error::io("spawn OOM watcher"))?;
            Ok(OomWatcher { stop, wake: None })
        }
    }
}

fn v1_loop(
    dir: &Path,
    efd: EventFd,
    _control: fs::File,
    wake: std::os::fd::OwnedFd,
    stop: &AtomicBool,
    on_oom: impl Fn(),
) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
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

fn oom_kills(dir: &Path) -> Option<u64> {
    let events = fs::read_to_string(dir.join("memory.events")).ok()?;
    events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

fn v2_loop(dir: &Path, inotify: Inotify, stop: &AtomicBool, on_oom: impl Fn()) {
    let mut seen = oom_kills(dir).unwrap_or(0);
    loop {
        let Ok(events) = inotify.read_events() else {
            return;
        };
        if stop.load(Ordering::SeqCst)
            || events
                .iter()
                .any(|e| e.mask.contains(AddWatchFlags::IN_IGNORED))
        {
            return;
        }
        match oom_kills(dir) {
            Some(n) if n > seen => {
                seen = n;
                on_oom();
            }
            Some(_) => {}
            None => return,
        }
    }
}
