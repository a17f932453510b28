//! `crabctl prune`: the checkpoint store and the internal images of a container stay while its
//! container record exists (also without a task, as after a crash) and go once the record is
//! gone; entries that are not such stores are left alone; `--dry-run` removes nothing.

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use crab_integration::{
    sandbox::{Sandbox, SandboxOptions},
    Harness,
};

const T: Duration = Duration::from_secs(60);

/// crabctl must succeed; returns its stdout.
fn crabctl_ok(s: &Sandbox, args: &[&str]) -> String {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(
        code, 0,
        "crabctl {args:?} failed:\nstdout: {out}\nstderr: {err}"
    );
    out
}

/// Sets the modification time of `dir` (and of its `checkpoints/`, if any) `ago` back.
fn set_changed(dir: &Path, ago: Duration) {
    let t = SystemTime::now() - ago;
    for d in [dir.to_path_buf(), dir.join("checkpoints")] {
        if d.is_dir() {
            fs::File::open(&d).unwrap().set_modified(t).unwrap();
        }
    }
}

/// Removes the test's state directory, config and checkpoint images when dropped (also on panic).
struct Cleanup {
    h: Harness,
    id: String,
    paths: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for name in self.h.internal_images(&self.id) {
            let _ = self.h.ctr().run(&["images", "rm", &name]);
        }
        for p in &self.paths {
            let _ = fs::remove_dir_all(p).or_else(|_| fs::remove_file(p));
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn prune_removes_only_what_containers_without_a_record_left() {
    let (mut s, _g) = Sandbox::start("prune", SandboxOptions::default()).await;
    let h = s.h.clone();
    let config = s.state_dir.with_extension("toml");
    fs::write(
        &config,
        format!("[store]\nstate_dir = \"{}\"\n", s.state_dir.display()),
    )
    .unwrap();
    let _cleanup = Cleanup {
        h: h.clone(),
        id: s.id.clone(),
        paths: vec![s.state_dir.clone(), config.clone()],
    };
    let cfg = config.to_str().unwrap().to_string();
    let prune = |s: &Sandbox, extra: &[&str]| {
        let mut args = vec!["--config", cfg.as_str(), "prune"];
        args.extend_from_slice(extra);
        crabctl_ok(s, &args)
    };

    // A checkpoint, and a rollback to it by recreating the container (in place would make no
    // image): the container now runs from crabctl's internal image.
    s.run("echo one > /app/a.txt").await;
    s.end_turn().await;
    s.wait_manifests(1).await;
    crabctl_ok(&s, &["rollback", &s.id, "--to", "t1", "--recreate"]);
    let images = h.internal_images(&s.id);
    assert_eq!(images.len(), 1, "{images:?}");
    let store = s.store();
    let kept = |out: &str| {
        assert!(
            store.join("checkpoints").is_dir(),
            "the store of an existing container was removed:\n{out}"
        );
        assert_eq!(h.internal_images(&s.id), images, "{out}");
        assert!(
            !out.contains(&format!("remove store {}", store.display())),
            "{out}"
        );
        assert!(!out.contains("remove image"), "{out}");
    };

    // While the container exists its store stays, however old.
    set_changed(&store, Duration::from_secs(3600));
    let out = prune(&s, &[]);
    kept(&out);
    assert!(
        out.contains("kept 1 stores of existing containers"),
        "{out}"
    );
    // Without --config the state_dir is found through the container's own runtime options.
    let (code, out, err) = s.crabctl(&["prune", "--dry-run"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.lines()
            .next()
            .unwrap()
            .contains(&s.state_dir.display().to_string()),
        "{out}"
    );

    // Its task gone but its record kept (as after a crash, for `crabctl recover`): still kept.
    h.kill(&s.id, "", libc::SIGKILL, true).await.unwrap();
    h.wait(&s.id, "", T).await.unwrap();
    h.delete_task(&s.id).await.unwrap();
    kept(&prune(&s, &[]));

    // Next to it: a directory that is no store, a symlink to a store elsewhere, and the
    // leftover of a prune that crashed midway.
    let ns_dir = store.parent().unwrap().to_path_buf();
    let plain = ns_dir.join("not-a-store");
    fs::create_dir_all(plain.join("data")).unwrap();
    let outside = s.state_dir.join("outside");
    fs::create_dir_all(outside.join("checkpoints")).unwrap();
    std::os::unix::fs::symlink(&outside, ns_dir.join("linked")).unwrap();
    let leftover = ns_dir.join(".prune-old-1-2-3.tmp");
    fs::create_dir_all(leftover.join("blobs")).unwrap();
    fs::write(leftover.join("blobs/x"), vec![1u8; 10_000]).unwrap();
    for d in [&plain, &outside] {
        set_changed(d, Duration::from_secs(3600));
    }

    // The record goes. A store changed a moment ago is left for a later run.
    h.delete_container(&s.id).await.unwrap();
    set_changed(&store, Duration::ZERO);
    let out = prune(&s, &["--dry-run"]);
    assert!(
        out.contains(&format!("kept {}: too new", store.display())),
        "{out}"
    );
    assert!(
        out.contains("kept image"),
        "the image goes with its store, later: {out}"
    );

    // An entry of the state dir's restore cache (a verified copy of a process image, kept for
    // the next restore of it): prune clears the cache.
    let cached = s.state_dir.join(".restore-cache/entries/feed");
    fs::create_dir_all(&cached).unwrap();
    fs::write(cached.join("pages-1.img"), vec![2u8; 10_000]).unwrap();

    // --dry-run says what would go and removes nothing.
    set_changed(&store, Duration::from_secs(3600));
    let dry = prune(&s, &["--dry-run"]);
    assert!(
        dry.contains("entries of the restore cache") && cached.is_dir(),
        "{dry}"
    );
    for line in [
        format!("would remove store {} (", store.display()),
        format!("would remove image {}", images[0]),
        format!("would finish {} (", leftover.display()),
        format!(
            "kept {}: a symlink (not followed)",
            ns_dir.join("linked").display()
        ),
        format!("kept {}: not a crab store", plain.display()),
        "total: would remove 2 store directories".to_string(),
    ] {
        assert!(dry.contains(&line), "no {line:?} in:\n{dry}");
    }
    assert!(
        store.join("checkpoints").is_dir() && leftover.is_dir(),
        "--dry-run removed a store:\n{dry}"
    );
    assert_eq!(
        h.internal_images(&s.id),
        images,
        "--dry-run removed an image:\n{dry}"
    );

    // The real thing.
    let out = prune(&s, &[]);
    assert!(
        out.contains(&format!("removed store {} (", store.display())),
        "{out}"
    );
    assert!(
        out.contains(&format!("removed image {}", images[0])),
        "{out}"
    );
    assert!(out.contains("total: removed 2 store directories"), "{out}");
    assert!(
        out.contains("entries of the restore cache") && !cached.exists(),
        "{out}"
    );
    assert!(out.contains("and 1 images"), "{out}");
    assert!(!store.exists(), "{out}");
    assert!(h.internal_images(&s.id).is_empty(), "{out}");
    let mut left: Vec<String> = fs::read_dir(&ns_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    // What is left: the entries prune keeps, and the figures of the stores it removed (which
    // `crabctl metrics` adds to its counters, so that they do not drop).
    assert_eq!(
        left,
        [".pruned-metrics.json", "linked", "not-a-store"],
        "{out}"
    );
    assert!(
        outside.join("checkpoints").is_dir() && plain.join("data").is_dir(),
        "{out}"
    );

    // Nothing left to do.
    let again = prune(&s, &[]);
    assert!(
        again.contains("total: removed 0 store directories (0 B) and 0 images"),
        "{again}"
    );
    h.assert_no_leaks(&s.id).await;
}
