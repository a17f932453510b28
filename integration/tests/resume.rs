//! Resume at Create (`io.crab/resume: newest`): a new container of a lineage starts from the
//! newest durable checkpoint of that lineage on the node, with no human step: the kubelet's
//! next attempt of a crashed container, a container created again after a crash or a reboot.
//! Real containerd, runc and CRIU, through the Task API; the CRI and Docker paths have their
//! own tests (`cri_resume`, `docker_resume`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crab_integration::sandbox::{Sandbox, SandboxOptions, KV_SCRIPTS};

/// The agent's turns (after [`KV_SCRIPTS`]): files, a git commit, a server holding state in
/// memory.
const TURNS: &[&str] = &[
    r#"mkdir -p proj && echo v1 > proj/a.txt && echo scratch > junk.txt && chmod 1777 proj
cd proj && git init -q && git -c user.email=a@b -c user.name=a add a.txt && git -c user.email=a@b -c user.name=a commit -qm one"#,
    "nohup python3 /app/kv.py >/dev/null 2>&1 & python3 /app/cli.py 'x = 41'",
    "rm junk.txt && echo v2 >> proj/a.txt && python3 /app/cli.py 'x += 1'",
];

/// What is compared: files (hashes and modes), git's log, the interpreter's variable.
const STATE: &str = r#"cd /app && find . -path ./proj/.git -prune -o -type f -print | sort | xargs sha256sum
stat -c '%a %n' proj
git -C proj log --format=%s
python3 /app/cli.py 'x'"#;

fn unique_lineage(name: &str) -> String {
    format!(
        "test/{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

fn options<'a>(annotations: &'a [(&'a str, &'a str)], state: &'a Path) -> SandboxOptions<'a> {
    SandboxOptions {
        annotations,
        state_dir: Some(state.to_path_buf()),
        ..SandboxOptions::default()
    }
}

async fn end_turn_durably(s: &mut Sandbox) -> serde_json::Value {
    let a = s.end_turn().await;
    s.sync().await;
    a
}

/// SIGKILL of every process of the container: the task stops, the container and its store stay.
async fn crash(s: &Sandbox) {
    s.h.kill(&s.id, "", libc::SIGKILL, true).await.unwrap();
    s.h.wait(&s.id, "", Duration::from_secs(30)).await.unwrap();
}

/// The manifest that begins a sandbox's lineage (a restored one is recorded once its process
/// image is imported, in the background).
async fn origin_of(s: &Sandbox) -> serde_json::Value {
    for _ in 0..600 {
        if let Some(m) = s.lineage().first() {
            return m.clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{}: no origin manifest after 30 s", s.id);
}

fn state_dir(name: &str) -> PathBuf {
    let env = crab_integration::TestEnv::from_env();
    let dir = env
        .crab_home
        .join("state")
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_container_of_the_lineage_comes_back_as_of_its_last_turn_end() {
    let state = state_dir("resume");
    let lineage = unique_lineage("resume");
    let annotations = [
        ("io.crab/lineage", lineage.as_str()),
        ("io.crab/resume", "newest"),
    ];
    // The first container of the lineage has nothing to resume: it starts fresh.
    let (mut a, guard_a) = Sandbox::start("res-a", options(&annotations, &state)).await;
    assert_eq!(a.lineage()[0]["kind"], "created", "{:#?}", a.lineage());
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.store().join("lineage.json")).unwrap()).unwrap();
    assert_eq!(record["lineage"], lineage.as_str(), "{record}");
    assert!(
        record["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("sha256:")),
        "the image it runs on is recorded: {record}"
    );
    // The interpreter's scripts are written in the first turn.
    a.run(KV_SCRIPTS).await;
    for t in TURNS {
        a.run(t).await;
        end_turn_durably(&mut a).await;
    }
    let want = a.run(STATE).await.stdout;
    assert!(
        want.contains("42") && want.contains("one") && want.contains("1777 proj"),
        "{want}"
    );
    // An interrupted turn: files written and a process started, no turn end.
    a.run("echo half > /app/interrupted.txt && (nohup sleep 1000 >/dev/null 2>&1 &)")
        .await;
    crash(&a).await;

    let (mut b, guard_b) = Sandbox::start("res-b", options(&annotations, &state)).await;
    let origin = origin_of(&b).await;
    assert_eq!(origin["kind"], "restored", "{origin:#}");
    assert!(
        origin["explanation"].as_str().unwrap().contains(&a.id),
        "{origin:#}"
    );
    let got = b.run(STATE).await.stdout;
    assert_eq!(got, want, "resumed as of the last turn end");
    let gone = b
        .run("ls /app/interrupted.txt 2>&1; ps -eo args | grep -c '^sleep 1000' || true")
        .await
        .stdout;
    assert!(
        gone.contains("No such file") && gone.trim_end().ends_with('0'),
        "the interrupted turn's file and process are not back: {gone}"
    );
    // It goes on checkpointing: a turn, then a crash, and a third container resumes the
    // second's newest turn (a second generation: the layers are the new store's own).
    b.run("python3 /app/cli.py 'x += 100' && echo v3 >> /app/proj/a.txt")
        .await;
    let answer = end_turn_durably(&mut b).await;
    assert_eq!(answer["kind"], "full", "{answer:#}");
    let want2 = b.run(STATE).await.stdout;
    assert!(want2.contains("142"), "{want2}");
    crash(&b).await;
    let (mut c, guard_c) = Sandbox::start("res-c", options(&annotations, &state)).await;
    assert_eq!(
        c.run(STATE).await.stdout,
        want2,
        "the second generation resumes"
    );
    let m = origin_of(&c).await;
    for layer in m["fs_layers"].as_array().unwrap() {
        let hex = layer["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:");
        assert!(
            c.store().join("blobs/sha256").join(hex).is_file(),
            "the resumed store holds its layers: {m:#}"
        );
    }
    assert_eq!(m["image_layers"].as_u64().unwrap_or(0), 0, "{m:#}");
    c.finish().await;
    drop(guard_c);
    for (s, g) in [(a, guard_a), (b, guard_b)] {
        s.h.kill_and_remove(&s.id).await.unwrap();
        s.h.assert_no_leaks(&s.id).await;
        drop(g);
    }
    let _ = std::fs::remove_dir_all(&state);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_that_cannot_be_used_fails_create_with_the_reason() {
    let state = state_dir("resume-bad");
    let lineage = unique_lineage("bad");
    let annotations = [
        ("io.crab/lineage", lineage.as_str()),
        ("io.crab/resume", "newest"),
    ];
    let (mut a, guard_a) = Sandbox::start("resbad-a", options(&annotations, &state)).await;
    a.run("echo hello > /app/f.txt").await;
    let answer = end_turn_durably(&mut a).await;
    assert_eq!(answer["kind"], "fs", "{answer:#}");
    crash(&a).await;
    // Its layer damaged on disk: the digest check refuses it; no silent fresh start.
    let m = a.manifests().last().unwrap().clone();
    let hex = m["fs_layers"].as_array().unwrap().last().unwrap()["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let blob = a.store().join("blobs/sha256").join(&hex);
    let good = std::fs::read(&blob).unwrap();
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    std::fs::write(&blob, &bad).unwrap();
    let e = match Sandbox::try_start("resbad-b", options(&annotations, &state)).await {
        Ok(_) => panic!("a damaged checkpoint was resumed"),
        Err(e) => e,
    };
    assert!(
        e.contains("cannot resume") && e.contains(&lineage) && e.contains(&hex),
        "{e}"
    );
    std::fs::write(&blob, &good).unwrap();
    // Another image under the same lineage: refused, naming both images.
    let busybox = crab_integration::env::BUSYBOX_IMAGE;
    let e = match Sandbox::try_start(
        "resbad-c",
        SandboxOptions {
            image: Some(busybox),
            ..options(&annotations, &state)
        },
    )
    .await
    {
        Ok(_) => panic!("a checkpoint was resumed onto another image"),
        Err(e) => e,
    };
    assert!(
        e.contains("taken on image") && e.contains("this container's image"),
        "{e}"
    );
    // A malformed request is refused before anything is looked up.
    for (k, v) in [("io.crab/resume", "latest"), ("io.crab/lineage", "../x")] {
        let bad = [(k, v)];
        let e = match Sandbox::try_start("resbad-d", options(&bad, &state)).await {
            Ok(_) => panic!("{k}={v} accepted"),
            Err(e) => e,
        };
        assert!(e.contains(k), "{e}");
    }
    // With the layer whole again, it resumes.
    let (mut b, guard_b) = Sandbox::start("resbad-e", options(&annotations, &state)).await;
    assert_eq!(b.run("cat /app/f.txt").await.stdout, "hello\n");
    b.finish().await;
    drop(guard_b);
    a.h.kill_and_remove(&a.id).await.unwrap();
    drop(guard_a);
    let _ = std::fs::remove_dir_all(&state);
}
