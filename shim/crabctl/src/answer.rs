//! The turn answers the shim stores (`<sandbox>/turns/<seq:06>.json`), read as typed data:
//! what `turns`, `show` and `diff` print and compute from.
//!
//! The stored document is the shim's own [`TurnRecord`] (the inspector's answer with the
//! harness's turn id), parsed with the types that wrote it; its field names are those of the
//! file and of `-o json` alike. The store is a trust boundary: a file that does not parse as an
//! answer is an error naming it (exit 1), never skipped or guessed at.

use std::{
    path::{Path, PathBuf},
    time::SystemTime,
};

pub use crab_shim::{inspector::Answer, sandbox::TurnRecord};

use crate::{CtlError, Result};

/// The one-line summary `crabctl turns` shows after the kind: degraded, fs and procs counts.
pub fn why(a: &Answer) -> String {
    let mut why = Vec::new();
    if !a.degraded.is_empty() {
        why.push("DEGRADED".to_string());
    }
    let fs = &a.fs;
    if fs.changed {
        why.push(format!(
            "fs +{} ~{} -{}",
            fs.added.len(),
            fs.modified.len(),
            fs.deleted.len()
        ));
    }
    let p = &a.procs;
    let kept = p.memory.iter().filter(|m| m.self_contained).count();
    if kept > 0 {
        why.push(format!("kept {kept} self-contained"));
    }
    // Each reason by its name in the answer (`interacted`, `shared_memory`, ...).
    let not_kept: Vec<String> = p
        .memory
        .iter()
        .filter_map(|m| serde_json::to_value(m.not_kept?).ok())
        .filter_map(|v| v.as_str().map(str::to_string))
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

/// A stored answer with where and when it was written.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub path: PathBuf,
    /// When the shim wrote it (the file's mtime), RFC 3339 UTC like a manifest's `created_at`.
    pub written_at: String,
    pub record: TurnRecord,
}

/// Parses one stored answer; `path` names it in the error.
pub fn parse(path: &Path, data: &[u8]) -> Result<TurnRecord> {
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
            let record = parse(&path, &data)?;
            let written_at = crab_shim::checkpoint::store::rfc3339(
                md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            );
            Ok(Stored {
                path,
                written_at,
                record,
            })
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use crab_shim::{
        inspector::{
            memory::ObservationStats, FsFinding as F, Kind, MemoryFinding as M, NotOwn,
            ProcFinding as P, ProcSummary,
        },
        sandbox::RollbackNote,
    };
    use serde_json::{json, Value};

    use super::*;

    /// A turn's record as the shim makes it.
    fn record() -> TurnRecord {
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
                    // Not stored (the log's): empty, so that the record reads back equal.
                    regions: vec![],
                    state: vec![
                        "fd 3 (pipe:[7]): queue: pipe 0 bytes -> queue: pipe 6 bytes".into(),
                    ],
                    self_contained: false,
                    not_kept: Some(NotOwn::Interacted),
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
        TurnRecord {
            turn_id: "t2".into(),
            answer,
            rollback: None,
        }
    }

    /// What the shim stores (`sandbox::store_answer` writes the record as it serializes).
    fn stored_by_the_shim() -> Value {
        serde_json::to_value(record()).unwrap()
    }

    #[test]
    fn reads_what_the_shim_stores_and_writes_the_same_fields_back() {
        let stored = stored_by_the_shim();
        let t = parse(
            Path::new("turns/000002.json"),
            stored.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(t, record(), "the shim's record reads back whole");
        let a = &t.answer;
        assert_eq!(t.turn_id, "t2");
        assert_eq!(a.kind, Kind::Full);
        assert_eq!(a.fs.added, [Path::new("/app/out")]);
        assert_eq!(a.procs.started[0].cmdline, "sleep 1000");
        assert_eq!(a.procs.held_changed, [(1, PathBuf::from("/app/out"))]);
        assert_eq!(
            why(a),
            "fs +1 ~1 -1, not kept: interacted, procs +1 -0 mem 1, kernel sysv-ipc"
        );
        assert_eq!(a.procs.memory[0].not_kept, Some(NotOwn::Interacted));
        assert_eq!(a.procs.memory[0].state.len(), 1);
        // `show -o json` prints these field names: those of the stored file, none lost.
        let back = serde_json::to_value(&t).unwrap();
        assert_eq!(back, stored);
        assert_eq!(back["fs"]["unobserved"], false);
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
        // What an observation read, and the note of an in-place rollback, when there are.
        let mut t = record();
        t.answer.procs.read = ObservationStats {
            memory_bytes: 4096,
            ..Default::default()
        };
        t.rollback = Some(RollbackNote {
            to_checkpoint: 3,
            to_turn: "t1".into(),
            checkpoint: Some(5),
            in_place: true,
            paths: 2,
        });
        let data = serde_json::to_vec_pretty(&t).unwrap();
        let read = parse(Path::new("turns/000002.json"), &data).unwrap();
        assert_eq!(read, t);
        crate::output::tests::documented(
            &serde_json::to_value(&read).unwrap(),
            crate::output::ANSWER_FIELDS,
        );
    }

    /// Answers written by older shims, before fields were added: each missing field takes its
    /// default.
    #[test]
    fn older_answers_without_the_newer_fields_still_parse() {
        let oldest = json!({
            "turn_id": "t1",
            "container_id": "c1",
            "seq": 1,
            "kind": "proc",
            "fs": {"changed": false, "added": [], "modified": [], "deleted": []},
            "procs": {
                "changed": true,
                "started": [{"pid": 9, "cmdline": "sleep 1"}],
                "ended": [],
                "memory": [{"pid": 1, "cmdline": "sh", "changed_pages": 2}],
                "forks": 1, "execs": 1, "exits": 0
            }
        });
        let t = parse(
            Path::new("turns/000001.json"),
            oldest.to_string().as_bytes(),
        )
        .unwrap();
        let a = &t.answer;
        assert_eq!((t.turn_id.as_str(), a.seq, a.kind), ("t1", 1, Kind::Proc));
        assert!(!a.fs.scanned && !a.fs.unobserved && a.fs.syscalls.is_empty());
        assert!(a.procs.reexeced.is_empty() && a.procs.held_changed.is_empty());
        assert!(a.procs.idle.is_empty() && a.procs.kernel.is_empty());
        assert!(a.procs.read.is_empty());
        let m = &a.procs.memory[0];
        assert_eq!((m.pid, m.changed_pages, m.scanned_pages), (1, 2, 0));
        assert!(!m.self_contained && m.not_kept.is_none() && m.state.is_empty());
        assert!(a.degraded.is_empty() && a.elapsed_us == 0 && t.rollback.is_none());
        assert_eq!(why(a), "procs +1 -0 mem 1");
        // `read` from before it counted queued bytes.
        let mut v = stored_by_the_shim();
        v["procs"]["read"] = json!({"memory_bytes": 8192, "fdinfo_bytes": 10});
        let t = parse(Path::new("turns/000002.json"), v.to_string().as_bytes()).unwrap();
        assert_eq!(t.answer.procs.read.memory_bytes, 8192);
        assert_eq!(t.answer.procs.read.queue_bytes, 0);
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
        let turns: Vec<&str> = read.iter().map(|s| s.record.turn_id.as_str()).collect();
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
