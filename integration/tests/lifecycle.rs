//! Run to completion, Wait, Get and Delete of tasks and execs.

use std::time::Duration;

use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec, TaskStatus};
use tonic::Code;

const T: Duration = Duration::from_secs(30);

/// A refusal, not "no such thing" and not a transport failure.
fn refused(err: &crab_integration::Error) -> bool {
    matches!(
        err.grpc_code(),
        Some(Code::FailedPrecondition | Code::Unknown | Code::Internal)
    ) && err.to_string().contains("running")
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_run_reports_stdout_and_exit_code() {
    let h = Harness::for_test().await;
    let id = h.unique_id("ctr_run_exit_code");
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
            "sh",
            "-c",
            "echo hi; echo oops >&2; exit 3",
        ])
        .unwrap();
    assert_eq!(out.code(), 3, "{out:?}");
    assert_eq!(out.stdout, "hi\n", "{out:?}");
    assert!(out.stderr.contains("oops"), "{out:?}");
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_wait_returns_exit_status_and_output() {
    let h = Harness::for_test().await;
    let id = h.unique_id("grpc_wait_exit_status");
    let _g = h.guard(&[&id]);
    h.create_container(&id, &ProcessSpec::sh("echo hi; echo oops >&2; exit 3"))
        .await
        .unwrap();
    let mut io = h.stdio(&id, "init", StdioOptions::default()).unwrap();
    let mut exits = h.task_exits().await.unwrap();
    let pid = h.create_task(&id, Some(&io)).await.unwrap();
    assert!(pid > 0);
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Created);
    assert_eq!(h.start(&id, "").await.unwrap(), pid);
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 3);
    // Event consumers (the CRI plugin) learn of the exit from the TaskExit event.
    let exit = exits.next_for(&id, "", T).await.unwrap();
    assert_eq!((exit.pid, exit.exit_status), (pid, 3), "{exit:?}");
    assert_eq!(io.stdout_string(T).unwrap(), "hi\n");
    assert_eq!(io.stderr_string(T).unwrap(), "oops\n");
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Stopped);
    // A second Wait on an exited process answers at once with the same status.
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 3);
    assert_eq!(h.delete_task(&id).await.unwrap(), 3);
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_running_task_fails_cleanly() {
    let h = Harness::for_test().await;
    let id = h.unique_id("delete_running_task");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    // The stock shim answers Unknown ("cannot delete a running process"); the code is not
    // part of the contract, refusing is.
    let err = h
        .delete_task(&id)
        .await
        .expect_err("deleting a running task must fail");
    assert!(refused(&err), "{err}");
    // The refused delete changed nothing: the task still runs and still takes execs.
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Running);
    let mut io = h.stdio(&id, "probe", StdioOptions::default()).unwrap();
    h.exec(&id, "probe", &ProcessSpec::sh("echo alive"), &io)
        .await
        .unwrap();
    h.start(&id, "probe").await.unwrap();
    assert_eq!(h.wait(&id, "probe", T).await.unwrap(), 0);
    assert_eq!(io.stdout_string(T).unwrap(), "alive\n");
    h.delete_process(&id, "probe").await.unwrap();
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_delete_reports_status_and_refuses_running_execs() {
    let h = Harness::for_test().await;
    let id = h.unique_id("exec_delete");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();

    let done = h.stdio(&id, "done", StdioOptions::default()).unwrap();
    h.exec(&id, "done", &ProcessSpec::sh("exit 4"), &done)
        .await
        .unwrap();
    h.start(&id, "done").await.unwrap();
    assert_eq!(h.wait(&id, "done", T).await.unwrap(), 4);
    assert_eq!(h.status(&id, "done").await.unwrap().0, TaskStatus::Stopped);
    assert_eq!(h.delete_process(&id, "done").await.unwrap(), 4);
    let gone = h
        .delete_process(&id, "done")
        .await
        .expect_err("exec was deleted");
    assert_eq!(gone.grpc_code(), Some(Code::NotFound), "{gone}");

    let busy = h.stdio(&id, "busy", StdioOptions::default()).unwrap();
    h.exec(&id, "busy", &ProcessSpec::new(&["sleep", "1000"]), &busy)
        .await
        .unwrap();
    h.start(&id, "busy").await.unwrap();
    let err = h
        .delete_process(&id, "busy")
        .await
        .expect_err("deleting a running exec must fail");
    assert!(refused(&err), "{err}");
    assert_eq!(h.status(&id, "busy").await.unwrap().0, TaskStatus::Running);
    // An exec id is unique within its task while it exists.
    let dup = h.stdio(&id, "busy2", StdioOptions::default()).unwrap();
    let err = h
        .exec(&id, "busy", &ProcessSpec::new(&["true"]), &dup)
        .await
        .expect_err("duplicate exec id must fail");
    assert_eq!(err.grpc_code(), Some(Code::AlreadyExists), "{err}");

    h.kill(&id, "busy", libc::SIGKILL, false).await.unwrap();
    assert_eq!(h.wait(&id, "busy", T).await.unwrap(), 137);
    assert_eq!(h.delete_process(&id, "busy").await.unwrap(), 137);
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}
