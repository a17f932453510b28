//! The decisions of a turn end that need no I/O: from the kernel's counters now and at the
//! mark, from run counts and from the mark's memory images, what the turn must look at again,
//! what it cannot trust, and whether the present can become the mark.
//! [`super::Inspection::observe_since`] gathers (reads counters, scans, captures) and asks
//! these; the decisions over the answer's own findings ([`super::Kind`], [`super::ProcFinding`])
//! are beside those types in `mod.rs`.
//!
//! Where they cannot tell, they answer "changed" (scan, capture, full): a turn answered `none`
//! that changed something loses the user's work after a crash, a needless scan or capture only
//! costs time.

use std::{collections::BTreeMap, path::PathBuf};

use super::{
    bpf::CgroupCounters,
    fs::TreeManifest,
    memory::{MemoryImage, RegionKind},
};

/// Why the counters alone say the turn cannot be observed, in the order a turn says them:
/// there is no mark to compare with (`then` is `None`); kernel events were lost since the mark
/// (the BPF side could not record something, so its counts are incomplete); processes ran
/// without a run count because the container holds its quota of them (`max_bpf_processes`).
/// Without counters now (blind, or unreadable: said where that is learnt) only the first can
/// be said.
pub(super) fn counter_reasons(
    now: Option<&CgroupCounters>,
    then: Option<&CgroupCounters>,
    max_bpf_processes: u64,
) -> Vec<String> {
    let mut degraded = Vec::new();
    if then.is_none() {
        degraded.push("no mark to compare with".into());
    }
    if let (Some(c), Some(m)) = (now, then) {
        if c.errors > m.errors {
            degraded.push(format!(
                "{} kernel events lost since the mark",
                c.errors - m.errors
            ));
        }
        if c.over_quota > m.over_quota {
            degraded.push(over_quota_reason(
                c.over_quota - m.over_quota,
                max_bpf_processes,
            ));
        }
    }
    degraded
}

/// Why a turn is DEGRADED when processes of the container ran without a run count because it
/// held its quota of them: names the key, so that the operator knows what to raise.
pub(crate) fn over_quota_reason(runs: u64, max: u64) -> String {
    format!(
        "processes ran {runs} times without a run count: the container holds more than \
         [limits] max_bpf_processes ({max}) processes"
    )
}

/// What the counters say of the container's files since the mark ([`fs_activity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FsActivity {
    /// The upperdir and the tracked volumes must be scanned and compared with the mark's.
    pub scan: bool,
    /// Shared writable mappings of files must be armed before the scan
    /// ([`super::Inspection::arm_shared_mappings`]).
    pub arm: bool,
    /// Mutating syscalls since the mark, by class ([`super::FsFinding::syscalls`]).
    pub syscalls: BTreeMap<String, u64>,
}

/// Whether the files must be scanned: only when a mutating syscall happened since the mark, or
/// when a shared writable mapping of a file was made (stores into it change the file with no
/// syscall at all; counted since the watch began, not since the mark: a mapping made in an
/// earlier turn may still be written through). Without counters or without a mark nothing says
/// the files did not change: scan. Arming is needed whenever such a mapping may exist (any was
/// made, or no counters to tell).
pub(super) fn fs_activity(
    now: Option<&CgroupCounters>,
    then: Option<&CgroupCounters>,
) -> FsActivity {
    let arm = now.is_none_or(|c| c.shared_writable_mmaps > 0);
    match (now, then) {
        (Some(c), Some(m)) => {
            let since = c.since(m);
            FsActivity {
                // A shared writable mapping lets stores change a file with no syscall at all.
                scan: since.fs_mutations > 0 || c.shared_writable_mmaps > 0,
                arm,
                syscalls: since
                    .fs_classes()
                    .map(|(class, n)| (class.name().to_string(), n))
                    .collect(),
            }
        }
        _ => FsActivity {
            scan: true,
            arm,
            syscalls: BTreeMap::new(),
        },
    }
}

/// The process events the counters saw since the mark ([`process_events`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct ProcessEvents {
    pub forks: u64,
    pub execs: u64,
    pub exits: u64,
    /// Kernel state outside the compared process state changed since the mark, by class
    /// ([`super::ProcFinding::kernel`]).
    pub kernel: BTreeMap<String, u64>,
    /// Another process may have written into a process's memory (ptrace, process_vm_writev,
    /// /proc/PID/mem): then no process counts as idle.
    pub foreign_writes: bool,
}

/// The forks, execs, exits and kernel state changes since the mark (`then`), for the answer,
/// and whether memory may have been written from outside a process. Without counters now
/// there are no counts to report, and foreign writes cannot be ruled out.
pub(super) fn process_events(now: Option<&CgroupCounters>, then: &CgroupCounters) -> ProcessEvents {
    let Some(c) = now else {
        return ProcessEvents {
            foreign_writes: true,
            ..ProcessEvents::default()
        };
    };
    ProcessEvents {
        forks: c.forks.saturating_sub(then.forks),
        execs: c.execs.saturating_sub(then.execs),
        exits: c.exits.saturating_sub(then.exits),
        kernel: c
            .since(then)
            .state_classes()
            .map(|(class, n)| (class.name().to_string(), n))
            .collect(),
        foreign_writes: c.foreign_mem_writes > then.foreign_mem_writes,
    }
}

/// Whether a process that persisted since the mark may have changed its memory: a process
/// that was not scheduled since the mark did not change it, unless another process wrote into
/// it (`foreign_writes`). Scheduled is told by its run count now and at the mark; either
/// unknown (no probes, the process over the quota, a count not taken at the mark) counts as
/// ran.
pub(super) fn ran_since_mark(
    foreign_writes: bool,
    runs_now: Option<u64>,
    runs_then: Option<u64>,
) -> bool {
    foreign_writes
        || match (runs_now, runs_then) {
            (Some(now), Some(then)) => now != then,
            _ => true,
        }
}

/// What a turn does for the memory of a process that persisted since the mark.
#[derive(Debug, Clone, Copy)]
pub(super) enum MemoryStep<'a> {
    /// It did not run and maps no shared memory: its memory is exactly the mark's image,
    /// carried to the next mark as it is.
    Carry(&'a MemoryImage),
    /// It did not run but maps shared memory, which another process may have changed while
    /// it slept: its shared regions are read again over the mark's image
    /// ([`super::memory::refresh_shared`], a whole capture when that cannot).
    RefreshShared(&'a MemoryImage),
    /// It ran, or there is no image at the mark: its whole memory is captured.
    Capture,
}

/// [`MemoryStep`] for a process that `ran` (after its kernel-held state was compared, see
/// [`ran_since_mark`]), with its image at the mark `prev`: one that did not run is carried,
/// unless it maps shared memory (a [`RegionKind::Shmem`] region).
pub(super) fn memory_step(ran: bool, prev: Option<&MemoryImage>) -> MemoryStep<'_> {
    match prev {
        Some(img) if !ran => {
            // Shared memory (shared anonymous, SysV shm, memfd, tmpfs) can be changed by
            // another process while this one sleeps: compare it whatever the run count says.
            if img.regions.iter().any(|r| r.kind == RegionKind::Shmem) {
                MemoryStep::RefreshShared(img)
            } else {
                MemoryStep::Carry(img)
            }
        }
        _ => MemoryStep::Capture,
    }
}

/// Why the memory of `pid` could not be compared although it was captured now: the mark has no
/// image of it, with the `[limits]` bound the mark's observation passed if that is why.
pub(super) fn no_image_reason(pid: u32, over_limit: Option<&str>) -> String {
    match over_limit {
        Some(why) => format!("no memory image of pid {pid} at the mark: {why}"),
        None => format!("no memory image of pid {pid} at the mark"),
    }
}

/// How many entries of the container's tmpfs mounts differ between the mark's manifests
/// (`then`) and `now`, both by mount point: added, changed or removed entries, and every entry
/// of a mount that came or went.
pub(super) fn tmpfs_changes(
    then: &[(PathBuf, TreeManifest)],
    now: &[(PathBuf, TreeManifest)],
) -> u64 {
    let empty = TreeManifest::default();
    fn find<'a>(list: &'a [(PathBuf, TreeManifest)], at: &PathBuf) -> Option<&'a TreeManifest> {
        list.iter().find(|(p, _)| p == at).map(|(_, m)| m)
    }
    let mut points: Vec<&PathBuf> = then.iter().chain(now).map(|(p, _)| p).collect();
    points.sort();
    points.dedup();
    points
        .into_iter()
        .map(|at| {
            let (before, after) = (find(then, at), find(now, at));
            match (before, after) {
                (Some(b), Some(a)) => {
                    let d = super::fs::diff(b, a, &[]);
                    (d.added.len() + d.modified.len() + d.deleted.len()) as u64
                }
                // A mount come or gone: all of it (at least one: its root).
                (b, a) => b.or(a).unwrap_or(&empty).len().max(1) as u64,
            }
        })
        .sum()
}

/// What the next mark is made of ([`next_mark`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NextMark<C, M, P, V> {
    /// The present, as this turn observed it: counters, upperdir manifest, processes, volumes.
    Present(C, M, P, V),
    /// A fresh full observation, over the upperdir's manifest when this turn scanned it.
    Fresh(Option<M>),
}

/// Whether the present can become the mark: only when all four parts were observed and
/// nothing degraded the turn. Otherwise the next turn would be compared with a present that is
/// incomplete or untrusted (a scan that failed, images over a bound): a fresh full observation
/// is taken instead, keeping the upperdir manifest if there is one.
pub(super) fn next_mark<C, M, P, V>(
    counters: Option<C>,
    manifest: Option<M>,
    processes: Option<P>,
    volumes: Option<V>,
    degraded: &[String],
) -> NextMark<C, M, P, V> {
    match (counters, manifest, processes, volumes) {
        (Some(c), Some(m), Some(p), Some(v)) if degraded.is_empty() => {
            NextMark::Present(c, m, p, v)
        }
        (_, manifest, _, _) => NextMark::Fresh(manifest),
    }
}

/// What a turn end knows of one persisting process whose memory it compared, for
/// [`not_own`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OwnDoing<'a> {
    /// The policy keeps self-contained changes, and the interactions program was attached
    /// before the mark's image was taken and still is.
    pub kept: bool,
    /// Another task wrote into some process of the container since the mark (ptrace,
    /// process_vm_writev, `/proc/PID/mem`).
    pub foreign_writes: bool,
    /// The process's interactions read just before its image at the mark was taken, and just
    /// after the image now was.
    pub before: Option<u64>,
    pub after: Option<u64>,
    pub prev: &'a MemoryImage,
    pub now: &'a MemoryImage,
    /// What differs of the kernel-held state (signals, fds, threads, credentials, cwd).
    pub state_changes: usize,
    /// The mark's image cannot prove "unchanged" (a lazy restore was under way).
    pub unproven: bool,
}

/// Why a change the policy could keep was not kept ([`not_own`]): the first condition
/// that failed, for the turn's answer (`not_kept`) and the log. The names are part of the
/// answer's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotOwn {
    /// The policy does not keep self-contained changes, or the interactions program is not
    /// attached since the mark.
    Policy,
    /// Some task wrote into a process of the container (ptrace, `process_vm_writev`,
    /// `/proc/PID/mem`).
    ForeignWrite,
    /// The mark's image was taken while a lazy restore's pages were arriving.
    UnprovenBase,
    /// Kernel-held state (signals, fds, threads, credentials, cwd) differs.
    StateChanged,
    /// No interactions count at the mark or now (no entry in the counting program yet).
    NoCount,
    /// A syscall that is not a quiet one, or a signal, reached it since the mark.
    Interacted,
    /// Its threads could not be read.
    NoThreads,
    /// A thread of it was not asleep when its image was read (and did not fall asleep within
    /// the turn end's bound): it may have taken in data its count does not show yet.
    Running,
    /// It maps memory another task could write (shared anonymous, memfd, SysV or tmpfs shared
    /// memory, a file mapped shared and writable), at the mark or now.
    SharedMemory,
}

/// Whether a process's memory change since the mark was its own doing alone, so that its image
/// at the last checkpoint, left to run, is indistinguishable from it to anyone outside it: no
/// syscall but the quiet ones and no signal reached it (its interactions did not move between
/// the two images), nobody wrote into it, it maps no memory that another task could write
/// (shared anonymous, memfd, SysV or tmpfs shared memory, or a file mapped shared and writable:
/// a read-only shared file mapping changes only through a file change, which the held-files
/// check sees), its kernel-held state is the mark's, and every thread of it was asleep when its
/// image was taken (one preempted in a syscall may have taken in data that its count does not
/// show yet). Anything it cannot tell is "not self-contained".
///
/// Returns the first reason why it is not ([`NotOwn`]); `None` when it is self-contained.
pub(super) fn not_own(o: &OwnDoing<'_>) -> Option<NotOwn> {
    let shares = |img: &MemoryImage| {
        img.regions.iter().any(|r| match r.kind {
            RegionKind::Shmem => true,
            RegionKind::SharedFile => r.perms.contains('w'),
            RegionKind::Anon | RegionKind::FilePrivate => false,
        })
    };
    let why = if !o.kept {
        NotOwn::Policy
    } else if o.foreign_writes {
        NotOwn::ForeignWrite
    } else if o.unproven {
        NotOwn::UnprovenBase
    } else if o.state_changes != 0 {
        NotOwn::StateChanged
    } else if o.before.is_none() || o.after.is_none() {
        NotOwn::NoCount
    } else if o.before != o.after {
        NotOwn::Interacted
    } else if o.now.state.threads.is_empty() {
        NotOwn::NoThreads
    } else if !o.now.state.threads.iter().all(|t| t.sleeping) {
        NotOwn::Running
    } else if shares(o.prev) || shares(o.now) {
        NotOwn::SharedMemory
    } else {
        return None;
    };
    Some(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspector::bpf::{FsClass, StateClass, FS_CLASSES, STATE_CLASSES};
    use crate::inspector::memory::{CaptureStats, ProcState, Region};

    #[test]
    fn over_quota_reason_names_the_key_and_its_value() {
        let why = over_quota_reason(17, 64);
        assert!(why.contains("[limits] max_bpf_processes (64)"), "{why}");
        assert!(why.contains("17 times"), "{why}");
    }

    fn counters() -> CgroupCounters {
        CgroupCounters::default()
    }

    /// Counters now or at the mark, in a table row.
    type Counts<'a> = Option<&'a CgroupCounters>;

    #[test]
    fn counter_reasons_table() {
        let base = CgroupCounters {
            errors: 5,
            over_quota: 2,
            ..counters()
        };
        let lost = CgroupCounters { errors: 8, ..base };
        let over = CgroupCounters {
            over_quota: 9,
            ..base
        };
        let both = CgroupCounters {
            errors: 6,
            over_quota: 3,
            ..base
        };
        let backwards = CgroupCounters {
            errors: 1,
            over_quota: 0,
            ..base
        };
        let quota = over_quota_reason;
        #[rustfmt::skip]
        let rows: Vec<(&str, Counts, Counts, Vec<String>)> = vec![
            ("no mark, no counters", None, None, vec!["no mark to compare with".into()]),
            ("no mark, counters", Some(&lost), None, vec!["no mark to compare with".into()]),
            ("no counters, a mark: said where they failed", None, Some(&base), vec![]),
            ("nothing lost", Some(&base), Some(&base), vec![]),
            ("events lost", Some(&lost), Some(&base), vec!["3 kernel events lost since the mark".into()]),
            ("over quota", Some(&over), Some(&base), vec![quota(7, 100)]),
            ("both, lost first", Some(&both), Some(&base),
             vec!["1 kernel events lost since the mark".into(), quota(1, 100)]),
            ("counters behind the mark's: no growth", Some(&backwards), Some(&base), vec![]),
        ];
        for (name, now, then, want) in rows {
            assert_eq!(counter_reasons(now, then, 100), want, "{name}");
        }
    }

    #[test]
    fn fs_activity_table() {
        let mut by_class = [0; FS_CLASSES];
        by_class[FsClass::ALL[0].index()] = 3;
        let base = CgroupCounters {
            fs_mutations: 10,
            fs_by_class: by_class,
            ..counters()
        };
        let mut more = by_class;
        more[FsClass::ALL[0].index()] = 5;
        more[FsClass::ALL[1].index()] = 1;
        let wrote = CgroupCounters {
            fs_mutations: 13,
            fs_by_class: more,
            ..base
        };
        let mapped = CgroupCounters {
            shared_writable_mmaps: 1,
            ..base
        };
        let backwards = CgroupCounters {
            fs_mutations: 4,
            ..base
        };
        let other = CgroupCounters {
            forks: 3,
            execs: 2,
            ..base
        };
        type Classes = BTreeMap<String, u64>;
        let classes = |v: &[(FsClass, u64)]| -> Classes {
            v.iter().map(|(c, n)| (c.name().to_string(), *n)).collect()
        };
        let (c0, c1) = (FsClass::ALL[0], FsClass::ALL[1]);
        #[rustfmt::skip]
        let rows: Vec<(&str, Counts, Counts, bool, bool, Classes)> = vec![
            ("no counters, no mark", None, None, true, true, classes(&[])),
            ("no counters: scan and arm", None, Some(&base), true, true, classes(&[])),
            ("no mark: scan", Some(&base), None, true, false, classes(&[])),
            ("no mark, a mapping: scan and arm", Some(&mapped), None, true, true, classes(&[])),
            ("nothing since the mark", Some(&base), Some(&base), false, false, classes(&[])),
            ("mutations since the mark", Some(&wrote), Some(&base), true, false, classes(&[(c0, 2), (c1, 1)])),
            ("a shared writable mapping", Some(&mapped), Some(&base), true, true, classes(&[])),
            ("a mapping made before the mark still counts", Some(&mapped), Some(&mapped), true, true, classes(&[])),
            ("only process events", Some(&other), Some(&base), false, false, classes(&[])),
            ("a counter behind the mark's: no mutation", Some(&backwards), Some(&base), false, false, classes(&[])),
        ];
        for (name, now, then, scan, arm, syscalls) in rows {
            assert_eq!(
                fs_activity(now, then),
                FsActivity {
                    scan,
                    arm,
                    syscalls
                },
                "{name}"
            );
        }
    }

    #[test]
    fn process_events_table() {
        let mut state = [0; STATE_CLASSES];
        state[StateClass::ALL[0].index()] = 1;
        let base = CgroupCounters {
            forks: 10,
            execs: 4,
            exits: 7,
            foreign_mem_writes: 2,
            state_by_class: state,
            ..counters()
        };
        let mut more_state = state;
        more_state[StateClass::ALL[0].index()] = 4;
        let busy = CgroupCounters {
            forks: 12,
            execs: 5,
            exits: 9,
            state_by_class: more_state,
            ..base
        };
        let foreign = CgroupCounters {
            foreign_mem_writes: 3,
            ..base
        };
        let backwards = CgroupCounters {
            forks: 1,
            execs: 0,
            exits: 0,
            foreign_mem_writes: 0,
            ..base
        };
        let kernel = |n: u64| -> BTreeMap<String, u64> {
            [(StateClass::ALL[0].name().to_string(), n)].into()
        };
        let events = |forks, execs, exits, kernel, foreign_writes| ProcessEvents {
            forks,
            execs,
            exits,
            kernel,
            foreign_writes,
        };
        #[rustfmt::skip]
        let rows: Vec<(&str, Option<&CgroupCounters>, ProcessEvents)> = vec![
            ("no counters: nothing counted, foreign writes possible", None,
             events(0, 0, 0, BTreeMap::new(), true)),
            ("nothing since the mark", Some(&base), events(0, 0, 0, BTreeMap::new(), false)),
            ("forks, execs, exits, kernel state", Some(&busy), events(2, 1, 2, kernel(3), false)),
            ("a foreign memory write", Some(&foreign), events(0, 0, 0, BTreeMap::new(), true)),
            ("counters behind the mark's: nothing", Some(&backwards), events(0, 0, 0, BTreeMap::new(), false)),
        ];
        for (name, now, want) in rows {
            assert_eq!(process_events(now, &base), want, "{name}");
        }
    }

    #[test]
    fn ran_since_mark_table() {
        #[rustfmt::skip]
        let rows = [
            // (foreign writes, runs now, runs at the mark, ran)
            (false, Some(5), Some(5), false),
            (false, Some(6), Some(5), true),
            (false, Some(4), Some(5), true), // a count that went back (a recycled slot)
            (true, Some(5), Some(5), true),  // written into from outside
            (false, None, Some(5), true),    // no count now (blind, over the quota)
            (false, Some(5), None, true),    // no count at the mark
            (false, None, None, true),
            (true, None, None, true),
        ];
        for (foreign, now, then, ran) in rows {
            assert_eq!(
                ran_since_mark(foreign, now, then),
                ran,
                "foreign {foreign}, now {now:?}, then {then:?}"
            );
        }
    }

    fn region(kind: RegionKind) -> Region {
        Region {
            start: 0x10000,
            end: 0x11000,
            perms: "rw-p".into(),
            offset: 0,
            dev: "00:00".into(),
            inode: 0,
            name: String::new(),
            kind,
            pages: Vec::new(),
            shared: None,
        }
    }

    fn image(kinds: &[RegionKind]) -> MemoryImage {
        MemoryImage {
            pid: 1,
            start_time: 1,
            regions: kinds.iter().map(|k| region(*k)).collect(),
            state: ProcState::default(),
            stats: CaptureStats::default(),
            masked: Vec::new(),
            interactions: None,
        }
    }

    #[test]
    fn memory_step_table() {
        use RegionKind::*;
        let private = image(&[Anon, FilePrivate, SharedFile]);
        let shmem = image(&[Anon, Shmem]);
        let empty = image(&[]);
        #[rustfmt::skip]
        let rows: Vec<(&str, bool, Option<&MemoryImage>, &str)> = vec![
            ("idle, private memory only", false, Some(&private), "carry"),
            ("idle, no regions", false, Some(&empty), "carry"),
            ("idle, a Shmem region", false, Some(&shmem), "refresh"),
            ("ran", true, Some(&private), "capture"),
            ("ran, a Shmem region", true, Some(&shmem), "capture"),
            ("idle, no image at the mark", false, None, "capture"),
            ("ran, no image at the mark", true, None, "capture"),
        ];
        for (name, ran, prev, want) in rows {
            let got = match memory_step(ran, prev) {
                MemoryStep::Carry(img) => {
                    assert!(std::ptr::eq(img, prev.unwrap()), "{name}");
                    "carry"
                }
                MemoryStep::RefreshShared(img) => {
                    assert!(std::ptr::eq(img, prev.unwrap()), "{name}");
                    "refresh"
                }
                MemoryStep::Capture => "capture",
            };
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn no_image_reason_says_the_bound_when_there_is_one() {
        #[rustfmt::skip]
        let rows = [
            (7, None, "no memory image of pid 7 at the mark"),
            (7, Some("over [limits] x"), "no memory image of pid 7 at the mark: over [limits] x"),
        ];
        for (pid, over, want) in rows {
            assert_eq!(no_image_reason(pid, over), want);
        }
    }

    #[test]
    fn tmpfs_changes_table() {
        use std::fs;
        let tmp = tempfile::tempdir().unwrap();
        let (shm, dev) = (tmp.path().join("shm"), tmp.path().join("dev"));
        fs::create_dir_all(&shm).unwrap();
        fs::create_dir_all(&dev).unwrap();
        fs::write(shm.join("a"), "a").unwrap();
        fs::write(shm.join("b"), "b").unwrap();
        let scan = |d: &std::path::Path| TreeManifest::scan(d).unwrap();
        let at = |p: &str| PathBuf::from(p);
        let then = vec![(at("/dev"), scan(&dev)), (at("/dev/shm"), scan(&shm))];
        assert_eq!(tmpfs_changes(&then, &then.clone()), 0);
        // A rename (one gone, one new) and a removal, nothing written.
        fs::rename(shm.join("a"), shm.join("moved")).unwrap();
        fs::remove_file(shm.join("b")).unwrap();
        let now = vec![(at("/dev"), scan(&dev)), (at("/dev/shm"), scan(&shm))];
        assert!(
            tmpfs_changes(&then, &now) >= 3,
            "{}",
            tmpfs_changes(&then, &now)
        );
        // A mount gone, or come, counts every entry of it, at least one.
        assert_eq!(tmpfs_changes(&then, &then[..1]), then[1].1.len() as u64);
        assert_eq!(
            tmpfs_changes(&[], &[(at("/run"), TreeManifest::default())]),
            1
        );
        // Order does not matter: by mount point.
        let swapped = vec![then[1].clone(), then[0].clone()];
        assert_eq!(tmpfs_changes(&then, &swapped), 0);
    }

    #[test]
    fn next_mark_table() {
        type Next = NextMark<u8, &'static str, u16, u32>;
        type Parts = (Option<u8>, Option<&'static str>, Option<u16>, Option<u32>);
        let none: &[String] = &[];
        let one = &["a reason".to_string()][..];
        #[rustfmt::skip]
        let rows: Vec<(&str, Parts, &[String], Next)> = vec![
            ("all observed, nothing degraded", (Some(1), Some("m"), Some(2), Some(3)), none,
             NextMark::Present(1, "m", 2, 3)),
            ("all observed, degraded", (Some(1), Some("m"), Some(2), Some(3)), one,
             NextMark::Fresh(Some("m"))),
            ("no counters", (None, Some("m"), Some(2), Some(3)), none, NextMark::Fresh(Some("m"))),
            ("no upperdir manifest", (Some(1), None, Some(2), Some(3)), none, NextMark::Fresh(None)),
            ("no processes", (Some(1), Some("m"), None, Some(3)), none, NextMark::Fresh(Some("m"))),
            ("no volumes", (Some(1), Some("m"), Some(2), None), none, NextMark::Fresh(Some("m"))),
            ("nothing", (None, None, None, None), one, NextMark::Fresh(None)),
        ];
        for (name, (c, m, p, v), degraded, want) in rows {
            assert_eq!(next_mark(c, m, p, v, degraded), want, "{name}");
        }
    }

    #[test]
    fn self_contained_table() {
        use super::super::memory::ThreadState;
        let asleep = |n: usize| {
            let mut img = image(&[RegionKind::Anon, RegionKind::FilePrivate]);
            img.state.threads = (0..n)
                .map(|i| ThreadState {
                    tid: i as u32 + 1,
                    sleeping: true,
                    ..ThreadState::default()
                })
                .collect();
            img
        };
        let base = asleep(2);
        let with = |f: fn(&mut MemoryImage)| {
            let mut img = asleep(2);
            f(&mut img);
            img
        };
        let ro_shared = with(|i| {
            let mut r = i.regions[1].clone();
            r.kind = RegionKind::SharedFile;
            r.perms = "r--s".into();
            i.regions.push(r);
        });
        let rw_shared = with(|i| {
            let mut r = i.regions[1].clone();
            r.kind = RegionKind::SharedFile;
            r.perms = "rw-s".into();
            i.regions.push(r);
        });
        let shmem = with(|i| i.regions.push(region(RegionKind::Shmem)));
        let one_runnable = with(|i| i.state.threads[1].sleeping = false);
        let no_threads = with(|i| i.state.threads.clear());
        let ok = OwnDoing {
            kept: true,
            foreign_writes: false,
            before: Some(40),
            after: Some(40),
            prev: &base,
            now: &base,
            state_changes: 0,
            unproven: false,
        };
        #[rustfmt::skip]
        let rows: Vec<(&str, OwnDoing<'_>, Option<NotOwn>)> = vec![
            ("quiet, private memory, asleep", ok, None),
            ("a read-only shared file mapping (a file change is seen apart)",
             OwnDoing { now: &ro_shared, prev: &ro_shared, ..ok }, None),
            ("policy off", OwnDoing { kept: false, ..ok }, Some(NotOwn::Policy)),
            ("someone wrote into a process", OwnDoing { foreign_writes: true, ..ok },
             Some(NotOwn::ForeignWrite)),
            ("an interaction", OwnDoing { after: Some(41), ..ok }, Some(NotOwn::Interacted)),
            ("count went back (entry made again)", OwnDoing { after: Some(2), ..ok },
             Some(NotOwn::Interacted)),
            ("no count at the mark", OwnDoing { before: None, ..ok }, Some(NotOwn::NoCount)),
            ("no count now", OwnDoing { after: None, ..ok }, Some(NotOwn::NoCount)),
            ("no counts at all", OwnDoing { before: None, after: None, ..ok },
             Some(NotOwn::NoCount)),
            ("kernel-held state changed", OwnDoing { state_changes: 1, ..ok },
             Some(NotOwn::StateChanged)),
            ("unproven base", OwnDoing { unproven: true, ..ok }, Some(NotOwn::UnprovenBase)),
            ("shared writable file mapping now", OwnDoing { now: &rw_shared, ..ok },
             Some(NotOwn::SharedMemory)),
            ("shared writable file mapping at the mark", OwnDoing { prev: &rw_shared, ..ok },
             Some(NotOwn::SharedMemory)),
            ("shared memory now", OwnDoing { now: &shmem, ..ok }, Some(NotOwn::SharedMemory)),
            ("shared memory at the mark", OwnDoing { prev: &shmem, ..ok },
             Some(NotOwn::SharedMemory)),
            ("a thread not asleep", OwnDoing { now: &one_runnable, ..ok }, Some(NotOwn::Running)),
            ("no thread read", OwnDoing { now: &no_threads, ..ok }, Some(NotOwn::NoThreads)),
        ];
        for (name, o, want) in rows {
            assert_eq!(not_own(&o), want, "{name}");
        }
    }
}
