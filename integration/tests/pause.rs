//! Pause and resume: the status changes, and the container's processes really stop running.

use std::time::Duration;

use crab_integration::host::{self, eventually};
use crab_integration::{Harness, ProcessSpec, TaskStatus};

const T: Duration = Duration::from_secs(30);

fn counter(pid: u32) -> Option<u64> {
    host::read_in_root(pid, "/tmp/count")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The counter after it has had `d` to advance.
async fn counter_after(pid: u32, d: Duration) -> u64 {
    tokio::time::sleep(d).await;
    eventually(T, || counter(pid)).expect("counter unreadable")
}

fn ctr_status(h: &Harness, id: &str) -> String {
    let ls = h.ctr().run(&["tasks", "ls"]).unwrap().ok().unwrap();
    ls.stdout
        .lines()
        .find(|l| l.starts_with(&format!("{id} ")))
        .and_then(|l| l.split_whitespace().nth(2))
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn pause_freezes_and_resume_thaws() {
    let h = Harness::for_test().await;
    let id = h.unique_id("pause_resume");
    let _g = h.guard(&[&id]);
    // Written to a temp name and renamed, so a reader never sees a half-written number.
    let script = "i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/count; sleep 0.02; done";
    let pid = h
        .start_detached(&id, &ProcessSpec::sh(script))
        .await
        .unwrap();
    eventually(T, || counter(pid).filter(|c| *c >= 3)).expect("counter never advanced");

    // Pause through ctr, observe through gRPC and ctr.
    h.ctr().run(&["tasks", "pause", &id]).unwrap().ok().unwrap();
    h.wait_status(&id, TaskStatus::Paused, T).await.unwrap();
    assert_eq!(ctr_status(&h, &id), "PAUSED");
    let frozen = counter_after(pid, Duration::from_millis(100)).await;
    let still = counter_after(pid, Duration::from_millis(500)).await;
    assert_eq!(frozen, still, "counter advanced while paused");

    // Resume through gRPC, observe through ctr.
    h.resume(&id).await.unwrap();
    h.wait_status(&id, TaskStatus::Running, T).await.unwrap();
    assert_eq!(ctr_status(&h, &id), "RUNNING");
    let moved = counter_after(pid, Duration::from_millis(500)).await;
    assert!(
        moved > still,
        "counter did not advance after resume ({still} -> {moved})"
    );

    // Pause and resume through gRPC as well.
    h.pause(&id).await.unwrap();
    h.wait_status(&id, TaskStatus::Paused, T).await.unwrap();
    h.resume(&id).await.unwrap();
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}
