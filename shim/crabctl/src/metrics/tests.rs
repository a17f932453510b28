use super::*;

fn engine_config(root: &Path) -> crab_runtime_config::EngineConfig {
    crab_runtime_config::EngineConfig {
        root: root.to_path_buf(),
        ..Config::default().engine
    }
}

fn answer(kind: &str, us: u64) -> String {
    serde_json::json!({"turn_id": "t", "kind": kind, "degraded": [], "elapsed_us": us}).to_string()
}

fn write(path: &Path, data: impl AsRef<[u8]>) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, data).unwrap();
}

/// Values of the samples of `text` by `name{labels}` as written.
fn samples(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

#[test]
fn a_state_dir_is_scanned_across_namespaces_and_set_aside_stores() {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    write(&s.join("default/a/turns/000001.json"), answer("fs", 100));
    write(&s.join("default/a/turns/000002.json"), answer("none", 100));
    write(&s.join("k8s.io/b/turns/000001.json"), answer("proc", 100));
    // The earlier lineage of a reused id counts under the same id.
    write(
        &s.join("default/.replaced-a-1764650000000000000-4242/turns/000001.json"),
        answer("full", 100),
    );
    // Not stores: dot entries, files, symlinks.
    write(&s.join(".hidden/x/turns/000001.json"), answer("full", 1));
    write(&s.join("default/.lock"), "");
    write(&s.join("default/file"), "");
    let elsewhere = tempfile::tempdir().unwrap();
    write(
        &elsewhere.path().join("turns/000001.json"),
        answer("full", 1),
    );
    std::os::unix::fs::symlink(elsewhere.path(), s.join("default/link")).unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), s.join("linkns")).unwrap();

    let engine = tempfile::tempdir().unwrap();
    let snap = scan(
        s,
        &engine_config(&engine.path().join("none-yet")),
        true,
        &mut ScanCache::default(),
    );
    assert_eq!(snap.stores, 3, "{:?}", snap.warnings);
    let d = &snap.tally.answers;
    assert_eq!((d.none, d.fs, d.proc, d.full), (1, 1, 1, 1));
    let keys: Vec<_> = snap.per_container.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(
        keys,
        [
            ("default".to_string(), "a".to_string()),
            ("k8s.io".to_string(), "b".to_string())
        ]
    );
    assert_eq!(snap.per_container[0].1.answers.full, 1);
    assert_eq!(
        snap.engine.slots_free,
        u64::from(Config::default().engine.max_jobs)
    );

    let text = render(&snap);
    assert!(text.ends_with("# EOF\n"), "{text}");
    let v = samples(&text);
    assert_eq!(v["crab_turn_answers_total{decision=\"fs\"}"], 1.0);
    assert_eq!(
        v["crab_turn_answers_total{namespace=\"default\",container=\"a\",decision=\"full\"}"],
        1.0
    );
    assert_eq!(v["crab_turns_skipped_total"], 1.0);
    assert_eq!(v["crab_turn_decision_seconds_count"], 4.0);
    assert_eq!(v["crab_turn_decision_seconds_bucket{le=\"+Inf\"}"], 4.0);
    // Cumulative: every answer took 100 us, so every bucket holds all four.
    assert_eq!(v["crab_turn_decision_seconds_bucket{le=\"0.0005\"}"], 4.0);
    assert_eq!(v["crab_turn_decision_seconds_bucket{le=\"5.0\"}"], 4.0);
    assert_eq!(v["crab_metrics_stores"], 3.0);
    // Without --per-container no series names a container.
    let plain = render(&scan(
        s,
        &engine_config(&engine.path().join("none-yet")),
        false,
        &mut ScanCache::default(),
    ));
    assert!(!plain.contains("container="), "{plain}");

    // The 0.0.4 text format: counters' families named as their samples, no UNIT, no EOF.
    let prom = to_prometheus_text(&plain);
    assert!(
        prom.contains("# TYPE crab_checkpoints_total counter\n"),
        "{prom}"
    );
    assert!(
        prom.contains("# HELP crab_checkpoint_written_bytes_total "),
        "{prom}"
    );
    assert!(
        prom.contains("# TYPE crab_turn_decision_seconds histogram\n"),
        "{prom}"
    );
    assert!(
        !prom.contains("# EOF") && !prom.contains("# UNIT"),
        "{prom}"
    );
    assert_eq!(samples(&prom), samples(&plain));
}

/// A store prune removes goes on counting (its figures folded into the namespace
/// directory's pruned file first), exactly once whatever point a prune stops at.
#[test]
fn replication_figures_are_summed_over_the_stores() {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let status = |pushes: u64, newest: u64, pushed: u64, lag_s: f64| {
        let mut st = crab_shim::replication::Status {
            pushes,
            failures: 1,
            superseded: 2,
            bytes_sent: 1000,
            bytes_skipped: 10,
            newest_seq: Some(newest),
            pushed_seq: Some(pushed),
            ..Default::default()
        };
        st.lag.observe(REPLICATION_BOUNDS, lag_s);
        serde_json::to_vec(&st).unwrap()
    };
    write(&s.join("default/a/replication.json"), status(3, 5, 5, 0.04));
    write(&s.join("default/b/replication.json"), status(4, 7, 6, 3.0));
    // A damaged status counts for nothing (and fails nothing).
    write(&s.join("default/c/replication.json"), "{");
    let engine = tempfile::tempdir().unwrap();
    let snap = scan(
        s,
        &engine_config(&engine.path().join("none-yet")),
        false,
        &mut ScanCache::default(),
    );
    let r = &snap.replication;
    assert_eq!((r.pushes, r.failures, r.superseded), (7, 2, 4));
    assert_eq!((r.bytes_sent, r.bytes_skipped, r.behind), (2000, 20, 1));
    let v = samples(&render(&snap));
    assert_eq!(v["crab_replication_pushes_total{outcome=\"ok\"}"], 7.0);
    assert_eq!(
        v["crab_replication_bytes_total{part=\"deduplicated\"}"],
        20.0
    );
    assert_eq!(v["crab_replication_queue_depth"], 1.0);
    assert_eq!(v["crab_replication_lag_seconds_count"], 2.0);
    assert_eq!(v["crab_replication_lag_seconds_bucket{le=\"0.05\"}"], 1.0);
    assert_eq!(v["crab_replication_lag_seconds_bucket{le=\"5.0\"}"], 2.0);
}

#[test]
fn pruned_stores_go_on_counting() {
    let state = tempfile::tempdir().unwrap();
    let ns = state.path().join("default");
    write(&ns.join("a/turns/000001.json"), answer("fs", 100));
    write(&ns.join("a/turns/000002.json"), answer("none", 100));
    write(&ns.join("b/turns/000001.json"), answer("proc", 100));
    write(
        &ns.join(".replaced-b-1-2/turns/000001.json"),
        answer("full", 100),
    );
    let engine = tempfile::tempdir().unwrap();
    let c = engine_config(engine.path());
    let count = || scan(state.path(), &c, false, &mut ScanCache::default());
    let before = count().tally;
    assert_eq!(
        before.answers.fs + before.answers.proc + before.answers.full,
        3
    );
    // Folded, then a crash before the rename: counted once.
    figures::fold_pruned_store(&ns, "a").unwrap();
    assert_eq!(count().tally, before);
    figures::fold_pruned_store(&ns, "a").unwrap();
    assert_eq!(count().tally, before, "folding twice adds nothing");
    // Renamed away (prune's leftover name), then removed.
    fs::rename(ns.join("a"), ns.join(".prune-a-1.tmp")).unwrap();
    assert_eq!(count().tally, before);
    fs::remove_dir_all(ns.join(".prune-a-1.tmp")).unwrap();
    assert_eq!(count().tally, before);
    assert_eq!(count().stores, 2);
    // A set-aside store, half removed when a prune stopped.
    figures::fold_pruned_store(&ns, ".replaced-b-1-2").unwrap();
    fs::remove_file(ns.join(".replaced-b-1-2/turns/000001.json")).unwrap();
    assert_eq!(count().tally, before);
    fs::remove_dir_all(ns.join(".replaced-b-1-2")).unwrap();
    // A new store under a pruned name is a new store.
    write(&ns.join("a/turns/000001.json"), answer("fs", 100));
    assert_eq!(count().tally.answers.fs, 2);
    let p = figures::Pruned::load(&ns).unwrap();
    assert_eq!(p.tally.answers.none, 1);
    // A corrupt pruned file is named and not guessed at; prune then refuses to fold.
    fs::write(ns.join(figures::PRUNED_FILE), b"{\"tally\": 7}").unwrap();
    let snap = count();
    assert_eq!(snap.unreadable, 1);
    assert!(
        snap.warnings[0].contains(figures::PRUNED_FILE),
        "{:?}",
        snap.warnings
    );
    let e = figures::fold_pruned_store(&ns, "b")
        .unwrap_err()
        .to_string();
    assert!(e.contains("move it away"), "{e}");
}

#[test]
fn the_engine_is_read_from_its_directory() {
    let engine = tempfile::tempdir().unwrap();
    let c = crab_runtime_config::EngineConfig {
        max_jobs: 2,
        ..engine_config(engine.path())
    };
    let e = crab_shim::engine::Engine::new(&c);
    let permit = e.enqueue("s", "ns", "t1", false).unwrap().wait().unwrap();
    let _queued = e.enqueue("s2", "ns", "t2", false).unwrap();
    e.count_restore(true).unwrap();
    e.count_restore(false).unwrap();
    e.count_restore(true).unwrap();
    let snap = scan(
        &engine.path().join("no-state"),
        &c,
        false,
        &mut ScanCache::default(),
    );
    let en = &snap.engine;
    assert_eq!((en.slots_busy, en.slots_free, en.queue_depth), (1, 1, 1));
    assert_eq!((en.restores.ok, en.restores.failed), (2, 1));
    permit.finish(4096);
    let snap = scan(
        &engine.path().join("no-state"),
        &c,
        false,
        &mut ScanCache::default(),
    );
    assert_eq!((snap.engine.jobs, snap.engine.bytes), (1, 4096));
    assert_eq!(snap.engine.wait.count, 1);
    let v = samples(&render(&snap));
    assert_eq!(v["crab_restores_total{outcome=\"ok\"}"], 2.0);
    assert_eq!(v["crab_restores_total{outcome=\"failed\"}"], 1.0);
    assert_eq!(v["crab_engine_wait_seconds_count"], 1.0);
    assert_eq!(v["crab_engine_written_bytes_total"], 4096.0);
    // A corrupt restores file is no figure (zero), not a panic.
    fs::write(engine.path().join("restores.json"), b"{\"ok\": -3").unwrap();
    let snap = scan(
        &engine.path().join("no-state"),
        &c,
        false,
        &mut ScanCache::default(),
    );
    assert_eq!(snap.engine.restores, Restores::default());
}

/// Scanning many stores stays cheap: prints the figure (`--nocapture`).
#[test]
fn scanning_a_thousand_stores() {
    let state = tempfile::tempdir().unwrap();
    let big_answer = serde_json::json!({
        "turn_id": "t", "kind": "fs", "degraded": [], "elapsed_us": 900,
        "fs": {"added": (0..200).map(|i| format!("/workspace/some/long/path/file-{i}.txt")).collect::<Vec<_>>()},
    })
    .to_string();
    for c in 0..1000 {
        for t in 1..=10u64 {
            write(
                &state.path().join(format!("default/c{c}/turns/{t:06}.json")),
                &big_answer,
            );
        }
        write(
            &state.path().join(format!("default/c{c}/checkpoints/000001.json")),
            br#"{"format": 1, "kind": "fs", "fs_layers": [{"size": 10}], "timings": {"total_ms": 50, "freeze_ms": 2}}"#,
        );
    }
    let engine = tempfile::tempdir().unwrap();
    let c = engine_config(engine.path());
    let mut cache = ScanCache::default();
    let t = Instant::now();
    let first = scan(state.path(), &c, false, &mut cache);
    let cold = t.elapsed();
    let t = Instant::now();
    let second = scan(state.path(), &c, false, &mut cache);
    let warm = t.elapsed();
    assert_eq!(first.tally, second.tally);
    assert_eq!(
        (first.stores, first.files_read, second.files_read),
        (1000, 11000, 0)
    );
    assert_eq!(first.tally.answers.fs, 10_000);
    println!(
        "scan of 1000 stores (11000 files, answers of {} bytes): {cold:?} cold, {warm:?} with the cache",
        big_answer.len()
    );
}

/// `--listen`: hyper answers one request per connection and closes it (a client reading to
/// the end gets the whole answer), in the format the Accept header asks for; another path is
/// 404, another method 405, a head over the bound 431, what is not HTTP 400.
#[tokio::test]
async fn the_endpoint_answers_one_request_per_connection() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.store.state_dir = dir.path().join("state");
    config.engine = engine_config(&dir.path().join("engine"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let scraped = Arc::new(Scraped {
        cache: Mutex::new(ScanCache::default()),
        config,
        per_container: false,
    });
    let server = tokio::spawn(async move {
        let () = serve_on(listener, scraped).await;
    });
    let request = |head: String| {
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut conn = std::net::TcpStream::connect(addr).unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            conn.write_all(head.as_bytes()).unwrap();
            let mut response = String::new();
            conn.read_to_string(&mut response).unwrap();
            response
        })
    };
    let get =
        |path: &str, headers: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n");

    let accept = "Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n";
    let om = request(get("/metrics", accept)).await.unwrap();
    let (head, body) = om.split_once("\r\n\r\n").unwrap();
    let lower = head.to_ascii_lowercase();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        lower.contains(&format!("content-type: {CONTENT_TYPE}")),
        "{head}"
    );
    assert!(
        lower.contains(&format!("content-length: {}", body.len())),
        "{head}"
    );
    assert!(lower.contains("connection: close"), "{head}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(samples(body).contains_key("crab_metrics_stores"), "{body}");

    let plain = request(get("/metrics?x=1", "")).await.unwrap();
    let (head, body) = plain.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains(TEXT_CONTENT_TYPE), "{head}");
    assert!(!body.contains("# EOF"), "{body}");

    let other = request(get("/other", "")).await.unwrap();
    assert!(other.starts_with("HTTP/1.1 404"), "{other}");
    assert!(other.ends_with("crab serves /metrics only\n"), "{other}");
    let post = "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
    let post = request(post.to_string()).await.unwrap();
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    let long = format!("X-Long: {}\r\n", "a".repeat(MAX_REQUEST_HEAD));
    let long = request(get("/metrics", &long)).await.unwrap();
    assert!(long.starts_with("HTTP/1.1 431"), "{long}");
    let junk = request("NOT HTTP AT ALL\r\n\r\n".to_string())
        .await
        .unwrap();
    assert!(junk.starts_with("HTTP/1.1 400"), "{junk}");
    server.abort();
}
