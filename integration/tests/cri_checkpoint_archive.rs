//! The CRI's restore of a checkpoint archive through crab (issue 24): the kubelet's
//! CheckpointContainer writes an archive (CRIU's files, which crab's shim signs as it dumps
//! them, and the container's rw layer as `rootfs-diff.tar`); a CreateContainer whose image is
//! that archive restores it (containerd 2.1/2.2: it pulls the base image by digest, puts the
//! rootfs diff back between Create and Start, and hands the CRIU directory to the shim at
//! Create). Restored as written, the process goes on; with its rootfs diff altered, or its
//! signature taken out, the restore is refused with the reason and nothing runs.
//!
//! Needs containerd with the CRI plugin and the test images in its `k8s.io` namespace (as
//! tests/cri.rs), and Debian's `docker-registry` (the base image is pulled by digest from a
//! registry on 127.0.0.1).

use std::{path::Path, process::Command, time::Duration};

use crab_integration::{
    cri::{api, both, image_spec, Cri, PodGuard, BUSYBOX, CRI_NAMESPACE},
    ctr::Ctr,
    registry::Registry,
};

/// crab under its own runtime type. (The handler that runs crab's binary under runc's runtime
/// type, `runtime_path`, cannot restore through the CRI: containerd's restore leaves the
/// runtime path out of its task request and starts runc's stock shim binary, which answers
/// with the pod's crab shim at task API v3.)
const HANDLER: &str = "crab-v1";
const WAIT: Duration = Duration::from_secs(60);
const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done";

async fn count(cri: &Cri, id: &str) -> u64 {
    cri.sh(id, "cat /tmp/count")
        .await
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `sh -c script`, which must succeed.
fn sh(script: &str) {
    let out = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A copy of checkpoint archive `from` at `to`, with `edit` run (`sh -c`) in its unpacked
/// directory first. Entry names stay as the CRI writes them (no `./`).
fn edited(from: &Path, to: &Path, edit: &str) {
    let dir = to.with_extension("d");
    std::fs::create_dir_all(&dir).unwrap();
    sh(&format!(
        "cd '{d}' && tar -xf '{from}' && {edit} && tar -cf '{to}' *",
        d = dir.display(),
        from = from.display(),
        to = to.display()
    ));
}

/// Creates a container in `pod` whose image is the checkpoint archive `archive`, and starts
/// it: its id, and Start's outcome.
async fn restore(
    cri: &Cri,
    pod: &(String, api::PodSandboxConfig),
    name: &str,
    archive: &Path,
) -> (String, Result<(), String>) {
    let mut config = Cri::container_config(name, &[]);
    config.image = Some(image_spec(&archive.to_string_lossy()));
    let id = cri
        .create_container(&pod.0, &pod.1, config)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer from {}: {e}", archive.display()));
    let started = cri.start_container(&id).await.map_err(|e| e.to_string());
    (id, started)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_archive_restores_through_the_cri_only_as_it_was_written() {
    let cri = Cri::for_test().await;
    let registry = Registry::start();
    // The base image where the restore can pull it by digest: pushed to the registry under a
    // name of its own (the CRI runs the container from that name, already local).
    let ctr = Ctr::new(&crab_integration::TestEnv {
        namespace: CRI_NAMESPACE.into(),
        ..cri.env.clone()
    });
    // The CRI names an image by its first repo digest: none may be left from an earlier run's
    // registry (another port).
    let forget = || {
        let refs = ctr.run(&["images", "ls", "-q"]).unwrap().stdout;
        for r in refs
            .lines()
            .filter(|r| r.starts_with("127.0.0.1:") && r.contains("/crab/busybox"))
        {
            let _ = ctr.run(&["images", "rm", r]);
        }
    };
    forget();
    let base = format!("{}/crab/busybox:cri-restore", registry.addr);
    for args in [
        ["images", "tag", "--force", BUSYBOX, &base].as_slice(),
        &["images", "push", "--plain-http", &base],
        &["images", "rm", &base],
    ] {
        let out = ctr.run(args).unwrap();
        assert_eq!(out.code(), 0, "ctr {args:?}: {out:?}");
    }
    // Pulled through the CRI, as the kubelet would: the image gets its repo digest, which the
    // checkpoint names it by.
    cri.images()
        .pull_image(api::PullImageRequest {
            image: Some(image_spec(&base)),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("PullImage {base}: {e}"));
    let mut guard = PodGuard::new();
    let pod = both::pod(&cri, &mut guard, HANDLER, "cri-restore", |_| {}).await;
    let src = both::container(&cri, &pod, "counter", &["sh", "-c", COUNTER], |c| {
        c.image = Some(image_spec(&base));
    })
    .await;
    cri.sh_until_ok(&src, "[ \"$(cat /tmp/count)\" -ge 5 ]", WAIT)
        .await
        .unwrap();
    let dir = tempfile::tempdir_in(cri.env.crab_home.join("tmp")).unwrap();
    let archive = dir.path().join("checkpoint.tar");
    cri.runtime()
        .checkpoint_container(api::CheckpointContainerRequest {
            container_id: src.clone(),
            location: archive.to_string_lossy().into_owned(),
            timeout: 60,
        })
        .await
        .unwrap_or_else(|e| panic!("CheckpointContainer: {e}"));
    let at_checkpoint = count(&cri, &src).await;
    cri.stop_container(&src, 0).await.unwrap();
    cri.remove_container(&src).await.unwrap();

    // As written: restored, counting on from where it was, its rootfs checked.
    let (id, started) = restore(&cri, &pod, "restored", &archive).await;
    started.unwrap_or_else(|e| panic!("StartContainer of the restore: {e}"));
    let n = count(&cri, &id).await;
    assert!(
        n + 20 >= at_checkpoint && n > 0,
        "the count goes on ({n}, {at_checkpoint} at the checkpoint)"
    );
    let log = crab_integration::harness::log_excerpt(&cri.env, &id, 40);
    assert!(
        log.contains("containerd's checkpoint is signed by a trusted key")
            && log.contains("its rootfs is the image it was dumped on")
            && log.contains("its rw layer is the one it was dumped with")
            && log.contains("kernel check passed"),
        "{log}"
    );
    cri.stop_container(&id, 0).await.unwrap();
    cri.remove_container(&id).await.unwrap();

    // The rootfs diff with one more file: the processes would run on other files.
    let altered = dir.path().join("altered.tar");
    edited(
        &archive,
        &altered,
        "mkdir -p x/tmp && echo planted > x/tmp/planted && gzip -dc rootfs-diff.tar > d.tar \
         && tar -C x -rf d.tar tmp/planted && gzip -c d.tar > rootfs-diff.tar && rm -r d.tar x",
    );
    let (id, started) = restore(&cri, &pod, "altered", &altered).await;
    let e = started.expect_err("a restore with an altered rootfs diff started");
    assert!(
        e.contains("rw layer is not the one it was dumped with"),
        "{e}\n{}",
        crab_integration::harness::log_excerpt(&cri.env, &id, 40)
    );
    let status = cri.container_status(&id).await.unwrap();
    assert_ne!(
        status.state,
        api::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );
    cri.remove_container(&id).await.unwrap();

    // CRIU's files without crab's signature: no trusted key vouches for them.
    let unsigned = dir.path().join("unsigned.tar");
    edited(&archive, &unsigned, "rm checkpoint/crab-signature.json");
    let (id, started) = restore(&cri, &pod, "unsigned", &unsigned).await;
    let e = started.expect_err("an unsigned checkpoint started");
    assert!(e.contains("carries no signature"), "{e}");
    cri.remove_container(&id).await.unwrap();
    drop(guard);
    forget();
}
