//! What the kernel holds of a restored task that `/proc` does not show (its securebits and its
//! seccomp filter programs), and the filter program runc installs for a spec, to compare them
//! with.
//!
//! **Reading.** While CRIU holds a restored tree at `pre-resume`, CRIU is every task's tracer,
//! so `PTRACE_SECCOMP_GET_FILTER` is not the shim's to call. The kernel keeps each filter's
//! classic-BPF program as it was installed (`bpf_prog.orig_prog`, kept on kernels built with
//! checkpoint/restore, which CRIU needs anyway), and a BPF task iterator
//! (`bpf-programs/restored.bpf.c`) can read it: for every thread of the listed processes it
//! writes one record (securebits, seccomp mode, filter count) and the program of one filter,
//! chosen by its index counted from the oldest. [`read`] asks for index 0 first, then 1, 2, ..
//! only for threads still without a match, up to [`PASSES_MAX`] filters.
//!
//! **The reference.** A spec's seccomp profile is compiled by runc (libseccomp plus runc's own
//! patching of the program), so the only faithful source of "runc's filter for this spec" is
//! runc itself: [`reference`] creates a throwaway container (`runc create` of an empty rootfs
//! whose process never starts, with the spec's `linux.seccomp` and no_new_privs off, so that
//! runc's init installs the filter before it waits to be started), reads the filter of its init
//! with the same iterator, and deletes it. The program is cached by the profile's digest and
//! the runc binary's identity, in memory and in a root-only directory, so a host pays one probe
//! (~100 ms) per profile and runc version.
//!
//! **The rule** (in [`super::kernel::judge`]): runc's program must be among the filters of
//! every live restored thread: byte for byte but for runc's ENOSYS stub, whose architecture
//! sections runc orders differently from run to run ([`decides_as`] says what a stub may
//! hold). Filters are stacked and the kernel applies the
//! most restrictive verdict of all of them, so any other filter only narrows what runc's
//! allows; an image that swaps runc's filter for an allow-all one is refused. A profile that
//! hands syscalls to a listener (`SCMP_ACT_NOTIFY`) is not compared (the probe would need the
//! listener) and says so in the log.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::{Read, Write},
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use aya::{
    maps::{Array, HashMap as BpfHashMap},
    programs::Iter,
    Btf, Ebpf, EbpfLoader, Pod,
};
use oci_spec::runtime::{LinuxSeccomp, LinuxSeccompAction, Spec};
use sha2::{Digest, Sha256};

use crate::runc::{ChildStdio, OciRuntime as _, Runc};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/restored.bpf.o"));

const PROGRAM: &str = "crab_restored_task";
const MAP_TGIDS: &str = "crab_restored_tgids";
const MAP_PARAMS: &str = "crab_restored_params";

/// `RESTORED_MAGIC` of `restored.h`.
const MAGIC: u32 = 0x6372_6231;
/// `sizeof(struct restored_record)`.
pub const RECORD_LEN: usize = 40;
/// `RESTORED_INSNS_MAX`: the longest program a record carries (a longer one is never runc's).
pub const INSNS_MAX: usize = 4000;
/// `RESTORED_TGIDS_MAX`.
const TGIDS_MAX: usize = 65_536;
/// `restored_record.len` values that mean no program follows.
pub const NO_FILTER: i32 = -1;
pub const NO_PROGRAM: i32 = -2;
pub const PROGRAM_TOO_LONG: i32 = -3;
pub const CHAIN_TOO_LONG: i32 = -4;
/// How many filters of one thread, oldest first, are compared with the reference.
pub const PASSES_MAX: u32 = 64;
/// The most an iterator pass may produce (65,536 threads with a short program each).
const PASS_BYTES_MAX: u64 = 256 << 20;
/// How long the reference probe's runc may take per step.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// What is wrong with the task iterator's output ([`parse_records`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("a truncated record ({0} bytes)")]
    Truncated(usize),
    #[error("a record without the magic ({0:#x})")]
    NoMagic(u32),
    #[error("a record with length {0}")]
    Length(i32),
    #[error("a record of thread {tid} cut short ({have} of {want} program bytes)")]
    CutShort { tid: u32, have: usize, want: usize },
}

/// Why the task iterator could not read the restored threads ([`read`]).
#[derive(Debug, thiserror::Error)]
pub enum IteratorError {
    #[error("the kernel's BTF: {0}")]
    Btf(#[source] aya::BtfError),
    #[error("loading the task iterator: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    #[error("no program {PROGRAM}")]
    NoProgram,
    /// The iterator program could not be loaded, attached or linked.
    #[error("{what}{PROGRAM}: {source}")]
    Program {
        /// "loading " for the load, empty otherwise.
        what: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("{PROGRAM}: creating the iterator: {0}")]
    Link(#[source] aya::programs::links::LinkError),
    #[error("no map {0}")]
    NoMap(&'static str),
    #[error("{name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("reading the task iterator: {0}")]
    Read(#[source] std::io::Error),
    #[error(transparent)]
    Records(#[from] RecordError),
    #[error("more than {TGIDS_MAX} processes")]
    TooManyProcesses,
    #[error("thread {tid} reported filter {index} in pass {pass}")]
    OtherIndex { tid: u32, index: u32, pass: u32 },
    #[error("thread {0} changed between passes")]
    Changed(u32),
}

impl IteratorError {
    fn program(source: aya::programs::ProgramError) -> IteratorError {
        IteratorError::Program { what: "", source }
    }

    fn map(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> IteratorError {
        move |source| IteratorError::Map { name, source }
    }
}

/// Why runc's seccomp program for a spec is not known ([`reference`]).
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    #[error("{} is not on PATH", .0.display())]
    NotOnPath(PathBuf),
    #[error("{}: {source}", path.display())]
    Runc {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the seccomp profile: {0}")]
    Profile(#[source] serde_json::Error),
    #[error("learning runc's seccomp program for the spec: {0}")]
    Probe(#[source] ProbeError),
}

/// Why the probe container did not give runc's program ([`probe`]).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("making the probe bundle {}: {source}", bundle.display())]
    Bundle {
        bundle: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("runc create took over {PROBE_TIMEOUT:?}")]
    CreateTimedOut,
    #[error("runc create: {0}")]
    Create(#[source] crate::runc::RuncError),
    #[error("runc wrote no init pid")]
    NoPid,
    #[error("reading the probe: {0}")]
    Task(#[source] tokio::task::JoinError),
    #[error(transparent)]
    Iterator(#[from] IteratorError),
    #[error("the probe's init {0} is not in the iterator")]
    NotIterated(u32),
    #[error("runc's init has {0} filters, none installed by runc")]
    NoFilter(u32),
    #[error("runc's filter is unreadable ({0})")]
    Unreadable(i32),
}

/// `struct restored_params`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    index: u32,
    pad: u32,
}
// SAFETY: two u32, no padding, any bit pattern valid.
unsafe impl Pod for Params {}

/// One record of the iterator: a thread and, where `len > 0`, one of its filter programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub tid: u32,
    pub tgid: u32,
    pub securebits: u32,
    pub filter_count: u32,
    /// Which filter the program is, counted from the oldest.
    pub index: u32,
    /// Instructions of the program, or one of [`NO_FILTER`] .. [`CHAIN_TOO_LONG`].
    pub len: i32,
    pub exit_state: i32,
    pub seccomp_mode: i32,
    /// `len * 8` bytes of `struct sock_filter`, as installed.
    pub program: Option<Vec<u8>>,
}

/// Splits an iterator's output into records. The bytes are the kernel's (written by crab's own
/// program), but are read as if they were not: every length is checked.
pub fn parse_records(mut bytes: &[u8]) -> Result<Vec<Record>, RecordError> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < RECORD_LEN {
            return Err(RecordError::Truncated(bytes.len()));
        }
        let word = |i: usize| u32::from_ne_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
        if word(0) != MAGIC {
            return Err(RecordError::NoMagic(word(0)));
        }
        let len = word(6) as i32;
        let program_bytes = match len {
            n if n > 0 && n as usize <= INSNS_MAX => n as usize * 8,
            NO_FILTER | NO_PROGRAM | PROGRAM_TOO_LONG | CHAIN_TOO_LONG => 0,
            n => return Err(RecordError::Length(n)),
        };
        if bytes.len() < RECORD_LEN + program_bytes {
            return Err(RecordError::CutShort {
                tid: word(1),
                have: bytes.len() - RECORD_LEN,
                want: program_bytes,
            });
        }
        out.push(Record {
            tid: word(1),
            tgid: word(2),
            securebits: word(3),
            filter_count: word(4),
            index: word(5),
            len,
            exit_state: word(7) as i32,
            seccomp_mode: word(8) as i32,
            program: (program_bytes > 0)
                .then(|| bytes[RECORD_LEN..RECORD_LEN + program_bytes].to_vec()),
        });
        bytes = &bytes[RECORD_LEN + program_bytes..];
    }
    Ok(out)
}

/// One thread as the task iterator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSecurity {
    pub tgid: u32,
    pub securebits: u32,
    pub seccomp_mode: i32,
    pub filter_count: u32,
    /// Exiting or dead: it runs nothing of its own again.
    pub exiting: bool,
    /// Whether the reference program is among its filters (`None`: no reference asked for).
    pub holds_reference: Option<bool>,
    /// Filters looked at for the reference (oldest first).
    pub compared: u32,
}

/// Classic-BPF opcodes a runc stub is made of (`<linux/filter.h>`).
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_JMP_JGT_K: u16 = 0x25;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_JMP_JSET_K: u16 = 0x45;
const BPF_RET_K: u16 = 0x06;
/// `struct seccomp_data`: offsets of `nr` and `arch`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

/// One classic-BPF instruction (`struct sock_filter`) as the kernel keeps it.
pub fn encode_insn(code: u16, jt: u8, jf: u8, k: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..2].copy_from_slice(&code.to_ne_bytes());
    b[2] = jt;
    b[3] = jf;
    b[4..].copy_from_slice(&k.to_ne_bytes());
    b
}

fn insn(program: &[u8], i: usize) -> (u16, u8, u8, u32) {
    let b = &program[i * 8..i * 8 + 8];
    (
        u16::from_ne_bytes([b[0], b[1]]),
        b[2],
        b[3],
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
    )
}

/// A return value that denies: SECCOMP_RET_KILL_PROCESS, KILL_THREAD, TRAP or ERRNO (the
/// kernel's most restrictive actions; never ALLOW, LOG, TRACE or USER_NOTIF).
fn denies(ret: u32) -> bool {
    matches!(
        ret & 0xffff_0000,
        0x8000_0000 | 0x0000_0000 | 0x0003_0000 | 0x0005_0000
    )
}

/// `SECCOMP_RET_ERRNO | ENOSYS`: what runc's stub answers.
const RET_ENOSYS: u32 = 0x0005_0000 | 38;

/// Whether `program`'s first `len` instructions are only stub instructions (loads of the
/// syscall number or architecture, comparisons with constants, forward jumps, denials), none
/// jumping past `len`.
fn stub_prefix_ok(program: &[u8], len: usize) -> bool {
    let mut reach = 0usize;
    for i in 0..len {
        let (code, jt, jf, k) = insn(program, i);
        let ok = match code {
            BPF_LD_W_ABS => k == DATA_NR || k == DATA_ARCH,
            BPF_JMP_JA => {
                reach = reach.max(i + 1 + k as usize);
                true
            }
            BPF_JMP_JEQ_K | BPF_JMP_JGT_K | BPF_JMP_JGE_K | BPF_JMP_JSET_K => {
                reach = reach.max(i + 1 + jt.max(jf) as usize);
                true
            }
            BPF_RET_K => denies(k),
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    reach <= len
}

/// Where libseccomp's program begins in runc's `program`: after runc's ENOSYS stub, a prefix
/// of stub instructions ending in `ret ENOSYS`, followed by libseccomp's first instruction
/// (the load of the architecture it checks first). `None`: no stub.
fn stub_end(program: &[u8]) -> Option<usize> {
    let n = program.len() / 8;
    (1..n).find(|&l| {
        insn(program, l - 1) == (BPF_RET_K, 0, 0, RET_ENOSYS)
            && insn(program, l) == (BPF_LD_W_ABS, 0, 0, DATA_ARCH)
            && stub_prefix_ok(program, l)
    })
}

/// Whether `candidate` (a restored filter) is `reference` (runc's program for the spec) up to
/// runc's ENOSYS stub.
///
/// runc's program is its stub (which answers ENOSYS for syscalls newer than the profile knows,
/// per architecture) followed by libseccomp's whole compilation of the profile, and runc emits
/// the stub's architecture sections in Go map order: two runs of runc on one profile give
/// programs that differ in their first dozen instructions (seen: containerd's default profile,
/// 1,251 instructions, stubs differing in 10). So the rule is byte equality, or: the same
/// length, byte-identical from where libseccomp's program begins in the reference (found in
/// the reference, never in the candidate), and before that only stub instructions that load the
/// syscall number or architecture, compare them with constants, deny, or jump forward no
/// further than libseccomp's first instruction. libseccomp's program is a whole filter (it
/// checks the architecture first and decides every syscall itself), so every syscall is denied
/// by the candidate's stub or decided by the spec's own compiled profile from its start.
pub fn decides_as(candidate: &[u8], reference: &[u8]) -> bool {
    if candidate == reference {
        return true;
    }
    if candidate.len() != reference.len() || !valid_program(reference) {
        return false;
    }
    let Some(l) = stub_end(reference) else {
        return false;
    };
    candidate[l * 8..] == reference[l * 8..] && stub_prefix_ok(candidate, l)
}

/// Finds, for every thread `pass(0)` reports, whether `reference` is among its filters: pass
/// `i` reports each thread's filter `i` (from the oldest). Passes go on only while some
/// thread is unmatched and has more filters, up to [`PASSES_MAX`].
pub fn search(
    reference: Option<&[u8]>,
    mut pass: impl FnMut(u32) -> Result<Vec<Record>, IteratorError>,
) -> Result<BTreeMap<u32, ThreadSecurity>, IteratorError> {
    let mut threads: BTreeMap<u32, ThreadSecurity> = BTreeMap::new();
    for index in 0..PASSES_MAX {
        let pending = |threads: &BTreeMap<u32, ThreadSecurity>| {
            threads
                .values()
                .any(|t| t.holds_reference == Some(false) && t.filter_count > index)
        };
        if index > 0 && (reference.is_none() || !pending(&threads)) {
            break;
        }
        for r in pass(index)? {
            if r.index != index {
                return Err(IteratorError::OtherIndex {
                    tid: r.tid,
                    index: r.index,
                    pass: index,
                });
            }
            let matched = match (reference, &r.program) {
                (Some(want), Some(have)) => decides_as(have, want),
                _ => false,
            };
            let t = threads.entry(r.tid).or_insert_with(|| ThreadSecurity {
                tgid: r.tgid,
                securebits: r.securebits,
                seccomp_mode: r.seccomp_mode,
                filter_count: r.filter_count,
                exiting: r.exit_state != 0,
                holds_reference: reference.map(|_| false),
                compared: 0,
            });
            if index > 0 && (t.tgid != r.tgid || t.filter_count != r.filter_count) {
                return Err(IteratorError::Changed(r.tid));
            }
            if r.index < r.filter_count {
                t.compared = r.index + 1;
            }
            if matched {
                t.holds_reference = Some(true);
            }
        }
    }
    Ok(threads)
}

/// The loaded iterator (one per shim, loaded on first use).
struct Reader {
    ebpf: Ebpf,
}

static READER: Mutex<Option<Reader>> = Mutex::new(None);

impl Reader {
    fn load() -> Result<Reader, IteratorError> {
        let btf = Btf::from_sys_fs().map_err(IteratorError::Btf)?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .load(OBJECT)
            .map_err(|e| IteratorError::Load(Box::new(e)))?;
        let prog: &mut Iter = ebpf
            .program_mut(PROGRAM)
            .ok_or(IteratorError::NoProgram)?
            .try_into()
            .map_err(IteratorError::program)?;
        prog.load("task", &btf)
            .map_err(|source| IteratorError::Program {
                what: "loading ",
                source,
            })?;
        Ok(Reader { ebpf })
    }

    fn tgids(&mut self) -> Result<BpfHashMap<&mut aya::maps::MapData, u32, u32>, IteratorError> {
        let map = self
            .ebpf
            .map_mut(MAP_TGIDS)
            .ok_or(IteratorError::NoMap(MAP_TGIDS))?;
        BpfHashMap::try_from(map).map_err(IteratorError::map(MAP_TGIDS))
    }

    fn pass(&mut self, index: u32) -> Result<Vec<Record>, IteratorError> {
        {
            let map = self
                .ebpf
                .map_mut(MAP_PARAMS)
                .ok_or(IteratorError::NoMap(MAP_PARAMS))?;
            let mut params: Array<_, Params> =
                Array::try_from(map).map_err(IteratorError::map(MAP_PARAMS))?;
            params
                .set(0, Params { index, pad: 0 }, 0)
                .map_err(IteratorError::map(MAP_PARAMS))?;
        }
        let prog: &mut Iter = self
            .ebpf
            .program_mut(PROGRAM)
            .ok_or(IteratorError::NoProgram)?
            .try_into()
            .map_err(IteratorError::program)?;
        let id = prog.attach().map_err(IteratorError::program)?;
        let link = prog.take_link(id).map_err(IteratorError::program)?;
        let file = link.into_file().map_err(IteratorError::Link)?;
        let mut bytes = Vec::new();
        file.take(PASS_BYTES_MAX)
            .read_to_end(&mut bytes)
            .map_err(IteratorError::Read)?;
        Ok(parse_records(&bytes)?)
    }
}

/// Reads every thread of processes `tgids` (host pids) from the kernel, and whether
/// `reference` (a filter program) is among each one's seccomp filters. Threads of other
/// processes are never reported.
pub fn read(
    tgids: &[u32],
    reference: Option<&[u8]>,
) -> Result<BTreeMap<u32, ThreadSecurity>, IteratorError> {
    with_reader(tgids, |reader| {
        search(reference, |index| reader.pass(index))
    })
}

/// Loads the task iterator now if it is not yet (~60 ms, mostly parsing the kernel's BTF), so
/// that the kernel check, which holds CRIU at pre-resume, does not pay for it. Called off the
/// critical path while CRIU restores.
pub fn preload() -> Result<(), IteratorError> {
    let mut guard = READER.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(Reader::load()?);
    }
    Ok(())
}

/// Runs `f` with the iterator listing `tgids` only (loaded on first use, one user at a time).
fn with_reader<T>(
    tgids: &[u32],
    f: impl FnOnce(&mut Reader) -> Result<T, IteratorError>,
) -> Result<T, IteratorError> {
    if tgids.len() > TGIDS_MAX {
        return Err(IteratorError::TooManyProcesses);
    }
    let mut guard = READER.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(Reader::load()?);
    }
    let reader = guard.as_mut().expect("loaded above");
    let listed = (|| {
        let mut map = reader.tgids()?;
        for &tgid in tgids {
            map.insert(tgid, 0, 0)
                .map_err(IteratorError::map(MAP_TGIDS))?;
        }
        Ok::<_, IteratorError>(())
    })();
    let result = listed.and_then(|()| f(reader));
    // Always emptied, whatever failed: the next read lists its own processes only.
    if let Ok(mut map) = reader.tgids() {
        for tgid in tgids {
            let _ = map.remove(tgid);
        }
    }
    result
}

/// What a restored thread's filters are compared with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Reference {
    /// The spec sets no seccomp profile: nothing to find.
    #[default]
    NoProfile,
    /// The program runc installs for the spec's profile.
    Program(Arc<Vec<u8>>),
    /// Not compared, and why (the log says it).
    NotCompared(String),
}

impl Reference {
    pub fn program(&self) -> Option<&[u8]> {
        match self {
            Reference::Program(p) => Some(p.as_slice()),
            _ => None,
        }
    }
}

/// The programs already learnt by this shim, by cache key.
static LEARNT: Mutex<Option<HashMap<String, Arc<Vec<u8>>>>> = Mutex::new(None);
static PROBES: AtomicU64 = AtomicU64::new(0);

/// The seccomp program runc installs for `spec` (see the module doc): from this shim's memory,
/// else from `cache_dir`, else learnt by a probe container run with `runc`'s binary.
pub async fn reference(
    spec: &Spec,
    runc: &Runc,
    cache_dir: &Path,
) -> Result<Reference, ReferenceError> {
    let Some(profile) = spec.linux().as_ref().and_then(|l| l.seccomp().clone()) else {
        return Ok(Reference::NoProfile);
    };
    if notifies(&profile) {
        return Ok(Reference::NotCompared(
            "the seccomp profile hands syscalls to a listener (SCMP_ACT_NOTIFY)".into(),
        ));
    }
    let key = cache_key(&profile, &runc.binary)?;
    if let Some(p) = LEARNT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(Reference::Program(p.clone()));
    }
    let file = cache_dir.join(format!("{key}.bpf"));
    let program = match read_cached(&file) {
        Some(p) => p,
        None => {
            let started = std::time::Instant::now();
            let p = probe(&profile, runc, cache_dir)
                .await
                .map_err(ReferenceError::Probe)?;
            log::info!(
                "learnt runc's seccomp program for profile {} ({} instructions) in {:?}",
                &key[..12],
                p.len() / 8,
                started.elapsed()
            );
            if let Err(e) = write_cached(&file, &p) {
                log::warn!("caching runc's seccomp program in {}: {e}", file.display());
            }
            p
        }
    };
    let program = Arc::new(program);
    LEARNT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, program.clone());
    Ok(Reference::Program(program))
}

fn notifies(profile: &LinuxSeccomp) -> bool {
    profile.default_action() == LinuxSeccompAction::ScmpActNotify
        || profile
            .syscalls()
            .iter()
            .flatten()
            .any(|s| s.action() == LinuxSeccompAction::ScmpActNotify)
}

/// The profile (as JSON) and the runc binary's identity: a new runc may compile otherwise.
fn cache_key(profile: &LinuxSeccomp, runc: &Path) -> Result<String, ReferenceError> {
    let runc = resolve(runc)?;
    let meta = fs::metadata(&runc).map_err(|source| ReferenceError::Runc {
        path: runc.clone(),
        source,
    })?;
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(profile).map_err(ReferenceError::Profile)?);
    h.update(runc.as_os_str().as_encoded_bytes());
    for n in [
        meta.dev(),
        meta.ino(),
        meta.len(),
        meta.mtime() as u64,
        meta.mtime_nsec() as u64,
    ] {
        h.update(n.to_le_bytes());
    }
    h.update(std::env::consts::ARCH.as_bytes());
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A bare binary name found on PATH, as runc would be run.
fn resolve(binary: &Path) -> Result<PathBuf, ReferenceError> {
    if binary.components().count() > 1 {
        return Ok(binary.to_path_buf());
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
        .ok_or_else(|| ReferenceError::NotOnPath(binary.to_path_buf()))
}

fn valid_program(bytes: &[u8]) -> bool {
    !bytes.is_empty() && bytes.len().is_multiple_of(8) && bytes.len() <= INSNS_MAX * 8
}

fn read_cached(file: &Path) -> Option<Vec<u8>> {
    let meta = fs::symlink_metadata(file).ok()?;
    // Root's own file only (the directory is root's and 0700 too).
    if !meta.is_file() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
        return None;
    }
    let bytes = fs::read(file).ok()?;
    valid_program(&bytes).then_some(bytes)
}

fn write_cached(file: &Path, program: &[u8]) -> std::io::Result<()> {
    let dir = file.parent().expect("a file in the cache directory");
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(program)?;
    f.sync_all()?;
    fs::rename(&tmp, file)
}

/// The filters the shim itself runs under: runc's init (and CRIU) inherit them, below runc's.
fn own_filters() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Seccomp_filters:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The id of shim `pid`'s `n`th probe container (also its bundle's name in the cache dir).
pub fn probe_id(pid: u32, n: u64) -> String {
    format!("{PROBE_PREFIX}{pid}-{n}")
}

const PROBE_PREFIX: &str = "crab-seccomp-probe-";

/// Writes the probe's bundle: an empty rootfs whose process never starts, runc's init
/// installing `profile`'s filter before it waits to be started (no_new_privs off).
pub fn write_probe_bundle(bundle: &Path, id: &str, profile: &LinuxSeccomp) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(bundle.join("rootfs/proc"))?;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(bundle.join("rootfs/crab-seccomp-probe"))?;
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": ["/crab-seccomp-probe"],
            "env": [],
            "cwd": "/",
            "noNewPrivileges": false,
        },
        "root": {"path": "rootfs"},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {
            "namespaces": [{"type": "mount"}, {"type": "pid"}],
            "cgroupsPath": format!("/{id}"),
            "seccomp": profile,
        },
    });
    fs::write(
        bundle.join("config.json"),
        serde_json::to_vec(&config).map_err(std::io::Error::other)?,
    )
}

/// runc as the probe `id` in `bundle` runs it (its state inside the bundle).
fn probe_runc(runc: &Runc, bundle: &Path) -> Runc {
    Runc {
        binary: runc.binary.clone(),
        root: bundle.join("runc"),
        systemd_cgroup: false,
        log: bundle.join("log.json"),
        no_pivot_root: runc.no_pivot_root,
        no_new_keyring: true,
        io_owner: None,
        merge_memory: false,
    }
}

/// Removes the probes of shims that died while probing (their runc init waits forever on its
/// FIFO, in a cgroup of its own): each is deleted with runc (`--force`: the init is killed, the
/// cgroup removed), then its bundle. A probe whose shim's pid is alive (or reused) is left.
pub async fn sweep_stale_probes(runc: &Runc, cache_dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(cache_dir) else {
        return 0;
    };
    let mut swept = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PROBE_PREFIX)
            .and_then(|r| r.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let bundle = cache_dir.join(&name);
        let r = probe_runc(runc, &bundle);
        if let Ok(Err(e)) = tokio::time::timeout(PROBE_TIMEOUT, r.delete(&name, true)).await {
            if !e.is_gone() {
                log::warn!("sweeping the stale seccomp probe {name}: {e}");
            }
        }
        match fs::remove_dir_all(&bundle) {
            Ok(()) => swept += 1,
            Err(e) => log::warn!("sweeping the stale seccomp probe {name}: {e}"),
        }
    }
    swept
}

/// Learns runc's program for `profile` from a container that never starts (module doc).
async fn probe(
    profile: &LinuxSeccomp,
    runc: &Runc,
    cache_dir: &Path,
) -> Result<Vec<u8>, ProbeError> {
    let swept = sweep_stale_probes(runc, cache_dir).await;
    if swept > 0 {
        log::info!("swept {swept} seccomp probes left by shims that died while probing");
    }
    let id = probe_id(std::process::id(), PROBES.fetch_add(1, Ordering::Relaxed));
    let bundle = cache_dir.join(&id);
    let made = write_probe_bundle(&bundle, &id, profile);
    let result = match made {
        Err(source) => Err(ProbeError::Bundle {
            bundle: bundle.clone(),
            source,
        }),
        Ok(()) => {
            let runc = probe_runc(runc, &bundle);
            let pid_file = bundle.join("pid");
            let created = tokio::time::timeout(
                PROBE_TIMEOUT,
                runc.create(&id, &bundle, &pid_file, None, ChildStdio::null()),
            )
            .await;
            let learnt = match created {
                Err(_) => Err(ProbeError::CreateTimedOut),
                Ok(Err(e)) => Err(ProbeError::Create(e)),
                Ok(Ok(())) => {
                    let pid = fs::read_to_string(&pid_file)
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok())
                        .ok_or(ProbeError::NoPid);
                    match pid {
                        Err(e) => Err(e),
                        Ok(pid) => tokio::task::spawn_blocking(move || init_program(pid))
                            .await
                            .map_err(ProbeError::Task)
                            .and_then(|r| r),
                    }
                }
            };
            match tokio::time::timeout(PROBE_TIMEOUT, runc.delete(&id, true)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => log::warn!("deleting the seccomp probe container {id}: {e}"),
                Err(_) => log::warn!("deleting the seccomp probe container {id}: timed out"),
            }
            learnt
        }
    };
    let _ = fs::remove_dir_all(&bundle);
    result
}

/// The first filter runc's init `pid` installed itself (above the ones it inherited).
fn init_program(pid: u32) -> Result<Vec<u8>, ProbeError> {
    let records = with_reader(&[pid], |reader| reader.pass(own_filters()))?;
    let r = records
        .into_iter()
        .find(|r| r.tid == pid)
        .ok_or(ProbeError::NotIterated(pid))?;
    match (r.len, r.program) {
        (n, Some(p)) if n > 0 => Ok(p),
        (NO_FILTER, _) => Err(ProbeError::NoFilter(r.filter_count)),
        (n, _) => Err(ProbeError::Unreadable(n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tid: u32, index: u32, count: u32, program: Option<&[u8]>) -> Record {
        Record {
            tid,
            tgid: tid,
            securebits: 0,
            filter_count: count,
            index,
            len: program.map_or(NO_FILTER, |p| (p.len() / 8) as i32),
            exit_state: 0,
            seccomp_mode: 2,
            program: program.map(<[u8]>::to_vec),
        }
    }

    fn encode(r: &Record) -> Vec<u8> {
        let mut out = Vec::new();
        for w in [
            MAGIC,
            r.tid,
            r.tgid,
            r.securebits,
            r.filter_count,
            r.index,
            r.len as u32,
            r.exit_state as u32,
            r.seccomp_mode as u32,
            0,
        ] {
            out.extend(w.to_ne_bytes());
        }
        out.extend(r.program.iter().flatten());
        out
    }

    #[test]
    fn records_round_trip_and_bad_lengths_are_errors() {
        let runc = [7u8; 16];
        let a = record(10, 0, 2, Some(&runc));
        let b = record(11, 0, 0, None);
        let bytes = [encode(&a), encode(&b)].concat();
        assert_eq!(parse_records(&bytes).unwrap(), vec![a.clone(), b]);
        // Cut anywhere inside a record: an error, never a shorter program.
        for cut in 1..bytes.len() {
            if cut == encode(&a).len() {
                continue;
            }
            assert!(parse_records(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = encode(&a);
        bad[24..28].copy_from_slice(&(INSNS_MAX as u32 + 1).to_ne_bytes());
        assert_eq!(
            parse_records(&bad).unwrap_err(),
            RecordError::Length(INSNS_MAX as i32 + 1)
        );
        let mut bad = encode(&a);
        bad[24..28].copy_from_slice(&(-9i32).to_ne_bytes());
        assert_eq!(
            parse_records(&bad).unwrap_err().to_string(),
            "a record with length -9"
        );
        let mut bad = encode(&a);
        bad[0] ^= 1;
        assert!(parse_records(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
    }

    #[test]
    fn the_reference_is_searched_oldest_first_and_only_as_deep_as_needed() {
        let runc = vec![1u8; 8];
        let allow_all = vec![2u8; 8];
        let agent = vec![3u8; 8];
        // Thread 1: runc's filter oldest, one of the agent's on top. Thread 2: an image's
        // allow-all filter instead of runc's, with a second on top. Thread 3: none.
        let passes = |index: u32| -> Vec<Record> {
            match index {
                0 => vec![
                    record(1, 0, 2, Some(&runc)),
                    record(2, 0, 2, Some(&allow_all)),
                    record(3, 0, 0, None),
                ],
                1 => vec![
                    record(1, 1, 2, Some(&agent)),
                    record(2, 1, 2, Some(&agent)),
                    record(3, 1, 0, None),
                ],
                _ => panic!("pass {index} asked for: no thread has a third filter"),
            }
        };
        let mut asked = Vec::new();
        let t = search(Some(&runc), |i| {
            asked.push(i);
            Ok(passes(i))
        })
        .unwrap();
        assert_eq!(asked, [0, 1]);
        assert_eq!(t[&1].holds_reference, Some(true));
        assert_eq!(t[&2].holds_reference, Some(false));
        assert_eq!(t[&2].compared, 2);
        assert_eq!(t[&3].holds_reference, Some(false));
        // Everyone matched at once: one pass. No reference: one pass.
        let mut asked = 0;
        search(Some(&runc), |i| {
            asked += 1;
            Ok(vec![record(1, i, 3, Some(&runc))])
        })
        .unwrap();
        assert_eq!(asked, 1);
        let t = search(None, |i| Ok(vec![record(1, i, 3, Some(&runc))])).unwrap();
        assert_eq!(t[&1].holds_reference, None);
        // A record for another index than asked: an error.
        assert!(matches!(
            search(Some(&runc), |_| Ok(vec![record(1, 5, 9, None)])),
            Err(IteratorError::OtherIndex {
                tid: 1,
                index: 5,
                pass: 0
            })
        ));
    }

    #[test]
    fn the_search_stops_at_the_pass_bound() {
        let runc = vec![1u8; 8];
        let other = vec![2u8; 8];
        let mut asked = 0;
        let t = search(Some(&runc), |i| {
            asked += 1;
            Ok(vec![record(1, i, 10_000, Some(&other))])
        })
        .unwrap();
        assert_eq!(asked, PASSES_MAX);
        assert_eq!(t[&1].holds_reference, Some(false));
        assert_eq!(t[&1].compared, PASSES_MAX);
    }

    fn hex_program(text: &str) -> Vec<u8> {
        text.split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect()
    }

    /// Two ENOSYS stubs runc 1.3 emitted for one profile (x86_64, x86, x32) in two runs: the
    /// same sections in another order. Each ends in `ret ENOSYS` and jumps to instruction 14.
    const STUB_A: &str = "20 00 00 00 04 00 00 00  15 00 07 00 03 00 00 40
        15 00 01 00 3e 00 00 c0  05 00 00 00 0a 00 00 00  20 00 00 00 00 00 00 00
        45 00 01 00 00 00 00 40  25 00 06 01 c8 01 00 00  25 00 05 00 23 02 00 40
        05 00 00 00 05 00 00 00  20 00 00 00 00 00 00 00  25 00 02 00 c8 01 00 00
        05 00 00 00 02 00 00 00  05 00 00 00 01 00 00 00  06 00 00 00 26 00 05 00";
    const STUB_B: &str = "20 00 00 00 04 00 00 00  15 00 02 00 03 00 00 40
        15 00 04 00 3e 00 00 c0  05 00 00 00 0a 00 00 00  20 00 00 00 00 00 00 00
        25 00 07 00 c8 01 00 00  05 00 00 00 07 00 00 00  20 00 00 00 00 00 00 00
        45 00 01 00 00 00 00 40  25 00 03 01 c8 01 00 00  25 00 02 00 23 02 00 40
        05 00 00 00 02 00 00 00  05 00 00 00 01 00 00 00  06 00 00 00 26 00 05 00";

    /// A small libseccomp-like program: kill on a foreign architecture, deny syscall 2, allow
    /// the rest.
    fn tail() -> Vec<u8> {
        [
            (BPF_LD_W_ABS, 0, 0, DATA_ARCH),
            (BPF_JMP_JEQ_K, 1, 0, 0xc000_003e),
            (BPF_RET_K, 0, 0, 0x8000_0000),
            (BPF_LD_W_ABS, 0, 0, DATA_NR),
            (BPF_JMP_JEQ_K, 0, 1, 2),
            (BPF_RET_K, 0, 0, 0x0005_0001),
            (BPF_RET_K, 0, 0, 0x7fff_0000),
        ]
        .iter()
        .flat_map(|&(c, jt, jf, k)| encode_insn(c, jt, jf, k))
        .collect()
    }

    fn set(program: &mut [u8], i: usize, (code, jt, jf, k): (u16, u8, u8, u32)) {
        program[i * 8..i * 8 + 8].copy_from_slice(&encode_insn(code, jt, jf, k));
    }

    #[test]
    fn runc_s_stub_orders_are_the_same_program_and_forged_stubs_are_not() {
        let a = [hex_program(STUB_A), tail()].concat();
        let b = [hex_program(STUB_B), tail()].concat();
        assert_ne!(a, b);
        assert_eq!(stub_end(&a), Some(14));
        assert!(decides_as(&a, &b) && decides_as(&b, &a) && decides_as(&a, &a));
        // A stub that denies everything: stricter, accepted.
        let mut deny_all = a.clone();
        set(&mut deny_all, 0, (BPF_RET_K, 0, 0, 0x8000_0000));
        assert!(decides_as(&deny_all, &b));

        type Edit = Box<dyn Fn(&mut Vec<u8>)>;
        let forged: Vec<(&str, Edit)> = vec![
            // The stub allows instead of ENOSYS.
            (
                "allows",
                Box::new(|p| set(p, 13, (BPF_RET_K, 0, 0, 0x7fff_0000))),
            ),
            (
                "logs",
                Box::new(|p| set(p, 13, (BPF_RET_K, 0, 0, 0x7ffc_0000))),
            ),
            (
                "traces",
                Box::new(|p| set(p, 13, (BPF_RET_K, 0, 0, 0x7ff0_0000))),
            ),
            // A jump past libseccomp's architecture check, into its syscall table.
            (
                "skips the arch check",
                Box::new(|p| set(p, 3, (BPF_JMP_JA, 0, 0, 13))),
            ),
            (
                "jt past the start",
                Box::new(|p| set(p, 1, (BPF_JMP_JEQ_K, 15, 0, 1))),
            ),
            // Anything but stub instructions: an argument load, scratch memory, the X register.
            (
                "loads an argument",
                Box::new(|p| set(p, 4, (BPF_LD_W_ABS, 0, 0, 16))),
            ),
            ("stores", Box::new(|p| set(p, 4, (0x02, 0, 0, 0)))),
            ("uses X", Box::new(|p| set(p, 4, (0x07, 0, 0, 0)))),
            ("returns A", Box::new(|p| set(p, 12, (0x16, 0, 0, 0)))),
            // libseccomp's part altered: syscall 2 allowed.
            (
                "changes the profile",
                Box::new(|p| set(p, 19, (BPF_RET_K, 0, 0, 0x7fff_0000))),
            ),
            (
                "is longer",
                Box::new(|p| p.extend(p[p.len() - 8..].to_vec())),
            ),
            ("is shorter", Box::new(|p| p.truncate(p.len() - 8))),
        ];
        for (what, edit) in forged {
            let mut p = a.clone();
            edit(&mut p);
            assert!(!decides_as(&p, &b), "a stub that {what} was accepted");
        }
        // Without runc's stub in the reference, only byte equality.
        let plain = tail();
        let mut other = plain.clone();
        set(&mut other, 2, (BPF_RET_K, 0, 0, 0));
        assert_eq!(stub_end(&plain), None);
        assert!(decides_as(&plain, &plain) && !decides_as(&other, &plain));
    }

    #[test]
    fn cached_programs_are_root_owned_and_well_formed_only() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cache/k.bpf");
        write_cached(&file, &[1; 16]).unwrap();
        assert_eq!(read_cached(&file), Some(vec![1; 16]));
        for bad in [&[][..], &[1; 7][..], &vec![1; (INSNS_MAX + 1) * 8][..]] {
            fs::write(&file, bad).unwrap();
            assert_eq!(read_cached(&file), None);
        }
        fs::write(&file, [1; 8]).unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&file, fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(
            read_cached(&file),
            None,
            "a group/other-writable cache file"
        );
        fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &file).unwrap();
        assert_eq!(read_cached(&file), None, "a symlink");
    }
}
