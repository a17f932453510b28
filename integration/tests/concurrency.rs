//! Many containers at once through gRPC: all complete with their own output and exit status.

use crab_integration::{Harness, ProcessSpec};

const CONTAINERS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_containers_at_once() {
    let h = Harness::for_test().await;
    let ids: Vec<String> = (0..CONTAINERS)
        .map(|i| h.unique_id(&format!("concurrent_{i}")))
        .collect();
    let _g = h.guard(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let mut set = tokio::task::JoinSet::new();
    for (i, id) in ids.iter().cloned().enumerate() {
        let h = h.clone();
        set.spawn(async move {
            let script = format!("echo hello-{i}; echo err-{i} >&2; exit {}", i % 5);
            let out = h.run_to_exit(&id, &ProcessSpec::sh(&script)).await;
            (i, id, out)
        });
    }
    let mut failures = Vec::new();
    while let Some(joined) = set.join_next().await {
        let (i, id, out) = joined.expect("task panicked");
        match out {
            Ok(o)
                if o.exit_status == (i % 5) as u32
                    && o.stdout == format!("hello-{i}\n")
                    && o.stderr == format!("err-{i}\n") => {}
            Ok(o) => failures.push(format!("{id}: wrong result {o:?}")),
            Err(e) => failures.push(format!("{id}: {e}\n{}", h.log_excerpt(&id))),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {CONTAINERS} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    for id in &ids {
        h.assert_no_leaks(id).await;
    }
}
