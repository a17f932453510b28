//! Restore in Kubernetes: a pod whose container image is a crab checkpoint image, run with the
//! runtime handler `crab`, comes up restored through the CRI's own CreateContainer and
//! StartContainer (no special client), in the new pod's network namespace.
//!
//! The checkpoint comes from another pod, as it would in a cluster: turn ends reach the app
//! container through containerd's `Tasks.Update` in the CRI's namespace, and `crabctl export`
//! writes the image into that namespace, where the CRI finds it like any pulled image.

use std::path::Path;
use std::time::{Duration, Instant};

use crab_integration::cri::{api, Cri, PodGuard, CRI_NAMESPACE};
use crab_integration::TestEnv;

/// A loop whose only copy of `tok` and `i` is in the shell's memory; it writes them out so the
/// test can see that a restored process carries on from where it was dumped.
const COUNTER: &str = "tok=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \\n'); i=0; \
                       while :; do i=$((i+1)); echo \"$tok $i\" > /tmp/count; sleep 0.2; done";

/// What a fresh start of the restore pod's container would run instead of restoring.
const FRESH: &str = "echo fresh start; exec sleep 1000";

/// A busybox container config running `cmd` from `image` (in the kubelet's namespaces, as
/// [`Cri::container_config`] makes them: a checkpoint holds one container's process tree, so
/// its PID namespace must be the container's own).
fn container_config(name: &str, image: &str, cmd: &[&str]) -> api::ContainerConfig {
    let mut c = Cri::container_config(name, cmd);
    c.image = Some(crab_integration::cri::image_spec(image));
    c
}

/// `tok i` as the counter wrote it. The counter's `>` truncates before it writes: a read in
/// between finds the file empty (seen under load), so an empty read is tried again.
async fn counter(cri: &Cri, id: &str) -> (String, u64) {
    let mut out = String::new();
    for _ in 0..20 {
        out = cri.sh(id, "cat /tmp/count").await.unwrap();
        if !out.trim().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut parts = out.split_whitespace();
    let (Some(tok), Some(i)) = (parts.next(), parts.next()) else {
        panic!("/tmp/count of {id} holds {out:?}");
    };
    (
        tok.to_string(),
        i.parse().unwrap_or_else(|_| panic!("/tmp/count: {out:?}")),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn checkpoint_image_restores_in_a_new_pod() {
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();

    // The agent's pod: a long-lived process with state in memory, and a file the agent wrote.
    let src_pod = cri.pod_config("restore-src");
    let src_pod_id = cri.run_pod(&mut guard, "crab", &src_pod).await.unwrap();
    let src = cri
        .run_container(
            &src_pod_id,
            &src_pod,
            container_config(
                "agent",
                crab_integration::cri::BUSYBOX,
                &["sh", "-c", COUNTER],
            ),
        )
        .await
        .unwrap();
    // Past the inspector's baseline (taken while the container starts), so the turn sees the
    // counter run. (Memory a process changed before that baseline is not seen: see docs/status.md.)
    cri.sh_until_ok(
        &src,
        "test \"$(cut -d' ' -f2 /tmp/count)\" -ge 5",
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    cri.sh(&src, "echo agent-was-here > /root/note")
        .await
        .unwrap();
    let (tok, before) = counter(&cri, &src).await;

    // The turn ends through containerd's Tasks.Update in k8s.io, as a harness would send it.
    cri.end_turn(&src, "t1").await.unwrap();
    // The next action waits until the turn's checkpoint is durable.
    cri.sh(&src, "true").await.unwrap();
    assert_eq!(
        cri.checkpoint_kind(&src, "t1").as_deref(),
        Some("full"),
        "a new file and a live process with changed memory make a full checkpoint: {}",
        cri.crabctl(&["checkpoints", &src]).1
    );

    // The node is lost: the source pod goes away before the restore.
    let (image, _image_cleanup) =
        export_t1_and_drop_pod(&cri, &src_pod_id, &src, "cri-restore").await;

    // The new pod names the checkpoint image like any other image.
    let dst_pod = cri.pod_config("restore-dst");
    let dst_pod_id = cri.run_pod(&mut guard, "crab", &dst_pod).await.unwrap();
    let dst = cri
        .run_container(
            &dst_pod_id,
            &dst_pod,
            container_config("agent", &image, &["sh", "-c", FRESH]),
        )
        .await
        .unwrap();
    let status = cri.container_status(&dst).await.unwrap();
    assert_eq!(
        status.state,
        api::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );

    assert_eq!(
        cri.sh(&dst, "cat /root/note").await.unwrap(),
        "agent-was-here\n"
    );
    let init = cri
        .sh(&dst, "cat /proc/1/cmdline | tr '\\0' ' '")
        .await
        .unwrap();
    assert!(
        init.contains("while :"),
        "PID 1 is the restored counter, not a fresh start: {init:?}"
    );
    // The counter goes on from its dumped memory: same token, never below the value it had
    // before the checkpoint, and still counting.
    let (tok_after, after) = counter(&cri, &dst).await;
    assert_eq!(tok_after, tok, "the restored shell kept its token");
    assert!(
        after >= before,
        "counter went back from {before} to {after}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while counter(&cri, &dst).await.1 <= after {
        assert!(
            Instant::now() < deadline,
            "the restored counter does not count"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // It lives in the new pod's network namespace, with the new pod's address.
    let pod_ip = cri
        .pod_status(&dst_pod_id)
        .await
        .unwrap()
        .network
        .map(|n| n.ip)
        .unwrap_or_default();
    assert!(!pod_ip.is_empty(), "the restore pod has an address");
    let addrs = cri.sh(&dst, "ip -o -4 addr show").await.unwrap();
    assert!(
        addrs.contains(&format!("{pod_ip}/")),
        "container addresses {addrs:?} lack the pod's {pod_ip}"
    );
    let log = std::fs::read_to_string(Path::new(&dst_pod.log_directory).join("agent.log"))
        .unwrap_or_default();
    assert!(
        !log.contains("fresh start"),
        "the container was started fresh: {log}"
    );

    // The restored container carries on: its lineage begins with a `restored` origin, and its
    // next turn ends in a checkpoint of its own.
    cri.end_turn(&dst, "t2").await.unwrap();
    cri.sh(&dst, "true").await.unwrap();
    let (code, out, err) = cri.crabctl(&["checkpoints", &dst]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("restored"),
        "lineage of the restored container: {out}"
    );
    let kind = cri.checkpoint_kind(&dst, "t2");
    assert!(
        matches!(kind.as_deref(), Some("proc" | "full")),
        "the counter ran during t2, so its memory changed: {out}"
    );
}

/// Pods with their own user namespace (Kubernetes `hostUsers: false`), which crab takes as runc
/// does when registered with runc's runtime type: the agent's container runs as an unprivileged
/// host uid on id-mapped layers, and its turns are inspected and checkpointed like any other
/// (CRIU dumps the user-namespaced tree). Its files restore into another such pod, whose mapping
/// differs; its processes cannot (CRIU cannot restore a tree into an existing user namespace):
/// that start is refused before anything runs, with what to do instead, and the pod runs on.
#[tokio::test(flavor = "multi_thread")]
async fn a_user_namespaced_pod_checkpoints_and_its_files_restore_in_another() {
    let (src_host, dst_host) = (1_000_000, 1_200_000);
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let mut src_pod = cri.pod_config("userns-src");
    let mut src_config = container_config(
        "agent",
        crab_integration::cri::BUSYBOX,
        &["sleep", "100000"],
    );
    in_userns(src_host, &mut src_pod, &mut src_config);
    let src_pod_id = cri.run_pod(&mut guard, "crab", &src_pod).await.unwrap();
    let src = cri
        .run_container(&src_pod_id, &src_pod, src_config)
        .await
        .unwrap();
    let pid = cri.container_pid(&src).await.unwrap();
    assert_eq!(
        host_uid(pid),
        src_host.to_string(),
        "the agent's root on the host"
    );

    // A file only: a filesystem checkpoint.
    cri.sh(&src, "echo agent-was-here > /root/note")
        .await
        .unwrap();
    cri.end_turn(&src, "t1").await.unwrap();
    cri.sh(&src, "true").await.unwrap();
    assert_eq!(
        cri.checkpoint_kind(&src, "t1").as_deref(),
        Some("fs"),
        "{}",
        cri.crabctl(&["checkpoints", &src]).1
    );
    // A process left running: a process checkpoint of the user-namespaced tree.
    cri.sh(&src, "sleep 100000 </dev/null >/dev/null 2>&1 &")
        .await
        .unwrap();
    cri.end_turn(&src, "t2").await.unwrap();
    cri.sh(&src, "true").await.unwrap();
    let kind = cri.checkpoint_kind(&src, "t2");
    assert!(
        matches!(kind.as_deref(), Some("proc" | "full")),
        "a new process makes a process checkpoint: {}",
        cri.crabctl(&["checkpoints", &src]).1
    );

    let pid = std::process::id();
    let (files, procs) = (
        format!("localhost/crab/cri-userns-fs:{pid}"),
        format!("localhost/crab/cri-userns-proc:{pid}"),
    );
    let mut cleanups = Vec::new();
    for (turn, image) in [("t1", &files), ("t2", &procs)] {
        let (code, out, err) = cri.crabctl(&["export", &src, "--turn", turn, image]);
        assert_eq!(code, 0, "crabctl export {turn}: {out}{err}");
        cleanups.push(ImageCleanup {
            env: cri.env.clone(),
            image: image.clone(),
        });
    }

    // The files come back in a pod with another mapping: owned by the new pod's root.
    let mut dst_pod = cri.pod_config("userns-dst");
    let mut dst_config = container_config("files", &files, &["sh", "-c", FRESH]);
    in_userns(dst_host, &mut dst_pod, &mut dst_config);
    let dst_pod_id = cri.run_pod(&mut guard, "crab", &dst_pod).await.unwrap();
    let dst = cri
        .run_container(&dst_pod_id, &dst_pod, dst_config)
        .await
        .unwrap();
    let pid = cri.container_pid(&dst).await.unwrap();
    assert_eq!(
        host_uid(pid),
        dst_host.to_string(),
        "the restored root on the host"
    );
    assert_eq!(
        cri.sh(
            &dst,
            "cat /root/note; cat /proc/self/uid_map | tr -s ' ' | sed 's/^ //'; stat -c '%u:%g' /root/note"
        )
        .await
        .unwrap(),
        format!("agent-was-here\n0 {dst_host} 65536\n0:0\n"),
        "the note, the uid map and the note's owner in the new pod"
    );

    // The processes cannot: refused at create, naming the reason and what works.
    let mut config = container_config("procs", &procs, &["sh", "-c", FRESH]);
    in_userns(dst_host, &mut dst_pod, &mut config);
    let err = cri
        .run_container(&dst_pod_id, &dst_pod, config)
        .await
        .expect_err("a process image started in a user-namespaced pod");
    let err = err.to_string();
    assert!(
        err.contains("user namespace") && err.contains("fs-every-turn"),
        "{err}"
    );
    // The pod and its other container run on.
    assert_eq!(
        cri.sh(&dst, "cat /root/note").await.unwrap(),
        "agent-was-here\n"
    );
    drop(cleanups);
}

/// A pod-wide user namespace mapping container ids 0..65536 to host ids from `host`.
fn userns(host: u32) -> api::NamespaceOption {
    let mapping = || api::IdMapping {
        host_id: host,
        container_id: 0,
        length: 65536,
    };
    api::NamespaceOption {
        userns_options: Some(api::UserNamespace {
            mode: api::NamespaceMode::Pod as i32,
            uids: vec![mapping()],
            gids: vec![mapping()],
        }),
        ..crab_integration::cri::kubelet_namespaces()
    }
}

/// Puts a pod config and a container config of it in the user namespace of `host`.
fn in_userns(host: u32, pod: &mut api::PodSandboxConfig, c: &mut api::ContainerConfig) {
    crab_integration::cri::both::pod_sc(pod).namespace_options = Some(userns(host));
    crab_integration::cri::both::linux_sc(c).namespace_options = Some(userns(host));
}

/// The host uid of `pid` (`Uid:` of /proc/PID/status, the real one).
fn host_uid(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
        .to_string()
}

/// Issue 16, item 1, through the CRI: a checkpoint of a privileged container (crab's own,
/// signed export) is refused in a pod whose container is not privileged, with the reason in
/// the status the kubelet would show; in a privileged pod it restores.
#[tokio::test(flavor = "multi_thread")]
async fn a_privileged_checkpoint_is_refused_in_an_unprivileged_pod() {
    use crab_integration::cri::both::{linux_sc, pod_sc};
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let mut src_pod = cri.pod_config("priv-src");
    pod_sc(&mut src_pod).privileged = true;
    let src_pod_id = cri.run_pod(&mut guard, "crab", &src_pod).await.unwrap();
    let mut config = container_config(
        "agent",
        crab_integration::cri::BUSYBOX,
        &["sh", "-c", COUNTER],
    );
    linux_sc(&mut config).privileged = true;
    let src = cri
        .run_container(&src_pod_id, &src_pod, config)
        .await
        .unwrap();
    cri.sh_until_ok(
        &src,
        "test \"$(cut -d' ' -f2 /tmp/count)\" -ge 5",
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    let caps = cri.sh(&src, "grep CapEff /proc/1/status").await.unwrap();
    let eff = u64::from_str_radix(caps.split_whitespace().nth(1).unwrap_or(""), 16).unwrap_or(0);
    assert_ne!(
        eff & 1 << 21,
        0,
        "the source runs privileged (CAP_SYS_ADMIN): {caps}"
    );
    cri.end_turn(&src, "t1").await.unwrap();
    cri.sh(&src, "true").await.unwrap();
    assert!(
        matches!(
            cri.checkpoint_kind(&src, "t1").as_deref(),
            Some("proc" | "full")
        ),
        "{}",
        cri.crabctl(&["checkpoints", &src]).1
    );
    let (image, _image_cleanup) =
        export_t1_and_drop_pod(&cri, &src_pod_id, &src, "cri-restore-priv").await;

    // An ordinary pod (the kubelet's defaults) naming the image: StartContainer fails, and the
    // reason is what the kubelet would show.
    let dst_pod = cri.pod_config("priv-dst");
    let dst_pod_id = cri.run_pod(&mut guard, "crab", &dst_pod).await.unwrap();
    let id = cri
        .create_container(
            &dst_pod_id,
            &dst_pod,
            container_config("agent", &image, &["sh", "-c", FRESH]),
        )
        .await
        .unwrap();
    let err = cri.start_container(&id).await.unwrap_err().to_string();
    assert!(
        err.contains("asks for more privilege than the container's spec grants")
            && err.contains("CAP_SYS_ADMIN"),
        "{err}"
    );
    let status = cri.container_status(&id).await.unwrap();
    assert_ne!(
        status.state,
        api::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );

    // A privileged pod restores it: the counter goes on.
    let mut ok_pod = cri.pod_config("priv-ok");
    pod_sc(&mut ok_pod).privileged = true;
    let ok_pod_id = cri.run_pod(&mut guard, "crab", &ok_pod).await.unwrap();
    let mut config = container_config("agent", &image, &["sh", "-c", FRESH]);
    linux_sc(&mut config).privileged = true;
    let ok = cri
        .run_container(&ok_pod_id, &ok_pod, config)
        .await
        .unwrap();
    let init = cri
        .sh(&ok, "cat /proc/1/cmdline | tr '\\0' ' '")
        .await
        .unwrap();
    assert!(
        init.contains("while :"),
        "PID 1 is the restored counter: {init:?}"
    );
}

/// Many pods from one checkpoint image (RL rollouts) ask for same-page merging with the pod
/// annotation `io.crab/merge-memory: "true"`, which the handler passes to the container's spec
/// (`pod_annotations = ["io.crab/*"]`): the restored processes of such a pod are marked for
/// the kernel's KSM (`ksm_merge_any`), those of a pod without it are not, and a value that is
/// neither `true` nor `false` fails the pod's start with the annotation's name.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_annotated_merge_memory_restores_with_mergeable_memory() {
    assert!(
        crab_shim::sys::ksm::merge_any_supported(),
        "this kernel has no PR_SET_MEMORY_MERGE (Linux 6.4): the test needs it"
    );
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let src_pod = cri.pod_config("ksm-src");
    let src_pod_id = cri.run_pod(&mut guard, "crab", &src_pod).await.unwrap();
    let src = cri
        .run_container(
            &src_pod_id,
            &src_pod,
            container_config(
                "agent",
                crab_integration::cri::BUSYBOX,
                &["sh", "-c", COUNTER],
            ),
        )
        .await
        .unwrap();
    cri.sh_until_ok(
        &src,
        "test \"$(cut -d' ' -f2 /tmp/count)\" -ge 5",
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    let src_init = cri.container_pid(&src).await.unwrap();
    assert!(
        !crab_shim::sys::ksm::stat(src_init).unwrap().merge_any,
        "a pod without the annotation is not marked"
    );
    cri.end_turn(&src, "t1").await.unwrap();
    cri.sh(&src, "true").await.unwrap();
    assert!(
        matches!(
            cri.checkpoint_kind(&src, "t1").as_deref(),
            Some("proc" | "full")
        ),
        "{}",
        cri.crabctl(&["checkpoints", &src]).1
    );
    let (image, _image_cleanup) =
        export_t1_and_drop_pod(&cri, &src_pod_id, &src, "cri-restore-ksm").await;

    let pod_with = |name: &str, value: Option<&str>| {
        let mut pod = cri.pod_config(name);
        if let Some(v) = value {
            pod.annotations
                .insert("io.crab/merge-memory".to_string(), v.to_string());
        }
        pod
    };
    // Marked: the restored counter and every process it starts.
    let merged_pod = pod_with("ksm-merged", Some("true"));
    let merged_pod_id = cri.run_pod(&mut guard, "crab", &merged_pod).await.unwrap();
    let merged = cri
        .run_container(
            &merged_pod_id,
            &merged_pod,
            container_config("agent", &image, &["sh", "-c", FRESH]),
        )
        .await
        .unwrap();
    let init = cri
        .sh(&merged, "cat /proc/1/cmdline | tr '\\0' ' '")
        .await
        .unwrap();
    assert!(
        init.contains("while :"),
        "PID 1 is the restored counter: {init:?}"
    );
    let pid = cri.container_pid(&merged).await.unwrap();
    let st = crab_shim::sys::ksm::stat(pid).unwrap();
    assert!(
        st.merge_any,
        "the restored init of an annotated pod is marked: {st:?}"
    );
    let (tok, _) = counter(&cri, &merged).await;
    assert_eq!(tok.len(), 16, "the restored counter writes its token");

    // Not marked: the same image in a pod without the annotation.
    let plain_pod = pod_with("ksm-plain", None);
    let plain_pod_id = cri.run_pod(&mut guard, "crab", &plain_pod).await.unwrap();
    let plain = cri
        .run_container(
            &plain_pod_id,
            &plain_pod,
            container_config("agent", &image, &["sh", "-c", FRESH]),
        )
        .await
        .unwrap();
    let pid = cri.container_pid(&plain).await.unwrap();
    let st = crab_shim::sys::ksm::stat(pid).unwrap();
    assert!(
        !st.merge_any,
        "a restored init without the annotation is not: {st:?}"
    );

    // Refused: a value that is neither true nor false. The pod's own sandbox container carries
    // the annotation too, so RunPodSandbox fails, with the annotation's name and the code.
    let bad_pod = pod_with("ksm-bad", Some("yes"));
    let err = cri
        .run_pod(&mut guard, "crab", &bad_pod)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("InvalidArgument")
            && err.contains("io.crab/merge-memory")
            && err.contains("neither true nor false"),
        "{err}"
    );
}

/// Exports turn `t1` of container `src` as image `localhost/crab/<name>:<pid>` into the CRI's
/// namespace (removed again when the guard drops), then removes the source pod, as a lost
/// node would: the image is all that is left.
async fn export_t1_and_drop_pod(
    cri: &Cri,
    src_pod_id: &str,
    src: &str,
    name: &str,
) -> (String, ImageCleanup) {
    let image = format!("localhost/crab/{name}:{}", std::process::id());
    let (code, out, err) = cri.crabctl(&["export", src, "--turn", "t1", &image]);
    assert_eq!(code, 0, "crabctl export: {out}{err}");
    let cleanup = ImageCleanup {
        env: cri.env.clone(),
        image: image.clone(),
    };
    cri.stop_pod(src_pod_id).await.unwrap();
    cri.remove_pod(src_pod_id).await.unwrap();
    (image, cleanup)
}

/// Removes the exported image from the CRI's namespace, also when the test fails.
struct ImageCleanup {
    env: TestEnv,
    image: String,
}

impl Drop for ImageCleanup {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ctr")
            .arg("--address")
            .arg(&self.env.address)
            .args(["-n", CRI_NAMESPACE, "images", "rm", &self.image])
            .output();
    }
}
