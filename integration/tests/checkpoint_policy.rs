//! Checkpoint policies (`[checkpoint] policy`, spec annotation `io.crab/checkpoint-policy`):
//! the baselines crab is compared with take their checkpoint at every turn end, whatever the
//! inspector found; the stored answer stays the inspector's.

use crab_integration::{
    api::crab_runtime_options,
    env::TestEnv,
    sandbox::{Sandbox, SandboxOptions, AGENT_IMAGE},
    Harness, ProcessSpec,
};

#[tokio::test(flavor = "multi_thread")]
async fn fs_every_turn_takes_a_layer_every_turn_and_never_processes() {
    let config = "checkpoint.policy = \"fs-every-turn\"";
    let (mut s, _g) = Sandbox::start(
        "policy_fs",
        SandboxOptions {
            config,
            ..Default::default()
        },
    )
    .await;
    // Nothing changed: still an fs checkpoint, of an empty layer.
    s.run("cat /etc/os-release >/dev/null").await;
    assert_eq!(
        s.end_turn().await["kind"],
        "none",
        "the stored answer is the inspector's"
    );
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "fs", "{:#}", m[0]);
    let layers = m[0]["fs_layers"].as_array().unwrap();
    assert!(
        s.layer(&layers[0]).is_empty(),
        "{:?}",
        s.layer(&layers[0]).keys().collect::<Vec<_>>()
    );
    // A file change: its layer.
    s.run("echo hi > /app/a.txt").await;
    s.end_turn().await;
    let m = s.wait_manifests(2).await;
    let l = s.layer(m[1]["fs_layers"].as_array().unwrap().last().unwrap());
    assert_eq!(
        l.get("app/a.txt").map(|(_, d)| d.as_slice()),
        Some(&b"hi\n"[..])
    );
    // A new process: files only, no process image.
    s.run("nohup sleep 3000 >/dev/null 2>&1 & sleep 0.2").await;
    assert_eq!(s.end_turn().await["kind"], "proc");
    let m = s.wait_manifests(3).await;
    assert_eq!(m[2]["kind"], "fs", "{:#}", m[2]);
    assert!(m[2]["process"].is_null(), "{:#}", m[2]);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_spec_annotation_chooses_full_every_turn() {
    let annotations = [("io.crab/checkpoint-policy", "full-every-turn")];
    let (mut s, _g) = Sandbox::start(
        "policy_full",
        SandboxOptions {
            annotations: &annotations,
            ..Default::default()
        },
    )
    .await;
    s.run("true").await;
    assert_eq!(s.end_turn().await["kind"], "none");
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "full", "{:#}", m[0]);
    assert!(
        !m[0]["process"]["pids"].as_array().unwrap().is_empty(),
        "{:#}",
        m[0]
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_policy_is_refused_at_create() {
    let env = TestEnv {
        image: AGENT_IMAGE.into(),
        ..TestEnv::from_env()
    };
    let h = Harness::connect_env(env)
        .await
        .unwrap_or_else(|e| panic!("integration test setup failed: {e}"));
    if !h.runs_crab_only(
        "an_unknown_policy_is_refused_at_create",
        "checkpoint policies are crab's",
    ) {
        return;
    }
    let id = h.unique_id("policy_bad");
    let _g = h.guard(&[&id]);
    let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
    let mut spec = crab_integration::spec::container_spec(&id, &h.env.namespace, process);
    spec["annotations"]["io.crab/checkpoint-policy"] = "every-turn".into();
    let state = h.env.crab_home.join("state").join(&id);
    let config = format!("[store]\nstate_dir = \"{}\"\n", state.display());
    h.create_container_with_spec_and_options(
        &id,
        &spec,
        Some(crab_runtime_options(None, Some(&config))),
    )
    .await
    .unwrap();
    let e = h
        .create_task(&id, None)
        .await
        .expect_err("an unknown policy must fail the create")
        .to_string();
    assert!(
        e.contains("io.crab/checkpoint-policy") && e.contains("every-turn"),
        "{e}"
    );
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
    let _ = std::fs::remove_dir_all(&state);
}
