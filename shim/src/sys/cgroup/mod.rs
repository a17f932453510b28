//! A process's cgroups, on cgroup v1, v2 or the hybrid of both: its directories from
//! `/proc/PID/cgroup` and the mount table (never assuming where hierarchies are mounted), the
//! cgroup2 mount, cgroup ids (what eBPF programs filter on) and their directories, and the
//! [`freezer`]. The one place crab resolves cgroups: the task core, the inspector, checkpoints
//! and the shim's own placement all go through it.

pub mod freezer;

use std::{
    fs, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Component, Path, PathBuf},
};

use super::mountinfo::{self, Mount};

/// Why a process's cgroups could not be found.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl CgroupError {
    fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> CgroupError {
        let context = context.into();
        move |source| CgroupError::Io { context, source }
    }
}

/// Where a process's cgroups are.
#[derive(Debug, Clone, Default)]
pub struct Cgroups {
    /// v1 hierarchies: (controllers, directory of the process in that hierarchy).
    v1: Vec<(Vec<String>, PathBuf)>,
    /// The process's directory in the cgroup2 (unified) hierarchy, if mounted.
    pub unified: Option<PathBuf>,
}

impl Cgroups {
    pub fn of(pid: u32) -> Result<Cgroups, CgroupError> {
        let membership = fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map_err(CgroupError::io(format!("read /proc/{pid}/cgroup")))?;
        let mounts = mountinfo::read_self().map_err(CgroupError::io("read mountinfo"))?;
        Ok(Self::parse(&membership, &mounts))
    }

    fn parse(membership: &str, mounts: &[Mount]) -> Cgroups {
        let mut out = Cgroups::default();
        for line in membership.lines() {
            // `hierarchy-ID:controller-list:cgroup-path`; the path may hold colons.
            let mut parts = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            if id.parse::<u32>().is_err() || !path.starts_with('/') {
                continue;
            }
            if controllers.is_empty() {
                if out.unified.is_none() {
                    out.unified = Hierarchy::unified(mounts).map(|h| h.dir_of(path));
                }
                continue;
            }
            let names: Vec<String> = controllers.split(',').map(str::to_owned).collect();
            let mount = mounts
                .iter()
                .find(|m| m.fstype == "cgroup" && names.iter().all(|n| m.has_super_option(n)));
            if let Some(m) = mount {
                out.v1.push((names, Hierarchy::of(m).dir_of(path)));
            }
        }
        out
    }

    /// The v1 directory of `controller`, when that controller is on a v1 hierarchy.
    pub fn v1(&self, controller: &str) -> Option<&PathBuf> {
        self.v1
            .iter()
            .find(|(names, _)| names.iter().any(|n| n == controller))
            .map(|(_, dir)| dir)
    }
}

/// A mounted cgroup hierarchy: where it is mounted and which of its cgroups is mounted there
/// (`/` unless a cgroup namespace or a bind mount shows a subtree).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub mount_point: PathBuf,
    pub root: PathBuf,
}

impl Hierarchy {
    fn of(m: &Mount) -> Hierarchy {
        Hierarchy {
            mount_point: m.mount_point.clone(),
            root: m.root.clone(),
        }
    }

    /// The first cgroup2 mount of a mount table.
    pub fn unified(mounts: &[Mount]) -> Option<Hierarchy> {
        mounts
            .iter()
            .find(|m| m.fstype == "cgroup2")
            .map(Hierarchy::of)
    }

    /// The directory of the cgroup at `cgroup_path` (as `/proc/PID/cgroup` prints it).
    pub fn dir_of(&self, cgroup_path: &str) -> PathBuf {
        let path = Path::new(cgroup_path);
        let relative = path.strip_prefix(&self.root).unwrap_or(path);
        let relative = relative.strip_prefix("/").unwrap_or(relative);
        self.mount_point.join(relative)
    }

    /// Depth of the cgroup directory `dir` (below this mount) in the whole hierarchy: 0 for the
    /// root cgroup.
    pub fn level_of(&self, dir: &Path) -> u64 {
        let normal = |p: &Path| {
            p.components()
                .filter(|c| matches!(c, Component::Normal(_)))
                .count()
        };
        let below_mount = dir.strip_prefix(&self.mount_point).unwrap_or(dir);
        (normal(&self.root) + normal(below_mount)) as u64
    }
}

/// The cgroup2 hierarchy of this process's mount table.
pub fn cgroup2_mount() -> io::Result<Hierarchy> {
    Hierarchy::unified(&mountinfo::read_self()?).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no cgroup2 mount in /proc/self/mountinfo",
        )
    })
}

/// The cgroup2 directory of a process (its `0::/path` entry under the cgroup2 mount:
/// `/sys/fs/cgroup/unified` on hybrid hosts, `/sys/fs/cgroup` on pure v2 ones).
pub fn cgroup2_dir_of(pid: u32) -> io::Result<PathBuf> {
    let cgroups = Cgroups::of(pid).map_err(|e| match e {
        CgroupError::Io { ref source, .. } => io::Error::new(source.kind(), e.to_string()),
    })?;
    cgroups.unified.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("process {pid} has no cgroup2 entry (or no cgroup2 is mounted)"),
        )
    })
}

/// Mount points of every mounted cgroup hierarchy, v1 and cgroup2, in mount table order.
pub fn hierarchy_mount_points(mounts: &[Mount]) -> Vec<PathBuf> {
    mounts
        .iter()
        .filter(|m| matches!(m.fstype.as_str(), "cgroup" | "cgroup2"))
        .map(|m| m.mount_point.clone())
        .collect()
}

/// Inode number of a cgroup2 directory, which is the kernel's cgroup id
/// (`bpf_get_current_cgroup_id()`). Fails for cgroup v1 directories, whose inode numbers mean
/// nothing to BPF.
pub fn cgroup_id(cgroup2_dir: &Path) -> io::Result<u64> {
    let fs_type = nix::sys::statfs::statfs(cgroup2_dir)?.filesystem_type();
    if fs_type != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not in a cgroup2 hierarchy", cgroup2_dir.display()),
        ));
    }
    Ok(fs::metadata(cgroup2_dir)?.ino())
}

/// Path of the cgroup2 directory with this id, below the cgroup2 mount point `cgroup2_mount`:
/// `open_by_handle_at(2)` with a kernfs file handle (type `FILEID_KERNFS`, 8 bytes of id),
/// then the descriptor's path. `ENOENT` or `ESTALE` when no such cgroup exists (any more).
pub fn cgroup_path_by_id(cgroup2_mount: &Path, cgroup_id: u64) -> io::Result<PathBuf> {
    const FILEID_KERNFS: i32 = 0xfe;
    /// `struct file_handle` with its 8 bytes of payload.
    #[repr(C)]
    struct KernfsHandle {
        handle_bytes: u32,
        handle_type: i32,
        id: u64,
    }
    let mount = fs::File::open(cgroup2_mount)?;
    let mut handle = KernfsHandle {
        handle_bytes: 8,
        handle_type: FILEID_KERNFS,
        id: cgroup_id,
    };
    // SAFETY: `handle` is a `struct file_handle` whose `handle_bytes` (8) is exactly the payload
    // that follows it; it lives across the call, and the kernel only reads it. `mount` is an
    // open descriptor. nix has no wrapper for open_by_handle_at.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            mount.as_raw_fd(),
            &mut handle as *mut KernfsHandle,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall succeeded, so `fd` is a new descriptor that nothing else owns.
    let dir = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
30 25 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:5 - cgroup2 cgroup2 rw
33 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
40 1 0:40 / /work rw - ext4 /dev/vda rw
";

    fn mounts(text: &str) -> Vec<Mount> {
        mountinfo::parse(text.as_bytes())
    }

    #[test]
    fn hybrid_and_pure_v2() {
        let c = Cgroups::parse(
            "4:memory:/ns/c1\n3:cpu,cpuacct:/ns/c1\n0::/ns/c1\n",
            &mounts(HYBRID),
        );
        assert_eq!(
            c.v1("memory").unwrap(),
            &PathBuf::from("/sys/fs/cgroup/memory/ns/c1")
        );
        assert_eq!(
            c.v1("cpuacct").unwrap(),
            &PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/ns/c1")
        );
        assert_eq!(c.v1("pids"), None);
        assert_eq!(
            c.unified.as_deref(),
            Some(Path::new("/sys/fs/cgroup/unified/ns/c1"))
        );
        let v2 = Cgroups::parse(
            "0::/kubepods/pod1/c2\n",
            &mounts("31 25 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"),
        );
        assert_eq!(v2.v1("memory"), None);
        assert_eq!(
            v2.unified.as_deref(),
            Some(Path::new("/sys/fs/cgroup/kubepods/pod1/c2"))
        );
        // No cgroup2 mounted: no unified directory, whatever /proc/PID/cgroup says.
        let v1 = Cgroups::parse(
            "0::/x\n4:memory:/x\n",
            &mounts("33 30 0:29 / /cg/memory rw - cgroup cgroup rw,memory\n"),
        );
        assert_eq!(v1.unified, None);
        assert_eq!(v1.v1("memory").unwrap(), Path::new("/cg/memory/x"));
    }

    #[test]
    fn mounted_subtrees_and_escaped_mount_points() {
        // A cgroup namespace (or a bind mount) shows /sub at /mnt/cg v2.
        let m = mounts("30 1 0:26 /sub /mnt/cg\\040v2 rw - cgroup2 none rw\n");
        let h = Hierarchy::unified(&m).unwrap();
        assert_eq!(h.mount_point, Path::new("/mnt/cg v2"));
        assert_eq!(h.root, Path::new("/sub"));
        assert_eq!(h.dir_of("/sub/c1"), Path::new("/mnt/cg v2/c1"));
        assert_eq!(h.level_of(Path::new("/mnt/cg v2/c1")), 2);
        assert_eq!(
            Cgroups::parse("0::/sub/c1/c2\n", &m).unified.unwrap(),
            Path::new("/mnt/cg v2/c1/c2")
        );
        assert_eq!(
            Hierarchy::unified(&mounts(HYBRID)).unwrap().root,
            Path::new("/")
        );
        assert_eq!(
            Hierarchy::unified(&mounts("1 0 8:1 / / rw - ext4 /dev/sda rw\n")),
            None
        );
    }

    #[test]
    fn hostile_membership_lines_are_skipped() {
        let c = Cgroups::parse(
            "garbage\n::\n:memory:/x\n7:memory\n4:memory:relative\n0::/real:colon\n0::/second\n",
            &mounts(HYBRID),
        );
        // The first cgroup2 entry wins; lines without a numeric id, three fields and an
        // absolute path are ignored.
        assert_eq!(
            c.unified.as_deref(),
            Some(Path::new("/sys/fs/cgroup/unified/real:colon"))
        );
        assert_eq!(c.v1("memory"), None);
    }

    #[test]
    fn hierarchy_mount_points_of_hybrid_and_v2() {
        assert_eq!(
            hierarchy_mount_points(&mounts(HYBRID)),
            vec![
                PathBuf::from("/sys/fs/cgroup/unified"),
                PathBuf::from("/sys/fs/cgroup/memory"),
                PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")
            ]
        );
    }
}
