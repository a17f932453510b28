//! The pinned versions of the programs under the pin root (`<root>/<version>/{maps,progs,links}`):
//! opening a complete one, publishing a fresh load with one rename under `flock`, and retiring
//! the versions nothing watches through any more.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use aya::maps::{
    Array, HashMap as BpfHashMap, Map, MapData, MapError, MapInfo, MapType, PerCpuArray,
    PerCpuHashMap,
};
use log::{debug, info, warn};
use nix::fcntl::{Flock, FlockArg};
use nix::mount::MsFlags;
use nix::sys::statfs::{FsType, BPF_FS_MAGIC, TRACEFS_MAGIC};

use super::programs::{
    expected_links, pin_into, program_names, version_dir_name, RawCounters, RawQuota, RawRun,
    TRACEFS_MOUNT,
};
use super::{io_err, map_err, BpfError, ProgramStats};
use crate::sys::bpf;
use crate::sys::pidfd::PidFd;

pub(super) const BPFFS_MOUNT: &str = "/sys/fs/bpf";

/// One version's pins, opened. Behind a mutex: aya's maps want `&mut` to
/// write, and [`HostProbes::watch`] may swap in a fresh set (see there).
pub(super) struct Maps {
    pub(super) dir: PathBuf,
    /// Kernel id of `watched`: tells whether `dir` still holds our maps.
    pub(super) watched_id: u32,
    /// Pinned programs, to read their statistics (recursion misses).
    programs: Vec<OwnedFd>,
    pub(super) watched: PerCpuHashMap<MapData, u64, RawCounters>,
    pub(super) levels: Array<MapData, u64>,
    pub(super) runs: RunStorage,
    pub(super) oncpu: PerCpuArray<MapData, u64>,
    pub(super) quotas: BpfHashMap<MapData, u64, RawQuota>,
    /// Rootfs superblock (`st_dev` in the kernel's encoding) -> watched cgroup id.
    pub(super) rootfs: BpfHashMap<MapData, u64, u64>,
    pub(super) rootfs_any: Array<MapData, u64>,
}

impl Maps {
    pub(super) fn program_stats(&self) -> Result<Vec<ProgramStats>, BpfError> {
        self.programs
            .iter()
            .map(|fd| {
                bpf::prog_stats(fd.as_fd()).map_err(|source| BpfError::Syscall {
                    op: "BPF_OBJ_GET_INFO_BY_FD",
                    source,
                })
            })
            .collect()
    }

    pub(super) fn recursion_misses(&self) -> Result<u64, BpfError> {
        Ok(self
            .program_stats()?
            .iter()
            .map(|p| p.recursion_misses)
            .sum())
    }
}

/// The `runs` task storage: one [`RawRun`] per process, on its thread-group leader, found
/// through a pidfd of the process (the eBPF library has no type for it).
pub(super) struct RunStorage(MapData);

impl RunStorage {
    fn open(path: &Path) -> Result<RunStorage, BpfError> {
        let data = MapData::from_pin(path).map_err(map_err("runs"))?;
        let info = data.info().map_err(map_err("runs"))?;
        let (kind, key, value) = (info.map_type().ok(), info.key_size(), info.value_size());
        if kind != Some(MapType::TaskStorage)
            || key != 4
            || value as usize != std::mem::size_of::<RawRun>()
        {
            return Err(BpfError::Incomplete {
                path: path.to_path_buf(),
                detail: format!(
                    "runs is {kind:?} with {key}-byte keys and {value}-byte values, not task \
                     storage of {}-byte runs",
                    std::mem::size_of::<RawRun>()
                ),
            });
        }
        Ok(RunStorage(data))
    }

    /// The entry of process `pid`; `None` if it has none or is gone (or `pid` is no process:
    /// a thread id).
    pub(super) fn get(&self, pid: u32) -> Result<Option<RawRun>, BpfError> {
        let Some(pidfd) = open_process(pid)? else {
            return Ok(None);
        };
        // SAFETY: `open` checked that the map is task storage of RawRun-sized values, and
        // RawRun is plain old data (every bit pattern valid).
        unsafe { bpf::task_storage_get::<RawRun>(self.0.fd().as_fd(), pidfd.as_fd()) }.map_err(
            |source| BpfError::Syscall {
                op: "BPF_MAP_LOOKUP_ELEM (runs)",
                source,
            },
        )
    }

    /// Removes the entry of process `pid`, if any.
    pub(super) fn remove(&self, pid: u32) -> Result<(), BpfError> {
        let Some(pidfd) = open_process(pid)? else {
            return Ok(());
        };
        bpf::task_storage_delete(self.0.fd().as_fd(), pidfd.as_fd())
            .map(drop)
            .map_err(|source| BpfError::Syscall {
                op: "BPF_MAP_DELETE_ELEM (runs)",
                source,
            })
    }
}

/// A pidfd of process `pid`; `None` when there is no such process (`ESRCH`) or `pid` names a
/// thread other than a leader (`EINVAL`).
fn open_process(pid: u32) -> Result<Option<PidFd>, BpfError> {
    match PidFd::open(pid) {
        Ok(fd) => Ok(Some(fd)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH) | Some(libc::EINVAL)) => Ok(None),
        Err(source) => Err(BpfError::Syscall {
            op: "pidfd_open",
            source,
        }),
    }
}

pub(super) fn open_pinned(dir: &Path) -> Result<Maps, BpfError> {
    check_links(dir)?;
    let open = |name: &'static str| -> Result<Map, BpfError> {
        let path = dir.join("maps").join(name);
        let data = MapData::from_pin(&path).map_err(map_err(name))?;
        Map::from_map_data(data).map_err(map_err(name))
    };
    let watched_id = pinned_map_id(dir).map_err(map_err("watched"))?;
    let mut maps = Maps {
        dir: dir.to_path_buf(),
        watched_id,
        programs: Vec::new(),
        watched: PerCpuHashMap::try_from(open("watched")?).map_err(map_err("watched"))?,
        levels: Array::try_from(open("levels")?).map_err(map_err("levels"))?,
        runs: RunStorage::open(&dir.join("maps").join("runs"))?,
        oncpu: PerCpuArray::try_from(open("oncpu")?).map_err(map_err("oncpu"))?,
        quotas: BpfHashMap::try_from(open("quotas")?).map_err(map_err("quotas"))?,
        rootfs: BpfHashMap::try_from(open("rootfs")?).map_err(map_err("rootfs"))?,
        rootfs_any: Array::try_from(open("rootfs_any")?).map_err(map_err("rootfs_any"))?,
    };
    for name in program_names() {
        let path = dir.join("progs").join(name);
        maps.programs
            .push(bpf::obj_get(&path).map_err(io_err("opening pinned program", &path))?);
    }
    debug!("inspector: opened pinned BPF programs at {}", dir.display());
    Ok(maps)
}

/// Kernel id of the `watched` map pinned in a version directory.
pub(super) fn pinned_map_id(dir: &Path) -> Result<u32, MapError> {
    Ok(MapInfo::from_pin(dir.join("maps").join("watched"))?.id())
}

/// Unpins everything under `root` (all versions): programs detach once no
/// process holds them. Only for roots nobody else uses (tests, benchmarks,
/// decommissioning a host) — shims still watching through these pins would
/// go blind.
pub fn remove_pinned(root: &Path) -> Result<(), BpfError> {
    match fs::remove_dir_all(root) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BpfError::Io {
            what: "removing pins",
            path: root.to_path_buf(),
            source: e,
        }),
    }
}

/// Unpins the other versions under `root` that nothing is watched through
/// (left by shims of older builds): attached, they cost every syscall on the
/// host for nothing. Caller holds the root lock.
pub(super) fn collect_stale_versions_locked(root: &Path) {
    let current = version_dir_name();
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let dir = entry.path();
        if name == current || !(name.starts_with('v') || name.starts_with("retired-")) {
            continue;
        }
        if version_in_use(&dir) {
            debug!(
                "inspector: keeping {} (cgroups watched through it)",
                dir.display()
            );
            continue;
        }
        // Parked under another name first: a shim of that version that
        // watches from now on finds its pins gone (HostProbes::watch checks
        // after inserting) and one that inserted before shows up in the
        // second check.
        let parked = if name.starts_with("retired-") {
            dir.clone()
        } else {
            root.join(format!("retired-{name}"))
        };
        if fs::rename(&dir, &parked).is_err() {
            continue;
        }
        if version_in_use(&parked) {
            let _ = fs::rename(&parked, &dir);
            continue;
        }
        info!("inspector: removing unused BPF programs {}", dir.display());
        if let Err(e) = fs::remove_dir_all(&parked) {
            warn!("inspector: removing {}: {e}", parked.display());
        }
    }
}

/// Does the `watched` map of a version directory have any entry? Anything
/// unreadable counts as in use.
fn version_in_use(dir: &Path) -> bool {
    let Ok(fd) = bpf::obj_get(&dir.join("maps").join("watched")) else {
        return true;
    };
    !matches!(bpf::map_is_empty(fd.as_fd()), Ok(true))
}

fn check_links(dir: &Path) -> Result<(), BpfError> {
    let links_dir = dir.join("links");
    let mut present = BTreeSet::new();
    for entry in fs::read_dir(&links_dir).map_err(io_err("listing", &links_dir))? {
        let entry = entry.map_err(io_err("listing", &links_dir))?;
        present.insert(entry.file_name().to_string_lossy().into_owned());
    }
    let expected = expected_links()?;
    let missing: Vec<_> = expected.difference(&present).cloned().collect();
    if !missing.is_empty() {
        return Err(BpfError::Incomplete {
            path: dir.to_path_buf(),
            detail: format!("missing links {missing:?}"),
        });
    }
    Ok(())
}

/// Loads, attaches and pins everything into a temporary directory, then
/// publishes it as `dir` with one rename. Caller holds the root lock.
pub(super) fn load_and_pin(root: &Path, dir: &Path) -> Result<(), BpfError> {
    // Leftovers of a loader that died mid-way hold attached links: drop them.
    if let Ok(entries) = fs::read_dir(root) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("tmp-") {
                warn!(
                    "inspector: removing unfinished BPF pins {}",
                    entry.path().display()
                );
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }
    let tmp = root.join(format!("tmp-{}", std::process::id()));
    let result =
        pin_into(&tmp).and_then(|()| fs::rename(&tmp, dir).map_err(io_err("publishing", dir)));
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    result?;
    info!(
        "inspector: loaded and pinned BPF programs at {}",
        dir.display()
    );
    Ok(())
}

/// The filesystem type of what `path` is on.
pub(super) fn fs_type(path: &Path) -> io::Result<FsType> {
    Ok(nix::sys::statfs::statfs(path)?.filesystem_type())
}

/// Mounts bpffs and tracefs where they belong unless they are there.
pub(super) fn ensure_filesystems() -> Result<(), BpfError> {
    ensure_mounted(BPFFS_MOUNT, "bpf", BPF_FS_MAGIC)?;
    ensure_mounted(TRACEFS_MOUNT, "tracefs", TRACEFS_MAGIC)
}

/// Mounts `fstype` at `target` unless a filesystem of that type is there.
fn ensure_mounted(target: &str, fstype: &str, magic: FsType) -> Result<(), BpfError> {
    let path = Path::new(target);
    if fs_type(path).ok() == Some(magic) {
        return Ok(());
    }
    fs::create_dir_all(path).map_err(io_err("creating", path))?;
    nix::mount::mount(
        Some(fstype),
        path,
        Some(fstype),
        MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| BpfError::Io {
        what: "mounting",
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    info!("inspector: mounted {fstype} at {target}");
    Ok(())
}

/// flock on a directory (or a file); released on drop.
pub(super) struct DirLock {
    _lock: Flock<File>,
}

impl DirLock {
    pub(super) fn exclusive(dir: &Path) -> Result<DirLock, BpfError> {
        let file = File::open(dir).map_err(io_err("opening", dir))?;
        let lock = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| BpfError::Io {
            what: "locking",
            path: dir.to_path_buf(),
            source: e.into(),
        })?;
        Ok(DirLock { _lock: lock })
    }
}
