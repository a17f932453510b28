//! Annotations cross a trust boundary (issue 16, item 5): whoever creates a container or sends
//! `Tasks.Update` chooses them. A typo in a crab spec annotation is refused (it must not
//! silently change nothing), an explicit shim group can never name another workload's shim,
//! and an update's annotations are bounded.

use std::collections::HashMap;

use crab_integration::{api::crab_runtime_options, spec::container_spec, Harness, ProcessSpec};

const CRAB: &str = "io.containerd.crab.v1";

fn crab_harness_check(h: &Harness) {
    assert_eq!(
        h.runtime(),
        CRAB,
        "crab's annotations: run with CRAB_RUNTIME unset"
    );
}

/// A `sleep` container's spec with `annotations`.
fn spec_with(h: &Harness, id: &str, annotations: &[(&str, &str)]) -> serde_json::Value {
    let process = ProcessSpec::new(&["sleep", "1000"]).to_oci(&h.image.env, &h.image.cwd);
    let mut spec = container_spec(id, &h.env.namespace, process);
    for (k, v) in annotations {
        spec["annotations"][*k] = serde_json::Value::String(v.to_string());
    }
    spec
}

/// The pid of the shim serving `id`: its init's parent (the shim is the subreaper runc's init
/// is handed to).
fn shim_of(init: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{init}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mistyped_crab_spec_annotation_is_refused() {
    let h = Harness::for_test().await;
    crab_harness_check(&h);
    let id = h.unique_id("ann_typo");
    let _g = h.guard(&[&id]);
    let spec = spec_with(&h, &id, &[("io.crab/checkpoint-polcy", "full-every-turn")]);
    h.create_container_with_spec(&id, &spec).await.unwrap();
    let err = h
        .create_task(&id, None)
        .await
        .expect_err("a typo must fail the create");
    let msg = err.to_string();
    assert!(
        msg.contains("unknown crab annotation `io.crab/checkpoint-polcy`")
            && msg.contains("io.crab/checkpoint-policy"),
        "{msg}"
    );
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_cannot_join_another_containers_shim() {
    let h = Harness::for_test().await;
    crab_harness_check(&h);
    let victim = h.unique_id("ann_victim");
    let (g1, g2, intruder, forger) = (
        format!("{victim}-g1"),
        format!("{victim}-g2"),
        format!("{victim}-in"),
        format!("{victim}-pod"),
    );
    let _g = h.guard(&[&victim, &g1, &g2, &intruder, &forger]);
    let group = format!("grp-{}", std::process::id());
    // The config lists the groups containers may join (issue 24, item 7): here the test's own,
    // and the victim's id (allowed, it still names no container's shim).
    let config = format!("[shim]\ngroups = [\"{group}\", \"{victim}\"]\n");
    let options = || crab_runtime_options(None, Some(&config));
    let mut inits = HashMap::new();
    for (id, annotations) in [
        (&victim, vec![]),
        // Names the victim's id as its group: it must not land in the victim's shim.
        (
            &intruder,
            vec![("io.containerd.crab.v1.group", victim.as_str())],
        ),
        // Claims to be a container of the victim's "pod" (issue 24, item 7: any client may set
        // annotations; only the CRI's containers in its namespace join a pod's shim).
        (
            &forger,
            vec![
                ("io.kubernetes.cri.sandbox-id", victim.as_str()),
                ("io.kubernetes.cri.container-type", "container"),
            ],
        ),
        (&g1, vec![("io.containerd.crab.v1.group", group.as_str())]),
        (&g2, vec![("io.containerd.crab.v1.group", group.as_str())]),
    ] {
        h.create_container_with_spec_and_options(
            id,
            &spec_with(&h, id, &annotations),
            Some(options()),
        )
        .await
        .unwrap();
        let pid = h.create_task(id, None).await.unwrap();
        h.start(id, "").await.unwrap();
        inits.insert(id.clone(), pid);
    }
    let shim = |id: &String| shim_of(inits[id]);
    assert_ne!(
        shim(&intruder),
        shim(&victim),
        "a group named after a container joined its shim"
    );
    assert_ne!(
        shim(&forger),
        shim(&victim),
        "a forged sandbox id outside the CRI's namespace joined the victim's shim"
    );
    assert_eq!(shim(&g1), shim(&g2), "one explicit group, one shim");
    assert_ne!(shim(&g1), shim(&victim));

    // A malformed group fails the create with the reason.
    let bad = format!("{victim}-bad");
    let _gb = h.guard(&[&bad]);
    h.create_container_with_spec(
        &bad,
        &spec_with(&h, &bad, &[("io.containerd.crab.v1.group", "../escape")]),
    )
    .await
    .unwrap();
    let err = h
        .create_task(&bad, None)
        .await
        .expect_err("a malformed group must fail");
    assert!(
        err.to_string().contains("io.containerd.crab.v1.group"),
        "{err}"
    );
    h.delete_container(&bad).await.unwrap();

    // A well-formed group the config does not list: refused with the reason, and the group's
    // member keeps running alone in its shim.
    let unlisted = format!("{victim}-unlisted");
    let _gu = h.guard(&[&unlisted]);
    h.create_container_with_spec_and_options(
        &unlisted,
        &spec_with(
            &h,
            &unlisted,
            &[("io.containerd.crab.v1.group", "not-listed")],
        ),
        Some(options()),
    )
    .await
    .unwrap();
    let err = h
        .create_task(&unlisted, None)
        .await
        .expect_err("a group the config does not list must fail");
    assert!(
        err.to_string()
            .contains("\"not-listed\", which the config does not allow"),
        "{err}"
    );
    h.delete_container(&unlisted).await.unwrap();
    h.assert_no_leaks(&unlisted).await;

    for id in [&intruder, &forger, &g1, &g2, &victim] {
        h.kill_and_remove(id).await.unwrap();
    }
    for id in [&intruder, &forger, &g1, &g2, &victim] {
        h.assert_no_leaks(id).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_update_with_too_many_annotations_is_refused() {
    let h = Harness::for_test().await;
    crab_harness_check(&h);
    let id = h.unique_id("ann_update");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let many: HashMap<String, String> = (0..1000)
        .map(|i| (format!("x.example/{i}"), "v".repeat(100)))
        .collect();
    let err = h
        .update(&id, None, many)
        .await
        .expect_err("a huge update must be refused");
    assert!(err.to_string().contains("at most 64"), "{err}");
    // The container is unaffected and a normal update still works.
    let small = HashMap::from([("x.example/ok".to_string(), "1".to_string())]);
    h.update(&id, None, small).await.unwrap();
    h.kill_and_remove(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}
