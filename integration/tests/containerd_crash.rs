//! containerd itself dies (SIGKILL) under a sandbox: the shim and the sandbox live on, a
//! restarted containerd finds them again, and `crabctl recover` still brings the sandbox back
//! to its last durable checkpoint. Its own test binary: it restarts the private containerd
//! that every other test uses, so it must not run beside them.

use std::{path::Path, time::Duration};

use crab_integration::sandbox::{Sandbox, SandboxOptions};

fn hack_containerd(home: &Path, cmd: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/containerd.sh");
    let out = std::process::Command::new(script)
        .arg(cmd)
        .env("CRAB_HOME", home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "hack/containerd.sh {cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_survives_a_containerd_crash_and_recovers_from_its_checkpoint() {
    let (mut s, _guard) = Sandbox::start("ctrd-crash", SandboxOptions::default()).await;
    s.run("echo before > /app/state.txt && (nohup python3 -c 'import time; x = 7; time.sleep(10**6)' >/dev/null 2>&1 &)").await;
    s.end_turn().await;
    s.sync().await;
    let before = s.lineage().len();

    let home = s.h.env.crab_home.clone();
    let pidfile = std::fs::read_to_string(home.join("run/containerd.pid"))
        .expect("the private containerd's pid file (hack/containerd.sh start)");
    let pid: i32 = pidfile.trim().parse().unwrap();
    // SAFETY: plain kill(2) of the private containerd this suite started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    for _ in 0..200 {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    hack_containerd(&home, "start");

    // The sandbox kept running through it, with everything it had.
    let out = s
        .run("cat /app/state.txt; pgrep -fc 'x = [7]'")
        .await
        .stdout;
    assert_eq!(out, "before\n1\n", "the sandbox after containerd's restart");
    // And its last checkpoint is still a recovery point.
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover after containerd's crash: {out}{err}");
    let lineage = s.lineage();
    assert_eq!(lineage.len(), before + 1, "{lineage:#?}");
    assert_eq!(lineage.last().unwrap()["kind"], "restored");
    let out = s
        .run("cat /app/state.txt; pgrep -fc 'x = [7]'")
        .await
        .stdout;
    assert_eq!(out, "before\n1\n", "the sandbox after recover");
    s.finish().await;
}
