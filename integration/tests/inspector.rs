//! The inspector's answers for real agent turns, through containerd and the crab shim: each
//! turn runs as an exec (`bash -c` in /app, as agents do), then a `Tasks.Update` with the
//! turn-end annotation asks the shim what the turn left behind; the stored answer is checked
//! against the kind it must have. Zero false negatives is the bar; where an answer is a
//! deliberate false positive the test says why.

use std::{collections::HashMap, path::Path};

use crab_integration::sandbox::{Sandbox, SandboxOptions, TURN_END};
use serde_json::Value;

/// Runs `script` as one turn and checks the kind of its answer (never degraded).
async fn turn(s: &mut Sandbox, script: &str, kind: &str) -> Value {
    s.run(script).await;
    let answer = s.end_turn().await;
    assert_eq!(
        answer["kind"],
        kind,
        "turn {} `{script}`: expected {kind}, answer:\n{}",
        s.turn,
        serde_json::to_string_pretty(&answer).unwrap()
    );
    assert!(
        answer["degraded"].as_array().unwrap().is_empty(),
        "degraded answer: {answer:#}"
    );
    answer
}

/// A turn without mutating syscalls skips the upperdir comparison. Once a shared writable
/// file mapping was made in the sandbox (seen under load from the agent image's tools; the BPF
/// counter says so), stores need no syscall and every later turn compares: the only exception.
fn assert_unscanned(s: &Sandbox, a: &Value) {
    let turns = s.store().join("turns");
    let mapped = std::fs::read_dir(&turns).unwrap().any(|e| {
        let path = e.unwrap().path();
        let answer: Value =
            serde_json::from_slice(&std::fs::read(path).unwrap_or_default()).unwrap_or_default();
        answer["fs"]["syscalls"].get("mmap-shared-write").is_some()
    });
    assert!(
        a["fs"]["scanned"] == false || mapped,
        "no mutating syscall, yet the upperdir was compared: {a:#}"
    );
}

fn paths(answer: &Value, field: &str) -> Vec<String> {
    answer["fs"][field]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

fn has(answer: &Value, field: &str, path: &str) -> bool {
    paths(answer, field).iter().any(|p| p == path)
}

#[tokio::test(flavor = "multi_thread")]
async fn filesystem_turns() {
    let (mut s, _g) = Sandbox::start("inspect_fs", SandboxOptions::default()).await;

    // Setup: a repository and files to work on (python's bytecode caches get written too).
    turn(
        &mut s,
        "git init -q repo && cd repo && printf 'a\\nb\\n' > f.txt && git add f.txt && \
         git -c user.email=x@y -c user.name=x commit -qm init && git status >/dev/null && \
         python3 -c 'import json, http.server; print(1)' >/dev/null",
        "fs",
    )
    .await;

    // Read-only turns leave nothing. (Plain `git status` may rewrite .git/index to refresh
    // its stat cache, a real change crab reports; `--no-optional-locks` is the read-only form.)
    let a = turn(
        &mut s,
        "cat repo/f.txt; grep -r b repo/f.txt; ls -la / /app; find /etc -name '*.conf' | head; \
             cd repo && git --no-optional-locks status && git log --oneline; \
             python3 -c 'import json; print(json.dumps([1]))'",
        "none",
    )
    .await;
    assert_unscanned(&s, &a);

    // A temp file created and removed: mutating syscalls, no net change.
    let a = turn(
        &mut s,
        "echo tmp > /tmp/scratch.txt; cat /tmp/scratch.txt; rm /tmp/scratch.txt",
        "none",
    )
    .await;
    assert_eq!(a["fs"]["scanned"], true, "{a:#}");

    // Printing to stdout/stderr is not a filesystem mutation.
    let a = turn(
        &mut s,
        "for i in $(seq 100); do echo line $i; echo err $i >&2; done",
        "none",
    )
    .await;
    assert_unscanned(&s, &a);

    let a = turn(&mut s, "sed -i 's/a/A/' repo/f.txt", "fs").await;
    assert!(
        has(&a, "modified", "/app/repo/f.txt") || has(&a, "added", "/app/repo/f.txt"),
        "{a:#}"
    );

    let a = turn(&mut s, "echo appended >> repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = turn(&mut s, "mkdir -p deep/er/est", "fs").await;
    assert!(has(&a, "added", "/app/deep/er/est"), "{a:#}");

    // Removing a file of the image leaves a whiteout.
    let a = turn(&mut s, "rm /etc/debian_version", "fs").await;
    assert!(has(&a, "deleted", "/etc/debian_version"), "{a:#}");

    let a = turn(&mut s, "chmod 600 repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = turn(&mut s, "touch repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = turn(&mut s, "chown nobody repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = turn(&mut s, "truncate -s 1 repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = turn(
        &mut s,
        "ln repo/f.txt hard.txt && ln -s repo/f.txt soft.txt",
        "fs",
    )
    .await;
    assert!(
        has(&a, "added", "/app/hard.txt") && has(&a, "added", "/app/soft.txt"),
        "{a:#}"
    );

    // A file made in an earlier turn and removed now.
    let a = turn(&mut s, "rm soft.txt", "fs").await;
    assert!(has(&a, "deleted", "/app/soft.txt"), "{a:#}");

    // pip installs a local wheel into site-packages (built by hand: no index, no network).
    turn(
        &mut s,
        r#"python3 - <<'EOF'
import zipfile
with zipfile.ZipFile('/tmp/crabdemo-0.1-py3-none-any.whl', 'w') as z:
    z.writestr('crabdemo/__init__.py', 'VALUE = 42\n')
    z.writestr('crabdemo-0.1.dist-info/METADATA', 'Metadata-Version: 2.1\nName: crabdemo\nVersion: 0.1\n')
    z.writestr('crabdemo-0.1.dist-info/WHEEL', 'Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n')
    z.writestr('crabdemo-0.1.dist-info/RECORD', '')
EOF"#,
        "fs",
    )
    .await;
    let a = turn(
        &mut s,
        "pip install -q --no-index --break-system-packages /tmp/crabdemo-0.1-py3-none-any.whl && \
             python3 -c 'import crabdemo; assert crabdemo.VALUE == 42'",
        "fs",
    )
    .await;
    assert!(
        paths(&a, "added")
            .iter()
            .any(|p| p.contains("site-packages/crabdemo") || p.contains("dist-packages/crabdemo")),
        "{a:#}"
    );

    // Nothing since the last turn.
    turn(&mut s, "true", "none").await;
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn process_turns() {
    let (mut s, _g) = Sandbox::start("inspect_proc", SandboxOptions::default()).await;

    // A background process that exits before the turn ends leaves nothing.
    turn(&mut s, "(sleep 0.2 &); sleep 0.6", "none").await;

    // A long-lived interpreter fed through a FIFO: its setup is a process (and a FIFO file).
    let a = turn(
        &mut s,
        "mkfifo /tmp/repl; nohup python3 -u -c '
import sys
state = {}
while True:
    with open(\"/tmp/repl\") as f:
        for line in f:
            exec(line, state)
' >/dev/null 2>&1 &
sleep 0.5",
        "full",
    )
    .await;
    let started = a["procs"]["started"].as_array().unwrap();
    assert!(
        started
            .iter()
            .any(|p| p["cmdline"].as_str().unwrap().contains("python3")),
        "{a:#}"
    );

    // It receives input and changes its memory: a process turn without file changes.
    let a = turn(
        &mut s,
        "echo 'x = bytearray(1 << 20); x[5] = 1' > /tmp/repl; sleep 0.3",
        "proc",
    )
    .await;
    let mem = a["procs"]["memory"].as_array().unwrap();
    assert!(
        mem.iter()
            .any(|m| m["changed_pages"].as_u64().unwrap() + m["added_pages"].as_u64().unwrap() > 0),
        "{a:#}"
    );

    // It receives nothing: it did not run, so nothing changed (exactly, without reading it).
    let a = turn(&mut s, "ls /tmp >/dev/null", "none").await;
    assert!(
        !a["procs"]["idle"].as_array().unwrap().is_empty(),
        "the interpreter was idle: {a:#}"
    );

    // A server left running is a process change...
    let a = turn(
        &mut s,
        "nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1",
        "proc",
    )
    .await;
    assert!(
        a["procs"]["started"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["cmdline"].as_str().unwrap().contains("http.server")),
        "{a:#}"
    );
    // ... and, while it lives, its selector loop rewrites its memory every 0.5 s: every turn
    // is a process turn by exact comparison (DESIGN.md: measured, not guessed).
    let a = turn(&mut s, "sleep 1.2; curl -s 127.0.0.1:8000 >/dev/null || python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000\").read()'", "proc").await;
    assert!(
        a["procs"]["started"].as_array().unwrap().is_empty(),
        "{a:#}"
    );

    // Stopping it is a process change too.
    let a = turn(&mut s, "pkill -f 'm http[.]server'; sleep 0.3", "proc").await;
    assert!(
        a["procs"]["ended"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["cmdline"].as_str().unwrap().contains("http.server")),
        "{a:#}"
    );

    // A daemon that double-forks and calls setsid stays: a process change.
    let a = turn(
        &mut s,
        "setsid sh -c 'sleep 1000 >/dev/null 2>&1 & exit 0'; sleep 0.3",
        "proc",
    )
    .await;
    assert!(
        a["procs"]["started"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["cmdline"].as_str().unwrap().contains("sleep 1000")),
        "{a:#}"
    );

    // Deleting a file a persisting process holds open: the process image must be retaken.
    turn(&mut s, "sleep 0.1", "none").await;
    let a = turn(&mut s, "echo log > /tmp/held.log; (exec 3</tmp/held.log; exec sleep 2000) >/dev/null 2>&1 & sleep 0.3", "full")
        .await;
    assert!(
        !a["procs"]["started"].as_array().unwrap().is_empty(),
        "{a:#}"
    );
    let a = turn(&mut s, "rm /tmp/held.log", "full").await;
    assert!(
        !a["procs"]["held_changed"].as_array().unwrap().is_empty(),
        "{a:#}"
    );

    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_turn_annotations_change_nothing() {
    let (mut s, _g) = Sandbox::start("inspect_bad", SandboxOptions::default()).await;
    s.run("echo x > /app/x").await;
    for (key, value) in [
        (TURN_END, ""),
        (TURN_END, "a\nb"),
        ("io.crab/turn-ned", "1"),
    ] {
        let err =
            s.h.update(
                &s.id,
                None,
                HashMap::from([(key.to_string(), value.to_string())]),
            )
            .await
            .expect_err("malformed annotation accepted");
        assert!(err.to_string().contains("io.crab/"), "{err}");
    }
    let turns = s.store().join("turns");
    assert!(
        !Path::new(&turns).exists(),
        "a malformed annotation stored an answer"
    );
    // The next well-formed turn end still sees the change made before.
    let a = s.end_turn().await;
    assert_eq!(a["kind"], "fs", "{a:#}");
    assert_eq!(a["seq"], 1, "{a:#}");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tracked_volume_turns() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "v1\n").unwrap();
    let (mut s, _g) = Sandbox::start(
        "inspect_vol",
        SandboxOptions {
            volume: Some((dir.path(), "/workspace")),
            ..Default::default()
        },
    )
    .await;
    turn(&mut s, "cat /workspace/notes.txt", "none").await;
    let a = turn(&mut s, "echo v2 >> /workspace/notes.txt", "fs").await;
    assert!(has(&a, "modified", "/workspace/notes.txt"), "{a:#}");
    let a = turn(
        &mut s,
        "mkdir /workspace/out && echo r > /workspace/out/result",
        "fs",
    )
    .await;
    assert!(has(&a, "added", "/workspace/out/result"), "{a:#}");
    let a = turn(&mut s, "rm /workspace/notes.txt", "fs").await;
    assert!(has(&a, "deleted", "/workspace/notes.txt"), "{a:#}");
    turn(&mut s, "echo t > /workspace/tmp; rm /workspace/tmp", "none").await;
    s.finish().await;
}

/// crabctl ends a turn and explains it, the way a harness or a person would use it.
#[tokio::test(flavor = "multi_thread")]
async fn crabctl_turn_end_and_explain() {
    let (mut s, _g) = Sandbox::start("inspect_ctl", SandboxOptions::default()).await;
    s.run("echo hello > /app/greeting").await;
    let config = s.state_dir.with_extension("toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(
        &config,
        format!("[store]\nstate_dir = \"{}\"\n", s.state_dir.display()),
    )
    .unwrap();
    let crabctl = |args: &[&str]| {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let out = std::process::Command::new(&bin)
            .arg("--address")
            .arg(&s.h.env.address)
            .args(["--namespace", &s.h.env.namespace, "--config"])
            .arg(&config)
            .args(args)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "run {}: {e} (build it with `cargo build --release`)",
                    bin.display()
                )
            });
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = crabctl(&["turn-end", &s.id, "--turn", "greet"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, err) = crabctl(&["turns", &s.id]);
    assert_eq!(code, Some(0), "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.contains("greet"))
        .unwrap_or_else(|| panic!("no turn line in:\n{out}"));
    assert!(line.contains(" fs ") && line.contains("fs +1"), "{line}");
    let (code, out, err) = crabctl(&["show", &s.id, "greet"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert!(has(&answer, "added", "/app/greeting"), "{answer:#}");
    // Errors are clear and exit non-zero.
    // Not found (3), as documented in `crabctl --help`.
    let (code, _, err) = crabctl(&["show", &s.id, "nope"]);
    assert_eq!(code, Some(3));
    assert!(err.contains("has no turn nope"), "{err}");
    let (code, _, err) = crabctl(&["turn-end", "no-such-container"]);
    assert_eq!(code, Some(3));
    assert!(err.contains("no-such-container"), "{err}");
    let (code, _, err) = crabctl(&["frobnicate"]);
    assert_eq!(code, Some(2), "{err}");
    let _ = std::fs::remove_file(&config);
    s.finish().await;
}
