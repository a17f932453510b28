//! Summaries of latency samples.

use serde::Serialize;

/// Count, mean, nearest-rank p50/p95 and max of a sample (all NaN when empty; NaN is `null`
/// in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Summary {
                n: 0,
                mean: f64::NAN,
                p50: f64::NAN,
                p95: f64::NAN,
                max: f64::NAN,
            };
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        // Nearest rank: the smallest sample with at least p% of the samples at or below it.
        let rank = |p: f64| v[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Summary {
            n,
            mean: v.iter().sum::<f64>() / n as f64,
            p50: rank(50.0),
            p95: rank(95.0),
            max: v[n - 1],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let s = Summary::of(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((s.n, s.mean, s.p50, s.p95, s.max), (5, 3.0, 3.0, 5.0, 5.0));
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!((s.p50, s.p95, s.max), (50.0, 95.0, 100.0));
        let s = Summary::of(&[7.0]);
        assert_eq!((s.p50, s.p95), (7.0, 7.0));
    }

    #[test]
    fn empty_and_nan() {
        let s = Summary::of(&[]);
        assert_eq!(s.n, 0);
        assert!(s.p50.is_nan());
        assert_eq!(
            serde_json::to_value(s).unwrap()["p50"],
            serde_json::Value::Null
        );
        assert_eq!(Summary::of(&[f64::NAN, 2.0]).n, 1);
    }
}
