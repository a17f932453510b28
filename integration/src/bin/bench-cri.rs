//! Kubernetes-path benchmark: the runtime handler `crab` against the stock `runc`, through the
//! CRI plugin of the private containerd, as the kubelet drives it.
//!
//! Per handler and iteration (handlers interleaved, their order alternating each iteration):
//!   pod-start  RunPodSandbox -> CreateContainer -> StartContainer of a busybox `sleep`
//!              (the pause container, CNI, the shim and the app container all included),
//!              also split into its three calls: run-pod, create, start
//!   pod-stop   StopPodSandbox -> RemovePodSandbox of that pod
//! and, in one long-lived pod per handler, `--execs` rounds of
//!   exec-sync  ExecSync of `true` (the kubelet's exec probes and `kubectl exec` without a tty)
//!
//! Prints nearest-rank p50/p95 per handler and the crab/runc ratio of the p50s (aim: <= 1.1),
//! and writes `$CRAB_HOME/bench/cri-<unix time>.{json,md}` (plus `cri-latest.*`).
//! Figures only, nothing is asserted.
//!
//! Usage: bench-cri [--iterations N (pod starts, default 10)] [--execs N (default 50)]

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crab_integration::bench::stats::{ms, Summary};
use crab_integration::bench::{Bench, Host};
use crab_integration::cri::{api, Cri, PodGuard, BUSYBOX};

const BENCH: Bench = Bench::new("bench-cri");
use serde_json::{json, Value};

const HANDLERS: [&str; 2] = ["crab", "runc"];
const METRICS: [&str; 6] = [
    "pod-start",
    "run-pod",
    "create",
    "start",
    "pod-stop",
    "exec-sync",
];

/// Milliseconds per metric of one handler.
#[derive(Default)]
struct Samples(std::collections::BTreeMap<&'static str, Vec<f64>>);

impl Samples {
    fn of(&self, metric: &str) -> &[f64] {
        self.0.get(metric).map(Vec::as_slice).unwrap_or_default()
    }

    fn push(&mut self, metric: &'static str, d: Duration) {
        self.0.entry(metric).or_default().push(ms(d));
    }
}

fn sleeper() -> api::ContainerConfig {
    Cri::container_config("app", &["sleep", "100000"])
}

/// One pod from nothing to a running app container, then its teardown.
async fn pod_once(
    cri: &Cri,
    guard: &mut PodGuard,
    handler: &str,
    iter: usize,
) -> Result<Vec<(&'static str, Duration)>, String> {
    let pod = cri.pod_config(&format!("bench-{handler}-{iter}"));
    let t0 = Instant::now();
    let pod_id = cri
        .run_pod(guard, handler, &pod)
        .await
        .map_err(|e| e.to_string())?;
    let t1 = Instant::now();
    let id = cri
        .create_container(&pod_id, &pod, sleeper())
        .await
        .map_err(|e| e.to_string())?;
    let t2 = Instant::now();
    cri.start_container(&id).await.map_err(|e| e.to_string())?;
    let t3 = Instant::now();
    cri.stop_pod(&pod_id).await.map_err(|e| e.to_string())?;
    cri.remove_pod(&pod_id).await.map_err(|e| e.to_string())?;
    Ok(vec![
        ("pod-start", t3 - t0),
        ("run-pod", t1 - t0),
        ("create", t2 - t1),
        ("start", t3 - t2),
        ("pod-stop", t3.elapsed()),
    ])
}

async fn exec_once(cri: &Cri, id: &str) -> Result<Duration, String> {
    let t = Instant::now();
    let r = cri
        .exec_sync(id, &["true"], 30)
        .await
        .map_err(|e| e.to_string())?;
    if r.exit_code != 0 {
        return Err(format!("`true` exited {}", r.exit_code));
    }
    Ok(t.elapsed())
}

async fn measure(cri: &Cri, iterations: usize, execs: usize) -> Result<Vec<Samples>, String> {
    let mut guard = PodGuard::new();
    let mut samples: Vec<Samples> = HANDLERS.iter().map(|_| Samples::default()).collect();
    eprintln!("bench-cri: {iterations} pod starts and {execs} ExecSyncs (+1 warm-up each) x handlers {HANDLERS:?}");
    for iter in 0..=iterations {
        let mut order: Vec<usize> = (0..HANDLERS.len()).collect();
        if iter % 2 == 1 {
            order.reverse();
        }
        for h in order {
            let timings = pod_once(cri, &mut guard, HANDLERS[h], iter)
                .await
                .map_err(|e| format!("handler {}: pod {iter}: {e}", HANDLERS[h]))?;
            if iter > 0 {
                for (metric, d) in timings {
                    samples[h].push(metric, d);
                }
            }
        }
    }

    let mut apps = Vec::new();
    for handler in HANDLERS {
        let pod = cri.pod_config(&format!("bench-exec-{handler}"));
        let pod_id = cri
            .run_pod(&mut guard, handler, &pod)
            .await
            .map_err(|e| format!("{handler}: {e}"))?;
        apps.push(
            cri.run_container(&pod_id, &pod, sleeper())
                .await
                .map_err(|e| format!("{handler}: {e}"))?,
        );
    }
    for iter in 0..=execs {
        let mut order: Vec<usize> = (0..HANDLERS.len()).collect();
        if iter % 2 == 1 {
            order.reverse();
        }
        for h in order {
            let d = exec_once(cri, &apps[h])
                .await
                .map_err(|e| format!("handler {}: ExecSync {iter}: {e}", HANDLERS[h]))?;
            if iter > 0 {
                samples[h].push("exec-sync", d);
            }
        }
    }
    Ok(samples)
}

fn report(iterations: usize, execs: usize, samples: &[Samples], cri: &Cri) {
    let host = Host::now();
    let now = host.unix_time;
    let kernel = &host.kernel;
    let load = &host.loadavg;
    let cpus = host.cpus;
    let summary = |h: usize, m: &str| Summary::of(samples[h].of(m));
    let (crab, runc) = (0, 1);

    let mut md = String::new();
    let _ = writeln!(
        md,
        "# bench-cri: pods under the CRI, handler crab vs runc\n"
    );
    let _ = writeln!(
        md,
        "{iterations} pod starts and {execs} ExecSyncs per handler (after one warm-up each), handlers \
         interleaved. Kernel {kernel}, {cpus} CPUs, load {load}. Milliseconds; nearest-rank percentiles. \
         Aim: crab/runc <= 1.1 at p50. Figures only.\n"
    );
    let _ = writeln!(
        md,
        "| metric | crab p50 | crab p95 | runc p50 | runc p95 | crab/runc (p50) |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|");
    let mut metrics = serde_json::Map::new();
    for m in METRICS {
        let (c, r) = (summary(crab, m), summary(runc, m));
        let ratio = c.p50 / r.p50;
        let _ = writeln!(
            md,
            "| {m} | {:.1} | {:.1} | {:.1} | {:.1} | {ratio:.2}x |",
            c.p50, c.p95, r.p50, r.p95
        );
        metrics.insert(
            m.to_string(),
            json!({ "crab": c, "runc": r, "ratio_p50": ratio, "samples": { "crab": samples[crab].of(m), "runc": samples[runc].of(m) } }),
        );
    }
    let result: Value = json!({
        "bench": "cri",
        "unix_time": now,
        "iterations": iterations,
        "execs": execs,
        "kernel": kernel,
        "cpus": cpus,
        "loadavg": load,
        "unit": "ms",
        "aim_ratio_p50": 1.1,
        "metrics": metrics,
    });
    BENCH.finish(&cri.env.crab_home.join("bench"), "cri", now, &result, &md);
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let (mut iterations, mut execs) = (10, 50);
    crab_integration::bench::parse_counts(
        "bench-cri",
        "[--iterations N (pod starts per handler, default 10)] [--execs N (ExecSyncs per handler, default 50)]",
        &mut [("--iterations", &mut iterations), ("--execs", &mut execs)],
    );
    let cri = match Cri::connect().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bench-cri: {e}\n(the image {BUSYBOX} and the pause image must be in namespace k8s.io: `make images`)");
            std::process::exit(1);
        }
    };
    match measure(&cri, iterations, execs).await {
        Ok(samples) => report(iterations, execs, &samples, &cri),
        Err(e) => {
            eprintln!("bench-cri: {e}");
            std::process::exit(1);
        }
    }
}
