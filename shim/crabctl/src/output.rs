//! Machine-readable output (`-o json`, alias `--json`): one JSON document per invocation on
//! stdout, newline-terminated, serialized from the typed structs below (never formatted by
//! hand). Their field names are stable and snake_case; docs/crabctl.md lists them.
//!
//! | command | document |
//! |---|---|
//! | `turns` | array of turn answers ([`crate::answer::TurnRecord`]), oldest first |
//! | `show` | one turn answer |
//! | `checkpoints` | array of [`CheckpointRow`], oldest first |
//! | `diff` | [`crate::diff::Diff`] |
//! | `fork` | [`ForkReport`] |
//! | `prune` | [`PruneReport`] |
//! | `engine` | the engine's snapshot (`crab_shim::engine::Snapshot`) |
//!
//! A command that fails prints an [`ErrorReport`] on stdout instead (and its message on stderr,
//! with the exit status of its kind), except `prune`, whose report (with `failures` counted)
//! is the document even when removals failed. A command line that does not parse (exit 2 from
//! the argument parser) prints nothing on stdout: its format is not known.

use std::path::PathBuf;

use serde::Serialize;

use crate::{
    error::ErrorKind,
    lifecycle::{Forked, RollbackWay, RolledBack},
    prune::{Outcome, Pruned},
    CtlError,
};
use crab_shim::checkpoint::store::{CheckpointKind, Manifest};

/// `crabctl show --help`, `turns --help`: the fields of a turn answer in `-o json`.
pub const ANSWER_FIELDS: &str = "\
JSON (-o json): a turn answer is {turn_id, container_id, seq (the turn's number in its task),
kind (none|fs|proc|full), fs {changed, scanned, unobserved, syscalls {class: count}, added,
modified, deleted (paths)}, procs {changed, started, ended, reexeced [{pid, cmdline}],
held_changed [[pid, path]], memory [{pid, cmdline, changed_pages, added_pages, removed_pages,
scanned_pages, state (kernel-held state that changed: pending signals, stopped, fds and what
they hold), self_contained (true: its own doing alone, its last image kept), not_kept (why a
change the keeping policy could have kept was not: interacted, running, shared_memory,
state_changed, no_count, foreign_write, unproven_base, no_threads, policy)}], idle (pids),
kernel {class: count} (kernel state changed by routes counted, not compared: pidfd-getfd,
userfaultfd, ptrace-write, other-process, sysv-ipc, uts, procfs, async-io, tmpfs), forks, execs,
exits, read (what the observation read, when it read anything: memory_bytes, shared_objects,
shared_bytes, shared_bytes_reused, carried_memory_bytes, carried_fdinfo_bytes, fdinfo_bytes,
queue_bytes)}, degraded (reasons), elapsed_us, rollback (on the first turn after an in-place
rollback: {to_checkpoint, to_turn, checkpoint, in_place, paths})}; turns prints an array of
them, oldest first.";

/// `crabctl checkpoints --help`: the fields of a row in `-o json`.
pub const CHECKPOINT_FIELDS: &str = "\
JSON (-o json): an array, oldest first, of {seq, parent, turn_id, kind
(fs|proc|full|failed|created|restored), recovery_point, layers, image_layers, layer_bytes,
process_bytes, process_logical_bytes (null without a process image), pids, freeze_ms,
capture_ms, total_ms, created_at (RFC 3339 UTC), explanation, volumes, lineage (the
lineage its store records; null for a store older than lineages)}.";

/// `crabctl diff --help`: the fields of `-o json`.
pub const DIFF_FIELDS: &str = "\
JSON (-o json): {container, from {arg, checkpoint, turn_id}, to {...}, turns (ids between),
complete, incomplete (reasons), files {created, modified, deleted}, processes {started, ended,
transient, alive: [{pid, cmdline}]}, memory [{pid, cmdline, changed_pages, added_pages,
removed_pages}], checkpoints [{seq, kind, turn_id, new_layers, new_layer_bytes,
process_bytes}]}.";

/// `crabctl fork --help`: the fields of `-o json`.
pub const FORK_FIELDS: &str = "\
JSON (-o json): {container, seq, turn_id (the checkpoint), image, image_reused (it was in
containerd already, from an earlier fork or rollback to that checkpoint), forks [{id, pid,
container_ms (Snapshots.Prepare + Containers.Create), task_create_ms (the shim takes the
checkpoint out of the rootfs), task_start_ms (runc restore), total_ms (the three: this
sandbox's own time), done_at_ms (from the launch of all forks until it ran)}], checkpoint_ms
(export and unpack), start_ms (all forks, concurrently), total_ms, per_sandbox_ms {min, p50,
max} (of the forks' total_ms), merge_memory (--merge-memory), ksmd_running (the host's ksmd
merges pages; null: no KSM in this kernel)}.";

/// `crabctl prune --help`: the fields of `-o json`.
pub const PRUNE_FIELDS: &str = "\
JSON (-o json): {dry_run, namespaces, state_dirs, stores [{path, outcome
(removed|finished|kept|failed), reason, bytes}], images [{name, outcome, reason}], existing,
warnings, restore_caches [{path, entries, bytes}], removed_stores, removed_bytes,
removed_images, failures}; printed even when removals failed (exit 1).";

/// `crabctl engine --help`: the fields of `-o json`.
pub const ENGINE_FIELDS: &str = "\
JSON (-o json or --json): {root, max_jobs, io_budget_bytes_s, budget_level, slots [{index,
holder}], queue [{ticket, info, urgent, waiting_us}], stats {jobs, urgent_jobs, bytes,
wait_us_total, wait_us_max, run_us_total, waits_us, recent, wait_buckets (jobs per wait bucket
of crabctl metrics' crab_engine_wait_seconds, not cumulative, the last +Inf), wait_buckets_us}}.";

/// How a command prints its result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// for people: tables and sentences
    #[default]
    Text,
    /// one JSON document on stdout (field names: see docs/crabctl.md)
    Json,
}

/// Prints `value` as one JSON document (pretty, newline-terminated) on stdout.
pub fn print_json<T: Serialize + ?Sized>(value: &T) {
    println!("{}", to_json(value));
}

/// `value` as the JSON document crabctl prints.
pub fn to_json<T: Serialize + ?Sized>(value: &T) -> String {
    // Every type printed is made of strings, numbers, sequences and string-keyed maps.
    serde_json::to_string_pretty(value).expect("crabctl's output types serialize")
}

/// What `-o json` prints on stdout when a command fails.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorReport {
    pub error: ErrorBody,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorBody {
    /// `failed`, `not_found`, `refused` or `usage`.
    pub kind: &'static str,
    /// The exit status (1, 3, 4, 2).
    pub exit_code: u8,
    /// The message stderr shows too.
    pub message: String,
}

impl ErrorReport {
    pub fn of(e: &CtlError) -> ErrorReport {
        let kind = match e.kind() {
            ErrorKind::Failed => "failed",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Refused => "refused",
            ErrorKind::Usage => "usage",
        };
        ErrorReport {
            error: ErrorBody {
                kind,
                exit_code: e.exit_code(),
                message: e.to_string(),
            },
        }
    }
}

/// The name of a checkpoint kind as the store writes it (`fs`, `proc`, `full`, `failed`,
/// `created`, `restored`).
pub fn kind_name(k: CheckpointKind) -> String {
    format!("{k:?}").to_lowercase()
}

/// One checkpoint of `crabctl checkpoints -o json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointRow {
    pub seq: u64,
    pub parent: Option<u64>,
    /// The turn(s) it was taken for (comma-separated when turns were coalesced; empty for an
    /// origin).
    pub turn_id: String,
    /// `fs`, `proc`, `full`, `failed` (no recovery point), `created`, `restored` (origins).
    pub kind: String,
    /// Whether it can be exported, forked from, rolled back to (every kind but `failed`).
    pub recovery_point: bool,
    /// The fs layers of its whole chain, oldest first.
    pub layers: usize,
    /// Of `layers`, the first ones the container's image carries.
    pub image_layers: usize,
    /// Bytes of its chain's layers (compressed, as stored).
    pub layer_bytes: u64,
    /// Bytes its process image takes in the store (`null`: no process image).
    pub process_bytes: Option<u64>,
    /// Bytes of the memory its process image holds (before sharing and compression).
    pub process_logical_bytes: Option<u64>,
    /// The pids its process image holds.
    pub pids: Vec<u32>,
    pub freeze_ms: f64,
    pub capture_ms: f64,
    pub total_ms: f64,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// Why it was taken as it was (or why it failed).
    pub explanation: String,
    /// Tracked volumes its layers hold whole.
    pub volumes: Vec<PathBuf>,
    /// The lineage its store records (`null`: recorded by none, a store older than lineages).
    pub lineage: Option<String>,
}

impl From<&Manifest> for CheckpointRow {
    fn from(m: &Manifest) -> CheckpointRow {
        CheckpointRow {
            seq: m.seq,
            parent: m.parent,
            turn_id: m.turn_id.clone(),
            kind: kind_name(m.kind),
            recovery_point: m.kind.is_durable_state(),
            layers: m.fs_layers.len(),
            image_layers: m.image_layers,
            layer_bytes: m.fs_layers.iter().map(|l| l.size).sum(),
            process_bytes: m.process.as_ref().map(|p| p.bytes_stored),
            process_logical_bytes: m.process.as_ref().map(|p| p.bytes_logical),
            pids: m
                .process
                .as_ref()
                .map(|p| p.pids.clone())
                .unwrap_or_default(),
            freeze_ms: m.timings.freeze_ms,
            capture_ms: m.timings.capture_ms,
            total_ms: m.timings.total_ms,
            created_at: m.created_at.clone(),
            explanation: m.explanation.clone(),
            volumes: m.volumes.clone(),
            lineage: None,
        }
    }
}

/// What `crabctl fork -o json` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForkReport {
    /// The container forked.
    pub container: String,
    /// The checkpoint the forks started from.
    pub seq: u64,
    pub turn_id: String,
    /// The (internal) image they run.
    pub image: String,
    /// That image was in containerd already (an earlier fork or rollback to the same
    /// checkpoint) and was not built again.
    pub image_reused: bool,
    /// The forks, in id order.
    pub forks: Vec<ForkItem>,
    pub checkpoint_ms: f64,
    pub start_ms: f64,
    pub total_ms: f64,
    /// Of the forks' own times (`total_ms`).
    pub per_sandbox_ms: Spread,
    /// The forks' processes are marked for same-page merging (`--merge-memory`).
    pub merge_memory: bool,
    /// The host's ksmd runs (null: no KSM in this kernel).
    pub ksmd_running: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForkItem {
    pub id: String,
    /// Its init's pid on the host.
    pub pid: u32,
    pub container_ms: f64,
    pub task_create_ms: f64,
    pub task_start_ms: f64,
    pub total_ms: f64,
    pub done_at_ms: f64,
}

/// Minimum, median and maximum of some milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub min: f64,
    pub p50: f64,
    pub max: f64,
}

impl ForkReport {
    pub fn of(container: &str, f: &Forked) -> ForkReport {
        let s = &f.exported.source;
        ForkReport {
            container: container.to_string(),
            seq: s.seq,
            turn_id: s.turn_id.clone(),
            image: f.exported.reference.clone(),
            image_reused: f.exported.reused,
            forks: f
                .forks
                .iter()
                .map(|r| ForkItem {
                    id: r.id.clone(),
                    pid: r.pid,
                    container_ms: r.times.container_ms,
                    task_create_ms: r.times.task_create_ms,
                    task_start_ms: r.times.task_start_ms,
                    total_ms: r.times.total_ms,
                    done_at_ms: r.times.done_at_ms,
                })
                .collect(),
            checkpoint_ms: f.phases.checkpoint_ms,
            start_ms: f.phases.start_ms,
            total_ms: f.phases.total_ms,
            per_sandbox_ms: {
                let (min, p50, max) = f.per_sandbox_ms();
                Spread { min, p50, max }
            },
            merge_memory: f.merge_memory,
            ksmd_running: f.ksmd_running,
        }
    }
}

/// What `crabctl rollback -o json` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RollbackReport {
    pub container: String,
    /// The checkpoint returned to.
    pub seq: u64,
    pub turn_id: String,
    /// `in_place` (files reset, processes kept) or `recreated` (a new task from the checkpoint).
    pub way: &'static str,
    /// Why it was not done in place (`recreated` only; `null` when it was not tried:
    /// `--recreate`, or a recovery).
    pub not_in_place: Option<String>,
    /// The init's pid now (unchanged in place).
    pub pid: u32,
    /// In place: the paths reset, how long the container was frozen and, of that, how long
    /// the files took; the `restored` checkpoint that records it.
    pub paths: Option<u64>,
    pub freeze_ms: Option<f64>,
    pub apply_ms: Option<f64>,
    pub recorded: Option<u64>,
    /// Recreated: the (internal) image the new task runs.
    pub image: Option<String>,
    /// Recreated: that image was in containerd already (built for an earlier rollback or fork
    /// to the same checkpoint) and was not built again.
    pub image_reused: Option<bool>,
    pub checkpoint_ms: f64,
    pub stop_ms: f64,
    pub start_ms: f64,
    pub total_ms: f64,
}

impl RollbackReport {
    pub fn of(container: &str, r: &RolledBack) -> RollbackReport {
        let mut out = RollbackReport {
            container: container.to_string(),
            seq: r.seq,
            turn_id: r.turn_id.clone(),
            way: "recreated",
            not_in_place: r.not_in_place.clone(),
            pid: r.pid,
            paths: None,
            freeze_ms: None,
            apply_ms: None,
            recorded: None,
            image: None,
            image_reused: None,
            checkpoint_ms: r.phases.checkpoint_ms,
            stop_ms: r.phases.stop_ms,
            start_ms: r.phases.start_ms,
            total_ms: r.phases.total_ms,
        };
        match &r.way {
            RollbackWay::InPlace(p) => {
                out.way = "in_place";
                out.paths = Some(p.paths);
                out.freeze_ms = Some(p.freeze_ms);
                out.apply_ms = Some(p.apply_ms);
                out.recorded = p.recorded;
            }
            RollbackWay::Recreated { exported, .. } => {
                out.image = Some(exported.reference.clone());
                out.image_reused = Some(exported.reused);
            }
        }
        out
    }
}

/// What `crabctl prune -o json` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PruneReport {
    /// Nothing was removed: the items say what would be.
    pub dry_run: bool,
    pub namespaces: Vec<String>,
    pub state_dirs: Vec<PathBuf>,
    /// Store directories, leftovers and other entries looked at (not those of existing
    /// containers).
    pub stores: Vec<PruneStore>,
    /// Internal images looked at.
    pub images: Vec<PruneImage>,
    /// Stores of existing containers (kept, not listed).
    pub existing: usize,
    pub warnings: Vec<String>,
    /// Each state dir's restore cache: its entries and bytes removed (would be).
    pub restore_caches: Vec<PruneCache>,
    /// Store directories removed (would be) and their bytes, images removed (would be).
    pub removed_stores: usize,
    pub removed_bytes: u64,
    pub removed_images: usize,
    /// Removals that failed (then crabctl exits 1).
    pub failures: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PruneStore {
    pub path: PathBuf,
    /// `removed`, `finished` (an interrupted prune's leftover), `kept` or `failed`.
    pub outcome: &'static str,
    /// Why it was kept, or why its removal failed.
    pub reason: Option<String>,
    /// Disk usage (allocated bytes) of what was (would be) removed.
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PruneCache {
    pub path: PathBuf,
    pub entries: usize,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PruneImage {
    pub name: String,
    pub outcome: &'static str,
    pub reason: Option<String>,
}

fn outcome(o: &Outcome) -> (&'static str, Option<String>) {
    match o {
        Outcome::Removed => ("removed", None),
        Outcome::Finished => ("finished", None),
        Outcome::Kept(why) => ("kept", Some(why.clone())),
        Outcome::Failed(e) => ("failed", Some(e.clone())),
    }
}

impl From<&Pruned> for PruneReport {
    fn from(p: &Pruned) -> PruneReport {
        let gone = |o: &Outcome| matches!(o, Outcome::Removed | Outcome::Finished);
        PruneReport {
            dry_run: p.dry_run,
            namespaces: p.namespaces.clone(),
            state_dirs: p.state_dirs.clone(),
            stores: p
                .stores
                .iter()
                .map(|s| {
                    let (outcome, reason) = outcome(&s.outcome);
                    PruneStore {
                        path: s.path.clone(),
                        outcome,
                        reason,
                        bytes: s.bytes,
                    }
                })
                .collect(),
            images: p
                .images
                .iter()
                .map(|i| {
                    let (outcome, reason) = outcome(&i.outcome);
                    PruneImage {
                        name: i.name.clone(),
                        outcome,
                        reason,
                    }
                })
                .collect(),
            existing: p.existing,
            warnings: p.warnings.clone(),
            restore_caches: p
                .restore_caches
                .iter()
                .map(|c| PruneCache {
                    path: c.path.clone(),
                    entries: c.entries,
                    bytes: c.bytes,
                })
                .collect(),
            removed_stores: p.stores.iter().filter(|s| gone(&s.outcome)).count(),
            removed_bytes: p
                .stores
                .iter()
                .filter(|s| gone(&s.outcome))
                .map(|s| s.bytes)
                .sum(),
            removed_images: p.images.iter().filter(|i| gone(&i.outcome)).count(),
            failures: p.failures(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::prune::{ImageItem, StoreItem};
    use crab_shim::checkpoint::store::{Descriptor, ProcessImage};

    /// The keys of a JSON object, sorted.
    fn keys(v: &Value) -> Vec<&str> {
        let mut k: Vec<&str> = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {v}"))
            .keys()
            .map(String::as_str)
            .collect();
        k.sort_unstable();
        k
    }

    /// Every key of `v`, at any depth.
    fn all_keys(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    out.push(k.clone());
                    all_keys(x, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|x| all_keys(x, out)),
            _ => {}
        }
    }

    /// Each field of `doc` is named in `help` (as a word).
    pub(crate) fn documented(doc: &Value, help: &str) {
        let words: Vec<&str> = help
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .collect();
        let mut keys = Vec::new();
        all_keys(doc, &mut keys);
        assert!(!keys.is_empty());
        for k in keys {
            // syscalls' and kernel's keys are classes, not fields
            if ["write", "unlink", "sysv-ipc"].contains(&k.as_str()) {
                continue;
            }
            assert!(
                words.contains(&k.as_str()),
                "{k} is not documented in:\n{help}"
            );
        }
    }

    #[test]
    fn help_documents_every_field() {
        let mut m = Manifest::child_of(None, 1, "t", CheckpointKind::Full);
        m.process = Some(ProcessImage {
            image: "proc/000001".into(),
            bytes_stored: 1,
            bytes_logical: 1,
            pids: vec![1],
        });
        documented(
            &serde_json::to_value([CheckpointRow::from(&m)]).unwrap(),
            CHECKPOINT_FIELDS,
        );
        let p = Pruned {
            stores: vec![StoreItem {
                path: "/x".into(),
                outcome: Outcome::Removed,
                bytes: 1,
            }],
            images: vec![ImageItem {
                name: "x".into(),
                outcome: Outcome::Removed,
            }],
            restore_caches: vec![crate::prune::CacheItem {
                path: "/x/.restore-cache".into(),
                entries: 1,
                bytes: 1,
            }],
            ..Pruned::default()
        };
        documented(
            &serde_json::to_value(PruneReport::from(&p)).unwrap(),
            PRUNE_FIELDS,
        );
        let fork = ForkReport {
            container: "c1".into(),
            seq: 2,
            turn_id: "t1".into(),
            image: "crab.local/checkpoint/default/c1:2".into(),
            image_reused: false,
            forks: vec![ForkItem {
                id: "c1-fork-1".into(),
                pid: 7,
                container_ms: 3.0,
                task_create_ms: 20.0,
                task_start_ms: 100.0,
                total_ms: 123.0,
                done_at_ms: 125.0,
            }],
            checkpoint_ms: 1.0,
            start_ms: 125.0,
            total_ms: 126.0,
            per_sandbox_ms: Spread {
                min: 123.0,
                p50: 123.0,
                max: 123.0,
            },
            merge_memory: true,
            ksmd_running: Some(false),
        };
        let v = serde_json::to_value(&fork).unwrap();
        assert_eq!(v["forks"][0]["id"], "c1-fork-1");
        assert_eq!(v["forks"][0]["pid"], 7);
        assert_eq!(v["forks"][0]["task_start_ms"], 100.0);
        assert_eq!(v["per_sandbox_ms"]["p50"], 123.0);
        documented(&v, FORK_FIELDS);
        let engine_root = tempfile::tempdir().unwrap();
        let config = crab_runtime_config::EngineConfig {
            root: engine_root.path().to_path_buf(),
            ..crab_runtime_config::EngineConfig::default()
        };
        let snapshot = crab_shim::engine::Engine::new(&config).snapshot().unwrap();
        documented(&serde_json::to_value(&snapshot).unwrap(), ENGINE_FIELDS);
        documented(
            &serde_json::to_value(&snapshot).unwrap()["stats"],
            ENGINE_FIELDS,
        );
    }

    #[test]
    fn error_reports_carry_kind_status_and_message() {
        let e = CtlError::NoTurn {
            container: "c1".into(),
            turn: "t9".into(),
        };
        let v = serde_json::to_value(ErrorReport::of(&e)).unwrap();
        assert_eq!(
            v,
            json!({"error": {"kind": "not_found", "exit_code": 3, "message": e.to_string()}})
        );
        let v = serde_json::to_value(ErrorReport::of(&CtlError::Refused("no".into()))).unwrap();
        assert_eq!(
            (&v["error"]["kind"], &v["error"]["exit_code"]),
            (&json!("refused"), &json!(4))
        );
        // One document, newline-terminated when printed (println! adds it): no newline inside
        // a line's worth of error that would split it.
        assert!(to_json(&ErrorReport::of(&e)).starts_with('{'));
    }

    #[test]
    fn checkpoint_rows_pin_their_field_names() {
        let mut m = Manifest::child_of(None, 3, "t2", CheckpointKind::Full);
        m.parent = Some(2);
        m.fs_layers = vec![
            Descriptor {
                digest: format!("sha256:{}", "a".repeat(64)),
                diff_id: format!("sha256:{}", "b".repeat(64)),
                size: 100,
                media_type: crab_shim::checkpoint::store::MEDIA_TYPE_LAYER_ZSTD.into(),
            };
            2
        ];
        m.fs_layers[1].size = 23;
        m.process = Some(ProcessImage {
            image: "proc/000003".into(),
            bytes_stored: 4096,
            bytes_logical: 8192,
            pids: vec![1, 7],
        });
        let v = serde_json::to_value(CheckpointRow::from(&m)).unwrap();
        assert_eq!(
            keys(&v),
            [
                "capture_ms",
                "created_at",
                "explanation",
                "freeze_ms",
                "image_layers",
                "kind",
                "layer_bytes",
                "layers",
                "lineage",
                "parent",
                "pids",
                "process_bytes",
                "process_logical_bytes",
                "recovery_point",
                "seq",
                "total_ms",
                "turn_id",
                "volumes"
            ]
        );
        assert_eq!(v["seq"], 3);
        assert_eq!(v["parent"], 2);
        assert_eq!(v["kind"], "full");
        assert_eq!(v["recovery_point"], true);
        assert_eq!(v["layers"], 2);
        assert_eq!(v["layer_bytes"], 123);
        assert_eq!(v["process_bytes"], 4096);
        assert_eq!(v["pids"], json!([1, 7]));
        let failed = Manifest::child_of(None, 1, "", CheckpointKind::Failed);
        let v = serde_json::to_value(CheckpointRow::from(&failed)).unwrap();
        assert_eq!(v["recovery_point"], false);
        assert_eq!(v["process_bytes"], Value::Null);
        assert_eq!(v["parent"], Value::Null);
    }

    #[test]
    fn prune_reports_pin_their_field_names_and_totals() {
        let p = Pruned {
            dry_run: true,
            namespaces: vec!["default".into()],
            state_dirs: vec!["/var/lib/crab".into()],
            stores: vec![
                StoreItem {
                    path: "/var/lib/crab/default/gone".into(),
                    outcome: Outcome::Removed,
                    bytes: 1000,
                },
                StoreItem {
                    path: "/var/lib/crab/default/.replaced-x-1".into(),
                    outcome: Outcome::Finished,
                    bytes: 24,
                },
                StoreItem {
                    path: "/var/lib/crab/default/link".into(),
                    outcome: Outcome::Kept("a symlink".into()),
                    bytes: 0,
                },
            ],
            images: vec![ImageItem {
                name: "crab.local/checkpoint/default/gone:2".into(),
                outcome: Outcome::Failed("in use".into()),
            }],
            existing: 4,
            warnings: vec!["w".into()],
            restore_caches: vec![crate::prune::CacheItem {
                path: "/var/lib/crab/.restore-cache".into(),
                entries: 2,
                bytes: 4096,
            }],
        };
        let v = serde_json::to_value(PruneReport::from(&p)).unwrap();
        assert_eq!(
            keys(&v),
            [
                "dry_run",
                "existing",
                "failures",
                "images",
                "namespaces",
                "removed_bytes",
                "removed_images",
                "removed_stores",
                "restore_caches",
                "state_dirs",
                "stores",
                "warnings"
            ]
        );
        assert_eq!(keys(&v["restore_caches"][0]), ["bytes", "entries", "path"]);
        assert_eq!(
            keys(&v["stores"][0]),
            ["bytes", "outcome", "path", "reason"]
        );
        assert_eq!(keys(&v["images"][0]), ["name", "outcome", "reason"]);
        assert_eq!(v["stores"][1]["outcome"], "finished");
        assert_eq!(v["stores"][2]["outcome"], "kept");
        assert_eq!(v["stores"][2]["reason"], "a symlink");
        assert_eq!(v["images"][0]["outcome"], "failed");
        assert_eq!(
            (
                &v["removed_stores"],
                &v["removed_bytes"],
                &v["removed_images"],
                &v["failures"]
            ),
            (&json!(2), &json!(1024), &json!(0), &json!(1))
        );
    }
}
