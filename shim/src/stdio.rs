//! Process stdio: FIFOs and files from containerd, pipes or a pty towards runc.
//!
//! Without a terminal, the process gets pipes and the shim copies between them and the
//! FIFOs (or `file://` targets) containerd named. With a terminal, runc sends the pty master
//! over a console socket and the shim copies between it and the FIFOs. As in containerd's
//! runc shim, output FIFOs are opened read-write (so a client that goes away never blocks
//! or kills the copy) and the shim holds a write end of the stdin FIFO until `CloseIO`, so
//! stdin reaches EOF only when both the client and the shim have closed it.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    pin::Pin,
    sync::Mutex,
    task::{ready, Context, Poll},
    time::Duration,
};

use nix::{
    fcntl::{self, OFlag},
    sys::stat::Mode,
};
use tokio::{
    io::{unix::AsyncFd, AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf},
    net::UnixListener,
    task::JoinHandle,
};

use crate::{
    error::{Error, Result},
    logdriver,
    runc::ChildStdio,
};

/// Where containerd wants a process's stdio.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StdioSpec {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

#[derive(Debug, PartialEq)]
enum Target {
    Fifo(PathBuf),
    File(PathBuf),
}

fn parse_target(uri: &str) -> Result<Option<Target>> {
    if uri.is_empty() {
        return Ok(None);
    }
    match uri.split_once("://") {
        None => Ok(Some(Target::Fifo(uri.into()))),
        Some(("fifo", path)) => Ok(Some(Target::Fifo(path.into()))),
        Some(("file", path)) => Ok(Some(Target::File(path.into()))),
        Some((scheme, _)) => Err(Error::InvalidArgument(format!(
            "stdio URI scheme `{scheme}` in `{uri}` is not supported (use a FIFO path or file://)"
        ))),
    }
}

/// Async reads and writes on a non-blocking fd (pipe, FIFO or pty master).
struct FdIo(AsyncFd<OwnedFd>);

impl FdIo {
    fn new(fd: OwnedFd) -> io::Result<Self> {
        let flags = fcntl::fcntl(fd.as_raw_fd(), fcntl::F_GETFL)?;
        let flags = OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK;
        fcntl::fcntl(fd.as_raw_fd(), fcntl::F_SETFL(flags))?;
        // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays open and refers to
        // the same file description for the AsyncFd's whole life.
        unsafe { AsyncFd::register(fd) }
            .map(Self)
            .map_err(|e| e.into_parts().1)
    }
}

impl AsyncRead for FdIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard
                .try_io(|fd| nix::unistd::read(fd.as_raw_fd(), unfilled).map_err(io::Error::from))
            {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // A pty master reads EIO once every slave fd is closed: that is its EOF.
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Poll::Ready(Ok(())),
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for FdIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from))
            {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

type Writer = Box<dyn AsyncWrite + Send + Unpin>;

fn open_fd(path: &Path, flags: OFlag) -> Result<OwnedFd> {
    let fd = fcntl::open(
        path,
        flags | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(|e| Error::io(format!("cannot open {}", path.display()))(e.into()))?;
    // SAFETY: `open` returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

async fn open_output(target: &Target) -> Result<Writer> {
    match target {
        Target::Fifo(path) => {
            let fd = open_fd(path, OFlag::O_RDWR | OFlag::O_NONBLOCK)?;
            Ok(Box::new(FdIo::new(fd).map_err(Error::io("stdio fifo"))?))
        }
        Target::File(path) => {
            if let Some(dir) = path.parent() {
                tokio::fs::create_dir_all(dir)
                    .await
                    .map_err(Error::io(format!("cannot create {}", dir.display())))?;
            }
            let file = tokio::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .await
                .map_err(Error::io(format!("cannot open {}", path.display())))?;
            Ok(Box::new(file))
        }
    }
}

/// A pipe towards runc's child; both ends owned by `owner` (uid, gid) when given, as containerd's
/// runc shim does with `IoUid`/`IoGid`: a process running as a user-namespaced uid can then
/// reopen its own stdio (`/proc/self/fd/1`, `/dev/stdout`), which needs the pipe's owner.
fn pipe(owner: Option<(u32, u32)>) -> Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    if let Some((uid, gid)) = owner {
        for fd in [&r, &w] {
            nix::unistd::fchown(
                fd.as_raw_fd(),
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .map_err(|source| Error::Sys {
                context: format!("chown stdio pipe to {uid}:{gid}"),
                source,
            })?;
        }
    }
    Ok((r, w))
}

/// The socket runc hands a new pty master to (`--console-socket`).
pub struct ConsoleSocket {
    pub path: PathBuf,
    listener: UnixListener,
}

const CONSOLE_DIR: &str = "/run/crab/console";

impl ConsoleSocket {
    fn new() -> Result<Self> {
        std::fs::create_dir_all(CONSOLE_DIR)
            .map_err(Error::io(format!("cannot create {CONSOLE_DIR}")))?;
        // Bundle paths are too long for sun_path, hence a short private directory.
        let path = Path::new(CONSOLE_DIR).join(format!("{}-{}.sock", std::process::id(), unique()));
        let listener = UnixListener::bind(&path)
            .map_err(Error::io(format!("cannot bind {}", path.display())))?;
        Ok(Self { path, listener })
    }

    async fn receive_master(&self) -> Result<OwnedFd> {
        let (stream, _) = tokio::time::timeout(Duration::from_secs(10), self.listener.accept())
            .await
            .map_err(|_| Error::TimedOut("runc did not send the console within 10s".into()))?
            .map_err(Error::io("console socket accept"))?;
        let stream = stream.into_std().map_err(Error::io("console socket"))?;
        stream
            .set_nonblocking(false)
            .map_err(Error::io("console socket"))?;
        tokio::task::spawn_blocking(move || recv_fd(&stream))
            .await
            .map_err(|e| Error::io("console receive task")(io::Error::other(e)))?
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn recv_fd(stream: &std::os::unix::net::UnixStream) -> Result<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut buf = [0u8; 4096];
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                // SAFETY: the kernel installed this descriptor for us; we own it now.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Err(Error::Other(
        "console socket message carried no file descriptor".into(),
    ))
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Stdio set up before runc runs: the child's ends and what the shim keeps.
pub struct PreparedIo {
    pub child: ChildStdio,
    pub console: Option<ConsoleSocket>,
    stdin_source: Option<(FdIo, OwnedFd)>,
    stdin_pipe: Option<OwnedFd>,
    outputs: Vec<(OwnedFd, Writer)>,
    console_output: Option<Writer>,
    /// Which of stdin, stdout, stderr the child gets no stream for (`/dev/null`).
    null: [bool; 3],
}

/// The null device as seen inside the container of `pid`, or `None` if what is at its
/// `/dev/null` is anything else. A process that an exec leaves behind keeps the exec's null
/// streams; if they are the host's `/dev/null` (a file on a mount the container does not
/// have), CRIU cannot dump it. The container controls that path: it is resolved beneath the
/// process's root without following any symlink (one in `/dev` could otherwise name a host
/// path), and checked to be the null device (1:3) before it is opened for I/O.
fn container_null(pid: u32) -> Option<std::fs::File> {
    use std::os::fd::AsFd;
    let root = crate::sys::beneath::process_root(pid).ok()?;
    let path = crate::sys::beneath::resolve_beneath(root.as_fd(), std::path::Path::new("dev/null"))
        .ok()?;
    let st = crate::sys::beneath::fstat(path.as_fd()).ok()?;
    if st.st_mode & libc::S_IFMT != libc::S_IFCHR || st.st_rdev != libc::makedev(1, 3) {
        log::warn!(
            "pid {pid}: /dev/null in its container is not the null device; execs get the host's"
        );
        return None;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", path.as_raw_fd()))
        .ok()
}

impl PreparedIo {
    /// Opens the targets and makes the pipes (or the console socket). Errors here leave
    /// nothing behind: everything is owned and closed on drop. `id` (container id for an
    /// init, exec id for an exec) and `namespace` are for a `binary://` logger.
    /// `owner`: who owns the pipes (see [`pipe`]).
    pub async fn new(
        spec: &StdioSpec,
        id: &str,
        namespace: &str,
        owner: Option<(u32, u32)>,
    ) -> Result<Self> {
        let stdin_source = match parse_target(&spec.stdin)? {
            None => None,
            Some(Target::Fifo(path)) => {
                let reader = open_fd(&path, OFlag::O_RDONLY | OFlag::O_NONBLOCK)?;
                let holder = open_fd(&path, OFlag::O_WRONLY | OFlag::O_NONBLOCK)?;
                Some((FdIo::new(reader).map_err(Error::io("stdin fifo"))?, holder))
            }
            Some(Target::File(_)) => {
                return Err(Error::InvalidArgument(format!(
                    "stdin `{}` must be a FIFO",
                    spec.stdin
                )))
            }
        };
        // A binary:// stdout takes stderr too, whatever stderr's URI (as in containerd).
        let [mut logger_stdout, mut logger_stderr]: [Option<Writer>; 2] =
            if logdriver::is_binary(&spec.stdout) {
                let logger =
                    logdriver::start(&logdriver::LoggerUri::parse(&spec.stdout)?, id, namespace)
                        .await?;
                [Some(Box::new(logger.stdout)), Some(Box::new(logger.stderr))]
            } else {
                [None, None]
            };
        let mut prepared = PreparedIo {
            child: ChildStdio::null(),
            console: None,
            stdin_source,
            stdin_pipe: None,
            outputs: Vec::new(),
            console_output: None,
            null: [false; 3],
        };
        if spec.terminal {
            prepared.console = Some(ConsoleSocket::new()?);
            if let Some(w) = logger_stdout {
                prepared.console_output = Some(w);
            } else if let Some(t) = parse_target(&spec.stdout)? {
                prepared.console_output = Some(open_output(&t).await?);
            }
            return Ok(prepared);
        }
        if prepared.stdin_source.is_some() {
            let (r, w) = pipe(owner)?;
            prepared.child.stdin = r.into();
            prepared.stdin_pipe = Some(w);
        } else {
            prepared.null[0] = true;
        }
        for (uri, is_stdout) in [(&spec.stdout, true), (&spec.stderr, false)] {
            let to_logger = if is_stdout {
                logger_stdout.take()
            } else {
                logger_stderr.take()
            };
            let writer = match to_logger {
                Some(w) => Some(w),
                None => match parse_target(uri)? {
                    Some(t) => Some(open_output(&t).await?),
                    None => None,
                },
            };
            if let Some(writer) = writer {
                let (r, w) = pipe(owner)?;
                if is_stdout {
                    prepared.child.stdout = w.into();
                } else {
                    prepared.child.stderr = w.into();
                }
                prepared.outputs.push((r, writer));
            } else {
                prepared.null[if is_stdout { 1 } else { 2 }] = true;
            }
        }
        Ok(prepared)
    }

    /// Gives the streams the child gets none for the null device of `init_pid`'s container
    /// instead of the host's (see [`container_null`]); for execs, whose container exists.
    pub fn null_from_container(&mut self, init_pid: u32) {
        if !self.null.contains(&true) {
            return;
        }
        let Some(null) = container_null(init_pid) else {
            return;
        };
        for (i, slot) in [
            &mut self.child.stdin,
            &mut self.child.stdout,
            &mut self.child.stderr,
        ]
        .into_iter()
        .enumerate()
        {
            if self.null[i] {
                if let Ok(f) = null.try_clone() {
                    *slot = f.into();
                }
            }
        }
    }

    /// Starts copying once runc has run. `self.child` must have been handed to runc.
    pub async fn start(self) -> Result<ProcessIo> {
        let mut io = ProcessIo::default();
        let PreparedIo {
            console,
            stdin_source,
            stdin_pipe,
            outputs,
            console_output,
            ..
        } = self;
        let stdin_sink: Option<Writer> = if let Some(console) = console {
            let master = console.receive_master().await?;
            let reader = FdIo::new(master.try_clone().map_err(Error::io("dup console"))?)
                .map_err(Error::io("console"))?;
            // Nobody to read it (a task started with no stdio, e.g. by `crabctl recover`): the
            // output is read and discarded, or the terminal's buffer would fill and block
            // every process writing to it.
            let out = console_output.unwrap_or_else(|| Box::new(tokio::io::sink()));
            io.outputs.push(spawn_copy(reader, out, "console output"));
            let writer = FdIo::new(master.try_clone().map_err(Error::io("dup console"))?)
                .map_err(Error::io("console"))?;
            io.console = Some(master);
            Some(Box::new(writer))
        } else {
            for (r, w) in outputs {
                if let Ok(st) = nix::sys::stat::fstat(r.as_raw_fd()) {
                    io.pipes.push(st.st_ino);
                }
                let reader = FdIo::new(r).map_err(Error::io("stdio pipe"))?;
                io.outputs.push(spawn_copy(reader, w, "output"));
            }
            match stdin_pipe {
                Some(p) => Some(Box::new(FdIo::new(p).map_err(Error::io("stdin pipe"))?)),
                None => None,
            }
        };
        if let (Some((source, holder)), Some(sink)) = (stdin_source, stdin_sink) {
            *io.stdin_holder.lock().unwrap() = Some(holder);
            io.input = Some(spawn_copy(source, sink, "stdin"));
        }
        Ok(io)
    }
}

fn spawn_copy<R, W>(mut reader: R, mut writer: W, what: &'static str) -> JoinHandle<()>
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = tokio::io::copy(&mut reader, &mut writer).await {
            log::debug!("{what} copy ended: {e}");
        }
        let _ = writer.shutdown().await;
    })
}

/// The running side of a process's stdio.
#[derive(Default)]
pub struct ProcessIo {
    console: Option<OwnedFd>,
    stdin_holder: Mutex<Option<OwnedFd>>,
    input: Option<JoinHandle<()>>,
    outputs: Vec<JoinHandle<()>>,
    /// The inodes of the output pipes (their read ends are the shim's): who else holds them
    /// when the output outlives the process ([`Self::drain`]).
    pipes: Vec<u64>,
}

impl ProcessIo {
    pub fn resize(&self, width: u32, height: u32) -> Result<()> {
        let Some(master) = &self.console else {
            return Err(Error::FailedPrecondition("process has no terminal".into()));
        };
        let ws = libc::winsize {
            ws_row: height as u16,
            ws_col: width as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize struct we own, on an fd we own.
        let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        if rc != 0 {
            return Err(Error::io("resize pty")(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Drops the shim's write end of the stdin FIFO: stdin ends once the client closes too.
    pub fn close_stdin(&self) {
        self.stdin_holder.lock().unwrap().take();
    }

    /// Waits (bounded) until the process's output has been copied out. When it is not by
    /// then, returns the processes that still hold a write end of its output pipes (a
    /// background process that inherited them, typically): its output stays open until they
    /// close them or the process is deleted.
    pub async fn drain(&mut self, bound: Duration) -> Option<Vec<(u32, String)>> {
        let all = futures_join(&mut self.outputs);
        if tokio::time::timeout(bound, all).await.is_ok() {
            return None;
        }
        let pipes = self.pipes.clone();
        let me = std::process::id();
        let holders = tokio::task::spawn_blocking(move || pipe_holders(&pipes, me))
            .await
            .unwrap_or_default();
        Some(holders)
    }
}

/// The processes with a descriptor on one of the pipes `inodes` (the shim, `me`, only when it
/// holds more than one descriptor on one of them: its read end and a write end it failed to
/// close), with their command names. Read from `/proc/*/fd` links alone (nothing is opened);
/// processes that vanish or cannot be read are left out.
fn pipe_holders(inodes: &[u64], me: u32) -> Vec<(u32, String)> {
    let names: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let mut holders = Vec::new();
    for pid in crate::sys::procfs::pids() {
        let dir = std::path::PathBuf::from(format!("/proc/{pid}"));
        let mut held = vec![0usize; names.len()];
        for fd in std::fs::read_dir(dir.join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(l) = std::fs::read_link(fd.path()) {
                if let Some(i) = names.iter().position(|n| l.as_os_str() == n.as_str()) {
                    held[i] += 1;
                }
            }
        }
        let own = usize::from(pid == me);
        if held.iter().any(|&n| n > own) {
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            holders.push((pid, comm.trim_end().to_string()));
        }
    }
    holders
}

async fn futures_join(handles: &mut Vec<JoinHandle<()>>) {
    for h in handles.iter_mut() {
        let _ = h.await;
    }
    handles.clear();
}

impl Drop for ProcessIo {
    fn drop(&mut self) {
        if let Some(h) = &self.input {
            h.abort();
        }
        for h in &self.outputs {
            h.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_null_device_of_a_process_root() {
        use std::os::unix::fs::MetadataExt;
        let null = super::container_null(std::process::id()).expect("our own /dev/null");
        assert_eq!(null.metadata().unwrap().rdev(), libc::makedev(1, 3));
        let mut buf = [0u8; 4];
        assert_eq!(
            std::io::Read::read(&mut &null, &mut buf).unwrap(),
            0,
            "reads EOF"
        );
        assert!(super::container_null(u32::MAX).is_none(), "no such process");
    }

    use super::*;

    #[test]
    fn the_holders_of_an_output_pipe_are_found() {
        let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).unwrap();
        let ino = nix::sys::stat::fstat(r.as_raw_fd()).unwrap().st_ino;
        let me = std::process::id();
        // A background process that inherited the write end (as `cmd &` in an exec does).
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdout(std::process::Stdio::from(w.try_clone().unwrap()))
            .spawn()
            .unwrap();
        // The shim still holding its write end too: a leak of its own, reported as such.
        let holders = pipe_holders(&[ino], me);
        assert!(
            holders.contains(&(child.id(), "sleep".into())),
            "{holders:?}"
        );
        assert!(holders.iter().any(|(p, _)| *p == me), "{holders:?}");
        // Only its read end: the shim is not a holder.
        drop(w);
        assert_eq!(
            pipe_holders(&[ino], me),
            [(child.id(), "sleep".to_string())]
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(pipe_holders(&[ino], me).is_empty());
        drop(r);
    }

    #[test]
    fn targets() {
        assert_eq!(parse_target("").unwrap(), None);
        assert_eq!(
            parse_target("/run/x/stdout").unwrap(),
            Some(Target::Fifo("/run/x/stdout".into()))
        );
        assert_eq!(
            parse_target("fifo:///a").unwrap(),
            Some(Target::Fifo("/a".into()))
        );
        assert_eq!(
            parse_target("file:///var/log/c.log").unwrap(),
            Some(Target::File("/var/log/c.log".into()))
        );
        let err = parse_target("binary:///usr/bin/logger?x=1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`binary`"), "{err}");
    }

    #[tokio::test]
    async fn pipes_copy_to_fifo_and_stdin_ends_after_close_io() {
        use tokio::io::AsyncReadExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = |n: &str| {
            let p = dir.path().join(n);
            nix::unistd::mkfifo(&p, Mode::from_bits_truncate(0o600)).unwrap();
            p
        };
        let (stdin, stdout) = (fifo("in"), fifo("out"));
        let spec = StdioSpec {
            stdin: stdin.display().to_string(),
            stdout: stdout.display().to_string(),
            stderr: String::new(),
            terminal: false,
        };
        // The client side, as containerd opens it: a reader on stdout, a writer on stdin.
        let mut client_out =
            FdIo::new(open_fd(&stdout, OFlag::O_RDONLY | OFlag::O_NONBLOCK).unwrap()).unwrap();
        let mut prepared = PreparedIo::new(&spec, "c", "ns", None).await.unwrap();
        let mut client_in =
            FdIo::new(open_fd(&stdin, OFlag::O_WRONLY | OFlag::O_NONBLOCK).unwrap()).unwrap();
        // Play the process: `cat` from its stdin pipe to its stdout pipe.
        let child = std::mem::replace(&mut prepared.child, ChildStdio::null());
        let mut cat = std::process::Command::new("cat")
            .stdin(child.stdin)
            .stdout(child.stdout)
            .stderr(child.stderr)
            .spawn()
            .unwrap();
        let io = prepared.start().await.unwrap();
        client_in.write_all(b"hello\n").await.unwrap();
        drop(client_in);
        let mut buf = [0u8; 6];
        client_out.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello\n");
        // The client closed stdin, but the shim's holder keeps cat alive until CloseIO.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            cat.try_wait().unwrap().is_none(),
            "cat ended before CloseIO"
        );
        io.close_stdin();
        let status = tokio::task::spawn_blocking(move || cat.wait().unwrap())
            .await
            .unwrap();
        assert_eq!(status.code(), Some(0));
    }
}
