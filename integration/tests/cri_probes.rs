//! Issue 14, item 5: the kubelet's exec probes are no agent actions. A pod names its probe
//! commands in the annotation `io.crab/probe-commands` (which containerd passes to the
//! containers' specs for handlers that allow `io.crab/*` pod annotations, as the README's
//! registration does). An exec whose argv begins with one of them neither waits for the last
//! turn's checkpoint (a liveness probe during a long process checkpoint would otherwise fail)
//! nor ends a turn (with `io.crab/turn-boundary: exec`), while every other exec still does both.
//!
//! The checkpoint is held up for as long as the test likes by locking every slot of the CRI
//! handlers' engine (hack/containerd.sh gives them their own under `$CRAB_HOME`), as any
//! process holding a slot would.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crab_integration::cri::{Cri, PodGuard};

const PROBE: &[&str] = &["cat", "/tmp/healthy"];

/// The turns `crabctl turns` lists for `id`, as (turn id, kind).
fn turns(cri: &Cri, id: &str) -> Vec<(String, String)> {
    let (code, out, err) = cri.crabctl(&["turns", id]);
    assert_eq!(code, 0, "crabctl turns {id}: {out}{err}");
    out.lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 3).then(|| (cols[1].to_string(), cols[2].to_string()))
        })
        .collect()
}

/// Every slot of the engine at `root` (of `max_jobs` slots), locked until dropped.
struct HeldSlots {
    _locked: Vec<std::fs::File>,
}

impl HeldSlots {
    fn lock(root: &std::path::Path, max_jobs: u32) -> HeldSlots {
        std::fs::create_dir_all(root.join("slots")).unwrap();
        HeldSlots {
            _locked: (0..max_jobs)
                .map(|i| {
                    let f = std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(root.join("slots").join(i.to_string()))
                        .unwrap();
                    // SAFETY: flock on a file this test owns; the lock goes with the file.
                    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
                    f
                })
                .collect(),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_probe_neither_waits_for_a_checkpoint_nor_ends_a_turn() {
    let cri = Cri::for_test().await;
    let config = crab_runtime_config::Config::load(&cri.env.cri_config).unwrap();
    let mut guard = PodGuard::new();
    let mut pod = cri.pod_config("probes");
    pod.annotations.extend([
        (
            "io.crab/probe-commands".to_string(),
            r#"[["cat", "/tmp/healthy"]]"#.to_string(),
        ),
        ("io.crab/turn-boundary".to_string(), "exec".to_string()),
    ]);
    let pod_id = cri.run_pod(&mut guard, "crab", &pod).await.unwrap();
    let id = cri
        .run_container(
            &pod_id,
            &pod,
            Cri::container_config(
                "agent",
                &["sh", "-c", "touch /tmp/healthy; exec sleep 100000"],
            ),
        )
        .await
        .unwrap();

    // Turns: each agent exec ends one, the probes between them none.
    cri.sh(&id, "echo one > /root/one").await.unwrap();
    for _ in 0..3 {
        let r = cri.exec_sync(&id, PROBE, 5).await.unwrap();
        assert_eq!(r.exit_code, 0, "probe: {r:?}");
    }
    cri.sh(&id, "true").await.unwrap();
    let seen = turns(&cri, &id);
    assert_eq!(seen.len(), 2, "two agent execs, three probes: {seen:?}");
    assert_eq!(
        seen[0].1, "fs",
        "the first agent exec wrote a file: {seen:?}"
    );

    // A checkpoint that cannot run: every engine slot is held.
    let slots = HeldSlots::lock(&config.engine.root, config.engine.max_jobs);
    cri.sh(&id, "echo two > /root/two").await.unwrap();
    // The next agent action waits for that turn's checkpoint...
    let agent = {
        let (cri, id) = (cri.clone(), id.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let r = cri.sh(&id, "cat /root/two").await;
            (started.elapsed(), r)
        })
    };
    // ... while a probe, as the kubelet sends it with a 2 s timeout, answers at once.
    let started = Instant::now();
    let r = cri.exec_sync(&id, PROBE, 2).await.unwrap();
    let probe_took = started.elapsed();
    assert_eq!(r.exit_code, 0, "probe during a held checkpoint: {r:?}");
    assert!(
        probe_took < Duration::from_secs(2),
        "the probe took {probe_took:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !agent.is_finished(),
        "the agent's exec did not wait for the held checkpoint"
    );
    drop(slots);
    let (agent_took, r) = agent.await.unwrap();
    assert_eq!(r.unwrap(), "two\n");
    assert!(agent_took >= Duration::from_secs(2), "{agent_took:?}");
    let seen = turns(&cri, &id);
    assert_eq!(seen.len(), 4, "four agent execs, four probes: {seen:?}");
    assert_eq!(
        seen[2].1, "fs",
        "the held turn's checkpoint ran once the slots were free: {seen:?}"
    );
    eprintln!("probe answered in {probe_took:?} while the agent's exec waited {agent_took:?}");
}
