//! A fake OCI runtime for the task core's unit tests: it records each call as a line
//! (`create c1`, `kill c1 9 --all`, `exec c1 sh -c true`), fails a verb with runc's own
//! words when told to, and writes the pid files runc would. Its pids are above any kernel's
//! `pid_max` (2^22), so a signal the core sends one directly finds no process.

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
    runc::{CheckpointOpts, ChildStdio, OciRuntime, Result, Runc, RuncError},
};

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
        let pid = self.next_pid.fetch_add(1, Ordering::SeqCst);
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

    async fn restore(
        &self,
        id: &str,
        _bundle: &Path,
        pid_file: &Path,
        opts: &CheckpointOpts,
        _console_socket: Option<&Path>,
        _stdio: ChildStdio,
    ) -> Result<()> {
        self.record(
            "restore",
            format!("restore {id} {}", opts.image_path.display()),
        )?;
        self.write_pid(pid_file)
    }

    fn clear_restore_leftovers(&self, id: &str) -> usize {
        let _ = self.record("clear", format!("clear {id}"));
        0
    }
}

/// A host whose containers all sit in one cgroup2 directory (or none) and whose dumps hold
/// every live process unless told which ones a dump would leave out.
pub(super) struct FakeHost {
    cgroup: Mutex<Option<PathBuf>>,
    outside: Mutex<Vec<u32>>,
}

impl FakeHost {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            cgroup: Mutex::new(Some(PathBuf::from("/sys/fs/cgroup/unit"))),
            outside: Mutex::new(Vec::new()),
        })
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
}
