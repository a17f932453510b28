//! What many sandboxes at once cost the host, beyond time: the shims' memory (crab's, and
//! containerd's own runc shim for the same containers), the host engine's queue (each round
//! gets an engine root of its own, read back when the round ends), and a projection to more
//! sandboxes than one host here can run, from the engine's queueing model with the measured
//! costs ([`project`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::bench::stats::Summary;
use crate::env::{TestEnv, RUNC_RUNTIME};
use crate::sandbox::{Sandbox, SandboxOptions, AGENT_IMAGE};
use crate::{Harness, ProcessSpec};

/// The shim binaries whose memory is measured, by the name they run as.
pub const CRAB_SHIM: &str = "containerd-shim-crab-v1";
pub const RUNC_SHIM: &str = "containerd-shim-runc-v2";

/// One shim process's memory, from `/proc/<pid>/smaps_rollup` (kernel-computed): resident
/// set and proportional set (shared pages divided among the processes that map them, which is
/// what N copies of one binary really cost together).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcMemory {
    pub rss_kib: u64,
    pub pss_kib: u64,
}

/// Reads the `Rss:` and `Pss:` lines of an smaps_rollup text.
pub fn parse_smaps_rollup(text: &str) -> Option<ProcMemory> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
        })
    };
    Some(ProcMemory {
        rss_kib: field("Rss")?,
        pss_kib: field("Pss")?,
    })
}

/// The shims of `binary` that serve `env`'s namespace, now, with their `-id`.
pub fn shims_serving(env: &TestEnv, binary: &str) -> Vec<(String, crate::host::Proc)> {
    crate::host::shims_of(&env.address)
        .into_iter()
        .filter(|(_, p)| {
            p.argv
                .first()
                .and_then(|a| Path::new(a).file_name())
                .is_some_and(|n| n == binary)
                && p.argv
                    .windows(2)
                    .any(|w| w[0] == "-namespace" && w[1] == env.namespace)
        })
        .collect()
}

/// The shims of `binary` that serve `env`'s namespace, now: their memory, one entry each.
pub fn shims_now(env: &TestEnv, binary: &str) -> Vec<ProcMemory> {
    shims_serving(env, binary)
        .into_iter()
        .filter_map(|(_, p)| {
            std::fs::read_to_string(format!("/proc/{}/smaps_rollup", p.pid))
                .ok()
                .and_then(|t| parse_smaps_rollup(&t))
        })
        .collect()
}

/// The shims' memory over a round, per shim: samples of (RSS, PSS) summed over the shims
/// alive at that moment and divided by their number; `peak_*` is the sample with the most
/// memory in total.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShimMemory {
    pub binary: String,
    pub samples: usize,
    /// The most shims seen at once.
    pub max_shims: usize,
    pub rss_kib_per_shim: Option<Summary>,
    pub pss_kib_per_shim: Option<Summary>,
    pub peak_total_rss_kib: u64,
    pub peak_total_pss_kib: u64,
}

impl ShimMemory {
    pub fn of(binary: &str, samples: &[Vec<ProcMemory>]) -> ShimMemory {
        let live: Vec<&Vec<ProcMemory>> = samples.iter().filter(|s| !s.is_empty()).collect();
        let per = |f: fn(&ProcMemory) -> u64| -> Option<Summary> {
            let v: Vec<f64> = live
                .iter()
                .map(|s| s.iter().map(f).sum::<u64>() as f64 / s.len() as f64)
                .collect();
            (!v.is_empty()).then(|| Summary::of(&v))
        };
        let total = |s: &Vec<ProcMemory>, f: fn(&ProcMemory) -> u64| s.iter().map(f).sum::<u64>();
        ShimMemory {
            binary: binary.into(),
            samples: live.len(),
            max_shims: live.iter().map(|s| s.len()).max().unwrap_or(0),
            rss_kib_per_shim: per(|m| m.rss_kib),
            pss_kib_per_shim: per(|m| m.pss_kib),
            peak_total_rss_kib: live
                .iter()
                .map(|s| total(s, |m| m.rss_kib))
                .max()
                .unwrap_or(0),
            peak_total_pss_kib: live
                .iter()
                .map(|s| total(s, |m| m.pss_kib))
                .max()
                .unwrap_or(0),
        }
    }
}

/// Samples the shims of `binary` every `every` until stopped.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Vec<ProcMemory>>>,
    binary: String,
}

impl Sampler {
    pub fn start(env: TestEnv, binary: &str, every: Duration) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, b) = (stop.clone(), binary.to_string());
        let task = tokio::spawn(async move {
            let mut out = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let (env, b) = (env.clone(), b.clone());
                if let Ok(v) = tokio::task::spawn_blocking(move || shims_now(&env, &b)).await {
                    out.push(v);
                }
                tokio::time::sleep(every).await;
            }
            out
        });
        Sampler {
            stop,
            task,
            binary: binary.into(),
        }
    }

    pub async fn finish(self) -> ShimMemory {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.task.await.unwrap_or_default();
        ShimMemory::of(&self.binary, &samples)
    }
}

/// The host engine's figures for one round, from the `stats.json` of the round's own root.
#[derive(Debug, Clone, Serialize)]
pub struct EngineFigures {
    pub jobs: u64,
    pub urgent_jobs: u64,
    pub bytes: u64,
    /// Waits for a slot (the newest [`crab_shim::engine::WAIT_SAMPLES`] jobs), in ms.
    pub wait_ms: Summary,
    /// Mean time a job held its slot, in ms.
    pub run_ms_mean: f64,
}

impl EngineFigures {
    pub fn read(root: &Path) -> Result<EngineFigures, String> {
        let path = root.join("stats.json");
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            // No job ended in this round (no turn changed anything, or no checkpoints).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(EngineFigures {
                    jobs: 0,
                    urgent_jobs: 0,
                    bytes: 0,
                    wait_ms: Summary::of(&[]),
                    run_ms_mean: f64::NAN,
                })
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let s: crab_shim::engine::Stats =
            serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let waits: Vec<f64> = s.waits_us.iter().map(|us| *us as f64 / 1e3).collect();
        Ok(EngineFigures {
            jobs: s.jobs,
            urgent_jobs: s.urgent_jobs,
            bytes: s.bytes,
            wait_ms: Summary::of(&waits),
            run_ms_mean: if s.jobs == 0 {
                f64::NAN
            } else {
                s.run_us_total as f64 / 1e3 / s.jobs as f64
            },
        })
    }
}

/// A fresh engine root for one round under `$CRAB_HOME/bench/engine/`.
pub fn round_engine_root(env: &TestEnv, label: &str) -> PathBuf {
    let root = env.bench_dir().join("engine").join(format!(
        "{label}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0)
    ));
    let _ = std::fs::remove_dir_all(&root);
    root
}

/// Idle memory: `n` agent sandboxes (`sleep infinity`) under crab (its default policy) and
/// then `n` under containerd's runc shim, each set sampled for a few seconds once all run.
pub async fn idle_shims(n: usize, engine_root: &Path) -> Result<(ShimMemory, ShimMemory), String> {
    let env = TestEnv {
        image: AGENT_IMAGE.into(),
        ..TestEnv::from_env()
    };
    let config = format!("engine.root = \"{}\"", engine_root.display());
    // crab: the replayer's own sandboxes.
    let mut sandboxes = Vec::new();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let config = config.clone();
        set.spawn(async move {
            Sandbox::start(
                &format!("idle-crab-{i}"),
                SandboxOptions {
                    config: &config,
                    ..Default::default()
                },
            )
            .await
        });
    }
    while let Some(s) = set.join_next().await {
        sandboxes.push(s.map_err(|e| format!("starting an idle crab sandbox: {e}"))?);
    }
    let crab = sample_for(&env, CRAB_SHIM).await;
    for (sb, guard) in sandboxes {
        let _ = sb.h.kill_and_remove(&sb.id).await;
        let _ = std::fs::remove_dir_all(&sb.state_dir);
        drop(guard);
    }
    // runc: the same image and process under containerd's own shim.
    let renv = TestEnv {
        runtime: RUNC_RUNTIME.into(),
        ..env.clone()
    };
    let h = Harness::connect_env(renv)
        .await
        .map_err(|e| format!("connecting for the runc sandboxes: {e}"))?;
    let ids: Vec<String> = (0..n)
        .map(|i| h.unique_id(&format!("idle-runc-{i}")))
        .collect();
    let guard = h.guard(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let mut result = Ok(());
    for id in &ids {
        let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
        let spec = crate::spec::container_spec(id, &h.env.namespace, process);
        let r = async {
            h.create_container_with_spec_and_options(id, &spec, None)
                .await?;
            h.create_task(id, None).await?;
            h.start(id, "").await
        }
        .await;
        if let Err(e) = r {
            result = Err(format!("starting {id} under runc: {e}"));
            break;
        }
    }
    let runc = sample_for(&env, RUNC_SHIM).await;
    for id in &ids {
        let _ = h.kill_and_remove(id).await;
    }
    drop(guard);
    result.map(|_| (crab, runc))
}

/// Samples for a few seconds (the shims settle after their containers start).
async fn sample_for(env: &TestEnv, binary: &str) -> ShimMemory {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = Sampler::start(env.clone(), binary, Duration::from_millis(500));
    tokio::time::sleep(Duration::from_secs(3)).await;
    s.finish().await
}

/// The engine's queue seen as M/M/c (Poisson arrivals of checkpoint jobs, exponential job
/// times, `c` slots): Erlang's C formula, the probability that an arriving job waits.
/// `a` is the offered load in slots (arrival rate × mean job time). 1.0 when `a >= c`.
pub fn erlang_c(c: u32, a: f64) -> f64 {
    if c == 0 || a >= c as f64 {
        return 1.0;
    }
    if a <= 0.0 {
        return 0.0;
    }
    // Erlang B by its stable recursion, then C from B.
    let mut b = 1.0;
    for k in 1..=c {
        b = a * b / (k as f64 + a * b);
    }
    let rho = a / c as f64;
    b / (1.0 - rho + rho * b)
}

/// What the projection starts from: measured per-turn costs of crab's policy.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Costs {
    /// Mean seconds between one sandbox's turn ends at the real (unscaled) think times: the
    /// recorded think time plus the command's run time.
    pub turn_interval_s: f64,
    /// Checkpoint jobs per turn (the engine's jobs over the round's turns).
    pub jobs_per_turn: f64,
    /// Mean time a job holds its slot, in seconds.
    pub job_s: f64,
    /// Bytes written per job.
    pub bytes_per_job: f64,
    /// Shim memory per sandbox (PSS), KiB.
    pub shim_pss_kib: f64,
}

/// The projection to `sandboxes` at once.
#[derive(Debug, Clone, Serialize)]
pub struct Projection {
    pub sandboxes: usize,
    pub slots: u32,
    /// Jobs per second, host-wide.
    pub jobs_per_s: f64,
    /// Offered load over slots (utilisation); >= 1 means the queue grows without bound.
    pub utilisation: f64,
    pub p_wait: f64,
    /// Mean wait for a slot, in ms (M/M/c); infinite when saturated.
    pub mean_wait_ms: f64,
    /// Mean wait as a share of a turn's interval: the upper bound of the delay a turn could be
    /// exposed to (a wait only shows when it outlasts the agent's next think time).
    pub wait_share_of_turn: f64,
    pub write_mb_s: f64,
    pub shim_memory_gib: f64,
}

pub fn project(c: &Costs, sandboxes: usize, slots: u32) -> Projection {
    let jobs_per_s = sandboxes as f64 * c.jobs_per_turn / c.turn_interval_s.max(1e-9);
    let a = jobs_per_s * c.job_s;
    let utilisation = a / slots.max(1) as f64;
    let p_wait = erlang_c(slots, a);
    let mean_wait_s = if utilisation >= 1.0 {
        f64::INFINITY
    } else if jobs_per_s <= 0.0 {
        0.0
    } else {
        p_wait * c.job_s / (slots as f64 - a)
    };
    Projection {
        sandboxes,
        slots,
        jobs_per_s,
        utilisation,
        p_wait,
        mean_wait_ms: mean_wait_s * 1e3,
        wait_share_of_turn: mean_wait_s / c.turn_interval_s.max(1e-9),
        write_mb_s: jobs_per_s * c.bytes_per_job / 1e6,
        shim_memory_gib: sandboxes as f64 * c.shim_pss_kib / (1024.0 * 1024.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_rollup_fields() {
        let t = "00400000-7ffd0000 ---p 00000000 00:00 0  [rollup]\nRss:                4096 kB\nPss:                1234 kB\nPss_Anon:            100 kB\n";
        assert_eq!(
            parse_smaps_rollup(t),
            Some(ProcMemory {
                rss_kib: 4096,
                pss_kib: 1234
            })
        );
        // Pss_Anon is not Pss; a text without Pss is no figure.
        assert_eq!(parse_smaps_rollup("Rss: 1 kB\nPss_Anon: 2 kB\n"), None);
        assert_eq!(parse_smaps_rollup("garbage"), None);
    }

    #[test]
    fn memory_per_shim_and_peaks() {
        let m = |rss, pss| ProcMemory {
            rss_kib: rss,
            pss_kib: pss,
        };
        let s = ShimMemory::of(
            CRAB_SHIM,
            &[
                vec![],
                vec![m(10, 4), m(20, 6)],
                vec![m(10, 4), m(20, 6), m(30, 11)],
            ],
        );
        assert_eq!(s.samples, 2, "an empty sample (no shim yet) is left out");
        assert_eq!(s.max_shims, 3);
        assert_eq!((s.peak_total_rss_kib, s.peak_total_pss_kib), (60, 21));
        let pss = s.pss_kib_per_shim.unwrap();
        assert_eq!((pss.min, pss.max), (5.0, 7.0));
        assert!(ShimMemory::of(RUNC_SHIM, &[]).pss_kib_per_shim.is_none());
    }

    #[test]
    fn erlang_c_known_values() {
        // One server: P(wait) = utilisation.
        assert!((erlang_c(1, 0.5) - 0.5).abs() < 1e-12);
        // Two servers, a = 1: C = 1/3.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        // A textbook case: c = 10, a = 8 gives about 0.409.
        assert!((erlang_c(10, 8.0) - 0.4092).abs() < 1e-3);
        assert_eq!(erlang_c(2, 2.0), 1.0);
        assert_eq!(erlang_c(2, 0.0), 0.0);
    }

    #[test]
    fn projection_from_costs() {
        let c = Costs {
            turn_interval_s: 10.0,
            jobs_per_turn: 0.3,
            job_s: 0.2,
            bytes_per_job: 1e6,
            shim_pss_kib: 4096.0,
        };
        let p = project(&c, 100, 2);
        assert!((p.jobs_per_s - 3.0).abs() < 1e-9);
        assert!((p.utilisation - 0.3).abs() < 1e-9);
        assert!((p.write_mb_s - 3.0).abs() < 1e-9);
        // M/M/2 at a = 0.6: C = 0.6²/2 / (1 - 0.3) / (1 + 0.6 + 0.6²/2/(1-0.3)) …
        let expected_c = erlang_c(2, 0.6);
        assert!((p.mean_wait_ms - expected_c * 0.2 / (2.0 - 0.6) * 1e3).abs() < 1e-9);
        assert!((p.shim_memory_gib - 100.0 * 4096.0 / 1048576.0).abs() < 1e-9);
        let saturated = project(&c, 1000, 2);
        assert!(saturated.utilisation >= 1.0 && saturated.mean_wait_ms.is_infinite());
    }
}
