//! A fake OCI runtime for the task core's unit tests: it records each call as a line
//! (`create c1`, `kill c1 9 --all`, `exec c1 sh -c true`), fails a verb with runc's own
//! words when told to, and writes the pid files runc would. Its pids are above any kernel's
//! `pid_max` (2^22), so a signal the core sends one directly finds no process. Its restore
//! plays CRIU's part of the restore gate: it runs the action script the spec's CRIU
//! configuration names at post-restore and pre-resume, as CRIU would.
//!
//! And a fake host ([`FakeHost`]), whose kernel check of restored processes passes, refuses
//! or cannot read them as told, and which records what the core asks of it for a restore.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc, Mutex,
    },
};

use crate::{
    checkpoint::{
        criu_image::{ns, testing::write_image, Creds},
        process::ProcError,
    },
    restore::{gate::CRIU_CONFIG_ANNOTATION, kernel},
    runc::{CheckpointOpts, ChildStdio, OciRuntime, Result, Runc, RuncError},
};
use oci_spec::runtime::Spec;

use super::{Host, RuntimeFactory};

/// The namespaces a test image's tasks share with CRIU (the host's): all but the pid and
/// mount namespaces, which the test spec makes.
pub(super) const HOST_NAMESPACES: u32 = ns::NET | ns::IPC | ns::UTS | ns::USER | ns::TIME;

/// The first pid the fake hands out.
pub(super) const FIRST_PID: u32 = 1 << 30;

#[derive(Default)]
pub(super) struct FakeRuntime {
    calls: Mutex<Vec<String>>,
    /// Verb -> the message runc's failure carries, for every call of that verb until cleared.
    failures: Mutex<HashMap<&'static str, String>>,
    /// What `ps` answers.
    pids: Mutex<Vec<i32>>,
    next_pid: AtomicU32,
    /// The settings each container's runtime was made from, in order.
    made_from: Mutex<Vec<Runc>>,
    /// Its CRIU runs no action script (as one configured without the gate's would).
    no_action_scripts: std::sync::atomic::AtomicBool,
}

impl FakeRuntime {
    pub fn new() -> Arc<Self> {
        let f = Self::default();
        f.next_pid.store(FIRST_PID, Ordering::SeqCst);
        Arc::new(f)
    }

    /// A factory handing out this fake for every container (and noting what it was made from).
    pub fn factory(self: &Arc<Self>) -> RuntimeFactory {
        let me = self.clone();
        Arc::new(move |r: &Runc| {
            me.made_from.lock().unwrap().push(r.clone());
            me.clone() as Arc<dyn OciRuntime>
        })
    }

    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    pub fn made_from(&self) -> Vec<Runc> {
        self.made_from.lock().unwrap().clone()
    }

    /// Every later call of `verb` fails with runc's `message`.
    pub fn fail(&self, verb: &'static str, message: &str) {
        self.failures.lock().unwrap().insert(verb, message.into());
    }

    pub fn succeed(&self, verb: &'static str) {
        self.failures.lock().unwrap().remove(verb);
    }

    /// Later restores run no action script: CRIU resumes what it restored unchecked.
    pub fn ignore_action_scripts(&self) {
        self.no_action_scripts.store(true, Ordering::SeqCst);
    }

    pub fn answer_ps(&self, pids: &[i32]) {
        *self.pids.lock().unwrap() = pids.to_vec();
    }

    fn record(&self, verb: &'static str, line: String) -> Result<()> {
        self.calls.lock().unwrap().push(line);
        match self.failures.lock().unwrap().get(verb) {
            Some(message) => Err(RuncError::Failed {
                command: verb,
                message: message.clone(),
            }),
            None => Ok(()),
        }
    }

    fn write_pid(&self, pid_file: &Path) -> Result<()> {
        self.write_pid_of(pid_file, self.next_pid.fetch_add(1, Ordering::SeqCst))
    }

    fn write_pid_of(&self, pid_file: &Path, pid: u32) -> Result<()> {
        std::fs::write(pid_file, pid.to_string()).map_err(|e| RuncError::Failed {
            command: "pid file",
            message: e.to_string(),
        })
    }
}

fn flag(on: bool, name: &str) -> String {
    match on {
        true => format!(" {name}"),
        false => String::new(),
    }
}

#[async_trait::async_trait]
impl OciRuntime for FakeRuntime {
    async fn create(
        &self,
        id: &str,
        _bundle: &Path,
        pid_file: &Path,
        console_socket: Option<&Path>,
        _stdio: ChildStdio,
    ) -> Result<()> {
        self.record(
            "create",
            format!("create {id}{}", flag(console_socket.is_some(), "--console")),
        )?;
        self.write_pid(pid_file)
    }

    async fn start(&self, id: &str) -> Result<()> {
        self.record("start", format!("start {id}"))
    }

    async fn exec(
        &self,
        id: &str,
        process_file: &Path,
        pid_file: &Path,
        _console_socket: Option<&Path>,
        _stdio: ChildStdio,
    ) -> Result<()> {
        // What the core wrote for runc to read: the exec's process spec.
        let args = std::fs::read(process_file)
            .ok()
            .and_then(|b| serde_json::from_slice::<oci_spec::runtime::Process>(&b).ok())
            .and_then(|p| p.args().clone())
            .map(|a| a.join(" "))
            .unwrap_or_else(|| "<no process file>".into());
        self.record("exec", format!("exec {id} {args}"))?;
        self.write_pid(pid_file)
    }

    async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        self.record("kill", format!("kill {id} {signal}{}", flag(all, "--all")))
    }

    async fn delete(&self, id: &str, force: bool) -> Result<()> {
        self.record("delete", format!("delete {id}{}", flag(force, "--force")))
    }

    async fn pause(&self, id: &str) -> Result<()> {
        self.record("pause", format!("pause {id}"))
    }

    async fn resume(&self, id: &str) -> Result<()> {
        self.record("resume", format!("resume {id}"))
    }

    async fn ps(&self, id: &str) -> Result<Vec<i32>> {
        self.record("ps", format!("ps {id}"))?;
        Ok(self.pids.lock().unwrap().clone())
    }

    async fn update(&self, id: &str, resources_file: &Path) -> Result<()> {
        let resources = std::fs::read_to_string(resources_file).unwrap_or_default();
        self.record("update", format!("update {id} {resources}"))
    }

    /// As runc: CRIU's log in the work directory whatever happens, then (unless told to fail)
    /// an image of one task, a shell with no privilege, in the image directory.
    async fn checkpoint(&self, id: &str, opts: &CheckpointOpts) -> Result<()> {
        if let Some(work) = &opts.work_path {
            std::fs::create_dir_all(work).unwrap();
            std::fs::write(work.join("dump.log"), "dumping\n").unwrap();
        }
        self.record(
            "checkpoint",
            format!(
                "checkpoint {id} {}{}",
                opts.image_path.display(),
                flag(opts.leave_running, "--leave-running")
            ),
        )?;
        write_image(
            &opts.image_path,
            &[(1, &[])],
            &Creds::default(),
            HOST_NAMESPACES,
        );
        Ok(())
    }

    /// As runc over CRIU: CRIU's log in the work directory whatever happens; then (unless
    /// told to fail) the gate's action script run at post-restore and at pre-resume with the
    /// restored init's pid, the restore failing where the script fails (as it does once the
    /// shim killed the tree it refused); the pid file last.
    async fn restore(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        opts: &CheckpointOpts,
        _console_socket: Option<&Path>,
        _stdio: ChildStdio,
    ) -> Result<()> {
        let log = opts.work_path.as_ref().map(|w| {
            std::fs::create_dir_all(w).unwrap();
            let log = w.join("restore.log");
            std::fs::write(&log, "(00.000001) restoring\n").unwrap();
            log
        });
        let failed = |message: String| {
            if let Some(log) = &log {
                let line = format!("(00.000002) Error (criu/cr-restore.c:2397): {message}\n");
                let mut text = std::fs::read_to_string(log).unwrap_or_default();
                text.push_str(&line);
                std::fs::write(log, text).unwrap();
            }
            RuncError::Failed {
                command: "restore",
                message,
            }
        };
        let line = format!("restore {id} {}", opts.image_path.display());
        if let Err(RuncError::Failed { message, .. }) = self.record("restore", line) {
            return Err(failed(message));
        }
        let pid = self.next_pid.fetch_add(1, Ordering::SeqCst);
        let script = gate_script(bundle).filter(|_| !self.no_action_scripts.load(Ordering::SeqCst));
        for stage in script
            .iter()
            .flat_map(|s| [(s, "post-restore"), (s, "pre-resume")])
        {
            let passed = run_action_script(stage.0, stage.1, pid).await;
            let verdict = if passed { "ok" } else { "failed" };
            self.calls
                .lock()
                .unwrap()
                .push(format!("criu {} {verdict}", stage.1));
            if !passed {
                return Err(failed(format!(
                    "criu failed: type RESTORE errno 0 (action script failed at {})",
                    stage.1
                )));
            }
        }
        self.write_pid_of(pid_file, pid)
    }

    fn clear_restore_leftovers(&self, id: &str) -> usize {
        let _ = self.record("clear", format!("clear {id}"));
        0
    }
}

/// The action script the CRIU configuration of the spec in `bundle` names (runc's
/// `org.criu.config` annotation), if any.
fn gate_script(bundle: &Path) -> Option<PathBuf> {
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).ok()?).ok()?;
    let conf = spec["annotations"][CRIU_CONFIG_ANNOTATION].as_str()?;
    std::fs::read_to_string(conf)
        .ok()?
        .lines()
        .find_map(|l| l.trim().strip_prefix("action-script "))
        .map(|p| PathBuf::from(p.trim()))
}

/// Runs CRIU's action script `script` at `stage` of a restore whose init is `init`, as CRIU
/// does (its environment); whether it succeeded (one that hangs is killed after a while).
async fn run_action_script(script: &Path, stage: &'static str, init: u32) -> bool {
    let mut child = match std::process::Command::new(script)
        .env("CRTOOLS_SCRIPT_ACTION", stage)
        .env("CRTOOLS_INIT_PID", init.to_string())
        .spawn()
    {
        Ok(child) => child,
        Err(_) => return false,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    tokio::task::spawn_blocking(move || loop {
        match child.try_wait() {
            Ok(Some(status)) => return status.success(),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(2))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    })
    .await
    .unwrap_or(false)
}

/// What the fake host's kernel check says of restored processes.
#[derive(Clone)]
pub(super) enum KernelCheck {
    Passes,
    /// They have more than the spec grants (the refusal's words).
    Refuses(String),
    /// They cannot be read (the error's words).
    Fails(String),
}

/// A host whose containers all sit in one cgroup2 directory (or none), whose dumps hold
/// every live process unless told which ones a dump would leave out, and whose kernel check
/// answers as told. It records the restore's requests (`check-restored PID`, `kill-cgroup
/// ID`, `loopback PID`).
pub(super) struct FakeHost {
    cgroup: Mutex<Option<PathBuf>>,
    outside: Mutex<Vec<u32>>,
    kernel_check: Mutex<KernelCheck>,
    calls: Mutex<Vec<String>>,
}

impl FakeHost {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            cgroup: Mutex::new(Some(PathBuf::from("/sys/fs/cgroup/unit"))),
            outside: Mutex::new(Vec::new()),
            kernel_check: Mutex::new(KernelCheck::Passes),
            calls: Mutex::new(Vec::new()),
        })
    }

    /// What the kernel check says of later restores.
    pub fn kernel_check(&self, answer: KernelCheck) {
        *self.kernel_check.lock().unwrap() = answer;
    }

    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, line: String) {
        self.calls.lock().unwrap().push(line);
    }

    /// Containers' inits have no cgroup2 directory (a cgroup v1 host).
    pub fn without_cgroup2(&self) {
        *self.cgroup.lock().unwrap() = None;
    }

    /// Live processes `pids` of every container do not descend from its init.
    pub fn leave_out(&self, pids: &[u32]) {
        *self.outside.lock().unwrap() = pids.to_vec();
    }
}

impl Host for FakeHost {
    fn cgroup2_of(&self, _pid: u32) -> crate::error::Result<Option<PathBuf>> {
        Ok(self.cgroup.lock().unwrap().clone())
    }

    fn check_dumpable(&self, init: u32, _cgroup: &Path) -> std::result::Result<(), ProcError> {
        let pids = self.outside.lock().unwrap().clone();
        if pids.is_empty() {
            return Ok(());
        }
        Err(ProcError::Undumpable {
            init,
            cmdlines: vec!["sleep 1000".into(); pids.len()],
            pids,
        })
    }

    fn preload_kernel_check(&self) {}

    fn check_restored(
        &self,
        _expected: &kernel::Expected,
        _script: u32,
        init: u32,
    ) -> std::result::Result<kernel::Passed, kernel::CheckError> {
        self.record(format!("check-restored {init}"));
        match self.kernel_check.lock().unwrap().clone() {
            KernelCheck::Passes => Ok(kernel::Passed {
                processes: 1,
                threads: 1,
                mounts: 0,
                seccomp_matched: 0,
                took: std::time::Duration::ZERO,
            }),
            KernelCheck::Refuses(why) => Err(kernel::Refusal(why).into()),
            KernelCheck::Fails(why) => Err(kernel::CheckError::Restored(kernel::ReadError::Proc {
                path: format!("/proc/{init}/status"),
                source: std::io::Error::other(why),
            })),
        }
    }

    fn kill_cgroup_members(&self, _spec: &Spec, id: &str) -> usize {
        self.record(format!("kill-cgroup {id}"));
        1
    }

    fn bring_up_loopback(&self, pid: u32) -> std::io::Result<()> {
        self.record(format!("loopback {pid}"));
        Ok(())
    }

    fn share_criu_cache(&self) {
        self.record("criu cache".to_string());
    }
}
