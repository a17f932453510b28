//! `crabctl metrics` against a real run: a container under the private containerd takes real
//! turns (fs, proc, none), is rolled back (a restore), takes one more turn; the figures
//! crabctl prints, parsed by the Prometheus project's own parsers (Python's
//! `prometheus_client`: `openmetrics.parser` for OpenMetrics, `parser` for the 0.0.4 text
//! format, in a venv this test makes under `$CRAB_HOME`), must match what the store says
//! happened. Then the same through `--listen`.

use std::{
    collections::HashMap,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use crab_integration::sandbox::{json_files, Sandbox, SandboxOptions};
use serde_json::Value;

/// Prints each sample as JSON: `[family, type, sample name, labels, value]`.
const PARSE: &str = r#"
import json, sys
fmt = sys.argv[1]
text = sys.stdin.read()
if fmt == "openmetrics":
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
else:
    from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(text):
    for s in family.samples:
        out.append([family.name, family.type, s.name, s.labels, s.value])
print(json.dumps(out))
"#;

/// A Python with `prometheus_client` (a venv under `$CRAB_HOME`, made once).
fn python(crab_home: &Path) -> PathBuf {
    let venv = crab_home.join("venv-metrics");
    let python = venv.join("bin/python3");
    let has_parser = |p: &Path| {
        Command::new(p)
            .args(["-c", "import prometheus_client.openmetrics.parser"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if python.exists() && has_parser(&python) {
        return python;
    }
    let ok = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "python3 -m venv {} failed", venv.display());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "prometheus-client>=0.20,<1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success() && has_parser(&python),
        "cannot install prometheus-client into {}: {}",
        venv.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    python
}

/// The samples of `text` as the reference parser reads them: `name{k=v,...}` (labels
/// sorted) -> value; panics with the parser's error if it refuses the text.
fn parse(python: &Path, format: &str, text: &str) -> HashMap<String, f64> {
    let mut child = Command::new(python)
        .args(["-c", PARSE, format])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the {format} parser refuses crabctl's output: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    samples
        .iter()
        .map(|s| {
            let mut labels: Vec<String> = s[3]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap()))
                .collect();
            labels.sort();
            (
                format!("{}{{{}}}", s[2].as_str().unwrap(), labels.join(",")),
                s[4].as_f64().unwrap(),
            )
        })
        .collect()
}

fn get(v: &HashMap<String, f64>, key: &str) -> f64 {
    *v.get(key)
        .unwrap_or_else(|| panic!("no sample {key}; have {:#?}", v.keys()))
}

/// What the store says happened, counted here from the JSON files themselves.
struct Expected {
    answers: HashMap<String, f64>,
    skipped: f64,
    checkpoints: HashMap<(String, String), f64>,
    layer_bytes: f64,
    process_bytes: f64,
    origins: HashMap<String, f64>,
}

fn expected(store: &Path) -> Expected {
    let mut e = Expected {
        answers: HashMap::new(),
        skipped: 0.0,
        checkpoints: HashMap::new(),
        layer_bytes: 0.0,
        process_bytes: 0.0,
        origins: HashMap::new(),
    };
    for a in json_files(&store.join("turns")) {
        let kind = a["kind"].as_str().unwrap().to_string();
        if kind == "none" && !a["turn_id"].as_str().unwrap().ends_with("+exec-end") {
            e.skipped += 1.0;
        }
        *e.answers.entry(kind).or_default() += 1.0;
    }
    for m in json_files(&store.join("checkpoints")) {
        let kind = m["kind"].as_str().unwrap().to_string();
        match kind.as_str() {
            "created" | "restored" => *e.origins.entry(kind).or_default() += 1.0,
            "failed" => {
                let attempted = m["attempted"].as_str().unwrap_or("unknown").to_string();
                *e.checkpoints
                    .entry((attempted, "failed".into()))
                    .or_default() += 1.0;
            }
            _ => {
                let outcome = match m["degraded"].as_bool() == Some(true) {
                    true => "degraded",
                    false => "ok",
                };
                if kind != "proc" {
                    let last = m["fs_layers"].as_array().unwrap().last().unwrap();
                    e.layer_bytes += last["size"].as_f64().unwrap();
                }
                if kind != "fs" {
                    e.process_bytes += m["process"]["bytes_stored"].as_f64().unwrap();
                }
                *e.checkpoints
                    .entry((kind, outcome.to_string()))
                    .or_default() += 1.0;
            }
        }
    }
    e
}

fn check(v: &HashMap<String, f64>, e: &Expected) {
    for d in ["none", "fs", "proc", "full"] {
        let want = e.answers.get(d).copied().unwrap_or(0.0);
        assert_eq!(
            get(v, &format!("crab_turn_answers_total{{decision={d}}}")),
            want,
            "answers {d}"
        );
    }
    assert_eq!(get(v, "crab_turns_skipped_total{}"), e.skipped);
    for kind in ["fs", "proc", "full", "unknown"] {
        for outcome in ["ok", "degraded", "failed"] {
            let want = e
                .checkpoints
                .get(&(kind.to_string(), outcome.to_string()))
                .copied()
                .unwrap_or(0.0);
            assert_eq!(
                get(
                    v,
                    &format!("crab_checkpoints_total{{kind={kind},outcome={outcome}}}")
                ),
                want,
                "checkpoints {kind} {outcome}"
            );
        }
    }
    assert_eq!(
        get(v, "crab_checkpoint_written_bytes_total{part=layer}"),
        e.layer_bytes
    );
    assert_eq!(
        get(v, "crab_checkpoint_written_bytes_total{part=process}"),
        e.process_bytes
    );
    for (origin, kind) in [("image", "created"), ("checkpoint", "restored")] {
        assert_eq!(
            get(
                v,
                &format!("crab_sandboxes_started_total{{origin={origin}}}")
            ),
            e.origins.get(kind).copied().unwrap_or(0.0),
            "origin {origin}"
        );
    }
    let answers: f64 = e.answers.values().sum();
    assert_eq!(get(v, "crab_turn_decision_seconds_count{}"), answers);
    assert_eq!(
        get(v, "crab_turn_decision_seconds_bucket{le=+Inf}"),
        answers
    );
    let published: f64 = e
        .checkpoints
        .iter()
        .filter(|((_, o), _)| o != "failed")
        .map(|(_, n)| n)
        .sum();
    let durations: f64 = ["fs", "proc", "full"]
        .iter()
        .map(|k| {
            get(
                v,
                &format!("crab_checkpoint_duration_seconds_count{{kind={k}}}"),
            )
        })
        .sum();
    assert_eq!(durations, published);
    assert_eq!(get(v, "crab_metrics_unreadable_files{}"), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_what_really_happened() {
    let crab_home = crab_integration::env::TestEnv::from_env().crab_home;
    let python = python(&crab_home);
    let work = tempfile::tempdir_in(&crab_home).unwrap();
    let engine = work.path().join("engine");
    let extra = format!("engine.root = \"{}\"", engine.display());
    let (mut s, _g) = Sandbox::start(
        "metrics",
        SandboxOptions {
            config: &extra,
            ..SandboxOptions::default()
        },
    )
    .await;
    // The sandbox's own state_dir and engine: the figures are this test's alone.
    let config = work.path().join("crab.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nstate_dir = \"{}\"\n[engine]\nroot = \"{}\"\n",
            s.state_dir.display(),
            engine.display()
        ),
    )
    .unwrap();
    let metrics = |s: &Sandbox, format: &str| -> String {
        let (code, out, err) = s.crabctl(&[
            "--config",
            config.to_str().unwrap(),
            "metrics",
            "--format",
            format,
        ]);
        assert_eq!(code, 0, "crabctl metrics: {err}");
        out
    };

    // Turns: a file (fs), a process (proc), nothing (none).
    s.run("echo a > /app/metrics-a.txt").await;
    assert_eq!(s.end_turn().await["kind"], "fs");
    s.sync().await;
    s.run("nohup sleep 3000 >/dev/null 2>&1 & sleep 0.2").await;
    assert_eq!(s.end_turn().await["kind"], "proc");
    s.sync().await;
    s.run("true").await;
    assert_eq!(s.end_turn().await["kind"], "none");
    s.sync().await;
    s.wait_manifests(2).await;

    let text = metrics(&s, "openmetrics");
    assert!(text.ends_with("# EOF\n"), "{text}");
    let v = parse(&python, "openmetrics", &text);
    let e = expected(&s.store());
    assert_eq!(e.answers.get("fs"), Some(&1.0));
    assert_eq!(e.answers.get("proc"), Some(&1.0));
    assert_eq!(e.skipped, 1.0);
    assert_eq!(
        e.checkpoints.get(&("fs".into(), "ok".into())),
        Some(&1.0),
        "{:?}",
        e.checkpoints
    );
    assert_eq!(e.checkpoints.get(&("proc".into(), "ok".into())), Some(&1.0));
    assert!(e.layer_bytes > 0.0 && e.process_bytes > 0.0);
    check(&v, &e);
    // The engine ran both jobs; nothing waits now.
    assert_eq!(get(&v, "crab_engine_jobs_total{}"), 2.0);
    assert_eq!(get(&v, "crab_engine_wait_seconds_count{}"), 2.0);
    assert_eq!(get(&v, "crab_engine_queue_depth{}"), 0.0);
    assert_eq!(get(&v, "crab_metrics_stores{}"), 1.0);
    assert!(
        !v.keys().any(|k| k.contains("container=")),
        "no container label without --per-container"
    );
    // The 0.0.4 text format carries the same samples.
    let v04 = parse(&python, "prometheus", &metrics(&s, "prometheus"));
    for key in [
        "crab_turn_answers_total{decision=fs}",
        "crab_checkpoints_total{kind=proc,outcome=ok}",
        "crab_turn_decision_seconds_count{}",
    ] {
        assert_eq!(get(&v04, key), get(&v, key), "{key}");
    }

    // A rollback is a restore; the turns after it are numbered after the ones before (the new
    // shim does not overwrite them), so nothing counted goes away.
    let (code, out, err) = s.crabctl(&["rollback", &s.id, "--to", "t1"]);
    assert_eq!(code, 0, "rollback: {out}{err}");
    let answers_before = json_files(&s.store().join("turns")).len();
    s.run("echo b > /app/metrics-b.txt").await;
    let after = s.end_turn().await;
    assert_eq!(after["kind"], "fs");
    assert_eq!(
        json_files(&s.store().join("turns")).len(),
        answers_before + 1,
        "the answer after the rollback overwrote one: {after:#}"
    );
    s.sync().await;
    s.wait_manifests(3).await;
    let v = parse(&python, "openmetrics", &metrics(&s, "openmetrics"));
    let e = expected(&s.store());
    assert_eq!(e.origins.get("restored"), Some(&1.0));
    assert_eq!(e.answers.get("fs"), Some(&2.0));
    check(&v, &e);
    assert_eq!(get(&v, "crab_restores_total{outcome=ok}"), 1.0);
    assert_eq!(get(&v, "crab_restores_total{outcome=failed}"), 0.0);

    // --listen: the same figures over HTTP, in the format the scraper asks for.
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
    let mut server = Command::new(&bin)
        .args(["--config", config.to_str().unwrap(), "metrics"])
        .args(["--listen", "127.0.0.1:0", "--per-container"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = server.stderr.take().unwrap();
    let mut said = Vec::new();
    let mut byte = [0u8; 1];
    while !said.ends_with(b"\n") && stderr.read(&mut byte).unwrap_or(0) == 1 {
        said.push(byte[0]);
    }
    let said = String::from_utf8_lossy(&said).into_owned();
    let addr = said
        .split("http://")
        .nth(1)
        .and_then(|r| r.strip_suffix("/metrics\n"))
        .unwrap_or_else(|| panic!("no address in {said:?}"))
        .to_string();
    let request = |path: &str, accept: &str| -> String {
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        write!(conn, "GET {path} HTTP/1.1\r\nHost: x\r\n{accept}\r\n").unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).unwrap();
        response
    };
    let om = request(
        "/metrics",
        "Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n",
    );
    let (head, body) = om.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");
    let served = parse(&python, "openmetrics", body);
    check(&served, &e);
    // Labels sorted by name: container, decision, namespace.
    let mine = format!(
        "crab_turn_answers_total{{container={},decision=fs,namespace={}}}",
        s.id, s.h.env.namespace
    );
    assert_eq!(get(&served, &mine), 2.0);
    let plain = request("/metrics", "");
    let (head, body) = plain.split_once("\r\n\r\n").unwrap();
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert_eq!(
        get(
            &parse(&python, "prometheus", body),
            "crab_turns_skipped_total{}"
        ),
        e.skipped
    );
    assert!(request("/other", "").starts_with("HTTP/1.1 404"));
    server.kill().unwrap();
    server.wait().unwrap();

    // Not on the network unless asked.
    let (code, _, err) = s.crabctl(&[
        "--config",
        config.to_str().unwrap(),
        "metrics",
        "--listen",
        "0.0.0.0:0",
    ]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("--listen-any"), "{err}");
    s.finish().await;
}
