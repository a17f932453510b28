//! The kernel check: what CRIU actually restored, compared with what the new container's OCI
//! spec grants, before any restored process runs an instruction of its own.
//!
//! A checkpoint image is a request, and crab's reading of it (`checkpoint::criu_image`) is one
//! reading of untrusted bytes; CRIU may read the same bytes otherwise (protobuf-c merges
//! repeated embedded messages). So the decision that matters is made from the kernel: at CRIU's
//! `pre-resume` stage every restored thread has its credentials, seccomp filters, rlimits,
//! namespaces, cgroups and mounts back, sits ptrace-stopped at its `rt_sigreturn`, and has run
//! nothing of its own (CRIU's own restorer code only). The gate ([`super::gate`]) holds CRIU
//! there, the shim reads every thread of the restored tree from `/proc` ([`observe`]) and
//! compares ([`judge`]); on an excess the shim kills the tree while it is still stopped (a
//! SIGKILL wakes a traced task only to end it) and the restore fails naming the field.
//!
//! Compared, for every thread of every restored process:
//! - uids, gids and supplementary groups (mapped through the task's own user namespace), the
//!   five capability sets, no_new_privs and the seccomp mode: the rules of
//!   [`super::privilege`], which says what a spec grants;
//! - hard rlimits: within `process.rlimits`, or for a resource the spec does not list, within
//!   the shim's own (what runc's init would inherit), unless CAP_SYS_RESOURCE is in reach;
//! - namespaces: the restored init is in a new namespace of every type the spec creates, in
//!   the named one for every type it joins, in the shim's own for every type it lists not;
//!   every other task in init's (unless CAP_SYS_ADMIN is in reach: it could unshare);
//! - seccomp: runc's filter program for the spec's profile among the thread's filters, byte for
//!   byte (read with a BPF task iterator and learnt from runc itself: [`super::seccomp`]);
//! - securebits: no `SECBIT_NO_SETUID_FIXUP` (keeping capabilities across a switch away from
//!   uid 0) unless CAP_SETPCAP is in reach (the process could set it itself), no unknown bit;
//! - the LSM label (where the host has AppArmor or SELinux): the spec's `apparmorProfile` or
//!   `selinuxLabel`, or the shim's own where the spec sets none;
//! - user-namespace maps: exactly `linux.uidMappings` / `gidMappings` when the spec creates a
//!   user namespace;
//! - cgroups: every task in the container's cgroup (the one runc put CRIU in) or below it, in
//!   every hierarchy;
//! - the mount table (unless CAP_SYS_ADMIN is in reach outside a user namespace: such a
//!   process could remount anything itself): no mount point the spec does not produce, read-only
//!   where the spec says so (the root, `ro` mounts, `readonlyPaths`), masked paths masked,
//!   procfs and sysfs only where the spec mounts them.
//!
//! Not compared (docs/security.md says so): the filter of a profile that hands
//! syscalls to a listener (`SCMP_ACT_NOTIFY`: only that a filter is installed), the cgroup
//! namespace, and which host directory a bind mount shows.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Component, Path, PathBuf},
    time::{Duration, Instant},
};

use oci_spec::runtime::{LinuxNamespaceType, Spec};

use super::privilege::{self, Granted};
use super::seccomp::{self, Reference, ThreadSecurity};
use crate::{
    checkpoint::criu_image::Creds,
    sys::mountinfo::{self, Mount},
};

/// The most threads a check reads (a container's pids limit is far below).
pub const MAX_THREADS: usize = 65_536;
/// `/proc` files are read up to this many bytes (mountinfo of a busy container included).
const PROC_FILE_MAX: u64 = 4 << 20;

const CAP_SETPCAP: u64 = 1 << 8;
const CAP_SYS_ADMIN: u64 = 1 << 21;
/// securebits (`<linux/securebits.h>`): the one that keeps capabilities across a switch away
/// from uid 0, and every defined bit.
const SECBIT_NO_SETUID_FIXUP: u32 = 1 << 2;
const SECBITS_DEFINED: u32 = 0xff;
const CAP_SYS_RESOURCE: u64 = 1 << 24;

/// The rlimit names `/proc/PID/limits` prints, in resource order (`RLIMIT_CPU` = 0 ..).
const LIMIT_NAMES: [&str; 16] = [
    "Max cpu time",
    "Max file size",
    "Max data size",
    "Max stack size",
    "Max core file size",
    "Max resident set",
    "Max processes",
    "Max open files",
    "Max locked memory",
    "Max address space",
    "Max file locks",
    "Max pending signals",
    "Max msgqueue size",
    "Max nice priority",
    "Max realtime priority",
    "Max realtime timeout",
];
const RLIMIT_SPEC_NAMES: [&str; 16] = [
    "RLIMIT_CPU",
    "RLIMIT_FSIZE",
    "RLIMIT_DATA",
    "RLIMIT_STACK",
    "RLIMIT_CORE",
    "RLIMIT_RSS",
    "RLIMIT_NPROC",
    "RLIMIT_NOFILE",
    "RLIMIT_MEMLOCK",
    "RLIMIT_AS",
    "RLIMIT_LOCKS",
    "RLIMIT_SIGPENDING",
    "RLIMIT_MSGQUEUE",
    "RLIMIT_NICE",
    "RLIMIT_RTPRIO",
    "RLIMIT_RTTIME",
];

/// The namespace types compared, with their `/proc/PID/ns` names.
const NS_TYPES: [(&str, LinuxNamespaceType); 7] = [
    ("mnt", LinuxNamespaceType::Mount),
    ("uts", LinuxNamespaceType::Uts),
    ("ipc", LinuxNamespaceType::Ipc),
    ("net", LinuxNamespaceType::Network),
    ("pid", LinuxNamespaceType::Pid),
    ("user", LinuxNamespaceType::User),
    ("time", LinuxNamespaceType::Time),
];

/// Why the restored processes may not run: the first excess found, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the restored processes have more than the container's spec grants: {0}")]
pub struct Refusal(pub String);

/// Why the kernel check ([`check_restored`]) let nothing run: what it could not read, or the
/// refusal. Either way the restored tree was killed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("the kernel check could not read the host's side: {0}")]
    Host(#[source] ReadError),
    #[error("the kernel check could not read the restored processes: {0}")]
    Restored(#[source] ReadError),
    #[error(transparent)]
    Refused(#[from] Refusal),
}

/// What the kernel check could not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// A `/proc` file or directory.
    #[error("{path}: {source}")]
    Proc {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The namespace file the spec names for a namespace it joins.
    #[error("the {name} namespace {}: {source}", path.display())]
    Namespace {
        name: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("more than {MAX_THREADS} threads")]
    TooManyThreads,
    #[error("a child pid {0:?}")]
    ChildPid(String),
    /// A `/proc` file whose text is not as the kernel writes it.
    #[error("{path}: {source}")]
    Malformed {
        path: String,
        #[source]
        source: ProcTextError,
    },
    #[error(transparent)]
    IdMap(#[from] ProcTextError),
    #[error("seccomp filters and securebits: {0}")]
    Seccomp(#[source] seccomp::IteratorError),
}

/// What is wrong with the text of a `/proc` file ([`parse_status`], [`parse_limits`],
/// [`parse_id_map`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProcTextError {
    #[error("an id map line {0:?}")]
    IdMapLine(String),
    /// A field of `status` missing.
    #[error("no {0}")]
    NoField(&'static str),
    #[error("{field} {word:?}")]
    Id { field: &'static str, word: String },
    #[error("{0}: not four ids")]
    NotFourIds(&'static str),
    #[error("{field}: host id {host} is not mapped in its namespace")]
    Unmapped { field: &'static str, host: u32 },
    #[error("{0} is not hexadecimal")]
    NotHex(&'static str),
    #[error("Seccomp is not a number")]
    SeccompMode,
    #[error("Groups {0:?}")]
    Group(String),
    #[error("Groups: host gid {0} is not mapped")]
    GroupUnmapped(u32),
    /// A resource's line missing from `limits`.
    #[error("no {0:?}")]
    NoLimit(&'static str),
    #[error("{name}: {word:?}")]
    Limit { name: &'static str, word: String },
    #[error("{0}: a missing value")]
    LimitMissing(&'static str),
}

/// What the kernel check needs to know about the spec.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    pub granted: Granted,
    /// Hard-limit ceilings the spec sets, by resource.
    spec_rlimits: BTreeMap<usize, u64>,
    /// Per namespace type: `None` not listed, `Some(None)` created, `Some(Some(path))` joined.
    namespaces: BTreeMap<&'static str, Option<PathBuf>>,
    uid_map: Vec<(u32, u32, u32)>,
    gid_map: Vec<(u32, u32, u32)>,
    mounts: MountRules,
    /// What each thread's seccomp filters must include (set by the caller: learning it may
    /// run runc, [`seccomp::reference`]).
    pub seccomp: Reference,
    /// `process.apparmorProfile` and `process.selinuxLabel`.
    apparmor: Option<String>,
    selinux: Option<String>,
}

/// What the spec makes of the mount table (as runc mounts it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountRules {
    pub root_readonly: bool,
    /// Each spec mount: destination, type, read-only, recursive bind.
    pub mounts: Vec<(PathBuf, String, bool, bool)>,
    pub masked: Vec<PathBuf>,
    pub readonly: Vec<PathBuf>,
    /// Device nodes runc may bind-mount under `/dev`.
    pub devices: Vec<PathBuf>,
}

/// `path` with `.` and repeated or trailing slashes gone (a spec path, trusted, made comparable
/// with the kernel's mount points).
fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

impl Expected {
    pub fn from_spec(spec: &Spec) -> Expected {
        let mut e = Expected {
            granted: Granted::from_spec(spec),
            ..Default::default()
        };
        if let Some(p) = spec.process() {
            e.apparmor = p.apparmor_profile().clone().filter(|s| !s.is_empty());
            e.selinux = p.selinux_label().clone().filter(|s| !s.is_empty());
            for r in p.rlimits().iter().flatten() {
                let name = serde_json::to_value(r.typ())
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string));
                if let Some(i) = name.and_then(|n| RLIMIT_SPEC_NAMES.iter().position(|x| *x == n)) {
                    e.spec_rlimits.insert(i, r.hard());
                }
            }
        }
        let mut rules = MountRules {
            root_readonly: spec
                .root()
                .as_ref()
                .and_then(|r| r.readonly())
                .unwrap_or(false),
            devices: [
                "null", "zero", "full", "random", "urandom", "tty", "console",
            ]
            .iter()
            .map(|d| Path::new("/dev").join(d))
            .collect(),
            ..Default::default()
        };
        for m in spec.mounts().iter().flatten() {
            let options = m.options().clone().unwrap_or_default();
            let typ = m.typ().clone().unwrap_or_default();
            rules.mounts.push((
                clean(m.destination()),
                typ,
                options.iter().any(|o| o == "ro"),
                options.iter().any(|o| o == "rbind"),
            ));
        }
        if let Some(linux) = spec.linux() {
            rules.masked = linux
                .masked_paths()
                .iter()
                .flatten()
                .map(|p| clean(Path::new(p)))
                .collect();
            rules.readonly = linux
                .readonly_paths()
                .iter()
                .flatten()
                .map(|p| clean(Path::new(p)))
                .collect();
            rules
                .devices
                .extend(linux.devices().iter().flatten().map(|d| clean(d.path())));
            for (name, typ) in NS_TYPES {
                if let Some(n) = linux.namespaces().iter().flatten().find(|n| n.typ() == typ) {
                    e.namespaces.insert(name, n.path().clone());
                }
            }
            let map = |m: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>| {
                let mut v: Vec<_> = m
                    .iter()
                    .flatten()
                    .map(|m| (m.container_id(), m.host_id(), m.size()))
                    .collect();
                v.sort_unstable();
                v
            };
            e.uid_map = map(linux.uid_mappings());
            e.gid_map = map(linux.gid_mappings());
        }
        e.mounts = rules;
        e
    }

    fn creates_user_namespace(&self) -> bool {
        matches!(self.namespaces.get("user"), Some(None))
    }

    /// CAP_SYS_ADMIN in reach, outside a user namespace: such a process could mount, remount
    /// and unshare anything itself.
    fn host_admin(&self) -> bool {
        self.granted.permitted_ceiling() & CAP_SYS_ADMIN != 0
            && !self.namespaces.contains_key("user")
    }
}

/// What the host (the shim) contributes to the comparison: its own namespaces and limits, the
/// container's cgroups, and which masked paths exist.
#[derive(Debug, Clone, Default)]
pub struct Host {
    /// The shim's own namespaces by type: (device, inode).
    pub namespaces: BTreeMap<&'static str, (u64, u64)>,
    /// The namespaces the spec joins, by type: (device, inode) of the named file.
    pub joined: BTreeMap<&'static str, (u64, u64)>,
    /// The shim's own hard limits by resource (what runc's init inherits).
    pub hard_limits: [u64; 16],
    /// `/proc/PID/cgroup` of a process runc put in the container's cgroup (CRIU's script).
    pub cgroups: String,
    /// The spec's masked and read-only paths that exist on this host (`/proc` and `/sys` show
    /// the same entries in a container; paths elsewhere are not known and not required).
    pub existing: Vec<PathBuf>,
    /// The shim's own LSM label (`None`: no LSM gives labels here), and which LSMs are on.
    pub lsm_label: Option<String>,
    pub apparmor: bool,
    pub selinux: bool,
}

impl Host {
    /// Reads the host's side; `reference` is a process in the container's cgroup.
    pub fn read(expected: &Expected, reference: u32) -> Result<Host, ReadError> {
        let mut h = Host::default();
        for (name, _) in NS_TYPES {
            if let Ok(m) = fs::metadata(format!("/proc/self/ns/{name}")) {
                h.namespaces.insert(name, (m.dev(), m.ino()));
            }
            if let Some(Some(path)) = expected.namespaces.get(name) {
                let m = fs::metadata(path).map_err(|source| ReadError::Namespace {
                    name,
                    path: path.clone(),
                    source,
                })?;
                h.joined.insert(name, (m.dev(), m.ino()));
            }
        }
        for (i, slot) in h.hard_limits.iter_mut().enumerate() {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit(2) of this process into a local struct.
            let rc = unsafe { libc::getrlimit(i as libc::__rlimit_resource_t, &mut r) };
            *slot = if rc == 0 { r.rlim_max } else { u64::MAX };
        }
        h.cgroups = read_proc(&format!("/proc/{reference}/cgroup"))?;
        h.lsm_label = lsm_label("self");
        h.apparmor = fs::read_to_string("/sys/module/apparmor/parameters/enabled")
            .is_ok_and(|v| v.trim() == "Y");
        h.selinux = Path::new("/sys/fs/selinux/enforce").exists();
        let m = &expected.mounts;
        h.existing = m
            .masked
            .iter()
            .chain(&m.readonly)
            .filter(|p| p.starts_with("/proc") || p.starts_with("/sys"))
            .filter(|p| fs::symlink_metadata(p).is_ok())
            .cloned()
            .collect();
        Ok(h)
    }
}

/// One restored thread as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadState {
    pub pid: u32,
    pub tid: u32,
    pub comm: String,
    /// Ids already mapped into the task's user namespace.
    pub creds: Creds,
    pub seccomp_filters: Option<u32>,
    /// Dead (`Z` or `X`): it never runs again.
    pub zombie: bool,
}

/// One restored process as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    pub pid: u32,
    pub threads: Vec<ThreadState>,
    /// (soft, hard) by resource.
    pub limits: Vec<(u64, u64)>,
    /// Namespaces by type: (device, inode).
    pub namespaces: BTreeMap<&'static str, (u64, u64)>,
    pub cgroups: String,
    /// `/proc/PID/attr/current` (`None`: no LSM gives labels).
    pub lsm_label: Option<String>,
}

impl ProcessState {
    /// Every thread dead: it never runs again, and CRIU restores nothing but its exit for it
    /// (it keeps CRIU's credentials, limits and cgroups).
    pub fn is_zombie(&self) -> bool {
        !self.threads.is_empty() && self.threads.iter().all(|t| t.zombie)
    }
}

/// Everything read from the kernel about one restored tree.
#[derive(Debug, Clone)]
pub struct Observed {
    /// Init first.
    pub processes: Vec<ProcessState>,
    pub uid_map: Vec<(u32, u32, u32)>,
    pub gid_map: Vec<(u32, u32, u32)>,
    pub mounts: Vec<Mount>,
    /// By tid: what the task iterator read ([`seccomp::read`]); filled by [`check_restored`].
    pub security: BTreeMap<u32, ThreadSecurity>,
}

fn read_proc(path: &str) -> Result<String, ReadError> {
    use std::io::Read;
    let mut text = String::new();
    fs::File::open(path)
        .and_then(|f| f.take(PROC_FILE_MAX).read_to_string(&mut text))
        .map_err(proc_err(path))?;
    Ok(text)
}

fn proc_err(path: &str) -> impl FnOnce(std::io::Error) -> ReadError + '_ {
    move |source| ReadError::Proc {
        path: path.to_string(),
        source,
    }
}

fn malformed(path: String) -> impl FnOnce(ProcTextError) -> ReadError {
    move |source| ReadError::Malformed { path, source }
}

/// Reads the restored tree under `init` (a host pid) from `/proc`: its processes through
/// `/proc/PID/task/TID/children`, every thread's credentials, limits, namespaces, cgroups,
/// init's id maps and mount table. The tree is stopped (CRIU holds it at pre-resume).
pub fn observe(init: u32) -> Result<Observed, ReadError> {
    let mut processes = Vec::new();
    let mut queue = vec![init];
    let mut threads_seen = 0usize;
    let uid_map = parse_id_map(&read_proc(&format!("/proc/{init}/uid_map"))?)?;
    let gid_map = parse_id_map(&read_proc(&format!("/proc/{init}/gid_map"))?)?;
    while let Some(pid) = queue.pop() {
        let mut threads = Vec::new();
        let task_dir = format!("/proc/{pid}/task");
        let tids = fs::read_dir(&task_dir).map_err(proc_err(&task_dir))?;
        for entry in tids {
            let entry = entry.map_err(proc_err(&task_dir))?;
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            threads_seen += 1;
            if threads_seen > MAX_THREADS {
                return Err(ReadError::TooManyThreads);
            }
            let status = read_proc(&format!("/proc/{pid}/task/{tid}/status"))?;
            let (uid_map, gid_map) = match pid == init {
                true => (uid_map.clone(), gid_map.clone()),
                false => (
                    parse_id_map(&read_proc(&format!("/proc/{pid}/uid_map"))?)?,
                    parse_id_map(&read_proc(&format!("/proc/{pid}/gid_map"))?)?,
                ),
            };
            let (comm, creds, filters) = parse_status(&status, &uid_map, &gid_map)
                .map_err(malformed(format!("/proc/{pid}/task/{tid}/status")))?;
            let state = status
                .lines()
                .find_map(|l| l.strip_prefix("State:"))
                .map(str::trim_start)
                .unwrap_or("");
            threads.push(ThreadState {
                pid,
                tid,
                comm,
                creds,
                seccomp_filters: filters,
                zombie: state.starts_with('Z') || state.starts_with('X'),
            });
            let children = read_proc(&format!("/proc/{pid}/task/{tid}/children"))?;
            for c in children.split_whitespace() {
                queue.push(c.parse().map_err(|_| ReadError::ChildPid(c.to_string()))?);
            }
        }
        threads.sort_by_key(|t| t.tid);
        let mut namespaces = BTreeMap::new();
        for (name, _) in NS_TYPES {
            if let Ok(m) = fs::metadata(format!("/proc/{pid}/ns/{name}")) {
                namespaces.insert(name, (m.dev(), m.ino()));
            }
        }
        processes.push(ProcessState {
            pid,
            threads,
            limits: parse_limits(&read_proc(&format!("/proc/{pid}/limits"))?)
                .map_err(malformed(format!("/proc/{pid}/limits")))?,
            namespaces,
            cgroups: read_proc(&format!("/proc/{pid}/cgroup"))?,
            lsm_label: lsm_label(&pid.to_string()),
        });
    }
    let mounts = mountinfo::parse(read_proc(&format!("/proc/{init}/mountinfo"))?.as_bytes());
    Ok(Observed {
        processes,
        uid_map,
        gid_map,
        mounts,
        security: BTreeMap::new(),
    })
}

/// `/proc/<who>/attr/current` without its trailing NUL and newline; `None` where no LSM
/// gives labels (the kernel answers EINVAL).
fn lsm_label(who: &str) -> Option<String> {
    let text = read_proc(&format!("/proc/{who}/attr/current")).ok()?;
    Some(text.trim_end_matches(['\0', '\n']).to_string())
}

/// Whether `label` is what the spec asks for (module doc).
fn lsm_allowed(label: &str, e: &Expected, h: &Host) -> bool {
    let apparmor = e
        .apparmor
        .as_deref()
        .is_some_and(|p| label == p || label.strip_prefix(p).is_some_and(|r| r.starts_with(" (")));
    let selinux = e.selinux.as_deref() == Some(label);
    // Where the spec names no label this host's LSMs apply, runc leaves the runtime's own.
    let own = (e.apparmor.is_none() || !h.apparmor)
        && (e.selinux.is_none() || !h.selinux)
        && h.lsm_label.as_deref() == Some(label);
    apparmor || selinux || own
}

/// `/proc/PID/uid_map` (or `gid_map`): (inside, outside as the reader sees it, count).
pub fn parse_id_map(text: &str) -> Result<Vec<(u32, u32, u32)>, ProcTextError> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let bad = || ProcTextError::IdMapLine(line.to_string());
        let n: Vec<u32> = line
            .split_whitespace()
            .map(|w| w.parse::<u32>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        match n[..] {
            [inside, outside, count] => out.push((inside, outside, count)),
            _ => return Err(bad()),
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// A host id as the task's user namespace sees it.
fn to_inside(map: &[(u32, u32, u32)], host: u32) -> Option<u32> {
    map.iter().find_map(|&(inside, outside, count)| {
        let offset = host.checked_sub(outside)?;
        (offset < count)
            .then(|| inside.checked_add(offset))
            .flatten()
    })
}

/// `/proc/PID/task/TID/status`: comm, credentials (ids mapped inside), and the number of
/// seccomp filters where the kernel tells it.
pub fn parse_status(
    text: &str,
    uid_map: &[(u32, u32, u32)],
    gid_map: &[(u32, u32, u32)],
) -> Result<(String, Creds, Option<u32>), ProcTextError> {
    let mut fields: BTreeMap<&str, &str> = BTreeMap::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(':') {
            // The first of each key: the kernel prints each once.
            fields.entry(k).or_insert(v.trim());
        }
    }
    let get = |k: &'static str| fields.get(k).copied().ok_or(ProcTextError::NoField(k));
    let ids = |k: &'static str, map: &[(u32, u32, u32)]| -> Result<[u32; 4], ProcTextError> {
        let v: Vec<u32> = get(k)?
            .split_whitespace()
            .map(|w| {
                w.parse::<u32>().map_err(|_| ProcTextError::Id {
                    field: k,
                    word: w.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        let v: [u32; 4] = v.try_into().map_err(|_| ProcTextError::NotFourIds(k))?;
        let mut out = [0; 4];
        for (o, host) in out.iter_mut().zip(v) {
            *o = to_inside(map, host).ok_or(ProcTextError::Unmapped { field: k, host })?;
        }
        Ok(out)
    };
    let cap = |k: &'static str| -> Result<u64, ProcTextError> {
        u64::from_str_radix(get(k)?, 16).map_err(|_| ProcTextError::NotHex(k))
    };
    let mut creds = Creds {
        uids: ids("Uid", uid_map)?,
        gids: ids("Gid", gid_map)?,
        cap_inh: cap("CapInh")?,
        cap_prm: cap("CapPrm")?,
        cap_eff: cap("CapEff")?,
        cap_bnd: cap("CapBnd")?,
        cap_amb: cap("CapAmb")?,
        no_new_privs: get("NoNewPrivs")? != "0",
        seccomp_mode: get("Seccomp")?
            .parse()
            .map_err(|_| ProcTextError::SeccompMode)?,
        ..Default::default()
    };
    for g in get("Groups")?.split_whitespace() {
        let host: u32 = g.parse().map_err(|_| ProcTextError::Group(g.to_string()))?;
        creds
            .groups
            .push(to_inside(gid_map, host).ok_or(ProcTextError::GroupUnmapped(host))?);
    }
    let filters = fields.get("Seccomp_filters").and_then(|v| v.parse().ok());
    Ok((get("Name")?.to_string(), creds, filters))
}

/// `/proc/PID/limits`: (soft, hard) by resource, `unlimited` as `u64::MAX`.
pub fn parse_limits(text: &str) -> Result<Vec<(u64, u64)>, ProcTextError> {
    let mut out = Vec::with_capacity(LIMIT_NAMES.len());
    for name in LIMIT_NAMES {
        let line = text
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with("  "))
            .ok_or(ProcTextError::NoLimit(name))?;
        let mut words = line[name.len()..].split_whitespace();
        let mut value = || -> Result<u64, ProcTextError> {
            match words.next() {
                Some("unlimited") => Ok(u64::MAX),
                Some(w) => w.parse().map_err(|_| ProcTextError::Limit {
                    name,
                    word: w.to_string(),
                }),
                None => Err(ProcTextError::LimitMissing(name)),
            }
        };
        out.push((value()?, value()?));
    }
    Ok(out)
}

/// What a passed check saw, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passed {
    pub processes: usize,
    pub threads: usize,
    pub mounts: usize,
    /// Threads in which runc's seccomp program was found (0 where none was asked for).
    pub seccomp_matched: usize,
    pub took: Duration,
}

/// Compares what the kernel holds with what the spec grants: the first excess is the refusal.
pub fn judge(o: &Observed, e: &Expected, h: &Host) -> Result<Passed, Refusal> {
    let started = Instant::now();
    let refuse = |s: String| Refusal(s);
    let init = o
        .processes
        .first()
        .ok_or_else(|| refuse("no restored process".into()))?;
    check_threads(o, e)?;
    check_labels(o, e, h)?;
    check_limits(o, e, h)?;
    check_namespaces(o, init, e, h)?;
    check_user_maps(o, e)?;
    check_cgroups(o, h)?;
    // The mount table.
    if !e.host_admin() {
        check_mounts(&o.mounts, &e.mounts, &h.existing)?;
    }
    Ok(Passed {
        processes: o.processes.len(),
        threads: o.processes.iter().map(|p| p.threads.len()).sum(),
        mounts: o.mounts.len(),
        seccomp_matched: o
            .security
            .values()
            .filter(|k| k.holds_reference == Some(true))
            .count(),
        took: started.elapsed(),
    })
}

/// Credentials, capabilities, no_new_privs, seccomp and securebits of every thread (a zombie runs
/// nothing again: CRIU recreates it with its own credentials and lets it exit).
fn check_threads(o: &Observed, e: &Expected) -> Result<(), Refusal> {
    let refuse = |s: String| Refusal(s);
    for t in o
        .processes
        .iter()
        .flat_map(|p| &p.threads)
        .filter(|t| !t.zombie)
    {
        privilege::check_creds(&t.creds, &e.granted).map_err(|what| {
            refuse(format!(
                "process {} (thread {}, {:?}) {what}",
                t.pid, t.tid, t.comm
            ))
        })?;
        if e.granted.seccomp && t.seccomp_filters == Some(0) {
            return Err(refuse(format!(
                "process {} (thread {}) has no seccomp filter, the spec requires one",
                t.pid, t.tid
            )));
        }
        let Some(k) = o.security.get(&t.tid).filter(|k| k.tgid == t.pid) else {
            return Err(refuse(format!(
                "process {} (thread {}) was not seen by the kernel's task iterator",
                t.pid, t.tid
            )));
        };
        if k.holds_reference == Some(false) {
            return Err(refuse(format!(
                "process {} (thread {}, {:?}) does not run under the seccomp filter runc installs \
                 for the spec's profile (none of its {} filters{} is that program)",
                t.pid,
                t.tid,
                t.comm,
                k.filter_count,
                match k.compared < k.filter_count {
                    true => format!(", of which the oldest {} were compared,", k.compared),
                    false => String::new(),
                }
            )));
        }
        let forbidden = k.securebits & !SECBITS_DEFINED
            | match prm_ceiling(e) & CAP_SETPCAP {
                0 => k.securebits & SECBIT_NO_SETUID_FIXUP,
                _ => 0,
            };
        if forbidden != 0 {
            return Err(refuse(format!(
                "process {} (thread {}) has securebits {:#x} ({:#x} not within the spec: \
                 SECBIT_NO_SETUID_FIXUP needs CAP_SETPCAP)",
                t.pid, t.tid, k.securebits, forbidden
            )));
        }
    }
    Ok(())
}

/// The LSM label of every live process.
fn check_labels(o: &Observed, e: &Expected, h: &Host) -> Result<(), Refusal> {
    let refuse = |s: String| Refusal(s);
    if h.lsm_label.is_some() {
        for p in o.processes.iter().filter(|p| !p.is_zombie()) {
            let label = p.lsm_label.as_deref().unwrap_or("");
            if !lsm_allowed(label, e, h) {
                return Err(refuse(format!(
                    "process {} has the LSM label {label:?}, the spec gives {}",
                    p.pid,
                    match (&e.apparmor, &e.selinux) {
                        (Some(a), _) if h.apparmor => format!("the AppArmor profile {a:?}"),
                        (_, Some(s)) if h.selinux => format!("the SELinux label {s:?}"),
                        _ => format!("none (the runtime's own is {:?})", h.lsm_label),
                    }
                )));
            }
        }
    }
    Ok(())
}

/// Hard limits, without CAP_SYS_RESOURCE.
fn check_limits(o: &Observed, e: &Expected, h: &Host) -> Result<(), Refusal> {
    let refuse = |s: String| Refusal(s);
    let prm = prm_ceiling(e);
    if prm & CAP_SYS_RESOURCE == 0 {
        for p in o.processes.iter().filter(|p| !p.is_zombie()) {
            for (i, &(_, hard)) in p.limits.iter().enumerate() {
                let ceiling = e.spec_rlimits.get(&i).copied().unwrap_or(h.hard_limits[i]);
                if hard > ceiling {
                    return Err(refuse(format!(
                        "process {} ({:?}) has a hard {} of {}, the spec grants {} \
                         (process.rlimits, or the runtime's own limit where the spec sets none) \
                         and no CAP_SYS_RESOURCE",
                        p.pid,
                        p.threads.first().map_or("", |t| t.comm.as_str()),
                        RLIMIT_SPEC_NAMES[i],
                        show_limit(hard),
                        show_limit(ceiling)
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The namespaces of the init and, without CAP_SYS_ADMIN, of every other process.
fn check_namespaces(
    o: &Observed,
    init: &ProcessState,
    e: &Expected,
    h: &Host,
) -> Result<(), Refusal> {
    let refuse = |s: String| Refusal(s);
    for (name, _) in NS_TYPES {
        let Some(&have) = init.namespaces.get(name) else {
            continue;
        };
        let own = h.namespaces.get(name).copied();
        match e.namespaces.get(name) {
            Some(None) if Some(have) == own => {
                return Err(refuse(format!(
                "the restored init is in the host's {name} namespace, the spec creates a new one"
            )))
            }
            Some(Some(path)) if h.joined.get(name) != Some(&have) => {
                return Err(refuse(format!(
                    "the restored init is not in the {name} namespace the spec joins ({})",
                    path.display()
                )))
            }
            // CRIU gives a restored tree a time namespace of its own (so that its monotonic
            // and boot clocks go on from where they were dumped): offsets of two clocks, no
            // privilege.
            None if name == "time" => {}
            None if own.is_some_and(|own| own != have) => {
                return Err(refuse(format!(
                    "the restored init is in a {name} namespace of its own, the spec creates none"
                )))
            }
            _ => {}
        }
    }
    if prm_ceiling(e) & CAP_SYS_ADMIN == 0 {
        for p in &o.processes[1..] {
            if let Some(name) = p
                .namespaces
                .iter()
                .find(|(name, ns)| init.namespaces.get(*name) != Some(ns))
                .map(|(name, _)| name)
            {
                return Err(refuse(format!(
                    "process {} is in another {name} namespace than the container's init, and \
                     the spec grants no CAP_SYS_ADMIN",
                    p.pid
                )));
            }
        }
    }
    Ok(())
}

/// The maps of a user namespace the spec creates.
fn check_user_maps(o: &Observed, e: &Expected) -> Result<(), Refusal> {
    let refuse = |s: String| Refusal(s);
    if e.creates_user_namespace() {
        if o.uid_map != e.uid_map {
            return Err(refuse(format!(
                "the user namespace maps uids {:?}, the spec maps {:?}",
                o.uid_map, e.uid_map
            )));
        }
        if o.gid_map != e.gid_map {
            return Err(refuse(format!(
                "the user namespace maps gids {:?}, the spec maps {:?}",
                o.gid_map, e.gid_map
            )));
        }
    }
    Ok(())
}

/// Every live process within the container's cgroups.
fn check_cgroups(o: &Observed, h: &Host) -> Result<(), Refusal> {
    let refuse = |s: String| Refusal(s);
    let reference = cgroup_lines(&h.cgroups);
    for p in o.processes.iter().filter(|p| !p.is_zombie()) {
        for (id, path) in cgroup_lines(&p.cgroups) {
            let Some((_, want)) = reference.iter().find(|(i, _)| *i == id) else {
                continue;
            };
            let within = path == *want
                || want == "/"
                || path.strip_prefix(want).is_some_and(|r| r.starts_with('/'));
            if !within {
                return Err(refuse(format!(
                    "process {} is in cgroup {path:?} (hierarchy {id}), outside the container's \
                     {want:?}",
                    p.pid
                )));
            }
        }
    }
    Ok(())
}

fn prm_ceiling(e: &Expected) -> u64 {
    e.granted.permitted_ceiling()
}

/// The whole check of a restored tree held at pre-resume: the host's side read through
/// `script` (CRIU's action script, in the container's cgroup), the tree under `init` observed
/// and judged. On a refusal, or when the tree cannot be read, every restored process found is
/// SIGKILLed before this returns (they are ptrace-stopped: the signal ends them before any of
/// their own instructions runs).
pub fn check_restored(expected: &Expected, script: u32, init: u32) -> Result<Passed, CheckError> {
    let started = Instant::now();
    let kill = |pids: &[u32]| {
        for &pid in pids {
            // SAFETY: kill(2) of a pid of the tree CRIU restored and holds stopped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    };
    let host = match Host::read(expected, script) {
        Ok(h) => h,
        Err(e) => {
            kill(&[init]);
            kill_criu(script);
            return Err(CheckError::Host(e));
        }
    };
    let observed = observe(init).and_then(|mut o| {
        let pids: Vec<u32> = o.processes.iter().map(|p| p.pid).collect();
        o.security =
            seccomp::read(&pids, expected.seccomp.program()).map_err(ReadError::Seccomp)?;
        Ok(o)
    });
    let observed = match observed {
        Ok(o) => o,
        Err(e) => {
            kill(&[init]);
            kill_criu(script);
            return Err(CheckError::Restored(e));
        }
    };
    match judge(&observed, expected, &host) {
        Ok(mut passed) => {
            passed.took = started.elapsed();
            Ok(passed)
        }
        Err(refusal) => {
            let pids: Vec<u32> = observed.processes.iter().map(|p| p.pid).collect();
            kill(&pids);
            kill_criu(script);
            Err(refusal.into())
        }
    }
}

/// Ends CRIU (the parent of its action script `script`) once the restored tree is killed: a
/// failing pre-resume script is only logged, and CRIU, finding its tasks gone, waits for the
/// killed init without `__WALL` forever when init had threads (their zombies are the tracer's
/// to reap). With CRIU gone runc fails the restore at once. The tree's SIGKILL is queued
/// first, so no restored task returns to its own code when its tracer goes.
fn kill_criu(script: u32) {
    let ppid = fs::read_to_string(format!("/proc/{script}/stat"))
        .ok()
        .and_then(|s| {
            // `pid (comm) state ppid ...`: comm may hold anything but ends at the last ')'.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().nth(1)?.parse::<i32>().ok()
        });
    if let Some(ppid) = ppid.filter(|p| *p > 1) {
        // SAFETY: kill(2) of the CRIU process that runs the gate's script.
        unsafe { libc::kill(ppid, libc::SIGKILL) };
    }
}

fn show_limit(v: u64) -> String {
    match v {
        u64::MAX => "unlimited".into(),
        v => v.to_string(),
    }
}

/// `/proc/PID/cgroup`: (hierarchy id and controllers, path).
fn cgroup_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let (id, rest) = l.split_once(':')?;
            let (controllers, path) = rest.split_once(':')?;
            Some((format!("{id}:{controllers}"), path.to_string()))
        })
        .collect()
}

/// The mount table of the restored init against the spec's mounts (see the module doc).
/// `existing`: the masked and read-only paths that exist on this host.
pub fn check_mounts(
    mounts: &[Mount],
    rules: &MountRules,
    existing: &[PathBuf],
) -> Result<(), Refusal> {
    let is_ro = |m: &Mount| m.options.split(',').any(|o| o == "ro");
    fn spec_at<'a>(
        rules: &'a MountRules,
        p: &'a Path,
    ) -> impl Iterator<Item = &'a (PathBuf, String, bool, bool)> {
        rules.mounts.iter().filter(move |(d, ..)| d == p)
    }
    let spec_at = |p| spec_at(rules, p);
    for m in mounts {
        let p = m.mount_point.as_path();
        let at_spec = spec_at(p).next().is_some();
        let below_spec = rules.mounts.iter().any(|(d, typ, _, rbind)| {
            (typ == "cgroup" || typ == "cgroup2" || *rbind) && p.starts_with(d) && p != d
        });
        let is_device = p.parent() == Some(Path::new("/dev"))
            && rules.devices.iter().any(|d| d == p)
            || rules.devices.iter().any(|d| d == p);
        let expected = p == Path::new("/")
            || at_spec
            || below_spec
            || is_device
            || rules.masked.iter().any(|x| x == p)
            || rules.readonly.iter().any(|x| x == p);
        if !expected {
            return Err(Refusal(format!(
                "a {} mount at {} that the spec does not make",
                m.fstype,
                p.display()
            )));
        }
        // Read-only where the spec says so.
        let ro_wanted = (p == Path::new("/") && rules.root_readonly)
            || spec_at(p).any(|(_, _, ro, _)| *ro)
            || rules.readonly.iter().any(|x| x == p)
            || rules.mounts.iter().any(|(d, typ, ro, _)| {
                *ro && (typ == "cgroup" || typ == "cgroup2") && p.starts_with(d)
            });
        // A tmpfs holds nothing of the host or the kernel: writable, it exposes nothing (on
        // cgroup v1 runc mounts one at the cgroup destination, and CRIU restores it writable
        // whatever the spec's `ro`; the hierarchies bound below it are checked).
        if ro_wanted && !is_ro(m) && m.fstype != "tmpfs" {
            return Err(Refusal(format!(
                "{} is mounted read-write ({} {}), the spec mounts it read-only",
                p.display(),
                m.fstype,
                m.options
            )));
        }
        // procfs and sysfs (the kernel's knobs) only where the spec puts them, or bound
        // read-only onto its read-only and masked paths.
        if m.fstype == "proc" || m.fstype == "sysfs" {
            let typed = spec_at(p).any(|(_, typ, ..)| *typ == m.fstype);
            let onto_path = rules.readonly.iter().chain(&rules.masked).any(|x| x == p);
            if !typed && !onto_path {
                return Err(Refusal(format!(
                    "a {} mount at {} where the spec mounts none",
                    m.fstype,
                    p.display()
                )));
            }
        }
    }
    fn at<'a>(mounts: &'a [Mount], p: &'a Path) -> impl Iterator<Item = &'a Mount> {
        mounts.iter().filter(move |m| m.mount_point == p)
    }
    let at = |p| at(mounts, p);
    for p in &rules.masked {
        if !existing.contains(p) {
            continue;
        }
        let masked = at(p).next().is_some()
            && at(p).all(|m| {
                (m.fstype == "tmpfs" && is_ro(m)) || m.root.file_name().is_some_and(|n| n == "null")
            });
        if !masked {
            return Err(Refusal(format!(
                "{} is not masked, the spec masks it",
                p.display()
            )));
        }
    }
    for p in &rules.readonly {
        if existing.contains(p) && at(p).next().is_none() {
            return Err(Refusal(format!(
                "{} is not mounted read-only, the spec makes it read-only",
                p.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
