//! crab's own configuration, passed per container in containerd's runtime options
//! (`runtimeoptions.v1.Options`: ConfigBody or ConfigPath) or with `ctr run
//! --runtime-config-path`: bad files fail the task create with an error that names the key (or
//! the file), and leave nothing behind; a good one is used.
//!
//! crab only: the stock runc shim takes `containerd.runc.v1.Options`, not crab's TOML.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crab_integration::api::crab_runtime_options;
use crab_integration::host::{self, eventually};
use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec, TaskStatus};
use prost_types::Any;
use tonic::Code;

const T: Duration = Duration::from_secs(30);
const WHY: &str = "crab's config file is a crab feature; the stock shim reads \
                   containerd.runc.v1.Options instead";

/// Where a test writes its config files (under CRAB_HOME, removed by the caller).
fn config_file(h: &Harness, id: &str, toml: &str) -> PathBuf {
    let dir = h.env.crab_home.join("tmp").join("config-errors");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, toml).unwrap();
    path
}

/// Creating a task of a container with runtime options `options` must fail with `code` and an
/// error containing every one of `needles`; afterwards nothing of the container may remain.
async fn task_create_fails(h: &Harness, id: &str, options: Any, code: Code, needles: &[&str]) {
    let _g = h.guard(&[id]);
    h.create_container_with_runtime_options(id, &ProcessSpec::new(&["echo", "never"]), options)
        .await
        .unwrap();
    let io = h.stdio(id, "init", StdioOptions::default()).unwrap();
    let err = h
        .create_task(id, Some(&io))
        .await
        .expect_err("task create must fail");
    let msg = err.to_string();
    assert_eq!(err.grpc_code(), Some(code), "{msg}");
    for n in needles {
        assert!(msg.contains(n), "error does not name {n:?}: {msg}");
    }
    let after = h
        .status(id, "")
        .await
        .expect_err("no task may exist after a failed create");
    assert_eq!(after.grpc_code(), Some(Code::NotFound), "{after}");
    drop(io);
    h.delete_container(id).await.unwrap();
    h.assert_no_leaks(id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_key_in_config_body_is_named() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only("unknown_key_in_config_body_is_named", WHY) {
        return;
    }
    let id = h.unique_id("config_unknown_key");
    let body = "[runc]\nbinray = \"x\"\n";
    task_create_fails(
        &h,
        &id,
        crab_runtime_options(None, Some(body)),
        Code::InvalidArgument,
        &["runc.binray", ":2:"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_key_in_config_path_names_key_and_file() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only("unknown_key_in_config_path_names_key_and_file", WHY) {
        return;
    }
    let id = h.unique_id("config_unknown_key_path");
    let path = config_file(&h, &id, "# crab\n[runc]\nbinray = \"x\"\n");
    task_create_fails(
        &h,
        &id,
        crab_runtime_options(Some(path.to_str().unwrap()), None),
        Code::InvalidArgument,
        &["runc.binray", &format!("{}:3:", path.display())],
    )
    .await;
    std::fs::remove_file(&path).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_log_level_is_named() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only("bad_log_level_is_named", WHY) {
        return;
    }
    let id = h.unique_id("config_bad_log_level");
    task_create_fails(
        &h,
        &id,
        crab_runtime_options(None, Some("[log]\nlevel = \"loud\"\n")),
        Code::InvalidArgument,
        &["log.level", "loud"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_runc_binary_is_reported() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only("missing_runc_binary_is_reported", WHY) {
        return;
    }
    let id = h.unique_id("config_missing_runc");
    task_create_fails(
        &h,
        &id,
        crab_runtime_options(None, Some("[runc]\nbinary = \"/nonexistent/runc\"\n")),
        Code::InvalidArgument,
        &["/nonexistent/runc", "not found", "runc.binary"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_config_path_is_named() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only("missing_config_path_is_named", WHY) {
        return;
    }
    let id = h.unique_id("config_missing_path");
    let path = format!("/nonexistent/crab-{id}.toml");
    task_create_fails(
        &h,
        &id,
        crab_runtime_options(Some(&path), None),
        Code::InvalidArgument,
        &[&path],
    )
    .await;
}

/// A valid ConfigBody is used: runc keeps the container's state under the configured root
/// (`<root>/<namespace>/<id>`) while it runs, and nothing stays there afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn valid_config_body_moves_the_runc_root() {
    const ROOT: &str = "/run/crab-test-root";
    let h = Harness::for_test().await;
    if !h.runs_crab_only("valid_config_body_moves_the_runc_root", WHY) {
        return;
    }
    let id = h.unique_id("config_runc_root");
    let _g = h.guard(&[&id]);
    let body = format!("[runc]\nroot = \"{ROOT}\"\n\n[log]\nlevel = \"debug\"\n");
    h.create_container_with_runtime_options(
        &id,
        &ProcessSpec::new(&["sleep", "1000"]),
        crab_runtime_options(None, Some(&body)),
    )
    .await
    .unwrap();
    let pid = h.create_task(&id, None).await.unwrap();
    h.start(&id, "").await.unwrap();
    let ns_root = Path::new(ROOT).join(&h.env.namespace);
    let state = ns_root.join(&id).join("state.json");
    assert!(
        state.is_file(),
        "{} missing while the container runs",
        state.display()
    );
    let default_state = crab_runtime_config::RuncConfig::default()
        .root
        .join(&h.env.namespace)
        .join(&id);
    assert!(!default_state.exists(), "{}", default_state.display());
    // runc under that root really is managing the container.
    let out = std::process::Command::new("runc")
        .args(["--root", ns_root.to_str().unwrap(), "state", &id])
        .output()
        .unwrap();
    let st: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("runc state: {e}: {out:?}"));
    assert_eq!(
        (st["status"].as_str(), st["pid"].as_u64()),
        (Some("running"), Some(pid as u64)),
        "{st}"
    );
    assert_eq!(h.status(&id, "").await.unwrap(), (TaskStatus::Running, pid));
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    eventually(T, || (!ns_root.join(&id).exists()).then_some(()))
        .unwrap_or_else(|| panic!("{} left behind", ns_root.join(&id).display()));
    h.assert_no_leaks(&id).await;
    assert!(host::container_processes(&id).is_empty());
    // Other runs may share the directory; remove it only when it is empty.
    let _ = std::fs::remove_dir(&ns_root);
    let _ = std::fs::remove_dir(ROOT);
}

/// `ctr run --runtime-config-path FILE` with an unknown key: ctr fails, the error names the
/// key and the file, and nothing is left.
#[tokio::test(flavor = "multi_thread")]
async fn ctr_run_with_bad_runtime_config_path_fails_naming_the_key() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only(
        "ctr_run_with_bad_runtime_config_path_fails_naming_the_key",
        WHY,
    ) {
        return;
    }
    let id = h.unique_id("config_ctr_bad_file");
    let _g = h.guard(&[&id]);
    let path = config_file(&h, &id, "[store]\nstate_dri = \"/var/lib/crab\"\n");
    let out = h
        .ctr()
        .run(&[
            "run",
            "--rm",
            "--runtime",
            h.runtime(),
            "--runtime-config-path",
            path.to_str().unwrap(),
            &h.env.image,
            &id,
            "echo",
            "never",
        ])
        .unwrap();
    assert_ne!(out.code(), 0, "{out:?}");
    assert!(out.stderr.contains("store.state_dri"), "{out:?}");
    assert!(
        out.stderr.contains(path.to_str().unwrap()),
        "error does not name the file: {out:?}"
    );
    assert!(!out.stdout.contains("never"), "{out:?}");
    h.assert_no_leaks(&id).await;
    std::fs::remove_file(&path).unwrap();
}

/// The same file without the bad key works through ctr: the config path is really read.
#[tokio::test(flavor = "multi_thread")]
async fn ctr_run_with_good_runtime_config_path_works() {
    let h = Harness::for_test().await;
    if !h.runs_crab_only("ctr_run_with_good_runtime_config_path_works", WHY) {
        return;
    }
    let id = h.unique_id("config_ctr_good_file");
    let _g = h.guard(&[&id]);
    let path = config_file(&h, &id, "[log]\nlevel = \"debug\"\n");
    let out = h
        .ctr()
        .run(&[
            "run",
            "--rm",
            "--runtime",
            h.runtime(),
            "--runtime-config-path",
            path.to_str().unwrap(),
            &h.env.image,
            &id,
            "echo",
            "configured",
        ])
        .unwrap();
    assert_eq!(
        (out.code(), out.stdout.as_str()),
        (0, "configured\n"),
        "{out:?}"
    );
    h.assert_no_leaks(&id).await;
    std::fs::remove_file(&path).unwrap();
}
