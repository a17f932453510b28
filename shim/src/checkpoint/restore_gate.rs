//! CRIU's post-restore gate: no restored process runs before the image's page files are known
//! to be the signed ones, although their digests are checked while CRIU restores
//! ([`super::restore::Verification`]).
//!
//! CRIU runs its action scripts at each stage of a restore, also under runc (scripts from the
//! configuration file runc names, besides runc's own RPC notifications). At `post-restore`
//! CRIU has recreated every process and put every page back (the restorer has read the page
//! files in full), and no restored process has run an instruction of its own yet; a script that
//! fails there makes CRIU kill what it restored and fail the restore. (`pre-resume` comes later
//! but its failure is only logged.) So for one restore the shim writes, into the bundle:
//!
//! ```text
//! crab-restore-gate/criu.conf   the CRIU configuration runc would have used, plus `action-script`
//! crab-restore-gate/gate.sh     the script: at post-restore, waits for a line on `verdict`
//! crab-restore-gate/verdict     a FIFO the shim holds open for reading and writing
//! crab-restore-gate/reached     made by the script when CRIU reached the gate (its mtime: when)
//! ```
//!
//! and points the spec's `org.criu.config` annotation at `criu.conf`. The shim writes `ok` or
//! `refused` into the FIFO once the verdict is there (before or after the script opened it:
//! the pipe keeps the line); while the shim holds the FIFO the script's open never blocks, and
//! when the shim closes it without a verdict the script reads end-of-file and fails. After the
//! restore `criu.conf` keeps only what runc would have used (runc records the annotation in its
//! state, and later dumps read that file) and the rest goes.

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
         # of the restore; at post-restore (every process and page put back, none of them run\n\
         # yet) it waits for the shim's verdict on the image's page files, whose digests are\n\
         # checked meanwhile, and fails the restore unless they are the signed ones.\n\
         [ \"$CRTOOLS_SCRIPT_ACTION\" = post-restore ] || exit 0\n\
         : > '{dir}/reached'\n\
         IFS= read -r verdict < '{dir}/verdict' || exit 1\n\
         [ \"$verdict\" = ok ]\n"
    )
}

/// The gate of one restore, installed in its bundle.
#[derive(Debug)]
pub struct Gate {
    dir: PathBuf,
    /// The FIFO, open for reading and writing (so that neither end's open blocks).
    fifo: File,
    /// What runc would have given CRIU as its configuration without the gate.
    inherited: Vec<u8>,
}

/// Why a gate could not be installed (the caller then waits for the verdict first).
#[derive(Debug, thiserror::Error)]
#[error("restore gate in {dir}: {reason}")]
pub struct GateError {
    dir: PathBuf,
    reason: String,
}

impl Gate {
    /// Installs the gate for a `runc restore` of the container in `bundle`, whose spec
    /// annotations are `annotations`.
    pub fn install(
        bundle: &Path,
        annotations: Option<&std::collections::HashMap<String, String>>,
    ) -> Result<Gate, GateError> {
        let dir = bundle.join(GATE_DIR);
        let fail = |reason: String| GateError {
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
            .ok_or_else(|| {
                fail("the bundle's path cannot be written into a CRIU configuration".into())
            })?
            .to_string();
        let inherited = match annotations.and_then(|a| a.get(CRIU_CONFIG_ANNOTATION)) {
            Some(v) if v.is_empty() => Vec::new(),
            Some(v) => read_config(Path::new(v)).map_err(|e| fail(format!("{v}: {e}")))?,
            None => read_config(Path::new(RUNC_DEFAULT_CONFIG))
                .map_err(|e| fail(format!("{RUNC_DEFAULT_CONFIG}: {e}")))?,
        };
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(format!("removing an old one: {e}"))),
        }
        let made = (|| -> io::Result<File> {
            fs::DirBuilder::new().mode(0o700).create(&dir)?;
            let fifo_path = dir.join("verdict");
            nix::unistd::mkfifo(&fifo_path, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
            let fifo = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&fifo_path)?;
            let script_path = dir.join("gate.sh");
            fs::write(&script_path, script(&text))?;
            fs::set_permissions(&script_path, fs::Permissions::from_mode(0o700))?;
            let mut conf = inherited.clone();
            conf.extend_from_slice(
                format!("\n# crab: the restore gate\naction-script {text}/gate.sh\n").as_bytes(),
            );
            fs::write(dir.join("criu.conf"), conf)?;
            Ok(fifo)
        })();
        let fifo = match made {
            Ok(f) => f,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(fail(e.to_string()));
            }
        };
        let conf = format!("{text}/criu.conf");
        if let Err(e) = bundle::set_annotation(bundle, CRIU_CONFIG_ANNOTATION, &conf) {
            let _ = fs::remove_dir_all(&dir);
            return Err(fail(e.to_string()));
        }
        Ok(Gate {
            dir,
            fifo,
            inherited,
        })
    }

    /// A handle that gives the verdict ([`Opener::open`]), for whoever waits for it.
    pub fn opener(&self) -> Result<Opener, GateError> {
        self.fifo.try_clone().map(Opener).map_err(|e| GateError {
            dir: self.dir.clone(),
            reason: e.to_string(),
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
        for f in ["gate.sh", "verdict", "reached"] {
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
        for stage in [
            "pre-restore",
            "setup-namespaces",
            "pre-resume",
            "post-resume",
        ] {
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
