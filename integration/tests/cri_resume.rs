//! A crashed container in a pod comes back as of its last turn end through the kubelet's
//! ordinary restart: a new attempt of the container (same pod, same name, attempt + 1), with
//! the pod annotation `io.crab/resume: newest`, resumes the newest checkpoint of its lineage
//! (`<kubernetes namespace>/<pod>/<container>`): files, git, a background server answering
//! with the state it held in memory. Through the CRI, as the kubelet drives it; real
//! containerd, runc and CRIU.

use std::time::{Duration, Instant};

use crab_integration::cri::{api, image_spec, Cri, PodGuard, POD_NAMESPACE};
use crab_integration::sandbox::AGENT_IMAGE;

const CHECKPOINT_WITHIN: Duration = Duration::from_secs(60);

/// The agent's turns (`bash -c` in /app): files and a git commit; a server keeping a counter in
/// memory; more of both.
const TURNS: &[&str] = &[
    "mkdir -p proj && echo v1 > proj/a.txt && cd proj && git init -q && \
     git -c user.email=a@b -c user.name=a add a.txt && git -c user.email=a@b -c user.name=a commit -qm one",
    r#"cat > /app/counter.py <<'EOF'
import http.server
n = [0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n[0] += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(str(n[0]).encode())
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
EOF
(nohup python3 /app/counter.py >/dev/null 2>&1 &)
for i in $(seq 100); do python3 -c 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:8000/").read().decode())' 2>/dev/null && break; sleep 0.1; done"#,
    "echo v2 >> proj/a.txt && cd proj && git -c user.email=a@b -c user.name=a commit -qam two && \
     python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/\").read().decode())'",
];

const STATE: &str = "cd /app && cat proj/a.txt && git -C proj log --format=%s && \
     ls /app/interrupted 2>&1 | head -1";

fn agent(name: &str, attempt: u32) -> api::ContainerConfig {
    let mut c = Cri::container_config(name, &["sleep", "infinity"]);
    c.image = Some(image_spec(AGENT_IMAGE));
    c.working_dir = "/app".into();
    c.metadata.as_mut().unwrap().attempt = attempt;
    c
}

async fn bash(cri: &Cri, id: &str, script: &str) -> String {
    let r = cri
        .exec_sync(id, &["bash", "-c", script], 60)
        .await
        .unwrap();
    assert_eq!(
        r.exit_code,
        0,
        "`{script}`: {}{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8_lossy(&r.stdout).into_owned()
}

async fn end_turn_durably(cri: &Cri, id: &str, turn: &str) {
    cri.end_turn(id, turn).await.unwrap();
    let start = Instant::now();
    while cri.checkpoint_kind(id, turn).is_none() {
        assert!(
            start.elapsed() < CHECKPOINT_WITHIN,
            "no checkpoint of turn {turn} of {id}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crashed_container_comes_back_as_of_its_last_turn_in_the_same_pod() {
    let cri = Cri::for_test().await;
    let mut guard = PodGuard::new();
    let mut pod = cri.pod_config("resume");
    pod.annotations
        .insert("io.crab/resume".into(), "newest".into());
    let pod_name = pod.metadata.as_ref().unwrap().name.clone();
    let pod_id = cri.run_pod(&mut guard, "crab", &pod).await.unwrap();
    let first = cri
        .run_container(&pod_id, &pod, agent("sandbox", 0))
        .await
        .unwrap();
    let mut served = String::new();
    for (i, t) in TURNS.iter().enumerate() {
        served = bash(&cri, &first, t).await;
        end_turn_durably(&cri, &first, &format!("t{i}")).await;
    }
    assert_eq!(served.trim(), "2", "the counter served twice");
    let want = bash(&cri, &first, STATE).await;
    assert!(want.contains("v2") && want.contains("two"), "{want}");
    // The crash: a turn half done (a file, no turn end), then the container's init killed.
    bash(&cri, &first, "touch /app/interrupted").await;
    let pid = cri.container_pid(&first).await.unwrap();
    // SAFETY: plain kill(2) of the container's init.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    cri.wait_exited(&first, Duration::from_secs(30))
        .await
        .unwrap();

    // The kubelet's restart: the next attempt of the same container in the same pod.
    let second = cri
        .run_container(&pod_id, &pod, agent("sandbox", 1))
        .await
        .unwrap();
    let got = bash(&cri, &second, STATE).await;
    assert_eq!(
        got, want,
        "as of the last turn end (without the interrupted turn's file)"
    );
    assert!(got.contains("No such file"), "{got}");
    let count = bash(
        &cri,
        &second,
        "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/\").read().decode())'",
    )
    .await;
    assert_eq!(
        count.trim(),
        "3",
        "the server answers from the memory it had"
    );
    // Its lineage is the pod's and the container's name, in both stores.
    let (code, out, err) = cri.crabctl(&["checkpoints", &second]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("restored"), "{out}");
    let lineage = format!("{POD_NAMESPACE}/{pod_name}/sandbox");
    for id in [&first, &second] {
        let (code, out, err) = cri.crabctl(&["checkpoints", id, "-o", "json"]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains(&lineage), "{id}: {out}");
    }
    // And it goes on: the new attempt's first turn (a file, and the request above, which
    // changed the server's memory) is checkpointed whole; the next (a file) files only.
    bash(&cri, &second, "echo v3 >> /app/proj/a.txt").await;
    end_turn_durably(&cri, &second, "t8").await;
    assert_eq!(cri.checkpoint_kind(&second, "t8").as_deref(), Some("full"));
    bash(&cri, &second, "echo v4 >> /app/proj/a.txt").await;
    end_turn_durably(&cri, &second, "t9").await;
    assert_eq!(cri.checkpoint_kind(&second, "t9").as_deref(), Some("fs"));
    // crabctl lists the lineage: both attempts' stores, the newest checkpoint in the second's.
    let (code, out, err) = cri.crabctl(&["lineages", &lineage, "-o", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1, "{rows:#}");
    let row = &rows[0];
    assert_eq!(row["newest"]["container"], second.as_str(), "{row:#}");
    assert_eq!(row["newest"]["turn_id"], "t9", "{row:#}");
    assert_eq!(row["stores"].as_array().unwrap().len(), 2, "{row:#}");
    let (code, out, err) = cri.crabctl(&["lineages"]);
    assert!(code == 0 && out.contains(&lineage), "{out}{err}");
}
