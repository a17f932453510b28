//! The turn answers the shim stores (`<sandbox>/turns/<seq:06>.json`), read as typed data:
//! what `turns`, `show` and `diff` print and compute from.
//!
//! [`TurnAnswer`] mirrors the stored document (the inspector's answer with the harness's turn
//! id); its field names are those of the file and of `-o json` alike. The store is a trust
//! boundary: a file that does not parse as an answer is an error naming it (exit 1), never
//! skipped or guessed at.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::SystemTime,
};

use serde::{Deserialize, Serialize};

use crate::{CtlError, Result};

/// The smallest checkpoint that preserves what a turn left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnKind {
    None,
    Fs,
    Proc,
    Full,
}

/// One turn's answer, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnAnswer {
    /// The harness's id of the turn.
    pub turn_id: String,
    pub container_id: String,
    /// The turn's number in its task (1 for the first turn after the container started).
    pub seq: u64,
    pub kind: TurnKind,
    pub fs: FsFinding,
    pub procs: ProcFinding,
    /// Why the inspector could not observe the turn (then `kind` is `full`).
    #[serde(default)]
    pub degraded: Vec<String>,
    #[serde(default)]
    pub elapsed_us: u64,
}

/// What changed in the container's files during the turn.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FsFinding {
    pub changed: bool,
    /// Whether the files were compared at all (not when no mutating syscall happened).
    pub scanned: bool,
    /// The files could not all be compared: `added`, `modified`, `deleted` are incomplete.
    pub unobserved: bool,
    /// Mutating syscalls seen during the turn, by class.
    pub syscalls: BTreeMap<String, u64>,
    pub added: Vec<String>,
    pub modified: Vec<String>,
    pub deleted: Vec<String>,
}

/// A process by pid and command line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proc {
    pub pid: u32,
    pub cmdline: String,
}

/// A persisting process that ran during the turn, and how its memory changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryFinding {
    pub pid: u32,
    pub cmdline: String,
    pub changed_pages: u64,
    pub added_pages: u64,
    pub removed_pages: u64,
    pub scanned_pages: u64,
    /// Compared with an image taken while a lazy restore's pages were still arriving: counted
    /// as a change.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unproven_base: bool,
    /// Kernel-held state that changed (pending signals, stopped, fds and what they hold).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub state: Vec<String>,
    /// The change was the process's own doing alone and the container keeps its last image
    /// (`[checkpoint] self_contained_changes = "keep"`): not a change of the turn.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub self_contained: bool,
    /// Why a change the keeping policy could have kept was not (`interacted`, `running`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_kept: Option<String>,
}

/// What changed in the container's processes during the turn.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcFinding {
    pub changed: bool,
    pub started: Vec<Proc>,
    pub ended: Vec<Proc>,
    /// Persisting processes whose executable changed (exec without fork).
    pub reexeced: Vec<Proc>,
    /// Persisting processes holding a file the turn changed: `[pid, path]`.
    pub held_changed: Vec<(u32, String)>,
    /// Persisting processes that ran, with their memory comparison.
    pub memory: Vec<MemoryFinding>,
    /// Persisting processes that did not run during the turn.
    pub idle: Vec<u32>,
    /// Kernel state changed by routes the inspector counts instead of comparing, by class.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub kernel: std::collections::BTreeMap<String, u64>,
    pub forks: u64,
    pub execs: u64,
    pub exits: u64,
}

impl TurnAnswer {
    /// The one-line summary `crabctl turns` shows after the kind: degraded, fs and procs
    /// counts.
    pub fn why(&self) -> String {
        let mut why = Vec::new();
        if !self.degraded.is_empty() {
            why.push("DEGRADED".to_string());
        }
        let fs = &self.fs;
        if fs.changed {
            why.push(format!(
                "fs +{} ~{} -{}",
                fs.added.len(),
                fs.modified.len(),
                fs.deleted.len()
            ));
        }
        let p = &self.procs;
        let kept = p.memory.iter().filter(|m| m.self_contained).count();
        if kept > 0 {
            why.push(format!("kept {kept} self-contained"));
        }
        let not_kept: Vec<&str> = p
            .memory
            .iter()
            .filter_map(|m| m.not_kept.as_deref())
            .collect();
        if !not_kept.is_empty() {
            why.push(format!("not kept: {}", not_kept.join(" ")));
        }
        if p.changed {
            why.push(format!(
                "procs +{} -{} mem {}",
                p.started.len(),
                p.ended.len(),
                p.memory.len()
            ));
            if !p.kernel.is_empty() {
                let classes: Vec<&str> = p.kernel.keys().map(String::as_str).collect();
                why.push(format!("kernel {}", classes.join(" ")));
            }
        }
        why.join(", ")
    }
}

/// A stored answer with where and when it was written.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub path: PathBuf,
    /// When the shim wrote it (the file's mtime), RFC 3339 UTC like a manifest's `created_at`.
    pub written_at: String,
    pub answer: TurnAnswer,
}

/// Parses one stored answer; `path` names it in the error.
pub fn parse(path: &Path, data: &[u8]) -> Result<TurnAnswer> {
    serde_json::from_slice(data).map_err(|e| CtlError::BadAnswer {
        path: path.to_path_buf(),
        reason: format!(
            "{e} (not a turn answer crab wrote: move the file out of the way to read the others)"
        ),
    })
}

/// Every answer in `dir` (`turns/`), in the order of their numbers (as `crabctl turns` lists
/// them); `Ok(None)` if `dir` is missing.
pub fn read_dir(dir: &Path) -> Result<Option<Vec<Stored>>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(it) => it,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(CtlError::Io {
                what: format!("reading {}", dir.display()),
                source: e,
            })
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let bad = |reason: String| CtlError::BadAnswer {
                path: path.clone(),
                reason,
            };
            let md = std::fs::symlink_metadata(&path).map_err(|e| bad(e.to_string()))?;
            if !md.is_file() {
                return Err(bad(
                    "not a regular file (move it out of the way to read the others)".into(),
                ));
            }
            let data = std::fs::read(&path).map_err(|e| bad(e.to_string()))?;
            let answer = parse(&path, &data)?;
            let written_at = crab_shim::checkpoint::store::rfc3339(
                md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            );
            Ok(Stored {
                path,
                written_at,
                answer,
            })
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    /// What the shim stores: its `Answer` serialized, with the turn id beside (as
    /// `sandbox::store_answer` writes it).
    fn stored_by_the_shim() -> Value {
        use crab_shim::inspector::{
            Answer, FsFinding as F, Kind, MemoryFinding as M, ProcFinding as P, ProcSummary,
        };
        let answer = Answer {
            container_id: "c1".into(),
            seq: 2,
            kind: Kind::Full,
            fs: F {
                changed: true,
                scanned: true,
                unobserved: false,
                syscalls: [("write".to_string(), 3)].into(),
                added: vec!["/app/out".into()],
                modified: vec!["/etc/hosts".into()],
                deleted: vec!["/tmp/x".into()],
            },
            procs: P {
                changed: true,
                started: vec![ProcSummary {
                    pid: 40,
                    cmdline: "sleep 1000".into(),
                }],
                ended: vec![],
                reexeced: vec![],
                held_changed: vec![(1, "/app/out".into())],
                memory: vec![M {
                    pid: 1,
                    cmdline: "sh".into(),
                    changed_pages: 3,
                    added_pages: 1,
                    removed_pages: 0,
                    scanned_pages: 90,
                    unproven_base: false,
                    regions: vec![],
                    state: vec![
                        "fd 3 (pipe:[7]): queue: pipe 0 bytes -> queue: pipe 6 bytes".into(),
                    ],
                    self_contained: false,
                    not_kept: Some(crab_shim::inspector::NotOwn::Interacted),
                }],
                idle: vec![7],
                kernel: [("sysv-ipc".to_string(), 2)].into(),
                forks: 1,
                execs: 1,
                exits: 0,
                read: Default::default(),
            },
            degraded: vec![],
            elapsed_us: 812,
        };
        let mut v = serde_json::to_value(&answer).unwrap();
        v["turn_id"] = json!("t2");
        v
    }

    #[test]
    fn reads_what_the_shim_stores_and_writes_the_same_fields_back() {
        let stored = stored_by_the_shim();
        let a = parse(
            Path::new("turns/000002.json"),
            stored.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(a.turn_id, "t2");
        assert_eq!(a.kind, TurnKind::Full);
        assert_eq!(a.fs.added, ["/app/out"]);
        assert_eq!(a.procs.started[0].cmdline, "sleep 1000");
        assert_eq!(a.procs.held_changed, [(1, "/app/out".to_string())]);
        assert_eq!(
            a.why(),
            "fs +1 ~1 -1, not kept: interacted, procs +1 -0 mem 1, kernel sysv-ipc"
        );
        assert_eq!(a.procs.memory[0].not_kept.as_deref(), Some("interacted"));
        assert_eq!(a.procs.memory[0].state.len(), 1);
        // `show -o json` prints these field names: those of the stored file, none lost.
        let mut back = serde_json::to_value(&a).unwrap();
        // The shim leaves `unobserved` out when false; crabctl always prints it.
        assert_eq!(back["fs"]["unobserved"], false);
        back["fs"].as_object_mut().unwrap().remove("unobserved");
        assert_eq!(back, stored);
        back["fs"]["unobserved"] = json!(false);
        crate::output::tests::documented(&back, crate::output::ANSWER_FIELDS);
        let mut top: Vec<&String> = back.as_object().unwrap().keys().collect();
        top.sort();
        assert_eq!(
            top,
            [
                "container_id",
                "degraded",
                "elapsed_us",
                "fs",
                "kind",
                "procs",
                "seq",
                "turn_id"
            ]
        );
    }

    #[test]
    fn a_corrupt_answer_is_an_error_naming_the_file() {
        let path = Path::new("/store/turns/000003.json");
        let mut wrong_type = stored_by_the_shim();
        wrong_type["fs"]["added"] = json!("not a list");
        let mut unknown_kind = stored_by_the_shim();
        unknown_kind["kind"] = json!("everything");
        let mut no_turn = stored_by_the_shim();
        no_turn.as_object_mut().unwrap().remove("turn_id");
        let mut huge_pid = stored_by_the_shim();
        huge_pid["procs"]["started"][0]["pid"] = json!(1u64 << 40);
        for (what, data) in [
            ("truncated", b"{\"turn_id\": \"t".to_vec()),
            ("empty", Vec::new()),
            ("binary", vec![0xff, 0, 0x13, 0x37]),
            ("an array", b"[1,2]".to_vec()),
            ("wrong type", wrong_type.to_string().into_bytes()),
            ("unknown kind", unknown_kind.to_string().into_bytes()),
            ("no turn id", no_turn.to_string().into_bytes()),
            ("pid out of range", huge_pid.to_string().into_bytes()),
        ] {
            let e = parse(path, &data).unwrap_err();
            assert!(matches!(e, CtlError::BadAnswer { .. }), "{what}: {e}");
            assert_eq!(e.exit_code(), 1, "{what}");
            let msg = e.to_string();
            assert!(
                msg.contains("/store/turns/000003.json") && msg.contains("out of the way"),
                "{what}: {msg}"
            );
        }
    }

    #[test]
    fn a_directory_of_answers_is_read_in_order_and_refuses_what_is_no_answer() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_dir(&dir.path().join("none")).unwrap(), None);
        let mut a = stored_by_the_shim();
        for (seq, turn) in [(2, "t2"), (1, "t1"), (10, "t10")] {
            a["seq"] = json!(seq);
            a["turn_id"] = json!(turn);
            std::fs::write(dir.path().join(format!("{seq:06}.json")), a.to_string()).unwrap();
        }
        // Temporaries and other files are no answers.
        std::fs::write(dir.path().join(".000011.json.tmp"), "{").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
        let read = read_dir(dir.path()).unwrap().unwrap();
        let turns: Vec<&str> = read.iter().map(|s| s.answer.turn_id.as_str()).collect();
        assert_eq!(turns, ["t1", "t2", "t10"]);
        assert!(read[0].written_at.ends_with('Z'), "{}", read[0].written_at);
        // A symlink planted in the store is refused, naming it, not followed.
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("000012.json")).unwrap();
        let e = read_dir(dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("000012.json") && e.to_string().contains("not a regular file"),
            "{e}"
        );
        assert_eq!(e.exit_code(), 1);
    }
}
