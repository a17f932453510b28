//! Invalid containers fail at create or start with an error that names the problem, and leave
//! nothing behind.

use std::time::Duration;

use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec, TaskStatus};
use tonic::Code;

const T: Duration = Duration::from_secs(30);

/// Creating the task of `process` must fail with an error mentioning `needle`; then the
/// container is deleted and nothing may remain.
async fn task_create_fails(name: &str, process: ProcessSpec, needle: &str) {
    let h = Harness::for_test().await;
    let id = h.unique_id(name);
    let _g = h.guard(&[&id]);
    h.create_container(&id, &process).await.unwrap();
    let io = h.stdio(&id, "init", StdioOptions::default()).unwrap();
    let err = h
        .create_task(&id, Some(&io))
        .await
        .expect_err("task create must fail");
    assert!(err.grpc_code().is_some(), "not a gRPC error: {err}");
    assert!(
        err.to_string().contains(needle),
        "error does not name {needle:?}: {err}"
    );
    let after = h
        .status(&id, "")
        .await
        .expect_err("no task may exist after a failed create");
    assert_eq!(after.grpc_code(), Some(Code::NotFound), "{after}");
    drop(io);
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_binary_fails_task_create() {
    task_create_fails(
        "missing_binary",
        ProcessSpec::new(&["/no/such/binary"]),
        "/no/such/binary",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cwd_that_is_a_file_fails_task_create() {
    task_create_fails(
        "cwd_is_file",
        ProcessSpec::new(&["pwd"]).cwd("/bin/busybox"),
        "not a directory",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_run_missing_binary_fails_cleanly() {
    let h = Harness::for_test().await;
    let id = h.unique_id("ctr_missing_binary");
    let _g = h.guard(&[&id]);
    let out = h
        .ctr()
        .run(&[
            "run",
            "--rm",
            "--runtime",
            h.runtime(),
            &h.env.image,
            &id,
            "/no/such/binary",
        ])
        .unwrap();
    assert_ne!(out.code(), 0, "{out:?}");
    assert!(out.stderr.contains("/no/such/binary"), "{out:?}");
    h.assert_no_leaks(&id).await;
}

/// runc creates a missing working directory; crab must behave the same.
#[tokio::test(flavor = "multi_thread")]
async fn missing_cwd_is_created_like_runc() {
    let h = Harness::for_test().await;
    let id = h.unique_id("missing_cwd");
    let _g = h.guard(&[&id]);
    let out = h
        .run_to_exit(&id, &ProcessSpec::new(&["pwd"]).cwd("/no/such/dir"))
        .await
        .unwrap();
    assert_eq!(
        (out.exit_status, out.stdout.as_str()),
        (0, "/no/such/dir\n"),
        "{out:?}"
    );
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_of_missing_binary_fails_and_leaves_task_running() {
    let h = Harness::for_test().await;
    let id = h.unique_id("exec_missing_binary");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let io = h.stdio(&id, "bad", StdioOptions::default()).unwrap();
    // Exec only records the process; running it (Start) is where it fails.
    let started = match h
        .exec(&id, "bad", &ProcessSpec::new(&["/no/such/binary"]), &io)
        .await
    {
        Err(e) => Err(e),
        Ok(()) => h.start(&id, "bad").await.map(|_| ()),
    };
    let err = started.expect_err("exec of a missing binary must fail");
    assert!(err.to_string().contains("/no/such/binary"), "{err}");
    let _ = h.delete_process(&id, "bad").await;
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Running);
    let mut ok = h.stdio(&id, "ok", StdioOptions::default()).unwrap();
    h.exec(&id, "ok", &ProcessSpec::sh("echo fine"), &ok)
        .await
        .unwrap();
    h.start(&id, "ok").await.unwrap();
    assert_eq!(h.wait(&id, "ok", T).await.unwrap(), 0);
    assert_eq!(ok.stdout_string(T).unwrap(), "fine\n");
    h.delete_process(&id, "ok").await.unwrap();
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

// Runtime configuration errors (crab.toml passed with `ctr run --runtime-config-path` or the
// runtime option ConfigPath: unknown keys, bad values, unreadable file) belong here: the task
// create must fail with an error naming the file and the field, and leak nothing. The lead adds
// these once the shim reads its config; `task_create_fails` is the pattern to follow.
