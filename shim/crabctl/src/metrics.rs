//! `crabctl metrics`: crab's host-level figures in the OpenMetrics text format, for
//! node-exporter's textfile collector (print once) or Prometheus itself (`--listen`, an HTTP
//! listener serving `/metrics`, loopback only unless `--listen-any`).
//!
//! Everything is derived from what crab already records, so it survives shim restarts and
//! needs no daemon ([`crab_shim::metrics`]): the turn answers and manifests of every store
//! under the config's `state_dir` (every namespace, with the stores set aside for a reused
//! id), what retention removed from them (`retired.json`), and the host engine's directory
//! (`stats.json`, the slots and queue, `restores.json`). No label carries a container id
//! unless `--per-container` asks for the breakdown.
//!
//! The encoding is the Prometheus project's Rust client (`prometheus-client`): its registry,
//! a collector over one scan, its text encoder (which ends with `# EOF`).

use std::{
    fs, io,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use clap::Args;
use crab_runtime_config::Config;
use crab_shim::metrics::{
    self as figures, Histogram, PerKind, Restores, ScanCache, Tally, CHECKPOINT_BOUNDS,
    DECISION_BOUNDS, REPLICATION_BOUNDS, WAIT_BOUNDS,
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder},
    metrics::{counter::ConstCounter, gauge::ConstGauge, MetricType},
    registry::{Registry, Unit},
};

use crate::{CtlError, Result};

pub const LONG_ABOUT: &str = "\
crab's host-level figures in the OpenMetrics text format: turn answers by decision, skipped turns,
degraded answers, checkpoints by kind and outcome, bytes written, the turn-end decision latency and
checkpoint duration histograms, the host engine's queue, slots and waits, restores by outcome.

They are derived from what crab records (every store under the config's state_dir, in every
namespace, and the host engine's directory), so they survive shim restarts; no series names a
container unless --per-container. Files that cannot be read are named on stderr and counted in
crab_metrics_unreadable_files. Without --listen the figures are printed once, for node-exporter's
textfile collector (write to a temporary file and rename it to *.prom: see docs/metrics.md). With
--listen 127.0.0.1:PORT they are served at /metrics, rescanned for each scrape.";

/// `crabctl metrics`'s flags.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct MetricsArgs {
    /// serve the figures over HTTP at ADDR (`/metrics`) instead of printing them once; each
    /// scrape rescans (reading only new files)
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// allow --listen on an address that is not loopback (the figures name no container
    /// unless --per-container, but anyone who reaches the port reads them)
    #[arg(long, requires = "listen")]
    pub listen_any: bool,
    /// the text format: openmetrics (OpenMetrics 1.0), or prometheus (the Prometheus text
    /// format 0.0.4, which node-exporter's textfile collector reads); --listen answers in the
    /// format the scraper asks for
    #[arg(long, value_enum, default_value_t = Format::Openmetrics, conflicts_with = "listen")]
    pub format: Format,
    /// add a breakdown by container (labels namespace and container: one series per container
    /// and figure, so not for hosts with many containers)
    #[arg(long)]
    pub per_container: bool,
}

/// The text formats of the figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// OpenMetrics 1.0 (`application/openmetrics-text`, ends with `# EOF`)
    Openmetrics,
    /// the Prometheus text format 0.0.4 (`text/plain; version=0.0.4`): for node-exporter's
    /// textfile collector
    Prometheus,
}

/// One scan's figures.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub tally: Tally,
    /// `(namespace, container)` → its store's figures (with `--per-container`).
    pub per_container: Vec<((String, String), Tally)>,
    pub stores: u64,
    pub unreadable: u64,
    pub warnings: Vec<String>,
    pub files_read: u64,
    pub engine: EngineFigures,
    pub replication: ReplicationFigures,
    pub scan_seconds: f64,
}

/// What the stores' replicators recorded (`replication.json`), summed over the stores.
#[derive(Debug, Clone, Default)]
pub struct ReplicationFigures {
    pub pushes: u64,
    pub failures: u64,
    pub superseded: u64,
    pub bytes_sent: u64,
    pub bytes_skipped: u64,
    /// Stores whose newest durable checkpoint seen is not pushed yet.
    pub behind: u64,
    pub lag: Histogram,
}

impl ReplicationFigures {
    fn add(&mut self, s: &crab_shim::replication::Status) {
        self.pushes += s.pushes;
        self.failures += s.failures;
        self.superseded += s.superseded;
        self.bytes_sent += s.bytes_sent;
        self.bytes_skipped += s.bytes_skipped;
        if s.newest_seq.is_some() && s.newest_seq != s.pushed_seq {
            self.behind += 1;
        }
        self.lag.merge(&s.lag);
    }
}

#[derive(Debug, Clone, Default)]
pub struct EngineFigures {
    pub queue_depth: u64,
    pub slots_busy: u64,
    pub slots_free: u64,
    pub jobs: u64,
    pub bytes: u64,
    pub wait: Histogram,
    pub restores: Restores,
}

/// Scans the stores under `state_dir` (`<state_dir>/<namespace>/<store>`) and the engine at
/// `engine`. Never fails: what cannot be read is a warning and counts in `unreadable`.
pub fn scan(
    state_dir: &Path,
    engine: &crab_runtime_config::EngineConfig,
    per_container: bool,
    cache: &mut ScanCache,
) -> Snapshot {
    let started = Instant::now();
    let mut snap = Snapshot::default();
    let (stores, pruned) = stores(state_dir, &mut snap.warnings, &mut snap.unreadable);
    snap.tally.merge(&pruned);
    for (namespace, id, root) in stores {
        if let Some(r) = crab_shim::replication::Status::read(&root) {
            snap.replication.add(&r);
        }
        let f = figures::scan_store(&root, cache);
        snap.stores += 1;
        snap.unreadable += f.unreadable;
        snap.files_read += f.files_read;
        snap.warnings.extend(f.warnings);
        snap.tally.merge(&f.tally);
        if per_container {
            snap.per_container.push(((namespace, id), f.tally));
        }
    }
    cache.retain_seen();
    // Stores set aside for a reused id count under the id: one series per container.
    snap.per_container.sort_by(|a, b| a.0.cmp(&b.0));
    snap.per_container.dedup_by(|later, first| {
        if later.0 == first.0 {
            first.1.merge(&later.1);
            true
        } else {
            false
        }
    });
    snap.engine = engine_figures(engine, &mut snap.warnings);
    snap.scan_seconds = started.elapsed().as_secs_f64();
    snap
}

/// Every store directory: `(namespace, container id, path)`, and the figures of the stores
/// prune removed. A store set aside for a reused id (`.replaced-<id>-<ns>-<pid>`) is the id's
/// too. Symlinks are never followed.
fn stores(
    state_dir: &Path,
    warnings: &mut Vec<String>,
    unreadable: &mut u64,
) -> (Vec<(String, String, PathBuf)>, Tally) {
    let mut out = Vec::new();
    let mut pruned_all = Tally::default();
    let namespaces = match fs::read_dir(state_dir) {
        Ok(it) => it,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return (out, pruned_all),
        Err(e) => {
            *unreadable += 1;
            warnings.push(format!("{}: {e}", state_dir.display()));
            return (out, pruned_all);
        }
    };
    let is_dir = |p: &Path| fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    for ns in namespaces.flatten() {
        let Ok(namespace) = ns.file_name().into_string() else {
            continue;
        };
        if namespace.starts_with('.') || !is_dir(&ns.path()) {
            continue;
        }
        let pruned = match figures::Pruned::load(&ns.path()) {
            Ok(p) => p,
            Err(e) => {
                *unreadable += 1;
                warnings.push(format!(
                    "{e}: the figures of the stores prune removed are not counted"
                ));
                figures::Pruned::default()
            }
        };
        pruned_all.merge(&pruned.tally);
        let entries = match fs::read_dir(ns.path()) {
            Ok(it) => it,
            Err(e) => {
                *unreadable += 1;
                warnings.push(format!("{}: {e}", ns.path().display()));
                continue;
            }
        };
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let id = match name.strip_prefix(crab_shim::checkpoint::store::SET_ASIDE_PREFIX) {
                // `<id>-<nanoseconds>-<pid>`.
                Some(rest) => match rest.rsplitn(3, '-').collect::<Vec<_>>()[..] {
                    [pid, nanos, id]
                        if [pid, nanos]
                            .iter()
                            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) =>
                    {
                        id.to_string()
                    }
                    _ => continue,
                },
                None if name.starts_with('.') => continue,
                None => name,
            };
            match fs::symlink_metadata(entry.path()) {
                // Already counted in the pruned figures: being removed.
                Ok(md) if md.is_dir() && !pruned.holds(&name_of(&entry), &md) => {
                    out.push((namespace.clone(), id, entry.path()))
                }
                _ => {}
            }
        }
    }
    (out, pruned_all)
}

fn name_of(entry: &fs::DirEntry) -> String {
    entry.file_name().to_string_lossy().into_owned()
}

fn engine_figures(
    c: &crab_runtime_config::EngineConfig,
    warnings: &mut Vec<String>,
) -> EngineFigures {
    let engine = crab_shim::engine::Engine::new(c);
    let mut out = EngineFigures {
        restores: engine.restores(),
        ..Default::default()
    };
    // No engine directory yet: no job ever ran on this host.
    if !c.root.is_dir() {
        out.slots_free = u64::from(c.max_jobs);
        return out;
    }
    match engine.snapshot() {
        Ok(s) => {
            out.queue_depth = s.queue.len() as u64;
            out.slots_busy = s.slots.iter().filter(|s| s.holder.is_some()).count() as u64;
            out.slots_free = s.slots.len() as u64 - out.slots_busy;
            out.jobs = s.stats.jobs;
            out.bytes = s.stats.bytes;
            let counts = s.stats.wait_buckets;
            out.wait = Histogram {
                count: counts.iter().sum(),
                counts,
                sum: s.stats.wait_buckets_us as f64 / 1e6,
            };
        }
        Err(e) => warnings.push(format!("the host engine cannot be read: {e}")),
    }
    out
}

/// The text of `snap` in `format`.
pub fn render_as(snap: &Snapshot, format: Format) -> String {
    match format {
        Format::Openmetrics => render(snap),
        Format::Prometheus => to_prometheus_text(&render(snap)),
    }
}

/// The Prometheus text format 0.0.4 of OpenMetrics text as [`render`] writes it: the same
/// samples; a counter's family is named as its samples (`_total`); no `# UNIT`, no `# EOF`.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// The OpenMetrics text of `snap` (ending with `# EOF`).
pub fn render(snap: &Snapshot) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Figures(Arc::new(snap.clone()))));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String");
    out
}

#[derive(Debug)]
struct Figures(Arc<Snapshot>);

type Labels = Vec<(&'static str, String)>;
/// The counter samples of one figure of a tally, under the given labels.
type CounterSamples = dyn Fn(&Labels, &Tally) -> Vec<(Labels, ConstCounter<u64>)>;

/// Writes one metric family: each `(labels, value)` a sample.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    metric_type: MetricType,
    samples: Vec<(Labels, M)>,
) -> std::fmt::Result {
    let unit = unit.as_ref();
    let mut family = encoder.encode_descriptor(name, help, unit, metric_type)?;
    // The sample without labels (at most one) last: `name 1`, not `name{} 1`.
    let mut bare = None;
    for (labels, metric) in samples {
        match labels.is_empty() {
            true => bare = Some(metric),
            false => metric.encode(family.encode_family(&labels)?)?,
        }
    }
    match bare {
        Some(metric) => metric.encode(family),
        None => Ok(()),
    }
}

/// A histogram as a metric prometheus-client encodes.
#[derive(Debug)]
struct ConstHistogram<'a>(&'a Histogram, &'static [f64]);

impl EncodeMetric for ConstHistogram<'_> {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        let h = self.0;
        // prometheus-client takes each bucket's own count (it sums them up as it writes) and
        // writes `+Inf` for the bound f64::MAX.
        let buckets: Vec<(f64, u64)> = self
            .1
            .iter()
            .copied()
            .chain([f64::MAX])
            .enumerate()
            .map(|(i, b)| (b, h.counts.get(i).copied().unwrap_or(0)))
            .collect();
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            h.sum, h.count, &buckets, None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The series of each figure: the host's, then each container's with `--per-container`.
fn series(snap: &Snapshot) -> Vec<(Labels, &Tally)> {
    let mut out: Vec<(Labels, &Tally)> = vec![(Vec::new(), &snap.tally)];
    for ((ns, id), t) in &snap.per_container {
        out.push((
            vec![("namespace", ns.clone()), ("container", id.clone())],
            t,
        ));
    }
    out
}

fn with(labels: &Labels, more: &[(&'static str, &str)]) -> Labels {
    let mut l = labels.clone();
    l.extend(more.iter().map(|(k, v)| (*k, v.to_string())));
    l
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

impl Collector for Figures {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let snap = &*self.0;
        let all = series(snap);
        let each = |f: &CounterSamples| all.iter().flat_map(|(l, t)| f(l, t)).collect::<Vec<_>>();
        family(
            &mut e,
            "crab_turn_answers",
            "Turn answers by the inspector's decision (none, fs, proc, full); a checkpoint job's re-inspection after waiting for an exec counts too",
            None,
            MetricType::Counter,
            each(&|l, t| {
                let d = &t.answers;
                [("none", d.none), ("fs", d.fs), ("proc", d.proc), ("full", d.full)]
                    .into_iter()
                    .map(|(k, v)| (with(l, &[("decision", k)]), counter(v)))
                    .collect()
            }),
        )?;
        family(
            &mut e,
            "crab_turns_skipped",
            "Turns that needed no checkpoint (answered none)",
            None,
            MetricType::Counter,
            each(&|l, t| vec![(l.clone(), counter(t.skipped_turns))]),
        )?;
        family(
            &mut e,
            "crab_turn_answers_degraded",
            "Turn answers given without observing the turn (then a full checkpoint)",
            None,
            MetricType::Counter,
            each(&|l, t| vec![(l.clone(), counter(t.degraded_answers))]),
        )?;
        family(
            &mut e,
            "crab_checkpoints",
            "Checkpoints by kind (fs, proc, full; unknown: a failed one recorded before crab recorded what it attempted) and outcome (ok, degraded: taken for a turn the inspector could not observe, failed)",
            None,
            MetricType::Counter,
            each(&|l, t| {
                t.checkpoints
                    .iter()
                    .into_iter()
                    .flat_map(|(kind, o)| {
                        [("ok", o.ok), ("degraded", o.degraded), ("failed", o.failed)]
                            .into_iter()
                            .map(move |(outcome, v)| (kind, outcome, v))
                    })
                    .map(|(kind, outcome, v)| {
                        (
                            with(l, &[("kind", kind), ("outcome", outcome)]),
                            counter(v),
                        )
                    })
                    .collect()
            }),
        )?;
        family(
            &mut e,
            "crab_checkpoint_written",
            "Bytes the published checkpoints added to the stores: part layer (compressed fs layers), process (process images after page deduplication)",
            Some(Unit::Bytes),
            MetricType::Counter,
            each(&|l, t| {
                vec![
                    (with(l, &[("part", "layer")]), counter(t.layer_bytes)),
                    (with(l, &[("part", "process")]), counter(t.process_bytes)),
                ]
            }),
        )?;
        family(
            &mut e,
            "crab_sandboxes_started",
            "Sandboxes whose lineage began: origin image (an ordinary image) or checkpoint (restored from a checkpoint, with checkpointing on)",
            None,
            MetricType::Counter,
            each(&|l, t| {
                vec![
                    (with(l, &[("origin", "image")]), counter(t.created)),
                    (with(l, &[("origin", "checkpoint")]), counter(t.restored)),
                ]
            }),
        )?;
        let hist = |f: &dyn Fn(&Tally) -> Vec<(Labels, &Histogram)>| -> Vec<(Labels, &Histogram)> {
            all.iter()
                .flat_map(|(l, t)| {
                    f(t).into_iter()
                        .map(|(more, h)| {
                            let mut labels = l.clone();
                            labels.extend(more);
                            (labels, h)
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        family(
            &mut e,
            "crab_turn_decision",
            "How long the inspector took to answer a turn end (elapsed_us of each answer)",
            Some(Unit::Seconds),
            MetricType::Histogram,
            histograms(
                hist(&|t| vec![(Vec::new(), &t.decision_seconds)]),
                DECISION_BOUNDS,
            ),
        )?;
        family(
            &mut e,
            "crab_checkpoint_duration",
            "How long each published checkpoint took, by kind (from its start to its publication, engine wait excluded)",
            Some(Unit::Seconds),
            MetricType::Histogram,
            histograms(
                hist(&|t| per_kind(&t.checkpoint_seconds)),
                CHECKPOINT_BOUNDS,
            ),
        )?;
        family(
            &mut e,
            "crab_checkpoint_freeze",
            "How long each published fs or full checkpoint kept its container frozen",
            Some(Unit::Seconds),
            MetricType::Histogram,
            histograms(
                hist(&|t| vec![(Vec::new(), &t.freeze_seconds)]),
                CHECKPOINT_BOUNDS,
            ),
        )?;
        let en = &snap.engine;
        family(
            &mut e,
            "crab_restores",
            "Containers restored from a checkpoint by outcome (ok, failed), host-wide since the engine directory was created (it is on a tmpfs: since boot)",
            None,
            MetricType::Counter,
            vec![
                (vec![("outcome", "ok".to_string())], counter(en.restores.ok)),
                (
                    vec![("outcome", "failed".to_string())],
                    counter(en.restores.failed),
                ),
            ],
        )?;
        family(
            &mut e,
            "crab_engine_queue_depth",
            "Checkpoint jobs waiting for a slot of the host engine now",
            None,
            MetricType::Gauge,
            vec![(Labels::new(), ConstGauge::new(en.queue_depth as i64))],
        )?;
        family(
            &mut e,
            "crab_engine_slots",
            "The host engine's slots by state (busy: a job holds it, free)",
            None,
            MetricType::Gauge,
            vec![
                (
                    vec![("state", "busy".to_string())],
                    ConstGauge::new(en.slots_busy as i64),
                ),
                (
                    vec![("state", "free".to_string())],
                    ConstGauge::new(en.slots_free as i64),
                ),
            ],
        )?;
        family(
            &mut e,
            "crab_engine_jobs",
            "Checkpoint jobs the host engine ran (since boot: its directory is on a tmpfs)",
            None,
            MetricType::Counter,
            vec![(Labels::new(), counter(en.jobs))],
        )?;
        family(
            &mut e,
            "crab_engine_written",
            "Bytes the host engine's jobs wrote (layers, and process images as CRIU wrote them before deduplication), charged to its I/O budget",
            Some(Unit::Bytes),
            MetricType::Counter,
            vec![(Labels::new(), counter(en.bytes))],
        )?;
        family(
            &mut e,
            "crab_engine_wait",
            "How long each checkpoint job waited for a slot of the host engine",
            Some(Unit::Seconds),
            MetricType::Histogram,
            vec![(Labels::new(), ConstHistogram(&en.wait, WAIT_BOUNDS))],
        )?;
        let r = &snap.replication;
        family(
            &mut e,
            "crab_replication_pushes",
            "Checkpoints pushed to the [replication] registry, by outcome (ok; failed: an attempt that failed, retried or not replicable; superseded: a newer checkpoint came before it was pushed)",
            None,
            MetricType::Counter,
            vec![
                (vec![("outcome", "ok".to_string())], counter(r.pushes)),
                (vec![("outcome", "failed".to_string())], counter(r.failures)),
                (vec![("outcome", "superseded".to_string())], counter(r.superseded)),
            ],
        )?;
        family(
            &mut e,
            "crab_replication",
            "Bytes of replicated checkpoints: sent, or deduplicated (the registry had the blob)",
            Some(Unit::Bytes),
            MetricType::Counter,
            vec![
                (vec![("part", "sent".to_string())], counter(r.bytes_sent)),
                (
                    vec![("part", "deduplicated".to_string())],
                    counter(r.bytes_skipped),
                ),
            ],
        )?;
        family(
            &mut e,
            "crab_replication_queue_depth",
            "Sandboxes whose newest durable checkpoint is not in the registry yet",
            None,
            MetricType::Gauge,
            vec![(Labels::new(), ConstGauge::new(r.behind as i64))],
        )?;
        family(
            &mut e,
            "crab_replication_lag",
            "From a checkpoint durable to it pushed to the registry",
            Some(Unit::Seconds),
            MetricType::Histogram,
            vec![(Labels::new(), ConstHistogram(&r.lag, REPLICATION_BOUNDS))],
        )?;
        family(
            &mut e,
            "crab_metrics_stores",
            "Checkpoint stores this scan read",
            None,
            MetricType::Gauge,
            vec![(Labels::new(), ConstGauge::new(snap.stores as i64))],
        )?;
        family(
            &mut e,
            "crab_metrics_unreadable_files",
            "Files of the stores this scan could not read or parse (crabctl metrics names them on stderr); their figures are missing",
            None,
            MetricType::Gauge,
            vec![(Labels::new(), ConstGauge::new(snap.unreadable as i64))],
        )?;
        family(
            &mut e,
            "crab_metrics_scan_duration",
            "How long this scan took",
            Some(Unit::Seconds),
            MetricType::Gauge,
            vec![(Labels::new(), ConstGauge::new(snap.scan_seconds))],
        )?;
        Ok(())
    }
}

fn histograms<'a>(
    v: Vec<(Labels, &'a Histogram)>,
    bounds: &'static [f64],
) -> Vec<(Labels, ConstHistogram<'a>)> {
    v.into_iter()
        .map(|(l, h)| (l, ConstHistogram(h, bounds)))
        .collect()
}

fn per_kind(h: &PerKind<Histogram>) -> Vec<(Labels, &Histogram)> {
    h.iter()
        .into_iter()
        .filter(|(kind, _)| *kind != "unknown")
        .map(|(kind, h)| (vec![("kind", kind.to_string())], h))
        .collect()
}

/// At most this many warnings go to stderr per scan (the count says how many there were).
const MAX_WARNINGS: usize = 20;

fn print_warnings(snap: &Snapshot) {
    for w in snap.warnings.iter().take(MAX_WARNINGS) {
        eprintln!("crabctl: metrics: {w}");
    }
    if snap.warnings.len() > MAX_WARNINGS {
        eprintln!(
            "crabctl: metrics: and {} more warnings",
            snap.warnings.len() - MAX_WARNINGS
        );
    }
}

/// Runs `crabctl metrics`.
pub async fn run(config: Option<&Path>, args: &MetricsArgs) -> Result<()> {
    let (config, _) = Config::load_or_default(config)?;
    let Some(addr) = args.listen else {
        let snap = scan(
            &config.store.state_dir,
            &config.engine,
            args.per_container,
            &mut ScanCache::default(),
        );
        print_warnings(&snap);
        print!("{}", render_as(&snap, args.format));
        return Ok(());
    };
    if !addr.ip().is_loopback() && !args.listen_any {
        return Err(CtlError::Refused(format!(
            "--listen {addr} is not a loopback address: the figures would be served to the \
             network; use 127.0.0.1:PORT, or add --listen-any if that is meant"
        )));
    }
    serve(addr, config, args.per_container).await
}

/// Bounds of one HTTP request: its head (hyper's smallest read buffer; a longer head is
/// answered 431), and how long the client has to send it.
const MAX_REQUEST_HEAD: usize = 8 << 10;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What every request of `--listen` scans with.
struct Scraped {
    cache: Mutex<ScanCache>,
    config: Config,
    per_container: bool,
}

async fn serve(addr: SocketAddr, config: Config, per_container: bool) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CtlError::Failed(format!("cannot listen on {addr}: {e}")))?;
    eprintln!(
        "crabctl: metrics: serving http://{}/metrics",
        listener.local_addr().unwrap_or(addr)
    );
    let scraped = Scraped {
        cache: Mutex::new(ScanCache::default()),
        config,
        per_container,
    };
    serve_on(listener, Arc::new(scraped)).await
}

/// Answers each connection to `listener` with hyper's HTTP/1.1 server: one request, then the
/// connection is closed (no keep-alive); its head is bounded in size and time.
async fn serve_on(listener: tokio::net::TcpListener, scraped: Arc<Scraped>) -> ! {
    use hyper::{server::conn::http1, service::service_fn};
    use hyper_util::rt::{TokioIo, TokioTimer};
    loop {
        let (conn, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("crabctl: metrics: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let scraped = scraped.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let scraped = scraped.clone();
                async move { Ok::<_, std::convert::Infallible>(route(request, scraped).await) }
            });
            let served = http1::Builder::new()
                .keep_alive(false)
                .max_buf_size(MAX_REQUEST_HEAD)
                .timer(TokioTimer::new())
                .header_read_timeout(REQUEST_TIMEOUT)
                .serve_connection(TokioIo::new(conn), service)
                .await;
            // A client that sends no request in time is only disconnected.
            match served {
                Err(e) if !e.is_timeout() => eprintln!("crabctl: metrics: a request failed: {e}"),
                _ => {}
            }
        });
    }
}

/// What OpenMetrics scrapers expect.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The Prometheus text format's.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `GET /metrics` gets the figures, in the format the scraper accepts; anything else 404 or
/// 405.
async fn route(
    request: hyper::Request<hyper::body::Incoming>,
    scraped: Arc<Scraped>,
) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
    let answer = |status: u16, content_type: &str, body: String| {
        hyper::Response::builder()
            .status(status)
            .header(hyper::header::CONTENT_TYPE, content_type)
            .body(body.into())
            .expect("a valid status and header")
    };
    // OpenMetrics if the scraper accepts it (Prometheus does), else the 0.0.4 text format.
    let accepts = request.headers().get_all(hyper::header::ACCEPT).iter();
    let format = match accepts
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .any(|v| v.contains("application/openmetrics-text"))
    {
        true => Format::Openmetrics,
        false => Format::Prometheus,
    };
    if request.uri().path() != "/metrics" {
        return answer(404, "text/plain", "crab serves /metrics only\n".into());
    }
    if request.method() != hyper::Method::GET {
        return answer(405, "text/plain", "GET /metrics\n".into());
    }
    let scanned = tokio::task::spawn_blocking(move || {
        // One scan at a time: the cache is shared, and a second scan would read the same.
        let mut cache = scraped.cache.lock().unwrap_or_else(|e| e.into_inner());
        let config = &scraped.config;
        let snap = scan(
            &config.store.state_dir,
            &config.engine,
            scraped.per_container,
            &mut cache,
        );
        print_warnings(&snap);
        render_as(&snap, format)
    })
    .await;
    let content_type = match format {
        Format::Openmetrics => CONTENT_TYPE,
        Format::Prometheus => TEXT_CONTENT_TYPE,
    };
    match scanned {
        Ok(body) => answer(200, content_type, body),
        Err(e) => answer(500, "text/plain", format!("the scan failed: {e}\n")),
    }
}

#[cfg(test)]
mod tests;
