//! The `ctr` CLI against the private containerd, with timeouts so a hung command fails the test
//! instead of hanging the suite.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Error, Result, TestEnv};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Output {
    pub command: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// The exit code; a command killed by a signal has none and reports -1.
    pub fn code(&self) -> i32 {
        self.status.code().unwrap_or(-1)
    }

    /// Fails unless the command exited 0.
    pub fn ok(self) -> Result<Self> {
        if self.status.success() {
            Ok(self)
        } else {
            Err(Error::Command {
                command: self.command.clone(),
                detail: format!(
                    "exit {}; stdout: {:?}; stderr: {:?}",
                    self.code(),
                    self.stdout,
                    self.stderr
                ),
            })
        }
    }
}

/// Builder for one `ctr` invocation.
#[derive(Debug, Clone)]
pub struct Ctr {
    env: TestEnv,
}

impl Ctr {
    /// `ctr images export PATH REFERENCE`, checked: every blob of the archive read whole and
    /// hashed to its name. `ctr images export` can exit 0 having written an archive cut short
    /// (seen on this host: a 1 MiB prefix of a 1.1 MB archive, in about 1 of 10 exports, with or
    /// without load beside it), which `docker load` then reports as "unexpected EOF"; such an
    /// export is made again, up to 5 times.
    pub fn export_image(&self, reference: &str, path: &std::path::Path) -> Result<()> {
        let mut last = String::new();
        for attempt in 1..=5 {
            self.run(&["images", "export", &path.to_string_lossy(), reference])?
                .ok()?;
            match whole_archive(path) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    eprintln!("ctr images export {reference} (attempt {attempt}): {e}");
                    last = e;
                }
            }
        }
        Err(Error::Command {
            command: format!("ctr images export {} {reference}", path.display()),
            detail: format!("never came back whole: {last}"),
        })
    }

    pub fn new(env: &TestEnv) -> Self {
        Ctr { env: env.clone() }
    }

    fn base_args(&self) -> Vec<String> {
        vec![
            "--address".into(),
            self.env.address.to_string_lossy().into_owned(),
            "--namespace".into(),
            self.env.namespace.clone(),
        ]
    }

    /// `ctr <args>` with no stdin.
    pub fn run<S: AsRef<str>>(&self, args: &[S]) -> Result<Output> {
        self.run_with(args, None, DEFAULT_TIMEOUT)
    }

    /// `ctr <args>`; `stdin` (if any) is written and then closed.
    pub fn run_with<S: AsRef<str>>(
        &self,
        args: &[S],
        stdin: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Output> {
        let mut full = self.base_args();
        full.extend(args.iter().map(|a| a.as_ref().to_string()));
        let mut cmd = Command::new("ctr");
        cmd.args(&full);
        run_command(cmd, &format!("ctr {}", full.join(" ")), stdin, timeout)
    }

    /// `ctr <args>` under a pseudo-terminal (`script`), for `-t` which needs a tty on stdin.
    /// stdin stays open (but silent) until the command exits, so ctr sees no EOF.
    pub fn run_in_pty<S: AsRef<str>>(&self, args: &[S], timeout: Duration) -> Result<Output> {
        let mut full = vec!["ctr".to_string()];
        full.extend(self.base_args());
        full.extend(args.iter().map(|a| a.as_ref().to_string()));
        let line = full
            .iter()
            .map(|a| shell_quote(a))
            .collect::<Vec<_>>()
            .join(" ");
        let mut cmd = Command::new("script");
        // -e: return the child's exit code; -f: flush; -q: no banner; log to /dev/null.
        cmd.args(["-qefc", &line, "/dev/null"]);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("spawn script", e))?;
        let stdin = child.stdin.take();
        let out = wait_child(child, &format!("script -qefc {line}"), timeout);
        drop(stdin);
        out
    }
}

pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` with a deadline; output is collected by threads so a chatty child cannot block.
pub fn run_command(
    mut cmd: Command,
    display: &str,
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> Result<Output> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io(format!("spawn {display}"), e))?;
    if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
        let data = data.to_vec();
        thread::spawn(move || {
            let _ = w.write_all(&data);
        });
    }
    wait_child(child, display, timeout)
}

fn wait_child(mut child: Child, display: &str, timeout: Duration) -> Result<Output> {
    let mut so = child.stdout.take().expect("stdout piped");
    let mut se = child.stderr.take().expect("stderr piped");
    let out_t = thread::spawn(move || {
        let mut s = Vec::new();
        let _ = so.read_to_end(&mut s);
        s
    });
    let err_t = thread::spawn(move || {
        let mut s = Vec::new();
        let _ = se.read_to_end(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Timeout {
                    what: format!("`{display}` to exit"),
                    after: timeout,
                });
            }
            Err(e) => return Err(Error::io(format!("wait {display}"), e)),
        }
    };
    let stdout = String::from_utf8_lossy(&out_t.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().unwrap_or_default()).into_owned();
    Ok(Output {
        command: display.to_string(),
        status,
        stdout,
        stderr,
    })
}

/// Whether the OCI archive at `path` is whole: readable to its end, an `index.json`, and every
/// `blobs/sha256/<hex>` entry hashing to `<hex>`.
pub fn whole_archive(path: &std::path::Path) -> std::result::Result<(), String> {
    use sha2::{Digest, Sha256};
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(file));
    let (mut index, mut blobs) = (false, 0);
    for e in archive.entries().map_err(|e| e.to_string())? {
        let mut e = e.map_err(|e| e.to_string())?;
        let name = e
            .path()
            .map_err(|e| e.to_string())?
            .to_string_lossy()
            .into_owned();
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = e.read(&mut buf).map_err(|err| format!("{name}: {err}"))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        index |= name == "index.json";
        if let Some(hex) = name.strip_prefix("blobs/sha256/").filter(|h| !h.is_empty()) {
            let got = format!("{:x}", h.finalize());
            if got != hex {
                return Err(format!("{name} hashes to {got}"));
            }
            blobs += 1;
        }
    }
    match (index, blobs) {
        (true, n) if n > 0 => Ok(()),
        _ => Err(format!("index.json: {index}, {blobs} blobs")),
    }
}
