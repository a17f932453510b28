//! A real agent harness end to end: mini-swe-agent (pinned from PyPI, in a venv under
//! CRAB_HOME made on first use and kept) runs the scripted episode of
//! `integration/harnesses/mini_swe_agent/episode.py` with its `DeterministicModel`, its
//! `DefaultAgent` and its `DockerEnvironment` (`--rm --runtime io.containerd.crab.v1
//! --annotation io.crab/turn-boundary=exec`) against the private dockerd with the containerd
//! image store (where a checkpoint image `crabctl export` makes is an image docker runs).
//! Each action is one turn; crab's answers must be the episode's oracle. Then the sandbox is
//! killed mid-episode, brought back from crab's newest checkpoint (`crabctl export` + `docker
//! run` of that image), and the remaining steps must succeed on what phase 1 left (files, the
//! installed package, the background server and its socket).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use crab_integration::{
    ctr::run_command,
    docker::{answer_why, Docker, Runtime, Store, DEFAULT_STATE_DIR},
    host,
    sandbox::{json_files, AGENT_IMAGE},
};
use serde_json::Value;

const MINI_SWE_AGENT: &str = "mini-swe-agent==2.4.6";
/// Debian's python3 (with python3-venv), not whatever python3 is first on PATH.
const PYTHON: &str = "/usr/bin/python3";

fn episode_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("harnesses/mini_swe_agent/episode.py")
}

/// The venv with mini-swe-agent, made once per pinned version (a marker written last says it
/// is complete; an interrupted install is redone). The tests of this binary run in parallel
/// and each asks for it: an exclusive `flock` on a lock file beside it makes the first one
/// build it while the others wait, then find it complete (on a fresh machine, two builders
/// racing in one directory failed both).
fn venv(crab_home: &Path) -> PathBuf {
    let harness = crab_home.join("harness");
    std::fs::create_dir_all(&harness).unwrap();
    let dir = harness.join(format!("venv-{}", MINI_SWE_AGENT.replace("==", "-")));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(harness.join("venv.lock"))
        .unwrap();
    // Released when `lock` is closed, at return or at a panic's unwind.
    // SAFETY: flock on a valid fd we own.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    assert_eq!(
        rc,
        0,
        "flock venv.lock: {}",
        std::io::Error::last_os_error()
    );
    let marker = dir.join(".crab-complete");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == MINI_SWE_AGENT) {
        return dir;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut cmd = Command::new(PYTHON);
    cmd.args(["-m", "venv"]).arg(&dir);
    run_command(cmd, "python3 -m venv", None, Duration::from_secs(120))
        .and_then(|o| o.ok())
        .unwrap_or_else(|e| panic!("cannot make the venv (python3-venv, `make deps`): {e}"));
    let mut cmd = Command::new(dir.join("bin/python"));
    cmd.args(["-m", "pip", "install", "-q", MINI_SWE_AGENT]);
    run_command(cmd, "pip install", None, Duration::from_secs(900))
        .and_then(|o| o.ok())
        .unwrap_or_else(|e| panic!("cannot install {MINI_SWE_AGENT} from PyPI: {e}"));
    std::fs::write(&marker, MINI_SWE_AGENT).unwrap();
    drop(lock);
    dir
}

/// Runs episode.py MODE ARGS with the venv's python against `d`; returns its report.
fn episode(d: &Docker, venv: &Path, mode: &str, args: &[&str], report: &Path) -> Value {
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.arg(episode_script())
        .arg(mode)
        .args(args)
        .arg("--report")
        .arg(report);
    d.set_env(&mut cmd);
    // mini-swe-agent's global config in CRAB_HOME, not in ~/.config.
    cmd.env(
        "MSWEA_GLOBAL_CONFIG_DIR",
        d.env.crab_home.join("harness/mini-swe-agent-config"),
    )
    .env("MSWEA_SILENT_STARTUP", "1");
    let out = run_command(
        cmd,
        &format!("episode.py {mode}"),
        None,
        Duration::from_secs(300),
    )
    .unwrap();
    serde_json::from_slice(&std::fs::read(report).unwrap_or_default()).unwrap_or_else(|e| {
        panic!(
            "episode.py {mode} wrote no report ({e}): exit {}\n{}{}",
            out.code(),
            out.stdout,
            out.stderr
        )
    })
}

/// crab's answers in `store`, turn by turn, against the episode's oracle `expect` (an idle
/// process whose memory the kernel touched may add `proc` when the explanation says so, as in
/// the ctr tests), and every turn that changed something covered by a published checkpoint,
/// none failed. Returns the problems found.
fn answers_against_the_oracle(store: &Path, expect: &Value, commands: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    let expect: Vec<String> = expect
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    let answers = host::eventually(Duration::from_secs(10), || {
        let a = json_files(&store.join("turns"));
        (a.len() >= expect.len()).then_some(a)
    })
    .unwrap_or_else(|| json_files(&store.join("turns")));
    if answers.len() != expect.len() {
        problems.push(format!(
            "{} turn answers for {} actions: {:?}",
            answers.len(),
            expect.len(),
            answers
                .iter()
                .map(|a| format!("{} {}", a["turn_id"], a["kind"]))
                .collect::<Vec<_>>()
        ));
    }
    for (i, (a, want)) in answers.iter().zip(&expect).enumerate() {
        let got = a["kind"].as_str().unwrap_or("");
        let why = answer_why(a);
        let memory_fp = why.contains("memory changed")
            && matches!((want.as_str(), got), ("fs", "full") | ("none", "proc"));
        if got != want && !memory_fp {
            problems.push(format!(
                "step {} `{}`: crab answered {got}, the oracle says {want}: {why}",
                i + 1,
                commands
                    .get(i)
                    .map(String::as_str)
                    .unwrap_or("")
                    .lines()
                    .next()
                    .unwrap_or("")
            ));
        }
    }
    let changed = expect.iter().filter(|k| *k != "none").count();
    let covered = || {
        json_files(&store.join("checkpoints"))
            .into_iter()
            .filter(|m| !matches!(m["kind"].as_str(), Some("created" | "restored")))
            .collect::<Vec<_>>()
    };
    let _ = host::eventually(Duration::from_secs(30), || {
        (covered().len() >= changed).then_some(())
    });
    let failed: Vec<String> = covered()
        .iter()
        .filter(|m| m["kind"] == "failed")
        .map(|m| format!("{}: {}", m["turn_id"], m["explanation"]))
        .collect();
    if !failed.is_empty() {
        problems.push(format!(
            "failed checkpoints:\n    {}",
            failed.join("\n    ")
        ));
    }
    problems
}

/// The `run_args` of the crash-proof recipe in docs/docker-and-harnesses.md (the python block
/// after "The crash-proof recipe").
fn documented_heal_run_args() -> Vec<String> {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/docker-and-harnesses.md"),
    )
    .unwrap();
    let after = &doc[doc
        .find("The crash-proof")
        .expect("the recipe is documented")..];
    let block = &after[after.find("run_args=[").unwrap() + "run_args=[".len()..];
    let list = &block[..block.find(']').unwrap()];
    list.split(',')
        .map(|a| a.trim().trim_matches('"').to_string())
        .filter(|a| !a.is_empty())
        .collect()
}

/// What episode.py runs the sandbox with in `heal` mode (`--runtime crab`).
fn episode_heal_run_args(d: &Docker, venv: &Path) -> Vec<String> {
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.env(
        "MSWEA_GLOBAL_CONFIG_DIR",
        d.env.crab_home.join("harness/mini-swe-agent-config"),
    )
    .env("MSWEA_SILENT_STARTUP", "1");
    cmd.arg("-c")
        .arg(
            "import json, sys; sys.path.insert(0, sys.argv[1]); import episode; \
             print(json.dumps(episode.heal_run_args('crab')))",
        )
        .arg(episode_script().parent().unwrap());
    let out = run_command(cmd, "episode.heal_run_args", None, Duration::from_secs(60))
        .and_then(|o| o.ok())
        .unwrap();
    let last = out.stdout.trim().lines().last().unwrap_or("");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

/// The crash-proof recipe, as the README gives it (`--restart on-failure --runtime crab
/// --annotation io.crab/resume=newest`, plus the exec turn boundary), through one
/// mini-swe-agent episode with two crashes: each kills the sandbox's init from the host in the
/// middle of a turn, dockerd restarts it and crab resumes it as of the last turn end; the
/// agent's later steps find its files, git history, sqlite rows, directory modes, processes and
/// a server's in-memory counter, the interrupted turns rolled back, and crab goes on answering
/// and checkpointing every turn in the same store.
fn heals_through_two_crashes(store: Store) {
    let d = Docker::for_test(store);
    let venv = venv(&d.env.crab_home);
    assert_eq!(
        episode_heal_run_args(&d, &venv),
        documented_heal_run_args(),
        "episode.py's heal_run_args(\"crab\") must be the recipe docs/docker-and-harnesses.md gives"
    );
    let work = tempfile::tempdir().unwrap();
    let mut guard = d.guard(&[]);
    let report = episode(
        &d,
        &venv,
        "heal",
        &["--keep", "--runtime", "crab"],
        &work.path().join("heal.json"),
    );
    let id = report["container_id"].as_str().unwrap().to_string();
    guard.add(&id);
    let crab_store = d.state_dir(Runtime::Named).join(&d.env.namespace).join(&id);
    guard.add_dir(crab_store.clone());
    let mut problems = Vec::new();
    if report["exit_status"] != "Submitted" || report["failures"] != serde_json::json!([]) {
        problems.push(format!(
            "the episode: exit {}, failures {:#}",
            report["exit_status"], report["failures"]
        ));
    }
    let restarts: Vec<u64> = report["crashes"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter_map(|c| c["restart_count"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    if restarts != [1, 2] {
        problems.push(format!("restarts {restarts:?}: {:#}", report["crashes"]));
    }
    let commands: Vec<String> = report["commands"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap_or("").to_string())
        .collect();
    problems.extend(answers_against_the_oracle(
        &crab_store,
        &report["expect"],
        &commands,
    ));
    // One lineage in one store: each resume recorded, and checkpoints taken after each.
    let lineage: Vec<String> = json_files(&crab_store.join("checkpoints"))
        .iter()
        .map(|m| m["kind"].as_str().unwrap_or("").to_string())
        .collect();
    let restored: Vec<usize> = lineage
        .iter()
        .enumerate()
        .filter(|(_, k)| *k == "restored")
        .map(|(i, _)| i)
        .collect();
    let checkpoint = |k: &String| !matches!(k.as_str(), "created" | "restored" | "failed");
    if restored.len() != 2
        || !restored.iter().all(|&r| {
            lineage[r + 1..]
                .iter()
                .take_while(|k| *k != "restored")
                .any(checkpoint)
        })
    {
        problems.push(format!(
            "two resumes, each followed by checkpoints: {lineage:?}"
        ));
    }
    d.docker(&["rm", "-f", &id]).unwrap();
    d.assert_no_leaks(&id, None);
    assert!(
        problems.is_empty(),
        "mini-swe-agent through two crashes on crab ({}):\n  {}",
        d.store.name(),
        problems.join("\n  ")
    );
}

#[test]
fn mini_swe_agent_heals_through_two_crashes_overlay2() {
    heals_through_two_crashes(Store::Overlay2);
}

#[test]
fn mini_swe_agent_heals_through_two_crashes_containerd_store() {
    heals_through_two_crashes(Store::Containerd);
}

#[test]
fn mini_swe_agent_episode_with_a_crash_and_a_restore() {
    let d = Docker::for_test(Store::Containerd);
    let venv = venv(&d.env.crab_home);
    let work = tempfile::tempdir().unwrap();
    let mut guard = d.guard(&[]);
    let mut problems = Vec::new();

    // Phase 1: the agent works; every action is one docker exec, one turn.
    let first = episode(&d, &venv, "run", &[], &work.path().join("phase1.json"));
    let id = first["container_id"].as_str().unwrap().to_string();
    guard.add(&id);
    let store = PathBuf::from(DEFAULT_STATE_DIR)
        .join(&d.env.namespace)
        .join(&id);
    guard.add_dir(store.clone());
    assert_eq!(first["exit_status"], "Submitted", "{first:#}");
    assert_eq!(
        first["failures"],
        serde_json::json!([]),
        "phase 1 steps failed"
    );

    let commands: Vec<String> = first["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["command"].as_str().unwrap_or("").to_string())
        .collect();
    problems.extend(answers_against_the_oracle(
        &store,
        &first["expect"],
        &commands,
    ));

    // The crash: the sandbox is killed (and, being --rm, removed by docker).
    d.docker(&["kill", &id]).unwrap().ok().unwrap();
    assert!(
        host::eventually(Duration::from_secs(10), || host::container_processes(&id)
            .is_empty()
            .then_some(()))
        .is_some(),
        "processes survived docker kill: {:?}",
        host::container_processes(&id)
    );

    // Brought back from crab's newest checkpoint: exported as an image, run by docker. The
    // container went with the kill (--rm), and its rootfs layers with it: the base layers come
    // from the image it ran, the rest from crab's store.
    let image = format!("localhost/crab/it-msa-{}:latest", std::process::id());
    let export = d.crabctl(&["export", &id, "--base-image", AGENT_IMAGE, &image]);
    if export.status.success() {
        let second = episode(
            &d,
            &venv,
            "resume",
            &["--image", &image],
            &work.path().join("phase2.json"),
        );
        if let Some(id2) = second["container_id"].as_str() {
            guard.add(id2);
            guard.add_dir(
                PathBuf::from(DEFAULT_STATE_DIR)
                    .join(&d.env.namespace)
                    .join(id2),
            );
        }
        if second["exit_status"] != "Submitted" || second["failures"] != serde_json::json!([]) {
            problems.push(format!(
                "phase 2 after the restore: exit {}, failures {:#}",
                second["exit_status"], second["failures"]
            ));
        }
        let _ = d.docker(&["rmi", &image]);
    } else {
        problems.push(format!(
            "restore: `crabctl --namespace {} export {id} --base-image {AGENT_IMAGE} {image}` \
             after the kill: exit {}: {}",
            d.env.namespace,
            export.code(),
            export.stderr.trim()
        ));
    }

    d.assert_no_leaks(&id, None);
    assert!(
        problems.is_empty(),
        "mini-swe-agent on crab through Docker ({}):\n  {}",
        d.store.name(),
        problems.join("\n  ")
    );
}
