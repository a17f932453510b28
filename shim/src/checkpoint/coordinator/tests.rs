//! The coordinator's decisions, with a fake inspection and a fake capture over a real
//! store and host engine in a temporary directory (no root, no runc).

use std::{
    io::Write,
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
};

use crab_runtime_config::EngineConfig;
use tokio::sync::Semaphore;

use super::*;
use crate::inspector::{FsFinding, ProcFinding};

fn answer(seq: u64, kind: Kind, added: &[&str]) -> Answer {
    Answer {
        container_id: "c1".into(),
        seq,
        kind,
        fs: FsFinding {
            changed: !added.is_empty(),
            scanned: true,
            added: added.iter().map(PathBuf::from).collect(),
            ..Default::default()
        },
        procs: ProcFinding::default(),
        degraded: Vec::new(),
        elapsed_us: 1,
    }
}

/// Answers with an fs change at `after-exec`, numbered on from `seq`.
#[derive(Default)]
struct FakeInspect {
    seq: AtomicU64,
    /// The turn ids its answers were stored as.
    stored: Mutex<Vec<String>>,
    refreshed: AtomicUsize,
    /// Its answers say the upperdir could not be scanned.
    unobserved: AtomicBool,
}

impl Inspect for Arc<FakeInspect> {
    async fn idle_since_mark(&self) -> Vec<(u32, u64)> {
        vec![(7, 1)]
    }

    async fn refresh_after_freeze(&self, idle: Vec<(u32, u64)>) {
        assert_eq!(idle, vec![(7, 1)]);
        self.refreshed.fetch_add(1, Ordering::SeqCst);
    }

    async fn turn_end(&self, turn_id: &str) -> Result<Answer> {
        self.stored.lock().unwrap().push(turn_id.to_string());
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let mut a = answer(seq, Kind::Fs, &["after-exec"]);
        a.fs.unobserved = self.unobserved.load(Ordering::SeqCst);
        Ok(a)
    }
}

/// Captures into the real store; an fs capture waits for a permit of `release` or for its
/// job's cancel flag (then it fails as the real capture does).
struct FakeCapture {
    release: Semaphore,
    fs_calls: Mutex<Vec<FsDiff>>,
    volume_calls: Mutex<Vec<Vec<VolumeChanges>>>,
    scans: AtomicUsize,
    proc_calls: AtomicUsize,
    /// How many of the next fs captures fail.
    fail_fs: AtomicUsize,
    outside: Mutex<Vec<(u32, String)>>,
    parents: HashMap<u32, u32>,
    aborts: AtomicUsize,
    /// Whether the first abort releases the waiting capture (as killing runc would).
    abort_releases: AtomicBool,
    /// Fs captures that ended because they were cancelled.
    cancelled: AtomicUsize,
}

impl FakeCapture {
    fn new(permits: usize) -> Arc<FakeCapture> {
        Arc::new(FakeCapture {
            release: Semaphore::new(permits),
            fs_calls: Mutex::default(),
            volume_calls: Mutex::default(),
            scans: AtomicUsize::new(0),
            proc_calls: AtomicUsize::new(0),
            fail_fs: AtomicUsize::new(0),
            outside: Mutex::default(),
            parents: HashMap::from([(4243, 4242), (4242, 1)]),
            aborts: AtomicUsize::new(0),
            abort_releases: AtomicBool::new(true),
            cancelled: AtomicUsize::new(0),
        })
    }

    fn fs_calls(&self) -> usize {
        self.fs_calls.lock().unwrap().len()
    }
}

impl Capture for Arc<FakeCapture> {
    async fn outside_init(&self) -> Result<Vec<(u32, String)>> {
        Ok(self.outside.lock().unwrap().clone())
    }

    fn parent_of(&self, pid: u32) -> Option<u32> {
        self.parents.get(&pid).copied()
    }

    async fn scan_upperdir(&self) -> Result<FsDiff> {
        self.scans.fetch_add(1, Ordering::SeqCst);
        Ok(FsDiff {
            added: vec![PathBuf::from("everything")],
            ..Default::default()
        })
    }

    async fn fs_layer(
        &self,
        store: Arc<Store>,
        changes: FsDiff,
        volumes: Vec<VolumeChanges>,
        capturing: OwnedMutexGuard<()>,
        cancel: Cancel,
    ) -> Result<FsLayer> {
        self.fs_calls.lock().unwrap().push(changes.clone());
        self.volume_calls.lock().unwrap().push(volumes);
        let cancelled = async {
            while !cancel.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::select! {
            permit = self.release.acquire() => permit.unwrap().forget(),
            () = cancelled => {}
        }
        if cancel.is_cancelled() {
            self.cancelled.fetch_add(1, Ordering::SeqCst);
            return Err(super::super::layer::LayerError::Cancelled { written: 0 }.into());
        }
        if self
            .fail_fs
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(CheckpointError::NotOverlay);
        }
        let _capturing = capturing;
        let mut tmp = store.temp_file("layer")?;
        let data = format!("{:?}", changes.added);
        tmp.file().write_all(data.as_bytes()).unwrap();
        Ok(FsLayer {
            descriptor: store.put_blob(tmp.path())?,
            freeze: Duration::from_millis(1),
            capture: Duration::from_millis(1),
        })
    }

    async fn process_image(&self, dir: PathBuf, _chunks: PathBuf) -> Result<ProcessCaptured> {
        self.proc_calls.fetch_add(1, Ordering::SeqCst);
        std::fs::create_dir_all(&dir).unwrap();
        Ok(ProcessCaptured {
            pids: vec![1],
            bytes_logical: 10,
            bytes_stored: 5,
            ..Default::default()
        })
    }

    /// Killing the capture makes it return (the first time, if `abort_releases`).
    async fn abort(&self) -> Aborted {
        if self.aborts.fetch_add(1, Ordering::SeqCst) == 0
            && self.abort_releases.load(Ordering::SeqCst)
        {
            self.release.add_permits(1);
        }
        Aborted::default()
    }
}

type TestCoordinator = Coordinator<Arc<FakeInspect>, Arc<FakeCapture>>;

struct Sandbox {
    co: Arc<TestCoordinator>,
    inspect: Arc<FakeInspect>,
    capture: Arc<FakeCapture>,
    _dir: tempfile::TempDir,
}

fn settings() -> Settings {
    Settings {
        policy: policy::CheckpointPolicy::Minimal,
        volumes: Vec::new(),
        keep_last: None,
        keep_every: None,
        wait_bound: Duration::from_secs(10),
    }
}

fn sandbox(settings: Settings, capture: Arc<FakeCapture>, job_timeout: Duration) -> Sandbox {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("sandbox")).unwrap();
    let engine = Admission::new(
        &EngineConfig {
            root: dir.path().join("engine"),
            job_timeout_ms: job_timeout.as_millis() as u64,
            ..EngineConfig::default()
        },
        "ns",
        "c1",
    );
    let inspect = Arc::new(FakeInspect::default());
    let co = Coordinator::new(
        "c1",
        store,
        inspect.clone(),
        capture.clone(),
        settings,
        engine,
    );
    Sandbox {
        co,
        inspect,
        capture,
        _dir: dir,
    }
}

impl Sandbox {
    /// The published manifests as (turn ids, kind).
    fn lineage(&self) -> Vec<(String, CheckpointKind)> {
        let list = self.co.store().list().unwrap();
        list.into_iter().map(|m| (m.turn_id, m.kind)).collect()
    }

    fn latest(&self) -> Manifest {
        self.co.store().latest().unwrap().unwrap()
    }

    /// Waits (as an action would) until no job runs or is pending.
    async fn idle(&self) {
        self.co.wait_durable(Action::Start).await.unwrap();
    }
}

async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const LONG: Duration = Duration::from_secs(600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_ends_during_a_job_are_coalesced_into_the_next() {
    let now_ms = || {
        SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let s = sandbox(settings(), FakeCapture::new(0), LONG);
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    eventually("the first job captures", || s.capture.fs_calls() == 1).await;
    let t2_before = now_ms();
    s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
    let t2_after = now_ms();
    tokio::time::sleep(Duration::from_millis(20)).await;
    s.co.submit("t3", &answer(3, Kind::Proc, &[]));
    s.capture.release.add_permits(2);
    s.idle().await;
    assert_eq!(
        s.lineage(),
        vec![
            ("t1".into(), CheckpointKind::Fs),
            ("t2,t3".into(), CheckpointKind::Full)
        ]
    );
    let calls = s.capture.fs_calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1].added, vec![PathBuf::from("b")]);
    assert_eq!(s.capture.proc_calls.load(Ordering::SeqCst), 1);
    let m = s.latest();
    assert_eq!(
        m.fs_layers.len(),
        2,
        "the second layer is on top of the first"
    );
    assert_eq!(m.explanation.lines().count(), 2, "{}", m.explanation);
    // Its recovery point is as old as the first turn it covers.
    let ended = m.turn_ended_ms.expect("the turn end is recorded");
    assert!(
        (t2_before..=t2_after).contains(&ended),
        "{ended} not t2's end"
    );
    // Each job refreshed the mark of the processes its freeze woke.
    assert_eq!(s.inspect.refreshed.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_makes_the_next_one_full_on_a_new_chain() {
    let s = sandbox(settings(), FakeCapture::new(100), LONG);
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    s.idle().await;
    s.capture.fail_fs.store(1, Ordering::SeqCst);
    s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
    s.idle().await;
    let failed = s.latest();
    assert_eq!(failed.kind, CheckpointKind::Failed);
    assert_eq!(
        failed.explanation,
        "failed: the rootfs is not an overlay: no fs checkpoint possible"
    );
    assert_eq!(failed.fs_layers.len(), 1, "a failure keeps the references");
    // An unchanged turn still takes everything now, starting the fs chain again.
    s.co.submit("t3", &answer(3, Kind::None, &[]));
    s.idle().await;
    let m = s.latest();
    assert_eq!((m.turn_id.as_str(), m.kind), ("t3", CheckpointKind::Full));
    assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
    assert_eq!(m.fs_layers.len(), 1, "a new chain: {:?}", m.fs_layers);
    let calls = s.capture.fs_calls.lock().unwrap().clone();
    assert_eq!(
        calls.last().unwrap().added,
        vec![PathBuf::from("everything")]
    );
    assert!(m.process.is_some());
    // And then the minimal checkpoint again.
    s.co.submit("t4", &answer(4, Kind::None, &[]));
    s.idle().await;
    assert_eq!(s.lineage().len(), 3, "no checkpoint for an unchanged turn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unobserved_turn_takes_a_new_chain() {
    let s = sandbox(settings(), FakeCapture::new(100), LONG);
    let mut a = answer(1, Kind::Fs, &["a"]);
    a.fs.unobserved = true;
    s.co.submit("t1", &a);
    s.idle().await;
    assert_eq!(s.latest().kind, CheckpointKind::Full);
    assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
}

/// A turn end whose answer could not be recorded: its checkpoint takes everything, whatever
/// the answer says (`none` included), also when it waits behind a running job; the turns
/// after it are checkpointed by their changes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_answer_was_not_recorded_is_checkpointed_whole() {
    let s = sandbox(settings(), FakeCapture::new(0), LONG);
    s.capture.release.add_permits(3);
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    s.idle().await;
    s.co.submit_unrecorded("t2", &answer(2, Kind::None, &[]));
    s.idle().await;
    let m = s.latest();
    assert_eq!((m.turn_id.as_str(), m.kind), ("t2", CheckpointKind::Full));
    assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
    assert_eq!(m.fs_layers.len(), 1, "a new chain: {:?}", m.fs_layers);
    assert!(m.process.is_some());
    assert_eq!(s.capture.proc_calls.load(Ordering::SeqCst), 1);
    // The next turn is checkpointed by its changes.
    s.co.submit("t3", &answer(3, Kind::Fs, &["c"]));
    s.idle().await;
    let m = s.latest();
    assert_eq!((m.turn_id.as_str(), m.kind), ("t3", CheckpointKind::Fs));
    assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
    assert_eq!(m.fs_layers.len(), 2);
    // Behind a running job: the unrecorded turn's own job takes everything.
    s.co.submit("t4", &answer(4, Kind::Fs, &["d"]));
    eventually("t4's job captures", || s.capture.fs_calls() == 4).await;
    s.co.submit_unrecorded("t5", &answer(5, Kind::Fs, &["e"]));
    s.capture.release.add_permits(2);
    s.idle().await;
    assert_eq!(
        s.lineage()[3..],
        [
            ("t4".into(), CheckpointKind::Fs),
            ("t5".into(), CheckpointKind::Full)
        ]
    );
    assert_eq!(s.capture.scans.load(Ordering::SeqCst), 2);
    assert_eq!(s.latest().fs_layers.len(), 1, "a new chain");
    // Back to minimal: an unchanged turn takes no checkpoint.
    s.co.submit("t6", &answer(6, Kind::None, &[]));
    s.idle().await;
    assert_eq!(s.lineage().len(), 5);
}

/// What a job takes in while it waits for running execs (its fresh answer, turn ends that
/// arrived meanwhile) can ask for everything too: an upperdir that could not be scanned, an
/// answer that could not be recorded. The job then takes the whole upperdir on a new chain,
/// never a layer of the paths it happens to know.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_wait_for_execs_takes_in_can_make_the_job_whole() {
    for unrecorded_meanwhile in [false, true] {
        let s = sandbox(settings(), FakeCapture::new(100), LONG);
        s.co.submit("t0", &answer(1, Kind::Fs, &["a"]));
        s.idle().await;
        s.inspect.seq.store(2, Ordering::SeqCst);
        s.inspect
            .unobserved
            .store(!unrecorded_meanwhile, Ordering::SeqCst);
        *s.capture.outside.lock().unwrap() = vec![(4242, "make".into())];
        s.co.note_running_execs(vec![(4242, "e1".into())]);
        s.co.submit("t1", &answer(2, Kind::Proc, &[]));
        tokio::time::sleep(Duration::from_millis(60)).await;
        if unrecorded_meanwhile {
            s.co.submit_unrecorded("t2", &answer(3, Kind::None, &[]));
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        s.capture.outside.lock().unwrap().clear();
        s.idle().await;
        let m = s.latest();
        let want = match unrecorded_meanwhile {
            true => "t1,t2",
            false => "t1",
        };
        assert_eq!((m.turn_id.as_str(), m.kind), (want, CheckpointKind::Full));
        assert_eq!(
            s.capture.scans.load(Ordering::SeqCst),
            1,
            "the whole upperdir (unrecorded meanwhile: {unrecorded_meanwhile})"
        );
        assert_eq!(m.fs_layers.len(), 1, "a new chain: {:?}", m.fs_layers);
        assert_eq!(s.lineage().len(), 2, "{:?}", s.lineage());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_waits_at_most_the_bound() {
    let bound = Duration::from_millis(150);
    let s = sandbox(
        Settings {
            wait_bound: bound,
            ..settings()
        },
        FakeCapture::new(0),
        LONG,
    );
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    let started = Instant::now();
    let e = s.co.wait_durable(Action::Update).await.unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= bound && waited < bound * 10, "{waited:?}");
    assert!(matches!(
        &e,
        CheckpointError::NotDurable { action: Action::Update, turns, .. } if turns == &["t1"]
    ));
    let text = e.to_string();
    assert!(
        text.starts_with("update on c1 waited 150ms for the checkpoint of turn(s) [\"t1\"]")
            && text.contains("action_wait_timeout_ms"),
        "{text}"
    );
    assert!(s.co.state.lock().unwrap().waiting_actions.is_empty());
    s.capture.release.add_permits(1);
    eventually("the job ends", || !s.co.state.lock().unwrap().running).await;
    // Nothing left to wait for.
    let started = Instant::now();
    s.co.wait_durable(Action::Update).await.unwrap();
    assert!(started.elapsed() < bound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_cuts_the_wait_for_execs_short() {
    let s = sandbox(settings(), FakeCapture::new(100), LONG);
    *s.capture.outside.lock().unwrap() = vec![(4242, "sleep 100".into()), (4243, "cat".into())];
    s.co.note_running_execs(vec![(4242, "e1".into())]);
    s.co.submit("t1", &answer(1, Kind::Proc, &[]));
    tokio::time::sleep(EXEC_POLL * 3).await;
    let started = Instant::now();
    // The kill waits for the job, which gives up at once for it.
    s.co.wait_durable(Action::Kill).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let m = s.latest();
    assert_eq!(m.kind, CheckpointKind::Failed);
    assert!(
        m.explanation.starts_with(
            "failed: no process checkpoint: exec e1 (pid 4242 `sleep 100`, pid 4243 `cat`) \
                 still running when the next action (a kill) arrived"
        ),
        "{}",
        m.explanation
    );
    assert_eq!(s.capture.proc_calls.load(Ordering::SeqCst), 0);
    assert!(s.co.state.lock().unwrap().force_full);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_still_running_at_the_bound_fail_the_turn() {
    let s = sandbox(
        Settings {
            wait_bound: Duration::from_millis(100),
            ..settings()
        },
        FakeCapture::new(100),
        LONG,
    );
    *s.capture.outside.lock().unwrap() = vec![(9, "top".into())];
    s.co.submit("t1", &answer(1, Kind::Proc, &[]));
    eventually("the job fails", || !s.lineage().is_empty()).await;
    let m = s.latest();
    assert!(
        m.explanation.starts_with(
            "failed: no process checkpoint: process(es) pid 9 `top` still running 100ms after \
                 the checkpoint began waiting for it ([checkpoint] action_wait_timeout_ms)"
        ),
        "{}",
        m.explanation
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_that_end_are_waited_for_then_the_container_is_inspected_again() {
    let s = sandbox(settings(), FakeCapture::new(100), LONG);
    s.inspect.seq.store(1, Ordering::SeqCst);
    *s.capture.outside.lock().unwrap() = vec![(4242, "make".into())];
    s.co.note_running_execs(vec![(4242, "e1".into())]);
    s.co.submit("t1", &answer(1, Kind::Proc, &[]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.capture.outside.lock().unwrap().clear();
    s.idle().await;
    let m = s.latest();
    // The checkpoint is of the state after the exec: its file change joins the job.
    assert_eq!((m.turn_id.as_str(), m.kind), ("t1", CheckpointKind::Full));
    assert_eq!(*s.inspect.stored.lock().unwrap(), vec!["t1+exec-end"]);
    let calls = s.capture.fs_calls.lock().unwrap().clone();
    assert_eq!(calls[0].added, vec![PathBuf::from("after-exec")]);
    let lines: Vec<&str> = m.explanation.lines().collect();
    assert_eq!(lines.len(), 3, "{}", m.explanation);
    assert!(
        lines[1].starts_with("waited ") && lines[1].contains("for exec e1 (pid 4242 `make`)"),
        "{}",
        lines[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_deadline_is_aborted_and_fails() {
    let s = sandbox(settings(), FakeCapture::new(0), Duration::from_millis(100));
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    s.idle().await;
    let m = s.latest();
    assert_eq!(m.kind, CheckpointKind::Failed);
    assert_eq!(
        m.explanation,
        "failed: the checkpoint held its engine slot longer than 100ms ([engine] \
             job_timeout_ms) and was aborted: no process dump was running, the container's \
             freezer could not be reached (the fs capture was stopped after writing 0 bytes of \
             its layer; nothing of it is stored)"
    );
    // Once to end the job, once more for what it may have started meanwhile.
    assert_eq!(s.capture.aborts.load(Ordering::SeqCst), 2);
    assert_eq!(s.capture.cancelled.load(Ordering::SeqCst), 1);
    // The next job is not aborted.
    s.capture.release.add_permits(1);
    s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
    s.idle().await;
    assert_eq!(s.latest().kind, CheckpointKind::Full);
}

/// An fs capture that nothing the abort kills would end (the real one: a blocking thread
/// copying a big file) stops on the job's cancel flag: the job fails at its deadline, not
/// at the end of the abort grace, and the next job need not wait for the capture.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fs_capture_past_the_deadline_is_cancelled() {
    let s = sandbox(settings(), FakeCapture::new(0), Duration::from_millis(100));
    s.capture.abort_releases.store(false, Ordering::SeqCst);
    let t = Instant::now();
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    s.idle().await;
    let took = t.elapsed();
    assert!(took < ABORT_GRACE, "the job ended after {took:?}");
    let m = s.latest();
    assert_eq!(m.kind, CheckpointKind::Failed);
    assert!(
        m.explanation.contains("job_timeout_ms")
            && m.explanation.contains("the fs capture was stopped"),
        "{}",
        m.explanation
    );
    assert_eq!(s.capture.cancelled.load(Ordering::SeqCst), 1);
    // The capture ended: the next job does not wait for it, and is not cancelled.
    s.capture.release.add_permits(1);
    s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
    tokio::time::timeout(Duration::from_secs(5), s.idle())
        .await
        .expect("the next job waited for the cancelled capture");
    assert_eq!(s.latest().kind, CheckpointKind::Full);
    assert_eq!(s.capture.cancelled.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_decides_the_kind() {
    let s = sandbox(
        Settings {
            policy: policy::CheckpointPolicy::FullEveryTurn,
            ..settings()
        },
        FakeCapture::new(100),
        LONG,
    );
    s.co.submit("t1", &answer(1, Kind::None, &[]));
    s.idle().await;
    assert_eq!(s.lineage(), vec![("t1".into(), CheckpointKind::Full)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracked_volumes_are_captured_whole_then_by_their_changes() {
    let s = sandbox(
        Settings {
            volumes: vec![PathBuf::from("/workspace")],
            ..settings()
        },
        FakeCapture::new(100),
        LONG,
    );
    let vol = |paths: Option<&[&str]>| VolumeChanges {
        at: PathBuf::from("/workspace"),
        paths: paths.map(|p| p.iter().map(PathBuf::from).collect()),
    };
    // The first fs layer takes the volume whole, whatever of it changed.
    s.co.submit("t1", &answer(1, Kind::Fs, &["/workspace/a", "/app/b"]));
    s.idle().await;
    // Then only its changes, relative to its root; none when it did not change.
    s.co.submit(
        "t2",
        &answer(2, Kind::Fs, &["/workspace/d/e", "/workspace"]),
    );
    s.idle().await;
    s.co.submit("t3", &answer(3, Kind::Fs, &["/app/c"]));
    s.idle().await;
    let calls = s.capture.fs_calls.lock().unwrap().clone();
    assert_eq!(calls[0].added, vec![PathBuf::from("/app/b")]);
    assert!(calls[1].added.is_empty());
    let volumes = s.capture.volume_calls.lock().unwrap().clone();
    assert_eq!(
        volumes,
        vec![vec![vol(None)], vec![vol(Some(&["", "d/e"]))], vec![]]
    );
    let m = s.latest();
    assert_eq!(m.volumes, vec![PathBuf::from("/workspace")]);
    assert!(!m.explanation.contains("not captured"), "{}", m.explanation);
    // A failure starts a new chain: the volume is taken whole again.
    s.capture.fail_fs.store(1, Ordering::SeqCst);
    s.co.submit("t4", &answer(4, Kind::Fs, &["/workspace/x"]));
    s.idle().await;
    assert_eq!(s.latest().kind, CheckpointKind::Failed);
    s.co.submit("t5", &answer(5, Kind::Fs, &["/workspace/y"]));
    s.idle().await;
    let volumes = s.capture.volume_calls.lock().unwrap().clone();
    assert_eq!(volumes.last().unwrap(), &vec![vol(None)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_origin_makes_the_next_checkpoint_full() {
    let s = sandbox(settings(), FakeCapture::new(100), LONG);
    let (tx, rx) = std::sync::mpsc::channel();
    s.co.record_origin(
        |_| Err(CheckpointError::NotInspected),
        move || tx.send(()).unwrap(),
    );
    s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
    tokio::task::spawn_blocking(move || rx.recv().unwrap())
        .await
        .unwrap();
    s.idle().await;
    assert_eq!(s.lineage(), vec![("t1".into(), CheckpointKind::Full)]);
}

#[test]
fn bytes_written_counts_what_the_job_wrote() {
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path()).unwrap();
    let layer = |size| Descriptor {
        digest: String::new(),
        diff_id: String::new(),
        size,
        media_type: String::new(),
    };
    let mut m = Manifest::child_of(None, store.next_seq().unwrap(), "t", CheckpointKind::Fs);
    m.fs_layers = vec![layer(100), layer(7)];
    m.process = Some(ProcessImage {
        image: "proc/000001".into(),
        bytes_stored: 1,
        bytes_logical: 50,
        pids: vec![1],
    });
    assert_eq!(bytes_written(&m), 7, "the new layer only");
    m.kind = CheckpointKind::Full;
    assert_eq!(bytes_written(&m), 57);
    m.kind = CheckpointKind::Proc;
    assert_eq!(bytes_written(&m), 50);
    m.kind = CheckpointKind::Failed;
    assert_eq!(bytes_written(&m), 0);
}

#[test]
fn volumes_split_off_their_changes() {
    let d = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
    let changes = FsDiff {
        added: d(&["/w/a", "/wx/b", "/w/n/x", "/w/../etc/passwd"]),
        modified: d(&["/w"]),
        deleted: d(&["/v/c"]),
    };
    let (out, volumes) = split_volumes(changes, &d(&["/w", "/v", "/w/n"]), &d(&["/w", "/w/n"]));
    assert_eq!(
        out.added,
        d(&["/wx/b"]),
        "a prefix of a name is not a parent"
    );
    assert!(out.modified.is_empty() && out.deleted.is_empty());
    let set = |v: &[&str]| Some(v.iter().map(PathBuf::from).collect::<BTreeSet<_>>());
    assert_eq!(
        volumes,
        vec![
            // `..` is never followed: left out of every tree.
            VolumeChanges {
                at: "/w".into(),
                paths: set(&["", "a"])
            },
            // Not based yet: whole.
            VolumeChanges {
                at: "/v".into(),
                paths: None
            },
            // Nested: the longest path owns its changes.
            VolumeChanges {
                at: "/w/n".into(),
                paths: set(&["x"])
            },
        ]
    );
}
