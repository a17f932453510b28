//! What the engine keeps and shows: tickets, slot holders, job records, stats and the
//! snapshot `crabctl engine` prints.

use std::{collections::VecDeque, path::PathBuf};

use serde::{Deserialize, Serialize};

use super::files::*;
use super::plan;

/// The newest waits kept for percentiles.
pub const WAIT_SAMPLES: usize = 1000;
/// The newest jobs kept one by one.
pub const RECENT_JOBS: usize = 100;

/// What a ticket file holds (written once, before the ticket enters the queue).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TicketInfo {
    pub sandbox: String,
    pub namespace: String,
    /// The turns the job covers.
    pub job: String,
    pub pid: u32,
    /// CLOCK_MONOTONIC (host-wide): orders the queue.
    pub enqueued_ns: u64,
    pub enqueued_unix_ms: u64,
    /// Urgent from the start (its sandbox already waited when the job was queued).
    pub urgent: bool,
    /// Its sandbox's penalty ([`plan::Usage::penalty`]) when the ticket was queued: fixed, so
    /// that the order of two queued tickets never changes. Absent in a ticket of an older crab
    /// (its penalty is then computed when the queue is read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub penalty_ns: Option<u64>,
}

/// Who holds a slot (`slots/<i>.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotHolder {
    pub sandbox: String,
    pub namespace: String,
    pub job: String,
    pub pid: u32,
    pub urgent: bool,
    pub since_unix_ms: u64,
    pub waited_us: u64,
}

/// One finished job in the stats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub sandbox: String,
    pub namespace: String,
    pub job: String,
    pub slot: u32,
    /// Urgent when it was admitted.
    pub urgent: bool,
    pub enqueued_unix_ms: u64,
    pub started_unix_ms: u64,
    pub ended_unix_ms: u64,
    pub wait_us: u64,
    pub run_us: u64,
    pub bytes: u64,
}

/// The cumulative stats (`stats.json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub jobs: u64,
    pub urgent_jobs: u64,
    pub bytes: u64,
    pub wait_us_total: u64,
    pub wait_us_max: u64,
    pub run_us_total: u64,
    /// The newest waits, at most [`WAIT_SAMPLES`].
    pub waits_us: VecDeque<u64>,
    /// The newest jobs, at most [`RECENT_JOBS`], oldest first.
    pub recent: VecDeque<JobRecord>,
    /// Every wait, in the buckets of [`crate::metrics::WAIT_BOUNDS`] (not cumulative; the
    /// last is `+Inf`), for `crabctl metrics`. Counts the jobs since the crab that added it.
    pub wait_buckets: Vec<u64>,
    /// The sum of the waits in `wait_buckets`.
    pub wait_buckets_us: u64,
}

impl Stats {
    pub fn record(&mut self, r: JobRecord) {
        self.jobs += 1;
        self.urgent_jobs += u64::from(r.urgent);
        self.bytes += r.bytes;
        self.wait_us_total += r.wait_us;
        self.wait_us_max = self.wait_us_max.max(r.wait_us);
        self.run_us_total += r.run_us;
        let bounds = crate::metrics::WAIT_BOUNDS;
        self.wait_buckets.resize(bounds.len() + 1, 0);
        let seconds = r.wait_us as f64 / 1e6;
        let bucket = bounds
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(bounds.len());
        self.wait_buckets[bucket] += 1;
        self.wait_buckets_us = self.wait_buckets_us.saturating_add(r.wait_us);
        self.waits_us.push_back(r.wait_us);
        while self.waits_us.len() > WAIT_SAMPLES {
            self.waits_us.pop_front();
        }
        self.recent.push_back(r);
        while self.recent.len() > RECENT_JOBS {
            self.recent.pop_front();
        }
    }

    pub fn avg_wait_us(&self) -> u64 {
        self.wait_us_total.checked_div(self.jobs).unwrap_or(0)
    }

    /// The 95th percentile of the newest waits.
    pub fn p95_wait_us(&self) -> Option<u64> {
        plan::percentile(self.waits_us.iter().copied(), 95.0)
    }
}

/// The engine as `crabctl engine` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub root: PathBuf,
    pub max_jobs: u32,
    pub io_budget_bytes_s: Option<u64>,
    /// The budget's bucket now, in bytes (negative: debt).
    pub budget_level: Option<f64>,
    pub slots: Vec<SlotView>,
    /// In the order jobs will start.
    pub queue: Vec<QueuedView>,
    pub stats: Stats,
}

#[derive(Debug, Clone, Serialize)]
pub struct SlotView {
    pub index: u32,
    /// `None`: free. A taken slot whose holder file is missing shows a default holder.
    pub holder: Option<SlotHolder>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QueuedView {
    pub ticket: String,
    pub info: TicketInfo,
    pub urgent: bool,
    pub waiting_us: u64,
}

/// `1.2 ms`, `3.40 s`: durations for people.
pub(super) fn human_us(us: u64) -> String {
    match us {
        0..=999 => format!("{us} us"),
        1_000..=999_999 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

pub(super) fn human_bytes(b: f64) -> String {
    match b.abs() {
        x if x < 1e3 => format!("{b:.0} B"),
        x if x < 1e6 => format!("{:.1} kB", b / 1e3),
        x if x < 1e9 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}

/// What `crabctl engine` prints.
impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let budget = match (self.io_budget_bytes_s, self.budget_level) {
            (Some(rate), Some(level)) => format!(
                "I/O budget {}/s (bucket {})",
                human_bytes(rate as f64),
                human_bytes(level)
            ),
            _ => "no I/O budget".into(),
        };
        writeln!(
            f,
            "engine {}: max_jobs {}, {budget}",
            self.root.display(),
            self.max_jobs
        )?;
        let now = unix_ms();
        writeln!(
            f,
            "{:<4}  {:<40} {:<20} {:<6}  SINCE",
            "SLOT", "SANDBOX", "JOB", "URGENT"
        )?;
        for s in &self.slots {
            match &s.holder {
                Some(h) => writeln!(
                    f,
                    "{:<4}  {:<40} {:<20} {:<6}  {} ago (waited {}), pid {}",
                    s.index,
                    format!("{}/{}", h.namespace, h.sandbox),
                    h.job,
                    if h.urgent { "yes" } else { "no" },
                    human_us(now.saturating_sub(h.since_unix_ms) * 1000),
                    human_us(h.waited_us),
                    h.pid
                )?,
                None => writeln!(f, "{:<4}  -", s.index)?,
            }
        }
        writeln!(f, "queue: {} waiting", self.queue.len())?;
        if !self.queue.is_empty() {
            writeln!(
                f,
                "{:<4}  {:<40} {:<20} {:<6}  WAITING",
                "POS", "SANDBOX", "JOB", "URGENT"
            )?;
        }
        for (i, q) in self.queue.iter().enumerate() {
            writeln!(
                f,
                "{:<4}  {:<40} {:<20} {:<6}  {}, pid {}",
                i + 1,
                format!("{}/{}", q.info.namespace, q.info.sandbox),
                q.info.job,
                if q.urgent { "yes" } else { "no" },
                human_us(q.waiting_us),
                q.info.pid
            )?;
        }
        let s = &self.stats;
        write!(
            f,
            "stats: {} jobs ({} urgent), {} written; wait avg {}, p95 {} (newest {}), max {}, total {}; run avg {}",
            s.jobs,
            s.urgent_jobs,
            human_bytes(s.bytes as f64),
            human_us(s.avg_wait_us()),
            s.p95_wait_us().map_or("-".into(), human_us),
            s.waits_us.len(),
            human_us(s.wait_us_max),
            human_us(s.wait_us_total),
            human_us(s.run_us_total.checked_div(s.jobs).unwrap_or(0))
        )
    }
}
