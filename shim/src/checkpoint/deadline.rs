//! A checkpoint job past its deadline (`[engine] job_timeout_ms`): what it started is stopped,
//! so that its engine slot and the container are free again.
//!
//! `runc checkpoint` is a child of the shim and CRIU a child of runc (`criu swrk`); CRIU freezes
//! the container's cgroup while it dumps, and a CRIU killed midway leaves it frozen (frozen
//! tasks do not even die). So the job's `runc checkpoint` and everything below it are killed,
//! then the container's cgroup is thawed. An fs capture runs on a blocking thread, which
//! cannot be killed: it is told to stop through its [`Cancel`], which it checks before every
//! entry and every chunk of file data it copies, and ends with
//! [`super::layer::LayerError::Cancelled`], its temporary files removed.

use std::{
    fs,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use crate::sys::cgroup::freezer::{CgroupFreezer, CgroupVersion};

/// A process as the search needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    pub args: Vec<String>,
}

/// The `runc checkpoint` processes of `container_id` that `shim_pid` started, and everything
/// below them, deepest first (so that CRIU dies before the runc that would report it).
pub fn checkpoint_tree(procs: &[ProcInfo], shim_pid: u32, container_id: &str) -> Vec<u32> {
    let is_checkpoint = |p: &ProcInfo| {
        p.ppid == shim_pid
            && p.args.iter().skip(1).any(|a| a == "checkpoint")
            && p.args.last().is_some_and(|a| a == container_id)
    };
    let mut levels: Vec<Vec<u32>> = vec![procs
        .iter()
        .filter(|p| is_checkpoint(p))
        .map(|p| p.pid)
        .collect()];
    // Bounded: a pid cycle cannot happen in /proc, but a racing read could show one.
    for _ in 0..32 {
        let last = levels.last().expect("one level at least");
        let next: Vec<u32> = procs
            .iter()
            .filter(|p| last.contains(&p.ppid))
            .map(|p| p.pid)
            .collect();
        if next.is_empty() {
            break;
        }
        levels.push(next);
    }
    let mut out = Vec::new();
    for level in levels.into_iter().rev() {
        for pid in level {
            if !out.contains(&pid) {
                out.push(pid);
            }
        }
    }
    out
}

/// Tells a running capture to stop (its job passed its deadline). Clones share the flag; a
/// capture checks it before every entry it writes and every chunk of file data it copies.
#[derive(Debug, Clone, Default)]
pub struct Cancel {
    flag: Arc<AtomicBool>,
    /// Tests: the flag sets itself at this many looks ([`Cancel::after_looks`]).
    #[cfg(test)]
    looks_left: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl Cancel {
    /// A flag nothing has set yet.
    pub fn new() -> Cancel {
        Cancel::default()
    }

    /// A flag that sets itself when it is looked at for the `n`th time: where a capture looks
    /// is then exact, whatever the speed of the disk.
    #[cfg(test)]
    pub fn after_looks(n: u64) -> Cancel {
        Cancel {
            looks_left: Some(Arc::new(n.into())),
            ..Cancel::default()
        }
    }

    pub fn cancel(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        #[cfg(test)]
        if let Some(left) = &self.looks_left {
            let was = left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            if was == Ok(1) {
                self.cancel();
            }
        }
        self.flag.load(Ordering::Relaxed)
    }
}

/// The processes of the host, read from `/proc` (those that vanish meanwhile are left out).
fn read_procs() -> Vec<ProcInfo> {
    let mut procs = Vec::new();
    for pid in crate::sys::procfs::pids() {
        let Ok(Some(stat)) = crate::inspector::procs::read_stat(pid) else {
            continue;
        };
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        procs.push(ProcInfo {
            pid,
            ppid: stat.ppid,
            args,
        });
    }
    procs
}

/// What [`abort`] did, for the job's failure record.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Aborted {
    pub killed: Vec<u32>,
    /// The container's freezer was thawed (`None`: it could not be found or written).
    pub thawed: Option<bool>,
}

impl std::fmt::Display for Aborted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.killed.len() {
            0 => write!(f, "no process dump was running")?,
            n => write!(
                f,
                "killed the process dump: CRIU and any runc checkpoint ({n} processes)"
            )?,
        }
        match self.thawed {
            Some(true) => write!(f, ", thawed the container"),
            Some(false) => write!(f, ", the container was not frozen"),
            None => write!(f, ", the container's freezer could not be reached"),
        }
    }
}

/// Kills the job's `runc checkpoint` of `container_id` with CRIU, then thaws the container
/// (init `init_pid`) if it is frozen.
pub fn abort(container_id: &str, init_pid: u32) -> Aborted {
    let doomed = checkpoint_tree(&read_procs(), std::process::id(), container_id);
    let mut killed = Vec::new();
    for pid in doomed {
        // SAFETY: kill(2) of a process this shim started (or its descendant).
        if unsafe { libc::kill(pid as i32, libc::SIGKILL) } == 0 {
            killed.push(pid);
        }
    }
    Aborted {
        killed,
        thawed: thaw(init_pid),
    }
}

/// Thaws the freezer cgroup of `init_pid`: `Some(true)` if it was frozen.
fn thaw(init_pid: u32) -> Option<bool> {
    let freezer = CgroupFreezer::for_pid(init_pid).ok()?;
    let (state, thawed) = match freezer.version() {
        CgroupVersion::V1 => ("freezer.state", "THAWED"),
        CgroupVersion::V2 => ("cgroup.freeze", "0"),
    };
    let path = freezer.dir().join(state);
    let was = fs::read_to_string(&path).ok()?;
    if was.trim() == thawed {
        return Some(false);
    }
    write(&path, thawed).then_some(true)
}

fn write(path: &Path, value: &str) -> bool {
    match fs::write(path, value) {
        Ok(()) => true,
        Err(e) => {
            log::error!("cannot thaw {}: {e}", path.display());
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, ppid: u32, args: &str) -> ProcInfo {
        ProcInfo {
            pid,
            ppid,
            args: args.split(' ').map(str::to_string).collect(),
        }
    }

    #[test]
    fn the_checkpoint_tree_is_the_shims_runc_checkpoint_of_the_container_and_below() {
        let procs = [
            p(10, 1, "containerd-shim-crab-v1 -namespace ns -id c"),
            p(20, 10, "runc --root /run/crab/runc/ns --log l --log-format json checkpoint --image-path /s/proc/000003 --leave-running c"),
            p(21, 20, "criu swrk 3"),
            p(22, 21, "criu helper"),
            // Another container's checkpoint, a restore of this one, a stranger's runc.
            p(30, 10, "runc --root r checkpoint --image-path /x other"),
            p(31, 30, "criu swrk 3"),
            p(40, 10, "runc --root r restore --detach --bundle /b c"),
            p(50, 99, "runc --root r checkpoint --image-path /y c"),
            // The container's own processes are no descendants of runc.
            p(60, 1, "sleep 1000"),
        ];
        assert_eq!(checkpoint_tree(&procs, 10, "c"), [22, 21, 20]);
        assert_eq!(checkpoint_tree(&procs, 10, "other"), [31, 30]);
        assert!(checkpoint_tree(&procs, 10, "nothing").is_empty());
        // An id that is also a word of runc's command line is matched as the last argument only.
        let procs = [p(
            20,
            10,
            "runc --root r checkpoint --image-path /p checkpoint",
        )];
        assert_eq!(checkpoint_tree(&procs, 10, "checkpoint"), [20]);
        assert!(checkpoint_tree(&procs, 10, "r").is_empty());
    }

    #[test]
    fn aborts_read_for_people() {
        let a = Aborted {
            killed: vec![3, 2],
            thawed: Some(true),
        };
        assert_eq!(
            a.to_string(),
            "killed the process dump: CRIU and any runc checkpoint (2 processes), thawed the container"
        );
        assert_eq!(
            Aborted::default().to_string(),
            "no process dump was running, the container's freezer could not be reached"
        );
    }
}
