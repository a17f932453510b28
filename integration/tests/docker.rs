//! crab under Docker Engine, in both Docker storage modes (overlay2 and the containerd image
//! store): the container lifecycle through the real `docker` CLI (run -d, exec, logs, stop,
//! start, rm), the two ways of naming crab (the shim's runtime name, daemon.json's runtime with
//! crab's config), the exec turn boundary, and the scenario matrix whose turn answers and
//! checkpoints must be the same as under ctr (the matrix runs under ctr here too, against the
//! same oracle).

use std::{path::PathBuf, time::Duration};

use crab_integration::{
    docker::{
        answer_why, Docker, DockerSandbox, DockerSandboxOptions, Runtime, Store, DEFAULT_STATE_DIR,
        SHIM_RUNTIME,
    },
    env::BUSYBOX_IMAGE,
    harness::unique_id,
    host,
    sandbox::{Sandbox, SandboxOptions},
};
use serde_json::Value;

/// run -d, exec (output and exit codes), logs (both streams), stop, start again, rm: Docker's
/// everyday lifecycle with crab named by its shim's runtime name.
fn lifecycle(store: Store) {
    let d = Docker::for_test(store);
    let name = unique_id(&format!("docker-life-{}", store.name()));
    let mut guard = d.guard(&[&name]);
    let id = d
        .run_detached(&[
            "--name",
            &name,
            "--runtime",
            SHIM_RUNTIME,
            BUSYBOX_IMAGE,
            "sh",
            "-c",
            "echo out; echo err >&2; exec sleep infinity",
        ])
        .unwrap();
    let state = PathBuf::from(DEFAULT_STATE_DIR)
        .join(&d.env.namespace)
        .join(&id);
    guard.add_dir(state.clone());
    assert_eq!(
        d.inspect(&id, "{{.HostConfig.Runtime}} {{.State.Running}}")
            .unwrap(),
        format!("{SHIM_RUNTIME} true")
    );
    // crab's shim serves it, not runc's.
    let shims = host::shim_processes(&id);
    assert!(
        shims.len() == 1 && shims[0].argv[0].ends_with("containerd-shim-crab-v1"),
        "{shims:?}"
    );
    let rootfs = d
        .inspect(&id, "{{.GraphDriver.Data.MergedDir}}")
        .ok()
        .filter(|m| m.starts_with('/'))
        .map(PathBuf::from);

    let out = d.exec(&id, &["echo", "hi"]).unwrap().ok().unwrap();
    assert_eq!(out.stdout, "hi\n");
    assert_eq!(d.exec(&id, &["sh", "-c", "exit 3"]).unwrap().code(), 3);
    let logs = host::eventually(Duration::from_secs(10), || {
        let l = d.docker(&["logs", &id]).ok()?;
        (l.stdout == "out\n" && l.stderr == "err\n").then_some(l)
    });
    assert!(
        logs.is_some(),
        "docker logs: {:?}",
        d.docker(&["logs", &id]).unwrap()
    );

    // sleep as pid 1 ignores SIGTERM: docker stop kills it after the timeout.
    d.docker(&["stop", "-t", "1", &id]).unwrap().ok().unwrap();
    assert_eq!(
        d.inspect(&id, "{{.State.Running}} {{.State.ExitCode}}")
            .unwrap(),
        "false 137"
    );
    assert!(host::container_processes(&id).is_empty());
    d.docker(&["start", &id]).unwrap().ok().unwrap();
    assert_eq!(d.inspect(&id, "{{.State.Running}}").unwrap(), "true");
    assert_eq!(
        d.exec(&id, &["cat", "/proc/1/cmdline"])
            .unwrap()
            .ok()
            .unwrap()
            .stdout,
        "sleep\0infinity\0"
    );
    d.rm(&id).unwrap();
    d.assert_no_leaks(&id, rootfs.as_deref());
}

#[test]
fn lifecycle_overlay2() {
    lifecycle(Store::Overlay2);
}

#[test]
fn lifecycle_containerd_store() {
    lifecycle(Store::Containerd);
}

/// daemon.json's runtime `crab` (runtimeType io.containerd.crab.v1, options.ConfigPath) passes
/// crab's config: the turn answer lands in the store that config names, and crabctl (with
/// Docker's namespace) reads it from the container's runtime options.
fn daemon_json_runtime(store: Store) {
    let (mut s, _g) = DockerSandbox::start(
        store,
        &format!("docker-named-{}", store.name()),
        DockerSandboxOptions::default(),
    );
    assert_eq!(
        s.d.inspect(&s.id, "{{.HostConfig.Runtime}}").unwrap(),
        "crab"
    );
    assert!(s.store().starts_with(&s.d.crab_store), "{:?}", s.store());
    s.run("echo hi > /app/hi.txt");
    let answer = s.end_turn();
    assert_eq!(answer["turn_id"], "t1", "{answer:#}");
    assert!(
        s.store().join("turns").is_dir(),
        "no store at {}",
        s.store().display()
    );
    let turns = s.d.crabctl(&["turns", &s.id]);
    assert!(
        turns.status.success() && turns.stdout.contains("t1"),
        "{turns:?}"
    );
    s.finish();
}

#[test]
fn daemon_json_runtime_overlay2() {
    daemon_json_runtime(Store::Overlay2);
}

#[test]
fn daemon_json_runtime_containerd_store() {
    daemon_json_runtime(Store::Containerd);
}

/// `--annotation io.crab/turn-boundary=exec` (no harness integration: each `docker exec` that
/// ends while no other runs ends a turn), as the ctr test of the same name: a write, a read, a
/// write give two fs checkpoints, the second holding only its own file.
fn exec_boundary(store: Store) {
    let (mut s, _g) = DockerSandbox::start(
        store,
        &format!("docker-execturn-{}", store.name()),
        DockerSandboxOptions {
            runtime: Runtime::Shim,
            annotations: &[("io.crab/turn-boundary", "exec")],
            ..Default::default()
        },
    );
    s.run("echo one > /app/one");
    s.run("cat /app/one");
    s.run("echo two > /app/two");
    let answers = host::eventually(Duration::from_secs(10), || {
        let a = s.answers();
        (a.len() >= 3).then_some(a)
    })
    .unwrap_or_else(|| panic!("3 turn answers expected: {:#?}", s.answers()));
    // The turn ids are `exec-<exec id>`: Docker's exec ids are its own (random) ones.
    let kinds: Vec<&str> = answers
        .iter()
        .map(|a| a["kind"].as_str().unwrap_or(""))
        .collect();
    assert!(
        answers.iter().all(|a| a["turn_id"]
            .as_str()
            .is_some_and(|t| t.starts_with("exec-"))),
        "{answers:#?}"
    );
    let whys: Vec<String> = answers.iter().map(answer_why).collect();
    assert_eq!(kinds, ["fs", "none", "fs"], "{whys:?}");
    let m = s.wait_manifests(2);
    let kinds: Vec<&str> = m.iter().map(|m| m["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["fs", "fs"], "{m:#?}");
    let l = s.layer(m[1]["fs_layers"].as_array().unwrap().last().unwrap());
    assert!(
        l.contains_key("app/two") && !l.contains_key("app/one"),
        "{:?}",
        l.keys().collect::<Vec<_>>()
    );
    s.finish();
}

#[test]
fn exec_boundary_overlay2() {
    exec_boundary(Store::Overlay2);
}

#[test]
fn exec_boundary_containerd_store() {
    exec_boundary(Store::Containerd);
}

/// The scenario matrix: one agent action per turn, the turn answer crab must give and the
/// checkpoint it must publish (None: none), as the ctr tests establish (checkpoints.rs,
/// checkpoint_policy.rs). Under Docker the answers must be the same.
const MATRIX: &[(&str, &str, Option<&str>)] = &[
    // A read-only turn: nothing to keep.
    ("cat /etc/os-release >/dev/null", "none", None),
    // Files written and removed (a whiteout), a temp file gone by the turn end: a layer.
    (
        "echo hello > /app/a.txt; chmod 640 /app/a.txt; rm /etc/debian_version; echo t > /tmp/tmp; rm /tmp/tmp",
        "fs",
        Some("fs"),
    ),
    // A background process left running: a process image.
    ("nohup sleep 3000 >/dev/null 2>&1 & sleep 0.2", "proc", Some("proc")),
    // Files only, the process idle: a layer (the process image is kept).
    ("echo x > /app/x", "fs", Some("fs")),
    // Reads with a process alive: nothing.
    ("cat /app/a.txt /app/x >/dev/null", "none", None),
    // A file and a new process: both.
    ("echo y > /app/y; nohup sleep 4000 >/dev/null 2>&1 & sleep 0.2", "full", Some("full")),
    // A listening TCP server: a process image holding its socket.
    (
        "nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1",
        "proc",
        Some("proc"),
    ),
];

/// One turn's outcome: (turn id, answer kind, why: [`answer_why`]).
type Answer = (String, String, String);

fn answer_of(a: &Value) -> Answer {
    (
        a["turn_id"].as_str().unwrap_or("").to_string(),
        a["kind"].as_str().unwrap_or("").to_string(),
        answer_why(a),
    )
}

/// Checks answers and checkpoints against [`MATRIX`]. An idle process whose memory the kernel
/// touched (rseq area on a CPU migration, under load) is a documented false positive: a turn
/// may add `proc` (fs -> full, none -> proc) when the answer says memory changed; never a
/// miss.
fn assert_matrix(label: &str, answers: &[Answer], manifests: &[Value], layer2: &[String]) {
    let mut problems = Vec::new();
    assert_eq!(answers.len(), MATRIX.len(), "{label}: {answers:#?}");
    for (i, ((script, want, want_ckpt), (turn, got, why))) in MATRIX.iter().zip(answers).enumerate()
    {
        let memory_fp = why.contains("memory changed")
            && matches!((*want, got.as_str()), ("fs", "full") | ("none", "proc"));
        if got != want && !memory_fp {
            problems.push(format!(
                "turn {} ({turn}) `{script}`: answer {got}, want {want}: {why}",
                i + 1
            ));
        } else if memory_fp {
            eprintln!(
                "{label}: turn {} was {got} (memory false positive): {why}",
                i + 1
            );
        }
        let ckpt: Vec<&Value> = manifests.iter().filter(|m| m["turn_id"] == *turn).collect();
        let got_ckpt = ckpt.first().and_then(|m| m["kind"].as_str());
        let ok = match (want_ckpt, got_ckpt) {
            (None, None) => true,
            (None, Some(_)) => memory_fp,
            (Some(w), Some(g)) => *w == g || (memory_fp && g == "full"),
            (Some(_), None) => false,
        };
        if !ok {
            problems.push(format!(
                "turn {} ({turn}) `{script}`: checkpoint {got_ckpt:?}, want {want_ckpt:?}: {}",
                i + 1,
                ckpt.first()
                    .map(|m| m["explanation"].to_string())
                    .unwrap_or_default()
            ));
        }
    }
    for want in ["app/a.txt", "etc/.wh.debian_version"] {
        if !layer2.iter().any(|k| k == want) {
            problems.push(format!("turn 2's layer lacks {want}: {layer2:?}"));
        }
    }
    if layer2.iter().any(|k| k.contains("tmp/tmp")) {
        problems.push(format!("turn 2's layer holds the temp file: {layer2:?}"));
    }
    assert!(
        problems.is_empty(),
        "{label}: not the answers crab gives under ctr:\n  {}",
        problems.join("\n  ")
    );
}

fn expected_checkpoints() -> usize {
    MATRIX.iter().filter(|(_, _, c)| c.is_some()).count()
}

/// The layer of turn 2's checkpoint, as its entry names.
fn layer2_keys(manifests: &[Value], read: impl Fn(&Value) -> Vec<String>) -> Vec<String> {
    manifests
        .iter()
        .find(|m| m["turn_id"] == "t2")
        .and_then(|m| m["fs_layers"].as_array()?.last().cloned())
        .map(|l| read(&l))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn scenario_matrix_under_ctr() {
    let (mut s, _g) = Sandbox::start("docker-matrix-ctr", SandboxOptions::default()).await;
    let mut answers = Vec::new();
    for (script, _, _) in MATRIX {
        s.run(script).await;
        answers.push(answer_of(&s.end_turn().await));
    }
    let m = s.wait_manifests(expected_checkpoints()).await;
    let layer2 = layer2_keys(&m, |l| s.layer(l).into_keys().collect());
    assert_matrix("ctr", &answers, &m, &layer2);
    s.finish().await;
}

fn scenario_matrix(store: Store) {
    let (mut s, _g) = DockerSandbox::start(
        store,
        &format!("docker-matrix-{}", store.name()),
        DockerSandboxOptions::default(),
    );
    let mut answers = Vec::new();
    for (script, _, _) in MATRIX {
        s.run(script);
        answers.push(answer_of(&s.end_turn()));
    }
    // Checkpoints run in the background: wait for as many as the oracle wants (or time out
    // and compare what there is).
    let _ = host::eventually(Duration::from_secs(30), || {
        (s.manifests().len() >= expected_checkpoints()).then_some(())
    });
    let m = s.manifests();
    let layer2 = layer2_keys(&m, |l| s.layer(l).into_keys().collect());
    assert_matrix(&format!("docker {}", store.name()), &answers, &m, &layer2);
    s.finish();
}

#[test]
fn scenario_matrix_under_docker_overlay2() {
    scenario_matrix(Store::Overlay2);
}

#[test]
fn scenario_matrix_under_docker_containerd_store() {
    scenario_matrix(Store::Containerd);
}

/// A workspace bind-mounted at /workspace (`docker run -v DIR:/workspace`, tracked by default)
/// is part of the checkpoint: exported and run again through Docker with the same directory
/// mounted, the directory holds the checkpoint's contents again (what came after is gone).
#[test]
fn a_bind_mounted_workspace_comes_back_through_docker_run() {
    let store = Store::Containerd;
    let d = Docker::for_test(store);
    let ws = d
        .env
        .crab_home
        .join(format!("docker-ws-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ws);
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("before.txt"), "there before\n").unwrap();
    let mount = format!("{}:/workspace", ws.display());
    let (mut s, mut guard) = DockerSandbox::start(
        store,
        "docker_ws",
        DockerSandboxOptions {
            run_args: &["-v", &mount],
            ..Default::default()
        },
    );
    guard.add_dir(ws.clone());
    s.run("echo v1 > /workspace/a.txt && mkdir -p /workspace/d && echo x > /workspace/d/x");
    s.end_turn();
    let m = s.wait_manifests(1).pop().unwrap();
    assert_eq!(m["volumes"], serde_json::json!(["/workspace"]), "{m:#}");
    let at_t1 = host::tree_listing(&ws);
    assert_eq!(
        at_t1,
        ["a.txt v1", "before.txt there before", "d/", "d/x x"]
    );
    // After the checkpoint, never checkpointed: must not come back.
    s.run("echo junk > /workspace/junk; rm /workspace/a.txt");

    let image = format!("localhost/crab-test/ws-{}:1", std::process::id());
    let out = s.d.crabctl(&["export", &s.id, "--turn", "t1", &image]);
    assert!(out.status.success(), "export: {}{}", out.stdout, out.stderr);
    s.d.rm(&s.name).unwrap();
    let again = unique_id("docker_ws_again");
    guard.add(&again);
    let id =
        s.d.run_detached(&["--name", &again, "--runtime", "crab", "-v", &mount, &image])
            .unwrap_or_else(|e| panic!("docker run of the checkpoint image: {e}"));
    guard.add_dir(
        s.d.state_dir(Runtime::Named)
            .join(&s.d.env.namespace)
            .join(&id),
    );
    assert_eq!(
        host::tree_listing(&ws),
        at_t1,
        "the host directory after docker run"
    );
    let seen = s.d.exec(&again, &["cat", "/workspace/a.txt"]).unwrap();
    assert_eq!(seen.stdout, "v1\n");
    s.d.rm(&again).unwrap();
    let _ = s.d.docker(&["rmi", &image]);
}

/// A sandbox on a terminal (`docker run -t`): its checkpoint holds the tty, and `docker run -t`
/// of the exported image restores its processes on a new terminal (CRIU recreates the pty, the
/// shim connects the new master to Docker's stdio).
#[test]
fn a_terminal_comes_back_through_docker_run() {
    let store = Store::Containerd;
    let (mut s, mut guard) = DockerSandbox::start(
        store,
        "docker_tty",
        DockerSandboxOptions {
            run_args: &["-t"],
            ..Default::default()
        },
    );
    s.run("echo on-a-tty > /app/tty.txt; (sleep 4000 </dev/null >/dev/null 2>&1 &)");
    s.end_turn();
    let m = s.wait_manifests(1).pop().unwrap();
    assert_eq!(m["kind"], "full", "{m:#}");
    let image = format!("localhost/crab-test/tty-{}:1", std::process::id());
    let out = s.d.crabctl(&["export", &s.id, "--turn", "t1", &image]);
    assert!(out.status.success(), "export: {}{}", out.stdout, out.stderr);
    s.d.rm(&s.name).unwrap();
    let again = unique_id("docker_tty_again");
    guard.add(&again);
    let id =
        s.d.run_detached(&["--name", &again, "--runtime", "crab", "-t", &image])
            .unwrap_or_else(|e| panic!("docker run -t of the checkpoint image: {e}"));
    guard.add_dir(
        s.d.state_dir(Runtime::Named)
            .join(&s.d.env.namespace)
            .join(&id),
    );
    let seen =
        s.d.exec(
            &again,
            &[
                "bash",
                "-c",
                "readlink /proc/1/fd/0; cat /app/tty.txt; pgrep -x sleep | wc -l",
            ],
        )
        .unwrap();
    assert_eq!(seen.stdout, "/dev/pts/0\non-a-tty\n2\n", "{}", seen.stderr);
    s.d.rm(&again).unwrap();
    let _ = s.d.docker(&["rmi", &image]);
}
