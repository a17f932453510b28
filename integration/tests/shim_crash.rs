//! The shim dies (SIGKILL): containerd must clean up through the shim binary's `delete` command,
//! which kills the container, and report the task's exit.

use std::time::Duration;

use crab_integration::host::{self, eventually};
use crab_integration::{Harness, ProcessSpec, TaskStatus};
use tonic::Code;

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn killed_shim_is_cleaned_up_by_containerd() {
    let h = Harness::for_test().await;
    let id = h.unique_id("shim_sigkill");
    let _g = h.guard(&[&id]);
    let init = h
        .start_detached(&id, &ProcessSpec::sh("sleep 1000 & exec sleep 1001"))
        .await
        .unwrap();
    let shims = host::shim_processes(&id);
    assert_eq!(shims.len(), 1, "expected one shim for {id}: {shims:?}");
    let shim = &shims[0];
    let runtime_binary = format!(
        "containerd-shim-{}",
        match h.runtime() {
            "io.containerd.runc.v2" => "runc-v2",
            "io.containerd.crab.v1" => "crab-v1",
            other => other,
        }
    );
    assert!(
        shim.argv[0].ends_with(&runtime_binary),
        "shim for runtime {} is {shim}",
        h.runtime()
    );
    let processes = eventually(T, || {
        let p = host::container_processes(&id);
        (p.len() >= 2).then_some(p)
    })
    .expect("container processes not found");

    let mut exits = h.task_exits().await.unwrap();
    assert_eq!(
        // SAFETY: kill(2) on a pid we just found; a race with its exit only makes this fail.
        unsafe { libc::kill(shim.pid, libc::SIGKILL) },
        0,
        "kill shim {shim}"
    );

    // containerd notices the lost connection, runs `<shim> delete`, and publishes the exit.
    let exit = exits.next_for(&id, "", T).await.unwrap_or_else(|e| {
        panic!(
            "no exit event after the shim died: {e}\n{}",
            h.log_excerpt(&id)
        )
    });
    assert_eq!(exit.exit_status, 137, "{exit:?}");
    assert_eq!(exit.pid, init, "{exit:?}");
    let gone = eventually(T, || {
        host::container_processes(&id).is_empty().then_some(())
    });
    assert!(
        gone.is_some(),
        "container processes survived the shim ({processes:?}): {:?}\n{}",
        host::container_processes(&id),
        h.log_excerpt(&id)
    );
    // The task is then stopped, or already forgotten (what containerd 2.x does).
    match h.status(&id, "").await {
        Ok((status, _)) => assert!(
            matches!(status, TaskStatus::Stopped | TaskStatus::Unknown),
            "task is {status:?} after its shim died"
        ),
        Err(e) => assert_eq!(e.grpc_code(), Some(Code::NotFound), "{e}"),
    }
    let rm = h.ctr().run(&["tasks", "rm", &id]).unwrap();
    assert!(
        rm.status.success() || rm.stderr.contains("not found"),
        "ctr tasks rm: {rm:?}"
    );
    h.ctr()
        .run(&["containers", "rm", &id])
        .unwrap()
        .ok()
        .unwrap();
    h.assert_no_leaks(&id).await;
}
