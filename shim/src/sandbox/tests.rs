use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// Stands for the inspection: a counter that says when it is dropped.
struct Counter {
    n: u32,
    dropped: Arc<AtomicBool>,
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

async fn cell() -> (InspectionCell<Counter>, Arc<AtomicBool>) {
    let dropped = Arc::new(AtomicBool::new(false));
    let cell = InspectionCell::new("c1", NotInspected::Starting);
    let counter = Counter {
        n: 0,
        dropped: dropped.clone(),
    };
    cell.set(counter).await;
    (cell, dropped)
}

#[tokio::test]
async fn the_inspection_is_used_in_place_one_task_at_a_time() {
    let (cell, _) = cell().await;
    for want in 1..=3 {
        let n = cell.run("counting", |c| {
            c.n += 1;
            c.n
        });
        assert_eq!(n.await.unwrap(), want);
    }
    cell.run_in_background("counting slowly", |c| {
        std::thread::sleep(Duration::from_millis(50));
        c.n += 10;
    })
    .await;
    // Whoever comes next waits for the background use.
    assert_eq!(cell.run("reading", |c| c.n).await.unwrap(), 13);
}

#[tokio::test]
async fn a_panic_loses_the_inspection_and_says_so() {
    let (cell, dropped) = cell().await;
    let e = cell
        .run("answering a turn end", |_| -> u32 { panic!("boom") })
        .await
        .unwrap_err();
    assert!(matches!(e, InspectionUnavailable::Lost { .. }), "{e:?}");
    assert!(
        dropped.load(Ordering::SeqCst),
        "the lost inspection is dropped"
    );
    // Every later use says what happened, not that the container was never inspected.
    for _ in 0..2 {
        let e = cell.run("reading", |c| c.n).await.unwrap_err().to_string();
        assert_eq!(
            e,
            "container c1 is no longer inspected: its inspection panicked while answering a \
                 turn end (boom), so its turn ends cannot be answered any more"
        );
    }
    // Turning it off (the container is deleted) does not hide it.
    cell.turn_off(NotInspected::Deleted).await;
    let e = cell.run("reading", |c| c.n).await.unwrap_err();
    assert!(matches!(e, InspectionUnavailable::Lost { .. }), "{e:?}");
}

#[tokio::test]
async fn a_panic_in_the_background_is_reported_to_the_next_user() {
    let (cell, _) = cell().await;
    cell.run_in_background("taking the base mark", |_| {
        panic!("{}", String::from("no memory map"))
    })
    .await;
    cell.settled().await;
    let e = cell.run("reading", |c| c.n).await.unwrap_err().to_string();
    assert!(
        e.contains("panicked while taking the base mark (no memory map)"),
        "{e}"
    );
}

#[tokio::test]
async fn a_container_without_inspection_says_why() {
    let why = |off: NotInspected| async move {
        let cell: InspectionCell<Counter> = InspectionCell::new("c1", off);
        cell.run("reading", |c| c.n).await.unwrap_err().to_string()
    };
    assert_eq!(
        why(NotInspected::Disabled).await,
        "container c1 is not inspected (turn ends are disabled by [checkpoint] enabled = \
             false, or it is a pod's pause container)"
    );
    assert!(why(NotInspected::UntilStart).await.contains("at start"));
    assert!(why(NotInspected::Failed("no store".into()))
        .await
        .ends_with("its checkpointing could not start: no store"));
    let (cell, dropped) = cell().await;
    cell.turn_off(NotInspected::Deleted).await;
    assert!(dropped.load(Ordering::SeqCst));
    let e = cell.run("reading", |c| c.n).await.unwrap_err().to_string();
    assert_eq!(e, "container c1 is being deleted");
}

#[tokio::test]
async fn answers_are_stored_where_the_turns_dir_is() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = Sandbox::new("c1", "ns", dir.path(), false, NotInspected::Disabled);
    assert_eq!(sandbox.dir, dir.path().join("ns/c1"));
    assert_eq!(sandbox.answers.turns_dir, dir.path().join("ns/c1/turns"));
    // Not inspected: the turn end is refused and nothing is written.
    let e = sandbox.end_turn("t1", Vec::new).await.unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    assert!(!sandbox.answers.turns_dir.exists());
    assert!(!sandbox.ends_turns_at_exec_exit());
    sandbox.gate(Action::Kill).await.unwrap();
}
