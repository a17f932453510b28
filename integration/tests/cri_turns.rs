//! Turn ends in Kubernetes: a pod run through the CRI with the runtime handler `crab`, its app
//! container's turn ended by `crabctl --namespace k8s.io turn-end --pod P --container C` (a
//! `Tasks.Update` with the turn annotation in the CRI's containerd namespace), and its store
//! found through the container's runtime options (the CRI handler's `ConfigPath`), with no
//! `--config`.
//!
//! Needs the private containerd with the CRI (`hack/containerd.sh start`, CRI on by default) and
//! the test images in k8s.io (`hack/build-images.sh import k8s.io`).

use std::time::Duration;

use crab_integration::cri::{api, image_spec, Cri, PodGuard, CRI_NAMESPACE, POD_NAMESPACE};

/// How long a checkpoint may take to become visible (off the critical path, on a loaded box).
const CHECKPOINT_WITHIN: Duration = Duration::from_secs(60);

/// `args` with the pod's container named in place of an id.
fn by_name<'a>(
    command: &'a str,
    pod: &'a str,
    container: &'a str,
    rest: &[&'a str],
) -> Vec<&'a str> {
    let mut v = vec![
        command,
        "--pod",
        pod,
        "--pod-namespace",
        POD_NAMESPACE,
        "--container",
        container,
    ];
    v.extend_from_slice(rest);
    v
}

/// Polls `crabctl checkpoints` until a line of `turn` shows a checkpoint of `kind`.
async fn wait_checkpoint(cri: &Cri, pod: &str, container: &str, turn: &str, kind: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        let (code, out, err) = cri.crabctl(&by_name("checkpoints", pod, container, &[]));
        let found = out.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[2] == turn && f[3] == kind
        });
        if code == 0 && found {
            return out;
        }
        assert!(
            start.elapsed() < CHECKPOINT_WITHIN,
            "no {kind} checkpoint of turn {turn} after {CHECKPOINT_WITHIN:?}: {code} {out}{err}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn crabctl_ends_turns_of_a_pods_container_by_name() {
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let pod_config = cri.pod_config("turns");
    let pod = pod_config.metadata.as_ref().unwrap().name.clone();
    let pod_id = cri.run_pod(&mut guard, "crab", &pod_config).await.unwrap();
    let app = cri
        .run_container(
            &pod_id,
            &pod_config,
            Cri::container_config("app", &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.sh(&app, "echo hello > /greeting").await.unwrap();

    let (code, out, err) = cri.crabctl(&by_name("turn-end", &pod, "app", &["--turn", "t1"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("turn t1 of {app} ended")), "{out}");
    let lineage = wait_checkpoint(&cri, &pod, "app", "t1", "fs").await;
    // The same store by id, and the turn's answer through `turns` and `show`.
    let (code, by_id, err) = cri.crabctl(&["checkpoints", &app]);
    assert_eq!((code, by_id.as_str()), (0, lineage.as_str()), "{err}");
    let (code, out, err) = cri.crabctl(&by_name("turns", &pod, "app", &[]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.lines()
            .any(|l| l.contains(" t1 ") && l.contains(" fs ")),
        "{out}"
    );
    let (code, out, err) = cri.crabctl(&by_name("show", &pod, "app", &["t1"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("/greeting"), "{out}");

    // A checkpoint leaves as an image (to run as a pod); replacing the task behind the CRI's
    // back is refused (the CRI would delete the new task when it handles the old one's exit).
    let reference = format!("localhost/crab/{pod}:t1");
    let (code, out, err) = cri.crabctl(&by_name(
        "export",
        &pod,
        "app",
        &["--turn", "t1", &reference],
    ));
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("exported {CRI_NAMESPACE}/{app} checkpoint")),
        "{out}"
    );
    let removed = cri
        .images()
        .remove_image(api::RemoveImageRequest {
            image: Some(image_spec(&reference)),
        })
        .await;
    assert!(removed.is_ok(), "{removed:?}");
    for (op, rest) in [
        ("rollback", &["--to", "t1"][..]),
        ("recover", &[]),
        ("fork", &["--at", "t1", "--count", "1"]),
    ] {
        let (code, _, err) = cri.crabctl(&by_name(op, &pod, "app", rest));
        assert_eq!(code, 4, "{op} is refused: {err}");
        assert!(
            err.contains("run by Kubernetes through the CRI"),
            "{op}: {err}"
        );
    }
    let status = cri.container_status(&app).await.unwrap();
    assert_eq!(
        status.state,
        api::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );

    // The pause container is neither inspected nor checkpointed: no store, and not addressable
    // by name.
    // (Exit statuses: 3 not found, 4 refused.)
    let (code, _, err) = cri.crabctl(&["checkpoints", &pod_id]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("no checkpoint store"), "{err}");
    let (code, _, err) = cri.crabctl(&["turn-end", &pod_id]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("is not inspected"), "{err}");
    let (code, _, err) = cri.crabctl(&by_name("turn-end", &pod, "POD", &[]));
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("sandbox (pause) container") && err.contains("its containers: app"),
        "{err}"
    );

    // Wrong names say what there is.
    let (code, _, err) = cri.crabctl(&by_name("turn-end", &pod, "web", &[]));
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("has no container web; its containers: app"),
        "{err}"
    );
    let (code, _, err) = cri.crabctl(&by_name("turn-end", "no-such-pod", "app", &[]));
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("no pod crab-cri-test/no-such-pod")
            && err.contains(&format!("{POD_NAMESPACE}/{pod}")),
        "{err}"
    );
    let (code, _, err) = cri.crabctl(&["turn-end", "--pod", &pod]);
    assert_eq!(code, 2, "{err}");

    // A restart, as the kubelet does it: the exited attempt stays, attempt 1 runs. The name
    // now means the running one, which has a store of its own.
    cri.stop_container(&app, 0).await.unwrap();
    let mut again = Cri::container_config("app", &["sleep", "3600"]);
    again.metadata.as_mut().unwrap().attempt = 1;
    let restarted = cri
        .run_container(&pod_id, &pod_config, again)
        .await
        .unwrap();
    cri.sh(&restarted, "echo again > /second").await.unwrap();
    let (code, out, err) = cri.crabctl(&by_name("turn-end", &pod, "app", &["--turn", "t2"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("turn t2 of {restarted} ended")),
        "{out}"
    );
    wait_checkpoint(&cri, &pod, "app", "t2", "fs").await;
    let (code, old, _) = cri.crabctl(&["checkpoints", &app]);
    assert!(code == 0 && !old.contains(" t2 "), "{old}");
}
