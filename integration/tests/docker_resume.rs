//! Docker's restart policies heal with crab: a container run with `--restart on-failure` and
//! `--annotation io.crab/resume=newest`, killed in the middle of a turn, is restarted by
//! dockerd (same container id, a new task) and comes back as of its last turn end: the files
//! the interrupted turn wrote are gone, the processes of the last turn end run again with
//! their memory, and the sandbox goes on checkpointing in the same store. What `docker cp` puts
//! into a sandbox (dockerd writes it, from outside the container) is in the next turn's
//! checkpoint and so survives the crash. Both Docker storage modes; the real dockerd,
//! containerd, runc and CRIU.

use std::time::Duration;

use crab_integration::docker::{DockerSandbox, DockerSandboxOptions, Store};
use crab_integration::host;
use crab_integration::sandbox::KV_SCRIPTS;

/// `(restart count, pid)` of the container, once it runs.
fn running(s: &DockerSandbox) -> Option<(u64, u32)> {
    let out =
        s.d.inspect(
            &s.id,
            "{{.RestartCount}} {{.State.Running}} {{.State.Restarting}} {{.State.Pid}}",
        )
        .ok()?;
    let f: Vec<&str> = out.split_whitespace().collect();
    match f.as_slice() {
        // While dockerd restarts it, Running is true too.
        [n, "true", "false", pid] => {
            Some((n.parse().ok()?, pid.parse().ok()?)).filter(|(_, p)| *p > 0)
        }
        _ => None,
    }
}

fn restart_policy_heals(store: Store) {
    let (mut s, _guard) = DockerSandbox::start(
        store,
        &format!("dres-{}", store.name()),
        DockerSandboxOptions {
            annotations: &[("io.crab/resume", "newest")],
            run_args: &["--restart", "on-failure"],
            ..DockerSandboxOptions::default()
        },
    );
    s.run(KV_SCRIPTS);
    s.run("mkdir -p /app/proj && echo v1 > /app/proj/a.txt");
    s.end_turn();
    s.wait_manifests(1);
    s.run("(nohup python3 /app/kv.py >/dev/null 2>&1 &) ; python3 /app/cli.py 'x = 41'");
    s.end_turn();
    s.run("python3 /app/cli.py 'x += 1' && echo v2 >> /app/proj/a.txt");
    s.end_turn();
    s.wait_manifests(3);
    // The interrupted turn: a file written, a file deleted, a process started, memory changed.
    s.run(
        "echo half > /app/interrupted.txt && rm /app/proj/a.txt && \
         (nohup sleep 1000 >/dev/null 2>&1 &) ; python3 /app/cli.py 'x = 0'",
    );
    let (_, pid) = running(&s).expect("it runs");
    // SAFETY: plain kill(2) of the container's init (not `docker kill`, which dockerd
    // remembers as a stop by hand and does not restart).
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let (restarts, new_pid) = host::eventually(Duration::from_secs(60), || {
        running(&s).filter(|(n, p)| *n >= 1 && *p != pid)
    })
    .unwrap_or_else(|| {
        panic!(
            "dockerd did not restart it ({}): {:?}",
            store.name(),
            s.d.inspect(&s.id, "{{json .State}}")
        )
    });
    assert_eq!(restarts, 1);
    assert_ne!(new_pid, pid);
    let state = s
        .run(
            "cat /app/proj/a.txt; ls /app/interrupted.txt 2>&1; python3 /app/cli.py 'x'; \
             ps -eo args | grep -c '^sleep 1000' || true",
        )
        .stdout;
    assert_eq!(
        state,
        "v1\nv2\nls: cannot access '/app/interrupted.txt': No such file or directory\n42\n0\n",
        "as of the last turn end ({})",
        store.name()
    );
    // The same store goes on: the restore recorded, then a new turn checkpointed.
    let lineage = s.lineage();
    let last = lineage.last().unwrap();
    assert_eq!(last["kind"], "restored", "{lineage:#?}");
    // The probe above was a turn (it asked the server, whose memory then changed).
    let taken = s.manifests().len();
    let probe = s.end_turn();
    assert_eq!(probe["kind"], "proc", "{probe:#}");
    let before = s.wait_manifests(taken + 1).len();
    s.run("echo v3 >> /app/proj/a.txt");
    let answer = s.end_turn();
    assert_eq!(answer["kind"], "fs", "{answer:#}");
    s.wait_manifests(before + 1);
    s.finish();
}

#[test]
fn overlay2_restart_policy_comes_back_as_of_the_last_turn_end() {
    restart_policy_heals(Store::Overlay2);
}

#[test]
fn containerd_store_restart_policy_comes_back_as_of_the_last_turn_end() {
    restart_policy_heals(Store::Containerd);
}

/// `docker cp` into a running sandbox: dockerd writes the files from outside the container
/// (chrooted into its rootfs), which the probes count for the container, so the next turn,
/// read-only as it is, answers `fs` and checkpoints them; after a crash they come back with
/// their modes. Without that they were lost at the first crash.
fn docker_cp_reaches_the_next_checkpoint(store: Store) {
    use std::os::unix::fs::PermissionsExt as _;
    let (mut s, _guard) = DockerSandbox::start(
        store,
        &format!("dcp-{}", store.name()),
        DockerSandboxOptions {
            annotations: &[
                ("io.crab/resume", "newest"),
                ("io.crab/turn-boundary", "exec"),
            ],
            run_args: &["--restart", "on-failure"],
            ..DockerSandboxOptions::default()
        },
    );
    s.run("echo one > /app/one");
    s.wait_manifests(1);
    // A repository upload: a file, an empty file, an empty directory, a private file.
    let upload = tempfile::tempdir().unwrap();
    let repo = upload.path().join("repo");
    std::fs::create_dir_all(repo.join("src/empty-dir")).unwrap();
    std::fs::write(repo.join("src/patch.diff"), "--- a\n+++ b\n").unwrap();
    std::fs::write(repo.join("EMPTY"), "").unwrap();
    std::fs::write(repo.join("secret.key"), "k").unwrap();
    std::fs::set_permissions(
        repo.join("secret.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let out =
        s.d.docker(&["cp", repo.to_str().unwrap(), &format!("{}:/app/repo", s.id)])
            .unwrap();
    assert!(
        out.status.success(),
        "docker cp: {}{}",
        out.stdout,
        out.stderr
    );
    // A read-only turn: what dockerd wrote is this turn's change.
    s.run("cat /app/one >/dev/null");
    let answers = host::eventually(Duration::from_secs(20), || {
        let a = s.answers();
        (a.len() >= 2).then_some(a)
    })
    .expect("two turn answers");
    let a = &answers[1];
    assert_eq!(a["kind"], "fs", "{} {a:#}", store.name());
    assert!(
        a["fs"]["syscalls"]["outside"].as_u64().unwrap_or(0) > 0,
        "counted as a change from outside: {a:#}"
    );
    let added = a["fs"]["added"].to_string();
    for p in [
        "app/repo/src/patch.diff",
        "app/repo/EMPTY",
        "app/repo/src/empty-dir",
    ] {
        assert!(added.contains(p), "{p} in the answer: {a:#}");
    }
    s.wait_manifests(2);
    // The crash: dockerd restarts it, resumed from the newest checkpoint.
    let (_, pid) = running(&s).expect("it runs");
    // SAFETY: plain kill(2) of the container's init.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    host::eventually(Duration::from_secs(60), || {
        running(&s).filter(|(n, p)| *n >= 1 && *p != pid)
    })
    .unwrap_or_else(|| panic!("dockerd did not restart it ({})", store.name()));
    let state = s
        .run(
            "cat /app/repo/src/patch.diff; stat -c '%n %a %s' /app/repo/EMPTY \
             /app/repo/secret.key; test -d /app/repo/src/empty-dir && echo dir",
        )
        .stdout;
    assert_eq!(
        state,
        "--- a\n+++ b\n/app/repo/EMPTY 644 0\n/app/repo/secret.key 600 1\ndir\n",
        "the upload came back ({})",
        store.name()
    );
    s.finish();
}

#[test]
fn overlay2_docker_cp_reaches_the_next_checkpoint() {
    docker_cp_reaches_the_next_checkpoint(Store::Overlay2);
}

#[test]
fn containerd_store_docker_cp_reaches_the_next_checkpoint() {
    docker_cp_reaches_the_next_checkpoint(Store::Containerd);
}
