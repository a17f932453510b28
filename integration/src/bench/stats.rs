//! Summaries of benchmark samples: one definition of the percentiles every report prints.

use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

/// Count, min, mean, nearest-rank p50/p95/p99 and max of a sample. NaN samples (a figure that was
/// missing) are left out; all fields are NaN when nothing is left (NaN is `null` in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Summary {
                n: 0,
                min: f64::NAN,
                mean: f64::NAN,
                p50: f64::NAN,
                p95: f64::NAN,
                p99: f64::NAN,
                max: f64::NAN,
            };
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        // Nearest rank: the smallest sample with at least p% of the samples at or below it
        // (with few samples p95 is the maximum).
        let rank = |p: f64| v[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Summary {
            n,
            min: v[0],
            mean: v.iter().sum::<f64>() / n as f64,
            p50: rank(50.0),
            p95: rank(95.0),
            p99: rank(99.0),
            max: v[n - 1],
        }
    }

    /// The summary of durations, in milliseconds.
    pub fn of_durations(samples: &[Duration]) -> Summary {
        Summary::of(&samples.iter().copied().map(ms).collect::<Vec<_>>())
    }

    /// The summary of `samples` with the samples themselves, as a results file holds them.
    pub fn json(samples: &[f64]) -> Value {
        let s = Summary::of(samples);
        let num = |x: f64| if x.is_nan() { Value::Null } else { json!(x) };
        let samples: Vec<Value> = samples.iter().map(|x| num(*x)).collect();
        json!({"n": s.n, "min": num(s.min), "mean": num(s.mean), "p50": num(s.p50),
               "p95": num(s.p95), "p99": num(s.p99), "max": num(s.max), "samples": samples})
    }
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let s = Summary::of(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(
            (s.n, s.min, s.mean, s.p50, s.p95, s.max),
            (5, 1.0, 3.0, 3.0, 5.0, 5.0)
        );
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!((s.p50, s.p95, s.p99, s.max), (50.0, 95.0, 99.0, 100.0));
        let s = Summary::of(&[7.0]);
        assert_eq!((s.p50, s.p95), (7.0, 7.0));
        let s = Summary::of_durations(&[Duration::from_millis(2), Duration::from_micros(500)]);
        assert_eq!((s.min, s.max), (0.5, 2.0));
    }

    #[test]
    fn empty_and_nan() {
        let s = Summary::of(&[]);
        assert_eq!(s.n, 0);
        assert!(s.p50.is_nan());
        assert_eq!(serde_json::to_value(s).unwrap()["p50"], Value::Null);
        assert_eq!(Summary::of(&[f64::NAN, 2.0]).n, 1);
        let j = Summary::json(&[f64::NAN, 2.0]);
        assert_eq!(j["n"], 1);
        assert_eq!(j["p50"], 2.0);
        assert_eq!(j["samples"], json!([null, 2.0]));
        assert_eq!(Summary::json(&[])["max"], Value::Null);
    }
}
