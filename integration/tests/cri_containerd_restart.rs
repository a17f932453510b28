//! The CRI across a restart of containerd, with handler `crab` as with `runc`: pods and containers
//! keep running, the restarted CRI finds them again (state, ExecSync, Stop, Remove), and a
//! container that exited while containerd was down is reported with its exit code. Its own test
//! binary: it restarts the private containerd that every other test uses.

use std::path::Path;
use std::time::{Duration, Instant};

use crab_integration::cri::{api, Cri, PodGuard, HANDLERS};

const WAIT: Duration = Duration::from_secs(60);

fn hack_containerd(home: &Path, cmd: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/containerd.sh");
    let out = std::process::Command::new(script)
        .arg(cmd)
        .env("CRAB_HOME", home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "hack/containerd.sh {cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Marks the command line of one handler's waiter, so the host can see when it is gone.
fn waiter_token(handler: &str) -> String {
    format!("crab-restart-waiter-{handler}-{}", std::process::id())
}

struct Pod {
    handler: &'static str,
    id: String,
    config: api::PodSandboxConfig,
    sleeper: String,
    /// Exits with 5 once `go` appears in `trigger` (a host directory it mounts).
    waiter: String,
    trigger: tempfile::TempDir,
}

async fn start_pod(cri: &Cri, guard: &mut PodGuard, handler: &'static str) -> Pod {
    let config = cri.pod_config(&format!("restart-{handler}"));
    let id = cri.run_pod(guard, handler, &config).await.unwrap();
    let sleeper = cri
        .run_container(
            &id,
            &config,
            Cri::container_config("sleeper", &["sleep", "3600"]),
        )
        .await
        .unwrap();
    let scratch = cri.env.crab_home.join("tmp");
    std::fs::create_dir_all(&scratch).unwrap();
    let trigger = tempfile::tempdir_in(&scratch).unwrap();
    let script = format!(
        "until [ -e /trigger/go ]; do sleep 0.1; done; exit 5; : {}",
        waiter_token(handler)
    );
    let mut waiter_config = Cri::container_config("waiter", &["sh", "-c", &script]);
    waiter_config.mounts.push(api::Mount {
        container_path: "/trigger".into(),
        host_path: trigger.path().to_string_lossy().into_owned(),
        ..Default::default()
    });
    let waiter = cri
        .run_container(&id, &config, waiter_config)
        .await
        .unwrap();
    Pod {
        handler,
        id,
        config,
        sleeper,
        waiter,
        trigger,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cri_state_survives_a_containerd_restart() {
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let mut pods = Vec::new();
    for handler in HANDLERS {
        pods.push(start_pod(&cri, &mut guard, handler).await);
    }

    let home = cri.env.crab_home.clone();
    let pid: i32 = std::fs::read_to_string(home.join("run/containerd.pid"))
        .expect("the private containerd's pid file (hack/containerd.sh start)")
        .trim()
        .parse()
        .unwrap();
    // SAFETY: plain kill(2) of the private containerd the suite started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let t0 = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(t0.elapsed() < WAIT, "containerd {pid} survives SIGKILL");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Exits nobody is listening for: the shims must keep them for the restarted containerd.
    for pod in &pods {
        std::fs::write(pod.trigger.path().join("go"), "").unwrap();
    }
    for pod in &pods {
        let t0 = Instant::now();
        while alive(&waiter_token(pod.handler)) {
            assert!(
                t0.elapsed() < WAIT,
                "handler {}: the waiter ignores its trigger",
                pod.handler
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    hack_containerd(&home, "start");

    // The CRI plugin may still be loading its state when the socket answers.
    let t0 = Instant::now();
    let mut waiter_outcomes = Vec::new();
    let cri = loop {
        match Cri::connect().await {
            Ok(cri) => break cri,
            Err(e) if t0.elapsed() > WAIT => panic!("CRI after containerd's restart: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    for pod in &pods {
        let h = pod.handler;
        let status = cri.pod_status(&pod.id).await.unwrap();
        assert_eq!(
            status.state,
            api::PodSandboxState::SandboxReady as i32,
            "handler {h}: pod after containerd's restart: {status:?}"
        );
        let sleeper = cri.container_status(&pod.sleeper).await.unwrap();
        assert_eq!(
            sleeper.state,
            api::ContainerState::ContainerRunning as i32,
            "handler {h}: running container after containerd's restart: {sleeper:?}"
        );
        let out = cri
            .sh(&pod.sleeper, "echo still here")
            .await
            .unwrap_or_else(|e| panic!("handler {h}: ExecSync after containerd's restart: {e}"));
        assert_eq!(out, "still here\n", "handler {h}");
        let waiter = cri
            .wait_exited(&pod.waiter, WAIT)
            .await
            .unwrap_or_else(|e| {
                panic!("handler {h}: container that exited during the restart: {e}")
            });
        // containerd 2.1 does not learn the code of an exit it missed, even from its own runc
        // shim (seen: 255, "Unknown"); crab must report what runc's shim does.
        waiter_outcomes.push((h, waiter.exit_code, waiter.reason.clone()));
        // A new container in the recovered pod, and a stop the restarted containerd drives.
        let late = cri
            .run_container(
                &pod.id,
                &pod.config,
                Cri::container_config("late", &["sleep", "3600"]),
            )
            .await
            .unwrap_or_else(|e| panic!("handler {h}: new container in a recovered pod: {e}"));
        assert_eq!(
            cri.sh(&late, "echo late").await.unwrap(),
            "late\n",
            "handler {h}"
        );
        cri.stop_container(&pod.sleeper, 1).await.unwrap();
        let stopped = cri.container_status(&pod.sleeper).await.unwrap();
        assert_eq!(
            (stopped.state, stopped.exit_code),
            (api::ContainerState::ContainerExited as i32, 137),
            "handler {h}: stopped after the restart: {stopped:?}"
        );
        cri.stop_pod(&pod.id).await.unwrap();
        cri.remove_pod(&pod.id).await.unwrap();
        let t0 = Instant::now();
        while !crab_integration::host::shim_processes(&pod.id).is_empty() {
            assert!(
                t0.elapsed() < WAIT,
                "handler {h}: the pod's shim outlives RemovePodSandbox by {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let (reference, crab) = (&waiter_outcomes[0], &waiter_outcomes[1]);
    assert_eq!(
        (crab.1, &crab.2),
        (reference.1, &reference.2),
        "exit code and reason of a container that exited while containerd was down: {} vs {}",
        crab.0,
        reference.0
    );
}

/// True while a process with `token` in its command line lives (zombies have none).
fn alive(token: &str) -> bool {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| c.windows(token.len()).any(|w| w == token.as_bytes()))
        })
}
