//! Pods under the CRI: one shim process serves a whole pod (the pause container and every app
//! container), as containerd's runc shim does, and only app containers are inspected and
//! checkpointed; the pause container is infrastructure.

use crab_integration::cri::{Cri, PodGuard, CRI_NAMESPACE, HANDLERS};
use crab_integration::{host, TestEnv};

/// The parent of `pid`, from `/proc/PID/stat` (after the command name, which may hold spaces).
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The ids the shims of the CRI namespace serve under (`-id`), with their pids.
fn cri_shims(env: &TestEnv) -> Vec<(String, i32)> {
    host::shims_of(&env.address)
        .into_iter()
        .filter(|(_, p)| {
            p.argv
                .windows(2)
                .any(|w| w[0] == "-namespace" && w[1] == CRI_NAMESPACE)
        })
        .map(|(id, p)| (id, p.pid))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_shim_per_pod_for_both_handlers() {
    let cri = Cri::for_test().await;
    for handler in HANDLERS {
        let mut guard = PodGuard::new();
        let pod = cri.pod_config(&format!("shims-{handler}"));
        let pod_id = cri.run_pod(&mut guard, handler, &pod).await.unwrap();
        let mut apps = Vec::new();
        for name in ["one", "two"] {
            let c = Cri::container_config(name, &["sleep", "100000"]);
            apps.push(cri.run_container(&pod_id, &pod, c).await.unwrap());
        }
        let shims = cri_shims(&cri.env);
        let of_pod: Vec<_> = shims.iter().filter(|(id, _)| *id == pod_id).collect();
        assert_eq!(
            of_pod.len(),
            1,
            "handler {handler}: one shim for pod {pod_id}, have {shims:?}"
        );
        for app in &apps {
            assert!(
                !shims.iter().any(|(id, _)| id == app),
                "handler {handler}: app container {app} got a shim of its own: {shims:?}"
            );
        }
        // The pod's shim is the parent of the pod's containers' init processes.
        let shim_pid = of_pod[0].1;
        for app in &apps {
            let status = cri.container_status(app).await.unwrap();
            assert_eq!(
                status.state,
                crab_integration::cri::api::ContainerState::ContainerRunning as i32
            );
            let inits: Vec<_> = host::container_processes(app)
                .into_iter()
                .filter(|p| ppid(p.pid) == Some(shim_pid))
                .collect();
            assert_eq!(
                inits.len(),
                1,
                "handler {handler}: {app}'s init is a child of the pod's shim {shim_pid}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn only_app_containers_are_inspected() {
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let pod = cri.pod_config("inspected");
    let pod_id = cri.run_pod(&mut guard, "crab", &pod).await.unwrap();
    let app = cri
        .run_container(
            &pod_id,
            &pod,
            Cri::container_config("app", &["sleep", "100000"]),
        )
        .await
        .unwrap();

    cri.sh(&app, "echo kept > /root/file").await.unwrap();
    cri.end_turn(&app, "t1").await.unwrap();
    cri.sh(&app, "true").await.unwrap();
    assert_eq!(
        cri.checkpoint_kind(&app, "t1").as_deref(),
        Some("fs"),
        "the app container's turn made an fs checkpoint: {}",
        cri.crabctl(&["checkpoints", &app]).1
    );

    // The pause container takes no turn ends and has no store.
    let err = cri.end_turn(&pod_id, "t1").await.unwrap_err();
    assert_eq!(
        err.grpc_code(),
        Some(tonic::Code::FailedPrecondition),
        "{err}"
    );
    assert!(
        err.to_string().contains("pause container"),
        "the refusal says why: {err}"
    );
    let (code, out, err) = cri.crabctl(&["checkpoints", &pod_id]);
    assert_ne!(code, 0, "the sandbox has no checkpoints: {out}{err}");
}
