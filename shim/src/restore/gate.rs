//! CRIU's restore gate: no restored process runs before the image's page files are known to
//! be the signed ones (their digests are checked while CRIU restores,
//! [`super::intake::Verification`]) and before the kernel check ([`super::kernel`]) has
//! compared what CRIU restored with the container's spec.
//!
//! CRIU runs its action scripts at each stage of a restore, also under runc (scripts from the
//! configuration file runc names, besides runc's own RPC notifications). Two stages matter:
//! - `post-restore`: every process recreated and every page put back (the restorer has read
//!   the page files in full), credentials not yet applied; a script that fails there makes
//!   CRIU kill what it restored and fail the restore. The page verdict is given here.
//! - `pre-resume`: every thread has its credentials, seccomp filters, limits, namespaces,
//!   cgroups and mounts back and sits ptrace-stopped at its `rt_sigreturn`, its own code not
//!   yet run. A failing script is only logged there, so the shim does not rely on it: on a
//!   refusal it SIGKILLs the stopped tree itself before it answers (CRIU then fails to detach
//!   from the dead tasks and fails the restore), and Start fails whatever runc says.
//!
//! So for one restore the shim writes, into the bundle:
//!
//! ```text
//! crab-restore-gate/criu.conf       the CRIU configuration runc would have used, plus `action-script`
//! crab-restore-gate/gate.sh         the script
//! crab-restore-gate/verdict         FIFO: the page verdict, read by the script at post-restore
//! crab-restore-gate/reached         made by the script when CRIU reached post-restore (its mtime: when)
//! crab-restore-gate/resume          FIFO: at pre-resume the script writes `<its pid> <init pid>`
//! crab-restore-gate/resume-verdict  FIFO: the kernel check's verdict, read by the script
//! ```
//!
//! and points the spec's `org.criu.config` annotation at `criu.conf`. The shim holds every FIFO
//! open for reading and writing, so that no open blocks and a line written before the other
//! side opens is kept; when the shim closes them without a verdict the script reads
//! end-of-file and fails. After the restore `criu.conf` keeps only what runc would have used
//! (runc records the annotation in its state, and later dumps read that file) and the rest
//! goes.

use std::{
    fs::{self, File},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    time::SystemTime,
};

use crate::bundle;

/// The gate's directory in the bundle.
pub const GATE_DIR: &str = "crab-restore-gate";
/// The annotation runc reads for the CRIU configuration file.
pub const CRIU_CONFIG_ANNOTATION: &str = "org.criu.config";
/// What runc uses without that annotation.
const RUNC_DEFAULT_CONFIG: &str = "/etc/criu/runc.conf";
/// A CRIU configuration file is small; one larger is not copied.
const CONFIG_MAX: u64 = 1 << 20;

/// The script CRIU runs (paths filled in; they hold no quote, see [`Gate::install`]).
fn script(dir: &str) -> String {
    format!(
        "#!/bin/sh\n\
         # Written by crab for one restore and removed after it. CRIU runs this at each stage\n\
         # of the restore. At post-restore it waits for the shim's verdict on the image's page\n\
         # files; at pre-resume (every thread restored and stopped, none of them run) it tells\n\
         # the shim the restored init's pid and waits while the shim compares what the kernel\n\
         # restored with the container's spec.\n\
         case \"$CRTOOLS_SCRIPT_ACTION\" in\n\
         post-restore)\n\
         \t: > '{dir}/reached'\n\
         \tIFS= read -r verdict < '{dir}/verdict' || exit 1\n\
         \t[ \"$verdict\" = ok ] ;;\n\
         pre-resume)\n\
         \techo \"$$ $CRTOOLS_INIT_PID\" > '{dir}/resume'\n\
         \tIFS= read -r verdict < '{dir}/resume-verdict' || exit 1\n\
         \t[ \"$verdict\" = ok ] ;;\n\
         *) exit 0 ;;\n\
         esac\n"
    )
}

/// The gate of one restore, installed in its bundle.
#[derive(Debug)]
pub struct Gate {
    dir: PathBuf,
    /// The page-verdict FIFO, open for reading and writing (so that neither end's open blocks).
    fifo: File,
    /// The pre-resume FIFOs: the script's line, and the kernel check's verdict.
    resume: File,
    resume_verdict: File,
    /// What runc would have given CRIU as its configuration without the gate.
    inherited: Vec<u8>,
}

/// Why a gate could not be installed (the caller then waits for the verdict first).
#[derive(Debug, thiserror::Error)]
#[error("restore gate in {}: {reason}", dir.display())]
pub struct GateError {
    dir: PathBuf,
    #[source]
    reason: GateFailure,
}

/// What went wrong with a gate ([`GateError`]).
#[derive(Debug, thiserror::Error)]
pub enum GateFailure {
    #[error("the bundle's path cannot be written into a CRIU configuration")]
    Path,
    /// The CRIU configuration runc would have used could not be read.
    #[error("{}: {source}", path.display())]
    Config {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("removing an old one: {0}")]
    Old(#[source] io::Error),
    /// Its directory, FIFOs, script or configuration could not be made, or its FIFOs opened
    /// again.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The bundle's spec could not name its configuration.
    #[error(transparent)]
    Spec(Box<crate::error::Error>),
}

/// Why CRIU's restore did not reach pre-resume ([`Resumed::NotReached`]).
#[derive(Debug, thiserror::Error)]
pub enum NotReached {
    #[error("the gate closed")]
    Closed,
    #[error(transparent)]
    Read(#[from] io::Error),
    #[error("not a pre-resume line: {0:?}")]
    Line(String),
    /// The thread that waited for it never finished.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

impl Gate {
    /// Installs the gate for a `runc restore` of the container in `bundle`, whose spec
    /// annotations are `annotations`.
    pub fn install(
        bundle: &Path,
        annotations: Option<&std::collections::HashMap<String, String>>,
    ) -> Result<Gate, GateError> {
        let dir = bundle.join(GATE_DIR);
        let fail = |reason: GateFailure| GateError {
            dir: dir.clone(),
            reason,
        };
        // The path goes into a CRIU configuration line (split at whitespace, `#` starts a
        // comment) and into single quotes in the script.
        let text = dir
            .to_str()
            .filter(|t| {
                !t.chars()
                    .any(|c| c.is_whitespace() || c.is_control() || "'\"#\\".contains(c))
            })
            .ok_or_else(|| fail(GateFailure::Path))?
            .to_string();
        let inherited = match annotations.and_then(|a| a.get(CRIU_CONFIG_ANNOTATION)) {
            Some(v) if v.is_empty() => Vec::new(),
            Some(v) => read_config(Path::new(v)).map_err(|source| {
                fail(GateFailure::Config {
                    path: v.into(),
                    source,
                })
            })?,
            None => read_config(Path::new(RUNC_DEFAULT_CONFIG)).map_err(|source| {
                fail(GateFailure::Config {
                    path: RUNC_DEFAULT_CONFIG.into(),
                    source,
                })
            })?,
        };
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(GateFailure::Old(e))),
        }
        let made = (|| -> io::Result<(File, File, File)> {
            fs::DirBuilder::new().mode(0o700).create(&dir)?;
            let fifo = |name: &str| -> io::Result<File> {
                let path = dir.join(name);
                nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
                fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(&path)
            };
            let fifos = (fifo("verdict")?, fifo("resume")?, fifo("resume-verdict")?);
            let script_path = dir.join("gate.sh");
            fs::write(&script_path, script(&text))?;
            fs::set_permissions(&script_path, fs::Permissions::from_mode(0o700))?;
            let mut conf = inherited.clone();
            conf.extend_from_slice(
                format!("\n# crab: the restore gate\naction-script {text}/gate.sh\n").as_bytes(),
            );
            fs::write(dir.join("criu.conf"), conf)?;
            Ok(fifos)
        })();
        let (fifo, resume, resume_verdict) = match made {
            Ok(f) => f,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(fail(e.into()));
            }
        };
        let conf = format!("{text}/criu.conf");
        if let Err(e) = bundle::set_annotation(bundle, CRIU_CONFIG_ANNOTATION, &conf) {
            let _ = fs::remove_dir_all(&dir);
            return Err(fail(GateFailure::Spec(Box::new(e))));
        }
        Ok(Gate {
            dir,
            fifo,
            resume,
            resume_verdict,
            inherited,
        })
    }

    /// What waits at pre-resume for the kernel check ([`Resume::wait`]), and what wakes it
    /// when the restore ended without reaching that stage ([`ResumeCancel::cancel`]).
    pub fn resume(&self) -> Result<(Resume, ResumeCancel), GateError> {
        let fail = |e: io::Error| GateError {
            dir: self.dir.clone(),
            reason: e.into(),
        };
        Ok((
            Resume {
                line: self.resume.try_clone().map_err(fail)?,
                verdict: self.resume_verdict.try_clone().map_err(fail)?,
            },
            ResumeCancel(self.resume.try_clone().map_err(fail)?),
        ))
    }

    /// A handle that gives the verdict ([`Opener::open`]), for whoever waits for it.
    pub fn opener(&self) -> Result<Opener, GateError> {
        self.fifo.try_clone().map(Opener).map_err(|e| GateError {
            dir: self.dir.clone(),
            reason: e.into(),
        })
    }

    /// When CRIU reached the gate, if it did.
    pub fn reached(&self) -> Option<SystemTime> {
        fs::metadata(self.dir.join("reached"))
            .and_then(|m| m.modified())
            .ok()
    }

    /// After the restore: the configuration keeps only what runc would have used, the script
    /// and FIFO go (a script still waiting reads end-of-file once every handle is closed).
    pub fn finish(self) {
        if let Err(e) = fs::write(self.dir.join("criu.conf"), &self.inherited) {
            log::warn!("restore gate {}: {e}", self.dir.display());
        }
        for f in ["gate.sh", "verdict", "reached", "resume", "resume-verdict"] {
            let _ = fs::remove_file(self.dir.join(f));
        }
    }
}

/// Gives a gate its verdict.
#[derive(Debug)]
pub struct Opener(File);

impl Opener {
    /// Lets the restore go on (`ok`) or makes it fail.
    pub fn open(mut self, ok: bool) -> io::Result<()> {
        self.0.write_all(if ok { b"ok\n" } else { b"refused\n" })
    }
}

/// The pre-resume stage of a gate, waited for on a thread of its own.
#[derive(Debug)]
pub struct Resume {
    line: File,
    verdict: File,
}

/// What a pre-resume wait came to.
#[derive(Debug)]
pub enum Resumed<T, E> {
    /// CRIU reached pre-resume and `check` answered (the script has the verdict).
    Checked(Result<T, E>),
    /// The restore ended before pre-resume (or the script's line was not one).
    NotReached(NotReached),
}

impl Resume {
    /// Blocks until the script's line (or a cancel), runs `check(script_pid, init_pid)` and
    /// gives its verdict. `check` must have stopped the restored processes for good before
    /// it returns an error: the script's failure is only logged by CRIU.
    pub fn wait<T, E>(mut self, check: impl FnOnce(u32, u32) -> Result<T, E>) -> Resumed<T, E> {
        use std::io::Read;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while line.len() < 64 {
            match self.line.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => break,
                Ok(1) => line.push(byte[0]),
                Ok(_) => return Resumed::NotReached(NotReached::Closed),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Resumed::NotReached(e.into()),
            }
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        let pids: Vec<u32> = text.split(' ').filter_map(|w| w.parse().ok()).collect();
        let [script, init] = pids[..] else {
            let _ = self.verdict.write_all(b"refused\n");
            return Resumed::NotReached(NotReached::Line(text));
        };
        let result = check(script, init);
        let answer: &[u8] = if result.is_ok() {
            b"ok\n"
        } else {
            b"refused\n"
        };
        if let Err(e) = self.verdict.write_all(answer) {
            log::warn!("restore gate: giving the kernel check's verdict: {e}");
        }
        Resumed::Checked(result)
    }
}

/// Wakes a [`Resume::wait`] that would otherwise wait for a stage CRIU will not reach.
#[derive(Debug)]
pub struct ResumeCancel(File);

impl ResumeCancel {
    pub fn cancel(mut self) {
        let _ = self.0.write_all(b"cancel\n");
    }
}

/// A CRIU configuration file's bytes (none if it does not exist: CRIU ignores a missing one).
fn read_config(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    if !f.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mut out = Vec::new();
    f.take(CONFIG_MAX + 1).read_to_end(&mut out)?;
    if out.len() as u64 > CONFIG_MAX {
        return Err(io::Error::other(format!("larger than {CONFIG_MAX} bytes")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::kernel::Refusal;
    use std::{collections::HashMap, process::Command};

    fn bundle() -> tempfile::TempDir {
        let b = tempfile::tempdir().unwrap();
        fs::write(
            b.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","annotations":{"a":"b"},"x-unknown":1}"#,
        )
        .unwrap();
        b
    }

    /// Runs the gate's script as CRIU would at `action`.
    fn run(gate_dir: &Path, action: &str) -> std::process::Child {
        Command::new(gate_dir.join("gate.sh"))
            .env("CRTOOLS_SCRIPT_ACTION", action)
            .spawn()
            .unwrap()
    }

    #[test]
    fn the_script_passes_other_stages_and_waits_at_post_restore_for_the_verdict() {
        let b = bundle();
        let gate = Gate::install(b.path(), None).unwrap();
        let dir = b.path().join(GATE_DIR);
        // The spec now names the configuration, the rest of it kept.
        let spec: serde_json::Value =
            serde_json::from_slice(&fs::read(b.path().join("config.json")).unwrap()).unwrap();
        let conf = dir.join("criu.conf");
        assert_eq!(
            spec["annotations"][CRIU_CONFIG_ANNOTATION],
            conf.to_str().unwrap()
        );
        assert_eq!(
            (
                spec["annotations"]["a"].as_str(),
                spec["x-unknown"].as_i64()
            ),
            (Some("b"), Some(1))
        );
        let text = fs::read_to_string(&conf).unwrap();
        assert!(
            text.contains(&format!("action-script {}/gate.sh", dir.display())),
            "{text}"
        );
        for stage in ["pre-restore", "setup-namespaces", "post-resume"] {
            assert!(run(&dir, stage).wait().unwrap().success(), "{stage}");
        }
        assert!(gate.reached().is_none());
        // At post-restore it waits until the verdict comes.
        let mut waiting = run(&dir, "post-restore");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(waiting.try_wait().unwrap().is_none(), "it waits");
        assert!(gate.reached().is_some());
        gate.opener().unwrap().open(true).unwrap();
        assert!(waiting.wait().unwrap().success());
        // A verdict given before CRIU gets there is kept for it.
        gate.opener().unwrap().open(false).unwrap();
        assert!(!run(&dir, "post-restore").wait().unwrap().success());
        // No verdict at all: the script fails once the shim lets go.
        let mut waiting = run(&dir, "post-restore");
        std::thread::sleep(std::time::Duration::from_millis(100));
        gate.finish();
        assert!(!waiting.wait().unwrap().success());
        assert!(!dir.join("gate.sh").exists() && !dir.join("verdict").exists());
        assert_eq!(
            fs::read(&conf).unwrap(),
            b"",
            "only what runc would have used"
        );
    }

    #[test]
    fn at_pre_resume_the_script_names_its_init_and_waits_for_the_kernel_check() {
        let b = bundle();
        let gate = Gate::install(b.path(), None).unwrap();
        let dir = b.path().join(GATE_DIR);
        let pre_resume = |init: &str| {
            Command::new(dir.join("gate.sh"))
                .env("CRTOOLS_SCRIPT_ACTION", "pre-resume")
                .env("CRTOOLS_INIT_PID", init)
                .spawn()
                .unwrap()
        };
        // Passed: the check saw the script's own pid and the init pid CRIU named.
        let (resume, _cancel) = gate.resume().unwrap();
        let waiter = std::thread::spawn(move || {
            resume.wait(|script, init| Ok::<_, Refusal>((script, init)))
        });
        let mut script = pre_resume("4242");
        let pid = script.id();
        assert!(script.wait().unwrap().success());
        match waiter.join().unwrap() {
            Resumed::Checked(Ok((s, 4242))) => assert_eq!(s, pid),
            other => panic!("{other:?}"),
        }
        // Refused: the script fails (CRIU logs it; the shim has killed the tree by then).
        let (resume, _cancel) = gate.resume().unwrap();
        let waiter = std::thread::spawn(move || {
            resume.wait(|_, _| Err::<(), _>(Refusal("too much".into())))
        });
        assert!(!pre_resume("7").wait().unwrap().success());
        match waiter.join().unwrap() {
            Resumed::Checked(Err(Refusal(why))) => assert_eq!(why, "too much"),
            other => panic!("{other:?}"),
        }
        // CRIU never got there: the cancel wakes the waiter, the check never runs.
        let (resume, cancel) = gate.resume().unwrap();
        let waiter = std::thread::spawn(move || {
            resume.wait(|_, _| -> Result<(), Refusal> { panic!("no check without a line") })
        });
        cancel.cancel();
        assert!(matches!(waiter.join().unwrap(), Resumed::NotReached(_)));
        gate.finish();
        assert!(!dir.join("resume").exists() && !dir.join("resume-verdict").exists());
    }

    #[test]
    fn the_configuration_runc_would_have_used_is_kept() {
        let t = tempfile::tempdir().unwrap();
        let own = t.path().join("own.conf");
        fs::write(&own, "tcp-close\n").unwrap();
        for (annotation, want) in [
            (Some(own.to_str().unwrap().to_string()), "tcp-close\n"),
            (Some(String::new()), ""),
            (
                Some(t.path().join("missing.conf").to_str().unwrap().to_string()),
                "",
            ),
        ] {
            let b = bundle();
            let a: Option<HashMap<String, String>> =
                annotation.map(|v| [(CRIU_CONFIG_ANNOTATION.to_string(), v)].into());
            let gate = Gate::install(b.path(), a.as_ref()).unwrap();
            let conf = b.path().join(GATE_DIR).join("criu.conf");
            let text = fs::read_to_string(&conf).unwrap();
            assert!(
                text.starts_with(want) && text.contains("action-script"),
                "{text}"
            );
            gate.finish();
            assert_eq!(fs::read_to_string(&conf).unwrap(), want);
        }
        // A path that would not survive a CRIU configuration line: no gate, spec untouched.
        let t = tempfile::tempdir().unwrap();
        let b = t.path().join("a bundle");
        fs::create_dir(&b).unwrap();
        fs::write(b.join("config.json"), "{}").unwrap();
        let e = Gate::install(&b, None).unwrap_err();
        assert!(e.to_string().contains("CRIU configuration"), "{e}");
        assert_eq!(fs::read(b.join("config.json")).unwrap(), b"{}");
        assert!(!b.join(GATE_DIR).exists());
    }
}
