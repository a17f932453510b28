//! Reading the few facts of a CRIU image that decide whether it may run: who its processes
//! are (credentials, capability sets, no_new_privs, seccomp mode) and which namespaces CRIU
//! would create for them. Everything else in the image is CRIU's business.
//!
//! A CRIU image is a directory of files, each a small header of magic numbers followed by
//! protobuf entries, each prefixed with its length (`u32`, little endian). The messages are
//! defined in CRIU's `images/*.proto`; only the fields read here are decoded, by the minimal
//! protobuf reader of [`super::criu_proto`], which skips everything else. The input is untrusted (it comes from an
//! image anyone may have built): every length is checked against what is left, every file is
//! read with a size bound, and anything unexpected is an error, never a guess.

use std::{
    io::{self, Read},
    path::{Path, PathBuf},
};

pub use super::criu_proto::MAX_TASKS;
use super::criu_proto::{
    parse_pstree,
    schemas::{
        CORE_ENTRY, CREDS_ENTRY, INVENTORY_ENTRY, RSEQ_ENTRY, TASK_CORE_ENTRY, TASK_KOBJ_IDS_ENTRY,
        THREAD_CORE_ENTRY,
    },
    single, DecodeError, Fields,
};

const INVENTORY_MAGIC: u32 = 0x5831_3116;
const CORE_MAGIC: u32 = 0x5505_3847;
const IDS_MAGIC: u32 = 0x5443_2030;
/// `inventory.img_version` of images with [`IMG_COMMON_MAGIC`] heads (CRIU's
/// `CRTOOLS_IMAGES_V1_1`), the only layout CRIU has written for a decade.
const IMAGES_V1_1: u64 = 2;
/// A task that is a zombie: CRIU restores it dead, it never runs (`TASK_DEAD`).
const TASK_DEAD: u64 = 2;

/// The files read here are small (a core file is a few KB); anything larger is not CRIU's.
pub const MAX_DESCRIPTOR_FILE: u64 = 8 << 20;

/// Namespace flags as in `clone(2)`.
pub mod ns {
    pub const MNT: u32 = 0x0002_0000;
    pub const UTS: u32 = 0x0400_0000;
    pub const IPC: u32 = 0x0800_0000;
    pub const USER: u32 = 0x1000_0000;
    pub const PID: u32 = 0x2000_0000;
    pub const NET: u32 = 0x4000_0000;
    pub const TIME: u32 = 0x0000_0080;

    /// Names for messages, in a fixed order.
    pub const NAMES: [(u32, &str); 7] = [
        (MNT, "mount"),
        (UTS, "uts"),
        (IPC, "ipc"),
        (USER, "user"),
        (PID, "pid"),
        (NET, "network"),
        (TIME, "time"),
    ];

    pub fn names(mask: u32) -> Vec<&'static str> {
        NAMES
            .iter()
            .filter(|(f, _)| mask & f != 0)
            .map(|(_, n)| *n)
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CriuImageError {
    #[error("CRIU image: {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// What a file of the image says is not what CRIU writes, or not what a sandbox runs.
    #[error("CRIU image: {path} is malformed: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: FactsError,
    },
    #[error("CRIU image: {path} is malformed: not a regular file")]
    NotRegular { path: PathBuf },
    #[error(
        "CRIU image: {path} is malformed: {len} bytes, more than the {max} a CRIU descriptor \
         file may have",
        max = MAX_DESCRIPTOR_FILE
    )]
    TooLarge { path: PathBuf, len: u64 },
    #[error("CRIU image: {path} is malformed: grew while being read")]
    Grew { path: PathBuf },
    /// A file the caller found wrong in a way of its own (a reader of other files of the
    /// image; a file missing from the set a test or fuzz target gives).
    #[error("CRIU image: {path} is malformed: {reason}")]
    Malformed { path: PathBuf, reason: String },
}

/// What is wrong with the content of one file of a CRIU image: its encoding
/// ([`DecodeError`]), or facts no sandbox's image has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FactsError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("image layout version {0}, not {v}", v = IMAGES_V1_1)]
    Version(u64),
    #[error("no image layout version")]
    NoVersion,
    #[error("no root_ids: the namespaces cannot be told")]
    NoRootIds,
    #[error("no tasks")]
    NoTasks,
    #[error("more than {max} threads", max = MAX_TASKS)]
    TooManyThreads,
    #[error("thread {0} records no credentials")]
    NoCredentials(u32),
    #[error("the root task {0} is not among its threads")]
    RootNotAThread(u32),
    #[error("more than 65536 supplementary groups")]
    TooManyGroups,
    #[error("credentials without all of uid, gid, euid, egid, suid, sgid, fsuid, fsgid")]
    PartialCredentials,
    #[error("{0} names capabilities beyond bit 63")]
    WideCapSet(&'static str),
}

/// One thread's credentials and security state, as CRIU would restore them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Creds {
    /// uid, euid, suid, fsuid.
    pub uids: [u32; 4],
    /// gid, egid, sgid, fsgid.
    pub gids: [u32; 4],
    pub groups: Vec<u32>,
    pub cap_inh: u64,
    pub cap_prm: u64,
    pub cap_eff: u64,
    pub cap_bnd: u64,
    pub cap_amb: u64,
    pub no_new_privs: bool,
    /// 0 disabled, 1 strict, 2 filter (`SECCOMP_MODE_*`).
    pub seccomp_mode: u32,
}

/// A thread of the image: its task and thread ids and what it would run as (`None` only for
/// a zombie, which never runs again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Thread {
    pub pid: u32,
    pub tid: u32,
    pub comm: String,
    pub creds: Option<Creds>,
    /// The user address of the thread's registered rseq area (`thread_core.rseq_entry`, which
    /// CRIU registers again at restore), if it had one: memory the kernel writes by itself
    /// whenever the thread is scheduled (the inspector leaves it out of its memory images).
    pub rseq: Option<u64>,
}

/// What a CRIU image says about the processes it restores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFacts {
    /// The root task's pid (the container's init).
    pub root_pid: u32,
    /// The namespaces CRIU creates for the root task (`clone(2)` flags): those in which the
    /// root task differed from CRIU itself at dump time.
    pub namespaces: u32,
    pub threads: Vec<Thread>,
}

/// Reads [`ImageFacts`] from the CRIU image directory `dir` (a private copy: the caller
/// copied it out of the container's rootfs, so nothing changes it under us).
pub fn read_facts(dir: &Path) -> Result<ImageFacts, CriuImageError> {
    facts_from(dir, &mut |path| read_bounded(path))
}

/// [`read_facts`] over any source of files: `read` gets the path of each file needed (under
/// `dir`) and returns its bytes. The parsing itself touches nothing else (fuzzed this way).
pub fn facts_from(
    dir: &Path,
    read: &mut dyn FnMut(&Path) -> Result<Vec<u8>, CriuImageError>,
) -> Result<ImageFacts, CriuImageError> {
    let inventory_path = dir.join("inventory.img");
    let inventory = read(&inventory_path)?;
    let root_ids = parse_inventory(&inventory).map_err(malformed(&inventory_path))?;

    let pstree_path = dir.join("pstree.img");
    let pstree = read(&pstree_path)?;
    let tasks = parse_pstree(&pstree).map_err(|e| malformed(&pstree_path)(e.into()))?;
    let root_pid = tasks
        .first()
        .map(|t| t.pid)
        .ok_or_else(|| malformed(&pstree_path)(FactsError::NoTasks))?;

    let mut threads = Vec::new();
    let mut namespaces = None;
    for task in &tasks {
        let (pid, tids) = (&task.pid, &task.threads);
        // A zombie is its leader's core alone (CRIU restores it from `core-<pid>.img`): CRIU
        // collects no threads of a zombie, and the one thread id its pstree entry carries is
        // whatever was in memory (seen: 148003136, with no such core file). A task without
        // threads listed is its own single thread.
        let leader_path = dir.join(format!("core-{pid}.img"));
        let mut leader = Some(parse_core(&read(&leader_path)?).map_err(malformed(&leader_path))?);
        let zombie = leader.as_ref().and_then(|c| c.task_state) == Some(TASK_DEAD);
        let tids: &[u32] = if tids.is_empty() || zombie {
            std::slice::from_ref(pid)
        } else {
            tids
        };
        for &tid in tids {
            if threads.len() >= MAX_TASKS {
                return Err(malformed(&pstree_path)(FactsError::TooManyThreads));
            }
            let path = dir.join(format!("core-{tid}.img"));
            // The leader's core was read above.
            let core = match if tid == *pid { leader.take() } else { None } {
                Some(core) => core,
                None => parse_core(&read(&path)?).map_err(malformed(&path))?,
            };
            if tid == *pid && *pid == root_pid {
                // CRIU restores namespaces from the root task's `ids-<pid>.img`.
                let ids_path = dir.join(format!("ids-{pid}.img"));
                let ids = single(&read(&ids_path)?, IDS_MAGIC, true)
                    .map_err(FactsError::from)
                    .and_then(parse_ns_ids)
                    .map_err(malformed(&ids_path))?;
                namespaces = Some(clone_mask(&ids, &root_ids));
            }
            let creds = match (core.creds, core.task_state) {
                (Some(c), _) => Some(c),
                (None, Some(TASK_DEAD)) => None,
                (None, _) => return Err(malformed(&path)(FactsError::NoCredentials(tid))),
            };
            threads.push(Thread {
                pid: *pid,
                tid,
                comm: core.comm,
                creds,
                rseq: core.rseq,
            });
        }
    }
    Ok(ImageFacts {
        root_pid,
        namespaces: namespaces
            .ok_or_else(|| malformed(&pstree_path)(FactsError::RootNotAThread(root_pid)))?,
        threads,
    })
}

fn malformed(path: &Path) -> impl Fn(FactsError) -> CriuImageError + '_ {
    move |source| CriuImageError::Invalid {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads a plain file of at most [`MAX_DESCRIPTOR_FILE`] bytes, never through a symlink and
/// never anything but a regular file.
pub(crate) fn read_bounded(path: &Path) -> Result<Vec<u8>, CriuImageError> {
    let io = |source| CriuImageError::Io {
        path: path.to_path_buf(),
        source,
    };
    let path_buf = || path.to_path_buf();
    let f = crate::sys::beneath::open_regular_nofollow(path).map_err(|e| {
        if crate::sys::beneath::is_refused(&e) {
            CriuImageError::NotRegular { path: path_buf() }
        } else {
            io(e)
        }
    })?;
    let md = f.metadata().map_err(io)?;
    if md.len() > MAX_DESCRIPTOR_FILE {
        return Err(CriuImageError::TooLarge {
            path: path_buf(),
            len: md.len(),
        });
    }
    let mut out = Vec::with_capacity(md.len() as usize);
    f.take(MAX_DESCRIPTOR_FILE + 1)
        .read_to_end(&mut out)
        .map_err(io)?;
    if out.len() as u64 > MAX_DESCRIPTOR_FILE {
        return Err(CriuImageError::Grew { path: path_buf() });
    }
    Ok(out)
}

/// `task_kobj_ids_entry`: the namespace ids (fields 5..=12 of CRIU's message), 0 when absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct NsIds {
    pid: u64,
    net: u64,
    ipc: u64,
    uts: u64,
    mnt: u64,
    user: u64,
    time: u64,
}

fn parse_ns_ids(msg: &[u8]) -> Result<NsIds, FactsError> {
    let mut ids = NsIds::default();
    for field in Fields::strict(msg, &TASK_KOBJ_IDS_ENTRY) {
        let (number, value) = field?;
        let slot = match number {
            5 => &mut ids.pid,
            6 => &mut ids.net,
            7 => &mut ids.ipc,
            8 => &mut ids.uts,
            9 => &mut ids.mnt,
            10 => &mut ids.user,
            12 => &mut ids.time,
            _ => continue,
        };
        *slot = value.varint("a namespace id")?;
    }
    Ok(ids)
}

/// CRIU's `get_clone_mask` for the root task: the namespaces in which it differs from the
/// dumping CRIU (the inventory's `root_ids`), which restore creates anew.
fn clone_mask(task: &NsIds, criu: &NsIds) -> u32 {
    [
        (task.pid != criu.pid, ns::PID),
        (task.net != criu.net, ns::NET),
        (task.ipc != criu.ipc, ns::IPC),
        (task.uts != criu.uts, ns::UTS),
        (task.time != criu.time, ns::TIME),
        (task.mnt != criu.mnt, ns::MNT),
        (task.user != criu.user, ns::USER),
    ]
    .into_iter()
    .filter(|(differs, _)| *differs)
    .fold(0, |mask, (_, flag)| mask | flag)
}

/// `inventory_entry`: checks the layout version, returns `root_ids` (field 3).
fn parse_inventory(bytes: &[u8]) -> Result<NsIds, FactsError> {
    let msg = single(bytes, INVENTORY_MAGIC, false)?;
    let (mut version, mut root_ids) = (None, None);
    for field in Fields::strict(msg, &INVENTORY_ENTRY) {
        match field? {
            (1, v) => version = Some(v.varint("img_version")?),
            (3, v) => root_ids = Some(parse_ns_ids(v.bytes("root_ids")?)?),
            _ => {}
        }
    }
    match version {
        Some(IMAGES_V1_1) => {}
        Some(v) => return Err(FactsError::Version(v)),
        None => return Err(FactsError::NoVersion),
    }
    root_ids.ok_or(FactsError::NoRootIds)
}

struct Core {
    task_state: Option<u64>,
    comm: String,
    creds: Option<Creds>,
    rseq: Option<u64>,
}

/// `core_entry`: the task's state and comm (`tc`, field 3) and the thread's credentials and
/// seccomp mode (`thread_core`, field 5).
fn parse_core(bytes: &[u8]) -> Result<Core, FactsError> {
    let msg = single(bytes, CORE_MAGIC, true)?;
    let mut core = Core {
        task_state: None,
        comm: String::new(),
        creds: None,
        rseq: None,
    };
    let (mut thread_seccomp, mut task_seccomp) = (None, None);
    for field in Fields::strict(msg, &CORE_ENTRY) {
        match field? {
            (3, v) => {
                for f in Fields::strict(v.bytes("tc")?, &TASK_CORE_ENTRY) {
                    match f? {
                        (1, v) => core.task_state = Some(v.varint("task_state")?),
                        (6, v) => {
                            core.comm = String::from_utf8_lossy(v.bytes("comm")?).into_owned()
                        }
                        // The deprecated per-task seccomp mode of older images.
                        (11, v) => task_seccomp = Some(v.u32("old_seccomp_mode")?),
                        _ => {}
                    }
                }
            }
            (5, v) => {
                for f in Fields::strict(v.bytes("thread_core")?, &THREAD_CORE_ENTRY) {
                    match f? {
                        (10, v) => core.creds = Some(parse_creds(v.bytes("creds")?)?),
                        (11, v) => thread_seccomp = Some(v.u32("seccomp_mode")?),
                        (15, v) => core.rseq = parse_rseq(v.bytes("rseq_entry")?)?,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(c) = core.creds.as_mut() {
        // The strictest mode either field records: a thread's own mode wins where both exist,
        // but an image must not escape a filter by leaving one field out.
        c.seccomp_mode = thread_seccomp.or(task_seccomp).unwrap_or(0);
    }
    Ok(core)
}

/// `rseq_entry`: the area's address (field 1) when one is registered (its size, field 2, is
/// not 0).
fn parse_rseq(msg: &[u8]) -> Result<Option<u64>, FactsError> {
    let (mut pointer, mut size) = (0, 0);
    for field in Fields::strict(msg, &RSEQ_ENTRY) {
        match field? {
            (1, v) => pointer = v.varint("rseq_abi_pointer")?,
            (2, v) => size = v.u32("rseq_abi_size")?,
            _ => {}
        }
    }
    Ok((pointer != 0 && size != 0).then_some(pointer))
}

/// `creds_entry`.
fn parse_creds(msg: &[u8]) -> Result<Creds, FactsError> {
    let mut c = Creds::default();
    let mut seen = 0u32;
    let (mut inh, mut prm, mut eff, mut bnd, mut amb) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for field in Fields::strict(msg, &CREDS_ENTRY) {
        let (number, v) = field?;
        match number {
            1 => c.uids[0] = v.u32("uid")?,
            2 => c.gids[0] = v.u32("gid")?,
            3 => c.uids[1] = v.u32("euid")?,
            4 => c.gids[1] = v.u32("egid")?,
            5 => c.uids[2] = v.u32("suid")?,
            6 => c.gids[2] = v.u32("sgid")?,
            7 => c.uids[3] = v.u32("fsuid")?,
            8 => c.gids[3] = v.u32("fsgid")?,
            9 => v.repeated_u32("cap_inh", &mut inh)?,
            10 => v.repeated_u32("cap_prm", &mut prm)?,
            11 => v.repeated_u32("cap_eff", &mut eff)?,
            12 => v.repeated_u32("cap_bnd", &mut bnd)?,
            14 => v.repeated_u32("groups", &mut c.groups)?,
            18 => c.no_new_privs = v.varint("no_new_privs")? != 0,
            19 => v.repeated_u32("cap_amb", &mut amb)?,
            _ => continue,
        }
        if number <= 8 {
            seen |= 1 << number;
        }
        if c.groups.len() > 65_536 {
            return Err(FactsError::TooManyGroups);
        }
    }
    if seen != 0b1_1111_1110 {
        return Err(FactsError::PartialCredentials);
    }
    c.cap_inh = cap_set("cap_inh", &inh)?;
    c.cap_prm = cap_set("cap_prm", &prm)?;
    c.cap_eff = cap_set("cap_eff", &eff)?;
    c.cap_bnd = cap_set("cap_bnd", &bnd)?;
    c.cap_amb = cap_set("cap_amb", &amb)?;
    Ok(c)
}

/// A capability set stored as 32-bit words, lowest first (CRIU's `CR_CAP_SIZE` is 2). A set
/// that does not fit 64 bits names capabilities no kernel has: refused, not truncated.
fn cap_set(what: &'static str, words: &[u32]) -> Result<u64, FactsError> {
    let mut set = 0u64;
    for (i, w) in words.iter().enumerate() {
        match i {
            0 => set |= u64::from(*w),
            1 => set |= u64::from(*w) << 32,
            _ if *w == 0 => {}
            _ => return Err(FactsError::WideCapSet(what)),
        }
    }
    Ok(set)
}

/// A minimal protobuf and image-file writer, for tests here and in other modules: builds the
/// images [`read_facts`] reads, including hostile ones.
#[cfg(any(test, feature = "fuzzing"))]
pub mod testing {
    use super::*;
    use crate::checkpoint::criu_proto::{IMG_COMMON_MAGIC, PSTREE_MAGIC};
    use std::fs;

    /// Root's credentials with `caps` in the permitted, effective and bounding sets.
    pub fn with_caps(caps: u64) -> Creds {
        Creds {
            cap_prm: caps,
            cap_eff: caps,
            cap_bnd: caps,
            ..Creds::default()
        }
    }

    pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    pub fn varint_field(out: &mut Vec<u8>, number: u32, v: u64) {
        put_varint(out, u64::from(number) << 3);
        put_varint(out, v);
    }

    pub fn bytes_field(out: &mut Vec<u8>, number: u32, b: &[u8]) {
        put_varint(out, (u64::from(number) << 3) | 2);
        put_varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }

    /// An image file of `entries` under `magic` (with the common head unless inventory).
    pub fn image_file(magic: u32, common_head: bool, entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        if common_head {
            out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        }
        out.extend_from_slice(&magic.to_le_bytes());
        for e in entries {
            out.extend_from_slice(&(e.len() as u32).to_le_bytes());
            out.extend_from_slice(e);
        }
        out
    }

    pub fn ns_ids(base: u64) -> Vec<u8> {
        let mut m = Vec::new();
        for (number, v) in [(1, 1), (2, 2), (3, 3), (4, 4)] {
            varint_field(&mut m, number, v);
        }
        for number in 5..=12 {
            varint_field(&mut m, number, base + u64::from(number));
        }
        m
    }

    pub fn inventory(root_ids_base: u64) -> Vec<u8> {
        let mut m = Vec::new();
        varint_field(&mut m, 1, IMAGES_V1_1);
        bytes_field(&mut m, 3, &ns_ids(root_ids_base));
        image_file(INVENTORY_MAGIC, false, &[m])
    }

    pub fn pstree(tasks: &[(u32, &[u32])]) -> Vec<u8> {
        let entries: Vec<Vec<u8>> = tasks
            .iter()
            .map(|(pid, threads)| {
                let mut m = Vec::new();
                varint_field(&mut m, 1, u64::from(*pid));
                varint_field(&mut m, 2, 0);
                varint_field(&mut m, 3, u64::from(*pid));
                varint_field(&mut m, 4, u64::from(*pid));
                for t in *threads {
                    varint_field(&mut m, 5, u64::from(*t));
                }
                m
            })
            .collect();
        image_file(PSTREE_MAGIC, true, &entries)
    }

    pub fn creds(c: &Creds) -> Vec<u8> {
        let mut m = Vec::new();
        for (number, v) in [
            (1, c.uids[0]),
            (2, c.gids[0]),
            (3, c.uids[1]),
            (4, c.gids[1]),
            (5, c.uids[2]),
            (6, c.gids[2]),
            (7, c.uids[3]),
            (8, c.gids[3]),
        ] {
            varint_field(&mut m, number, u64::from(v));
        }
        for (number, set) in [
            (9, c.cap_inh),
            (10, c.cap_prm),
            (11, c.cap_eff),
            (12, c.cap_bnd),
        ] {
            varint_field(&mut m, number, set & 0xffff_ffff);
            varint_field(&mut m, number, set >> 32);
        }
        varint_field(&mut m, 13, 0);
        for g in &c.groups {
            varint_field(&mut m, 14, u64::from(*g));
        }
        varint_field(&mut m, 18, u64::from(c.no_new_privs));
        varint_field(&mut m, 19, c.cap_amb & 0xffff_ffff);
        varint_field(&mut m, 19, c.cap_amb >> 32);
        m
    }

    /// A core file: `creds` None leaves out the credentials (as for a zombie, with `state` 2).
    pub fn core(state: u64, creds: Option<&Creds>) -> Vec<u8> {
        core_with(state, creds, None)
    }

    /// [`core`] whose thread registered an rseq area (`rseq`: address, size).
    pub fn core_with(state: u64, creds: Option<&Creds>, rseq: Option<(u64, u64)>) -> Vec<u8> {
        let mut tc = Vec::new();
        varint_field(&mut tc, 1, state);
        varint_field(&mut tc, 2, 0);
        bytes_field(&mut tc, 6, b"sh");
        let mut thread = Vec::new();
        varint_field(&mut thread, 1, 0);
        varint_field(&mut thread, 2, 0);
        if let Some(c) = creds {
            bytes_field(&mut thread, 10, &super::testing::creds(c));
            varint_field(&mut thread, 11, u64::from(c.seccomp_mode));
        }
        if let Some((pointer, size)) = rseq {
            let mut r = Vec::new();
            varint_field(&mut r, 1, pointer);
            varint_field(&mut r, 2, size);
            varint_field(&mut r, 3, 0x5305_3053);
            bytes_field(&mut thread, 15, &r);
        }
        let mut m = Vec::new();
        varint_field(&mut m, 1, 1);
        bytes_field(&mut m, 3, &tc);
        bytes_field(&mut m, 5, &thread);
        image_file(CORE_MAGIC, true, &[m])
    }

    /// Writes an image of `tasks` (pid, threads) whose every thread has `creds`, the root
    /// task in namespaces all different from CRIU's except those in `shared_with_criu`.
    pub fn write_image(dir: &Path, tasks: &[(u32, &[u32])], creds: &Creds, shared_with_criu: u32) {
        fs::create_dir_all(dir).unwrap();
        // The root task's ids are base 100 + field number; CRIU's are base 0 + field number,
        // except where shared.
        let mut criu_ids = NsIds::default();
        let task_ids = |base: u64| NsIds {
            pid: base + 5,
            net: base + 6,
            ipc: base + 7,
            uts: base + 8,
            mnt: base + 9,
            user: base + 10,
            time: base + 12,
        };
        let (root, other) = (task_ids(100), task_ids(0));
        for (flag, (slot, from_root, from_other)) in [
            (ns::PID, (&mut criu_ids.pid, root.pid, other.pid)),
            (ns::NET, (&mut criu_ids.net, root.net, other.net)),
            (ns::IPC, (&mut criu_ids.ipc, root.ipc, other.ipc)),
            (ns::UTS, (&mut criu_ids.uts, root.uts, other.uts)),
            (ns::MNT, (&mut criu_ids.mnt, root.mnt, other.mnt)),
            (ns::USER, (&mut criu_ids.user, root.user, other.user)),
            (ns::TIME, (&mut criu_ids.time, root.time, other.time)),
        ] {
            *slot = if shared_with_criu & flag != 0 {
                from_root
            } else {
                from_other
            };
        }
        let mut inv = Vec::new();
        varint_field(&mut inv, 1, IMAGES_V1_1);
        let mut ids = Vec::new();
        for (number, v) in [(1, 1), (2, 2), (3, 3), (4, 4)] {
            varint_field(&mut ids, number, v);
        }
        for (number, v) in [
            (5, criu_ids.pid),
            (6, criu_ids.net),
            (7, criu_ids.ipc),
            (8, criu_ids.uts),
            (9, criu_ids.mnt),
            (10, criu_ids.user),
            (12, criu_ids.time),
        ] {
            varint_field(&mut ids, number, v);
        }
        bytes_field(&mut inv, 3, &ids);
        fs::write(
            dir.join("inventory.img"),
            image_file(INVENTORY_MAGIC, false, &[inv]),
        )
        .unwrap();
        fs::write(dir.join("pstree.img"), pstree(tasks)).unwrap();
        for (i, (pid, threads)) in tasks.iter().enumerate() {
            let tids: Vec<u32> = if threads.is_empty() {
                vec![*pid]
            } else {
                threads.to_vec()
            };
            if i == 0 {
                fs::write(
                    dir.join(format!("ids-{pid}.img")),
                    image_file(IDS_MAGIC, true, &[ns_ids(100)]),
                )
                .unwrap();
            }
            for tid in tids {
                fs::write(dir.join(format!("core-{tid}.img")), core(1, Some(creds))).unwrap();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::checkpoint::criu_proto::PSTREE_MAGIC;
    use std::fs;

    fn root_creds() -> Creds {
        with_caps(0xa804_25fb)
    }

    #[test]
    fn reads_tasks_threads_creds_and_namespaces() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = root_creds();
        c.groups = vec![10, 11];
        c.seccomp_mode = 2;
        c.no_new_privs = true;
        c.cap_amb = 1 << 40;
        write_image(
            dir.path(),
            &[(1, &[1, 5]), (7, &[])],
            &c,
            ns::USER | ns::TIME,
        );
        let facts = read_facts(dir.path()).unwrap();
        assert_eq!(facts.root_pid, 1);
        assert_eq!(
            facts.namespaces,
            ns::MNT | ns::UTS | ns::IPC | ns::PID | ns::NET
        );
        let tids: Vec<(u32, u32)> = facts.threads.iter().map(|t| (t.pid, t.tid)).collect();
        assert_eq!(tids, vec![(1, 1), (1, 5), (7, 7)]);
        assert!(facts.threads.iter().all(|t| t.creds.as_ref() == Some(&c)));
        assert_eq!(facts.threads[0].comm, "sh");
        assert!(facts.threads.iter().all(|t| t.rseq.is_none()));
    }

    #[test]
    fn rseq_areas_are_read_per_thread() {
        let dir = tempfile::tempdir().unwrap();
        let c = root_creds();
        write_image(dir.path(), &[(1, &[1, 5]), (7, &[])], &c, 0);
        // As CRIU 4 writes it (seen: pointer 0x7f56..., size 32, signature 0x53053053); a
        // size of 0 is no registration; a hostile entry is an error naming the field.
        fs::write(
            dir.path().join("core-5.img"),
            core_with(1, Some(&c), Some((0x7f56_1234_5680, 32))),
        )
        .unwrap();
        fs::write(
            dir.path().join("core-7.img"),
            core_with(1, Some(&c), Some((0x7f56_0000_0000, 0))),
        )
        .unwrap();
        let facts = read_facts(dir.path()).unwrap();
        let areas: Vec<(u32, Option<u64>)> =
            facts.threads.iter().map(|t| (t.tid, t.rseq)).collect();
        assert_eq!(
            areas,
            vec![(1, None), (5, Some(0x7f56_1234_5680)), (7, None)]
        );
        let mut thread = Vec::new();
        bytes_field(&mut thread, 10, &creds(&c));
        bytes_field(&mut thread, 15, &[0x08]); // field 1 with its varint cut off
        let mut m = Vec::new();
        varint_field(&mut m, 1, 1);
        bytes_field(&mut m, 5, &thread);
        fs::write(
            dir.path().join("core-5.img"),
            image_file(CORE_MAGIC, true, &[m]),
        )
        .unwrap();
        let err = read_facts(dir.path()).unwrap_err().to_string();
        assert!(err.contains("core-5.img"), "{err}");
    }

    #[test]
    fn a_zombie_needs_no_creds_but_a_live_task_does() {
        let dir = tempfile::tempdir().unwrap();
        write_image(dir.path(), &[(1, &[]), (9, &[])], &root_creds(), 0);
        fs::write(dir.path().join("core-9.img"), core(TASK_DEAD, None)).unwrap();
        let facts = read_facts(dir.path()).unwrap();
        assert_eq!(facts.threads[1].creds, None);
        // CRIU lists a garbage thread id for a zombie (no core file of that name): the
        // zombie is its leader's core alone. A live task's listed threads are all read.
        write_image(dir.path(), &[(1, &[]), (9, &[148003136])], &root_creds(), 0);
        fs::remove_file(dir.path().join("core-148003136.img")).unwrap();
        fs::write(dir.path().join("core-9.img"), core(TASK_DEAD, None)).unwrap();
        let facts = read_facts(dir.path()).unwrap();
        let tids: Vec<(u32, u32)> = facts.threads.iter().map(|t| (t.pid, t.tid)).collect();
        assert_eq!(tids, vec![(1, 1), (9, 9)]);
        fs::write(dir.path().join("core-9.img"), core(1, Some(&root_creds()))).unwrap();
        let err = read_facts(dir.path()).unwrap_err().to_string();
        assert!(err.contains("core-148003136.img"), "{err}");
        write_image(dir.path(), &[(1, &[]), (9, &[])], &root_creds(), 0);
        fs::write(dir.path().join("core-9.img"), core(1, None)).unwrap();
        let err = read_facts(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no credentials"), "{err}");
    }

    /// The reading CRIU would make of an image is the only one crab accepts: the two-`creds`
    /// image (root with every capability first, the spec's ids without capabilities last,
    /// which protobuf-c merges into root with every capability) and its relatives are refused,
    /// as are fields CRIU's schema does not know.
    #[test]
    fn duplicate_and_unknown_fields_are_refused_as_crius_reading_would_differ() {
        let mut root = root_creds();
        root.cap_bnd = u64::MAX >> 23;
        root.cap_prm = root.cap_bnd;
        root.cap_eff = root.cap_bnd;
        let spec_ids = Creds {
            uids: [1000; 4],
            gids: [1000; 4],
            ..Default::default()
        };
        let plain = |c: &Creds| {
            // Without capability fields at all: protobuf-c keeps the first entry's arrays.
            let mut m = Vec::new();
            for (n, v) in (1..=8).zip([
                c.uids[0], c.gids[0], c.uids[1], c.gids[1], c.uids[2], c.gids[2], c.uids[3],
                c.gids[3],
            ]) {
                varint_field(&mut m, n, u64::from(v));
            }
            varint_field(&mut m, 13, 0);
            m
        };
        let core_of = |tc: Vec<Vec<u8>>, threads: Vec<Vec<u8>>, extra: Option<(u32, u64)>| {
            let mut m = Vec::new();
            varint_field(&mut m, 1, 1);
            for t in tc {
                bytes_field(&mut m, 3, &t);
            }
            for t in threads {
                bytes_field(&mut m, 5, &t);
            }
            if let Some((n, v)) = extra {
                varint_field(&mut m, n, v);
            }
            image_file(CORE_MAGIC, true, &[m])
        };
        let tc = || {
            let mut t = Vec::new();
            varint_field(&mut t, 1, 1);
            bytes_field(&mut t, 6, b"sh");
            t
        };
        let thread = |creds: &[Vec<u8>]| {
            let mut t = Vec::new();
            varint_field(&mut t, 1, 0);
            varint_field(&mut t, 2, 0);
            for c in creds {
                bytes_field(&mut t, 10, c);
            }
            varint_field(&mut t, 11, 2);
            t
        };
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "thread_core_entry has its field 10 twice",
                core_of(
                    vec![tc()],
                    vec![thread(&[testing::creds(&root), plain(&spec_ids)])],
                    None,
                ),
            ),
            (
                "core_entry has its field 5 twice",
                core_of(
                    vec![tc()],
                    vec![
                        thread(&[testing::creds(&root)]),
                        thread(&[plain(&spec_ids)]),
                    ],
                    None,
                ),
            ),
            (
                "core_entry has its field 3 twice",
                core_of(vec![tc(), tc()], vec![thread(&[plain(&spec_ids)])], None),
            ),
            (
                "creds_entry has its field 1 twice",
                core_of(
                    vec![tc()],
                    vec![thread(&[{
                        let mut c = plain(&spec_ids);
                        varint_field(&mut c, 1, 0);
                        c
                    }])],
                    None,
                ),
            ),
            (
                "creds_entry has a field 40",
                core_of(
                    vec![tc()],
                    vec![thread(&[{
                        let mut c = plain(&spec_ids);
                        varint_field(&mut c, 40, 1);
                        c
                    }])],
                    None,
                ),
            ),
            (
                "core_entry has a field 7",
                core_of(vec![tc()], vec![thread(&[plain(&spec_ids)])], Some((7, 1))),
            ),
        ];
        for (want, bytes) in cases {
            let dir = tempfile::tempdir().unwrap();
            write_image(dir.path(), &[(1, &[])], &root_creds(), 0);
            fs::write(dir.path().join("core-1.img"), &bytes).unwrap();
            let err = read_facts(dir.path()).unwrap_err().to_string();
            assert!(err.contains(want), "want {want:?}: {err}");
        }
        // Repeated fields may repeat (capability words, groups), as CRIU writes them.
        let dir = tempfile::tempdir().unwrap();
        write_image(dir.path(), &[(1, &[])], &root, 0);
        read_facts(dir.path()).unwrap();
    }

    #[test]
    fn hostile_images_are_errors_not_guesses() {
        let base = tempfile::tempdir().unwrap();
        write_image(base.path(), &[(1, &[])], &root_creds(), 0);
        let good_core = fs::read(base.path().join("core-1.img")).unwrap();
        let cases: Vec<(&str, &str, Vec<u8>)> = vec![
            ("inventory.img", "magic", pstree(&[(1, &[])])),
            ("inventory.img", "cut short", vec![0x16]),
            (
                "pstree.img",
                "no tasks",
                image_file(PSTREE_MAGIC, true, &[]),
            ),
            ("pstree.img", "head magic", {
                let mut p = pstree(&[(1, &[])]);
                p[0] ^= 0xff;
                p
            }),
            ("ids-1.img", "magic", core(1, Some(&root_creds()))),
            ("core-1.img", "bytes", {
                // An entry length pointing past the end of the file.
                let mut c = good_core.clone();
                c[8] = 0xff;
                c
            }),
            ("core-1.img", "entries", {
                let mut c = good_core.clone();
                c.extend_from_slice(&good_core[8..]);
                c
            }),
            ("core-1.img", "varint", {
                // A field whose varint never ends.
                let mut m = Vec::new();
                m.extend_from_slice(&[0x08]);
                m.extend_from_slice(&[0xff; 11]);
                image_file(CORE_MAGIC, true, &[m])
            }),
        ];
        for (file, want, bytes) in cases {
            let dir = tempfile::tempdir().unwrap();
            write_image(dir.path(), &[(1, &[])], &root_creds(), 0);
            fs::write(dir.path().join(file), &bytes).unwrap();
            let err = read_facts(dir.path()).unwrap_err().to_string();
            assert!(err.contains(want), "{file}: want {want:?}: {err}");
        }
    }

    /// What is wrong stays typed up to the caller, with the file it is in: a file cut short
    /// says where its last entry would have ended.
    #[test]
    fn errors_keep_their_kind_and_file() {
        let dir = tempfile::tempdir().unwrap();
        write_image(dir.path(), &[(1, &[])], &root_creds(), 0);
        let core = fs::read(dir.path().join("core-1.img")).unwrap();
        fs::write(dir.path().join("core-1.img"), &core[..core.len() - 1]).unwrap();
        match read_facts(dir.path()).unwrap_err() {
            CriuImageError::Invalid {
                path,
                source: FactsError::Decode(DecodeError::EntryPastEnd { offset, len, left }),
            } => {
                assert_eq!(path, dir.path().join("core-1.img"));
                assert_eq!((offset, left + 1), (8, len));
            }
            other => panic!("{other}"),
        }
        write_image(dir.path(), &[(1, &[])], &root_creds(), 0);
        fs::write(
            dir.path().join("pstree.img"),
            image_file(PSTREE_MAGIC, true, &[]),
        )
        .unwrap();
        let err = read_facts(dir.path()).unwrap_err();
        assert!(
            matches!(&err, CriuImageError::Invalid { source: FactsError::NoTasks, path } if path.ends_with("pstree.img")),
            "{err}"
        );
        fs::write(dir.path().join("pstree.img"), vec![0; 9 << 20]).unwrap();
        let err = read_facts(dir.path()).unwrap_err();
        assert!(
            matches!(err, CriuImageError::TooLarge { len, .. } if len == 9 << 20),
            "{err}"
        );
    }

    #[test]
    fn missing_credential_fields_and_wide_cap_sets_are_refused() {
        let mut partial = Vec::new();
        varint_field(&mut partial, 1, 0);
        varint_field(&mut partial, 2, 0);
        let err = parse_creds(&partial).unwrap_err();
        assert_eq!(err, FactsError::PartialCredentials);
        assert!(err.to_string().contains("without all of"), "{err}");
        let mut wide = creds(&root_creds());
        varint_field(&mut wide, 9, 0);
        varint_field(&mut wide, 9, 0);
        varint_field(&mut wide, 9, 1);
        let err = parse_creds(&wide).unwrap_err();
        assert_eq!(err, FactsError::WideCapSet("cap_inh"));
        assert!(err.to_string().contains("beyond bit 63"), "{err}");
    }

    #[test]
    fn packed_repeated_fields_are_read() {
        let mut m = Vec::new();
        for number in 1..=8 {
            varint_field(&mut m, number, 0);
        }
        let mut packed = Vec::new();
        put_varint(&mut packed, 0xffff_ffff);
        put_varint(&mut packed, 0x1ff);
        bytes_field(&mut m, 11, &packed);
        let c = parse_creds(&m).unwrap();
        assert_eq!(c.cap_eff, 0x1ff_ffff_ffff);
    }

    #[test]
    fn files_that_are_not_plain_or_too_large_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_image(dir.path(), &[(1, &[])], &root_creds(), 0);
        fs::remove_file(dir.path().join("pstree.img")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("pstree.img")).unwrap();
        assert!(read_facts(dir.path()).is_err());
        fs::remove_file(dir.path().join("pstree.img")).unwrap();
        nix::unistd::mkfifo(
            &dir.path().join("pstree.img"),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        // A FIFO must not block the reader.
        let err = read_facts(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        fs::remove_file(dir.path().join("pstree.img")).unwrap();
        let f = fs::File::create(dir.path().join("pstree.img")).unwrap();
        f.set_len(MAX_DESCRIPTOR_FILE + 1).unwrap();
        let err = read_facts(dir.path()).unwrap_err().to_string();
        assert!(err.contains("more than"), "{err}");
    }
}
