//! The rest of the Task API through containerd: Update (annotations, resources, bad input),
//! Stats, Pids, the shim's Connect, State of an exec, ResizePty, Kill of an unknown exec and
//! Checkpoint.

use std::collections::HashMap;
use std::io::Write;
use std::time::Duration;

use crab_integration::api::{linux_resources, linux_resources_raw, PROCESS_DETAILS_TYPE_URL};
use crab_integration::env::DEFAULT_RUNTIME;
use crab_integration::host::{self, eventually};
use crab_integration::spec::container_spec;
use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec, TaskStatus};
use serde_json::json;
use tonic::Code;

const T: Duration = Duration::from_secs(30);

/// Init waits for /tmp/go and then exits 4, so a test can end it normally.
const WAIT_FOR_GO: &str = "while [ ! -e /tmp/go ]; do sleep 0.05; done; exit 4";

fn let_init_exit(pid: u32) {
    std::fs::write(format!("/proc/{pid}/root/tmp/go"), b"").unwrap();
}

/// The value of a v1 controller's file in the cgroup of `pid` (the v2 file where the controller
/// is not on v1).
fn cgroup_value(pid: u32, controller: &str, v1: &str, v2: &str) -> String {
    let path = host::cgroup_file(pid, controller, v1)
        .filter(|p| p.exists())
        .or_else(|| host::cgroup_file(pid, "", v2))
        .unwrap_or_else(|| panic!("no {controller} cgroup for pid {pid}"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .trim()
        .to_string()
}

fn memory_limit(pid: u32) -> String {
    cgroup_value(pid, "memory", "memory.limit_in_bytes", "memory.max")
}

fn pids_max(pid: u32) -> String {
    cgroup_value(pid, "pids", "pids.max", "pids.max")
}

#[tokio::test(flavor = "multi_thread")]
async fn update_with_annotations_only_changes_nothing() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only(
        "update_with_annotations_only_changes_nothing",
        "the stock shim of containerd 2.1 panics on an Update without resources (nil \
         dereference in process.(*Init).update) and its task is lost, so there is no runc \
         behaviour to compare with",
    ) {
        return;
    }
    let id = h.unique_id("update_annotations");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::sh(WAIT_FOR_GO))
        .await
        .unwrap();
    let (mem, pids) = (memory_limit(pid), pids_max(pid));
    let annotations = HashMap::from([
        ("io.crab.test/turn".to_string(), "1".to_string()),
        ("io.crab.test/phase".to_string(), "think".to_string()),
    ]);
    h.update(&id, None, annotations).await.unwrap();
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    assert_eq!((memory_limit(pid), pids_max(pid)), (mem, pids));
    let_init_exit(pid);
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 4);
    assert_eq!(h.delete_task(&id).await.unwrap(), 4);
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn update_with_resources_applies_them() {
    let h = Harness::for_test().await;
    let id = h.unique_id("update_resources");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::sh(WAIT_FOR_GO))
        .await
        .unwrap();
    assert_ne!(pids_max(pid), "50");
    h.update(
        &id,
        Some(linux_resources(&json!({"pids": {"limit": 50}}))),
        HashMap::new(),
    )
    .await
    .unwrap();
    assert_eq!(pids_max(pid), "50");
    let limit = 96u64 << 20;
    h.update(
        &id,
        Some(linux_resources(&json!({"memory": {"limit": limit}}))),
        HashMap::new(),
    )
    .await
    .unwrap();
    assert_eq!(memory_limit(pid), limit.to_string());
    // The earlier pids limit stays.
    assert_eq!(pids_max(pid), "50");
    assert_eq!(h.stats(&id).await.unwrap().pids_limit, 50);
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    let_init_exit(pid);
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 4);
    h.delete_task(&id).await.unwrap();
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn update_with_malformed_resources_is_invalid_argument() {
    let h = Harness::for_test().await;
    let id = h.unique_id("update_malformed");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let before = pids_max(pid);
    for bad in [
        &b"{\"pids\": {\"limit\": "[..],
        b"not json",
        b"{\"pids\": 7}",
    ] {
        let err = h
            .update(&id, Some(linux_resources_raw(bad.to_vec())), HashMap::new())
            .await
            .expect_err("malformed resources must be refused");
        let what = format!("{:?}: {err}", String::from_utf8_lossy(bad));
        if h.runtime() == DEFAULT_RUNTIME {
            assert_eq!(err.grpc_code(), Some(Code::InvalidArgument), "{what}");
            assert!(err.to_string().contains("resources"), "{what}");
        } else {
            // The stock shim passes the JSON decoder's error on as Unknown.
            let _ = writeln!(
                std::io::stderr(),
                "NOTE {} refuses malformed resources with {:?} (crab: InvalidArgument): {what}",
                h.runtime(),
                err.grpc_code()
            );
            assert!(err.grpc_code().is_some(), "{what}");
        }
    }
    assert_eq!(pids_max(pid), before);
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_report_memory_and_pids() {
    let h = Harness::for_test().await;
    let id = h.unique_id("stats");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let io = h.stdio(&id, "e1", StdioOptions::default()).unwrap();
    h.exec(&id, "e1", &ProcessSpec::new(&["sleep", "1000"]), &io)
        .await
        .unwrap();
    h.start(&id, "e1").await.unwrap();
    let stats = h.stats(&id).await.unwrap();
    assert!(
        stats.type_url.ends_with("io.containerd.cgroups.v1.Metrics")
            || stats.type_url.ends_with("io.containerd.cgroups.v2.Metrics"),
        "{stats:?}"
    );
    assert!(stats.memory_usage > 0, "{stats:?}");
    assert!(stats.pids_current >= 2, "init and the exec: {stats:?}");
    h.kill(&id, "e1", libc::SIGKILL, false).await.unwrap();
    assert_eq!(h.wait(&id, "e1", T).await.unwrap(), 137);
    h.delete_process(&id, "e1").await.unwrap();
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

/// The metrics carry what the cgroup says, as the stock shim reports them: the memory limit
/// and the CPU time used (cgroup v1 keeps it in cpuacct).
#[tokio::test(flavor = "multi_thread")]
async fn stats_report_memory_limit_and_cpu_usage() {
    const LIMIT: u64 = 96 << 20;
    let h = Harness::for_test().await;
    let id = h.unique_id("stats_limit_cpu");
    let _g = h.guard(&[&id]);
    // Burns some CPU, then waits.
    let process = ProcessSpec::sh(
        "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; touch /tmp/done; sleep 1000",
    );
    let mut spec = container_spec(
        &id,
        &h.env.namespace,
        process.to_oci(&h.image.env, &h.image.cwd),
    );
    spec["linux"]["resources"]["memory"] = json!({"limit": LIMIT});
    h.create_container_with_spec(&id, &spec).await.unwrap();
    let pid = h.create_task(&id, None).await.unwrap();
    h.start(&id, "").await.unwrap();
    eventually(T, || host::read_in_root(pid, "/tmp/done").ok()).expect("loop never ended");
    assert_eq!(memory_limit(pid), LIMIT.to_string());
    let stats = h.stats(&id).await.unwrap();
    assert_eq!(
        stats.memory_limit,
        LIMIT,
        "{} reports no memory limit: {stats:?}",
        h.runtime()
    );
    assert!(
        stats.cpu_usage_ns > 0,
        "{} reports no CPU time: {stats:?}",
        h.runtime()
    );
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pids_list_init_and_exec_with_its_exec_id() {
    let h = Harness::for_test().await;
    let id = h.unique_id("pids");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let io = h.stdio(&id, "e1", StdioOptions::default()).unwrap();
    h.exec(&id, "e1", &ProcessSpec::new(&["sleep", "1000"]), &io)
        .await
        .unwrap();
    let exec_pid = h.start(&id, "e1").await.unwrap();
    let pids = h.list_pids(&id).await.unwrap();
    let init = pids
        .iter()
        .find(|p| p.pid == pid)
        .unwrap_or_else(|| panic!("init {pid} missing: {pids:?}"));
    assert_eq!(init.exec_id, None, "{pids:?}");
    let exec = pids
        .iter()
        .find(|p| p.pid == exec_pid)
        .unwrap_or_else(|| panic!("exec {exec_pid} missing: {pids:?}"));
    assert_eq!(exec.exec_id.as_deref(), Some("e1"), "{pids:?}");
    assert!(
        exec.info_type
            .as_deref()
            .is_some_and(|t| t.ends_with(PROCESS_DETAILS_TYPE_URL)),
        "{pids:?}"
    );
    assert_eq!(pids.len(), 2, "{pids:?}");
    h.kill(&id, "e1", libc::SIGKILL, false).await.unwrap();
    assert_eq!(h.wait(&id, "e1", T).await.unwrap(), 137);
    h.delete_process(&id, "e1").await.unwrap();
    let after = h.list_pids(&id).await.unwrap();
    assert_eq!(after.iter().map(|p| p.pid).collect::<Vec<_>>(), [pid]);
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn shim_connect_returns_shim_and_task_pids() {
    let h = Harness::for_test().await;
    let id = h.unique_id("connect");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let c = h.shim_connect(&id).await.unwrap();
    assert_eq!(c.task_pid, pid, "{c:?}");
    let shims = host::shim_processes(&id);
    assert!(
        shims.iter().any(|p| p.pid as u32 == c.shim_pid),
        "Connect says shim pid {} but the shims serving {id} are {shims:?}",
        c.shim_pid
    );
    let exe = std::fs::read_link(format!("/proc/{}/exe", c.shim_pid)).unwrap();
    let name = exe.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("containerd-shim-"), "{}", exe.display());
    // The container's init is the shim's descendant (runc leaves it to the subreaper).
    let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .rsplit(')')
        .next()
        .and_then(|rest| rest.split_whitespace().nth(1).map(String::from))
        .unwrap();
    assert_eq!(ppid, c.shim_pid.to_string(), "parent of init {pid}");
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn state_of_an_exec_follows_its_life() {
    let h = Harness::for_test().await;
    let id = h.unique_id("exec_state");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let io = h.stdio(&id, "e1", StdioOptions::default()).unwrap();
    h.exec(
        &id,
        "e1",
        &ProcessSpec::sh("while [ ! -e /tmp/go ]; do sleep 0.05; done; exit 9"),
        &io,
    )
    .await
    .unwrap();
    let created = h.process(&id, "e1").await.unwrap();
    assert_eq!(
        TaskStatus::from(created.status),
        TaskStatus::Created,
        "{created:?}"
    );
    assert_eq!((created.id.as_str(), created.pid), ("e1", 0), "{created:?}");
    assert_eq!(created.stdout, io.stdout_path(), "{created:?}");
    assert_eq!(created.stderr, io.stderr_path(), "{created:?}");
    assert!(!created.terminal);
    let exec_pid = h.start(&id, "e1").await.unwrap();
    let running = h.process(&id, "e1").await.unwrap();
    assert_eq!(
        (TaskStatus::from(running.status), running.pid),
        (TaskStatus::Running, exec_pid),
        "{running:?}"
    );
    std::fs::write(format!("/proc/{exec_pid}/root/tmp/go"), b"").unwrap();
    assert_eq!(h.wait(&id, "e1", T).await.unwrap(), 9);
    let stopped = h.process(&id, "e1").await.unwrap();
    assert_eq!(
        (TaskStatus::from(stopped.status), stopped.exit_status),
        (TaskStatus::Stopped, 9),
        "{stopped:?}"
    );
    assert!(stopped.exited_at.is_some(), "{stopped:?}");
    h.delete_process(&id, "e1").await.unwrap();
    let gone = h.process(&id, "e1").await.expect_err("deleted exec");
    assert_eq!(gone.grpc_code(), Some(Code::NotFound), "{gone}");
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn resize_pty_reaches_the_exec_terminal() {
    let h = Harness::for_test().await;
    let id = h.unique_id("resize_pty");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let opts = StdioOptions {
        stdin: true,
        terminal: true,
    };
    let mut io = h.stdio(&id, "t1", opts).unwrap();
    h.exec(&id, "t1", &ProcessSpec::sh("sleep 0.3; stty size"), &io)
        .await
        .unwrap();
    h.start(&id, "t1").await.unwrap();
    h.resize_pty(&id, "t1", 123, 45).await.unwrap();
    assert_eq!(h.wait(&id, "t1", T).await.unwrap(), 0);
    h.close_stdin(&id, "t1").await.unwrap();
    assert_eq!(io.stdout_string(T).unwrap(), "45 123\r\n");
    h.delete_process(&id, "t1").await.unwrap();
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_of_an_unknown_exec_is_not_found() {
    let h = Harness::for_test().await;
    let id = h.unique_id("kill_unknown_exec");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let err = h
        .kill(&id, "no-such-exec", libc::SIGKILL, false)
        .await
        .expect_err("kill of an unknown exec");
    assert_eq!(err.grpc_code(), Some(Code::NotFound), "{err}");
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

/// Tasks.Checkpoint (what `ctr task checkpoint` uses) dumps the running task with CRIU into a
/// checkpoint in containerd's content store, leaving the task running, like the stock shim.
#[tokio::test(flavor = "multi_thread")]
async fn checkpoint_leaves_the_task_running() {
    let h = Harness::for_test().await;
    let id = h.unique_id("checkpoint");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::sh("sleep 1000 & exec sleep 1001"))
        .await
        .unwrap();
    let resp = h
        .checkpoint(&id)
        .await
        .unwrap_or_else(|e| panic!("Checkpoint: {e}\n{}", h.log_excerpt(&id)));
    assert!(
        !resp.descriptors.is_empty(),
        "no checkpoint descriptors: {resp:?}"
    );
    assert!(
        resp.descriptors
            .iter()
            .any(|d| d.media_type.contains("checkpoint")),
        "{:?}",
        resp.descriptors
    );
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

/// An exec's main process still running is not in the tree `runc checkpoint` dumps (its parent is
/// the shim): crab refuses the checkpoint, naming the process, instead of silently losing it.
#[tokio::test(flavor = "multi_thread")]
async fn checkpoint_refuses_to_lose_a_running_exec() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only(
        "checkpoint_refuses_to_lose_a_running_exec",
        "the stock shim checkpoints without the exec's process (DESIGN.md, the trap)",
    ) {
        return;
    }
    let id = h.unique_id("checkpoint_trap");
    let _g = h.guard(&[&id]);
    let pid = h
        .start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let io = h
        .stdio(&id, "e1", crab_integration::StdioOptions::default())
        .unwrap();
    h.exec(&id, "e1", &ProcessSpec::new(&["sleep", "999"]), &io)
        .await
        .unwrap();
    h.start(&id, "e1").await.unwrap();
    let err = h
        .checkpoint(&id)
        .await
        .expect_err("a checkpoint that loses the exec");
    assert_eq!(err.grpc_code(), Some(Code::FailedPrecondition), "{err}");
    assert!(err.to_string().contains("sleep 999"), "{err}");
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}
