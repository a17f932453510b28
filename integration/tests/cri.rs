//! The CRI behaves the same with the runtime handler `crab` as with the stock `runc`: each test
//! runs one body against both handlers of the private containerd (runc first, as the reference)
//! and checks that each passes and that what they observed is equal. The checks follow what the
//! Kubernetes conformance suite for runtimes (cri-tools' `critest`, pkg/validate) looks at.
//!
//! Needs containerd with the CRI plugin (`CRAB_CONTAINERD_CRI=1 hack/containerd.sh start`) and
//! the test images in its `k8s.io` namespace (`hack/build-images.sh import k8s.io`).

use std::collections::HashMap;
use std::fmt::Debug;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crab_integration::cri::both::{
    assert_same, attach_stream, container, for_both_handlers, linux_sc, open_stream, pod, pod_sc,
    port_forward_stream, sh, state_name,
};
use crab_integration::cri::{api, ws, Cri, PodGuard};
use crab_integration::Error;

const SLEEPER: &[&str] = &["sleep", "3600"];
const EXIT_WAIT: Duration = Duration::from_secs(60);

fn namespaces(
    network: api::NamespaceMode,
    pid: api::NamespaceMode,
    ipc: api::NamespaceMode,
) -> api::NamespaceOption {
    api::NamespaceOption {
        network: network as i32,
        pid: pid as i32,
        ipc: ipc as i32,
        ..Default::default()
    }
}

fn expect_not_found<T: Debug>(handler: &str, what: &str, r: crab_integration::Result<T>) {
    match r {
        Err(e) if e.grpc_code() == Some(tonic::Code::NotFound) => {}
        other => {
            panic!("handler {handler}: {what} after removal: expected NotFound, got {other:?}")
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_sandbox_lifecycle() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "lifecycle", |_| {}).await;
        let status = cri.pod_status(&pod.0).await.unwrap();
        assert_eq!(
            status.state,
            api::PodSandboxState::SandboxReady as i32,
            "handler {h}: pod not ready after RunPodSandbox: {status:?}"
        );
        assert_eq!(status.runtime_handler, h, "handler {h}: {status:?}");
        let ip = status
            .network
            .as_ref()
            .map(|n| n.ip.clone())
            .unwrap_or_default();
        assert!(
            ip.parse::<std::net::IpAddr>().is_ok(),
            "handler {h}: the pod has no IP from CNI: {status:?}"
        );
        let listed = cri
            .runtime()
            .list_pod_sandbox(api::ListPodSandboxRequest {
                filter: Some(api::PodSandboxFilter {
                    id: pod.0.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .items;
        assert_eq!(
            listed.len(),
            1,
            "handler {h}: ListPodSandbox by id: {listed:?}"
        );
        assert_eq!(listed[0].runtime_handler, h);
        // Otherwise the comparison would be of runc with itself.
        let shims: Vec<String> = crab_integration::host::shim_processes(&pod.0)
            .iter()
            .map(|p| p.argv[0].rsplit('/').next().unwrap_or_default().to_string())
            .collect();
        let expected = match h {
            "crab" => "containerd-shim-crab-v1",
            _ => "containerd-shim-runc-v2",
        };
        assert_eq!(
            shims,
            [expected],
            "handler {h}: the shim serving pod {}",
            pod.0
        );

        let app = container(&cri, &pod, "app", SLEEPER, |_| {}).await;
        cri.stop_pod(&pod.0).await.unwrap();
        let app_status = cri.container_status(&app).await.unwrap();
        assert_eq!(
            app_status.state,
            api::ContainerState::ContainerExited as i32,
            "handler {h}: a container of a stopped pod: {app_status:?}"
        );
        let stopped = cri.pod_status(&pod.0).await.unwrap();
        assert_eq!(
            stopped.state,
            api::PodSandboxState::SandboxNotready as i32,
            "handler {h}: pod still ready after StopPodSandbox: {stopped:?}"
        );
        // Stop is idempotent for the kubelet, which retries it.
        cri.stop_pod(&pod.0).await.unwrap();
        cri.remove_pod(&pod.0).await.unwrap();
        expect_not_found(h, "PodSandboxStatus", cri.pod_status(&pod.0).await);
        let t0 = Instant::now();
        while !crab_integration::host::shim_processes(&pod.0).is_empty() {
            assert!(
                t0.elapsed() < EXIT_WAIT,
                "handler {h}: the pod's shim outlives RemovePodSandbox by {EXIT_WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (status.state, stopped.state, app_status.exit_code)
    })
    .await;
    assert_same(
        "pod states (ready, stopped), exit code of its container",
        &results,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn container_lifecycle_and_status() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "ctr-lifecycle", |_| {}).await;
        let mut config = Cri::container_config("sleeper", SLEEPER);
        config.labels.insert("crab-test".into(), "lifecycle".into());
        let id = cri.create_container(&pod.0, &pod.1, config).await.unwrap();
        let created = cri.container_status(&id).await.unwrap();
        assert_eq!(
            created.state,
            api::ContainerState::ContainerCreated as i32,
            "handler {h}: {created:?}"
        );
        assert!(
            created.created_at > 0 && created.started_at == 0,
            "handler {h}: {created:?}"
        );

        cri.start_container(&id).await.unwrap();
        let running = cri.container_status(&id).await.unwrap();
        assert_eq!(
            running.state,
            api::ContainerState::ContainerRunning as i32,
            "handler {h}: {running:?}"
        );
        assert!(
            running.started_at >= running.created_at,
            "handler {h}: {running:?}"
        );
        assert_eq!(
            running.labels.get("crab-test").map(String::as_str),
            Some("lifecycle")
        );
        let listed = cri
            .runtime()
            .list_containers(api::ListContainersRequest {
                filter: Some(api::ContainerFilter {
                    pod_sandbox_id: pod.0.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .containers;
        assert_eq!(
            listed.len(),
            1,
            "handler {h}: ListContainers in the pod: {listed:?}"
        );
        assert_eq!(
            listed[0].state,
            api::ContainerState::ContainerRunning as i32
        );

        // sleep as pid 1 ignores SIGTERM, so Stop has to escalate to SIGKILL after the timeout.
        let t0 = Instant::now();
        cri.stop_container(&id, 1).await.unwrap();
        let stop_took = t0.elapsed();
        let killed = cri.container_status(&id).await.unwrap();
        assert_eq!(
            killed.state,
            api::ContainerState::ContainerExited as i32,
            "handler {h}: {killed:?}"
        );
        assert!(
            killed.finished_at >= killed.started_at,
            "handler {h}: {killed:?}"
        );
        assert!(
            stop_took >= Duration::from_millis(900),
            "handler {h}: stop took {stop_took:?}, did it wait for the grace period?"
        );

        // A shell that traps SIGTERM exits by itself within the grace period, with its code.
        let graceful = container(
            &cri,
            &pod,
            "graceful",
            &[
                "sh",
                "-c",
                "trap 'exit 7' TERM; while :; do sleep 0.1; done",
            ],
            |_| {},
        )
        .await;
        cri.sh_until_ok(&graceful, "true", EXIT_WAIT).await.unwrap();
        cri.stop_container(&graceful, 30).await.unwrap();
        let graceful_status = cri.container_status(&graceful).await.unwrap();

        let fails = container(&cri, &pod, "fails", &["sh", "-c", "exit 3"], |_| {}).await;
        let failed = cri.wait_exited(&fails, EXIT_WAIT).await.unwrap();
        let succeeds = container(&cri, &pod, "succeeds", &["true"], |_| {}).await;
        let completed = cri.wait_exited(&succeeds, EXIT_WAIT).await.unwrap();

        // Starting a container that has exited is refused, as for the kubelet.
        let restart = cri.start_container(&fails).await;
        assert!(
            restart.is_err(),
            "handler {h}: StartContainer of an exited container succeeded"
        );

        cri.remove_container(&id).await.unwrap();
        expect_not_found(h, "ContainerStatus", cri.container_status(&id).await);
        let outcome =
            |s: &api::ContainerStatus| (state_name(s.state), s.exit_code, s.reason.clone());
        let outcomes = vec![
            outcome(&killed),
            outcome(&graceful_status),
            outcome(&failed),
            outcome(&completed),
        ];
        assert_eq!(
            outcomes,
            vec![
                ("CONTAINER_EXITED", 137, "Error".to_string()),
                ("CONTAINER_EXITED", 7, "Error".to_string()),
                ("CONTAINER_EXITED", 3, "Error".to_string()),
                ("CONTAINER_EXITED", 0, "Completed".to_string()),
            ],
            "handler {h}: (state, exit code, reason) of killed, graceful, failing, succeeding"
        );
        outcomes
    })
    .await;
    assert_same("container exit outcomes", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_sync_output_exit_code_and_timeout() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "execsync", |_| {}).await;
        let id = container(&cri, &pod, "sleeper", SLEEPER, |_| {}).await;
        let r = cri
            .exec_sync(&id, &["sh", "-c", "echo out; echo err >&2; exit 3"], 30)
            .await
            .unwrap();
        let out = (
            String::from_utf8_lossy(&r.stdout).into_owned(),
            String::from_utf8_lossy(&r.stderr).into_owned(),
            r.exit_code,
        );
        assert_eq!(
            out,
            ("out\n".into(), "err\n".into(), 3),
            "handler {h}: ExecSync output"
        );

        // Large output is not truncated.
        let big = cri.sh(&id, "seq 1 20000").await.unwrap();
        assert_eq!(
            big.lines().count(),
            20000,
            "handler {h}: seq 1 20000 via ExecSync"
        );

        let missing = cri.exec_sync(&id, &["/no/such/binary"], 30).await;
        let missing = match missing {
            Ok(r) => format!("exit code {}", r.exit_code),
            Err(e) => format!("error {:?}", e.grpc_code()),
        };

        // The CRI kills an exec that outlives its timeout and reports the timeout as an error.
        let t0 = Instant::now();
        let timed_out = cri
            .exec_sync(&id, &["sh", "-c", "echo started; exec sleep 300"], 2)
            .await;
        let took = t0.elapsed();
        let timed_out = match timed_out {
            Err(Error::Grpc { message, .. }) => message,
            other => panic!(
                "handler {h}: ExecSync past its 2s timeout: expected an error, got {other:?}"
            ),
        };
        assert!(timed_out.contains("timeout"), "handler {h}: {timed_out}");
        assert!(
            took < Duration::from_secs(30),
            "handler {h}: timed-out ExecSync took {took:?}"
        );
        cri.sh_until_ok(&id, "! ps -o args | grep -q '[s]leep 300'", EXIT_WAIT)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: the timed-out exec's process lives on: {e}"));
        let exited = container(&cri, &pod, "exited", &["true"], |_| {}).await;
        cri.wait_exited(&exited, EXIT_WAIT).await.unwrap();
        let into_exited = match cri.exec_sync(&exited, &["true"], 30).await {
            Ok(r) => panic!("handler {h}: ExecSync in an exited container: {r:?}"),
            Err(e) => e.grpc_code(),
        };
        (out, missing, into_exited)
    })
    .await;
    assert_same("ExecSync outcomes", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn container_logs_in_cri_format() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "logs", |_| {}).await;
        let script = "echo one; echo two >&2; printf 'a b  c\\n'; echo; printf no-newline";
        let id = container(&cri, &pod, "logger", &["sh", "-c", script], |_| {}).await;
        let status = cri.wait_exited(&id, EXIT_WAIT).await.unwrap();
        assert_eq!(status.exit_code, 0, "handler {h}: {status:?}");
        let path = PathBuf::from(&status.log_path);
        assert_eq!(
            path,
            PathBuf::from(&pod.1.log_directory).join("logger.log"),
            "handler {h}: log path in ContainerStatus"
        );
        let records = crab_integration::cri::wait_log(&path, EXIT_WAIT, |r| {
            r.iter().any(|(_, _, line)| line == "no-newline")
        })
        .await
        .unwrap_or_else(|e| panic!("handler {h}: {e}"));
        let stdout: Vec<_> = records
            .iter()
            .filter(|(s, _, _)| s == "stdout")
            .map(|(_, tag, line)| (tag.as_str(), line.as_str()))
            .collect();
        assert_eq!(
            stdout[..3],
            [("F", "one"), ("F", "a b  c"), ("F", "")],
            "handler {h}: stdout records of {}",
            path.display()
        );
        assert!(
            records.contains(&("stderr".into(), "F".into(), "two".into())),
            "handler {h}: no stderr record `two` in {records:?}"
        );
        // A TTY merges stderr into stdout, and its line discipline ends lines with \r\n.
        let tty = container(
            &cri,
            &pod,
            "tty",
            &["sh", "-c", "echo on-tty; echo err-on-tty >&2"],
            |c| {
                c.tty = true;
            },
        )
        .await;
        let tty_status = cri.wait_exited(&tty, EXIT_WAIT).await.unwrap();
        let tty_records = crab_integration::cri::wait_log(
            PathBuf::from(&tty_status.log_path).as_path(),
            EXIT_WAIT,
            |r| r.len() >= 2,
        )
        .await
        .unwrap_or_else(|e| panic!("handler {h}: {e}"));
        let tty_lines: Vec<_> = tty_records
            .iter()
            .map(|(s, _, l)| (s.as_str(), l.trim_end_matches('\r')))
            .collect();
        assert_eq!(
            tty_lines,
            [("stdout", "on-tty"), ("stdout", "err-on-tty")],
            "handler {h}: log of a TTY container"
        );
        // Streams are written concurrently, so only each stream's own order is defined.
        let mut by_stream = records;
        by_stream.sort_by(|a, b| a.0.cmp(&b.0));
        (by_stream, tty_records)
    })
    .await;
    assert_same(
        "CRI log records (stream, tag, line) without and with a TTY",
        &results,
    );
}

/// An Exec or Attach URL's stream, opened with the v4 protocol (exit codes on the error channel).
async fn exec_stream(
    cri: &Cri,
    h: &str,
    id: &str,
    cmd: &[&str],
    stdin: bool,
    tty: bool,
) -> ws::Conn {
    let url = cri
        .runtime()
        .exec(api::ExecRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            tty,
            stdin,
            stdout: true,
            stderr: !tty,
        })
        .await
        .unwrap_or_else(|e| panic!("handler {h}: Exec: {e}"))
        .into_inner()
        .url;
    open_stream(h, &url).await
}

async fn collect(h: &str, conn: &mut ws::Conn) -> ws::Output {
    tokio::time::timeout(EXIT_WAIT, ws::collect(conn))
        .await
        .unwrap_or_else(|_| panic!("handler {h}: stream not closed within {EXIT_WAIT:?}"))
        .unwrap_or_else(|e| panic!("handler {h}: {e}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_exec() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "exec", |_| {}).await;
        let id = container(&cri, &pod, "sleeper", SLEEPER, |_| {}).await;

        let mut conn = exec_stream(
            &cri,
            h,
            &id,
            &["sh", "-c", "echo out; echo err >&2; exit 3"],
            false,
            false,
        )
        .await;
        let plain = collect(h, &mut conn).await;
        assert_eq!(
            (
                plain.stdout.as_str(),
                plain.stderr.as_str(),
                plain.exit_code()
            ),
            ("out\n", "err\n", Some(3)),
            "handler {h}: streaming exec: {plain:?}"
        );

        let mut conn = exec_stream(&cri, h, &id, &["head", "-n1"], true, false).await;
        conn.send(ws::STDIN, b"through stdin\n").await.unwrap();
        let stdin = collect(h, &mut conn).await;
        assert_eq!(
            (stdin.stdout.as_str(), stdin.exit_code()),
            ("through stdin\n", Some(0)),
            "handler {h}: exec with stdin: {stdin:?}"
        );

        // With a TTY the line discipline turns \n into \r\n, and the process sees a terminal.
        let mut conn = exec_stream(
            &cri,
            h,
            &id,
            &["sh", "-c", "[ -t 0 ] && [ -t 1 ] && echo tty"],
            true,
            true,
        )
        .await;
        let tty = collect(h, &mut conn).await;
        assert_eq!(
            (tty.stdout.as_str(), tty.exit_code()),
            ("tty\r\n", Some(0)),
            "handler {h}: exec with a TTY: {tty:?}"
        );
        // A terminal resize on channel 4 reaches the exec's TTY (the shim's ResizePty).
        let mut conn = exec_stream(
            &cri,
            h,
            &id,
            &[
                "sh",
                "-c",
                "until [ \"$(stty size 2>/dev/null)\" = '40 100' ]; do sleep 0.1; done; stty size",
            ],
            true,
            true,
        )
        .await;
        conn.send(4, br#"{"Width":100,"Height":40}"#).await.unwrap();
        let resized = collect(h, &mut conn).await;
        assert_eq!(
            (resized.stdout.as_str(), resized.exit_code()),
            ("40 100\r\n", Some(0)),
            "handler {h}: exec TTY after a resize: {resized:?}"
        );
        (plain, stdin, tty, resized)
    })
    .await;
    assert_same("streaming exec outputs", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_attach() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "attach", |_| {}).await;
        let script = "while read l; do echo \"got:$l\"; echo \"err:$l\" >&2; done; echo bye";
        let id = container(&cri, &pod, "reader", &["sh", "-c", script], |c| {
            c.stdin = true;
        })
        .await;
        let mut conn = attach_stream(&cri, h, &id, false).await;
        conn.send(ws::STDIN, b"ping\n").await.unwrap();
        let mut out = ws::Output::default();
        let deadline = Instant::now() + EXIT_WAIT;
        while !(out.stdout.contains("got:ping\n") && out.stderr.contains("err:ping\n")) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, conn.recv()).await {
                Ok(Ok(Some((ws::STDOUT, d)))) => out.stdout.push_str(&String::from_utf8_lossy(&d)),
                Ok(Ok(Some((ws::STDERR, d)))) => out.stderr.push_str(&String::from_utf8_lossy(&d)),
                Ok(Ok(Some(_))) => {}
                other => {
                    panic!("handler {h}: attach ended before the echo ({other:?}), have {out:?}")
                }
            }
        }
        conn.close().await.unwrap();
        // Detaching leaves the container running, and what it wrote is in its log too.
        let status = cri.container_status(&id).await.unwrap();
        assert_eq!(
            status.state,
            api::ContainerState::ContainerRunning as i32,
            "handler {h}: container after detach: {status:?}"
        );
        crab_integration::cri::wait_log(
            PathBuf::from(&status.log_path).as_path(),
            EXIT_WAIT,
            |r| r.iter().any(|(s, _, l)| s == "stdout" && l == "got:ping"),
        )
        .await
        .unwrap_or_else(|e| panic!("handler {h}: {e}"));

        // stdin_once: the container's stdin closes when the first attach ends (containerd's
        // CloseIO to the shim), so `cat` sees EOF and the container exits.
        let once = container(
            &cri,
            &pod,
            "once",
            &["sh", "-c", "cat; echo cat-done"],
            |c| {
                c.stdin = true;
                c.stdin_once = true;
            },
        )
        .await;
        let mut conn = attach_stream(&cri, h, &once, false).await;
        conn.send(ws::STDIN, b"last words\n").await.unwrap();
        let mut echoed = String::new();
        while !echoed.contains("last words\n") {
            match tokio::time::timeout(EXIT_WAIT, conn.recv()).await {
                Ok(Ok(Some((ws::STDOUT, d)))) => echoed.push_str(&String::from_utf8_lossy(&d)),
                Ok(Ok(Some(_))) => {}
                other => panic!(
                    "handler {h}: stdin_once attach ended early ({other:?}), have {echoed:?}"
                ),
            }
        }
        conn.close().await.unwrap();
        drop(conn);
        let once_status = cri
            .wait_exited(&once, EXIT_WAIT)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: stdin_once container after detach: {e}"));
        let once_log = crab_integration::cri::wait_log(
            PathBuf::from(&once_status.log_path).as_path(),
            EXIT_WAIT,
            |r| r.iter().any(|(_, _, l)| l == "cat-done"),
        )
        .await
        .unwrap_or_else(|e| panic!("handler {h}: {e}"));
        let once_lines: Vec<String> = once_log.into_iter().map(|(_, _, l)| l).collect();
        assert_eq!(
            once_lines,
            ["last words", "cat-done"],
            "handler {h}: log of the stdin_once container"
        );
        (out, once_status.exit_code, once_lines)
    })
    .await;
    assert_same("attach output, stdin_once exit code and log", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_port_forward() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "portfwd", |_| {}).await;
        let id = container(
            &cri,
            &pod,
            "httpd",
            &["sh", "-c", "mkdir -p /www && echo crab-port-forward > /www/index.html && exec httpd -f -p 8080 -h /www"],
            |_| {},
        )
        .await;
        cri.sh_until_ok(&id, "wget -q -O- http://127.0.0.1:8080/index.html", EXIT_WAIT)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: httpd in the pod: {e}"));
        let mut conn = port_forward_stream(&cri, h, &pod.0, 8080).await;
        conn.send(0, b"GET /index.html HTTP/1.0\r\n\r\n").await.unwrap();
        let mut data = Vec::new();
        let mut errors = String::new();
        let mut port_headers = 0;
        let got = tokio::time::timeout(EXIT_WAIT, async {
            while let Some((channel, payload)) = conn.recv().await.unwrap() {
                // Each channel opens with the port number (u16 little endian).
                if payload == 8080u16.to_le_bytes() && port_headers < 2 {
                    port_headers += 1;
                    continue;
                }
                match channel {
                    0 => data.extend_from_slice(&payload),
                    _ => errors.push_str(&String::from_utf8_lossy(&payload)),
                }
                if String::from_utf8_lossy(&data).contains("crab-port-forward") {
                    break;
                }
            }
        })
        .await;
        let data = String::from_utf8_lossy(&data).into_owned();
        assert!(
            got.is_ok() && data.contains("crab-port-forward") && data.starts_with("HTTP/1."),
            "handler {h}: port-forwarded HTTP answer: {data:?}, errors {errors:?}"
        );
        let _ = conn.close().await;
        (data.lines().next().unwrap_or("").to_string(), errors)
    })
    .await;
    assert_same("port-forward (status line, errors)", &results);
}

/// A pod's cgroup parent, which runc creates and nobody else removes: the kubelet manages pod
/// cgroups itself. Removed (when empty) on drop, after the pod.
struct CgroupParent(String);

impl Drop for CgroupParent {
    fn drop(&mut self) {
        let roots = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];
        let hierarchies = roots.iter().flat_map(|root| {
            std::fs::read_dir(root)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .chain(std::iter::once(PathBuf::from(root)))
        });
        for dir in hierarchies {
            let _ = std::fs::remove_dir(dir.join(&self.0));
        }
    }
}

/// Reads a cgroup value in the container, from cgroup v2 or the v1 controller file.
async fn cgroup_value(cri: &Cri, h: &str, id: &str, v2: &str, v1: &str) -> String {
    sh(
        cri,
        h,
        id,
        &format!("cat /sys/fs/cgroup/{v2} 2>/dev/null || cat /sys/fs/cgroup/{v1}"),
    )
    .await
}

const MIB: i64 = 1024 * 1024;

#[tokio::test(flavor = "multi_thread")]
async fn resource_limits_update_and_stats() {
    let results = for_both_handlers(|cri, h| async move {
        // Pod-level stats come from the pod's cgroup, which only exists under a cgroup parent
        // (the kubelet always gives one).
        let parent = CgroupParent(crab_integration::cri::unique_name("cri-parent"));
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "resources", |p| {
            p.linux.get_or_insert_with(Default::default).cgroup_parent = format!("/{}", parent.0);
        })
        .await;
        let id = container(&cri, &pod, "limited", SLEEPER, |c| {
            c.linux.get_or_insert_with(Default::default).resources = Some(api::LinuxContainerResources {
                memory_limit_in_bytes: 64 * MIB,
                cpu_shares: 512,
                cpu_period: 100_000,
                cpu_quota: 50_000,
                ..Default::default()
            });
        })
        .await;
        let memory = || cgroup_value(&cri, h, &id, "memory.max", "memory/memory.limit_in_bytes");
        let quota = || cgroup_value(&cri, h, &id, "cpu.max", "cpu/cpu.cfs_quota_us");
        let before = (
            memory().await,
            quota().await,
            cgroup_value(&cri, h, &id, "cpu.weight", "cpu/cpu.shares").await,
        );
        assert_eq!(before.0, (64 * MIB).to_string(), "handler {h}: memory limit in the container's cgroup");
        assert!(before.1 == "50000" || before.1 == "50000 100000", "handler {h}: cpu quota {before:?}");

        cri.runtime()
            .update_container_resources(api::UpdateContainerResourcesRequest {
                container_id: id.clone(),
                linux: Some(api::LinuxContainerResources {
                    memory_limit_in_bytes: 128 * MIB,
                    cpu_shares: 512,
                    cpu_period: 100_000,
                    cpu_quota: 20_000,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: UpdateContainerResources: {e}"));
        let after = (memory().await, quota().await);
        assert_eq!(after.0, (128 * MIB).to_string(), "handler {h}: memory limit after update");
        assert!(after.1 == "20000" || after.1 == "20000 100000", "handler {h}: cpu quota after update {after:?}");
        let reported = cri.container_status(&id).await.unwrap().resources;
        let reported_memory = reported
            .as_ref()
            .and_then(|r| r.linux.as_ref())
            .map(|l| l.memory_limit_in_bytes);
        assert_eq!(reported_memory, Some(128 * MIB), "handler {h}: ContainerStatus resources: {reported:?}");

        // Burn some CPU and memory so both show in the stats.
        cri.sh(&id, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; head -c 8000000 /dev/zero | tail -c 1 >/dev/null")
            .await
            .unwrap();
        let stats = cri
            .runtime()
            .container_stats(api::ContainerStatsRequest { container_id: id.clone() })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: ContainerStats: {e}"))
            .into_inner()
            .stats
            .unwrap_or_else(|| panic!("handler {h}: ContainerStats without stats"));
        let cpu = stats.cpu.and_then(|c| c.usage_core_nano_seconds).map(|v| v.value);
        let working_set = stats.memory.and_then(|m| m.working_set_bytes).map(|v| v.value);
        assert!(cpu.is_some_and(|v| v > 0), "handler {h}: cpu usage in stats: {cpu:?}");
        assert!(
            working_set.is_some_and(|v| v > 0 && v <= 128 * MIB as u64),
            "handler {h}: memory working set in stats: {working_set:?}"
        );
        assert_eq!(
            stats.attributes.as_ref().map(|a| a.id.as_str()),
            Some(id.as_str()),
            "handler {h}: stats attributes"
        );
        let listed = cri
            .runtime()
            .list_container_stats(api::ListContainerStatsRequest {
                filter: Some(api::ContainerStatsFilter {
                    pod_sandbox_id: pod.0.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .stats;
        assert_eq!(listed.len(), 1, "handler {h}: ListContainerStats of the pod: {listed:?}");
        let pod_stats = cri
            .runtime()
            .pod_sandbox_stats(api::PodSandboxStatsRequest { pod_sandbox_id: pod.0.clone() })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: PodSandboxStats: {e}"))
            .into_inner()
            .stats
            .and_then(|s| s.linux)
            .unwrap_or_else(|| panic!("handler {h}: PodSandboxStats without Linux stats"));
        let pod_cpu = pod_stats.cpu.and_then(|c| c.usage_core_nano_seconds).map(|v| v.value);
        let pod_memory = pod_stats.memory.and_then(|m| m.working_set_bytes).map(|v| v.value);
        assert!(
            pod_cpu.is_some_and(|v| v > 0) && pod_memory.is_some_and(|v| v > 0),
            "handler {h}: pod cpu {pod_cpu:?}, memory {pod_memory:?}"
        );
        let pod_containers: Vec<_> = pod_stats
            .containers
            .iter()
            .filter_map(|c| c.attributes.as_ref().map(|a| a.id.clone()))
            .collect();
        assert_eq!(pod_containers, std::slice::from_ref(&id), "handler {h}: containers in PodSandboxStats");
        (before, after, stats.writable_layer.is_some())
    })
    .await;
    assert_same(
        "cgroup limits (before, after update), writable layer in stats",
        &results,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn oom_killed_is_reported() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "oom", |_| {}).await;
        // The string doubles until the 32 MiB limit stops it.
        let id = container(
            &cri,
            &pod,
            "hog",
            &["sh", "-c", "a=x; while :; do a=$a$a; done"],
            |c| {
                c.linux.get_or_insert_with(Default::default).resources =
                    Some(api::LinuxContainerResources {
                        memory_limit_in_bytes: 32 * MIB,
                        ..Default::default()
                    });
            },
        )
        .await;
        let status = cri.wait_exited(&id, EXIT_WAIT).await.unwrap();
        let outcome = (status.exit_code, status.reason.clone());
        assert_eq!(
            outcome,
            (137, "OOMKilled".to_string()),
            "handler {h}: {status:?}"
        );
        outcome
    })
    .await;
    assert_same("OOM outcome (exit code, reason)", &results);
}

/// The namespace inodes a process in `id` sees (`net:[...] ipc:[...] ...`).
async fn ns_of(cri: &Cri, h: &str, id: &str) -> HashMap<String, String> {
    let out = sh(
        cri,
        h,
        id,
        "for n in net ipc uts pid; do echo $n $(readlink /proc/self/ns/$n); done",
    )
    .await;
    out.lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn host_ns(kind: &str) -> String {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_namespaces_shared_and_host() {
    use api::NamespaceMode::{Node, Pod};
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        // The harness's defaults are the kubelet's: network and IPC per pod, PID per container.
        let pod1 = pod(&cri, &mut guard, h, "ns", |_| {}).await;
        let with_ns = |ns: api::NamespaceOption| {
            move |c: &mut api::ContainerConfig| linux_sc(c).namespace_options = Some(ns)
        };
        let a = container(&cri, &pod1, "a", SLEEPER, |_| {}).await;
        let b = container(&cri, &pod1, "b", SLEEPER, |_| {}).await;
        let (na, nb) = (ns_of(&cri, h, &a).await, ns_of(&cri, h, &b).await);
        for kind in ["net", "ipc", "uts"] {
            assert_eq!(
                na[kind], nb[kind],
                "handler {h}: containers of one pod share {kind}"
            );
            assert_ne!(
                na[kind],
                host_ns(kind),
                "handler {h}: pod {kind} namespace is the host's"
            );
        }
        assert_ne!(
            na["pid"], nb["pid"],
            "handler {h}: PID mode CONTAINER shares a pid namespace"
        );
        // The pod's network is the one CNI set up: its IP is on the container's eth0, and
        // containers of the pod reach each other on localhost.
        let pod_ip = cri
            .pod_status(&pod1.0)
            .await
            .unwrap()
            .network
            .map(|n| n.ip)
            .unwrap_or_default();
        let addrs = sh(&cri, h, &a, "ip -4 -o addr show dev eth0").await;
        assert!(
            !pod_ip.is_empty() && addrs.contains(&format!("inet {pod_ip}/")),
            "handler {h}: pod IP {pod_ip:?} not on eth0: {addrs}"
        );
        let _server = sh(
            &cri,
            h,
            &a,
            "nc -l -p 7777 -e echo from-a >/dev/null 2>&1 & echo started",
        )
        .await;
        let over_lo = cri
            .sh_until_ok(&b, "nc 127.0.0.1 7777 </dev/null | grep from-a", EXIT_WAIT)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: container b reaching a on localhost: {e}"));
        assert_eq!(over_lo.trim(), "from-a");
        let own_pid1 = sh(&cri, h, &a, "cat /proc/1/comm").await;

        // shareProcessNamespace: the pause process is pid 1 of every container.
        let shared = namespaces(Pod, Pod, Pod);
        let pod2 = pod(&cri, &mut guard, h, "ns-shared", |p| {
            pod_sc(p).namespace_options = Some(shared.clone());
        })
        .await;
        let c = container(&cri, &pod2, "c", SLEEPER, with_ns(shared.clone())).await;
        let d = container(&cri, &pod2, "d", SLEEPER, with_ns(shared.clone())).await;
        assert_eq!(
            ns_of(&cri, h, &c).await["pid"],
            ns_of(&cri, h, &d).await["pid"],
            "handler {h}: PID mode POD"
        );
        let shared_pid1 = sh(&cri, h, &c, "cat /proc/1/comm").await;
        let sees_other = sh(&cri, h, &c, "ps -o args | grep -c '[s]leep 3600'").await;

        // hostNetwork, hostIPC, hostPID.
        let host = namespaces(Node, Node, Node);
        let pod3 = pod(&cri, &mut guard, h, "ns-host", |p| {
            // As the kubelet does: a pod in the host's UTS namespace cannot set a hostname.
            p.hostname.clear();
            pod_sc(p).namespace_options = Some(host.clone());
        })
        .await;
        let e = container(&cri, &pod3, "e", SLEEPER, with_ns(host.clone())).await;
        let ne = ns_of(&cri, h, &e).await;
        for kind in ["net", "ipc", "pid"] {
            assert_eq!(ne[kind], host_ns(kind), "handler {h}: NODE mode for {kind}");
        }
        let host_pod_status = cri.pod_status(&pod3.0).await.unwrap();
        (
            own_pid1,
            shared_pid1,
            sees_other,
            ne["uts"] == host_ns("uts"),
            host_pod_status.network.map(|n| n.ip.is_empty()),
        )
    })
    .await;
    assert_same(
        "(pid 1 with own pid ns, pid 1 with the pod's, sleepers seen, host pod shares uts, host pod IP empty)",
        &results,
    );
    let (own_pid1, shared_pid1, sees_other, _, _) = &results[0].1;
    assert_eq!(own_pid1, "sleep");
    assert_eq!(shared_pid1, "pause");
    assert_eq!(sees_other, "2");
}

#[tokio::test(flavor = "multi_thread")]
async fn security_context_user_rootfs_caps_nnp() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "secctx", |_| {}).await;
        let default = container(&cri, &pod, "default", SLEEPER, |_| {}).await;
        let status = |id: String| {
            let cri = cri.clone();
            async move { sh(&cri, h, &id, "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status | tr -d '\\t'").await }
        };
        let default_status = status(default.clone()).await;
        let default_write = sh(&cri, h, &default, "touch /rootfs-write && echo ok").await;

        let user = container(&cri, &pod, "user", SLEEPER, |c| {
            let sc = linux_sc(c);
            sc.run_as_user = Some(api::Int64Value { value: 1234 });
            sc.run_as_group = Some(api::Int64Value { value: 2345 });
            sc.supplemental_groups = vec![3456];
        })
        .await;
        let ids = sh(&cri, h, &user, "echo $(id -u) $(id -g) $(id -G)").await;
        assert_eq!(ids, "1234 2345 2345 3456", "handler {h}: id -u, -g, -G with run_as_user/group");

        let readonly = container(&cri, &pod, "readonly", SLEEPER, |c| linux_sc(c).readonly_rootfs = true).await;
        let ro = cri.exec_sync(&readonly, &["touch", "/rootfs-write"], 30).await.unwrap();
        let ro = (ro.exit_code != 0, String::from_utf8_lossy(&ro.stderr).contains("Read-only file system"));
        assert_eq!(ro, (true, true), "handler {h}: write to a read-only rootfs");

        let dropped = container(&cri, &pod, "dropped", SLEEPER, |c| {
            linux_sc(c).capabilities = Some(api::Capability {
                drop_capabilities: vec!["ALL".into()],
                add_capabilities: vec!["NET_ADMIN".into()],
                ..Default::default()
            });
            linux_sc(c).no_new_privs = true;
        })
        .await;
        let dropped_status = status(dropped.clone()).await;
        let chown = cri.exec_sync(&dropped, &["chown", "1:1", "/tmp"], 30).await.unwrap().exit_code;
        assert_ne!(chown, 0, "handler {h}: chown without CAP_CHOWN succeeded");

        // containerd's default capability set (CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW
        // SETGID SETUID SETFCAP SETPCAP NET_BIND_SERVICE SYS_CHROOT KILL AUDIT_WRITE), no
        // seccomp filter unless asked for, no no_new_privs.
        assert!(default_status.contains("CapEff:00000000a80425fb"), "handler {h}: default {default_status}");
        assert!(default_status.contains("NoNewPrivs:0"), "handler {h}: default {default_status}");
        assert!(dropped_status.contains("CapEff:0000000000001000"), "handler {h}: drop ALL add NET_ADMIN {dropped_status}");
        assert!(dropped_status.contains("NoNewPrivs:1"), "handler {h}: no_new_privs {dropped_status}");
        (default_status, default_write, ids, ro, dropped_status)
    })
    .await;
    assert_same(
        "(default status, rootfs write, ids, read-only rootfs, dropped caps + nnp)",
        &results,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn security_context_masked_readonly_paths_and_seccomp() {
    use api::security_profile::ProfileType;
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "paths", |_| {}).await;
        let paths = container(&cri, &pod, "paths", SLEEPER, |c| {
            let sc = linux_sc(c);
            sc.masked_paths = vec!["/proc/cpuinfo".into(), "/etc/crab-masked".into()];
            sc.readonly_paths = vec!["/etc".into()];
        })
        .await;
        let cpuinfo = sh(&cri, h, &paths, "wc -c < /proc/cpuinfo").await;
        assert_eq!(cpuinfo, "0", "handler {h}: masked /proc/cpuinfo is readable");
        let etc = cri.exec_sync(&paths, &["touch", "/etc/crab-write"], 30).await.unwrap();
        let etc = (etc.exit_code != 0, String::from_utf8_lossy(&etc.stderr).contains("Read-only file system"));
        assert_eq!(etc, (true, true), "handler {h}: write under read-only path /etc");
        let tmp = sh(&cri, h, &paths, "touch /tmp/x && echo ok").await;

        // The runtime's default seccomp profile lets no unprivileged process create namespaces;
        // without a profile nothing stops an unprivileged user namespace.
        let seccomp = |profile: ProfileType| {
            move |c: &mut api::ContainerConfig| {
                linux_sc(c).seccomp = Some(api::SecurityProfile {
                    profile_type: profile as i32,
                    localhost_ref: String::new(),
                })
            }
        };
        let confined = container(&cri, &pod, "confined", SLEEPER, seccomp(ProfileType::RuntimeDefault)).await;
        let unconfined = container(&cri, &pod, "unconfined", SLEEPER, seccomp(ProfileType::Unconfined)).await;
        let probe = "grep Seccomp: /proc/self/status | tr -d '\\t'; unshare -U true 2>&1 && echo unshare-ok";
        // A profile of our own that only refuses chmod.
        let profile_dir = tempfile::tempdir_in(cri.env.crab_home.join("tmp")).unwrap();
        let profile = profile_dir.path().join("no-chmod.json");
        std::fs::write(
            &profile,
            r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["chmod", "fchmod", "fchmodat", "fchmodat2"], "action": "SCMP_ACT_ERRNO"}]}"#,
        )
        .unwrap();
        let localhost = container(&cri, &pod, "localhost", SLEEPER, |c| {
            linux_sc(c).seccomp = Some(api::SecurityProfile {
                profile_type: ProfileType::Localhost as i32,
                localhost_ref: profile.to_string_lossy().into_owned(),
            })
        })
        .await;
        let chmod = |id: String| {
            let cri = cri.clone();
            async move { cri.exec_sync(&id, &["chmod", "700", "/tmp"], 30).await.unwrap().exit_code }
        };
        let (chmod_localhost, chmod_unconfined) = (chmod(localhost).await, chmod(unconfined.clone()).await);
        assert!(
            chmod_localhost != 0 && chmod_unconfined == 0,
            "handler {h}: chmod exit codes: with the no-chmod profile {chmod_localhost}, unconfined {chmod_unconfined}"
        );
        let confined_out = cri.exec_sync(&confined, &["sh", "-c", probe], 30).await.unwrap();
        let unconfined_out = cri.exec_sync(&unconfined, &["sh", "-c", probe], 30).await.unwrap();
        let (c, u) = (
            String::from_utf8_lossy(&confined_out.stdout).into_owned(),
            String::from_utf8_lossy(&unconfined_out.stdout).into_owned(),
        );
        assert!(c.contains("Seccomp:2") && !c.contains("unshare-ok"), "handler {h}: RuntimeDefault: {c:?}");
        assert!(u.contains("Seccomp:0") && u.contains("unshare-ok"), "handler {h}: Unconfined: {u:?}");
        (cpuinfo, etc, tmp, c, u, chmod_localhost)
    })
    .await;
    assert_same(
        "(masked, read-only path, other path, seccomp default, unconfined, chmod under a localhost profile)",
        &results,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sysctls_apply_to_the_pod() {
    let host_value =
        || std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start").unwrap();
    let host_before = host_value();
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "sysctl", |p| {
            let sysctls = &mut p.linux.get_or_insert_with(Default::default).sysctls;
            sysctls.insert("kernel.shm_rmid_forced".into(), "1".into());
            sysctls.insert("net.ipv4.ip_unprivileged_port_start".into(), "2048".into());
        })
        .await;
        let id = container(&cri, &pod, "reader", SLEEPER, |_| {}).await;
        let values = sh(
            &cri,
            h,
            &id,
            "cat /proc/sys/kernel/shm_rmid_forced /proc/sys/net/ipv4/ip_unprivileged_port_start",
        )
        .await;
        assert_eq!(
            values, "1\n2048",
            "handler {h}: pod sysctls in the container"
        );
        values
    })
    .await;
    assert_same("sysctls", &results);
    assert_eq!(
        host_value(),
        host_before,
        "a pod's sysctl changed the host's"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn container_env_workdir_hostname_and_mounts() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "config", |_| {}).await;
        let scratch = cri.env.crab_home.join("tmp");
        std::fs::create_dir_all(&scratch).unwrap();
        let host_dir = tempfile::tempdir_in(&scratch).unwrap();
        std::fs::write(host_dir.path().join("from-host"), "host data\n").unwrap();
        let host_path = host_dir.path().to_string_lossy().into_owned();
        let id = container(&cri, &pod, "configured", SLEEPER, |c| {
            c.envs = vec![api::KeyValue {
                key: "CRAB_VAR".into(),
                value: "with space".into(),
            }];
            c.working_dir = "/tmp".into();
            c.mounts = vec![
                api::Mount {
                    container_path: "/data".into(),
                    host_path: host_path.clone(),
                    ..Default::default()
                },
                api::Mount {
                    container_path: "/data-ro".into(),
                    host_path: host_path.clone(),
                    readonly: true,
                    ..Default::default()
                },
            ];
        })
        .await;
        let seen = sh(
            &cri,
            h,
            &id,
            "echo \"$CRAB_VAR\"; pwd; hostname; cat /data/from-host; echo from-container > /data/written; \
             touch /data-ro/x 2>/dev/null && echo ro-writable || echo ro-refused",
        )
        .await;
        assert_eq!(
            seen,
            "with space\n/tmp\ncrab-pod\nhost data\nro-refused",
            "handler {h}: env, working dir, hostname, bind mounts"
        );
        let written = std::fs::read_to_string(host_dir.path().join("written")).unwrap_or_default();
        assert_eq!(written, "from-container\n", "handler {h}: a write to the bind mount, seen on the host");
        // Remove the pod before the directory it mounts.
        drop(guard);
        seen
    })
    .await;
    assert_same("env, working dir, hostname, mounts", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_sync_concurrent_and_during_stop() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "exec-concurrent", |_| {}).await;
        let id = container(&cri, &pod, "sleeper", SLEEPER, |_| {}).await;
        // The kubelet runs probes and `kubectl exec` side by side in one container.
        let execs = (0..6).map(|i| {
            let (cri, id) = (cri.clone(), id.clone());
            tokio::spawn(async move {
                let script = format!("sleep 0.$((RANDOM % 5)); echo exec-{i}");
                cri.sh(&id, &script).await
            })
        });
        let mut outputs = Vec::new();
        for exec in execs {
            let out = exec
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("handler {h}: concurrent exec: {e}"));
            outputs.push(out.trim().to_string());
        }
        let expected: Vec<String> = (0..6).map(|i| format!("exec-{i}")).collect();
        assert_eq!(
            outputs, expected,
            "handler {h}: outputs of concurrent ExecSyncs"
        );

        // An exec still running when its container is stopped ends with it.
        let long = {
            let (cri, id) = (cri.clone(), id.clone());
            tokio::spawn(async move {
                cri.exec_sync(&id, &["sh", "-c", "echo begun; exec sleep 300"], 0)
                    .await
            })
        };
        cri.sh_until_ok(&id, "ps -o args | grep -q '[s]leep 300'", EXIT_WAIT)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: the long exec did not start: {e}"));
        cri.stop_container(&id, 2).await.unwrap();
        let ended = tokio::time::timeout(EXIT_WAIT, long)
            .await
            .unwrap_or_else(|_| {
                panic!("handler {h}: ExecSync outlives its stopped container by {EXIT_WAIT:?}")
            })
            .unwrap();
        let ended = match ended {
            Ok(r) => format!(
                "exit code {}, stdout {:?}",
                r.exit_code,
                String::from_utf8_lossy(&r.stdout)
            ),
            Err(e) => format!("error {:?}", e.grpc_code()),
        };
        let status = cri.container_status(&id).await.unwrap();
        (outputs, ended, status.exit_code)
    })
    .await;
    assert_same(
        "concurrent exec outputs, an exec across StopContainer, exit code",
        &results,
    );
}
