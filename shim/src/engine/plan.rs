//! The pure part: the order of the queue, who may start, the budget's bucket, the stats.

use std::time::Duration;

/// A waiting job as the order needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queued {
    /// The ticket's name: unique, and sorts like the enqueue time.
    pub name: String,
    pub enqueued_ns: u64,
    pub urgent: bool,
    /// Its sandbox's recent slot time ([`Usage::penalty`]): the job goes as if it had been
    /// queued this much later.
    pub penalty_ns: u64,
}

/// Urgent first, then by enqueue time plus penalty: first come first served among
/// sandboxes that used the slots alike.
pub fn order(queue: &mut [Queued]) {
    queue.sort_by(|a, b| {
        b.urgent
            .cmp(&a.urgent)
            .then(
                a.enqueued_ns
                    .saturating_add(a.penalty_ns)
                    .cmp(&b.enqueued_ns.saturating_add(b.penalty_ns)),
            )
            .then_with(|| a.name.cmp(&b.name))
    });
}

/// A sandbox's recent use of the slots: slot time in microseconds at `at_ns`
/// (CLOCK_MONOTONIC), halving every `half_life`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub slot_us: f64,
    pub at_ns: u64,
}

impl Usage {
    /// The slot time at `now_ns`.
    pub fn decayed(&self, now_ns: u64, half_life: Duration) -> f64 {
        let elapsed = now_ns.saturating_sub(self.at_ns) as f64 / 1e9;
        self.slot_us * 0.5f64.powf(elapsed / half_life.as_secs_f64().max(1e-9))
    }

    /// Adds a job that held a slot for `run_us`.
    pub fn charge(&mut self, now_ns: u64, run_us: u64, half_life: Duration) {
        self.slot_us = self.decayed(now_ns, half_life) + run_us as f64;
        self.at_ns = now_ns.max(self.at_ns);
    }

    /// How much later than its enqueue time the sandbox's next job goes: its decayed slot
    /// time, at most `max`.
    pub fn penalty(&self, now_ns: u64, half_life: Duration, max: Duration) -> Duration {
        let us = self.decayed(now_ns, half_life).max(0.0);
        Duration::from_secs_f64(us / 1e6).min(max)
    }
}

/// What is left of a wait bounded by `deadline_ns` at `now_ns`: `None` once it is over.
pub fn remaining(deadline_ns: u64, now_ns: u64) -> Option<Duration> {
    (now_ns < deadline_ns).then(|| Duration::from_nanos(deadline_ns - now_ns))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Take a free slot now.
    Start,
    /// Not yet: look again at the next event, or after this long at the latest.
    Wait(Duration),
}

/// Whether the job at `rank` of the ordered queue may start, with `free` slots and the
/// budget in debt for `budget_wait` more; `poll` bounds the wait for an event.
pub fn decide(rank: usize, free: usize, budget_wait: Duration, poll: Duration) -> Decision {
    if rank >= free {
        Decision::Wait(poll)
    } else if budget_wait.is_zero() {
        Decision::Start
    } else {
        Decision::Wait(budget_wait.min(poll))
    }
}

/// A token bucket of bytes: `tokens` at `at_ns` (CLOCK_MONOTONIC); negative = debt.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Bucket {
    pub tokens: f64,
    pub at_ns: u64,
}

impl Bucket {
    /// A bucket saves up at most one second of its rate.
    pub fn full(rate: f64, now_ns: u64) -> Bucket {
        Bucket {
            tokens: rate,
            at_ns: now_ns,
        }
    }

    /// The tokens at `now_ns`.
    pub fn level(&self, rate: f64, now_ns: u64) -> f64 {
        let elapsed = now_ns.saturating_sub(self.at_ns) as f64 / 1e9;
        (self.tokens + rate * elapsed).min(rate)
    }

    pub fn debit(&mut self, rate: f64, now_ns: u64, bytes: u64) {
        self.tokens = self.level(rate, now_ns) - bytes as f64;
        self.at_ns = now_ns;
    }

    /// How long until the bucket is out of debt.
    pub fn wait(&self, rate: f64, now_ns: u64) -> Duration {
        let level = self.level(rate, now_ns);
        if level >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-level / rate)
        }
    }
}

/// The `p`-th percentile (0..=100, nearest rank) of `samples`.
pub fn percentile(samples: impl IntoIterator<Item = u64>, p: f64) -> Option<u64> {
    let mut v: Vec<u64> = samples.into_iter().collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}
