//! Global leak check, run after the other test binaries (cargo runs test targets in name order,
//! one binary at a time, hence the `z_` prefix): whatever the per-test checks could miss must
//! not have piled up either.
//! - every shim of this containerd serves a task containerd still knows,
//! - no test container (`it-*`) or its snapshot is left in any namespace,
//! - no rootfs mount in containerd's state dir without a live task,
//! - no empty cgroup of a test container that containerd does not know,
//! - no test FIFOs in ctr's or the harness's FIFO dirs.

use std::collections::HashSet;
use std::fs;

use crab_integration::{host, Harness};

#[tokio::test(flavor = "multi_thread")]
async fn no_orphaned_shims_mounts_cgroups_or_fifos() {
    let h = Harness::for_test().await;
    let inventory = h.inventory().await.unwrap();
    let mut problems = Vec::new();

    let live_tasks: HashSet<(String, String)> = inventory
        .iter()
        .flat_map(|ns| ns.tasks.iter().map(|(id, _)| (ns.name.clone(), id.clone())))
        .collect();
    let containers: HashSet<(String, String)> = inventory
        .iter()
        .flat_map(|ns| ns.containers.iter().map(|id| (ns.name.clone(), id.clone())))
        .collect();

    for (id, shim) in host::shims_of(&h.env.address) {
        let ns = shim
            .argv
            .windows(2)
            .find(|w| w[0] == "-namespace")
            .map(|w| w[1].clone())
            .unwrap_or_default();
        if !live_tasks.contains(&(ns.clone(), id.clone())) {
            problems.push(format!("shim without a task: {ns}/{id}: {shim}"));
        }
    }

    for (ns, id) in &containers {
        if id.starts_with("it-") {
            problems.push(format!("test container left behind: {ns}/{id}"));
        }
    }

    let task_dir = h
        .env
        .containerd_state()
        .join("io.containerd.runtime.v2.task");
    for m in host::mountinfo() {
        let Ok(rel) = m.mount_point.strip_prefix(&task_dir) else {
            continue;
        };
        let parts: Vec<String> = rel
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        if let [ns, id, ..] = parts.as_slice() {
            if !live_tasks.contains(&(ns.clone(), id.clone())) {
                problems.push(format!("mount without a task: {}", m.line));
            }
        }
    }

    // runc puts containers at <hierarchy>/<namespace>/<id> (the spec's cgroupsPath). cgroups are
    // host-wide and other private containerds may use the same namespace names, so only empty
    // cgroups named like this suite's containers count (live ones are caught per test).
    for root in host::cgroup_mounts() {
        for ns in &inventory {
            let Ok(rd) = fs::read_dir(root.join(&ns.name)) else {
                continue;
            };
            for e in rd
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            {
                let id = e.file_name().to_string_lossy().into_owned();
                let empty = fs::read_to_string(e.path().join("cgroup.procs"))
                    .is_ok_and(|p| p.trim().is_empty());
                if id.starts_with("it-")
                    && empty
                    && !containers.contains(&(ns.name.clone(), id.clone()))
                {
                    problems.push(format!(
                        "cgroup without a container: {}",
                        e.path().display()
                    ));
                }
            }
        }
    }

    for dir in [h.env.ctr_fifo_dir(), h.env.fifo_root()] {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let nested: Vec<String> = fs::read_dir(e.path())
                .map(|r| {
                    r.flatten()
                        .map(|f| f.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            if name.starts_with("it-") || nested.iter().any(|n| n.starts_with("it-")) {
                problems.push(format!(
                    "test FIFOs left behind: {} {nested:?}",
                    e.path().display()
                ));
            }
        }
    }

    assert!(
        problems.is_empty(),
        "host not clean after the suite:\n  {}",
        problems.join("\n  ")
    );
}
