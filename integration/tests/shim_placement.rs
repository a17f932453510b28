//! Where the crab shim runs: containerd's `ShimCgroup` (in runc's options, as the CRI and
//! `ctr` give it to a runtime registered with runc's type) puts the shim daemon into that
//! cgroup, so the work a sandbox makes its shim do is charged there; a hostile or missing path
//! does not move it anywhere else and does not stop the container. The shim's OOM score
//! follows its container's, so the kernel never prefers a neighbour over it.
//!
//! The containers run under the crab shim started through the test containerd's wrapper
//! (`hack/containerd.sh`'s `cri-shim/containerd-shim-crab-v1`, given as the runtime's absolute
//! path): with runc's options there are no crab options, and the wrapper's `CRAB_CONFIG` keeps
//! the shim on the test's own config (never the host's `/etc/crab`).

use std::path::PathBuf;
use std::time::Duration;

use crab_integration::api::runc_options_with_shim_cgroup;
use crab_integration::env::TestEnv;
use crab_integration::host::{self, eventually};
use crab_integration::spec::container_spec;
use crab_integration::{Harness, ProcessSpec, TaskStatus};

const WHY: &str = "the crab shim's own placement; the stock runc shim is containerd's";
const T: Duration = Duration::from_secs(30);

/// A harness whose runtime is the wrapper that runs the crab shim with the test config.
async fn wrapper_harness(h: &Harness) -> Harness {
    let wrapper = h
        .env
        .crab_home
        .join("containerd/cri-shim/containerd-shim-crab-v1");
    assert!(
        wrapper.is_file(),
        "{} is missing: start the test containerd with hack/containerd.sh (CRI enabled)",
        wrapper.display()
    );
    Harness::connect_env(TestEnv {
        runtime: wrapper.to_string_lossy().into_owned(),
        ..h.env.clone()
    })
    .await
    .unwrap()
}

/// The crab shim serving container `id`.
fn shim_pid(id: &str) -> u32 {
    let shims = host::shim_processes(id);
    assert_eq!(shims.len(), 1, "one shim for {id}: {shims:?}");
    shims[0].pid as u32
}

/// The cgroup paths of `pid`, one per hierarchy (the third field of /proc/PID/cgroup lines).
fn cgroups_of(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2).map(str::to_string))
        .collect()
}

fn oom_score_adj(pid: u32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A cgroup for the test, `/<name>` in every hierarchy (what runc's `ShimCgroup` names),
/// removed on drop once no process is left in it.
struct TestCgroup(Vec<PathBuf>);

impl TestCgroup {
    fn new(name: &str) -> TestCgroup {
        TestCgroup::with_cpuset(name, true)
    }

    /// With `cpuset` false, a v1 cpuset cgroup is left without CPUs (nothing can join it).
    fn with_cpuset(name: &str, cpuset: bool) -> TestCgroup {
        let dirs: Vec<PathBuf> = host::cgroup_mounts().iter().map(|h| h.join(name)).collect();
        assert!(!dirs.is_empty(), "no cgroup hierarchy is mounted");
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
            // A v1 cpuset cgroup takes no process until it has CPUs and memory nodes (ENOSPC):
            // set them from the parent, as an orchestrator creating it would.
            for f in ["cpuset.cpus", "cpuset.mems"] {
                let own = d.join(f);
                if cpuset && std::fs::read_to_string(&own).is_ok_and(|v| v.trim().is_empty()) {
                    let parent = std::fs::read_to_string(d.parent().unwrap().join(f)).unwrap();
                    std::fs::write(&own, parent.trim()).unwrap();
                }
            }
        }
        TestCgroup(dirs)
    }

    fn procs(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .0
            .iter()
            .flat_map(|d| {
                std::fs::read_to_string(d.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for d in &self.0 {
            let removed = (0..100).any(|_| {
                let gone = std::fs::remove_dir(d).is_ok() || !d.exists();
                if !gone {
                    std::thread::sleep(Duration::from_millis(100));
                }
                gone
            });
            if !removed {
                eprintln!("cannot remove {}", d.display());
            }
        }
    }
}

/// Starts `sleep` in container `id` with runc's options carrying `shim_cgroup`, and
/// `oom_score_adj` in its spec when given.
async fn start(h: &Harness, id: &str, shim_cgroup: &str, oom: Option<i32>) {
    let process = ProcessSpec::new(&["sleep", "600"]).to_oci(&h.image.env, &h.image.cwd);
    let mut spec = container_spec(id, &h.env.namespace, process);
    if let Some(score) = oom {
        spec["process"]["oomScoreAdj"] = score.into();
    }
    h.create_container_with_spec_and_options(
        id,
        &spec,
        Some(runc_options_with_shim_cgroup(shim_cgroup)),
    )
    .await
    .unwrap();
    h.create_task(id, None).await.unwrap();
    h.start(id, "").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_shim_joins_the_shim_cgroup_and_follows_its_containers_oom_score() {
    let h = Harness::connect().await.unwrap();
    if !h.runs_crab_only("shim_placement", WHY) {
        return;
    }
    let w = wrapper_harness(&h).await;
    let id = w.unique_id("shimcg");
    let name = format!("crab-test-{id}");
    // Declared before the guard, so dropped after it: the container and its shim are gone
    // before the cgroup is removed, also when the test fails.
    let cg = TestCgroup::new(&name);
    let _g = w.guard(&[&id]);
    start(&w, &id, &format!("/{name}"), Some(700)).await;
    let pid = shim_pid(&id);
    let want = format!("/{name}");
    let joined = cgroups_of(pid);
    assert!(
        !joined.is_empty() && joined.iter().all(|c| *c == want),
        "the shim daemon is in {want} in every hierarchy: {joined:?}"
    );
    assert!(
        cg.procs().contains(&pid),
        "{:?} lists the shim {pid}",
        cg.procs()
    );
    // The container itself is not put there: only its shim.
    let (_, init) = w.status(&id, "").await.unwrap();
    assert!(
        !cgroups_of(init).contains(&want),
        "the container's own cgroups: {:?}",
        cgroups_of(init)
    );
    // The container asked for 700: its shim is raised to it.
    assert_eq!(
        oom_score_adj(pid),
        700,
        "the shim follows its container's oom_score_adj"
    );
    w.kill_and_remove(&id).await.unwrap();
    eventually(T, || host::shim_processes(&id).is_empty().then_some(()))
        .unwrap_or_else(|| panic!("the shim of {id} did not exit"));
    assert!(cg.procs().is_empty(), "nothing left in the shim cgroup");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_or_missing_shim_cgroup_leaves_the_shim_where_it_was() {
    let h = Harness::connect().await.unwrap();
    if !h.runs_crab_only("shim_placement", WHY) {
        return;
    }
    let w = wrapper_harness(&h).await;
    // Escapes by `..`, and a cgroup that does not exist: the shim stays in the cgroup it
    // started in (containerd's), logs why, and the container runs.
    for (n, path) in [
        "/../../sys/fs/cgroup",
        "/crab-test-no-such-cgroup/x",
        "/../crab-test-escape",
    ]
    .into_iter()
    .enumerate()
    {
        let id = w.unique_id(&format!("shimcg-bad{n}"));
        let _g = w.guard(&[&id]);
        start(&w, &id, path, None).await;
        let pid = shim_pid(&id);
        let cgroups = cgroups_of(pid);
        assert!(
            cgroups
                .iter()
                .all(|c| !c.contains("crab-test-no-such") && !c.contains("escape")),
            "{path}: the shim is in {cgroups:?}"
        );
        let (status, _) = w.status(&id, "").await.unwrap();
        assert_eq!(status, TaskStatus::Running, "{path}: the container runs");
        w.kill_and_remove(&id).await.unwrap();
    }
    // A hierarchy that refuses the shim (a v1 cpuset cgroup without CPUs: ENOSPC) does not
    // keep it out of the others.
    let cpuset_v1 = host::cgroup_mounts()
        .into_iter()
        .find(|h| h.join("cpuset.cpus").exists() && h.join("tasks").exists());
    if let Some(cpuset) = cpuset_v1 {
        let id = w.unique_id("shimcg-cpuset");
        let name = format!("crab-test-{id}");
        let cg = TestCgroup::with_cpuset(&name, false);
        let _g = w.guard(&[&id]);
        start(&w, &id, &format!("/{name}"), None).await;
        let pid = shim_pid(&id);
        let want = format!("/{name}");
        let mut expected_elsewhere = 0;
        for h in host::cgroup_mounts() {
            let procs = std::fs::read_to_string(h.join(&name).join("cgroup.procs")).unwrap();
            let inside = procs.lines().any(|l| l.trim() == pid.to_string());
            if h == cpuset {
                assert!(!inside, "the empty cpuset cgroup took the shim");
            } else {
                assert!(
                    inside,
                    "{}: the shim joined the other hierarchies",
                    h.display()
                );
                expected_elsewhere += 1;
            }
        }
        assert!(expected_elsewhere > 0);
        assert!(cgroups_of(pid).contains(&want));
        let (status, _) = w.status(&id, "").await.unwrap();
        assert_eq!(status, TaskStatus::Running);
        w.kill_and_remove(&id).await.unwrap();
        eventually(T, || host::shim_processes(&id).is_empty().then_some(()))
            .unwrap_or_else(|| panic!("the shim of {id} did not exit"));
        drop(cg);
    }
    for h in host::cgroup_mounts() {
        assert!(!h.join("crab-test-escape").exists());
        assert!(!h.parent().unwrap().join("crab-test-escape").exists());
    }
}
