//! FIFOs for a task's or exec's stdio, as a containerd client creates them: the client makes the
//! FIFOs, passes their paths in Create/Exec, and the shim opens the other ends.
//!
//! Each output FIFO is drained by a thread that blocks in `open` until the shim connects and then
//! reads to EOF (the shim closes its end once the process has exited and its output is copied).

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use crate::{Error, Result};

#[derive(Debug, Clone, Copy, Default)]
pub struct StdioOptions {
    pub stdin: bool,
    /// With a terminal the console's output arrives on the stdout FIFO and there is no stderr.
    pub terminal: bool,
}

pub struct Stdio {
    dir: PathBuf,
    stdin: Option<PathBuf>,
    stdout: PathBuf,
    stderr: Option<PathBuf>,
    terminal: bool,
    stdout_rx: OutputSlot,
    stderr_rx: Option<OutputSlot>,
}

enum OutputSlot {
    // The Mutex only makes Stdio Sync, so `&Stdio` can be held across an await in spawned tasks.
    Pending(Mutex<Receiver<std::io::Result<Vec<u8>>>>),
    Done(Vec<u8>),
}

impl Stdio {
    /// Creates `dir` (which this value owns and removes on drop) and the FIFOs `<name>-stdin`,
    /// `<name>-stdout`, `<name>-stderr` in it.
    pub fn create(dir: &Path, name: &str, opts: StdioOptions) -> Result<Self> {
        fs::create_dir_all(dir).map_err(|e| Error::io(format!("mkdir {}", dir.display()), e))?;
        let stdin = opts.stdin.then(|| dir.join(format!("{name}-stdin")));
        let stdout = dir.join(format!("{name}-stdout"));
        let stderr = (!opts.terminal).then(|| dir.join(format!("{name}-stderr")));
        for p in stdin.iter().chain([&stdout]).chain(stderr.iter()) {
            mkfifo(p)?;
        }
        let stdout_rx = OutputSlot::Pending(spawn_reader(stdout.clone()));
        let stderr_rx = stderr.clone().map(|p| OutputSlot::Pending(spawn_reader(p)));
        Ok(Stdio {
            dir: dir.to_path_buf(),
            stdin,
            stdout,
            stderr,
            terminal: opts.terminal,
            stdout_rx,
            stderr_rx,
        })
    }

    pub fn terminal(&self) -> bool {
        self.terminal
    }

    pub fn stdin_path(&self) -> String {
        path_str(self.stdin.as_deref())
    }

    pub fn stdout_path(&self) -> String {
        path_str(Some(&self.stdout))
    }

    pub fn stderr_path(&self) -> String {
        path_str(self.stderr.as_deref())
    }

    /// Writes `data` to the process's stdin and closes this writer. The shim keeps its own
    /// writer open, so the process sees EOF only after `CloseIO`.
    pub fn write_stdin(&self, data: &[u8], timeout: Duration) -> Result<()> {
        let path = self
            .stdin
            .clone()
            .ok_or_else(|| Error::Protocol("stdio was created without stdin".into()))?;
        let data = data.to_vec();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let r = OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|mut f| f.write_all(&data));
            let _ = tx.send(r);
        });
        match rx.recv_timeout(timeout) {
            Ok(r) => r.map_err(|e| Error::io("write stdin FIFO", e)),
            Err(_) => Err(Error::Timeout {
                what: "the shim to open the stdin FIFO".into(),
                after: timeout,
            }),
        }
    }

    /// Everything written to stdout (the console, with a terminal), once the writer closed it.
    pub fn stdout(&mut self, timeout: Duration) -> Result<Vec<u8>> {
        self.stdout_rx.take(timeout, "stdout")
    }

    pub fn stdout_string(&mut self, timeout: Duration) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.stdout(timeout)?).into_owned())
    }

    pub fn stderr_string(&mut self, timeout: Duration) -> Result<String> {
        match &mut self.stderr_rx {
            Some(slot) => Ok(String::from_utf8_lossy(&slot.take(timeout, "stderr")?).into_owned()),
            None => Ok(String::new()),
        }
    }
}

impl OutputSlot {
    fn take(&mut self, timeout: Duration, what: &str) -> Result<Vec<u8>> {
        if let OutputSlot::Pending(rx) = self {
            let rx = rx.get_mut().unwrap_or_else(|p| p.into_inner());
            let data = match rx.recv_timeout(timeout) {
                Ok(r) => r.map_err(|e| Error::io(format!("read {what} FIFO"), e))?,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout {
                        what: format!("EOF on the {what} FIFO (the shim did not close it)"),
                        after: timeout,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Protocol(format!("{what} reader thread died")))
                }
            };
            *self = OutputSlot::Done(data);
        }
        match self {
            OutputSlot::Done(d) => Ok(d.clone()),
            OutputSlot::Pending(_) => unreachable!("slot was just filled"),
        }
    }
}

impl Drop for Stdio {
    fn drop(&mut self) {
        // A reader still blocked in open() (the shim never connected) is released by opening the
        // write end ourselves; its read then sees EOF. Likewise a stdin writer blocked in open().
        for p in std::iter::once(&self.stdout).chain(self.stderr.iter()) {
            let _ = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(p);
        }
        if let Some(p) = &self.stdin {
            let _ = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(p);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Reads the FIFO at `path` to EOF on a thread. Its read end is opened here, before the shim
/// is told the path (as containerd's clients do): a reader that opened only once its thread ran
/// could, on a busy host, open after the shim had written and closed, and then wait forever for
/// a writer. Opened non-blocking (no writer needed), then read after `poll`: Linux reports
/// `POLLHUP` on a FIFO only once a writer came and went since the read end opened, so a read of
/// 0 bytes before the shim opened it is never taken for the end.
fn spawn_reader(path: PathBuf) -> Mutex<Receiver<std::io::Result<Vec<u8>>>> {
    let (tx, rx) = mpsc::channel();
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path);
    thread::spawn(move || {
        let _ = tx.send(opened.and_then(read_fifo_to_end));
    });
    Mutex::new(rx)
}

fn read_fifo_to_end(mut f: File) -> std::io::Result<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let mut pfd = libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd we own, for the fd `f` holds open.
        if unsafe { libc::poll(&mut pfd, 1, -1) } < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // Readable, or every writer gone after one came: drain what is there.
        loop {
            match f.read(&mut chunk) {
                Ok(0) => return Ok(buf),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

fn mkfifo(path: &Path) -> Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::Protocol(format!("NUL in path {}", path.display())))?;
    // SAFETY: c is a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(Error::io(
            format!("mkfifo {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn path_str(p: Option<&Path>) -> String {
    p.map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}
