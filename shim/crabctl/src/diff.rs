//! `crabctl diff CONTAINER A [B]`: what changed in a sandbox between two points of its
//! history, like `git diff --stat`: files created, modified and deleted, processes started,
//! ended and alive throughout, memory changed, and the checkpoints taken on the way.
//!
//! Everything comes from what the store holds, nothing is guessed: the turn answers the
//! inspector recorded (`turns/`, [`crate::answer`]) say what each turn changed, composed here
//! turn by turn (a file created then modified is created; created then deleted is nothing;
//! deleted then created again is modified); the manifests (`checkpoints/`) say which
//! checkpoints were taken and which layers they added.
//!
//! A point (A, B) is a checkpoint's sequence number (as `checkpoints` lists it and `export`,
//! `fork`, `rollback` take it) or a turn id: the state right after that turn ended. A
//! checkpoint stands for the turn it was taken for; an origin (`created`, `restored`) for the
//! moment its task started. B defaults to the newest turn. A must not be newer than B (refused,
//! exit 4: the diff reads forward); a point that is neither is not found (exit 3, listing the
//! points there are). A diff across a rollback or recovery is refused: the turns before it were
//! undone, and what the answers recorded no longer adds up to the sandbox's state.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use crate::{answer::Stored, output::kind_name, CtlError, Result};
use crab_shim::{
    checkpoint::store::{CheckpointKind, Manifest},
    inspector::ProcSummary,
};

/// Most points a "not found" message lists of each kind.
const MAX_LISTED: usize = 20;

/// What `crabctl diff` prints (`-o json`: this, field for field).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diff {
    pub container: String,
    pub from: End,
    pub to: End,
    /// The turns between them (after `from`, up to and including `to`), oldest first.
    pub turns: Vec<String>,
    /// Whether every turn between was fully observed; if not, `incomplete` says which not.
    pub complete: bool,
    pub incomplete: Vec<String>,
    pub files: Files,
    pub processes: Processes,
    /// Processes whose memory changed, summed over the turns.
    pub memory: Vec<MemoryChange>,
    /// Checkpoints taken for the turns between, oldest first.
    pub checkpoints: Vec<CheckpointStep>,
}

/// One end of a diff.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct End {
    /// As given on the command line (empty: B's default, the newest turn).
    pub arg: String,
    /// The checkpoint it names (`null`: a turn without one, or the newest turn).
    pub checkpoint: Option<u64>,
    /// The turn it stands for (`null`: the start of the container's task, or no turn yet).
    pub turn_id: Option<String>,
}

/// Paths in the container, sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Files {
    pub created: Vec<String>,
    pub modified: Vec<String>,
    pub deleted: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Processes {
    /// Started after `from` and still running at `to`.
    pub started: Vec<ProcSummary>,
    /// Running at `from`, ended by `to`.
    pub ended: Vec<ProcSummary>,
    /// Started and ended again between the two.
    pub transient: Vec<ProcSummary>,
    /// Running at both ends (those `to`'s turn still saw). A process no answer recorded
    /// running (it stayed idle since before `from`) has an empty `cmdline`.
    pub alive: Vec<ProcSummary>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MemoryChange {
    pub pid: u32,
    pub cmdline: String,
    pub changed_pages: u64,
    pub added_pages: u64,
    pub removed_pages: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointStep {
    pub seq: u64,
    pub kind: String,
    pub turn_id: String,
    /// Layers it added to its parent's chain, and their bytes (compressed, as stored).
    pub new_layers: usize,
    pub new_layer_bytes: u64,
    /// Bytes of its process image in the store (`null`: it took none of its own).
    pub process_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Created,
    Modified,
    Deleted,
}

/// A resolved point: how many answers (in time order) lie before it.
struct Point {
    position: usize,
    end: End,
    label: String,
}

/// The diff of `container` between `from` and `to` (default: the newest turn), from its
/// manifests (oldest first) and stored answers (any order).
pub fn diff(
    container: &str,
    manifests: &[Manifest],
    answers: &[Stored],
    from: &str,
    to: Option<&str>,
) -> Result<Diff> {
    let mut answers: Vec<&Stored> = answers.iter().collect();
    answers.sort_by(|a, b| (a.written_at.as_str(), &a.path).cmp(&(b.written_at.as_str(), &b.path)));
    let a = resolve(container, manifests, &answers, from)?;
    let b = match to {
        Some(to) => resolve(container, manifests, &answers, to)?,
        None => Point {
            position: answers.len(),
            end: End {
                arg: String::new(),
                checkpoint: None,
                turn_id: answers.last().map(|s| s.record.turn_id.clone()),
            },
            label: match answers.last() {
                Some(s) => format!("the newest turn ({})", s.record.turn_id),
                None => "now (no turn yet)".to_string(),
            },
        },
    };
    if a.position > b.position {
        return Err(CtlError::Refused(format!(
            "{} ({}) is newer than {} ({}): a diff reads from an older point to a newer one; \
             swap them (crabctl diff {container} {} {})",
            a.end.arg,
            a.label,
            if b.end.arg.is_empty() {
                "B"
            } else {
                &b.end.arg
            },
            b.label,
            if b.end.arg.is_empty() {
                "NEWER"
            } else {
                &b.end.arg
            },
            a.end.arg
        )));
    }
    for m in restores(manifests) {
        let r = position_at(&answers, &m.created_at);
        if a.position < r && r <= b.position {
            return Err(CtlError::Refused(format!(
                "{container} was rolled back or recovered between {} and {} (checkpoint {}, \
                 restored from turn {:?} at {}): the turns before it were undone; diff from \
                 checkpoint {} or later",
                a.label, b.label, m.seq, m.turn_id, m.created_at, m.seq
            )));
        }
    }
    let range = &answers[a.position..b.position];
    let mut d = Diff {
        container: container.to_string(),
        from: a.end,
        to: b.end,
        turns: range.iter().map(|s| s.record.turn_id.clone()).collect(),
        complete: true,
        incomplete: Vec::new(),
        files: Files::default(),
        processes: Processes::default(),
        memory: Vec::new(),
        checkpoints: Vec::new(),
    };
    compose_files(range, &mut d.files);
    compose_processes(range, &answers, &mut d.processes);
    d.memory = memory(range);
    for s in range {
        let t = &s.record;
        for why in &t.answer.degraded {
            d.incomplete
                .push(format!("turn {}: not observed: {why}", t.turn_id));
        }
        if t.answer.fs.unobserved {
            d.incomplete.push(format!(
                "turn {}: its files could not all be compared (see crabctl show)",
                t.turn_id
            ));
        }
    }
    d.complete = d.incomplete.is_empty();
    d.checkpoints = manifests
        .iter()
        .filter(|m| m.kind.is_turn())
        .filter(|m| {
            let p = checkpoint_position(m, &answers);
            a.position < p && p <= b.position
        })
        .map(|m| step(m, manifests))
        .collect();
    Ok(d)
}

/// The rollbacks and recoveries in the store: `restored` checkpoints after its first (the
/// first is the origin of a container started from a checkpoint image).
fn restores(manifests: &[Manifest]) -> impl Iterator<Item = &Manifest> {
    manifests
        .iter()
        .skip(1)
        .filter(|m| m.kind == CheckpointKind::Restored)
}

/// How many answers were written before `time` (RFC 3339, as the store writes it).
fn position_at(answers: &[&Stored], time: &str) -> usize {
    answers
        .iter()
        .take_while(|s| s.written_at.as_str() < time)
        .count()
}

/// Where checkpoint `m` stands among the answers: after the answer of its (last) turn written
/// before it, else after every answer written before it; an origin at its time.
fn checkpoint_position(m: &Manifest, answers: &[&Stored]) -> usize {
    if m.kind.is_turn() {
        let turn = m.turn_id.rsplit(',').next().unwrap_or_default();
        let of_turn = answers
            .iter()
            .rposition(|s| s.record.turn_id == turn && s.written_at <= m.created_at);
        if let Some(i) = of_turn {
            return i + 1;
        }
        return answers
            .iter()
            .take_while(|s| s.written_at <= m.created_at)
            .count();
    }
    position_at(answers, &m.created_at)
}

fn resolve(
    container: &str,
    manifests: &[Manifest],
    answers: &[&Stored],
    arg: &str,
) -> Result<Point> {
    let of_checkpoint = |m: &Manifest| {
        let turn = (m.kind.is_turn() && !m.turn_id.is_empty()).then(|| m.turn_id.clone());
        Point {
            position: checkpoint_position(m, answers),
            label: match &turn {
                Some(t) => format!("checkpoint {} of turn {t}", m.seq),
                None => format!(
                    "checkpoint {} ({}: its task's start)",
                    m.seq,
                    kind_name(m.kind)
                ),
            },
            end: End {
                arg: arg.to_string(),
                checkpoint: Some(m.seq),
                turn_id: turn,
            },
        }
    };
    if let Some(m) = arg
        .parse::<u64>()
        .ok()
        .and_then(|seq| manifests.iter().find(|m| m.seq == seq))
    {
        return Ok(of_checkpoint(m));
    }
    if let Some(i) = answers.iter().rposition(|s| s.record.turn_id == arg) {
        return Ok(Point {
            position: i + 1,
            label: format!("turn {arg}"),
            end: End {
                arg: arg.to_string(),
                checkpoint: None,
                turn_id: Some(arg.to_string()),
            },
        });
    }
    // A turn whose answer is gone (retention) but whose checkpoint is still there.
    if let Some(m) = manifests
        .iter()
        .rev()
        .find(|m| m.kind.is_turn() && m.turn_id.split(',').any(|t| t == arg))
    {
        return Ok(of_checkpoint(m));
    }
    Err(CtlError::NoDiffPoint {
        container: container.to_string(),
        point: arg.to_string(),
        available: available(manifests, answers),
    })
}

/// The points there are, for a "not found" message.
fn available(manifests: &[Manifest], answers: &[&Stored]) -> String {
    let list = |items: Vec<String>| {
        let n = items.len();
        let mut shown: Vec<String> = items.into_iter().rev().take(MAX_LISTED).collect();
        shown.reverse();
        if n > MAX_LISTED {
            shown.insert(0, format!("({} older)", n - MAX_LISTED));
        }
        shown.join(", ")
    };
    let checkpoints: Vec<String> = manifests
        .iter()
        .map(|m| match m.turn_id.is_empty() {
            true => format!("{} ({})", m.seq, kind_name(m.kind)),
            false => format!("{} (turn {}, {})", m.seq, m.turn_id, kind_name(m.kind)),
        })
        .collect();
    let mut seen = HashSet::new();
    let turns: Vec<String> = answers
        .iter()
        .rev()
        .filter(|s| seen.insert(s.record.turn_id.as_str()))
        .map(|s| s.record.turn_id.clone())
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let mut out = Vec::new();
    out.push(match checkpoints.is_empty() {
        true => "no checkpoints".to_string(),
        false => format!("checkpoints {}", list(checkpoints)),
    });
    out.push(match turns.is_empty() {
        true => "no turn answers".to_string(),
        false => format!("turns {}", list(turns)),
    });
    out.join("; ")
}

fn compose_files(range: &[&Stored], files: &mut Files) {
    // By the paths' text (its order is the output's).
    let mut state: BTreeMap<String, Change> = BTreeMap::new();
    for s in range {
        let fs = &s.record.answer.fs;
        let ops = fs
            .added
            .iter()
            .map(|p| (p, Change::Created))
            .chain(fs.modified.iter().map(|p| (p, Change::Modified)))
            .chain(fs.deleted.iter().map(|p| (p, Change::Deleted)));
        for (path, op) in ops {
            use Change::*;
            let path = path.to_string_lossy().into_owned();
            let next = match (state.get(&path).copied(), op) {
                (None, op) => Some(op),
                (Some(Created), Deleted) => None,
                (Some(Created), _) => Some(Created),
                (Some(Deleted), Created | Modified) => Some(Modified),
                (Some(Modified), op) => Some(op),
                (Some(Deleted), Deleted) => Some(Deleted),
            };
            match next {
                Some(c) => state.insert(path, c),
                None => state.remove(&path),
            };
        }
    }
    for (path, change) in state {
        let list = match change {
            Change::Created => &mut files.created,
            Change::Modified => &mut files.modified,
            Change::Deleted => &mut files.deleted,
        };
        list.push(path);
    }
}

fn compose_processes(range: &[&Stored], all: &[&Stored], procs: &mut Processes) {
    let mut started: BTreeMap<u32, ProcSummary> = BTreeMap::new();
    for s in range {
        let p = &s.record.answer.procs;
        for x in &p.started {
            started.insert(x.pid, x.clone());
        }
        for x in &p.ended {
            match started.remove(&x.pid) {
                Some(s) => procs.transient.push(ProcSummary {
                    cmdline: if s.cmdline.is_empty() {
                        x.cmdline.clone()
                    } else {
                        s.cmdline
                    },
                    pid: x.pid,
                }),
                None => procs.ended.push(x.clone()),
            }
        }
    }
    procs.started = started.values().cloned().collect();
    let Some(last) = range.last() else { return };
    let p = &last.record.answer.procs;
    let mut persisting: Vec<u32> = p
        .memory
        .iter()
        .map(|m| m.pid)
        .chain(p.idle.iter().copied())
        .filter(|pid| !started.contains_key(pid))
        .collect();
    persisting.sort_unstable();
    persisting.dedup();
    procs.alive = persisting
        .into_iter()
        .map(|pid| ProcSummary {
            pid,
            cmdline: cmdline_of(pid, all),
        })
        .collect();
}

/// The newest command line the answers recorded for `pid` (empty if none did).
fn cmdline_of(pid: u32, answers: &[&Stored]) -> String {
    answers
        .iter()
        .rev()
        .flat_map(|s| {
            let p = &s.record.answer.procs;
            p.memory
                .iter()
                .filter(|m| m.pid == pid)
                .map(|m| m.cmdline.clone())
                .chain(
                    p.started
                        .iter()
                        .chain(&p.reexeced)
                        .filter(|x| x.pid == pid)
                        .map(|x| x.cmdline.clone()),
                )
                .collect::<Vec<_>>()
        })
        .find(|c| !c.is_empty())
        .unwrap_or_default()
}

fn memory(range: &[&Stored]) -> Vec<MemoryChange> {
    let mut by_pid: BTreeMap<u32, MemoryChange> = BTreeMap::new();
    for s in range {
        for m in &s.record.answer.procs.memory {
            let e = by_pid.entry(m.pid).or_insert_with(|| MemoryChange {
                pid: m.pid,
                ..MemoryChange::default()
            });
            e.cmdline = m.cmdline.clone();
            e.changed_pages += m.changed_pages;
            e.added_pages += m.added_pages;
            e.removed_pages += m.removed_pages;
        }
    }
    by_pid
        .into_values()
        .filter(|m| m.changed_pages + m.added_pages + m.removed_pages > 0)
        .collect()
}

fn step(m: &Manifest, manifests: &[Manifest]) -> CheckpointStep {
    let parent = m.parent.and_then(|p| manifests.iter().find(|x| x.seq == p));
    let before: HashSet<&str> = parent
        .map(|p| p.fs_layers.iter().map(|l| l.digest.as_str()).collect())
        .unwrap_or_default();
    let new: Vec<_> = m
        .fs_layers
        .iter()
        .skip(m.image_layers)
        .filter(|l| !before.contains(l.digest.as_str()))
        .collect();
    let own_process = m.process.as_ref().filter(|p| {
        parent
            .and_then(|x| x.process.as_ref())
            .is_none_or(|q| q.image != p.image)
    });
    CheckpointStep {
        seq: m.seq,
        kind: kind_name(m.kind),
        turn_id: m.turn_id.clone(),
        new_layers: new.len(),
        new_layer_bytes: new.iter().map(|l| l.size).sum(),
        process_bytes: own_process.map(|p| p.bytes_stored),
    }
}

fn human_bytes(b: u64) -> String {
    let f = b as f64;
    match b {
        0..=999 => format!("{b} B"),
        1_000..=999_999 => format!("{:.1} kB", f / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} MB", f / 1e6),
        _ => format!("{:.2} GB", f / 1e9),
    }
}

fn plural(n: usize, what: &str) -> String {
    match n {
        1 => format!("1 {what}"),
        n => format!("{n} {what}s"),
    }
}

fn describe(e: &End, default: &str) -> String {
    let mut s = match (&e.checkpoint, &e.turn_id) {
        (Some(c), Some(t)) => format!("checkpoint {c} (turn {t})"),
        (Some(c), None) => format!("checkpoint {c}"),
        (None, Some(t)) => format!("turn {t}"),
        (None, None) => default.to_string(),
    };
    if e.arg.is_empty() {
        s = format!("{s}, the newest");
    }
    s
}

/// What `crabctl diff` prints for people: a header, then a `git diff --stat`-like summary.
impl std::fmt::Display for Diff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "diff {}: {} .. {}: {}{}",
            self.container,
            describe(&self.from, "the start"),
            describe(&self.to, "now"),
            plural(self.turns.len(), "turn"),
            match self.turns.is_empty() {
                true => String::new(),
                false => format!(" ({})", self.turns.join(", ")),
            }
        )?;
        let fl = &self.files;
        writeln!(
            f,
            "files: {} created, {} modified, {} deleted",
            fl.created.len(),
            fl.modified.len(),
            fl.deleted.len()
        )?;
        for (mark, list) in [("+", &fl.created), ("~", &fl.modified), ("-", &fl.deleted)] {
            for p in list {
                writeln!(f, "  {mark} {p}")?;
            }
        }
        let p = &self.processes;
        writeln!(
            f,
            "processes: {} started, {} ended, {} started and ended, {} alive throughout",
            p.started.len(),
            p.ended.len(),
            p.transient.len(),
            p.alive.len()
        )?;
        for (mark, what, list) in [
            ("+", "running", &p.started),
            ("-", "ended", &p.ended),
            ("±", "started and ended", &p.transient),
            ("=", "alive", &p.alive),
        ] {
            for x in list {
                // The answers name a process that never ran during a turn by its pid alone.
                let cmdline = match x.cmdline.is_empty() {
                    true => "?",
                    false => &x.cmdline,
                };
                writeln!(f, "  {mark} {:>7} {cmdline}  ({what})", x.pid)?;
            }
        }
        if !self.memory.is_empty() {
            writeln!(f, "memory:")?;
            for m in &self.memory {
                writeln!(
                    f,
                    "  {:>7} {}: {} pages changed, {} added, {} removed",
                    m.pid, m.cmdline, m.changed_pages, m.added_pages, m.removed_pages
                )?;
            }
        }
        if !self.checkpoints.is_empty() {
            writeln!(f, "checkpoints:")?;
            for c in &self.checkpoints {
                write!(
                    f,
                    "  {:>5} {:<6} turn {}: +{} ({})",
                    c.seq,
                    c.kind,
                    c.turn_id,
                    plural(c.new_layers, "layer"),
                    human_bytes(c.new_layer_bytes)
                )?;
                if let Some(b) = c.process_bytes {
                    write!(f, ", process image {}", human_bytes(b))?;
                }
                writeln!(f)?;
            }
        }
        for why in &self.incomplete {
            writeln!(f, "INCOMPLETE: {why}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::{json, Value};

    use super::*;
    use crab_shim::checkpoint::store::{Descriptor, ProcessImage};
    use crab_shim::{
        inspector::{Answer, FsFinding, Kind, MemoryFinding, ProcFinding},
        sandbox::TurnRecord,
    };

    fn proc(pid: u32, cmdline: &str) -> ProcSummary {
        ProcSummary {
            pid,
            cmdline: cmdline.into(),
        }
    }

    fn paths(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Paths as an answer records them.
    fn recorded(v: &[&str]) -> Vec<PathBuf> {
        v.iter().map(PathBuf::from).collect()
    }

    /// An answer for turn `turn`, written at second `at`.
    fn answer(seq: u64, turn: &str, at: u32) -> Stored {
        Stored {
            path: PathBuf::from(format!("turns/{seq:06}.json")),
            written_at: format!("2030-01-01T00:00:{at:02}.000Z"),
            record: TurnRecord {
                turn_id: turn.into(),
                answer: Answer {
                    container_id: "c1".into(),
                    seq,
                    kind: Kind::None,
                    fs: FsFinding::default(),
                    procs: ProcFinding::default(),
                    degraded: vec![],
                    elapsed_us: 1,
                },
                rollback: None,
            },
        }
    }

    fn layer(n: u8, size: u64) -> Descriptor {
        Descriptor {
            digest: format!("sha256:{}", format!("{n:02x}").repeat(32)),
            diff_id: format!("sha256:{}", "0".repeat(64)),
            size,
            media_type: crab_shim::checkpoint::store::MEDIA_TYPE_LAYER_ZSTD.into(),
        }
    }

    /// A checkpoint of `turn` (after `parent`), created at second `at`.
    fn manifest(
        parent: Option<&Manifest>,
        seq: u64,
        turn: &str,
        kind: CheckpointKind,
        at: u32,
    ) -> Manifest {
        let mut m = Manifest::child_of(parent, seq, turn, kind);
        m.created_at = format!("2030-01-01T00:00:{at:02}.500Z");
        m
    }

    /// A sandbox's history: created (1), turn t1 writes files (checkpoint 2, fs), t2 starts a
    /// server and edits (checkpoint 3, full), t3 changes nothing (no checkpoint), t4 deletes
    /// and the server's memory changes (checkpoint 4, full).
    fn history() -> (Vec<Manifest>, Vec<Stored>) {
        let created = manifest(None, 1, "", CheckpointKind::Created, 0);
        let mut c2 = manifest(Some(&created), 2, "t1", CheckpointKind::Fs, 10);
        c2.fs_layers.push(layer(1, 1000));
        let mut c3 = manifest(Some(&c2), 3, "t2", CheckpointKind::Full, 20);
        c3.fs_layers.push(layer(2, 500));
        c3.process = Some(ProcessImage {
            image: "proc/000003".into(),
            bytes_stored: 8192,
            bytes_logical: 16384,
            pids: vec![1, 40],
        });
        let mut c4 = manifest(Some(&c3), 4, "t4", CheckpointKind::Full, 40);
        c4.fs_layers.push(layer(3, 20));
        c4.process.as_mut().unwrap().image = "proc/000004".into();

        let mut t1 = answer(1, "t1", 10);
        t1.record.answer.kind = Kind::Fs;
        t1.record.answer.fs.added = recorded(&["/app/a", "/app/tmp"]);
        t1.record.answer.fs.modified = recorded(&["/etc/hosts"]);
        t1.record.answer.procs.idle = vec![1];
        let mut t2 = answer(2, "t2", 20);
        t2.record.answer.kind = Kind::Full;
        t2.record.answer.fs.modified = recorded(&["/app/a"]);
        t2.record.answer.fs.deleted = recorded(&["/app/tmp", "/etc/motd"]);
        t2.record.answer.procs.started = vec![proc(40, "python -m http.server"), proc(41, "ls")];
        t2.record.answer.procs.ended = vec![proc(41, "ls")];
        t2.record.answer.procs.memory = vec![MemoryFinding {
            pid: 1,
            cmdline: "sh".into(),
            changed_pages: 2,
            ..MemoryFinding::default()
        }];
        let mut t3 = answer(3, "t3", 30);
        t3.record.answer.procs.idle = vec![1, 40];
        let mut t4 = answer(4, "t4", 40);
        t4.record.answer.kind = Kind::Full;
        t4.record.answer.fs.deleted = recorded(&["/app/a"]);
        t4.record.answer.fs.added = recorded(&["/etc/motd"]);
        t4.record.answer.procs.memory = vec![MemoryFinding {
            pid: 40,
            cmdline: "python -m http.server".into(),
            changed_pages: 5,
            added_pages: 3,
            removed_pages: 1,
            scanned_pages: 100,
            ..MemoryFinding::default()
        }];
        t4.record.answer.procs.idle = vec![1];
        (vec![created, c2, c3, c4], vec![t4, t2, t1, t3])
    }

    #[test]
    fn composes_files_and_processes_turn_by_turn() {
        let (ms, answers) = history();
        // From the origin (checkpoint 1) to the newest turn: everything.
        let d = diff("c1", &ms, &answers, "1", None).unwrap();
        assert_eq!(d.turns, ["t1", "t2", "t3", "t4"]);
        // /app/a: created, modified, deleted: nothing. /app/tmp: created, deleted: nothing.
        // /etc/motd: deleted then created again: modified.
        assert_eq!(d.files.created, Vec::<String>::new());
        assert_eq!(d.files.modified, paths(&["/etc/hosts", "/etc/motd"]));
        assert_eq!(d.files.deleted, Vec::<String>::new());
        assert_eq!(d.processes.started, [proc(40, "python -m http.server")]);
        assert_eq!(d.processes.transient, [proc(41, "ls")]);
        assert_eq!(d.processes.ended, []);
        assert_eq!(d.processes.alive, [proc(1, "sh")]);
        assert_eq!(
            d.memory
                .iter()
                .map(|m| (m.pid, m.changed_pages))
                .collect::<Vec<_>>(),
            [(1, 2), (40, 5)]
        );
        assert_eq!(
            d.checkpoints
                .iter()
                .map(|c| (c.seq, c.new_layers, c.new_layer_bytes, c.process_bytes))
                .collect::<Vec<_>>(),
            [
                (2, 1, 1000, None),
                (3, 1, 500, Some(8192)),
                (4, 1, 20, Some(8192))
            ]
        );
        assert!(d.complete);
        assert_eq!(d.from.checkpoint, Some(1));
        assert_eq!(d.from.turn_id, None);
        assert_eq!(d.to.turn_id.as_deref(), Some("t4"));

        // From t1 (by turn id) to checkpoint 3 (by number): turn t2 alone.
        let d = diff("c1", &ms, &answers, "t1", Some("3")).unwrap();
        assert_eq!(d.turns, ["t2"]);
        assert_eq!(d.files.created, Vec::<String>::new());
        assert_eq!(d.files.modified, paths(&["/app/a"]));
        assert_eq!(d.files.deleted, paths(&["/app/tmp", "/etc/motd"]));
        assert_eq!(d.processes.started, [proc(40, "python -m http.server")]);
        assert_eq!(d.checkpoints.len(), 1);
        assert_eq!(d.to.checkpoint, Some(3));
        assert_eq!(d.to.turn_id.as_deref(), Some("t2"));

        // From checkpoint 3 to t4: the server runs throughout and its memory changed.
        let d = diff("c1", &ms, &answers, "3", Some("t4")).unwrap();
        assert_eq!(d.turns, ["t3", "t4"]);
        assert_eq!(d.files.created, paths(&["/etc/motd"]));
        assert_eq!(d.files.deleted, paths(&["/app/a"]));
        assert_eq!(d.processes.started, []);
        assert_eq!(d.memory.len(), 1);
        assert_eq!(d.memory[0].pid, 40);
        // The same point twice: nothing.
        let d = diff("c1", &ms, &answers, "t2", Some("3")).unwrap();
        assert!(d.turns.is_empty() && d.files == Files::default(), "{d:?}");
    }

    #[test]
    fn ended_processes_and_incomplete_turns_are_reported() {
        let (ms, mut answers) = history();
        let mut t5 = answer(5, "t5", 50);
        t5.record.answer.procs.ended = vec![proc(40, "python -m http.server")];
        t5.record.answer.degraded = vec!["probes unavailable".into()];
        t5.record.answer.fs.unobserved = true;
        // Pid 99 never ran during a turn: no answer recorded its command line.
        t5.record.answer.procs.idle = vec![1, 99];
        answers.push(t5);
        let d = diff("c1", &ms, &answers, "t4", None).unwrap();
        assert_eq!(d.processes.ended, [proc(40, "python -m http.server")]);
        assert_eq!(d.processes.alive, [proc(1, "sh"), proc(99, "")]);
        assert!(d.to_string().contains("=      99 ?  (alive)"), "{d}");
        assert!(!d.complete);
        assert_eq!(d.incomplete.len(), 2, "{:?}", d.incomplete);
        assert!(d.incomplete[0].contains("probes unavailable"));
        let text = d.to_string();
        assert!(text.contains("INCOMPLETE"), "{text}");
    }

    #[test]
    fn unknown_points_are_not_found_listing_the_points_there_are() {
        let (ms, answers) = history();
        for bad in ["99", "t9", "", "../../etc"] {
            let e = diff("c1", &ms, &answers, bad, None).unwrap_err();
            assert_eq!(e.exit_code(), 3, "{bad}: {e}");
            let msg = e.to_string();
            for needle in [
                "c1",
                "checkpoints 1 (created), 2 (turn t1, fs)",
                "turns t1, t2, t3, t4",
            ] {
                assert!(msg.contains(needle), "{bad}: {needle}: {msg}");
            }
        }
        let e = diff("c1", &ms, &answers, "1", Some("t9")).unwrap_err();
        assert_eq!(e.exit_code(), 3);
        // Nothing stored at all.
        let e = diff("c1", &[], &[], "1", None).unwrap_err();
        assert!(
            e.to_string().contains("no checkpoints; no turn answers"),
            "{e}"
        );
        // A long history lists the newest points, saying how many are left out.
        let many: Vec<Stored> = (0..50).map(|i| answer(i, &format!("x{i}"), 0)).collect();
        let msg = diff("c1", &[], &many, "nope", None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("(30 older)") && msg.contains("x49"), "{msg}");
        assert!(!msg.contains("x29,"), "{msg}");
    }

    #[test]
    fn a_newer_first_point_is_refused_saying_to_swap() {
        let (ms, answers) = history();
        let e = diff("c1", &ms, &answers, "t4", Some("t1")).unwrap_err();
        assert_eq!(e.exit_code(), 4, "{e}");
        assert!(e.to_string().contains("crabctl diff c1 t1 t4"), "{e}");
    }

    #[test]
    fn a_diff_across_a_rollback_is_refused() {
        let (mut ms, mut answers) = history();
        // Rolled back to checkpoint 2 at second 45; the new task's first turn overwrote
        // turns/000001.json.
        let mut restored = manifest(Some(&ms[1]), 5, "t1", CheckpointKind::Restored, 45);
        restored.parent = Some(2);
        ms.push(restored);
        answers.retain(|s| s.record.answer.seq != 1);
        let mut n1 = answer(1, "n1", 50);
        n1.record.answer.fs.added = recorded(&["/new"]);
        answers.push(n1);
        let e = diff("c1", &ms, &answers, "t2", None).unwrap_err();
        assert_eq!(e.exit_code(), 4);
        assert!(e.to_string().contains("rolled back"), "{e}");
        // From the rollback on it reads fine (by the restored checkpoint or the new turn).
        let d = diff("c1", &ms, &answers, "5", None).unwrap();
        assert_eq!(d.turns, ["n1"]);
        assert_eq!(d.files.created, paths(&["/new"]));
        let d = diff("c1", &ms, &answers, "1", Some("t2")).unwrap();
        assert_eq!(
            d.turns,
            ["t2"],
            "t1's answer is gone: from the origin up to t2"
        );
    }

    #[test]
    fn the_json_shape_is_pinned() {
        let (ms, answers) = history();
        let d = diff("c1", &ms, &answers, "t1", Some("3")).unwrap();
        let v = serde_json::to_value(&d).unwrap();
        let keys = |v: &Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(
            keys(&v),
            [
                "checkpoints",
                "complete",
                "container",
                "files",
                "from",
                "incomplete",
                "memory",
                "processes",
                "to",
                "turns"
            ]
        );
        assert_eq!(keys(&v["from"]), ["arg", "checkpoint", "turn_id"]);
        assert_eq!(keys(&v["files"]), ["created", "deleted", "modified"]);
        assert_eq!(
            keys(&v["processes"]),
            ["alive", "ended", "started", "transient"]
        );
        assert_eq!(
            keys(&v["checkpoints"][0]),
            [
                "kind",
                "new_layer_bytes",
                "new_layers",
                "process_bytes",
                "seq",
                "turn_id"
            ]
        );
        assert_eq!(
            v["processes"]["started"],
            json!([{"pid": 40, "cmdline": "python -m http.server"}])
        );
        assert_eq!(
            v["from"],
            json!({"arg": "t1", "checkpoint": null, "turn_id": "t1"})
        );
        crate::output::tests::documented(&v, crate::output::DIFF_FIELDS);
        let text = d.to_string();
        for needle in [
            "diff c1: turn t1 .. checkpoint 3 (turn t2): 1 turn (t2)",
            "- /app/tmp",
            "+      40 python",
            "+1 layer (500 B), process image 8.2 kB",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }
}
