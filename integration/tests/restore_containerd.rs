//! containerd's own checkpoint path under crab (issue 24, item 1): `ctr c checkpoint --task`
//! dumps through the shim's Tasks.Checkpoint, `ctr c restore --live` restores through
//! `CreateTaskRequest.checkpoint`. The restore goes through the same trust decision as crab's
//! own images: crab signs the CRIU directory it dumps for containerd, a checkpoint no trusted
//! key signed is refused by default, `[restore] unsigned_images` says otherwise
//! (`kernel-check`: restored on the kernel check alone; `start-fresh`: the container starts
//! without its processes), and the kernel check runs on every restore.

use std::{path::Path, time::Duration};

use crab_integration::{env::BUSYBOX_IMAGE, Harness};

const CRAB: &str = "io.containerd.crab.v1";
/// The process: counts into /tmp/n (kept by `--rw`) five times a second.
const COUNTER: &str = "n=0; while :; do n=$((n+1)); echo $n > /tmp/n; sleep 0.2; done";

fn write_config(path: &Path, state: &Path, restore: &str) {
    std::fs::write(
        path,
        format!(
            "[store]\nstate_dir = \"{}\"\n[checkpoint]\nrestore_timeout_ms = 30000\n[restore]\n{restore}",
            state.display()
        ),
    )
    .unwrap();
}

/// `/tmp/n` of task `id`, once it reads as a number.
fn count(h: &Harness, id: &str) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = h
            .ctr()
            .run(&["tasks", "exec", "--exec-id", "probe", id, "cat", "/tmp/n"])
            .unwrap();
        if let Ok(n) = out.stdout.trim().parse::<u64>() {
            return n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no count in {id}: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn remove(h: &Harness, id: &str) {
    let ctr = h.ctr();
    let _ = ctr.run(&["tasks", "kill", "-s", "SIGKILL", id]);
    std::thread::sleep(Duration::from_millis(300));
    let _ = ctr.run(&["tasks", "rm", "-f", id]);
    let _ = ctr.run(&["containers", "rm", id]);
}

/// `ctr c restore --live --rw` of `reference` as `id`: (exit code, output).
fn restore(h: &Harness, reference: &str, id: &str) -> (i32, String) {
    let out = h
        .ctr()
        .run(&["containers", "restore", "--live", "--rw", id, reference])
        .unwrap();
    (out.code(), format!("{}{}", out.stdout, out.stderr))
}

/// `ctr run -d` of `image` as `src` under crab (config file `config`, more `ctr run` flags in
/// `flags`) running [`COUNTER`]; once it has counted to `at_least`, `ctr c checkpoint --task
/// --rw` of it as `localhost/crab-ckpt/<src>:1`. Returns the reference and the count at the
/// checkpoint; the container stays.
fn counter_checkpointed(
    h: &Harness,
    config: &Path,
    flags: &[&str],
    image: &str,
    src: &str,
    at_least: u64,
) -> (String, u64) {
    let ctr = h.ctr();
    let mut args = vec!["run", "-d"];
    args.extend(flags);
    let config = config.to_str().unwrap();
    args.extend([
        "--runtime",
        CRAB,
        "--runtime-config-path",
        config,
        image,
        src,
        "sh",
        "-c",
        COUNTER,
    ]);
    let run = ctr.run(&args).unwrap();
    assert_eq!(run.code(), 0, "{run:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count(h, src) < at_least {
        assert!(
            std::time::Instant::now() < deadline,
            "{src} did not count to {at_least}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let reference = format!("localhost/crab-ckpt/{src}:1");
    let out = ctr
        .run(&[
            "containers",
            "checkpoint",
            "--task",
            "--rw",
            src,
            &reference,
        ])
        .unwrap();
    assert_eq!(out.code(), 0, "ctr c checkpoint: {out:?}");
    let at = count(h, src);
    (reference, at)
}

#[tokio::test(flavor = "multi_thread")]
async fn containerd_checkpoints_restore_only_when_a_trusted_key_signed_them() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only(
        "containerd_checkpoints_restore_only_when_a_trusted_key_signed_them",
        "the stock shim signs nothing and checks nothing",
    ) {
        return;
    }
    let src = h.unique_id("ctrd-ckpt");
    let ids: Vec<String> = ["ok", "untrusted", "kernel", "fresh"]
        .iter()
        .map(|s| format!("{src}-{s}"))
        .collect();
    let mut all: Vec<&str> = ids.iter().map(String::as_str).collect();
    all.push(&src);
    let _g = h.guard(&all);
    let dir = tempfile::tempdir_in(h.env.crab_home.join("tmp")).unwrap();
    let (config, state) = (dir.path().join("crab.toml"), dir.path().join("state"));
    write_config(&config, &state, "");
    let ctr = h.ctr();
    // containerd's default seccomp profile: the kernel check finds runc's program for it in
    // every restored thread.
    let (reference, at_checkpoint) =
        counter_checkpointed(&h, &config, &["--seccomp"], BUSYBOX_IMAGE, &src, 10);
    remove(&h, &src);

    // Signed by this host's key: restored, the count goes on from where it was.
    let (code, out) = restore(&h, &reference, &ids[0]);
    assert_eq!(code, 0, "ctr c restore: {out}\n{}", h.log_excerpt(&ids[0]));
    let n = count(&h, &ids[0]);
    assert!(
        n + 1 >= at_checkpoint,
        "the restored counter starts again ({n}, {at_checkpoint} at the checkpoint)"
    );
    let log = h.log_excerpt(&ids[0]);
    assert!(
        log.contains("containerd's checkpoint is signed by a trusted key")
            && log.contains("kernel check passed")
            && log.contains("runc's seccomp program found in")
            && !log.contains("runc's seccomp program found in 0 threads"),
        "{log}"
    );
    remove(&h, &ids[0]);

    // The host now signs with (and trusts) another key: the checkpoint's key is not trusted,
    // and the restore is refused with the reason, nothing left running.
    let other = format!(
        "signing_key = \"{}\"\n",
        dir.path().join("other.key").display()
    );
    write_config(&config, &state, &other);
    let (code, out) = restore(&h, &reference, &ids[1]);
    assert_ne!(code, 0, "an untrusted checkpoint restored: {out}");
    assert!(
        out.contains("not signed by a trusted key") || out.contains("not among the"),
        "{out}"
    );
    let tasks = ctr.run(&["tasks", "ls"]).unwrap().stdout;
    assert!(
        !tasks
            .lines()
            .any(|l| l.starts_with(&ids[1]) && l.contains("RUNNING")),
        "{tasks}"
    );
    remove(&h, &ids[1]);

    // kernel-check: restored on the kernel check alone.
    write_config(
        &config,
        &state,
        &format!("{other}unsigned_images = \"kernel-check\"\n"),
    );
    let (code, out) = restore(&h, &reference, &ids[2]);
    assert_eq!(
        code,
        0,
        "kernel-check restore: {out}\n{}",
        h.log_excerpt(&ids[2])
    );
    assert!(count(&h, &ids[2]) + 1 >= at_checkpoint);
    assert!(h.log_excerpt(&ids[2]).contains("on the kernel check alone"));
    remove(&h, &ids[2]);

    // start-fresh: the container starts its command anew (the count restarts from 1 over the
    // restored rw layer's value).
    write_config(
        &config,
        &state,
        &format!("{other}unsigned_images = \"start-fresh\"\n"),
    );
    let (code, out) = restore(&h, &reference, &ids[3]);
    assert_eq!(code, 0, "start-fresh: {out}\n{}", h.log_excerpt(&ids[3]));
    std::thread::sleep(Duration::from_millis(600));
    let n = count(&h, &ids[3]);
    assert!(
        n < at_checkpoint,
        "start-fresh restored the processes ({n}, {at_checkpoint} at the checkpoint)"
    );
    remove(&h, &ids[3]);
    let _ = ctr.run(&["images", "rm", &reference]);
    for id in all {
        h.assert_no_leaks(id).await;
    }
}

/// A containerd checkpoint carries its rw layer beside the CRIU files and names its image by
/// reference only: the signature binds both (the image's chain id and what the rw layer
/// changes), and the restore checks them, the image at Create, the rw layer at Start, before
/// CRIU runs. Restored without its rw layer, or on another image tagged with the name it was
/// dumped on, the processes would run on other files: refused with the reason, nothing left
/// running; put back as it was, the same checkpoint restores.
#[tokio::test(flavor = "multi_thread")]
async fn a_containerd_checkpoint_goes_back_only_on_its_image_and_rw_layer() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only(
        "a_containerd_checkpoint_goes_back_only_on_its_image_and_rw_layer",
        "the stock shim binds nothing",
    ) {
        return;
    }
    let src = h.unique_id("ctrd-bind");
    let ids: Vec<String> = ["norw", "otherimage", "ok"]
        .iter()
        .map(|s| format!("{src}-{s}"))
        .collect();
    let mut all: Vec<&str> = ids.iter().map(String::as_str).collect();
    all.push(&src);
    let _g = h.guard(&all);
    let dir = tempfile::tempdir_in(h.env.crab_home.join("tmp")).unwrap();
    let (config, state) = (dir.path().join("crab.toml"), dir.path().join("state"));
    write_config(&config, &state, "");
    let ctr = h.ctr();
    // The image by a name of the test's own, which it can point elsewhere later.
    let base = format!("localhost/crab-bind/{src}:base");
    let tag = |from: &str| {
        let out = ctr.run(&["images", "tag", "--force", from, &base]).unwrap();
        assert_eq!(out.code(), 0, "tag {from}: {out:?}");
    };
    tag(BUSYBOX_IMAGE);
    let (reference, _) = counter_checkpointed(&h, &config, &[], &base, &src, 5);
    assert!(
        h.log_excerpt(&src).contains("its rw layer changes"),
        "the dump bound its rw layer: {}",
        h.log_excerpt(&src)
    );
    remove(&h, &src);
    let running = |id: &str| {
        ctr.run(&["tasks", "ls"])
            .unwrap()
            .stdout
            .lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING"))
    };

    // Without its rw layer (/tmp/n as the counter left it): refused at Start.
    let out = ctr
        .run(&["containers", "restore", "--live", &ids[0], &reference])
        .unwrap();
    let text = format!("{}{}", out.stdout, out.stderr);
    assert_ne!(out.code(), 0, "restored without its rw layer: {text}");
    assert!(
        text.contains("rw layer is not the one it was dumped with"),
        "{text}\n{}",
        h.log_excerpt(&ids[0])
    );
    assert!(!running(&ids[0]));
    remove(&h, &ids[0]);

    // The name it was dumped on now names another image: refused at Create.
    tag(crab_integration::sandbox::AGENT_IMAGE);
    let (code, text) = restore(&h, &reference, &ids[1]);
    assert_ne!(code, 0, "restored on another image: {text}");
    assert!(
        text.contains("it was dumped on image") && text.contains("would run on other files"),
        "{text}\n{}",
        h.log_excerpt(&ids[1])
    );
    assert!(!running(&ids[1]));
    remove(&h, &ids[1]);

    // Both put back: the same checkpoint restores.
    tag(BUSYBOX_IMAGE);
    let (code, text) = restore(&h, &reference, &ids[2]);
    assert_eq!(code, 0, "ctr c restore: {text}\n{}", h.log_excerpt(&ids[2]));
    assert!(count(&h, &ids[2]) >= 5);
    assert!(h
        .log_excerpt(&ids[2])
        .contains("its rw layer is the one it was dumped with"));
    remove(&h, &ids[2]);
    let _ = ctr.run(&["images", "rm", &reference, &base]);
    for id in all {
        h.assert_no_leaks(id).await;
    }
}
