//! The leak checks must see a live container, or every "no leaks" assertion would pass vacuously.

use std::time::Duration;

use crab_integration::host::{self, eventually};
use crab_integration::{Harness, ProcessSpec};

#[tokio::test(flavor = "multi_thread")]
async fn leak_checks_see_a_live_container() {
    let h = Harness::for_test().await;
    let id = h.unique_id("selftest_live");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    // Until it runs `sleep`: Start returns once runc has let its init go, which may still be
    // exec'ing (seen on a loaded host), and a process mid-exec has no command line for a moment.
    eventually(Duration::from_secs(10), || {
        host::container_processes(&id)
            .iter()
            .any(|p| p.argv.first().is_some_and(|a| a == "sleep"))
            .then_some(())
    })
    .expect("container process not visible");
    let l = h.leaks_now(&id).await;
    let has = |what: &str| l.iter().any(|x| x.starts_with(what));
    for what in [
        "containerd still has container",
        "containerd still has task",
        "snapshot",
        "shim process",
        "container process",
        "cgroup dir",
        "mount",
        "state entry",
    ] {
        assert!(
            has(what),
            "leak check misses {what:?} of a live container; saw:\n{}",
            l.join("\n")
        );
    }
    // runc's own state for the container, where this runtime keeps it.
    let runc_root = match h.runtime() {
        "io.containerd.runc.v2" => std::path::PathBuf::from("/run/containerd/runc"),
        _ => crab_runtime_config::RuncConfig::default().root,
    };
    let runc_state = runc_root.join(&h.env.namespace).join(&id);
    assert!(
        host::state_entries(&h.env, &id).contains(&runc_state),
        "leak check misses {}",
        runc_state.display()
    );
    // Both cgroup trees: the v2 tree (where present) and v1 controllers.
    if host::cgroup_mounts().len() > 1 {
        let dirs = host::cgroup_dirs(&id);
        assert!(dirs.len() > 1, "only {dirs:?}");
    }
    h.kill_and_remove(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}
