//! crab's host-level figures (what `crabctl metrics` prints), derived from what the stores
//! already record, so they survive shim restarts and need no daemon:
//!
//! - each turn answer (`turns/<seq:06>.json`): the inspector's decision (`none`, `fs`,
//!   `proc`, `full`), whether it was degraded, and how long the decision took (`elapsed_us`);
//! - each published manifest (`checkpoints/<seq:06>.json`): the checkpoint's kind and
//!   outcome, its duration and freeze, the bytes it added to the store (the new layer, the
//!   process image after deduplication);
//! - `retired.json` in the store root: the same figures of the manifests and answers that
//!   retention removed ([`Retired`], written by [`retire`], which the checkpoint coordinator
//!   calls before retention removes anything), so no counter goes down when retention
//!   deletes the files it was derived from;
//! - `.pruned-metrics.json` in a namespace directory: the figures of the stores `crabctl
//!   prune` removed from it ([`Pruned`], [`fold_pruned_store`]);
//! - `restores.json` in the host engine's directory: restores by outcome ([`Restores`],
//!   counted by the shim).
//!
//! [`Tally`] is the sum of those figures; [`scan_store`] reads one store's. The figures of a
//! manifest or an answer are read through small views ([`ManifestFigures`],
//! [`AnswerFigures`]) that skip the rest of the file (paths, explanations) unparsed. Published
//! files never change (they appear by rename), so [`ScanCache`] keeps each file's figures by
//! name, size and mtime and a later scan reads only what is new.
//!
//! Nothing here trusts the files: one that cannot be read or parsed, or has a newer format,
//! is counted in [`StoreFigures::unreadable`] (with a warning naming it) and adds nothing
//! else; a hostile size or duration is clamped, never a panic.

use std::{
    collections::HashMap,
    fs,
    io::{self, Write},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::checkpoint::store::{self, CheckpointKind};

/// The file in a store root holding the figures retention removed.
pub const RETIRED_FILE: &str = "retired.json";

/// Turn-end decision latency buckets (seconds).
pub const DECISION_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
/// Checkpoint duration and freeze buckets (seconds).
pub const CHECKPOINT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Engine slot wait buckets (seconds).
pub const WAIT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Replication lag buckets (seconds): a checkpoint durable to pushed.
pub const REPLICATION_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// No duration a file claims counts for more than this (a day): a hostile or corrupt figure
/// cannot push a sum to infinity.
const MAX_SECONDS: f64 = 86_400.0;

/// A histogram over fixed bounds: `counts[i]` observations in bucket `i` (not cumulative; the
/// last one is `+Inf`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn observe(&mut self, bounds: &[f64], value: f64) {
        let value = if value.is_finite() {
            value.clamp(0.0, MAX_SECONDS)
        } else {
            MAX_SECONDS
        };
        self.counts.resize(bounds.len() + 1, 0);
        let i = bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }

    pub fn merge(&mut self, other: &Histogram) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum += other.sum;
        self.count += other.count;
    }

    /// `(upper bound, cumulative count)` for each bound and `+Inf`, as OpenMetrics wants them.
    pub fn cumulative(&self, bounds: &[f64]) -> Vec<(f64, u64)> {
        let mut total = 0;
        bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .enumerate()
            .map(|(i, b)| {
                total += self.counts.get(i).copied().unwrap_or(0);
                (b, total)
            })
            .collect()
    }

    /// Whether it fits `bounds` (a file written with other bounds is not merged).
    fn fits(&self, bounds: &[f64]) -> bool {
        (self.counts.is_empty() || self.counts.len() == bounds.len() + 1)
            && self.counts.iter().sum::<u64>() == self.count
            && self.sum.is_finite()
            && self.sum >= 0.0
    }
}

/// The inspector's decisions (turn answers by kind).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Decisions {
    pub none: u64,
    pub fs: u64,
    pub proc: u64,
    pub full: u64,
}

/// Checkpoints of one kind by outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Outcomes {
    /// Published, for turns the inspector observed.
    pub ok: u64,
    /// Published, for a turn the inspector could not observe (a full checkpoint in its place).
    pub degraded: u64,
    /// Attempted and failed (a `failed` manifest).
    pub failed: u64,
}

/// Something per checkpoint kind; `unknown` is for failed checkpoints recorded before crab
/// recorded what a failed one attempted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PerKind<T> {
    pub fs: T,
    pub proc: T,
    pub full: T,
    pub unknown: T,
}

impl<T> PerKind<T> {
    pub fn get_mut(&mut self, kind: Option<CheckpointKind>) -> &mut T {
        match kind {
            Some(CheckpointKind::Fs) => &mut self.fs,
            Some(CheckpointKind::Proc) => &mut self.proc,
            Some(CheckpointKind::Full) => &mut self.full,
            _ => &mut self.unknown,
        }
    }

    /// `(label, value)` of each kind.
    pub fn iter(&self) -> [(&'static str, &T); 4] {
        [
            ("fs", &self.fs),
            ("proc", &self.proc),
            ("full", &self.full),
            ("unknown", &self.unknown),
        ]
    }
}

/// The figures of any number of turn answers and checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tally {
    /// Turn answers by the inspector's decision (a job's re-inspection after waiting for an
    /// exec is an answer too).
    pub answers: Decisions,
    /// Turns that needed no checkpoint (answers `none`, re-inspections not counted).
    pub skipped_turns: u64,
    /// Answers the inspector gave without observing the turn (then `full`).
    pub degraded_answers: u64,
    /// Checkpoints by kind and outcome.
    pub checkpoints: PerKind<Outcomes>,
    /// Bytes the published checkpoints added to the store: their new fs layers (compressed)
    /// and process images (after page deduplication).
    pub layer_bytes: u64,
    pub process_bytes: u64,
    /// The sandboxes' origins: started from an ordinary image, or restored from a checkpoint.
    pub created: u64,
    pub restored: u64,
    /// Turn-end decision latency (seconds).
    pub decision_seconds: Histogram,
    /// Duration of the published checkpoints by kind (seconds).
    pub checkpoint_seconds: PerKind<Histogram>,
    /// How long the published fs checkpoints froze their container (seconds).
    pub freeze_seconds: Histogram,
}

impl Tally {
    pub fn add_answer(&mut self, a: &AnswerFigures) {
        let d = &mut self.answers;
        match a.kind {
            AnswerKind::None => d.none += 1,
            AnswerKind::Fs => d.fs += 1,
            AnswerKind::Proc => d.proc += 1,
            AnswerKind::Full => d.full += 1,
        }
        if a.kind == AnswerKind::None && !a.is_reinspection() {
            self.skipped_turns += 1;
        }
        if !a.degraded.is_empty() {
            self.degraded_answers += 1;
        }
        self.decision_seconds
            .observe(DECISION_BOUNDS, a.elapsed_us as f64 / 1e6);
    }

    pub fn add_manifest(&mut self, m: &ManifestFigures) {
        match m.kind {
            CheckpointKind::Created => self.created += 1,
            CheckpointKind::Restored => self.restored += 1,
            CheckpointKind::Failed => self.checkpoints.get_mut(m.attempted).failed += 1,
            kind => {
                let outcomes = self.checkpoints.get_mut(Some(kind));
                match m.degraded {
                    true => outcomes.degraded += 1,
                    false => outcomes.ok += 1,
                }
                if matches!(kind, CheckpointKind::Fs | CheckpointKind::Full) {
                    let layer = m.fs_layers.last().map_or(0, |l| l.size);
                    self.layer_bytes = self.layer_bytes.saturating_add(layer);
                    self.freeze_seconds
                        .observe(CHECKPOINT_BOUNDS, m.timings.freeze_ms / 1e3);
                }
                if matches!(kind, CheckpointKind::Proc | CheckpointKind::Full) {
                    let stored = m.process.as_ref().map_or(0, |p| p.bytes_stored);
                    self.process_bytes = self.process_bytes.saturating_add(stored);
                }
                self.checkpoint_seconds
                    .get_mut(Some(kind))
                    .observe(CHECKPOINT_BOUNDS, m.timings.total_ms / 1e3);
            }
        }
    }

    pub fn merge(&mut self, o: &Tally) {
        let add = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        add(&mut self.answers.none, o.answers.none);
        add(&mut self.answers.fs, o.answers.fs);
        add(&mut self.answers.proc, o.answers.proc);
        add(&mut self.answers.full, o.answers.full);
        add(&mut self.skipped_turns, o.skipped_turns);
        add(&mut self.degraded_answers, o.degraded_answers);
        for (mine, theirs) in [
            (&mut self.checkpoints.fs, &o.checkpoints.fs),
            (&mut self.checkpoints.proc, &o.checkpoints.proc),
            (&mut self.checkpoints.full, &o.checkpoints.full),
            (&mut self.checkpoints.unknown, &o.checkpoints.unknown),
        ] {
            add(&mut mine.ok, theirs.ok);
            add(&mut mine.degraded, theirs.degraded);
            add(&mut mine.failed, theirs.failed);
        }
        add(&mut self.layer_bytes, o.layer_bytes);
        add(&mut self.process_bytes, o.process_bytes);
        add(&mut self.created, o.created);
        add(&mut self.restored, o.restored);
        self.decision_seconds.merge(&o.decision_seconds);
        for (mine, theirs) in [
            (&mut self.checkpoint_seconds.fs, &o.checkpoint_seconds.fs),
            (
                &mut self.checkpoint_seconds.proc,
                &o.checkpoint_seconds.proc,
            ),
            (
                &mut self.checkpoint_seconds.full,
                &o.checkpoint_seconds.full,
            ),
            (
                &mut self.checkpoint_seconds.unknown,
                &o.checkpoint_seconds.unknown,
            ),
        ] {
            mine.merge(theirs);
        }
        self.freeze_seconds.merge(&o.freeze_seconds);
    }

    /// Whether its histograms fit crab's bounds (a tally file from elsewhere may not).
    fn is_consistent(&self) -> bool {
        self.decision_seconds.fits(DECISION_BOUNDS)
            && self.freeze_seconds.fits(CHECKPOINT_BOUNDS)
            && self
                .checkpoint_seconds
                .iter()
                .iter()
                .all(|(_, h)| h.fits(CHECKPOINT_BOUNDS))
    }
}

/// The inspector's decision as an answer file spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnswerKind {
    None,
    Fs,
    Proc,
    Full,
}

/// What the figures need of a turn answer; the rest of the file is skipped unparsed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnswerFigures {
    #[serde(default)]
    pub turn_id: String,
    pub kind: AnswerKind,
    #[serde(default)]
    pub degraded: Vec<String>,
    #[serde(default)]
    pub elapsed_us: u64,
}

/// The suffix of the turn id under which a job stores its re-inspection after waiting for
/// running execs (see the checkpoint coordinator).
pub const REINSPECTION_SUFFIX: &str = "+exec-end";

impl AnswerFigures {
    pub fn is_reinspection(&self) -> bool {
        self.turn_id.ends_with(REINSPECTION_SUFFIX)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerFigures {
    #[serde(default)]
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessFigures {
    #[serde(default)]
    pub bytes_stored: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimingFigures {
    #[serde(default)]
    pub freeze_ms: f64,
    #[serde(default)]
    pub total_ms: f64,
}

/// What the figures need of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestFigures {
    pub format: u32,
    pub kind: CheckpointKind,
    #[serde(default)]
    pub fs_layers: Vec<LayerFigures>,
    #[serde(default)]
    pub process: Option<ProcessFigures>,
    #[serde(default)]
    pub timings: TimingFigures,
    #[serde(default)]
    pub attempted: Option<CheckpointKind>,
    #[serde(default)]
    pub degraded: bool,
}

impl From<&store::Manifest> for ManifestFigures {
    fn from(m: &store::Manifest) -> Self {
        ManifestFigures {
            format: m.format,
            kind: m.kind,
            fs_layers: m
                .fs_layers
                .last()
                .map(|d| LayerFigures { size: d.size })
                .into_iter()
                .collect(),
            process: m.process.as_ref().map(|p| ProcessFigures {
                bytes_stored: p.bytes_stored,
            }),
            timings: TimingFigures {
                freeze_ms: m.timings.freeze_ms,
                total_ms: m.timings.total_ms,
            },
            attempted: m.attempted,
            degraded: m.degraded,
        }
    }
}

/// Why a file of figures does not count: a manifest or answer that is not one, or a record
/// of removed figures that cannot be read ([`Retired::load`], [`Pruned::load`]).
#[derive(Debug, thiserror::Error)]
pub enum FiguresError {
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(
        "manifest format {format}, newer than this crab reads ({reads}): upgrade crabctl",
        reads = store::FORMAT
    )]
    NewerFormat { format: u32 },
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Its figures do not add up (`what`: how).
    #[error("{}: inconsistent ({what})", path.display())]
    Inconsistent { path: PathBuf, what: &'static str },
}

/// Parses a manifest's figures; `Err` says why the file does not count.
pub fn manifest_figures(data: &[u8]) -> Result<ManifestFigures, FiguresError> {
    let m: ManifestFigures = serde_json::from_slice(data)?;
    if m.format > store::FORMAT {
        return Err(FiguresError::NewerFormat { format: m.format });
    }
    Ok(m)
}

pub fn answer_figures(data: &[u8]) -> Result<AnswerFigures, FiguresError> {
    Ok(serde_json::from_slice(data)?)
}

/// Reads the JSON file `path` of a store or namespace directory; none is the default.
fn load_json<T: Default + serde::de::DeserializeOwned>(path: PathBuf) -> Result<T, FiguresError> {
    let data = match fs::read(&path) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(T::default()),
        Err(source) => return Err(FiguresError::Read { path, source }),
    };
    serde_json::from_slice(&data).map_err(|source| FiguresError::Parse { path, source })
}

/// Sequence numbers as sorted, disjoint, inclusive ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SeqSet(pub Vec<(u64, u64)>);

impl SeqSet {
    pub fn contains(&self, seq: u64) -> bool {
        let i = self.0.partition_point(|(_, hi)| *hi < seq);
        self.0.get(i).is_some_and(|(lo, _)| *lo <= seq)
    }

    pub fn insert(&mut self, seq: u64) {
        if self.contains(seq) {
            return;
        }
        self.0.push((seq, seq));
        self.0.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.0.len());
        for (lo, hi) in self.0.drain(..) {
            match merged.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        self.0 = merged;
    }

    /// Sorted, disjoint, not adjacent, each `lo <= hi`.
    fn is_canonical(&self) -> bool {
        self.0.iter().all(|(lo, hi)| lo <= hi)
            && self.0.windows(2).all(|w| w[0].1.saturating_add(1) < w[1].0)
    }
}

/// What retention removed from a store: the figures, and which manifests and answers they
/// came from. Written before the files are removed, so a crash in between counts them once:
/// a scan skips a file whose sequence number is here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Retired {
    pub tally: Tally,
    pub manifests: SeqSet,
    pub turns: SeqSet,
}

impl Retired {
    /// Reads `<root>/retired.json`; none is an empty one.
    pub fn load(root: &Path) -> Result<Retired, FiguresError> {
        let path = root.join(RETIRED_FILE);
        let r: Retired = load_json(path.clone())?;
        if !r.tally.is_consistent() || !r.manifests.is_canonical() || !r.turns.is_canonical() {
            return Err(FiguresError::Inconsistent {
                path,
                what: "histograms that do not add up, or unsorted ranges",
            });
        }
        Ok(r)
    }

    /// Writes it atomically (temp file, fsync, rename, fsync of the directory).
    pub fn save(&self, root: &Path) -> io::Result<()> {
        let path = root.join(RETIRED_FILE);
        let tmp = root.join(format!(".{RETIRED_FILE}.tmp"));
        let data = serde_json::to_vec(self).expect("figures serialize");
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&data)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)?;
        fs::File::open(root)?.sync_all()
    }
}

/// One file a scan read, as [`ScanCache`] remembers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Figures {
    Manifest(ManifestFigures),
    Answer(AnswerFigures),
    Unreadable(String),
}

/// The identity of a published file: it never changes under its name (files appear by
/// rename), so the same name, size, mtime and inode are the same content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct Stamp {
    size: u64,
    mtime_ns: i128,
    ino: u64,
}

impl Stamp {
    fn of(md: &fs::Metadata) -> Stamp {
        Stamp {
            size: md.len(),
            mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
            ino: md.ino(),
        }
    }
}

/// The figures of files already read, by path: a scan reads only new or changed files.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ScanCache {
    entries: HashMap<PathBuf, (Stamp, Figures)>,
    /// Paths seen by the current scan (the others are dropped by [`ScanCache::retain_seen`]).
    #[serde(skip)]
    seen: std::collections::HashSet<PathBuf>,
}

impl ScanCache {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Forgets the files the scans since the last call did not see (removed files).
    pub fn retain_seen(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.entries.retain(|p, _| seen.contains(p));
    }

    fn figures(
        &mut self,
        path: &Path,
        md: &fs::Metadata,
        parse: impl FnOnce(&[u8]) -> Figures,
    ) -> (Figures, bool) {
        let stamp = Stamp::of(md);
        self.seen.insert(path.to_path_buf());
        if let Some((s, f)) = self.entries.get(path) {
            if *s == stamp {
                return (f.clone(), false);
            }
        }
        let figures = match read_bounded(path, md.len()) {
            Ok(data) => parse(&data),
            Err(e) => Figures::Unreadable(e.to_string()),
        };
        self.entries
            .insert(path.to_path_buf(), (stamp, figures.clone()));
        (figures, true)
    }
}

/// At most this much of one manifest or answer is read (far above what crab writes).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

fn read_bounded(path: &Path, len: u64) -> io::Result<Vec<u8>> {
    if len > MAX_FILE_BYTES {
        return Err(io::Error::other(format!(
            "{len} bytes, more than the {MAX_FILE_BYTES} a crab file may have"
        )));
    }
    fs::read(path)
}

/// One store's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreFigures {
    pub tally: Tally,
    /// Files that could not be read or parsed (each also in `warnings`).
    pub unreadable: u64,
    pub warnings: Vec<String>,
    /// Manifests and answers read from disk (not from the cache).
    pub files_read: u64,
}

/// The sequence number of a published file's name (`000042.json`); `None` for anything else
/// (temp files, `*.json.corrupt`, other names).
fn published_seq(name: &std::ffi::OsStr) -> Option<u64> {
    let name = name.to_str()?;
    let digits = name.strip_suffix(".json")?;
    (digits.len() >= 6 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The figures of the store at `root` (manifests, answers and what retention removed). A
/// missing directory is an empty store; an unreadable one is a warning.
pub fn scan_store(root: &Path, cache: &mut ScanCache) -> StoreFigures {
    let mut out = StoreFigures::default();
    let retired = match Retired::load(root) {
        Ok(r) => r,
        Err(e) => {
            out.unreadable += 1;
            out.warnings.push(format!(
                "{e}: what retention removed from this store is not counted"
            ));
            Retired::default()
        }
    };
    out.tally.merge(&retired.tally);
    let dirs = [
        (root.join("checkpoints"), &retired.manifests, true),
        (store::turns_dir(root), &retired.turns, false),
    ];
    for (dir, skip, manifests) in dirs {
        let entries = match fs::read_dir(&dir) {
            Ok(it) => it,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                out.unreadable += 1;
                out.warnings.push(format!("{}: {e}", dir.display()));
                continue;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    out.unreadable += 1;
                    out.warnings.push(format!("{}: {e}", dir.display()));
                    break;
                }
            };
            let name = entry.file_name();
            let path = entry.path();
            let seq = published_seq(&name);
            let corrupt = name.to_string_lossy().ends_with(".json.corrupt");
            if corrupt {
                out.unreadable += 1;
                out.warnings
                    .push(format!("{}: set aside as corrupt", path.display()));
                continue;
            }
            let Some(seq) = seq else { continue };
            if skip.contains(seq) {
                continue;
            }
            // Never follow a link: what is not a regular file is not crab's.
            let md = match fs::symlink_metadata(&path) {
                Ok(md) if md.is_file() => md,
                Ok(_) => {
                    out.unreadable += 1;
                    out.warnings
                        .push(format!("{}: not a regular file", path.display()));
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    out.unreadable += 1;
                    out.warnings.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            let (figures, read) = cache.figures(&path, &md, |data| {
                let parsed = match manifests {
                    true => manifest_figures(data).map(Figures::Manifest),
                    false => answer_figures(data).map(Figures::Answer),
                };
                parsed.unwrap_or_else(|e| Figures::Unreadable(e.to_string()))
            });
            out.files_read += u64::from(read);
            match figures {
                Figures::Manifest(m) => out.tally.add_manifest(&m),
                Figures::Answer(a) => out.tally.add_answer(&a),
                Figures::Unreadable(why) => {
                    out.unreadable += 1;
                    out.warnings.push(format!("{}: {why}", path.display()));
                }
            }
        }
    }
    out
}

/// Adds the figures of manifests and turn answer files that retention is about to remove to
/// the store's `retired.json` (written before they go: see [`Retired`]). An answer that cannot
/// be read adds nothing (it counted nowhere before either).
pub fn retire(root: &Path, manifests: &[&store::Manifest], answers: &[PathBuf]) -> io::Result<()> {
    if manifests.is_empty() && answers.is_empty() {
        return Ok(());
    }
    let mut retired = Retired::load(root).map_err(|e| {
        io::Error::other(format!(
            "{e}; it is left as it is (move it away to start counting afresh)"
        ))
    })?;
    for m in manifests {
        if !retired.manifests.contains(m.seq) {
            retired.tally.add_manifest(&ManifestFigures::from(*m));
            retired.manifests.insert(m.seq);
        }
    }
    for path in answers {
        let Some(seq) = answer_seq(path) else {
            continue;
        };
        if !retired.turns.contains(seq) {
            let figures = fs::symlink_metadata(path)
                .ok()
                .filter(|md| md.is_file())
                .and_then(|md| read_bounded(path, md.len()).ok())
                .and_then(|d| answer_figures(&d).ok());
            if let Some(a) = figures {
                retired.tally.add_answer(&a);
            }
            retired.turns.insert(seq);
        }
    }
    retired.save(root)
}

/// The highest sequence number of the turn answers the store at `root` holds or held (0 if
/// none): a shim that carries on a lineage numbers its answers after it.
pub fn last_answer_seq(root: &Path) -> u64 {
    let held = fs::read_dir(store::turns_dir(root))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| published_seq(&e.file_name()))
        .max()
        .unwrap_or(0);
    let retired = Retired::load(root)
        .ok()
        .and_then(|r| r.turns.0.last().map(|(_, hi)| *hi))
        .unwrap_or(0);
    held.max(retired)
}

/// The file in a namespace directory (`<state_dir>/<namespace>/`) holding the figures of the
/// stores `crabctl prune` removed from it.
pub const PRUNED_FILE: &str = ".pruned-metrics.json";

/// The figures of the stores prune removed from a namespace directory, so that no counter goes
/// down when a store goes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Pruned {
    pub tally: Tally,
    /// Stores whose figures are in `tally` but that may still be on disk (being removed, or
    /// a prune that crashed before removing them): `(name, inode)`. A scan skips them.
    pub removing: Vec<(String, u64)>,
}

impl Pruned {
    pub fn load(ns_dir: &Path) -> Result<Pruned, FiguresError> {
        let path = ns_dir.join(PRUNED_FILE);
        let p: Pruned = load_json(path.clone())?;
        if !p.tally.is_consistent() {
            return Err(FiguresError::Inconsistent {
                path,
                what: "histograms that do not add up",
            });
        }
        Ok(p)
    }

    /// Whether the store `<ns_dir>/<name>` is one whose figures are already here.
    pub fn holds(&self, name: &str, md: &fs::Metadata) -> bool {
        self.removing
            .iter()
            .any(|(n, ino)| n == name && *ino == md.ino())
    }
}

/// Adds the figures of the store `<ns_dir>/<name>` to the namespace directory's
/// [`PRUNED_FILE`], before `crabctl prune` removes the store (the caller holds the namespace
/// directory's lock). Idempotent: a store already folded in is not added twice.
pub fn fold_pruned_store(ns_dir: &Path, name: &str) -> io::Result<()> {
    let root = ns_dir.join(name);
    let md = fs::symlink_metadata(&root)?;
    let mut pruned = Pruned::load(ns_dir).map_err(|e| {
        io::Error::other(format!(
            "{e}; it is left as it is (move it away to start counting afresh)"
        ))
    })?;
    // Those removed since (or renamed away) need no entry any more.
    pruned
        .removing
        .retain(|(n, ino)| fs::symlink_metadata(ns_dir.join(n)).is_ok_and(|m| m.ino() == *ino));
    if !pruned.holds(name, &md) {
        let f = scan_store(&root, &mut ScanCache::default());
        pruned.tally.merge(&f.tally);
        pruned.removing.push((name.to_string(), md.ino()));
    }
    let path = ns_dir.join(PRUNED_FILE);
    let tmp = ns_dir.join(format!("{PRUNED_FILE}.tmp"));
    let data = serde_json::to_vec(&pruned).expect("figures serialize");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&data)?;
    f.sync_all()?;
    fs::rename(&tmp, &path)?;
    fs::File::open(ns_dir)?.sync_all()
}

/// The sequence number of a turn answer's file name.
pub fn answer_seq(path: &Path) -> Option<u64> {
    published_seq(path.file_name()?)
}

/// Restores by outcome, host-wide (`restores.json` in the engine's root, see
/// [`crate::engine::Engine::count_restore`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Restores {
    pub ok: u64,
    pub failed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::{Descriptor, Manifest, ProcessImage, MEDIA_TYPE_LAYER_ZSTD};

    fn manifest(seq: u64, kind: CheckpointKind) -> Manifest {
        let mut m = Manifest::child_of(None, seq, &format!("t{seq}"), kind);
        m.fs_layers.push(Descriptor {
            digest: format!("sha256:{}", "ab".repeat(32)),
            diff_id: format!("sha256:{}", "cd".repeat(32)),
            size: 1000,
            media_type: MEDIA_TYPE_LAYER_ZSTD.into(),
        });
        m.process = Some(ProcessImage {
            image: "proc/000001".into(),
            bytes_stored: 500,
            bytes_logical: 9000,
            pids: vec![1],
        });
        m.timings.total_ms = 120.0;
        m.timings.freeze_ms = 3.0;
        m
    }

    fn write(path: &Path, data: impl AsRef<[u8]>) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, data).unwrap();
    }

    fn answer(turn: &str, kind: &str, degraded: bool, us: u64) -> String {
        serde_json::json!({
            "turn_id": turn, "container_id": "c", "seq": 1, "kind": kind,
            "fs": {"changed": true, "scanned": true, "syscalls": {}, "added": ["/a"], "modified": [], "deleted": []},
            "procs": {"changed": false},
            "degraded": if degraded { vec!["no probes"] } else { vec![] },
            "elapsed_us": us,
        })
        .to_string()
    }

    /// A store with every kind of checkpoint and answer, and what its figures must be.
    fn fake_store(root: &Path) {
        let cp = |seq: u64, m: &Manifest| {
            write(
                &root.join(format!("checkpoints/{seq:06}.json")),
                serde_json::to_vec(m).unwrap(),
            )
        };
        cp(1, &manifest(1, CheckpointKind::Created));
        cp(2, &manifest(2, CheckpointKind::Fs));
        cp(3, &manifest(3, CheckpointKind::Proc));
        let mut full = manifest(4, CheckpointKind::Full);
        full.degraded = true;
        cp(4, &full);
        let mut failed = manifest(5, CheckpointKind::Failed);
        failed.attempted = Some(CheckpointKind::Fs);
        cp(5, &failed);
        // A failed one from before `attempted` was recorded.
        cp(6, &manifest(6, CheckpointKind::Failed));
        let t = |seq: u64, data: String| write(&root.join(format!("turns/{seq:06}.json")), data);
        t(1, answer("t2", "fs", false, 800));
        t(2, answer("t3", "proc", false, 2000));
        t(3, answer("t4", "full", true, 30));
        t(4, answer("t5", "none", false, 400));
        t(5, answer("t5+exec-end", "none", false, 400));
        t(6, answer("t6", "none", false, 7_000_000));
    }

    #[test]
    fn a_store_is_counted_from_its_manifests_and_answers() {
        let dir = tempfile::tempdir().unwrap();
        fake_store(dir.path());
        let f = scan_store(dir.path(), &mut ScanCache::default());
        assert_eq!(f.unreadable, 0, "{:?}", f.warnings);
        let t = &f.tally;
        assert_eq!(
            t.answers,
            Decisions {
                none: 3,
                fs: 1,
                proc: 1,
                full: 1
            }
        );
        assert_eq!(t.skipped_turns, 2, "a re-inspection is not a turn");
        assert_eq!(t.degraded_answers, 1);
        assert_eq!(t.checkpoints.fs.ok, 1);
        assert_eq!(t.checkpoints.fs.failed, 1);
        assert_eq!(t.checkpoints.proc.ok, 1);
        assert_eq!(t.checkpoints.full.degraded, 1);
        assert_eq!(t.checkpoints.full.ok, 0);
        assert_eq!(t.checkpoints.unknown.failed, 1);
        assert_eq!((t.created, t.restored), (1, 0));
        // fs 1000 + full 1000; proc 500 + full 500.
        assert_eq!((t.layer_bytes, t.process_bytes), (2000, 1000));
        assert_eq!(t.decision_seconds.count, 6);
        assert!((t.decision_seconds.sum - 7.00363).abs() < 1e-9);
        // 30 us, 400 us x2 in the first bucket (0.5 ms); 800 us in 1 ms; 2 ms in 2.5 ms; 7 s in +Inf.
        let c = t.decision_seconds.cumulative(DECISION_BOUNDS);
        assert_eq!(c[0], (0.0005, 3));
        assert_eq!(c[1], (0.001, 4));
        assert_eq!(c[2], (0.0025, 5));
        assert_eq!(c[12], (5.0, 5));
        assert_eq!(c[13], (f64::INFINITY, 6));
        assert_eq!(t.checkpoint_seconds.fs.count, 1);
        assert_eq!(t.checkpoint_seconds.proc.count, 1);
        assert_eq!(t.checkpoint_seconds.full.count, 1);
        assert!((t.checkpoint_seconds.fs.sum - 0.12).abs() < 1e-9);
        assert_eq!(t.freeze_seconds.count, 2, "fs and full froze");
    }

    #[test]
    fn hostile_and_corrupt_files_are_counted_as_unreadable_never_as_figures() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fake_store(root);
        let clean = scan_store(root, &mut ScanCache::default()).tally;
        let outside = tempfile::tempdir().unwrap();
        write(
            &outside.path().join("x.json"),
            answer("x", "full", false, 1),
        );
        let hostile: Vec<(&str, Vec<u8>)> = vec![
            ("checkpoints/000010.json", b"{not json".to_vec()),
            (
                "checkpoints/000011.json",
                br#"{"format": 9, "kind": "fs"}"#.to_vec(),
            ),
            (
                "checkpoints/000012.json",
                br#"{"format": 1, "kind": "exploded"}"#.to_vec(),
            ),
            (
                "checkpoints/000013.json",
                br#"{"format": 1, "kind": "fs", "fs_layers": [{"size": -1}]}"#.to_vec(),
            ),
            ("checkpoints/000014.json", b"\xff\xfe\x00garbage".to_vec()),
            ("checkpoints/000015.json", Vec::new()),
            (
                "turns/000020.json",
                br#"{"kind": "none", "elapsed_us": "soon"}"#.to_vec(),
            ),
            ("turns/000021.json", br#"[1, 2, 3]"#.to_vec()),
            (
                "turns/000022.json",
                br#"{"kind": "none", "degraded": "yes"}"#.to_vec(),
            ),
        ];
        for (p, d) in &hostile {
            write(&root.join(p), d);
        }
        // Names that are not published files are none of the figures' business.
        write(&root.join("turns/.000023.json.tmp"), b"{");
        write(&root.join("turns/notes.txt"), b"x");
        write(&root.join("checkpoints/000016.json.corrupt"), b"{");
        // A symlink is never followed, a directory is not a file.
        std::os::unix::fs::symlink(
            outside.path().join("x.json"),
            root.join("turns/000024.json"),
        )
        .unwrap();
        fs::create_dir_all(root.join("turns/000025.json")).unwrap();
        let f = scan_store(root, &mut ScanCache::default());
        assert_eq!(f.tally, clean, "nothing hostile adds to a figure");
        assert_eq!(f.unreadable, hostile.len() as u64 + 3, "{:#?}", f.warnings);
        assert!(f
            .warnings
            .iter()
            .any(|w| w.contains("000011.json") && w.contains("upgrade")));
        assert!(f.warnings.iter().any(|w| w.contains("000016.json.corrupt")));
        assert!(f
            .warnings
            .iter()
            .any(|w| w.contains("000024.json") && w.contains("not a regular file")));

        // Hostile figures that parse are clamped, never a panic or an infinite sum.
        let mut t = Tally::default();
        t.add_answer(&AnswerFigures {
            turn_id: String::new(),
            kind: AnswerKind::Full,
            degraded: vec![],
            elapsed_us: u64::MAX,
        });
        let mut m: ManifestFigures = (&manifest(1, CheckpointKind::Full)).into();
        m.timings.total_ms = f64::NAN;
        m.timings.freeze_ms = -5.0;
        m.fs_layers[0].size = u64::MAX;
        t.add_manifest(&m);
        t.add_manifest(&m);
        assert_eq!(t.decision_seconds.sum, MAX_SECONDS);
        assert_eq!(t.checkpoint_seconds.full.sum, 2.0 * MAX_SECONDS);
        assert_eq!(t.freeze_seconds.sum, 0.0);
        assert_eq!(t.layer_bytes, u64::MAX, "saturates");

        // A file over the size bound is not read.
        let big = root.join("turns/000030.json");
        fs::File::create(&big)
            .unwrap()
            .set_len(MAX_FILE_BYTES + 1)
            .unwrap();
        let f = scan_store(root, &mut ScanCache::default());
        assert!(f
            .warnings
            .iter()
            .any(|w| w.contains("000030.json") && w.contains("more than")));
    }

    #[test]
    fn retired_figures_keep_counters_from_going_down() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fake_store(root);
        let before = scan_store(root, &mut ScanCache::default()).tally;
        // Retention takes manifests 2 and 3 and answers 1 and 2: recorded, then removed.
        let m2 = manifest(2, CheckpointKind::Fs);
        let m3 = manifest(3, CheckpointKind::Proc);
        let a = |seq: u64| root.join(format!("turns/{seq:06}.json"));
        retire(root, &[&m2, &m3], &[a(1), a(2)]).unwrap();
        // Until the files go (a crash in between), they count once.
        assert_eq!(scan_store(root, &mut ScanCache::default()).tally, before);
        for p in [
            "checkpoints/000002.json",
            "checkpoints/000003.json",
            "turns/000001.json",
            "turns/000002.json",
        ] {
            fs::remove_file(root.join(p)).unwrap();
        }
        assert_eq!(scan_store(root, &mut ScanCache::default()).tally, before);
        // Retiring the same ones again changes nothing.
        retire(root, &[&m2], &[a(3)]).unwrap();
        fs::remove_file(root.join("turns/000003.json")).unwrap();
        assert_eq!(scan_store(root, &mut ScanCache::default()).tally, before);
        let r = Retired::load(root).unwrap();
        assert_eq!(r.manifests, SeqSet(vec![(2, 3)]));
        assert_eq!(r.turns, SeqSet(vec![(1, 3)]));

        // A corrupt retired file is named, its figures are not guessed, and retire refuses to
        // overwrite it.
        fs::write(
            root.join(RETIRED_FILE),
            br#"{"tally": {"decision_seconds": {"counts": [5], "sum": 1, "count": 1}}}"#,
        )
        .unwrap();
        let f = scan_store(root, &mut ScanCache::default());
        assert_eq!(f.unreadable, 1);
        assert!(f.warnings[0].contains("retired.json"), "{:?}", f.warnings);
        let e = retire(root, &[&m2], &[]).unwrap_err().to_string();
        assert!(e.contains("move it away"), "{e}");
        fs::write(root.join(RETIRED_FILE), br#"{"manifests": [[5, 4]]}"#).unwrap();
        assert_eq!(scan_store(root, &mut ScanCache::default()).unreadable, 1);
        let e = Retired::load(root).unwrap_err();
        assert!(
            matches!(&e, FiguresError::Inconsistent { path, .. } if *path == root.join(RETIRED_FILE)),
            "{e}"
        );
        fs::write(root.join(RETIRED_FILE), b"{").unwrap();
        assert!(matches!(
            Retired::load(root),
            Err(FiguresError::Parse { .. })
        ));
        assert_eq!(
            manifest_figures(br#"{"format": 9, "kind": "fs"}"#)
                .unwrap_err()
                .to_string(),
            format!(
                "manifest format 9, newer than this crab reads ({}): upgrade crabctl",
                store::FORMAT
            )
        );
    }

    #[test]
    fn the_cache_reads_only_new_files() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fake_store(root);
        let mut cache = ScanCache::default();
        let first = scan_store(root, &mut cache);
        assert_eq!(first.files_read, 12);
        cache.retain_seen();
        let again = scan_store(root, &mut cache);
        assert_eq!((again.files_read, &again.tally), (0, &first.tally));
        write(
            &root.join("turns/000007.json"),
            answer("t7", "fs", false, 10),
        );
        let third = scan_store(root, &mut cache);
        assert_eq!(third.files_read, 1);
        assert_eq!(third.tally.answers.fs, 2);
        // A file replaced under the same name (another inode) is read again.
        fs::remove_file(root.join("turns/000007.json")).unwrap();
        write(
            &root.join("turns/000007.json"),
            answer("t7", "proc", false, 10),
        );
        let fourth = scan_store(root, &mut cache);
        assert_eq!(fourth.files_read, 1);
        assert_eq!(fourth.tally.answers.proc, 2);
        cache.retain_seen();
        fs::remove_dir_all(root.join("turns")).unwrap();
        scan_store(root, &mut cache);
        cache.retain_seen();
        assert_eq!(cache.len(), 6);
    }

    #[test]
    fn seq_sets_merge_ranges() {
        let mut s = SeqSet::default();
        for n in [5, 3, 4, 9, 1, 10, 2] {
            s.insert(n);
        }
        assert_eq!(s.0, vec![(1, 5), (9, 10)]);
        assert!(s.contains(1) && s.contains(5) && s.contains(10));
        assert!(!s.contains(0) && !s.contains(6) && !s.contains(11));
        assert!(s.is_canonical());
        assert!(!SeqSet(vec![(3, 4), (5, 6)]).is_canonical());
        assert!(!SeqSet(vec![(4, 3)]).is_canonical());
    }

    #[test]
    fn histograms_merge_and_refuse_what_does_not_add_up() {
        let mut a = Histogram::default();
        a.observe(DECISION_BOUNDS, 0.002);
        let mut b = Histogram::default();
        b.observe(DECISION_BOUNDS, 10.0);
        a.merge(&b);
        assert_eq!(a.count, 2);
        assert_eq!(
            a.cumulative(DECISION_BOUNDS).last(),
            Some(&(f64::INFINITY, 2))
        );
        assert!(a.fits(DECISION_BOUNDS));
        assert!(!a.fits(CHECKPOINT_BOUNDS));
        let empty = Histogram::default();
        assert!(empty.fits(DECISION_BOUNDS));
        assert_eq!(
            empty.cumulative(DECISION_BOUNDS).len(),
            DECISION_BOUNDS.len() + 1
        );
    }
}
