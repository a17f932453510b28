//! The inspector's answers for real agent turns, through containerd and the crab shim: each
//! turn runs as an exec (`bash -c` in /app, as agents do), then a `Tasks.Update` with the
//! turn-end annotation asks the shim what the turn left behind; the stored answer is checked
//! against the kind it must have. Zero false negatives is the bar; where an answer is a
//! deliberate false positive the test says why.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use crab_integration::{
    api::crab_runtime_options, env::TestEnv, Harness, ProcessSpec, RunOutput, StdioOptions,
};
use serde_json::Value;

const AGENT_IMAGE: &str = "localhost/crab/agent:latest";
const TURN_END: &str = "io.crab/turn-end";
const T: Duration = Duration::from_secs(60);

struct Sandbox {
    h: Harness,
    id: String,
    state_dir: PathBuf,
    turn: u64,
}

impl Sandbox {
    async fn start(name: &str) -> (Sandbox, crab_integration::CleanupGuard) {
        Self::start_with_volume(name, None).await
    }

    /// Starts a sandbox; with `volume`, a host directory is bind-mounted at that container
    /// path and the config marks it as tracked.
    async fn start_with_volume(name: &str, volume: Option<(&Path, &str)>) -> (Sandbox, crab_integration::CleanupGuard) {
        let env = TestEnv { image: AGENT_IMAGE.into(), ..TestEnv::from_env() };
        if env.runtime != "io.containerd.crab.v1" {
            panic!("the inspector tests are crab's own: run them with CRAB_RUNTIME unset (got {})", env.runtime);
        }
        let h = Harness::connect_env(env).await.unwrap_or_else(|e| panic!("integration test setup failed: {e}"));
        let id = h.unique_id(name);
        let guard = h.guard(&[&id]);
        let state_dir = h.env.crab_home.join("state").join(&id);
        let mut config = format!("[store]\nstate_dir = \"{}\"\n", state_dir.display());
        let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
        let mut spec = crab_integration::spec::container_spec(&id, &h.env.namespace, process);
        if let Some((source, at)) = volume {
            config.push_str(&format!("[checkpoint]\ntracked_volumes = [\"{at}\"]\n"));
            spec["mounts"].as_array_mut().unwrap().push(serde_json::json!({
                "destination": at, "type": "bind", "source": source, "options": ["rbind", "rw"]
            }));
        }
        h.create_container_with_spec_and_options(&id, &spec, Some(crab_runtime_options(None, Some(&config))))
            .await
            .unwrap();
        h.create_task(&id, None).await.unwrap();
        h.start(&id, "").await.unwrap();
        (Sandbox { h, id, state_dir, turn: 0 }, guard)
    }

    /// Runs one agent command to completion, the way mini-swe-agent does.
    async fn run(&mut self, script: &str) -> RunOutput {
        self.turn += 1;
        let exec_id = format!("turn-{}", self.turn);
        let mut io = self.h.stdio(&self.id, &exec_id, StdioOptions::default()).unwrap();
        let spec = ProcessSpec::new(&["bash", "-c", script]).cwd("/app");
        self.h.exec(&self.id, &exec_id, &spec, &io).await.unwrap();
        self.h.start(&self.id, &exec_id).await.unwrap();
        let exit_status = self.h.wait(&self.id, &exec_id, T).await.unwrap();
        let stdout = io.stdout_string(T).unwrap_or_else(|e| panic!("turn {} `{script}`: {e}", self.turn));
        let stderr = io.stderr_string(T).unwrap_or_else(|e| panic!("turn {} `{script}`: {e}", self.turn));
        self.h.delete_process(&self.id, &exec_id).await.unwrap();
        assert_eq!(exit_status, 0, "turn {} `{script}` failed: {stdout}{stderr}", self.turn);
        RunOutput { exit_status, stdout, stderr }
    }

    /// Ends the turn and returns the inspector's stored answer.
    async fn end_turn(&self) -> Value {
        let annotations = HashMap::from([(TURN_END.to_string(), format!("t{}", self.turn))]);
        self.h.update(&self.id, None, annotations).await.unwrap();
        let dir = self.state_dir.join(&self.h.env.namespace).join(&self.id).join("turns");
        let mut answers: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("no answers in {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        answers.sort();
        let last = answers.last().expect("an answer was stored");
        serde_json::from_slice(&std::fs::read(last).unwrap()).unwrap()
    }

    /// Runs `script` as one turn and checks the kind of its answer.
    async fn turn(&mut self, script: &str, kind: &str) -> Value {
        self.run(script).await;
        let answer = self.end_turn().await;
        assert_eq!(
            answer["kind"], kind,
            "turn {} `{script}`: expected {kind}, answer:\n{}",
            self.turn,
            serde_json::to_string_pretty(&answer).unwrap()
        );
        assert!(answer["degraded"].as_array().unwrap().is_empty(), "degraded answer: {answer:#}");
        answer
    }

    async fn finish(self) {
        self.h.kill_and_remove(&self.id).await.unwrap();
        self.h.assert_no_leaks(&self.id).await;
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

fn paths(answer: &Value, field: &str) -> Vec<String> {
    answer["fs"][field].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect()
}

fn has(answer: &Value, field: &str, path: &str) -> bool {
    paths(answer, field).iter().any(|p| p == path)
}

#[tokio::test(flavor = "multi_thread")]
async fn filesystem_turns() {
    let (mut s, _g) = Sandbox::start("inspect_fs").await;

    // Setup: a repository and files to work on (python's bytecode caches get written too).
    s.turn(
        "git init -q repo && cd repo && printf 'a\\nb\\n' > f.txt && git add f.txt && \
         git -c user.email=x@y -c user.name=x commit -qm init && git status >/dev/null && \
         python3 -c 'import json, http.server; print(1)' >/dev/null",
        "fs",
    )
    .await;

    // Read-only turns leave nothing. (Plain `git status` may rewrite .git/index to refresh
    // its stat cache, a real change crab reports; `--no-optional-locks` is the read-only form.)
    let a = s
        .turn(
            "cat repo/f.txt; grep -r b repo/f.txt; ls -la / /app; find /etc -name '*.conf' | head; \
             cd repo && git --no-optional-locks status && git log --oneline; \
             python3 -c 'import json; print(json.dumps([1]))'",
            "none",
        )
        .await;
    assert_eq!(a["fs"]["scanned"], false, "no mutating syscall: the upperdir is not even compared: {a:#}");

    // A temp file created and removed: mutating syscalls, no net change.
    let a = s.turn("echo tmp > /tmp/scratch.txt; cat /tmp/scratch.txt; rm /tmp/scratch.txt", "none").await;
    assert_eq!(a["fs"]["scanned"], true, "{a:#}");

    // Printing to stdout/stderr is not a filesystem mutation.
    let a = s.turn("for i in $(seq 100); do echo line $i; echo err $i >&2; done", "none").await;
    assert_eq!(a["fs"]["scanned"], false, "{a:#}");

    let a = s.turn("sed -i 's/a/A/' repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt") || has(&a, "added", "/app/repo/f.txt"), "{a:#}");

    let a = s.turn("echo appended >> repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = s.turn("mkdir -p deep/er/est", "fs").await;
    assert!(has(&a, "added", "/app/deep/er/est"), "{a:#}");

    // Removing a file of the image leaves a whiteout.
    let a = s.turn("rm /etc/debian_version", "fs").await;
    assert!(has(&a, "deleted", "/etc/debian_version"), "{a:#}");

    let a = s.turn("chmod 600 repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = s.turn("touch repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = s.turn("chown nobody repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = s.turn("truncate -s 1 repo/f.txt", "fs").await;
    assert!(has(&a, "modified", "/app/repo/f.txt"), "{a:#}");

    let a = s.turn("ln repo/f.txt hard.txt && ln -s repo/f.txt soft.txt", "fs").await;
    assert!(has(&a, "added", "/app/hard.txt") && has(&a, "added", "/app/soft.txt"), "{a:#}");

    // A file made in an earlier turn and removed now.
    let a = s.turn("rm soft.txt", "fs").await;
    assert!(has(&a, "deleted", "/app/soft.txt"), "{a:#}");

    // pip installs a local wheel into site-packages (built by hand: no index, no network).
    s.turn(
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
    let a = s
        .turn(
            "pip install -q --no-index --break-system-packages /tmp/crabdemo-0.1-py3-none-any.whl && \
             python3 -c 'import crabdemo; assert crabdemo.VALUE == 42'",
            "fs",
        )
        .await;
    assert!(
        paths(&a, "added").iter().any(|p| p.contains("site-packages/crabdemo") || p.contains("dist-packages/crabdemo")),
        "{a:#}"
    );

    // Nothing since the last turn.
    s.turn("true", "none").await;
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn process_turns() {
    let (mut s, _g) = Sandbox::start("inspect_proc").await;

    // A background process that exits before the turn ends leaves nothing.
    s.turn("(sleep 0.2 &); sleep 0.6", "none").await;

    // A long-lived interpreter fed through a FIFO: its setup is a process (and a FIFO file).
    let a = s
        .turn(
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
    assert!(started.iter().any(|p| p["cmdline"].as_str().unwrap().contains("python3")), "{a:#}");

    // It receives input and changes its memory: a process turn without file changes.
    let a = s.turn("echo 'x = bytearray(1 << 20); x[5] = 1' > /tmp/repl; sleep 0.3", "proc").await;
    let mem = a["procs"]["memory"].as_array().unwrap();
    assert!(mem.iter().any(|m| m["changed_pages"].as_u64().unwrap() + m["added_pages"].as_u64().unwrap() > 0), "{a:#}");

    // It receives nothing: it did not run, so nothing changed (exactly, without reading it).
    let a = s.turn("ls /tmp >/dev/null", "none").await;
    assert!(!a["procs"]["idle"].as_array().unwrap().is_empty(), "the interpreter was idle: {a:#}");

    // A server left running is a process change...
    let a = s
        .turn("nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1", "proc")
        .await;
    assert!(
        a["procs"]["started"].as_array().unwrap().iter().any(|p| p["cmdline"].as_str().unwrap().contains("http.server")),
        "{a:#}"
    );
    // ... and, while it lives, its selector loop rewrites its memory every 0.5 s: every turn
    // is a process turn by exact comparison (DESIGN.md: measured, not guessed).
    let a = s.turn("sleep 1.2; curl -s 127.0.0.1:8000 >/dev/null || python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000\").read()'", "proc").await;
    assert!(a["procs"]["started"].as_array().unwrap().is_empty(), "{a:#}");

    // Stopping it is a process change too.
    let a = s.turn("pkill -f 'm http[.]server'; sleep 0.3", "proc").await;
    assert!(
        a["procs"]["ended"].as_array().unwrap().iter().any(|p| p["cmdline"].as_str().unwrap().contains("http.server")),
        "{a:#}"
    );

    // A daemon that double-forks and calls setsid stays: a process change.
    let a = s.turn("setsid sh -c 'sleep 1000 >/dev/null 2>&1 & exit 0'; sleep 0.3", "proc").await;
    assert!(a["procs"]["started"].as_array().unwrap().iter().any(|p| p["cmdline"].as_str().unwrap().contains("sleep 1000")), "{a:#}");

    // Deleting a file a persisting process holds open: the process image must be retaken.
    s.turn("sleep 0.1", "none").await;
    let a = s
        .turn("echo log > /tmp/held.log; (exec 3</tmp/held.log; exec sleep 2000) >/dev/null 2>&1 & sleep 0.3", "full")
        .await;
    assert!(!a["procs"]["started"].as_array().unwrap().is_empty(), "{a:#}");
    let a = s.turn("rm /tmp/held.log", "full").await;
    assert!(!a["procs"]["held_changed"].as_array().unwrap().is_empty(), "{a:#}");

    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_turn_annotations_change_nothing() {
    let (mut s, _g) = Sandbox::start("inspect_bad").await;
    s.run("echo x > /app/x").await;
    for (key, value) in [(TURN_END, ""), (TURN_END, "a\nb"), ("io.crab/turn-ned", "1")] {
        let err = s
            .h
            .update(&s.id, None, HashMap::from([(key.to_string(), value.to_string())]))
            .await
            .expect_err("malformed annotation accepted");
        assert!(err.to_string().contains("io.crab/"), "{err}");
    }
    let turns = s.state_dir.join(&s.h.env.namespace).join(&s.id).join("turns");
    assert!(!Path::new(&turns).exists(), "a malformed annotation stored an answer");
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
    let (mut s, _g) = Sandbox::start_with_volume("inspect_vol", Some((dir.path(), "/workspace"))).await;
    s.turn("cat /workspace/notes.txt", "none").await;
    let a = s.turn("echo v2 >> /workspace/notes.txt", "fs").await;
    assert!(has(&a, "modified", "/workspace/notes.txt"), "{a:#}");
    let a = s.turn("mkdir /workspace/out && echo r > /workspace/out/result", "fs").await;
    assert!(has(&a, "added", "/workspace/out/result"), "{a:#}");
    let a = s.turn("rm /workspace/notes.txt", "fs").await;
    assert!(has(&a, "deleted", "/workspace/notes.txt"), "{a:#}");
    s.turn("echo t > /workspace/tmp; rm /workspace/tmp", "none").await;
    s.finish().await;
}

/// crabctl ends a turn and explains it, the way a harness or a person would use it.
#[tokio::test(flavor = "multi_thread")]
async fn crabctl_turn_end_and_explain() {
    let (mut s, _g) = Sandbox::start("inspect_ctl").await;
    s.run("echo hello > /app/greeting").await;
    let config = s.state_dir.with_extension("toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(&config, format!("[store]\nstate_dir = \"{}\"\n", s.state_dir.display())).unwrap();
    let crabctl = |args: &[&str]| {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let out = std::process::Command::new(&bin)
            .arg("--address")
            .arg(&s.h.env.address)
            .args(["--namespace", &s.h.env.namespace, "--config"])
            .arg(&config)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e} (build it with `cargo build --release`)", bin.display()));
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, out, err) = crabctl(&["turn-end", &s.id, "--turn", "greet"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, err) = crabctl(&["turns", &s.id]);
    assert_eq!(code, Some(0), "{out}{err}");
    let line = out.lines().find(|l| l.contains("greet")).unwrap_or_else(|| panic!("no turn line in:\n{out}"));
    assert!(line.contains(" fs ") && line.contains("fs +1"), "{line}");
    let (code, out, err) = crabctl(&["show", &s.id, "greet"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert!(has(&answer, "added", "/app/greeting"), "{answer:#}");
    // Errors are clear and exit non-zero.
    let (code, _, err) = crabctl(&["show", &s.id, "nope"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("has no turn nope"), "{err}");
    let (code, _, err) = crabctl(&["turn-end", "no-such-container"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no-such-container"), "{err}");
    let (code, _, err) = crabctl(&["frobnicate"]);
    assert_eq!(code, Some(2), "{err}");
    let _ = std::fs::remove_file(&config);
    s.finish().await;
}
