//! A thin wrapper over the runc command line.
//!
//! Not the `runc` crate: crab needs `checkpoint`/`restore` (absent there) and must wait for
//! runc through the shim's reaper (see [`crate::reaper`]); go-runc's argument lists are the
//! reference for what is passed here.

use std::{
    ffi::OsString,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde::{Deserialize, Serialize};

use crate::reaper::{self, ReaperError};

/// Why a runc invocation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuncError {
    /// runc ran and failed; `message` is runc's own last error line when it wrote one. Worded
    /// as containerd's runc shim words it (`OCI runtime create failed: runc create failed:
    /// ...`), since the CRI hands it on verbatim to the kubelet (a failed start's
    /// ContainerStatus.message) and tools match on it.
    #[error("OCI runtime {command} failed: {message}")]
    Failed {
        command: &'static str,
        message: String,
    },
    /// runc could not be run, or its exit not learnt.
    #[error(transparent)]
    Run(#[from] ReaperError),
    /// runc succeeded but its output is not what it documents.
    #[error("cannot parse runc {command} output: {source}")]
    Output {
        command: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl RuncError {
    /// Whether runc failed because the process or container is no longer there (a signal to
    /// a process that already exited, a container already deleted).
    pub fn is_gone(&self) -> bool {
        matches!(self, RuncError::Failed { message, .. } if is_gone(message))
    }
}

pub type Result<T, E = RuncError> = std::result::Result<T, E>;

/// How runc is invoked for one container: persisted in the bundle so the `delete` shim
/// command (run after a shim crash) invokes runc exactly as the shim did.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Runc {
    pub binary: PathBuf,
    /// runc's state root, already including the containerd namespace.
    pub root: PathBuf,
    pub systemd_cgroup: bool,
    /// runc's JSON log, inside the bundle.
    pub log: PathBuf,
    /// `runc create/restore --no-pivot` (runc's options `NoPivotRoot`, for a rootfs on a ramdisk).
    #[serde(default)]
    pub no_pivot_root: bool,
    /// `runc create/restore --no-new-keyring` (runc's options `NoNewKeyring`).
    #[serde(default)]
    pub no_new_keyring: bool,
    /// Who owns the stdio pipes of the container's processes (runc's options `IoUid`/`IoGid`,
    /// which the CRI sets for a user-namespaced pod to the host ids of the container's user, so
    /// that it can reopen its own `/dev/stdout`); `None`: the shim's own (root).
    #[serde(default)]
    pub io_owner: Option<(u32, u32)>,
    /// Every runc this container runs is marked for the kernel's same-page merging before it
    /// execs ([`crate::sys::ksm::set_merge_any`]): so are CRIU and the container's processes,
    /// which inherit the mark (annotation [`crate::turns::MERGE_MEMORY`]).
    #[serde(default)]
    pub merge_memory: bool,
}

impl Runc {
    /// runc as crab's `config` says, with runc's own `options` (a handler registered with runc's
    /// runtime type) on top, for a container of `namespace` whose bundle is `bundle`.
    pub fn from_config(
        config: &crab_runtime_config::Config,
        runc_options: Option<&crab_runtime_config::RuncOptions>,
        namespace: &str,
        bundle: &Path,
    ) -> std::result::Result<Runc, crab_runtime_config::ConfigError> {
        Ok(Runc {
            binary: config.resolve_runc_binary()?,
            root: config.runc.root.join(namespace),
            systemd_cgroup: config.runc.systemd_cgroup,
            log: bundle.join("log.json"),
            no_pivot_root: runc_options.is_some_and(|o| o.no_pivot_root),
            no_new_keyring: runc_options.is_some_and(|o| o.no_new_keyring),
            io_owner: runc_options.and_then(|o| o.io_owner()),
            merge_memory: false,
        })
    }

    /// The flags `create` and `restore` share.
    fn create_flags(&self) -> Vec<OsString> {
        let mut args = Vec::new();
        if self.no_pivot_root {
            args.push("--no-pivot".into());
        }
        if self.no_new_keyring {
            args.push("--no-new-keyring".into());
        }
        args
    }
}

/// The stdio a container process gets from runc (runc passes its own stdio down).
pub struct ChildStdio {
    pub stdin: Stdio,
    pub stdout: Stdio,
    pub stderr: Stdio,
}

impl ChildStdio {
    pub fn null() -> Self {
        Self {
            stdin: Stdio::null(),
            stdout: Stdio::null(),
            stderr: Stdio::null(),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct State {
    pub pid: i32,
    pub status: String,
}

/// Options of `runc checkpoint` (go-runc's `CheckpointOpts` and its `LeaveRunning` action).
#[derive(Debug, Clone, Default)]
pub struct CheckpointOpts {
    pub image_path: PathBuf,
    /// Where CRIU writes its log (`dump.log`); runc's default is the image directory.
    pub work_path: Option<PathBuf>,
    pub leave_running: bool,
    pub tcp_established: bool,
    pub ext_unix_sk: bool,
    pub file_locks: bool,
    pub shell_job: bool,
    /// `soft`, `full`, `strict` or `ignore`.
    pub manage_cgroups_mode: Option<String>,
    /// Restore only: memory pages come from a `criu lazy-pages` daemon listening in the work
    /// directory (`--lazy-pages`), on first touch and in the background.
    pub lazy_pages: bool,
}

impl CheckpointOpts {
    /// The arguments `runc checkpoint` and `runc restore` share (go-runc's order).
    fn criu_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["--image-path".into(), self.image_path.clone().into()];
        if let Some(w) = &self.work_path {
            args.extend(["--work-path".into(), w.clone().into()]);
        }
        for (set, flag) in [
            (self.tcp_established, "--tcp-established"),
            (self.ext_unix_sk, "--ext-unix-sk"),
            (self.shell_job, "--shell-job"),
            (self.file_locks, "--file-locks"),
        ] {
            if set {
                args.push(flag.into());
            }
        }
        if let Some(mode) = &self.manage_cgroups_mode {
            args.extend(["--manage-cgroups-mode".into(), mode.into()]);
        }
        args
    }
}

#[derive(Deserialize)]
struct LogLine {
    level: String,
    msg: String,
}

impl Runc {
    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--root").arg(&self.root);
        cmd.arg("--log")
            .arg(&self.log)
            .arg("--log-format")
            .arg("json");
        if self.systemd_cgroup {
            cmd.arg("--systemd-cgroup");
        }
        if self.merge_memory {
            // SAFETY: set_merge_any is one prctl, async-signal-safe; a kernel that refuses it
            // leaves the processes unmarked (merging saves memory, it changes nothing they
            // see), so its error is not runc's failure.
            unsafe {
                cmd.pre_exec(|| {
                    let _ = crate::sys::ksm::set_merge_any();
                    Ok(())
                });
            }
        }
        cmd
    }

    async fn run(
        &self,
        name: &'static str,
        args: Vec<OsString>,
        stdio: Option<ChildStdio>,
    ) -> Result<Vec<u8>> {
        let mut cmd = self.command();
        cmd.arg(name).args(args);
        let capture = stdio.is_none();
        if let Some(io) = stdio {
            cmd.stdin(io.stdin).stdout(io.stdout).stderr(io.stderr);
        }
        let log_offset = std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
        let started = std::time::Instant::now();
        let out = reaper::run(cmd, capture).await?;
        log::debug!(
            "runc {name} exited {} after {:?}",
            out.code,
            started.elapsed()
        );
        if out.code == 0 {
            return Ok(out.stdout);
        }
        let message = last_error(&self.log, log_offset)
            .or_else(|| {
                let s = String::from_utf8_lossy(&out.stderr).trim().to_string();
                (!s.is_empty()).then_some(s)
            })
            .unwrap_or_else(|| format!("exit status {}", out.code));
        Err(RuncError::Failed {
            command: name,
            message,
        })
    }

    pub async fn state(&self, id: &str) -> Result<State> {
        let out = self.run("state", vec![id.into()], None).await?;
        serde_json::from_slice(&out).map_err(|source| RuncError::Output {
            command: "state",
            source,
        })
    }
}

/// What the task core asks of an OCI runtime for one container: runc's verbs as the core
/// uses them (their argument lists are go-runc's). [`Runc`] is the one the shim runs; the core's unit tests put a fake in its place
/// (`containers::fake`), so the order of the calls and what each failure leads to are
/// checked without root.
#[async_trait::async_trait]
pub trait OciRuntime: Send + Sync {
    /// `runc create`: container `id` from `bundle`, its init's pid written to `pid_file`.
    async fn create(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        console_socket: Option<&Path>,
        stdio: ChildStdio,
    ) -> Result<()>;
    async fn start(&self, id: &str) -> Result<()>;
    /// `runc exec --detach` of the process `process_file` describes.
    async fn exec(
        &self,
        id: &str,
        process_file: &Path,
        pid_file: &Path,
        console_socket: Option<&Path>,
        stdio: ChildStdio,
    ) -> Result<()>;
    /// A process already gone is [`RuncError::is_gone`].
    async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()>;
    /// A container runc does not know is deleted already (not an error).
    async fn delete(&self, id: &str, force: bool) -> Result<()>;
    async fn pause(&self, id: &str) -> Result<()>;
    async fn resume(&self, id: &str) -> Result<()>;
    async fn ps(&self, id: &str) -> Result<Vec<i32>>;
    async fn update(&self, id: &str, resources_file: &Path) -> Result<()>;
    async fn checkpoint(&self, id: &str, opts: &CheckpointOpts) -> Result<()>;
    /// `runc restore --detach` of `opts.image_path` into container `id`.
    async fn restore(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        opts: &CheckpointOpts,
        console_socket: Option<&Path>,
        stdio: ChildStdio,
    ) -> Result<()>;
    /// What a restore of `id` that did not end normally left behind, cleared; returns the
    /// mounts detached (runc's `criu-root`: see the implementation for [`Runc`]).
    fn clear_restore_leftovers(&self, id: &str) -> usize;
}

#[async_trait::async_trait]
impl OciRuntime for Runc {
    async fn create(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        console_socket: Option<&Path>,
        stdio: ChildStdio,
    ) -> Result<()> {
        let mut args: Vec<OsString> = vec![
            "--bundle".into(),
            bundle.into(),
            "--pid-file".into(),
            pid_file.into(),
        ];
        args.extend(self.create_flags());
        if let Some(s) = console_socket {
            args.extend(["--console-socket".into(), s.into()]);
        }
        args.push(id.into());
        self.run("create", args, Some(stdio)).await.map(drop)
    }

    async fn start(&self, id: &str) -> Result<()> {
        self.run("start", vec![id.into()], None).await.map(drop)
    }

    async fn exec(
        &self,
        id: &str,
        process_file: &Path,
        pid_file: &Path,
        console_socket: Option<&Path>,
        stdio: ChildStdio,
    ) -> Result<()> {
        let mut args: Vec<OsString> = vec![
            "--process".into(),
            process_file.into(),
            "--pid-file".into(),
            pid_file.into(),
            "--detach".into(),
        ];
        if let Some(s) = console_socket {
            args.extend(["--console-socket".into(), s.into()]);
        }
        args.push(id.into());
        self.run("exec", args, Some(stdio)).await.map(drop)
    }

    /// `runc kill`; a process already gone is [`RuncError::is_gone`].
    async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        let mut args: Vec<OsString> = Vec::new();
        if all {
            args.push("--all".into());
        }
        args.extend([id.into(), signal.to_string().into()]);
        self.run("kill", args, None).await.map(drop)
    }

    async fn delete(&self, id: &str, force: bool) -> Result<()> {
        let mut args: Vec<OsString> = Vec::new();
        if force {
            args.push("--force".into());
        }
        args.push(id.into());
        match self.run("delete", args, None).await {
            Err(RuncError::Failed { message, .. }) if message.contains("does not exist") => Ok(()),
            other => other.map(drop),
        }
    }

    async fn pause(&self, id: &str) -> Result<()> {
        self.run("pause", vec![id.into()], None).await.map(drop)
    }

    async fn resume(&self, id: &str) -> Result<()> {
        self.run("resume", vec![id.into()], None).await.map(drop)
    }

    async fn ps(&self, id: &str) -> Result<Vec<i32>> {
        let out = self
            .run(
                "ps",
                vec!["--format".into(), "json".into(), id.into()],
                None,
            )
            .await?;
        serde_json::from_slice::<Option<Vec<i32>>>(&out)
            .map(Option::unwrap_or_default)
            .map_err(|source| RuncError::Output {
                command: "ps",
                source,
            })
    }

    async fn update(&self, id: &str, resources_file: &Path) -> Result<()> {
        self.run(
            "update",
            vec!["--resources".into(), resources_file.into(), id.into()],
            None,
        )
        .await
        .map(drop)
    }

    /// `runc checkpoint`: dumps the container's init and its descendants with CRIU.
    async fn checkpoint(&self, id: &str, opts: &CheckpointOpts) -> Result<()> {
        let mut args = opts.criu_args();
        if opts.leave_running {
            args.push("--leave-running".into());
        }
        args.push(id.into());
        self.run("checkpoint", args, None).await.map(drop)
    }

    /// `runc restore --detach`: creates container `id` from `bundle` with its processes restored
    /// by CRIU from `opts.image_path` (go-runc's argument list); `stdio` becomes the restored
    /// init's standard streams where the image recorded pipes or a terminal there.
    async fn restore(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        opts: &CheckpointOpts,
        console_socket: Option<&Path>,
        stdio: ChildStdio,
    ) -> Result<()> {
        let mut args = opts.criu_args();
        args.extend([
            "--detach".into(),
            "--pid-file".into(),
            pid_file.into(),
            "--bundle".into(),
            bundle.into(),
        ]);
        if opts.lazy_pages {
            args.push("--lazy-pages".into());
        }
        args.extend(self.create_flags());
        // A container with a terminal: CRIU recreates the pty pair, and runc hands the new
        // master to the socket, as at create.
        if let Some(s) = console_socket {
            args.extend(["--console-socket".into(), s.into()]);
        }
        args.push(id.into());
        self.run("restore", args, Some(stdio)).await.map(drop)
    }

    /// Clears what a `runc restore` of container `id` that did not end normally left in its
    /// state directory: runc bind-mounts the rootfs at `<root>/<id>/criu-root` for CRIU and
    /// unmounts it when it returns, so a runc or CRIU killed mid-restore (or a CRIU that stacked
    /// a mount of its own there) leaves it mounted. Every mount there is detached first (a
    /// `runc delete` that removes the state directory through it would remove the container's
    /// files), then the directory, and the state directory when runc never wrote a state into
    /// it (nothing is removed that is not empty). Returns the mounts detached. Run before a
    /// restore (a leftover `criu-root` fails runc's `mkdir`) and after a failed one.
    fn clear_restore_leftovers(&self, id: &str) -> usize {
        let state = self.root.join(id);
        let criu_root = state.join("criu-root");
        // One stat on every restore; the mount table is read only when there is a leftover.
        if std::fs::symlink_metadata(&criu_root).is_err() {
            return 0;
        }
        let detached = crate::sys::mountinfo::detach_all_under(&criu_root);
        match std::fs::remove_dir(&criu_root) {
            Ok(()) => {
                // Only runc's own directory for the container: empty unless it holds a state.
                let _ = std::fs::remove_dir(&state);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("cannot remove runc's leftover {}: {e}", criu_root.display()),
        }
        detached
    }
}

fn is_gone(message: &str) -> bool {
    [
        "not running",
        "process already finished",
        "does not exist",
        "container not found",
    ]
    .iter()
    .any(|m| message.contains(m))
}

/// The last `error`-level message runc appended to its JSON log after `offset`.
fn last_error(log: &Path, offset: u64) -> Option<String> {
    let data = std::fs::read(log).ok()?;
    let tail = data.get(offset as usize..)?;
    String::from_utf8_lossy(tail)
        .lines()
        .filter_map(|l| serde_json::from_str::<LogLine>(l).ok())
        .filter(|l| l.level == "error")
        .map(|l| l.msg.trim().to_string())
        .next_back()
}

#[cfg(test)]
mod tests {
    #[test]
    fn checkpoint_and_restore_share_criu_arguments() {
        let opts = CheckpointOpts {
            image_path: "/img".into(),
            work_path: Some("/work".into()),
            tcp_established: true,
            file_locks: true,
            manage_cgroups_mode: Some("soft".into()),
            ..Default::default()
        };
        let args: Vec<String> = opts
            .criu_args()
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--image-path",
                "/img",
                "--work-path",
                "/work",
                "--tcp-established",
                "--file-locks",
                "--manage-cgroups-mode",
                "soft"
            ]
        );
    }

    use super::*;

    #[test]
    fn last_error_reads_only_new_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.json");
        std::fs::write(&log, "{\"level\":\"error\",\"msg\":\"old\"}\n").unwrap();
        let offset = std::fs::metadata(&log).unwrap().len();
        assert_eq!(last_error(&log, offset), None);
        let mut data = std::fs::read(&log).unwrap();
        data.extend_from_slice(b"{\"level\":\"warning\",\"msg\":\"w\"}\n{\"level\":\"error\",\"msg\":\"exec: \\\"nope\\\": not found \"}\nnot json\n");
        std::fs::write(&log, data).unwrap();
        assert_eq!(
            last_error(&log, offset).as_deref(),
            Some("exec: \"nope\": not found")
        );
        assert_eq!(last_error(&dir.path().join("missing"), 0), None);
    }
}
