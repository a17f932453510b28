//! crabctl's command line against the real containerd and shim: the exit statuses its help
//! documents (0 success, 2 usage error, 3 not found, 4 refused, whether crabctl or the shim
//! behind containerd refuses), and the shell completions generated from its argument parser.

use std::{path::Path, time::Duration};

use crab_integration::sandbox::{Sandbox, SandboxOptions};

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
