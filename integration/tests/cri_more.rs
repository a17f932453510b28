//! More of what the CRI conformance suite (cri-tools' `critest`, pkg/validate) checks, each run
//! against both runtime handlers of the private containerd (runc first, as the reference) and
//! compared, as in tests/cri.rs: privileged pods and containers, ReopenContainerLog, attach with
//! a TTY and a resize, container restarts within a pod and removal of a running container,
//! CheckpointContainer, mount propagation, recursive read-only mounts, the runtime handler's
//! features, image volumes, DNS config, user names, RunAsGroup without RunAsUser, port-forward
//! in the host's network.
//!
//! Needs containerd with the CRI plugin (`CRAB_CONTAINERD_CRI=1 hack/containerd.sh start`) and
//! the test images in its `k8s.io` namespace (`hack/build-images.sh import k8s.io`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crab_integration::cri::both::{
    assert_same, attach_stream, container, for_both_handlers, linux_sc, pod, pod_sc,
    port_forward_stream, sh, state_name,
};
use crab_integration::cri::{api, ws, Cri, PodGuard};

const SLEEPER: &[&str] = &["sleep", "3600"];
const WAIT: Duration = Duration::from_secs(60);

/// `sh -c script` in `id`: (exit code, stdout, stderr), whatever the exit code.
async fn sh_any(cri: &Cri, handler: &str, id: &str, script: &str) -> (i32, String, String) {
    let r = cri
        .exec_sync(id, &["sh", "-c", script], 30)
        .await
        .unwrap_or_else(|e| panic!("handler {handler}: ExecSync {script:?} in {id}: {e}"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    (r.exit_code, text(&r.stdout), text(&r.stderr))
}

fn scratch(cri: &Cri) -> PathBuf {
    let dir = cri.env.crab_home.join("tmp");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What the CRI's Status says runtime handler `name` supports.
async fn handler_features(cri: &Cri, name: &str) -> Option<api::RuntimeHandlerFeatures> {
    let status = cri
        .runtime()
        .status(api::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner();
    let handler = status
        .runtime_handlers
        .iter()
        .find(|h| h.name == name)
        .unwrap_or_else(|| panic!("no runtime handler {name} in {status:?}"));
    handler.features
}

/// containerd's introspection asks a shim binary for its runtime info (`<shim> -info`): crab
/// answers with runc's features, as containerd's runc shim does.
#[tokio::test(flavor = "multi_thread")]
async fn runtime_info_through_introspection() {
    use containerd_client::services::v1::introspection_client::IntrospectionClient;
    use containerd_client::services::v1::PluginInfoRequest;
    use containerd_client::types::{RuntimeInfo, RuntimeRequest};
    use prost::Message;
    let cri = Cri::for_test().await;
    let channel = containerd_client::connect(&cri.env.address).await.unwrap();
    let mut features = Vec::new();
    for runtime in ["io.containerd.runc.v2", "io.containerd.crab.v1"] {
        let request = RuntimeRequest {
            runtime_path: runtime.into(),
            options: None,
        };
        let extra = IntrospectionClient::new(channel.clone())
            .plugin_info(PluginInfoRequest {
                r#type: "io.containerd.runtime.v2".into(),
                id: "task".into(),
                options: Some(prost_types::Any {
                    type_url: "containerd.types.RuntimeRequest".into(),
                    value: request.encode_to_vec(),
                }),
            })
            .await
            .unwrap_or_else(|e| panic!("PluginInfo of runtime {runtime}: {e}"))
            .into_inner()
            .extra
            .unwrap_or_else(|| panic!("PluginInfo of runtime {runtime}: no runtime info"));
        let info = RuntimeInfo::decode(extra.value.as_slice()).unwrap();
        assert_eq!(info.name, runtime, "{info:?}");
        let f = info
            .features
            .unwrap_or_else(|| panic!("runtime {runtime}: no features in {}", info.name));
        let json: serde_json::Value = serde_json::from_slice(&f.value).unwrap();
        features.push((runtime, (f.type_url, json)));
    }
    assert_same("runtime features (type URL, runc's JSON)", &features);
}

/// The CRI asks only runtime type io.containerd.runc.v2 for its features (containerd 2.1's
/// introspectRuntimeFeatures refuses other types before it runs the shim). crab's handler `crab`
/// is registered as the README recommends, with runc's runtime type and crab's shim as
/// `runtime_path`: it reports runc's features (recursive read-only mounts, user namespaces),
/// so the kubelet takes such pods on it as on runc. The same shim under its own runtime type
/// (`crab-v1`, as ctr, nerdctl and Docker use it) reports none: the kubelet would refuse those
/// pods there, which is why the README recommends the runc-type registration for Kubernetes.
#[tokio::test(flavor = "multi_thread")]
async fn runtime_handler_features() {
    let results = for_both_handlers(|cri, h| async move { handler_features(&cri, h).await }).await;
    // The reference: runc 1.3 on this kernel (mount_setattr) mounts recursively read-only.
    let (_, runc) = &results[0];
    assert!(
        runc.as_ref()
            .is_some_and(|f| f.recursive_read_only_mounts && f.user_namespaces),
        "runc handler features: {runc:?}"
    );
    assert_same("runtime handler features", &results);
    let cri = Cri::for_test().await;
    assert_eq!(
        handler_features(&cri, "crab-v1").await,
        None,
        "crab under its own runtime type now reports features: say so in docs/kubernetes.md"
    );
}

/// A block device node of the host, which only a privileged container gets in its /dev.
fn host_block_device() -> String {
    use std::os::unix::fs::FileTypeExt;
    std::fs::read_dir("/dev")
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_block_device()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .min()
        .expect("the host has a block device in /dev")
}

#[tokio::test(flavor = "multi_thread")]
async fn privileged_pod_and_container() {
    use api::security_profile::ProfileType;
    let device = host_block_device();
    let results = for_both_handlers(|cri, h| {
        let device = device.clone();
        async move {
            let mut guard = PodGuard::new();
            let pod = pod(&cri, &mut guard, h, "privileged", |p| {
                pod_sc(p).privileged = true
            })
            .await;
            // The runtime's default seccomp profile would refuse mount(2) and more; a privileged
            // container runs without it whatever it asks for.
            // The kubelet sends its masked and read-only /proc paths for every container; a
            // privileged one gets none of them.
            let kubelet_paths = |sc: &mut api::LinuxContainerSecurityContext| {
                sc.masked_paths = vec!["/proc/keys".into(), "/proc/timer_list".into()];
                sc.readonly_paths = vec!["/proc/sys".into()];
            };
            let privileged = container(&cri, &pod, "privileged", SLEEPER, |c| {
                let sc = linux_sc(c);
                kubelet_paths(sc);
                sc.privileged = true;
                sc.seccomp = Some(api::SecurityProfile {
                    profile_type: ProfileType::RuntimeDefault as i32,
                    localhost_ref: String::new(),
                });
            })
            .await;
            let plain = container(&cri, &pod, "plain", SLEEPER, |c| kubelet_paths(linux_sc(c))).await;
            let probe = format!(
                "grep -E '^(CapEff|CapBnd|Seccomp):' /proc/self/status | tr -d '\\t'; \
                 [ -b /dev/{device} ] && echo device || echo no-device; \
                 grep -E '^sysfs /sys ' /proc/mounts | cut -d' ' -f4 | cut -d, -f1; \
                 grep -c -E ' /proc/(keys|timer_list) ' /proc/mounts; \
                 grep ' /proc/sys ' /proc/mounts | cut -d' ' -f4 | cut -d, -f1 | grep . || echo no-proc-sys-mount; \
                 mkdir -p /mnt/t && mount -t tmpfs -o size=1m crab /mnt/t 2>/dev/null \
                   && touch /mnt/t/x && grep ' /mnt/t ' /proc/mounts | cut -d' ' -f1,3 || echo mount-refused; \
                 ip link add crabbr0 type bridge 2>/dev/null && ip link del crabbr0 && echo netadmin \
                   || echo netadmin-refused; \
                 hostname crab-renamed 2>/dev/null && hostname || echo sethostname-refused"
            );
            let p = sh_any(&cri, h, &privileged, &probe).await;
            let u = sh_any(&cri, h, &plain, &probe).await;
            let lines = |out: &(i32, String, String)| -> Vec<String> {
                out.1.lines().map(str::to_string).collect()
            };
            let (p, u) = (lines(&p), lines(&u));
            // CAP_SYS_ADMIN (21) and CAP_NET_ADMIN (12) only with privileged.
            let caps = |l: &[String]| {
                let eff = l[0].strip_prefix("CapEff:").unwrap_or_else(|| panic!("{l:?}"));
                u64::from_str_radix(eff, 16).unwrap()
            };
            assert!(
                caps(&p) & (1 << 21 | 1 << 12) == (1 << 21 | 1 << 12),
                "handler {h}: privileged: {p:?}"
            );
            assert_eq!(caps(&u) & (1 << 21 | 1 << 12), 0, "handler {h}: plain: {u:?}");
            assert_eq!(
                p[2..],
                [
                    "Seccomp:0",
                    "device",
                    "rw",
                    "0",
                    "no-proc-sys-mount",
                    "crab tmpfs",
                    "netadmin",
                    "crab-renamed"
                ],
                "handler {h}: privileged container (seccomp, /dev/{device}, /sys, masked /proc \
                 paths, read-only /proc/sys, tmpfs mount, a bridge, sethostname)"
            );
            assert_eq!(
                u[2..],
                [
                    "Seccomp:0",
                    "no-device",
                    "ro",
                    "2",
                    "ro",
                    "mount-refused",
                    "netadmin-refused",
                    "sethostname-refused"
                ],
                "handler {h}: unprivileged container in the privileged pod"
            );
            (p, u)
        }
    })
    .await;
    assert_same("privileged and plain container probes", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn reopen_container_log() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "reopen-log", |_| {}).await;
        let id = container(
            &cri,
            &pod,
            "counter",
            &[
                "sh",
                "-c",
                "i=0; while :; do echo line-$i; i=$((i+1)); sleep 0.05; done",
            ],
            |_| {},
        )
        .await;
        let path = PathBuf::from(cri.container_status(&id).await.unwrap().log_path);
        crab_integration::cri::wait_log(&path, WAIT, |r| !r.is_empty())
            .await
            .unwrap_or_else(|e| panic!("handler {h}: {e}"));
        let renamed = path.with_extension("log.rotated");
        std::fs::rename(&path, &renamed).unwrap();
        let reopen = |id: String| {
            let cri = cri.clone();
            async move {
                cri.runtime()
                    .reopen_container_log(api::ReopenContainerLogRequest { container_id: id })
                    .await
            }
        };
        reopen(id.clone())
            .await
            .unwrap_or_else(|e| panic!("handler {h}: ReopenContainerLog: {e}"));
        assert!(
            path.exists(),
            "handler {h}: ReopenContainerLog did not create {}",
            path.display()
        );
        let numbers = |p: &Path| -> Vec<u64> {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            crab_integration::cri::parse_cri_log(&text)
                .unwrap_or_else(|e| panic!("handler {h}: {}: {e}", p.display()))
                .iter()
                .map(|(_, _, l)| {
                    l.strip_prefix("line-")
                        .and_then(|n| n.parse().ok())
                        .unwrap()
                })
                .collect()
        };
        // The old file stops growing while the new one takes the next 20 lines.
        let old = numbers(&renamed);
        let t0 = Instant::now();
        let new = loop {
            let new = numbers(&path);
            assert_eq!(
                numbers(&renamed),
                old,
                "handler {h}: the renamed log is still written after the reopen"
            );
            if new.len() >= 20 {
                break new;
            }
            assert!(
                t0.elapsed() < WAIT,
                "handler {h}: new log after the reopen: {new:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Nothing is lost or doubled at the switch.
        let contiguous = |v: &[u64]| v.windows(2).all(|w| w[1] == w[0] + 1);
        assert!(
            contiguous(&old) && contiguous(&new) && old.first() == Some(&0),
            "handler {h}: old {old:?}, new {new:?}"
        );
        assert_eq!(
            new[0],
            old.last().unwrap() + 1,
            "handler {h}: the first line after the reopen"
        );
        // A stopped container has no log to reopen.
        cri.stop_container(&id, 0).await.unwrap();
        let stopped = reopen(id.clone()).await.map(drop).map_err(|s| s.code());
        assert!(
            stopped.is_err(),
            "handler {h}: ReopenContainerLog of a stopped container"
        );
        stopped
    })
    .await;
    assert_same("ReopenContainerLog of a stopped container", &results);
}

/// Receives from an attach or exec stream until `done` accepts what came on stdout.
async fn read_until(h: &str, conn: &mut ws::Conn, out: &mut String, done: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done(out) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, conn.recv()).await {
            Ok(Ok(Some((ws::STDOUT, d)))) => out.push_str(&String::from_utf8_lossy(&d)),
            Ok(Ok(Some(_))) => {}
            other => panic!("handler {h}: stream ended or stalled ({other:?}), have {out:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn attach_tty_and_resize() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "attach-tty", |_| {}).await;
        // Reads lines from its terminal and answers each with the terminal's size, so what the
        // resize did is seen in the reply to the next line.
        let script = "while read l; do echo \"$l:$(stty size)\"; done";
        let id = container(&cri, &pod, "tty", &["sh", "-c", script], |c| {
            c.tty = true;
            c.stdin = true;
        })
        .await;
        let mut conn = attach_stream(&cri, h, &id, true).await;
        let mut out = String::new();
        let mut sizes = Vec::new();
        for (i, (w, rows)) in [(100, 40), (132, 50)].into_iter().enumerate() {
            conn.send(4, format!(r#"{{"Width":{w},"Height":{rows}}}"#).as_bytes())
                .await
                .unwrap();
            // The resize and the line travel separately (the CRI resizes through the shim's
            // ResizePty): ask until the answer shows the new size.
            let want = format!("q{i}:{rows} {w}");
            let deadline = Instant::now() + WAIT;
            while !out.contains(&want) {
                assert!(
                    Instant::now() < deadline,
                    "handler {h}: no {want:?} after a resize, have {out:?}"
                );
                conn.send(ws::STDIN, format!("q{i}\n").as_bytes())
                    .await
                    .unwrap();
                let len = out.len();
                read_until(h, &mut conn, &mut out, |o| {
                    o[len..].contains(&format!("q{i}:")) && o.ends_with('\n')
                })
                .await;
            }
            sizes.push(want);
        }
        let _ = conn.close().await;
        drop(conn);
        // The terminal echoes input and ends lines with \r\n.
        assert!(
            out.contains("q0\r\n"),
            "handler {h}: no echo on the TTY: {out:?}"
        );
        let status = cri.container_status(&id).await.unwrap();
        assert_eq!(
            status.state,
            api::ContainerState::ContainerRunning as i32,
            "handler {h}: container after detach: {status:?}"
        );
        let log = crab_integration::cri::wait_log(Path::new(&status.log_path), WAIT, |r| {
            r.iter().any(|(_, _, l)| l.trim_end() == "q1:50 132")
        })
        .await
        .unwrap_or_else(|e| panic!("handler {h}: {e}"));
        assert!(
            log.iter().all(|(s, _, _)| s == "stdout"),
            "handler {h}: a TTY's log has only stdout: {log:?}"
        );
        sizes
    })
    .await;
    assert_same("terminal sizes seen after resizes", &results);
}

/// The container's init pid from the verbose ContainerStatus, as the kubelet's debug tools read
/// it.
async fn container_pid(cri: &Cri, h: &str, id: &str) -> i32 {
    cri.container_pid(id)
        .await
        .unwrap_or_else(|e| panic!("handler {h}: ContainerStatus: {e}")) as i32
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_within_pod_and_remove_running() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "restart", |_| {}).await;
        // What the kubelet does when a container exits: a new container with the same name and
        // the next attempt number, in the same pod.
        let attempt = |n: u32, cmd: &str| {
            let mut c = Cri::container_config("app", &["sh", "-c", cmd]);
            c.metadata.as_mut().unwrap().attempt = n;
            c.log_path = format!("app_{n}.log");
            c
        };
        let first = cri
            .run_container(&pod.0, &pod.1, attempt(0, "echo attempt-0; exit 2"))
            .await
            .unwrap();
        let exited = cri.wait_exited(&first, WAIT).await.unwrap();
        let second = cri
            .run_container(
                &pod.0,
                &pod.1,
                attempt(1, "echo attempt-1; exec sleep 3600"),
            )
            .await
            .unwrap_or_else(|e| panic!("handler {h}: attempt 1: {e}"));
        let running = cri.container_status(&second).await.unwrap();
        let exited_again = cri.container_status(&first).await.unwrap();
        let summary = |s: &api::ContainerStatus| {
            (
                s.metadata.as_ref().map(|m| (m.name.clone(), m.attempt)),
                state_name(s.state),
                s.exit_code,
                s.reason.clone(),
            )
        };
        let summaries = vec![summary(&exited), summary(&exited_again), summary(&running)];
        assert_eq!(
            summaries,
            vec![
                (
                    Some(("app".into(), 0)),
                    "CONTAINER_EXITED",
                    2,
                    "Error".into()
                ),
                (
                    Some(("app".into(), 0)),
                    "CONTAINER_EXITED",
                    2,
                    "Error".into()
                ),
                (
                    Some(("app".into(), 1)),
                    "CONTAINER_RUNNING",
                    0,
                    String::new()
                ),
            ],
            "handler {h}: attempts 0 (at exit, after attempt 1 started) and 1"
        );
        for (n, status) in [(0, &exited), (1, &running)] {
            crab_integration::cri::wait_log(Path::new(&status.log_path), WAIT, |r| {
                r.iter().any(|(_, _, l)| *l == format!("attempt-{n}"))
            })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: log of attempt {n}: {e}"));
        }
        // The same name and attempt twice is refused.
        let duplicate = cri
            .create_container(&pod.0, &pod.1, attempt(1, "true"))
            .await
            .map(drop)
            .map_err(|e| e.grpc_code());
        assert!(
            duplicate.is_err(),
            "handler {h}: a second attempt 1 was created"
        );

        // RemoveContainer of a running container kills it first.
        let pid = container_pid(&cri, h, &second).await;
        let cmdline = |pid: i32| std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        // StartContainer returns once runc has told the init to exec: under load the exec may
        // still be under way (its command line reads empty meanwhile).
        let t0 = Instant::now();
        while cmdline(pid) != b"sleep\x003600\x00" && t0.elapsed() < WAIT {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(cmdline(pid), b"sleep\x003600\x00", "handler {h}: pid {pid}");
        cri.remove_container(&second)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: RemoveContainer of a running container: {e}"));
        let gone = cri
            .container_status(&second)
            .await
            .map(drop)
            .map_err(|e| e.grpc_code());
        assert_eq!(
            gone,
            Err(Some(tonic::Code::NotFound)),
            "handler {h}: status after removal"
        );
        let t0 = Instant::now();
        while cmdline(pid) == b"sleep\x003600\x00" {
            assert!(
                t0.elapsed() < WAIT,
                "handler {h}: the removed container's process lives on"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cri.remove_container(&first).await.unwrap();
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
        assert!(
            listed.is_empty(),
            "handler {h}: containers left in the pod: {listed:?}"
        );
        (summaries, duplicate)
    })
    .await;
    assert_same("attempt statuses, a duplicate attempt", &results);
}

/// Entry names of a tar file, without a trailing '/'.
fn tar_entries(path: &Path) -> Vec<String> {
    let file = std::fs::File::open(path).unwrap();
    let mut archive = tar::Archive::new(file);
    archive
        .entries()
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let path = e.path().unwrap().to_string_lossy().into_owned();
            path.trim_end_matches('/').to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn checkpoint_container() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "checkpoint", |_| {}).await;
        let id = container(
            &cri,
            &pod,
            "counter",
            &[
                "sh",
                "-c",
                "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done",
            ],
            |_| {},
        )
        .await;
        let count = |cri: Cri, id: String| async move {
            sh(&cri, h, &id, "cat /tmp/count")
                .await
                .parse::<u64>()
                .unwrap_or(0)
        };
        cri.sh_until_ok(&id, "[ -s /tmp/count ]", WAIT)
            .await
            .unwrap();
        let dir = tempfile::tempdir_in(scratch(&cri)).unwrap();
        let location = dir.path().join("checkpoint.tar");
        let t0 = Instant::now();
        cri.runtime()
            .checkpoint_container(api::CheckpointContainerRequest {
                container_id: id.clone(),
                location: location.to_string_lossy().into_owned(),
                timeout: 60,
            })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: CheckpointContainer: {e}"));
        log::info!("handler {h}: CheckpointContainer took {:?}", t0.elapsed());
        let size = std::fs::metadata(&location).map(|m| m.len()).unwrap_or(0);
        assert!(
            size > 0,
            "handler {h}: checkpoint archive {} is missing or empty",
            location.display()
        );
        let entries = tar_entries(&location);
        // CRIU's image of the process tree, and what the CRI adds to restore it.
        for needed in ["checkpoint/inventory.img", "config.dump", "spec.dump"] {
            assert!(
                entries.iter().any(|e| e == needed),
                "handler {h}: no {needed} in the archive: {entries:?}"
            );
        }
        // The container runs on (checkpoint with leave-running) and still counts.
        let status = cri.container_status(&id).await.unwrap();
        assert_eq!(
            status.state,
            api::ContainerState::ContainerRunning as i32,
            "handler {h}: after the checkpoint: {status:?}"
        );
        let before = count(cri.clone(), id.clone()).await;
        let t0 = Instant::now();
        while count(cri.clone(), id.clone()).await <= before + 5 {
            assert!(
                t0.elapsed() < WAIT,
                "handler {h}: the counter stopped after the checkpoint"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Names outside CRIU's image directory (whose files are named by pid) are the CRI's.
        let mut top: Vec<String> = entries
            .iter()
            .map(|e| e.split('/').next().unwrap().to_string())
            .collect();
        top.sort();
        top.dedup();
        top
    })
    .await;
    // CRIU's own log and timing statistics reach the archive only from the CRI's container
    // directory, which containerd names as CRIU's work directory for runtime type
    // io.containerd.runc.v2 alone (withCheckpointOpts in its CRI); any other shim gets no
    // checkpoint options at all and so has nowhere to put them that the CRI would look. They
    // are diagnostics: restoring needs none of them.
    let criu_diagnostics = ["dump.log", "stats-dump"];
    let (_, runc) = &results[0];
    assert!(
        criu_diagnostics.iter().all(|d| runc.iter().any(|e| e == d)),
        "runc's archive: {runc:?}"
    );
    let without: Vec<_> = results
        .into_iter()
        .map(|(h, top)| {
            let rest: Vec<String> = top
                .into_iter()
                .filter(|e| !criu_diagnostics.contains(&e.as_str()))
                .collect();
            (h, rest)
        })
        .collect();
    assert_same("top-level entries of the checkpoint archive", &without);
}

/// Host mounts a test makes, undone (lazily, with everything below them) in reverse order on
/// drop, then the directory holding them removed. Declared before the test's PodGuard, so the
/// pods that use them are gone first.
struct HostMounts {
    dir: PathBuf,
    mounts: Vec<PathBuf>,
}

impl HostMounts {
    fn new(cri: &Cri) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("mounts-")
            .tempdir_in(scratch(cri))
            .unwrap()
            .keep();
        HostMounts {
            dir,
            mounts: Vec::new(),
        }
    }

    fn mount(&mut self, source: &Path, target: &Path, fstype: Option<&str>, flags: libc::c_ulong) {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).unwrap();
        let (src, dst) = (c(source), c(target));
        let fstype = fstype.map(|f| CString::new(f).unwrap());
        // SAFETY: NUL-terminated source, target and optional fstype that live across the
        // call, a null data pointer (no options).
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                fstype.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
                flags,
                std::ptr::null(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mount {} on {} (flags {flags:#x}): {}",
            source.display(),
            target.display(),
            std::io::Error::last_os_error()
        );
        if flags & (libc::MS_SHARED | libc::MS_PRIVATE | libc::MS_SLAVE) == 0 {
            self.mounts.push(target.to_path_buf());
        }
    }

    /// `dir` bind-mounted on itself with the given propagation (MS_SHARED or MS_PRIVATE), as
    /// critest prepares a host path for a propagation test.
    fn own_mount(&mut self, dir: &Path, propagation: libc::c_ulong) {
        self.mount(dir, dir, None, libc::MS_BIND | libc::MS_REC);
        self.mount(Path::new("none"), dir, None, propagation | libc::MS_REC);
    }
}

impl Drop for HostMounts {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt;
        for target in self.mounts.iter().rev() {
            let t = std::ffi::CString::new(target.as_os_str().as_bytes()).unwrap();
            // SAFETY: a NUL-terminated path that lives across the call.
            unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn mount_propagation() {
    use api::MountPropagation::{
        PropagationBidirectional, PropagationHostToContainer, PropagationPrivate,
    };
    let results = for_both_handlers(|cri, h| async move {
        let mut host = HostMounts::new(&cri);
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "propagation", |p| pod_sc(p).privileged = true).await;
        let mut seen = Vec::new();
        for (name, propagation, host_propagation) in [
            ("private", PropagationPrivate, libc::MS_PRIVATE),
            ("rslave", PropagationHostToContainer, libc::MS_SHARED),
            ("rshared", PropagationBidirectional, libc::MS_SHARED),
        ] {
            let base = host.dir.join(name);
            let (mnt, src) = (base.join("mnt"), base.join("src"));
            let host_point = mnt.join("from-host");
            std::fs::create_dir_all(&host_point).unwrap();
            std::fs::create_dir_all(&src).unwrap();
            std::fs::write(src.join("flag"), "").unwrap();
            host.own_mount(&mnt, host_propagation);
            let mnt_s = mnt.to_string_lossy().into_owned();
            let id = container(&cri, &pod, name, SLEEPER, |c| {
                linux_sc(c).privileged = true;
                c.mounts = vec![api::Mount {
                    container_path: mnt_s.clone(),
                    host_path: mnt_s.clone(),
                    propagation: propagation as i32,
                    ..Default::default()
                }];
            })
            .await;
            let status = cri.container_status(&id).await.unwrap();
            let reported: Vec<_> = status
                .mounts
                .iter()
                .map(|m| (m.container_path.as_str(), m.propagation, m.readonly))
                .collect();
            assert_eq!(
                reported,
                [(mnt_s.as_str(), propagation as i32, false)],
                "handler {h}: {name}: mounts in ContainerStatus"
            );
            // Host to container: a mount made on the host after the container started.
            host.mount(&src, &host_point, None, libc::MS_BIND);
            let in_container = sh(&cri, h, &id, &format!("ls -A {}", host_point.display())).await;
            // Container to host.
            let container_point = mnt.join("from-container");
            sh(
                &cri,
                h,
                &id,
                &format!("mkdir -p {0} && mount --bind /etc {0}", container_point.display()),
            )
            .await;
            let on_host = std::fs::read_dir(&container_point)
                .map(|d| d.count() > 0)
                .unwrap_or(false);
            seen.push((name, in_container, on_host));
        }
        assert_eq!(
            seen,
            [
                ("private", String::new(), false),
                ("rslave", "flag".into(), false),
                ("rshared", "flag".into(), true),
            ],
            "handler {h}: (mode, host mount seen in the container, container mount seen on the host)"
        );
        drop(guard);
        drop(host);
        seen
    })
    .await;
    assert_same("mount propagation", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn readonly_and_recursive_readonly_mounts() {
    use api::MountPropagation::{
        PropagationBidirectional, PropagationHostToContainer, PropagationPrivate,
    };
    let results = for_both_handlers(|cri, h| async move {
        // As critest does, recursive read-only mounts only where the handler reports them (see
        // runtime_handler_features): containerd 2.1 dereferences a handler's missing features on
        // such a CreateContainer and crashes, taking every other test down with it.
        let rro_supported = handler_features(&cri, h)
            .await
            .is_some_and(|f| f.recursive_read_only_mounts);
        let mut host = HostMounts::new(&cri);
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "rro", |_| {}).await;
        // A host path with a tmpfs mounted below it: only a recursive read-only mount makes the
        // tmpfs read-only in the container too.
        let dir = host.dir.join("volume");
        let tmpfs = dir.join("tmpfs");
        std::fs::create_dir_all(&tmpfs).unwrap();
        host.mount(Path::new("none"), &tmpfs, Some("tmpfs"), 0);
        let host_path = dir.to_string_lossy().into_owned();
        let config = |name: &str, readonly: bool, rro: bool, propagation: api::MountPropagation| {
            let mut c = Cri::container_config(name, SLEEPER);
            c.mounts = vec![api::Mount {
                container_path: "/mnt".into(),
                host_path: host_path.clone(),
                readonly,
                recursive_read_only: rro,
                propagation: propagation as i32,
                ..Default::default()
            }];
            c
        };
        let probe = "grep -c ' /mnt/tmpfs tmpfs ' /proc/mounts; \
                     touch /mnt/top 2>/dev/null && echo top-writable || echo top-ro; \
                     touch /mnt/tmpfs/below 2>/dev/null && echo below-writable || echo below-ro";
        let mut outcomes = Vec::new();
        let cases: &[(&str, bool)] = if rro_supported {
            &[("readonly", false), ("recursive", true)]
        } else {
            &[("readonly", false)]
        };
        for &(name, rro) in cases {
            let id = cri
                .run_container(&pod.0, &pod.1, config(name, true, rro, PropagationPrivate))
                .await
                .unwrap_or_else(|e| panic!("handler {h}: {name} read-only mount: {e}"));
            outcomes.push((name, sh_any(&cri, h, &id, probe).await.1));
        }
        let expected = [
            ("readonly", "1\ntop-ro\nbelow-writable".to_string()),
            ("recursive", "1\ntop-ro\nbelow-ro".to_string()),
        ];
        assert_eq!(
            outcomes,
            expected[..cases.len()],
            "handler {h}: writes to a read-only mount and to a tmpfs below it"
        );
        // What a recursive read-only mount cannot be combined with.
        let mut refused = Vec::new();
        for (name, readonly, propagation) in [
            ("rro-rslave", true, PropagationHostToContainer),
            ("rro-rshared", true, PropagationBidirectional),
            ("rro-writable", false, PropagationPrivate),
        ] {
            if !rro_supported {
                break;
            }
            let created = cri
                .create_container(&pod.0, &pod.1, config(name, readonly, true, propagation))
                .await;
            refused.push((name, created.map(drop).map_err(|e| e.grpc_code())));
        }
        assert!(
            refused.iter().all(|(_, r)| r.is_err()),
            "handler {h}: invalid recursive read-only mounts: {refused:?}"
        );
        drop(guard);
        drop(host);
        (outcomes, refused)
    })
    .await;
    let outcomes: Vec<_> = results
        .iter()
        .map(|(h, (outcomes, _))| (*h, outcomes.clone()))
        .collect();
    assert_eq!(
        outcomes.iter().map(|(_, o)| o.len()).collect::<Vec<_>>(),
        [2, 2],
        "both handlers take recursive read-only mounts (runtime_handler_features): {outcomes:?}"
    );
    assert_same("read-only and recursive read-only mounts", &outcomes);
}

#[tokio::test(flavor = "multi_thread")]
async fn dns_config_and_hostname_files() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "dns", |p| {
            p.dns_config = Some(api::DnsConfig {
                servers: vec!["10.0.0.53".into(), "10.0.0.54".into()],
                searches: vec!["crab.svc.cluster.local".into(), "svc.cluster.local".into()],
                options: vec!["ndots:5".into(), "timeout:2".into()],
            });
        })
        .await;
        let id = container(&cri, &pod, "reader", SLEEPER, |_| {}).await;
        let resolv = sh(&cri, h, &id, "cat /etc/resolv.conf").await;
        for line in [
            "search crab.svc.cluster.local svc.cluster.local",
            "nameserver 10.0.0.53",
            "nameserver 10.0.0.54",
            "options ndots:5 timeout:2",
        ] {
            assert!(
                resolv.lines().any(|l| l.trim() == line),
                "handler {h}: no {line:?} in /etc/resolv.conf: {resolv:?}"
            );
        }
        let names = sh(
            &cri,
            h,
            &id,
            "cat /etc/hostname; hostname; grep -c . /etc/hosts",
        )
        .await;
        let names: Vec<_> = names.lines().map(str::to_string).collect();
        assert_eq!(
            names[..2],
            ["crab-pod", "crab-pod"],
            "handler {h}: /etc/hostname, hostname"
        );
        (resolv, names)
    })
    .await;
    assert_same("/etc/resolv.conf, /etc/hostname, /etc/hosts", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn run_as_username_and_group_without_user() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "username", |_| {}).await;
        let id = container(&cri, &pod, "nobody", SLEEPER, |c| {
            linux_sc(c).run_as_username = "nobody".into();
        })
        .await;
        let ids = sh(&cri, h, &id, "echo $(id -u) $(id -nu) $(id -g)").await;
        assert_eq!(
            ids, "65534 nobody 65534",
            "handler {h}: run_as_username nobody"
        );
        let user = cri
            .container_status(&id)
            .await
            .unwrap()
            .user
            .and_then(|u| u.linux)
            .map(|l| (l.uid, l.gid, l.supplemental_groups));
        // A group without a user is refused before anything runs.
        let mut config = Cri::container_config("group-only", SLEEPER);
        linux_sc(&mut config).run_as_group = Some(api::Int64Value { value: 1234 });
        let group_only = cri
            .create_container(&pod.0, &pod.1, config)
            .await
            .map(drop)
            .map_err(|e| e.grpc_code());
        assert!(
            group_only.is_err(),
            "handler {h}: run_as_group without run_as_user was created"
        );
        (ids, user, group_only)
    })
    .await;
    assert_same(
        "ids, ContainerStatus.user, run_as_group without a user",
        &results,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_in_host_network() {
    let results = for_both_handlers(|cri, h| async move {
        // A port of its own per handler and test process: the pods share the host's network.
        let port = 20000 + (std::process::id() % 20000) as u16 + u16::from(h == "crab");
        let host = api::NamespaceOption {
            network: api::NamespaceMode::Node as i32,
            pid: api::NamespaceMode::Container as i32,
            ipc: api::NamespaceMode::Pod as i32,
            ..Default::default()
        };
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "hostnet-portfwd", |p| {
            p.hostname.clear();
            pod_sc(p).namespace_options = Some(host.clone());
        })
        .await;
        let serve = format!(
            "mkdir -p /www && echo crab-hostnet-{h} > /www/index.html && exec httpd -f -p 127.0.0.1:{port} -h /www"
        );
        let id = container(&cri, &pod, "httpd", &["sh", "-c", &serve], |c| {
            linux_sc(c).namespace_options = Some(host);
        })
        .await;
        cri.sh_until_ok(&id, &format!("wget -q -O- http://127.0.0.1:{port}/"), WAIT)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: httpd on the host network: {e}"));
        // The server listens in the host's own network namespace.
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("handler {h}: the host cannot reach 127.0.0.1:{port}: {e}"));
        let mut conn = port_forward_stream(&cri, h, &pod.0, port).await;
        conn.send(0, b"GET /index.html HTTP/1.0\r\n\r\n").await.unwrap();
        let mut data = Vec::new();
        let mut headers = 0;
        let body = format!("crab-hostnet-{h}");
        let got = tokio::time::timeout(WAIT, async {
            while let Some((channel, payload)) = conn.recv().await.unwrap() {
                // Each of the data and error channels opens with the port (u16 little endian).
                if payload == port.to_le_bytes() && headers < 2 {
                    headers += 1;
                    continue;
                }
                if channel == 0 {
                    data.extend_from_slice(&payload);
                }
                if String::from_utf8_lossy(&data).contains(&body) {
                    break;
                }
            }
        })
        .await;
        let data = String::from_utf8_lossy(&data).into_owned();
        assert!(
            got.is_ok() && data.starts_with("HTTP/1.") && data.contains(&body),
            "handler {h}: port-forwarded answer from the host network: {data:?}"
        );
        let _ = conn.close().await;
        data.lines().next().unwrap_or_default().to_string()
    })
    .await;
    assert_same("status line through port-forward", &results);
}

#[tokio::test(flavor = "multi_thread")]
async fn image_volume() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "image-volume", |_| {}).await;
        let image_mount = |readonly: bool| api::Mount {
            container_path: "/mnt/image-volume".into(),
            readonly,
            image: Some(crab_integration::cri::image_spec(crab_integration::cri::BUSYBOX)),
            ..Default::default()
        };
        let created = cri
            .create_container(&pod.0, &pod.1, {
                let mut c = Cri::container_config("image-volume", SLEEPER);
                c.mounts = vec![image_mount(true)];
                c
            })
            .await;
        // containerd 2.1 has image volumes (critest skips them where a runtime answers
        // Unimplemented).
        let id = created.unwrap_or_else(|e| panic!("handler {h}: image volume: {e}"));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: start with an image volume: {e}"));
        let seen = sh_any(
            &cri,
            h,
            &id,
            "ls -A /mnt/image-volume/bin/sh; touch /mnt/image-volume/x 2>/dev/null && echo writable \
             || echo read-only; /mnt/image-volume/bin/echo runs-from-volume",
        )
        .await;
        assert_eq!(
            seen.1,
            "/mnt/image-volume/bin/sh\nread-only\nruns-from-volume",
            "handler {h}: image volume content, read-only, executable"
        );
        let status = cri.container_status(&id).await.unwrap();
        let mounted: Vec<_> = status
            .mounts
            .iter()
            .map(|m| (m.container_path.clone(), m.readonly, m.image.is_some()))
            .collect();
        // An image volume is read-only or refused.
        let writable = cri
            .create_container(&pod.0, &pod.1, {
                let mut c = Cri::container_config("writable-image-volume", SLEEPER);
                c.mounts = vec![image_mount(false)];
                c
            })
            .await
            .map(drop)
            .map_err(|e| e.grpc_code());
        (seen, mounted, writable)
    })
    .await;
    assert_same("image volume", &results);
}

/// `text` with runs of 64 hex digits (container and exec ids) replaced by `<id>`.
fn without_ids(text: &str) -> String {
    let mut out = String::new();
    let mut run = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_hexdigit() {
            run.push(c);
            continue;
        }
        out.push_str(if run.len() == 64 { "<id>" } else { &run });
        run.clear();
        out.push(c);
    }
    out.pop();
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn start_failure_is_reported() {
    let results = for_both_handlers(|cri, h| async move {
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "start-failure", |_| {}).await;
        let mut outcomes = Vec::new();
        for (name, cmd) in [
            ("missing", &["/no/such/binary"][..]),
            ("not-executable", &["/etc/passwd"][..]),
        ] {
            let id = cri
                .create_container(&pod.0, &pod.1, Cri::container_config(name, cmd))
                .await
                .unwrap_or_else(|e| panic!("handler {h}: create {name}: {e}"));
            let started = cri.start_container(&id).await;
            let (code, message) = match started {
                Ok(()) => panic!("handler {h}: {name}: StartContainer succeeded"),
                Err(crab_integration::Error::Grpc { code, message, .. }) => (code, message),
                Err(e) => panic!("handler {h}: {name}: StartContainer: {e}"),
            };
            let status = cri.container_status(&id).await.unwrap();
            // What the kubelet shows: runc's own words reach the user with either shim.
            let why = if name == "missing" {
                "no such file or directory"
            } else {
                "permission denied"
            };
            assert!(
                message.contains(why) && status.message.contains(why),
                "handler {h}: {name}: StartContainer {message:?}, status message {:?}",
                status.message
            );
            // The words too: the kubelet shows them, and tools match on containerd's runc shim's
            // "OCI runtime create failed: ...".
            assert!(
                message.contains("OCI runtime create failed: "),
                "handler {h}: {name}: {message:?}"
            );
            outcomes.push((
                name,
                code,
                message,
                state_name(status.state),
                status.exit_code,
                status.reason,
                status.message,
            ));
            cri.remove_container(&id)
                .await
                .unwrap_or_else(|e| panic!("handler {h}: remove the failed {name}: {e}"));
        }
        // The pod is still good for the next container.
        let next = container(&cri, &pod, "next", SLEEPER, |_| {}).await;
        sh(&cri, h, &next, "true").await;
        // An exec that cannot start is worded the same way ("OCI runtime exec failed: ...").
        let exec = match cri.exec_sync(&next, &["/no/such/binary"], 30).await {
            Err(crab_integration::Error::Grpc { code, message, .. }) => {
                (code, without_ids(&message))
            }
            other => panic!("handler {h}: ExecSync of a missing binary: {other:?}"),
        };
        assert!(
            exec.1.contains("OCI runtime exec failed: "),
            "handler {h}: ExecSync of a missing binary: {exec:?}"
        );
        (outcomes, exec)
    })
    .await;
    assert_same(
        "(StartContainer code and message, state, exit code, reason, message) of failed starts",
        &results,
    );
}

/// The host uid a process runs as.
fn host_uid(pid: i64) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
        .to_string()
}

/// A pod with its own user namespace (Kubernetes `hostUsers: false`), on both handlers: crab
/// mounts the id-mapped rootfs layers containerd asks for, and owns the stdio pipes by the
/// container user's host ids (runc's `IoUid`/`IoGid`, which the CRI sets for such pods), as
/// containerd's runc shim does. (Checkpoint and restore in such pods: cri_restore.rs.)
#[tokio::test(flavor = "multi_thread")]
async fn user_namespace_per_pod() {
    let results = for_both_handlers(|cri, h| async move {
        // What the kubelet sends: a pod-wide user namespace mapping container root to an
        // unprivileged host range, in the pod's and each container's namespace options.
        let mapping = || api::IdMapping {
            host_id: 1_000_000,
            container_id: 0,
            length: 65536,
        };
        let userns = api::NamespaceOption {
            userns_options: Some(api::UserNamespace {
                mode: api::NamespaceMode::Pod as i32,
                uids: vec![mapping()],
                gids: vec![mapping()],
            }),
            ..crab_integration::cri::kubelet_namespaces()
        };
        let mut guard = PodGuard::new();
        let pod = pod(&cri, &mut guard, h, "userns", |p| {
            pod_sc(p).namespace_options = Some(userns.clone());
        })
        .await;
        let info = cri
            .runtime()
            .pod_sandbox_status(api::PodSandboxStatusRequest {
                pod_sandbox_id: pod.0.clone(),
                verbose: true,
            })
            .await
            .unwrap()
            .into_inner()
            .info;
        let info: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
        let pause_pid = info["pid"].as_i64().unwrap_or_default();
        let pause_uid = host_uid(pause_pid);
        // The pause image runs as its user 65535.
        assert_eq!(
            pause_uid, "1065535",
            "handler {h}: the pause process's uid on the host"
        );
        let mut config = Cri::container_config("mapped", SLEEPER);
        linux_sc(&mut config).namespace_options = Some(userns.clone());
        let id = cri
            .run_container(&pod.0, &pod.1, config)
            .await
            .unwrap_or_else(|e| panic!("handler {h}: a container in a user namespace: {e}"));
        // The last line: the container's root reopens its own stdout (a pipe), which needs the
        // pipe to be owned by its host uid.
        let seen = sh(
            &cri,
            h,
            &id,
            "cat /proc/self/uid_map /proc/self/gid_map | tr -s ' ' | sed 's/^ //'; id -u; \
             touch /rootfs-write && stat -c '%u:%g' /rootfs-write /bin/busybox; \
             echo reopened > /proc/self/fd/1",
        )
        .await;
        assert_eq!(
            seen, "0 1000000 65536\n0 1000000 65536\n0\n0:0\n0:0\nreopened",
            "handler {h}: uid/gid maps, uid, owners of a new and of an image file, stdout reopened"
        );
        let container_uid = host_uid(i64::from(container_pid(&cri, h, &id).await));
        assert_eq!(
            container_uid, "1000000",
            "handler {h}: the container's root on the host"
        );
        (pause_uid, seen, container_uid)
    })
    .await;
    assert_same(
        "pause uid, what the container saw, its root's host uid",
        &results,
    );
}
