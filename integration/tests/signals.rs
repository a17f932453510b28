//! Kill: signals to the init process and to execs, exit statuses, and `--all`.

use std::time::Duration;

use crab_integration::host::{self, eventually};
use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec, TaskStatus};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_init_exits_137() {
    let h = Harness::for_test().await;
    let id = h.unique_id("sigkill_init");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    h.kill(&id, "", libc::SIGKILL, false).await.unwrap();
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 137);
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Stopped);
    assert_eq!(h.delete_task(&id).await.unwrap(), 137);
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_reaches_init_handler() {
    let h = Harness::for_test().await;
    let id = h.unique_id("sigterm_init_trap");
    let _g = h.guard(&[&id]);
    // PID 1 ignores signals it has no handler for, so the shell installs one.
    let script =
        "trap 'echo got-term; exit 42' TERM; touch /tmp/ready; while :; do sleep 0.1; done";
    h.create_container(&id, &ProcessSpec::sh(script))
        .await
        .unwrap();
    let mut io = h.stdio(&id, "init", StdioOptions::default()).unwrap();
    let pid = h.create_task(&id, Some(&io)).await.unwrap();
    h.start(&id, "").await.unwrap();
    eventually(T, || host::read_in_root(pid, "/tmp/ready").ok()).expect("trap never installed");
    h.kill(&id, "", libc::SIGTERM, false).await.unwrap();
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 42);
    assert_eq!(io.stdout_string(T).unwrap(), "got-term\n");
    h.delete_task(&id).await.unwrap();
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_exec_exits_143_and_spares_init() {
    let h = Harness::for_test().await;
    let id = h.unique_id("sigterm_exec");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let io = h.stdio(&id, "sleeper", StdioOptions::default()).unwrap();
    h.exec(&id, "sleeper", &ProcessSpec::new(&["sleep", "1000"]), &io)
        .await
        .unwrap();
    h.start(&id, "sleeper").await.unwrap();
    h.kill(&id, "sleeper", libc::SIGTERM, false).await.unwrap();
    assert_eq!(h.wait(&id, "sleeper", T).await.unwrap(), 143);
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Running);
    assert_eq!(h.delete_process(&id, "sleeper").await.unwrap(), 143);
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_kill_all_reaps_background_children() {
    let h = Harness::for_test().await;
    let id = h.unique_id("ctr_kill_all");
    let _g = h.guard(&[&id]);
    let ctr = h.ctr();
    ctr.run(&[
        "run",
        "-d",
        "--runtime",
        h.runtime(),
        &h.env.image,
        &id,
        "sh",
        "-c",
        "sleep 1001 & sleep 1002 & wait",
    ])
    .unwrap()
    .ok()
    .unwrap();
    // An exec that leaves background children behind (they outlive the exec).
    ctr.run(&[
        "tasks",
        "exec",
        "--exec-id",
        "bg",
        &id,
        "sh",
        "-c",
        "sleep 1003 >/dev/null 2>&1 </dev/null &",
    ])
    .unwrap()
    .ok()
    .unwrap();
    let before = eventually(T, || {
        let p = host::container_processes(&id);
        (p.len() >= 4).then_some(p)
    })
    .unwrap_or_else(|| {
        panic!(
            "expected init + 3 sleeps, found {:?}",
            host::container_processes(&id)
        )
    });

    // ctr tasks ps (ListPids) sees every one of them.
    let ps = ctr.run(&["tasks", "ps", &id]).unwrap().ok().unwrap();
    for p in &before {
        assert!(
            ps.stdout
                .lines()
                .any(|l| l.split_whitespace().next() == Some(&p.pid.to_string())),
            "ctr tasks ps misses {p}: {:?}",
            ps.stdout
        );
    }

    ctr.run(&["tasks", "kill", "--all", "-s", "SIGKILL", &id])
        .unwrap()
        .ok()
        .unwrap();
    let left = eventually(T, || {
        host::container_processes(&id).is_empty().then_some(())
    });
    assert!(
        left.is_some(),
        "kill --all left {:?} (had {before:?})",
        host::container_processes(&id)
    );
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 137);
    let ls = ctr.run(&["tasks", "ls"]).unwrap().ok().unwrap();
    let line = ls
        .stdout
        .lines()
        .find(|l| l.starts_with(&format!("{id} ")))
        .unwrap_or_default();
    assert!(line.contains("STOPPED"), "ctr tasks ls: {:?}", ls.stdout);
    ctr.run(&["tasks", "rm", &id]).unwrap().ok().unwrap();
    ctr.run(&["containers", "rm", &id]).unwrap().ok().unwrap();
    h.assert_no_leaks(&id).await;
}
