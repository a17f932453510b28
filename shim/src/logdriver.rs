//! `binary://` log drivers: a logging binary that the shim starts for a process and that reads
//! the process's stdout and stderr (what `nerdctl run -d` and containerd's `cio.BinaryIO` ask
//! for).
//!
//! The contract is that of containerd's Go runc shim (`NewBinaryIO`, `NewBinaryCmd`):
//! - `binary:///path/to/logger?key=value&other=x` runs `/path/to/logger key value other x`:
//!   every query key followed by its (first) value. Go takes the keys in map order, so loggers
//!   cannot depend on the order; crab keeps the URI's.
//! - The logger's environment is only `CONTAINER_ID` (the container id for the init, the exec
//!   id for an exec) and `CONTAINER_NAMESPACE`; its stdin, stdout and stderr are /dev/null.
//! - fd 3 is the read end of the stdout pipe, fd 4 that of the stderr pipe and fd 5 the write
//!   end of a "ready" pipe, which the logger closes (or writes a byte to) once it is ready. The
//!   process is created only after that; unlike Go, which waits forever, crab gives up after
//!   [`READY_TIMEOUT`] and kills the logger.
//! - The stdout URI decides: stderr goes to the same logger whatever its own URI says. With a
//!   terminal the console goes to fd 3 and fd 4 is at EOF from the start.
//!
//! In Go the process writes into the logger's pipes directly. crab copies the output through
//! the shim like any other target (see [`crate::stdio`]): its exit event then comes after the
//! output reached the logger, as for FIFOs and files. The logger sees EOF once the process's
//! output ends or the process is deleted, and is expected to exit then. It is a child of the
//! shim, reaped by the shim's reaper like every child, never waited for here; one still alive
//! [`EXIT_GRACE`] after its pipes closed is killed (containerd: SIGTERM at once, SIGKILL 12 s
//! later).

use std::{
    io,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    os::unix::process::CommandExt,
    path::PathBuf,
    pin::Pin,
    process::{Command, Stdio},
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use nix::{
    fcntl::OFlag,
    poll::{poll, PollFd, PollFlags, PollTimeout},
};
use tokio::{
    io::{unix::AsyncFd, AsyncReadExt, AsyncWrite},
    net::unix::pipe,
};

use crate::{
    error::{Error, Result},
    reaper::ExitSubscription,
    sys::pidfd::PidFd,
};

/// How long a logger may take to say it is ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a logger may live on once its pipes are closed.
pub const EXIT_GRACE: Duration = Duration::from_secs(12);

const SCHEME_PREFIX: &str = "binary://";

/// True when a stdio URI names a logging binary.
pub fn is_binary(uri: &str) -> bool {
    uri.starts_with(SCHEME_PREFIX)
}

/// A parsed `binary://` URI: the logging binary and its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggerUri {
    pub path: PathBuf,
    pub args: Vec<String>,
}

impl LoggerUri {
    /// Parses `binary:///absolute/path?key=value&...` as Go's `url.Parse` and `URL.Query` do:
    /// percent-escapes are decoded (and `+` is a space in the query); a key without `=` has an
    /// empty value; a repeated key counts once, with its first value.
    pub fn parse(uri: &str) -> Result<Self> {
        let invalid = |why: &str| {
            Error::InvalidArgument(format!(
                "log URI `{uri}`: {why} (expected binary:///absolute/path?key=value&...)"
            ))
        };
        let rest = uri
            .strip_prefix(SCHEME_PREFIX)
            .ok_or_else(|| invalid("not a binary:// URI"))?;
        let rest = rest.split_once('#').map_or(rest, |(r, _fragment)| r);
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !path.starts_with('/') {
            // Go would take `binary://host/path` as host + `/path` and run `/path`: a typo
            // like `binary://usr/bin/logger` is refused rather than run as `/bin/logger`.
            return Err(invalid("the path must be absolute, with an empty host"));
        }
        let path =
            unescape(path, false).ok_or_else(|| invalid("bad percent-escape in the path"))?;
        let mut args: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            if pair.contains(';') {
                return Err(invalid("`;` in the query"));
            }
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let key =
                unescape(key, true).ok_or_else(|| invalid("bad percent-escape in the query"))?;
            let value =
                unescape(value, true).ok_or_else(|| invalid("bad percent-escape in the query"))?;
            if seen.insert(key.clone()) {
                args.extend([key, value]);
            }
        }
        Ok(Self {
            path: path.into(),
            args,
        })
    }
}

/// Decodes `%XX` escapes (and, in a query, `+` as a space); `None` on a malformed escape.
fn unescape(s: &str, query: bool) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' if query => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The shim's ends of a started logger's output pipes. Dropping both closes the pipes.
pub struct LoggerOutputs {
    pub stdout: LoggerPipe,
    pub stderr: LoggerPipe,
}

/// The write end of one of a logger's pipes.
pub struct LoggerPipe {
    tx: pipe::Sender,
    _logger: Arc<Logger>,
}

impl AsyncWrite for LoggerPipe {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tx).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tx).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tx).poll_shutdown(cx)
    }
}

/// A running logger; when the last of its pipes is dropped it gets [`EXIT_GRACE`] to exit.
struct Logger {
    path: PathBuf,
    pid: i32,
    /// Refers to the logger itself even after it was reaped and its pid reused.
    pidfd: Option<PidFd>,
}

impl Drop for Logger {
    fn drop(&mut self) {
        let Some(pidfd) = self.pidfd.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (path, pid) = (self.path.clone(), self.pid);
        runtime.spawn(async move {
            // SAFETY: the pidfd is moved into the AsyncFd and stays open for its whole life.
            let exited = match unsafe { AsyncFd::register(pidfd) } {
                Ok(fd) => {
                    let exited = tokio::time::timeout(EXIT_GRACE, fd.readable()).await.is_ok();
                    (exited, fd.into_inner())
                }
                Err(e) => {
                    log::debug!("cannot watch logging binary {} (pid {pid}): {}", path.display(), e.into_parts().1);
                    return;
                }
            };
            if let (false, pidfd) = exited {
                log::warn!(
                    "logging binary {} (pid {pid}) still running {EXIT_GRACE:?} after its pipes closed: killing it",
                    path.display()
                );
                let _ = pidfd.kill();
            }
        });
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(OFlag::O_CLOEXEC)?)
}

/// True when nobody holds the read end of the pipe whose write end is `w` any more.
fn reader_gone(w: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(w.as_fd(), PollFlags::POLLOUT)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLERR))
}

/// Starts the logger of `uri` for process `id` of `namespace` and waits until it is ready.
pub async fn start(uri: &LoggerUri, id: &str, namespace: &str) -> Result<LoggerOutputs> {
    start_with_timeout(uri, id, namespace, READY_TIMEOUT).await
}

async fn start_with_timeout(
    uri: &LoggerUri,
    id: &str,
    namespace: &str,
    ready_timeout: Duration,
) -> Result<LoggerOutputs> {
    let shown = uri.path.display().to_string();
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let (ready_r, ready_w) = pipe()?;
    let child_fds = [out_r.as_raw_fd(), err_r.as_raw_fd(), ready_w.as_raw_fd()];
    let mut cmd = Command::new(&uri.path);
    cmd.args(&uri.args)
        .env_clear()
        .env("CONTAINER_ID", id)
        .env("CONTAINER_NAMESPACE", namespace)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec. The sources are
    // first copied above 9 so that placing one on 3, 4 or 5 cannot clobber another; the copies
    // are close-on-exec, the targets (made by dup2) are not.
    unsafe {
        cmd.pre_exec(move || {
            let mut high = [0; 3];
            for (h, fd) in high.iter_mut().zip(child_fds) {
                *h = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
                if *h < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (target, fd) in (3..).zip(high) {
                if libc::dup2(fd, target) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    // Subscribed before the spawn, so an exit before readiness cannot be missed.
    let mut exits = ExitSubscription::new().await?;
    let child = cmd
        .spawn()
        .map_err(Error::io(format!("cannot execute logging binary {shown}")))?;
    let pid = child.id() as i32;
    // The reaper waits for it; the Child (which never waits on drop) is not needed.
    drop(child);
    drop((cmd, out_r, err_r, ready_w));
    let pidfd = PidFd::open(pid as u32)
        .map_err(|e| {
            log::warn!("no pidfd for logging binary {shown} (pid {pid}): it will not be killed if it lingers: {e}")
        })
        .ok();
    let logger = Arc::new(Logger {
        path: uri.path.clone(),
        pid,
        pidfd,
    });
    let kill = |logger: &Logger| match &logger.pidfd {
        Some(fd) => {
            let _ = fd.kill();
        }
        None => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    };

    let mut ready =
        pipe::Receiver::from_owned_fd(ready_r).map_err(Error::io("logging binary ready pipe"))?;
    let mut byte = [0u8; 1];
    let waited = tokio::time::timeout(ready_timeout, async {
        tokio::select! {
            read = ready.read(&mut byte) => Ok(read),
            code = exits.wait_for(pid) => Err(code),
        }
    })
    .await;
    match waited {
        Err(_elapsed) => {
            kill(&logger);
            return Err(Error::Logger(format!(
                "logging binary {shown} was not ready within {ready_timeout:?}: it must close fd 5 (or write to it) \
                 once it reads the process's stdout and stderr from fds 3 and 4"
            )));
        }
        Ok(Err(code)) => {
            return Err(Error::Logger(format!(
                "logging binary {shown} exited before it was ready (exit status {})",
                code.map_or_else(|e| e.to_string(), |c| c.to_string())
            )))
        }
        Ok(Ok(Err(e))) => {
            kill(&logger);
            return Err(Error::io(format!(
                "reading the ready pipe of logging binary {shown}"
            ))(e));
        }
        Ok(Ok(Ok(_))) => {}
    }
    // EOF on the ready pipe is also what a logger that died says. One that is alive holds its
    // ends of the output pipes. (Best effort: the kernel may close a dying logger's fd 5 a
    // moment before fds 3 and 4; such a logger is found out at the first write, as in Go.)
    if reader_gone(&out_w) && reader_gone(&err_w) {
        let status = tokio::time::timeout(Duration::from_secs(1), exits.wait_for(pid))
            .await
            .ok()
            .and_then(|r| r.ok())
            .map_or_else(
                || "exit status unknown".to_string(),
                |c| format!("exit status {c}"),
            );
        return Err(Error::Logger(format!(
            "logging binary {shown} exited (or closed fds 3 and 4) before it was ready ({status})"
        )));
    }
    log::debug!("logging binary {shown} (pid {pid}) ready for {namespace}/{id}");
    let sender =
        |fd: OwnedFd| pipe::Sender::from_owned_fd(fd).map_err(Error::io("logging binary pipe"));
    Ok(LoggerOutputs {
        stdout: LoggerPipe {
            tx: sender(out_w)?,
            _logger: logger.clone(),
        },
        stderr: LoggerPipe {
            tx: sender(err_w)?,
            _logger: logger,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn parses_like_go() {
        let u = LoggerUri::parse(
            "binary:///usr/bin/logger?dir=/var/log/x&flag&sp=a+b%2Fc&dir=ignored#frag",
        )
        .unwrap();
        assert_eq!(u.path, PathBuf::from("/usr/bin/logger"));
        assert_eq!(u.args, ["dir", "/var/log/x", "flag", "", "sp", "a b/c"]);
        let u = LoggerUri::parse("binary:///opt/my%20logger").unwrap();
        assert_eq!((u.path, u.args), (PathBuf::from("/opt/my logger"), vec![]));
        for bad in [
            "binary://usr/bin/logger",
            "binary:///x?a=%zz",
            "binary:///x?a=1;b=2",
            "file:///x",
        ] {
            let err = LoggerUri::parse(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{bad}: {err}");
        }
        assert!(is_binary("binary:///x") && !is_binary("/run/fifo") && !is_binary("file:///x"));
    }

    /// A logger that is `/bin/sh` running `body` (`$1` = "out", `$2` = `dir`). Not the
    /// script itself as the binary: a test thread that forks while this one still holds the
    /// script open for writing gives the child that fd, and exec of the script then fails with
    /// ETXTBSY (seen under load).
    fn script(dir: &std::path::Path, body: &str) -> LoggerUri {
        let path = dir.join("logger.sh");
        std::fs::write(&path, format!("{body}\n")).unwrap();
        LoggerUri {
            path: "/bin/sh".into(),
            args: vec![
                path.display().to_string(),
                "out".into(),
                dir.display().to_string(),
            ],
        }
    }

    async fn eventually_read(path: &std::path::Path, want: &str) -> String {
        for _ in 0..100 {
            let got = std::fs::read_to_string(path).unwrap_or_default();
            if got == want {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        std::fs::read_to_string(path).unwrap_or_default()
    }

    #[tokio::test]
    async fn logger_gets_fds_args_and_env_and_sees_eof_when_the_pipes_drop() {
        let dir = tempfile::tempdir().unwrap();
        // Each copy closes fd 5 too, or the ready pipe would stay open in it.
        let uri = script(
            dir.path(),
            r#"d=$2
echo "$# $1" > "$d/args"
/usr/bin/env > "$d/env"
/bin/cat <&3 >"$d/stdout" 5>&- &
/bin/cat <&4 >"$d/stderr" 5>&- &
exec 3<&- 4<&- 5>&-
wait
echo done >"$d/exited""#,
        );
        let mut out = start(&uri, "c1", "ns1").await.unwrap();
        out.stdout.write_all(b"to stdout\n").await.unwrap();
        out.stderr.write_all(b"to stderr\n").await.unwrap();
        drop(out);
        assert_eq!(
            eventually_read(&dir.path().join("exited"), "done\n").await,
            "done\n"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("stdout")).unwrap(),
            "to stdout\n"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("stderr")).unwrap(),
            "to stderr\n"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("args")).unwrap(),
            "2 out\n"
        );
        let env = std::fs::read_to_string(dir.path().join("env")).unwrap();
        let env: Vec<&str> = env.lines().collect();
        assert!(
            env.contains(&"CONTAINER_ID=c1") && env.contains(&"CONTAINER_NAMESPACE=ns1"),
            "{env:?}"
        );
        assert!(
            !env.iter().any(|v| v.starts_with("HOME=")),
            "the shim's environment leaked: {env:?}"
        );
    }

    #[tokio::test]
    async fn a_logger_that_never_gets_ready_is_killed_after_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let uri = script(dir.path(), "exec /bin/sleep 30");
        let started = std::time::Instant::now();
        let err = start_with_timeout(&uri, "c", "ns", Duration::from_millis(300))
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("was not ready within"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_logger_that_exits_at_once_or_is_missing_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        // Closing its output fds first makes the failure certain to be seen before readiness;
        // a plain `exit` races the kernel's closing order (best effort, as in containerd).
        let err = start(&script(dir.path(), "exec 3<&- 4<&-; exit 3"), "c", "ns")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("exited"), "{err}");
        let missing = LoggerUri {
            path: dir.path().join("nope"),
            args: vec![],
        };
        let err = start(&missing, "c", "ns").await.err().unwrap().to_string();
        assert!(err.contains("cannot execute logging binary"), "{err}");
    }
}
