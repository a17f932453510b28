//! crabctl's command line against the real containerd and shim: the exit statuses its help
//! documents (0 success, 2 usage error, 3 not found, 4 refused, whether crabctl or the shim
//! behind containerd refuses), the shell completions generated from its argument parser, the
//! JSON documents of `-o json` for a real sandbox's turns and checkpoints, `crabctl diff`
//! between real turns, and fork's JSON report and progress.

use std::{path::Path, time::Duration};

use crab_integration::sandbox::{Sandbox, SandboxOptions};
use serde_json::Value;

const USAGE: i32 = 2;
const NOT_FOUND: i32 = 3;
const REFUSED: i32 = 4;

/// crabctl without a containerd: (exit code, stdout, stderr).
fn crabctl_alone(args: &[&str]) -> (i32, String, String) {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
    let out = std::process::Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

/// crabctl must exit with `status`, saying `needle` on stderr.
fn expect(s: &Sandbox, args: &[&str], status: i32, needle: &str) {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(
        code, status,
        "crabctl {args:?}: status {status} expected\nstdout: {out}\nstderr: {err}"
    );
    assert!(
        err.contains(needle),
        "crabctl {args:?}: the error does not say {needle:?}: {err}"
    );
}

#[test]
fn completions_and_help_come_from_the_parser() {
    let (code, out, err) = crabctl_alone(&["completions", "bash"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("complete -F") && out.contains("crabctl"),
        "not a bash completion script: {out}"
    );
    for word in ["turn-end", "checkpoints", "rollback", "--pod-namespace"] {
        assert!(out.contains(word), "{word} is not completed");
    }
    let (code, out, err) = crabctl_alone(&["completions", "zsh"]);
    assert!(code == 0 && out.contains("#compdef crabctl"), "{out}{err}");

    let (code, out, _) = crabctl_alone(&["--help"]);
    assert_eq!(code, 0);
    for line in ["3  not found", "4  refused", "2  usage error"] {
        assert!(
            out.contains(line),
            "--help does not document {line:?}: {out}"
        );
    }
    let (code, _, err) = crabctl_alone(&["completions", "no-such-shell"]);
    assert_eq!(code, USAGE, "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn exit_statuses_tell_not_found_from_refused_from_success() {
    let (mut s, _g) = Sandbox::start("ctl_cli", SandboxOptions::default()).await;
    let (uninspected, _g2) = Sandbox::start(
        "ctl_cli_off",
        SandboxOptions {
            config: "checkpoint.enabled = false",
            ..SandboxOptions::default()
        },
    )
    .await;

    // Success.
    s.run("echo x > /app/x").await;
    let (code, out, err) = s.crabctl(&["turn-end", &s.id, "--turn", "t1"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("turn t1 of {} ended", s.id)), "{out}");
    let mut waited = 0;
    while !s.manifests().iter().any(|m| m["turn_id"] == "t1") {
        assert!(waited < 1200, "no checkpoint of t1: {:#?}", s.lineage());
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
    }
    let (code, out, err) = s.crabctl(&["checkpoints", &s.id]);
    assert!(code == 0 && out.contains(" t1 "), "{code}: {out}{err}");

    // Not found: the container (crabctl's own lookup, and containerd's answer to Tasks.Update),
    // the checkpoint, the turn.
    let unknown = format!("{}-nosuch", s.id);
    let reference = format!("localhost/crab-test/{}:cli", s.id);
    expect(&s, &["turn-end", &unknown], NOT_FOUND, &unknown);
    expect(
        &s,
        &["export", &unknown, &reference],
        NOT_FOUND,
        &format!("no container {unknown}"),
    );
    expect(
        &s,
        &["rollback", &s.id, "--to", "t999"],
        NOT_FOUND,
        "has no checkpoint t999",
    );
    expect(&s, &["show", &s.id, "nope"], NOT_FOUND, "has no turn nope");

    // Refused by the shim through containerd: a container it does not inspect.
    expect(
        &uninspected,
        &["turn-end", &uninspected.id, "--turn", "t1"],
        REFUSED,
        "is not inspected",
    );
    // Refused by crabctl: a failed checkpoint is no recovery point.
    let last = s.manifests().last().cloned().unwrap();
    let seq = last["seq"].as_u64().unwrap() + 1;
    let mut failed = last.clone();
    failed["seq"] = seq.into();
    failed["parent"] = last["seq"].clone();
    failed["kind"] = "failed".into();
    failed["turn_id"] = "tfailed".into();
    failed["explanation"] = "injected by the test: a failed checkpoint".into();
    std::fs::write(
        s.store().join(format!("checkpoints/{seq:06}.json")),
        serde_json::to_vec(&failed).unwrap(),
    )
    .unwrap();
    expect(
        &s,
        &["export", &s.id, "--turn", "tfailed", &reference],
        REFUSED,
        "failed: it is not a recovery point",
    );

    // A usage error.
    let (code, _, err) = s.crabctl(&["fork", &s.id, "--at", "t1", "--count", "0"]);
    assert_eq!(code, USAGE, "{err}");

    // Nothing was created on the way, and the sandbox still runs.
    let (code, out, err) = s.crabctl(&["checkpoints", &s.id]);
    assert!(code == 0 && out.contains(" tfailed "), "{code}: {out}{err}");
    let images = s.h.ctr().run(&["images", "ls", "-q"]).unwrap().stdout;
    assert!(
        !images.lines().any(|l| l == reference),
        "an image {reference} was left behind: {images}"
    );
    s.run("test -f /app/x").await;
    uninspected.finish().await;
    s.finish().await;
}

/// crabctl with `args` must succeed and print one JSON document.
fn json_ok(s: &Sandbox, args: &[&str]) -> Value {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(code, 0, "crabctl {args:?}:\nstdout: {out}\nstderr: {err}");
    assert!(
        out.ends_with('\n'),
        "crabctl {args:?}: not newline-terminated: {out:?}"
    );
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("crabctl {args:?}: not one JSON document ({e}): {out}"))
}

/// crabctl with `args` (and `-o json`) must fail with `status`, printing the JSON error
/// object on stdout and the message (saying `needle`) on stderr.
fn json_err(s: &Sandbox, args: &[&str], status: i32, kind: &str, needle: &str) {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(
        code, status,
        "crabctl {args:?}:\nstdout: {out}\nstderr: {err}"
    );
    let v: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("crabctl {args:?}: no JSON error on stdout ({e}): {out}"));
    assert_eq!(v["error"]["kind"], kind, "{v}");
    assert_eq!(v["error"]["exit_code"], status, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{needle:?} not in {message}");
    assert!(err.contains(message), "stderr says the same: {err}");
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn json_documents_and_diff_describe_real_turns() {
    let (mut s, _g) = Sandbox::start("ctl_json", SandboxOptions::default()).await;
    // t1 writes two files; t2 writes another, edits one, deletes one and leaves a server.
    s.run("echo one > /app/one; echo doomed > /app/doomed")
        .await;
    s.end_turn().await;
    s.run(
        "echo two > /app/two; echo more >> /app/one; rm /app/doomed; \
         nohup sleep 3000 >/dev/null 2>&1 & sleep 0.2",
    )
    .await;
    s.end_turn().await;
    s.wait_manifests(2).await;
    s.sync().await;
    let id = s.id.clone();

    // turns: the answers whole, oldest first; show: one of them, the same.
    let turns = json_ok(&s, &["turns", &id, "-o", "json"]);
    let turns = turns.as_array().unwrap();
    let ids: Vec<&str> = turns
        .iter()
        .map(|t| t["turn_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["t1", "t2"], "{turns:#?}");
    assert_eq!(turns[0]["kind"], "fs", "{:#}", turns[0]);
    assert!(
        strings(&turns[0]["fs"]["added"]).contains(&"/app/one"),
        "{:#}",
        turns[0]
    );
    assert_eq!(turns[1]["kind"], "full", "{:#}", turns[1]);
    let started = turns[1]["procs"]["started"].as_array().unwrap();
    assert!(
        started.iter().any(|p| p["cmdline"] == "sleep 3000"),
        "{:#}",
        turns[1]
    );
    for t in turns {
        assert_eq!(t["container_id"], id.as_str());
    }
    let t2 = json_ok(&s, &["show", &id, "t2", "--json"]);
    assert_eq!(&t2, &turns[1]);

    // checkpoints: the origin, then t1's (files) and t2's (files and processes).
    let rows = json_ok(&s, &["checkpoints", &id, "-o", "json"]);
    let rows = rows.as_array().unwrap();
    let kinds: Vec<&str> = rows.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["created", "fs", "full"], "{rows:#?}");
    let (origin, c1, c2) = (&rows[0], &rows[1], &rows[2]);
    assert_eq!(
        (&c1["turn_id"], &c2["turn_id"]),
        (&"t1".into(), &"t2".into())
    );
    assert_eq!(c2["parent"], c1["seq"]);
    assert!(
        rows.iter().all(|r| r["recovery_point"] == true),
        "{rows:#?}"
    );
    assert!(c1["layers"].as_u64().unwrap() >= 1 && c1["layer_bytes"].as_u64().unwrap() > 0);
    assert_eq!(c1["process_bytes"], Value::Null);
    assert!(c2["process_bytes"].as_u64().unwrap() > 0, "{c2:#}");
    assert!(!c2["pids"].as_array().unwrap().is_empty(), "{c2:#}");
    assert_eq!(
        rows.len(),
        s.lineage().len(),
        "one row per manifest in the store"
    );

    // diff t1 t2: t2's own changes, the server it left running, its checkpoint.
    let d = json_ok(&s, &["diff", &id, "t1", "t2", "-o", "json"]);
    assert_eq!(strings(&d["turns"]), ["t2"], "{d:#}");
    assert!(
        strings(&d["files"]["created"]).contains(&"/app/two"),
        "{d:#}"
    );
    assert!(
        strings(&d["files"]["modified"]).contains(&"/app/one"),
        "{d:#}"
    );
    assert!(
        strings(&d["files"]["deleted"]).contains(&"/app/doomed"),
        "{d:#}"
    );
    let running = d["processes"]["started"].as_array().unwrap();
    assert!(
        running.iter().any(|p| p["cmdline"] == "sleep 3000"),
        "the process t2 left running: {d:#}"
    );
    assert!(
        !d["processes"]["alive"].as_array().unwrap().is_empty(),
        "the init runs throughout: {d:#}"
    );
    let steps = d["checkpoints"].as_array().unwrap();
    assert_eq!(steps.len(), 1, "{d:#}");
    assert_eq!(
        (&steps[0]["seq"], &steps[0]["kind"]),
        (&c2["seq"], &"full".into())
    );
    assert_eq!(d["complete"], true, "{d:#}");
    assert_eq!(d["from"]["turn_id"], "t1");
    assert_eq!(d["to"]["turn_id"], "t2");

    // From the origin (by its number) to the newest turn (B's default): composed, so the file
    // created and deleted again in between is nowhere.
    let origin_seq = origin["seq"].to_string();
    let d = json_ok(&s, &["diff", &id, &origin_seq, "--json"]);
    assert_eq!(strings(&d["turns"]), ["t1", "t2"], "{d:#}");
    let created = strings(&d["files"]["created"]);
    assert!(
        created.contains(&"/app/one") && created.contains(&"/app/two"),
        "{d:#}"
    );
    for list in ["created", "modified", "deleted"] {
        assert!(
            !strings(&d["files"][list]).contains(&"/app/doomed"),
            "{d:#}"
        );
    }
    assert_eq!(d["checkpoints"].as_array().unwrap().len(), 2, "{d:#}");
    assert_eq!(d["from"]["checkpoint"], origin["seq"]);

    // The same for people: a git-diff-like summary.
    let (code, out, err) = s.crabctl(&["diff", &id, "t1"]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "+ /app/two",
        "~ /app/one",
        "- /app/doomed",
        "sleep 3000",
        "(running)",
    ] {
        assert!(out.contains(needle), "{needle:?} not in:\n{out}");
    }

    // Not found (3) lists what there is; a newer A than B is refused (4). With -o json the
    // error is the document on stdout.
    json_err(
        &s,
        &["diff", &id, "t9", "-o", "json"],
        NOT_FOUND,
        "not_found",
        "turns t1, t2",
    );
    json_err(
        &s,
        &["diff", &id, "t1", "99", "-o", "json"],
        NOT_FOUND,
        "not_found",
        "\"99\"",
    );
    json_err(
        &s,
        &["diff", &id, "t2", "t1", "--json"],
        REFUSED,
        "refused",
        "swap them",
    );
    json_err(
        &s,
        &["show", &id, "t9", "--json"],
        NOT_FOUND,
        "not_found",
        "has no turn t9",
    );
    let unknown = format!("{id}-nosuch");
    json_err(
        &s,
        &["checkpoints", &unknown, "-o", "json"],
        NOT_FOUND,
        "not_found",
        &unknown,
    );
    expect(&s, &["diff", &id, "t2", "t1"], REFUSED, "crabctl diff");

    // A corrupt answer in the store: every reader names it and exits 1, losing nothing.
    let planted = s.store().join("turns/000099.json");
    std::fs::write(&planted, "{\"turn_id\": \"t99\", \"seq\": \"many\"").unwrap();
    for args in [
        vec!["turns", &id],
        vec!["turns", &id, "-o", "json"],
        vec!["diff", &id, "t1"],
    ] {
        let (code, out, err) = s.crabctl(&args);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(err.contains("000099.json"), "{args:?}: {err}");
    }
    std::fs::remove_file(&planted).unwrap();
    let again = json_ok(&s, &["turns", &id, "--json"]);
    assert_eq!(again.as_array().unwrap(), turns);
    // A corrupt manifest likewise; with -o json the error is the document.
    let planted = s.store().join("checkpoints/000099.json");
    std::fs::write(
        &planted,
        "{\"format\": 1, \"seq\": 99, \"kind\": \"everything\"}",
    )
    .unwrap();
    json_err(
        &s,
        &["checkpoints", &id, "-o", "json"],
        1,
        "failed",
        "000099.json",
    );
    json_err(
        &s,
        &["diff", &id, "t1", "--json"],
        1,
        "failed",
        "000099.json",
    );
    std::fs::remove_file(&planted).unwrap();
    assert_eq!(
        json_ok(&s, &["checkpoints", &id, "--json"])
            .as_array()
            .unwrap(),
        rows
    );

    // fork -o json: the forks it started, and with --progress their count on stderr.
    let (code, out, err) = s.crabctl(&[
        "fork",
        &id,
        "--at",
        "t2",
        "--count",
        "2",
        "-o",
        "json",
        "--progress",
    ]);
    let mut guard = s.h.guard(&[]);
    let report: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("fork: no JSON ({e}), {code}: {out}{err}"));
    let forks: Vec<String> = report["forks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["id"].as_str().unwrap().to_string())
        .collect();
    for f in &forks {
        guard.add(f);
    }
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        forks,
        [format!("{id}-fork-1"), format!("{id}-fork-2")],
        "{report:#}"
    );
    assert!(report["forks"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["pid"].as_u64() > Some(0)));
    // Where each fork's time went: its steps add up to its own time, which ends before the
    // whole start did.
    for f in report["forks"].as_array().unwrap() {
        let t = |k: &str| {
            f[k].as_f64()
                .unwrap_or_else(|| panic!("fork without {k}: {report:#}"))
        };
        let steps = t("container_ms") + t("task_create_ms") + t("task_start_ms");
        assert!(t("task_start_ms") > 0.0, "{report:#}");
        assert!((steps - t("total_ms")).abs() < 1.0, "{report:#}");
        assert!(t("done_at_ms") >= t("total_ms") - 1.0, "{report:#}");
        assert!(
            t("done_at_ms") <= report["start_ms"].as_f64().unwrap() + 1.0,
            "{report:#}"
        );
    }
    let spread = &report["per_sandbox_ms"];
    assert!(
        spread["min"].as_f64() <= spread["p50"].as_f64()
            && spread["p50"].as_f64() <= spread["max"].as_f64()
            && spread["min"].as_f64() > Some(0.0),
        "{report:#}"
    );
    assert_eq!(report["seq"], c2["seq"], "{report:#}");
    assert_eq!(report["turn_id"], "t2");
    assert!(err.contains("2/2 forks started"), "{err}");
    assert!(err.contains("per sandbox"), "{err}");
    assert!(err.contains("layers"), "the export's progress: {err}");
    for f in &forks {
        s.h.kill_and_remove(f).await.unwrap();
        s.h.assert_no_leaks(f).await;
    }
    drop(guard);
    s.finish().await;
}
