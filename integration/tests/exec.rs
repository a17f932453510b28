//! Exec into a running container, with and without a TTY, through ctr and through gRPC.

use std::time::Duration;

use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec, TaskStatus};

const T: Duration = Duration::from_secs(30);
const PROBE: &str = "echo out; echo err >&2; [ -t 1 ] && echo tty || echo notty; exit 5";

/// `ctr run -d` a container that just sleeps, for ctr exec tests.
fn ctr_run_sleeper(h: &Harness, id: &str) {
    h.ctr()
        .run(&[
            "run",
            "-d",
            "--runtime",
            h.runtime(),
            &h.env.image,
            id,
            "sleep",
            "1000",
        ])
        .and_then(|o| o.ok())
        .unwrap();
}

fn ctr_remove(h: &Harness, id: &str) {
    h.ctr()
        .run(&["tasks", "kill", "-s", "SIGKILL", id])
        .unwrap()
        .ok()
        .unwrap();
    h.ctr().run(&["tasks", "rm", id]).unwrap().ok().unwrap();
    h.ctr()
        .run(&["containers", "rm", id])
        .unwrap()
        .ok()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_exec_without_tty() {
    let h = Harness::for_test().await;
    let id = h.unique_id("ctr_exec_no_tty");
    let _g = h.guard(&[&id]);
    ctr_run_sleeper(&h, &id);
    let out = h
        .ctr()
        .run(&["tasks", "exec", "--exec-id", "e1", &id, "sh", "-c", PROBE])
        .unwrap();
    assert_eq!(out.code(), 5, "{out:?}");
    assert_eq!(out.stdout, "out\nnotty\n", "{out:?}");
    assert!(out.stderr.contains("err"), "{out:?}");
    // The exec is gone once ctr returns; the same exec id can be used again.
    let again = h
        .ctr()
        .run(&["tasks", "exec", "--exec-id", "e1", &id, "true"])
        .unwrap();
    assert_eq!(again.code(), 0, "{again:?}");
    ctr_remove(&h, &id);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_exec_with_tty() {
    let h = Harness::for_test().await;
    let id = h.unique_id("ctr_exec_tty");
    let _g = h.guard(&[&id]);
    ctr_run_sleeper(&h, &id);
    let out = h
        .ctr()
        .run_in_pty(
            &[
                "tasks",
                "exec",
                "-t",
                "--exec-id",
                "t1",
                &id,
                "sh",
                "-c",
                PROBE,
            ],
            T,
        )
        .unwrap();
    assert_eq!(out.code(), 5, "{out:?}");
    // One pty inside the container, one from `script`: lines end in \r\r\n, and stderr
    // shares the terminal.
    let lines: Vec<&str> = out
        .stdout
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .collect();
    assert_eq!(&lines[..3], ["out", "err", "tty"], "{out:?}");
    ctr_remove(&h, &id);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_exec_without_tty() {
    let h = Harness::for_test().await;
    let id = h.unique_id("grpc_exec_no_tty");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let mut io = h.stdio(&id, "e1", StdioOptions::default()).unwrap();
    let mut exits = h.task_exits().await.unwrap();
    h.exec(&id, "e1", &ProcessSpec::sh(PROBE), &io)
        .await
        .unwrap();
    assert_eq!(h.status(&id, "e1").await.unwrap().0, TaskStatus::Created);
    let pid = h.start(&id, "e1").await.unwrap();
    assert!(pid > 0);
    assert_eq!(h.wait(&id, "e1", T).await.unwrap(), 5);
    let exit = exits.next_for(&id, "e1", T).await.unwrap();
    assert_eq!((exit.pid, exit.exit_status), (pid, 5), "{exit:?}");
    assert_eq!(io.stdout_string(T).unwrap(), "out\nnotty\n");
    assert_eq!(io.stderr_string(T).unwrap(), "err\n");
    assert_eq!(h.delete_process(&id, "e1").await.unwrap(), 5);
    // The init process is untouched by the exec's exit.
    assert_eq!(h.status(&id, "").await.unwrap().0, TaskStatus::Running);
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_exec_with_tty() {
    let h = Harness::for_test().await;
    let id = h.unique_id("grpc_exec_tty");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let opts = StdioOptions {
        stdin: true,
        terminal: true,
    };
    let mut io = h.stdio(&id, "t1", opts).unwrap();
    h.exec(&id, "t1", &ProcessSpec::sh(PROBE), &io)
        .await
        .unwrap();
    h.start(&id, "t1").await.unwrap();
    assert_eq!(h.wait(&id, "t1", T).await.unwrap(), 5);
    h.close_stdin(&id, "t1").await.unwrap();
    let out = io.stdout_string(T).unwrap();
    assert_eq!(out, "out\r\nerr\r\ntty\r\n");
    assert_eq!(h.delete_process(&id, "t1").await.unwrap(), 5);
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_init_with_tty() {
    let h = Harness::for_test().await;
    let id = h.unique_id("grpc_init_tty");
    let _g = h.guard(&[&id]);
    h.create_container(&id, &ProcessSpec::sh(PROBE).terminal(true))
        .await
        .unwrap();
    let opts = StdioOptions {
        stdin: false,
        terminal: true,
    };
    let mut io = h.stdio(&id, "init", opts).unwrap();
    h.create_task(&id, Some(&io)).await.unwrap();
    h.start(&id, "").await.unwrap();
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 5);
    assert_eq!(io.stdout_string(T).unwrap(), "out\r\nerr\r\ntty\r\n");
    assert_eq!(h.delete_task(&id).await.unwrap(), 5);
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

/// An exec that leaves a background process holding its stdout: the exit is published after the
/// shim's bounded drain, the shim names the holder in its log (pid and command), and the output
/// ends when the holder lets go (here: when it is killed).
#[tokio::test(flavor = "multi_thread")]
async fn an_exec_whose_output_is_held_names_the_holder() {
    let h = Harness::for_test().await;
    let id = h.unique_id("exec_held_out");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let from = h.env.containerd_log_len();
    let mut io = h.stdio(&id, "e1", StdioOptions::default()).unwrap();
    // The background sleep inherits the exec's stdout and stderr.
    h.exec(
        &id,
        "e1",
        &ProcessSpec::sh("echo started; sleep 777 & exit 0"),
        &io,
    )
    .await
    .unwrap();
    h.start(&id, "e1").await.unwrap();
    assert_eq!(h.wait(&id, "e1", T).await.unwrap(), 0);
    let names_holder = |log: &str| {
        log.lines()
            .any(|l| l.contains("process e1") && l.contains("still open") && l.contains("(sleep)"))
    };
    let log = crab_integration::harness::log_once(&h.env, from, T, names_holder).await;
    assert!(names_holder(&log), "the shim names the holder:\n{log}");
    // The holder goes: the output ends.
    let holder = log
        .lines()
        .find(|l| names_holder(l))
        .and_then(|l| l.split("pid ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse::<i32>().ok())
        .expect("a pid in the warning");
    // SAFETY: kill(2) of the pid the shim named (the exec's background sleep).
    unsafe { libc::kill(holder, libc::SIGKILL) };
    assert_eq!(io.stdout_string(T).unwrap(), "started\n");
    assert_eq!(h.delete_process(&id, "e1").await.unwrap(), 0);
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}
