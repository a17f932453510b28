//! Where a restore puts its copy of a checkpoint's CRIU image, through containerd and the crab
//! shim: on disk in the store (`<state_dir>/.restores/`, root's, 0700), never in the bundle
//! (a tmpfs under `/run/containerd` on most hosts, where an image of up to `[restore]
//! max_image_mib` would sit in RAM for the container's life), and gone after Delete and after a
//! restore that failed.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crab_integration::sandbox::{Sandbox, SandboxOptions};
use crab_integration::Harness;
use serde_json::Value;

const CRAB: &str = "io.containerd.crab.v1";
const T: Duration = Duration::from_secs(120);

fn crabctl_ok(s: &Sandbox, args: &[&str]) -> String {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(code, 0, "crabctl {args:?}:\nstdout: {out}\nstderr: {err}");
    out
}

/// Removes images when the test ends, however it ends.
struct Images(Harness, Vec<String>);

impl Drop for Images {
    fn drop(&mut self) {
        for name in &self.1 {
            let _ = self.0.ctr().run(&["images", "rm", name]);
        }
    }
}

/// The restore directory the shim logged for container `id` (containerd's log, from byte
/// `from` on), if any.
fn logged_restore_dir(h: &Harness, from: u64, id: &str) -> Option<PathBuf> {
    let text = h.env.containerd_log_since(from);
    let needle =
        format!("create {id}: its process image, if the checkpoint holds one, is copied to ");
    let line = text.lines().find(|l| l.contains(&needle))?;
    let rest = &line[line.find(&needle).unwrap() + needle.len()..];
    Some(PathBuf::from(rest.split(" to restore it").next().unwrap()))
}

fn log_len(h: &Harness) -> u64 {
    h.env.containerd_log_len()
}

/// The entries of `dir` (none if it does not exist).
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A fork of a process checkpoint (restored by its shim through containerd): its CRIU image is
/// in `<state_dir>/.restores/<ns>.<id>.<nonce>/criu` (root's 0700 directory, locked by the
/// shim) while it runs, nothing of it in the bundle; deleting the fork removes it. Then the
/// same checkpoint exported and run under a spec that grants less (uid 1000 without
/// CAP_SETUID): Create copies the image, refuses it, and the copy is gone at once.
#[tokio::test(flavor = "multi_thread")]
async fn the_restore_copy_is_on_disk_and_removed_after_delete_and_failure() {
    let (mut s, _g) = Sandbox::start("hostile_restore_copy", SandboxOptions::default()).await;
    let h = s.h.clone();
    let image = format!("localhost/crab-test/{}:proc", s.id);
    let _images = Images(h.clone(), vec![image.clone()]);
    s.run("(nohup sleep 434343 >/dev/null 2>&1 &) && sleep 0.2")
        .await;
    s.end_turn().await;
    let m = s.wait_manifests(1).await;
    assert!(!m[0]["process"].is_null(), "a process turn: {:#}", m[0]);
    let turn = m[0]["turn_id"].as_str().unwrap().to_string();

    // Restored by a fork.
    let from = log_len(&h);
    let out = crabctl_ok(
        &s,
        &["fork", &s.id, "--at", &turn, "--count", "1", "-o", "json"],
    );
    let report: Value = serde_json::from_str(&out).unwrap();
    let fork = report["forks"][0]["id"].as_str().unwrap().to_string();
    let mut guard = h.guard(&[]);
    guard.add(&fork);
    let _internal = Images(h.clone(), h.internal_images(&s.id));
    let restores = s.state_dir.join(".restores");
    let dir = logged_restore_dir(&h, from, &fork)
        .unwrap_or_else(|| panic!("no restore directory logged for {fork}"));
    eprintln!("the fork's restore copy: {}", dir.display());
    assert_eq!(dir.parent(), Some(restores.as_path()), "{}", dir.display());
    let md = std::fs::metadata(&restores).unwrap();
    assert_eq!(
        (md.uid(), md.mode() & 0o7777),
        (0, 0o700),
        "{}",
        restores.display()
    );
    assert!(
        dir.join("criu/inventory.img").is_file(),
        "the CRIU image is not in {}: {:?}",
        dir.display(),
        entries(&dir.join("criu"))
    );
    let bundle = h.env.task_bundle(&fork);
    let in_bundle = entries(&bundle);
    assert!(
        !in_bundle.iter().any(|e| e == "crab-restore" || e == "criu"),
        "a CRIU image in the bundle {}: {in_bundle:?}",
        bundle.display()
    );
    let mut f = Sandbox {
        h: h.clone(),
        id: fork.clone(),
        state_dir: s.state_dir.clone(),
        turn: 1,
    };
    let procs = f.run("ps -eo args").await.stdout;
    assert!(procs.contains("sleep 434343"), "the fork: {procs}");
    h.kill_and_remove(&fork).await.unwrap();
    assert!(!dir.exists(), "{} outlived Delete", dir.display());
    assert_eq!(entries(&restores), Vec::<String>::new());

    // A restore refused after the copy: the copy goes with the failed Create.
    crabctl_ok(&s, &["export", &s.id, "--turn", &turn, &image]);
    let id = h.unique_id("hostile_restore_copy_refused");
    let _g2 = h.guard(&[&id]);
    let state = h.env.crab_home.join("state").join(&id);
    let config = state.with_extension("toml");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(
        &config,
        format!(
            "[store]\nstate_dir = \"{}\"\n[restore]\ntrusted_keys = [\"{}\"]\n",
            state.display(),
            s.state_dir.join("keys/checkpoint-signing.pub").display()
        ),
    )
    .unwrap();
    let from = log_len(&h);
    let out = h
        .ctr()
        .run_with(
            &[
                "run",
                "--rm",
                "--runtime",
                CRAB,
                "--runtime-config-path",
                config.to_str().unwrap(),
                "--user",
                "1000:1000",
                "--cap-drop",
                "CAP_SETUID",
                "--cap-drop",
                "CAP_SETGID",
                &image,
                &id,
                "true",
            ],
            None,
            T,
        )
        .unwrap();
    let text = format!("{}{}", out.stdout, out.stderr);
    let restores = state.join(".restores");
    let dir = logged_restore_dir(&h, from, &id);
    let left = entries(&restores);
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_dir_all(&state);
    assert!(!out.status.success(), "restored under uid 1000: {text}");
    assert!(
        text.contains("privilege") || text.contains("uid"),
        "refused for another reason: {text}"
    );
    let dir = dir.unwrap_or_else(|| panic!("no restore directory logged for {id}: {text}"));
    eprintln!("the refused restore's copy was: {}", dir.display());
    assert_eq!(dir.parent(), Some(restores.as_path()));
    assert!(
        !dir.exists(),
        "{} outlived the failed Create",
        dir.display()
    );
    assert_eq!(left, Vec::<String>::new(), "left in {}", restores.display());
    s.finish().await;
}
