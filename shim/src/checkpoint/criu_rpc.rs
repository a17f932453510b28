//! Process dumps through CRIU's RPC interface (`criu swrk`), without `runc checkpoint`.
//!
//! `runc checkpoint` is a Go program that loads the container's state, starts CRIU once to
//! learn its version, then again to dump. Each start costs the process start-up and CRIU's
//! probing of the kernel (`kerndat`, which CRIU caches only where `/run` is a tmpfs), before
//! any page is touched. This module does what runc's `Checkpoint` does (runc's
//! `libcontainer/criu_linux.go`, with the options crab passes) in the shim: it reads the
//! container's configuration from runc's own state file, writes `descriptors.json` into the
//! image exactly as runc does (so that `runc restore` of the image works unchanged), starts
//! one `criu swrk` and speaks CRIU's protobuf RPC to it (`criu/rpc.proto`; the few messages
//! needed are encoded and decoded here by hand, like the rest of crab's protobuf).
//!
//! Bounds: CRIU's own `timeout` limits how long it may take to freeze the tree; the whole run
//! is bounded by the checkpoint job's deadline, which kills the CRIU this module registered
//! for the container ([`kill_running`]) before the container's freezer is thawed. A CRIU
//! whose caller went away (the job's future was dropped) is killed by its guard. CRIU is held
//! by a pidfd, so a kill never reaches a reused pid.

use std::{
    collections::HashMap,
    fs,
    io::{self, Write},
    os::{
        fd::{AsFd, AsRawFd, OwnedFd},
        unix::{fs::DirBuilderExt, process::CommandExt},
    },
    path::{Component, Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex, OnceLock},
};

use nix::{
    fcntl::{OFlag, OpenHow, ResolveFlag},
    sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockType},
};
use serde::Deserialize;

use super::criu_proto::{DecodeError, Fields, Value};
use crate::reaper::{ExitSubscription, ReaperError};
use crate::sys::pidfd::PidFd;

/// How long CRIU may take to freeze the container's processes (CRIU's `--timeout`, seconds).
const FREEZE_TIMEOUT_S: u64 = 10;
/// CRIU's answers are small; runc reads them into 40 KiB.
const RESP_BUF: usize = 10 * 4096;
/// runc's state file is a few KB; a larger one is not runc's.
const MAX_STATE_FILE: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("reading runc's state of the container ({path}): {source}")]
    State {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("runc's state of the container ({path}) is not what runc writes: {source}")]
    BadState {
        path: PathBuf,
        #[source]
        source: StateError,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("starting CRIU: {0}")]
    Start(#[from] ReaperError),
    #[error("CRIU's answer is malformed: {0}")]
    Protocol(#[from] RespError),
    /// CRIU answered that the request failed.
    #[error("CRIU {request} failed{}{}", errno.map(|e| format!(": {}", io::Error::from_raw_os_error(e))).unwrap_or_default(), message.as_ref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Failed {
        request: &'static str,
        errno: Option<i32>,
        message: Option<String>,
    },
    #[error("CRIU exited with status {0} after its answer")]
    Exit(i32),
    #[error("CRIU ended without answering (killed, or it crashed: see its log)")]
    NoAnswer,
}

/// What in runc's state of the container (or the dump asked of it) is not what runc writes.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("more than {max} bytes", max = MAX_STATE_FILE)]
    TooLarge,
    #[error("rootfs {} is not absolute", .0.display())]
    RelativeRootfs(PathBuf),
    #[error("no init pid")]
    NoInit,
    #[error("invalid manage-cgroups-mode {0:?}")]
    CgroupsMode(String),
    /// A namespace the container joined (by path) cannot be found.
    #[error("the container's {name} namespace {path}: {source}")]
    Namespace {
        name: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

/// What is wrong with an answer of CRIU's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    #[error("not a protobuf message: {0}")]
    NotProtobuf(#[source] DecodeError),
    #[error("a malformed notify: {0}")]
    Notify(#[source] DecodeError),
    #[error("field {0} has the wrong type")]
    WrongType(u32),
    #[error("no type or success")]
    Incomplete,
    #[error("an answer larger than {} KiB", RESP_BUF >> 10)]
    TooLarge,
    #[error("an answer of type {kind} to a {request}")]
    Unexpected { kind: u64, request: &'static str },
}

fn io_err(context: impl std::fmt::Display) -> impl FnOnce(io::Error) -> CriuError {
    let context = context.to_string();
    move |source| CriuError::Io { context, source }
}

// ---------------------------------------------------------------------------------------------
// Protobuf, the little CRIU's RPC needs.

/// A protobuf message being encoded.
#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn key(&mut self, field: u32, wire: u8) {
        self.raw_varint(u64::from(field) << 3 | u64::from(wire));
    }

    fn raw_varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn uint(&mut self, field: u32, v: u64) -> &mut Self {
        self.key(field, 0);
        self.raw_varint(v);
        self
    }

    /// An `int32`: negative values are sign-extended to ten bytes, as protobuf does.
    fn int32(&mut self, field: u32, v: i32) -> &mut Self {
        self.uint(field, i64::from(v) as u64)
    }

    fn bool(&mut self, field: u32, v: bool) -> &mut Self {
        self.uint(field, u64::from(v))
    }

    fn bytes(&mut self, field: u32, v: &[u8]) -> &mut Self {
        self.key(field, 2);
        self.raw_varint(v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }

    fn str(&mut self, field: u32, v: &str) -> &mut Self {
        self.bytes(field, v.as_bytes())
    }

    fn msg(&mut self, field: u32, m: &Enc) -> &mut Self {
        self.bytes(field, &m.0)
    }
}

/// One decoded protobuf field value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProtoValue<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of a protobuf message, in order, read by the one protobuf reader of the
/// checkpoint code ([`Fields`]).
fn fields_of(msg: &[u8]) -> Result<Vec<(u32, ProtoValue<'_>)>, DecodeError> {
    Fields::new(msg)
        .map(|f| {
            f.map(|(number, v)| {
                let v = match v {
                    Value::Varint(v) => ProtoValue::Varint(v),
                    Value::Bytes(b) => ProtoValue::Bytes(b),
                    Value::Fixed32 | Value::Fixed64 => ProtoValue::Fixed,
                };
                (number, v)
            })
        })
        .collect()
}

/// The fields of a protobuf message, in order; `None` if malformed.
pub fn proto_fields(msg: &[u8]) -> Option<Vec<(u64, ProtoValue<'_>)>> {
    let fields = fields_of(msg).ok()?;
    Some(fields.into_iter().map(|(n, v)| (u64::from(n), v)).collect())
}

/// `criu_req_type`.
const REQ_DUMP: u64 = 1;
const REQ_NOTIFY: u64 = 6;

/// What CRIU answered (`criu_resp`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resp {
    pub kind: u64,
    pub success: bool,
    /// `notify.script` of a NOTIFY.
    pub script: Option<String>,
    pub errno: Option<i32>,
    pub message: Option<String>,
}

/// Decodes a `criu_resp`: type 1, success 2, notify 5 (script 1), cr_errno 7, cr_errmsg 9.
pub fn decode_resp(data: &[u8]) -> Result<Resp, RespError> {
    let fields = fields_of(data).map_err(RespError::NotProtobuf)?;
    let mut r = Resp::default();
    let (mut has_type, mut has_success) = (false, false);
    for (field, v) in fields {
        match (field, v) {
            (1, ProtoValue::Varint(t)) => (r.kind, has_type) = (t, true),
            (2, ProtoValue::Varint(s)) => (r.success, has_success) = (s != 0, true),
            (5, ProtoValue::Bytes(n)) => {
                for (f, v) in fields_of(n).map_err(RespError::Notify)? {
                    if let (1, ProtoValue::Bytes(s)) = (f, v) {
                        r.script = Some(String::from_utf8_lossy(s).into_owned());
                    }
                }
            }
            (7, ProtoValue::Varint(e)) => r.errno = Some(e as i32),
            (9, ProtoValue::Bytes(m)) => {
                r.message = Some(String::from_utf8_lossy(m).trim().to_string())
            }
            (1 | 2 | 7, _) | (5 | 9, ProtoValue::Varint(_) | ProtoValue::Fixed) => {
                return Err(RespError::WrongType(field))
            }
            _ => {}
        }
    }
    if !(has_type && has_success) {
        return Err(RespError::Incomplete);
    }
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// The container as runc recorded it.

/// The part of runc's `state.json` a dump needs (runc's `libcontainer.State`).
#[derive(Debug, Clone, Deserialize)]
pub struct RuncState {
    pub init_process_pid: u32,
    pub config: RuncConfig,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub cgroup_paths: HashMap<String, String>,
    /// Where init's stdio pointed at create (`pipe:[...]`, `/dev/null`): runc writes them
    /// into the image as `descriptors.json`, and `runc restore` reads them back.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub external_descriptors: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RuncConfig {
    pub rootfs: PathBuf,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub mounts: Vec<RuncMount>,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub devices: Vec<RuncDevice>,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub mask_paths: Vec<String>,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub namespaces: Vec<RuncNamespace>,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub labels: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RuncMount {
    pub destination: String,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub device: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RuncDevice {
    #[serde(default, deserialize_with = "null_as_empty")]
    pub path: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RuncNamespace {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub path: String,
}

/// Go writes a nil slice, map or string as `null`: read it as empty.
fn null_as_empty<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl RuncState {
    /// Reads `<runc root>/<id>/state.json`.
    pub fn read(runc_root: &Path, id: &str) -> Result<RuncState, CriuError> {
        let path = runc_root.join(id).join("state.json");
        let data = (|| {
            let f = crate::sys::beneath::open_regular_nofollow(&path)?;
            let mut data = Vec::new();
            io::Read::read_to_end(&mut io::Read::take(f, MAX_STATE_FILE + 1), &mut data)?;
            Ok::<_, io::Error>(data)
        })()
        .map_err(|source| CriuError::State {
            path: path.clone(),
            source,
        })?;
        if data.len() as u64 > MAX_STATE_FILE {
            return Err(CriuError::BadState {
                path,
                source: StateError::TooLarge,
            });
        }
        Self::parse(&data).map_err(|source| CriuError::BadState { path, source })
    }

    pub fn parse(data: &[u8]) -> Result<RuncState, StateError> {
        let st: RuncState = serde_json::from_slice(data)?;
        if !st.config.rootfs.is_absolute() {
            return Err(StateError::RelativeRootfs(st.config.rootfs));
        }
        if st.init_process_pid == 0 {
            return Err(StateError::NoInit);
        }
        Ok(st)
    }

    /// The value of label `key` (runc keeps annotations as `key=value` labels).
    fn label(&self, key: &str) -> Option<&str> {
        self.config.labels.iter().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k == key).then_some(v)
        })
    }

    fn namespace_path(&self, kind: &str) -> Option<&str> {
        self.config
            .namespaces
            .iter()
            .find(|n| n.kind == kind)
            .map(|n| n.path.as_str())
            .filter(|p| !p.is_empty())
    }

    /// The cgroup CRIU freezes (runc's `cgroupManager.Path("freezer")`: the unified
    /// directory on cgroup v2, the freezer controller's on v1).
    fn freezer_cgroup(&self) -> Option<&str> {
        ["freezer", ""]
            .iter()
            .find_map(|k| self.cgroup_paths.get(*k))
            .map(String::as_str)
            .filter(|p| !p.is_empty())
    }
}

// ---------------------------------------------------------------------------------------------
// The dump request, as runc builds it.

/// What a dump is asked to do (the subset of `runc checkpoint`'s flags crab uses).
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub leave_running: bool,
    pub tcp_established: bool,
    pub ext_unix_sk: bool,
    pub file_locks: bool,
    pub shell_job: bool,
    /// `soft`, `full`, `strict` or `ignore`; `None` is CRIU's default (soft).
    pub manage_cgroups_mode: Option<String>,
    /// No network lock (CRIU's `--network-lock skip`), and in-flight connections of listening
    /// sockets left out of the image (`--skip-in-flight`): for a container whose network
    /// namespace holds no TCP connection ([`needs_network_lock`]). runc's default lock
    /// (iptables) costs a frozen container 50-100 ms on an nft host: unlocking deletes a chain
    /// with up to seven `iptables-restore`/`iptables` runs, each waiting for the kernel.
    pub skip_network_lock: bool,
    /// Where CRIU finds the root of every cgroup hierarchy already mounted, one directory per
    /// hierarchy ([`cgroup_yard`]); `None`: CRIU mounts each itself (~2-3 ms per hierarchy,
    /// with the container frozen: 25-30 ms on a cgroup v1 host).
    pub cgroup_yard: Option<String>,
    /// CRIU seizes every task with ptrace, not through the cgroup freezer (no
    /// `--freeze-cgroup`): the only way to dump a task in a job-control stop on a cgroup v1
    /// freezer, where `PTRACE_SEIZE` of a stopped task in a frozen cgroup waits forever (the
    /// kernel wakes it to move it to a trap stop, which a frozen task never reaches).
    pub ptrace_seize: bool,
    /// The container's network namespace is left out of the image (CRIU's `empty_ns` for
    /// the network; see [`crate::checkpoint::netns`]): no `ip`/`iptables-save` runs while
    /// it is frozen. A restore then makes a blank namespace.
    pub empty_netns: bool,
}

/// The host's cgroup mount directory.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// [`CGROUP_ROOT`], if it can serve as CRIU's cgroup yard for a process whose
/// `/proc/<pid>/cgroup` reads `cgroups`: CRIU opens `<yard>/<hierarchy>` for each hierarchy
/// (the controllers as listed, `name=` stripped, `unified` for cgroup v2), so each of those
/// must be a mount of that hierarchy's root. Otherwise (a cgroup v2 host, whose root is the
/// directory itself; other layouts) `None`.
pub fn cgroup_yard(mounts: &[crate::sys::mountinfo::Mount], cgroups: &str) -> Option<String> {
    let mut any = false;
    for line in cgroups.lines().filter(|l| !l.is_empty()) {
        let mut parts = line.splitn(3, ':');
        let (_, controllers) = (parts.next()?, parts.next()?);
        parts.next()?;
        let (dir, fstype) = match controllers {
            "" => ("unified", "cgroup2"),
            c => (c.strip_prefix("name=").unwrap_or(c), "cgroup"),
        };
        if dir.is_empty() || dir.contains('/') || dir.starts_with('.') {
            return None;
        }
        let at = Path::new(CGROUP_ROOT).join(dir);
        let mounted = mounts.iter().rev().find(|m| m.mount_point == at)?;
        let whole = mounted.fstype == fstype && mounted.root == Path::new("/");
        let same =
            fstype == "cgroup2" || controllers.split(',').all(|c| mounted.has_super_option(c));
        if !(whole && same) {
            return None;
        }
        any = true;
    }
    any.then(|| CGROUP_ROOT.to_string())
}

fn host_cgroup_yard(pid: u32, mounts: &[crate::sys::mountinfo::Mount]) -> Option<String> {
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    cgroup_yard(mounts, &cgroups)
}

/// The namespace flag CRIU's `empty_ns` takes for the network.
const CLONE_NEWNET: u64 = libc::CLONE_NEWNET as u64;

/// `criu_network_lock_method` SKIP.
const NETWORK_LOCK_SKIP: u64 = 3;

/// Whether the TCP sockets of a network namespace, by state, hold a connection whose state a
/// dump must keep consistent with its peer: any socket that is not listening, closed or in
/// TIME_WAIT (those belong to the kernel; CRIU leaves them). The network lock exists for
/// those: it drops packets while their sequence numbers and queues are read. A listening
/// socket needs no lock: a connection that arrives during the dump is left out
/// (`--skip-in-flight`), as any connection made after the checkpoint is.
pub fn needs_network_lock(states: &[u8]) -> bool {
    use crate::sys::sockdiag::{TCP_CLOSE, TCP_LISTEN, TCP_TIME_WAIT};
    states
        .iter()
        .any(|s| !matches!(*s, TCP_LISTEN | TCP_CLOSE | TCP_TIME_WAIT))
}

/// [`needs_network_lock`] for the network namespace of process `pid` (the container's init,
/// frozen), asked of the kernel ([`crate::sys::sockdiag`]); if it cannot tell, the lock is
/// kept.
pub fn netns_needs_network_lock(pid: u32) -> bool {
    use crate::sys::sockdiag::{self, ALL_TCP_STATES, TCP_CLOSE, TCP_LISTEN, TCP_TIME_WAIT};
    let wanted = ALL_TCP_STATES & !(1 << TCP_LISTEN | 1 << TCP_CLOSE | 1 << TCP_TIME_WAIT);
    let asked = sockdiag::socket_in(Path::new(&format!("/proc/{pid}/ns/net")))
        .and_then(|sock| sockdiag::tcp_states(&sock, wanted));
    match asked {
        Ok(states) => needs_network_lock(&states),
        Err(e) => {
            log::debug!("the TCP sockets of pid {pid}'s network namespace: {e}");
            true
        }
    }
}

/// `criu_cg_mode` of runc's `--manage-cgroups-mode`.
fn cg_mode(mode: Option<&str>) -> Result<u64, StateError> {
    Ok(match mode {
        None | Some("") => 6,
        Some("soft") => 3,
        Some("full") => 4,
        Some("strict") => 5,
        Some("ignore") => 0,
        Some(other) => return Err(StateError::CgroupsMode(other.to_string())),
    })
}

/// A mount destination as the container sees it, with symlinks inside the rootfs resolved
/// within it (runc's `securejoin.SecureJoin(rootfs, dest)` minus the rootfs); the destination
/// cleaned lexically when it cannot be resolved (it does not exist).
fn container_path(rootfs: &Path, dest: &str) -> String {
    let lexical = {
        let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
        for c in Path::new(dest).components() {
            match c {
                Component::Normal(n) => parts.push(n),
                Component::ParentDir => {
                    parts.pop();
                }
                _ => {}
            }
        }
        let mut s = String::new();
        for p in parts {
            s.push('/');
            s.push_str(&p.to_string_lossy());
        }
        if s.is_empty() {
            s.push('/');
        }
        s
    };
    let resolved = (|| {
        let root = crate::sys::beneath::open_root(rootfs).ok()?;
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let rel = lexical.trim_start_matches('/');
        let rel = if rel.is_empty() { "." } else { rel };
        let fd = crate::sys::file::openat2(root.as_fd(), rel, how).ok()?;
        let full = fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
        let inside = full.strip_prefix(rootfs).ok()?;
        Some(format!("/{}", inside.to_string_lossy()))
    })();
    resolved.unwrap_or(lexical)
}

/// The `criu_opts` runc's `Checkpoint` sends, for `state` and `opts`; `images_fd` and `work_fd`
/// are descriptors of the shim (CRIU opens them through `/proc/<shim>/fd`).
/// `cgroup_v1`: the host's cgroup v1 hierarchies ([`cgroup_v1_dirs`]).
fn dump_opts(
    state: &RuncState,
    opts: &DumpOptions,
    cgroup_v1: &[String],
    images_fd: i32,
    work_fd: i32,
) -> Result<Enc, StateError> {
    let mut o = Enc::default();
    o.int32(1, images_fd)
        .int32(2, state.init_process_pid as i32)
        .bool(3, opts.leave_running)
        .bool(4, opts.ext_unix_sk)
        .bool(5, opts.tcp_established)
        .bool(7, opts.shell_job)
        .bool(8, opts.file_locks)
        .int32(9, 4)
        .str(10, "dump.log")
        .bool(12, true)
        .str(13, &state.config.rootfs.to_string_lossy())
        .bool(16, false)
        .int32(17, work_fd)
        .bool(18, false)
        .bool(24, true)
        .uint(34, cg_mode(opts.manage_cgroups_mode.as_deref())?)
        .uint(38, if opts.empty_netns { CLONE_NEWNET } else { 0 })
        .uint(45, FREEZE_TIMEOUT_S)
        .bool(46, opts.skip_network_lock)
        .bool(48, false)
        .bool(50, true);
    if opts.skip_network_lock {
        o.uint(64, NETWORK_LOCK_SKIP);
    }
    if let Some(yard) = &opts.cgroup_yard {
        o.str(60, yard);
    }
    // runc's handleCriuConfigurationFile.
    match state.label("org.criu.config") {
        Some("") => {}
        Some(file) => {
            o.str(51, file);
        }
        None => {
            o.str(51, "/etc/criu/runc.conf");
        }
    }
    // Network and pid namespaces the container joined: external, as runc marks them.
    for (kind, name, key) in [
        ("NEWNET", "net", "extRootNetNS"),
        ("NEWPID", "pid", "extRootPidNS"),
    ] {
        if let Some(path) = state.namespace_path(kind) {
            let ino = fs::metadata(path)
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .map_err(|source| StateError::Namespace {
                    name,
                    path: path.to_string(),
                    source,
                })?;
            o.str(37, &format!("{name}[{ino}]:{key}"));
        }
    }
    if let Some(cg) = state.freezer_cgroup().filter(|_| !opts.ptrace_seize) {
        o.str(44, cg);
    }
    let mut ext_mnt = |key: &str, val: &str| {
        let mut m = Enc::default();
        m.str(1, key).str(2, val);
        o.msg(23, &m);
    };
    let rootfs = &state.config.rootfs;
    let cgroupns = state
        .config
        .namespaces
        .iter()
        .any(|n| n.kind == "NEWCGROUP");
    for m in &state.config.mounts {
        match m.device.as_str() {
            "bind" => {
                let dest = container_path(rootfs, &m.destination);
                ext_mnt(&dest, &dest);
            }
            // On cgroup v1 without a cgroup namespace, runc bind-mounts each hierarchy of the
            // host below the cgroup mount: external mounts, as runc's getCgroupMounts lists
            // them. On cgroup v2 or in a cgroup namespace it is a real mount.
            "cgroup" if !cgroupns => {
                for dir in cgroup_v1 {
                    let dest = container_path(rootfs, &format!("{}/{dir}", m.destination));
                    ext_mnt(&dest, &dest);
                }
            }
            _ => {}
        }
    }
    // Masked files are bind mounts of /dev/null (directories are tmpfs, CRIU's business).
    for path in &state.config.mask_paths {
        let at = format!("/proc/{}/root/{}", state.init_process_pid, path);
        match fs::metadata(&at) {
            Ok(md) if !md.is_dir() => ext_mnt(path, "/dev/null"),
            _ => {}
        }
    }
    for d in &state.config.devices {
        if !d.path.is_empty() {
            let dest = container_path(rootfs, &d.path);
            ext_mnt(&dest, &dest);
        }
    }
    Ok(o)
}

/// The cgroup v1 hierarchies of the host as runc's `getCgroupMounts` finds them (the mount
/// points of `cgroup` filesystems, by their last component, once each); empty on a cgroup v2
/// host (`/sys/fs/cgroup` itself is cgroup2).
pub fn cgroup_v1_dirs(mounts: &[crate::sys::mountinfo::Mount], unified: bool) -> Vec<String> {
    if unified {
        return Vec::new();
    }
    let mut out: Vec<String> = Vec::new();
    for m in mounts.iter().filter(|m| m.fstype == "cgroup") {
        if let Some(name) = m.mount_point.file_name() {
            let name = name.to_string_lossy().into_owned();
            if !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

fn host_cgroup_v1_dirs(mounts: &[crate::sys::mountinfo::Mount]) -> Result<Vec<String>, CriuError> {
    let unified = nix::sys::statfs::statfs("/sys/fs/cgroup")
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .map_err(|e| io_err("statfs /sys/fs/cgroup")(e.into()))?;
    Ok(cgroup_v1_dirs(mounts, unified))
}

// ---------------------------------------------------------------------------------------------
// Running CRIU.

/// The CRIU dumps running now, by container id, as (pid, pidfd).
type Registry = Mutex<HashMap<String, Vec<(u32, Arc<PidFd>)>>>;

/// The CRIU dumps running now: what [`kill_running`] kills.
fn running() -> &'static Registry {
    static RUNNING: OnceLock<Registry> = OnceLock::new();
    RUNNING.get_or_init(Default::default)
}

/// Kills the CRIU dumps running for container `id` (a job past its deadline); returns their
/// pids. The caller thaws the container afterwards: a CRIU killed midway leaves it frozen.
pub fn kill_running(id: &str) -> Vec<u32> {
    let procs = running()
        .lock()
        .unwrap()
        .get(id)
        .cloned()
        .unwrap_or_default();
    procs
        .into_iter()
        .filter(|(_, fd)| fd.kill())
        .map(|(pid, _)| pid)
        .collect()
}

/// A CRIU this module started: registered for [`kill_running`] while it runs, killed when
/// dropped before it was seen to exit.
struct Running {
    id: String,
    pid: u32,
    fd: Arc<PidFd>,
    exited: bool,
}

impl Running {
    fn new(id: &str, pid: u32, fd: PidFd) -> Running {
        let fd = Arc::new(fd);
        running()
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_default()
            .push((pid, fd.clone()));
        Running {
            id: id.to_string(),
            pid,
            fd,
            exited: false,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.exited {
            self.fd.kill();
        }
        let mut map = running().lock().unwrap();
        if let Some(list) = map.get_mut(&self.id) {
            list.retain(|(p, _)| *p != self.pid);
            if list.is_empty() {
                map.remove(&self.id);
            }
        }
    }
}

fn open_dir(path: &Path) -> Result<OwnedFd, CriuError> {
    crate::sys::file::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
    )
    .map_err(|e| io_err(format!("opening {}", path.display()))(e.into()))
}

fn make_dir(path: &Path) -> Result<(), CriuError> {
    // Parents too, as runc's `MkdirAll` of the image path.
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
    {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            Err(io_err(format!("creating {}", path.display()))(e))
        }
        _ => Ok(()),
    }
}

/// Sends `req` and reads CRIU's answers until the final one for `request`, acknowledging each
/// notification (runc's `criuSwrk` loop). Blocking: runs on a blocking thread; CRIU's death
/// (killed by the deadline or the guard) ends it with EOF.
fn converse(
    sock: &OwnedFd,
    req: &[u8],
    request: &'static str,
    on_notify: &mut dyn FnMut(&str),
) -> Result<(), CriuError> {
    let send = |data: &[u8]| {
        socket::send(sock.as_raw_fd(), data, MsgFlags::MSG_NOSIGNAL)
            .map_err(|e| io_err("writing to CRIU")(e.into()))
    };
    send(req)?;
    let mut buf = vec![0u8; RESP_BUF];
    loop {
        let n = loop {
            match socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other,
            }
        };
        let n = n.map_err(|e| io_err("reading from CRIU")(e.into()))?;
        if n == 0 {
            return Err(CriuError::NoAnswer);
        }
        if n == buf.len() {
            return Err(RespError::TooLarge.into());
        }
        let resp = decode_resp(&buf[..n])?;
        if !resp.success {
            return Err(CriuError::Failed {
                request,
                errno: resp.errno.filter(|e| *e != 0),
                message: resp.message.filter(|m| !m.is_empty()),
            });
        }
        match resp.kind {
            REQ_NOTIFY => {
                on_notify(resp.script.as_deref().unwrap_or_default());
                let mut ack = Enc::default();
                ack.uint(1, REQ_NOTIFY).bool(3, true);
                send(&ack.0)?;
            }
            REQ_DUMP if request == "dump" => return Ok(()),
            kind => return Err(RespError::Unexpected { kind, request }.into()),
        }
    }
}

/// Where CRIU keeps its kernel probe cache (`criu.kdat`): CRIU writes it only into `/run`, and
/// only if that is a tmpfs (the cache must not survive a reboot). On a host whose `/run` is
/// not a tmpfs every CRIU run probes the kernel again (~100 ms: it creates network
/// namespaces, runs `iptables`, parses the vDSO). There crab gives its CRIU a private mount
/// namespace whose `/run` is this directory on the tmpfs `/dev/shm`, so that the cache is
/// kept; nothing else of the host's `/run` is needed by a dump (images and work directory are
/// passed as descriptors, namespaces by inode, the container's files through `/proc`).
pub const KDAT_DIR: &str = "/dev/shm/crab-criu-run";

/// Whether `path` is on a tmpfs.
fn on_tmpfs(path: &Path) -> io::Result<bool> {
    let st = nix::sys::statfs::statfs(path).map_err(io::Error::from)?;
    Ok(st.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// The directory to mount on CRIU's `/run` ([`KDAT_DIR`]), created if missing; `None` when
/// `/run` is a tmpfs already (CRIU caches there itself) or the directory is not safe to use
/// (not a root-owned 0700 directory of its own on a tmpfs: someone else made it), which is
/// logged: CRIU then probes the kernel at every dump.
pub fn kdat_dir() -> Option<PathBuf> {
    static CHOICE: OnceLock<Option<PathBuf>> = OnceLock::new();
    CHOICE
        .get_or_init(|| {
            if on_tmpfs(Path::new("/run")).unwrap_or(true) {
                return None;
            }
            let dir = PathBuf::from(KDAT_DIR);
            match check_kdat_dir(&dir) {
                Ok(()) => {
                    log::info!(
                        "/run is not a tmpfs, so CRIU cannot keep its kernel probe cache there: crab's CRIU dumps see {} as /run",
                        dir.display()
                    );
                    Some(dir)
                }
                Err(e) => {
                    log::warn!(
                        "/run is not a tmpfs and {} cannot hold CRIU's kernel probe cache ({e}): every dump probes the kernel again (~100 ms)",
                        dir.display()
                    );
                    None
                }
            }
        })
        .clone()
}

/// `dir` is a directory (not a link) owned by root, mode 0700, on a tmpfs; created so if missing.
fn check_kdat_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let md = fs::symlink_metadata(dir)?;
    if !md.is_dir() || md.uid() != 0 || md.permissions().mode() & 0o7777 != 0o700 {
        return Err(io::Error::other(format!(
            "not a directory of root's with mode 0700 (uid {}, mode {:o})",
            md.uid(),
            md.permissions().mode() & 0o7777
        )));
    }
    if !on_tmpfs(dir)? {
        return Err(io::Error::other("not on a tmpfs"));
    }
    Ok(())
}

/// Where CRIU looks for its kernel probe cache (root's CRIU, `KDAT_RUNDIR` at build time).
pub const KDAT_FILE: &str = "/run/criu.kdat";

/// Lets a CRIU that crab does not start itself (`runc restore`'s) load the kernel probe cache
/// crab's dumps keep in [`KDAT_DIR`], where `/run` is not a tmpfs: `/run/criu.kdat` becomes a
/// link to `KDAT_DIR/criu.kdat`. CRIU loads the cache through the link (its load checks only
/// the file's two magics: the CRIU build and the cache format) and never saves through it
/// (it saves into `/run` only when that is a tmpfs), so the cache still dies with the boot
/// (`/dev/shm`) and is written only by crab's dumps; a CRIU of another build finds it stale and
/// unlinks the link, which the next restore makes again. Anything else already at
/// `/run/criu.kdat` (a file, another link) is left alone. Cheap when there is nothing to do
/// (one `lstat`); errors are logged: the restore then probes the kernel, as before.
pub fn link_kdat_cache() {
    let Some(dir) = kdat_dir() else { return };
    link_kdat_cache_at(Path::new(KDAT_FILE), &dir.join("criu.kdat"));
}

fn link_kdat_cache_at(link: &Path, target: &Path) {
    match fs::symlink_metadata(link) {
        Ok(md) if md.file_type().is_symlink() => {
            if fs::read_link(link).ok().as_deref() != Some(target) {
                log::debug!("{} links elsewhere: left alone", link.display());
            }
        }
        Ok(_) => log::debug!("{} exists: left alone", link.display()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match std::os::unix::fs::symlink(target, link) {
                Ok(()) => log::info!(
                    "{} now links to {}: restores load CRIU's kernel probe cache",
                    link.display(),
                    target.display()
                ),
                // Another shim made it meanwhile.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => log::warn!("linking {} to {}: {e}", link.display(), target.display()),
            }
        }
        Err(e) => log::warn!("{}: {e}", link.display()),
    }
}

/// Dumps container `id` (runc root `runc_root`) into `images` (created, must be new or empty)
/// with CRIU binary `criu`, logging to `work/dump.log`: what `runc checkpoint --image-path
/// images --work-path work` does, `descriptors.json` included. `run_dir`: a directory CRIU
/// sees as `/run` in a mount namespace of its own ([`kdat_dir`]), or `None` to share the
/// shim's.
pub async fn dump(
    criu: &Path,
    runc_root: &Path,
    id: &str,
    images: &Path,
    work: &Path,
    opts: &DumpOptions,
    run_dir: Option<&Path>,
) -> Result<(), CriuError> {
    let state = {
        let (root, id) = (runc_root.to_path_buf(), id.to_string());
        tokio::task::spawn_blocking(move || RuncState::read(&root, &id))
            .await
            .map_err(|e| io_err("reading runc's state")(io::Error::other(e)))??
    };
    make_dir(images)?;
    make_dir(work)?;
    let fds = serde_json::to_vec(&state.external_descriptors)
        .map_err(|e| io_err("encoding descriptors.json")(io::Error::other(e)))?;
    write_new(&images.join("descriptors.json"), &fds)?;
    let (images_fd, work_fd) = (open_dir(images)?, open_dir(work)?);
    // One read of the mount table for both.
    let mounts = crate::sys::mountinfo::read_self().map_err(io_err("reading the mount table"))?;
    let cgroup_v1 = host_cgroup_v1_dirs(&mounts)?;
    let opts = DumpOptions {
        cgroup_yard: opts
            .cgroup_yard
            .clone()
            .or_else(|| host_cgroup_yard(state.init_process_pid, &mounts)),
        ..opts.clone()
    };
    let opts = dump_opts(
        &state,
        &opts,
        &cgroup_v1,
        images_fd.as_raw_fd(),
        work_fd.as_raw_fd(),
    )
    .map_err(|source| CriuError::BadState {
        path: runc_root.join(id).join("state.json"),
        source,
    })?;
    let mut req = Enc::default();
    req.uint(1, REQ_DUMP).msg(2, &opts);

    let (client, server) = socket::socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| io_err("creating CRIU's socket")(e.into()))?;
    let mut exits = ExitSubscription::new().await?;
    let mut cmd = Command::new(criu);
    cmd.args(["swrk", "3"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let server_fd = server.as_raw_fd();
    let run_dir = run_dir
        .map(|d| std::ffi::CString::new(d.as_os_str().as_encoded_bytes()))
        .transpose()
        .map_err(|e| io_err("CRIU's /run")(io::Error::other(e)))?;
    // SAFETY: only async-signal-safe calls (unshare, mount, fcntl, dup2) on values prepared
    // before the fork: CRIU's end of the socket becomes its fd 3 (without close-on-exec), as
    // `criu swrk 3` expects, and with `run_dir`, CRIU gets a mount namespace of its own (no
    // propagation back to the host) with `run_dir` bound on /run.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(dir) = &run_dir {
                if libc::unshare(libc::CLONE_NEWNS) != 0
                    || libc::mount(
                        std::ptr::null(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_SLAVE,
                        std::ptr::null(),
                    ) != 0
                    || libc::mount(
                        dir.as_ptr(),
                        c"/run".as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if server_fd == 3 {
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(server_fd, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| ReaperError::Spawn {
        program: criu.display().to_string(),
        source,
    })?;
    drop(cmd);
    // Only CRIU holds its end now: its death is EOF here.
    drop(server);
    let pid = child.id();
    let fd = PidFd::open(pid).map_err(io_err("pidfd_open of CRIU"))?;
    let mut guard = Running::new(id, pid, fd);
    let state_dir = runc_root.join(id);
    let talk = tokio::task::spawn_blocking(move || {
        let _fds = (images_fd, work_fd);
        converse(&client, &req.0, "dump", &mut |script| {
            // runc marks a dumped container in its state directory; nothing else of the
            // notifications concerns a container without runc-managed networks.
            if script == "post-dump" {
                let _ = fs::File::create(state_dir.join("checkpoint"));
            }
        })
        // Dropping `client` tells CRIU the conversation is over.
    });
    let answered = talk
        .await
        .map_err(|e| io_err("talking to CRIU")(io::Error::other(e)));
    let answered = match answered {
        Ok(r) => r,
        Err(e) => Err(e),
    };
    if answered.is_err() {
        guard.fd.kill();
    }
    let code = exits.wait_for(pid as i32).await;
    guard.exited = true;
    drop(guard);
    drop(child);
    answered?;
    match code? {
        0 => Ok(()),
        c => Err(CriuError::Exit(c)),
    }
}

fn write_new(path: &Path, data: &[u8]) -> Result<(), CriuError> {
    (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)?;
        f.write_all(data)
    })()
    .map_err(io_err(format!("writing {}", path.display())))
}

/// CRIU's binary: `[runc] criu` when set, else `criu` on `PATH`.
pub fn criu_binary(config: &crab_runtime_config::Config) -> PathBuf {
    config
        .runc
        .criu
        .clone()
        .unwrap_or_else(|| PathBuf::from("criu"))
}

#[cfg(test)]
mod tests;
