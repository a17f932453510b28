//! Lazy restore of a process image: CRIU's lazy-pages daemon hands the image's private
//! anonymous pages to the restored processes over userfaultfd, on first touch and then in the
//! background, so `runc restore --lazy-pages` returns before the memory has been copied.
//!
//! # The hazard, and how it is contained
//! The kernel drops a process's userfaultfd registration when the daemon's descriptor closes:
//! a process whose daemon dies before every page arrived reads zeros where its pages should be.
//! So nothing here trusts the daemon to finish:
//! - it runs bounded ([`watch`]): if it fails or overruns, the caller kills the container, a
//!   clean failure instead of silent corruption;
//! - a [`Transfer`] says whether every page has arrived: checkpoints of the container wait for
//!   it (CRIU dumps no memory still registered with userfaultfd), and the inspector treats
//!   memory images taken before it as unproven (a page not there yet reads as absent).

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::reaper::{ExitSubscription, ReaperError};
use crate::sys::pidfd::PidFd;

/// CRIU's socket in the work directory, where the restore meets the daemon.
pub const SOCKET: &str = "lazy-pages.socket";
/// The daemon's log, in the work directory.
pub const LOG: &str = "lazy-pages.log";
/// How long the daemon may take to listen on its socket.
const LISTEN_BOUND: Duration = Duration::from_secs(5);

/// Why a lazy-pages daemon could not be started; `log` is the last error of its log (`: ...`),
/// if it wrote one.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("cannot create {}: {source}", path.display())]
    WorkDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Reaper(#[from] ReaperError),
    #[error("cannot run {} lazy-pages: {source}", criu.display())]
    Spawn {
        criu: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pidfd_open of criu lazy-pages: {0}")]
    PidFd(#[source] std::io::Error),
    #[error("criu lazy-pages did not listen within {bound:?}{log}", bound = LISTEN_BOUND)]
    NotListening { log: String },
    #[error("criu lazy-pages exited (status {code}) before listening{log}")]
    Exited { code: i32, log: String },
}

/// Where a lazy restore's page transfer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Pages are still on their way.
    InFlight,
    /// Every page of the image is in the processes' memory.
    Done,
    /// The daemon failed or overran; the container was killed.
    Failed(String),
}

/// A lazy restore's page transfer, shared by the restore (which ends it) and whoever must not
/// look at the processes' memory before it ends (checkpoints, the inspector).
#[derive(Debug, Clone)]
pub struct Transfer(Arc<(Mutex<State>, Condvar)>);

impl Transfer {
    pub fn in_flight() -> Transfer {
        Transfer(Arc::new((Mutex::new(State::InFlight), Condvar::new())))
    }

    /// A transfer that has nothing left to do (an eager restore, tests).
    pub fn done() -> Transfer {
        let t = Transfer::in_flight();
        t.end(State::Done);
        t
    }

    /// Ends the transfer (once: a later end is ignored).
    pub fn end(&self, state: State) {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        if *s == State::InFlight {
            *s = state;
        }
        cv.notify_all();
    }

    pub fn state(&self) -> State {
        self.0 .0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether pages may still be missing from the processes' memory.
    pub fn in_flight_now(&self) -> bool {
        self.state() == State::InFlight
    }

    /// Waits (blocking) until the transfer ends or `bound` passes; returns the state then.
    pub fn wait(&self, bound: Duration) -> State {
        let (lock, cv) = &*self.0;
        let s = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (s, _) = cv
            .wait_timeout_while(s, bound, |s| *s == State::InFlight)
            .unwrap_or_else(|e| e.into_inner());
        s.clone()
    }
}

/// The bytes of memory pages a CRIU image directory holds (its `pages-*.img` files), which is
/// what an eager restore copies before the processes run.
pub fn page_bytes(image: &Path) -> u64 {
    std::fs::read_dir(image)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("pages-") && name.ends_with(".img")
        })
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// A running `criu lazy-pages` daemon, listening in a restore's work directory. Its exit is
/// learnt from the shim's reaper (which reaps every child); it is killed (by pidfd) when
/// dropped before it was seen to exit.
pub struct Daemon {
    pid: u32,
    fd: PidFd,
    exits: ExitSubscription,
    /// Its exit status, once seen (`-1`: the reaper's monitor closed first).
    exit: Option<i32>,
    work: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Harmless when it has exited: the pidfd never reaches a reused pid.
        self.fd.kill();
    }
}

impl Daemon {
    /// Starts `criu lazy-pages` for the image in `images`, listening in `work` (the restore's
    /// CRIU work directory), and waits until it listens. The daemon is killed if this fails or
    /// the returned value is dropped.
    pub async fn start(criu: &Path, images: &Path, work: &Path) -> Result<Daemon, LazyError> {
        std::fs::create_dir_all(work).map_err(|source| LazyError::WorkDir {
            path: work.to_path_buf(),
            source,
        })?;
        let socket = work.join(SOCKET);
        let _ = std::fs::remove_file(&socket);
        // Subscribed before the spawn, so that the exit cannot be missed.
        let exits = ExitSubscription::new().await?;
        let child = std::process::Command::new(criu)
            .arg("lazy-pages")
            .arg("--images-dir")
            .arg(images)
            .arg("--work-dir")
            .arg(work)
            .args(["-o", LOG, "-v2"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| LazyError::Spawn {
                criu: criu.to_path_buf(),
                source,
            })?;
        let pid = child.id();
        drop(child);
        let fd = PidFd::open(pid).map_err(LazyError::PidFd)?;
        let mut daemon = Daemon {
            pid,
            fd,
            exits,
            exit: None,
            work: work.to_path_buf(),
        };
        let listening = async {
            let started = Instant::now();
            while started.elapsed() < LISTEN_BOUND {
                if std::fs::symlink_metadata(&socket).is_ok_and(|m| m.file_type().is_socket()) {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            false
        };
        tokio::select! {
            listens = listening => match listens {
                true => Ok(daemon),
                false => Err(LazyError::NotListening { log: log_tail(work) }),
            },
            code = daemon.wait_exit() => Err(LazyError::Exited { code, log: log_tail(work) }),
        }
    }

    /// Waits until the daemon has exited; its status (`-1` if the reaper's monitor closed).
    /// Cancel-safe: the status is kept once seen.
    pub async fn wait_exit(&mut self) -> i32 {
        if let Some(code) = self.exit {
            return code;
        }
        let code = self.exits.wait_for(self.pid as i32).await.unwrap_or(-1);
        self.exit = Some(code);
        code
    }

    /// Why the daemon failed, for messages: its status and the last error of its log.
    pub fn failure(&self, code: i32) -> String {
        format!(
            "criu lazy-pages failed (status {code}){}",
            log_tail(&self.work)
        )
    }

    /// Kills the daemon (if it still runs).
    pub fn kill(&self) {
        self.fd.kill();
    }

    /// Whether its exit has been seen.
    pub fn has_exited(&self) -> bool {
        self.exit.is_some()
    }
}

/// The last error line of the daemon's log, for messages; only the log's last 64 KiB are read
/// (a daemon fed a hostile image may have written a lot).
fn log_tail(work: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let tail = (|| -> std::io::Result<Vec<u8>> {
        let mut f = std::fs::File::open(work.join(LOG))?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(64 << 10)))?;
        let mut buf = Vec::new();
        f.take(64 << 10).read_to_end(&mut buf)?;
        Ok(buf)
    })();
    let Ok(tail) = tail else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&tail);
    match text.lines().rfind(|l| l.contains("Error")) {
        Some(l) => format!(": {}", l.trim()),
        None => String::new(),
    }
}

/// Waits for the daemon to hand over every page, at most `bound`. The transfer is ended with
/// the outcome; on failure the daemon is killed and `on_failure` runs first (the caller kills
/// the container, whose memory may now be incomplete). Returns the daemon's work directory for
/// the caller to remove.
pub async fn watch(
    mut daemon: Daemon,
    transfer: Transfer,
    bound: Duration,
    on_failure: impl FnOnce(&str),
) -> PathBuf {
    let started = Instant::now();
    let outcome = match tokio::time::timeout(bound, daemon.wait_exit()).await {
        Ok(0) => Ok(()),
        Ok(code) => Err(daemon.failure(code)),
        Err(_) => Err(format!(
            "criu lazy-pages still handing pages over after {bound:?} \
             ([checkpoint] restore_timeout_ms)"
        )),
    };
    match outcome {
        Ok(()) => {
            log::debug!(
                "lazy restore: every page arrived in {:?}",
                started.elapsed()
            );
            transfer.end(State::Done);
        }
        Err(why) => {
            daemon.kill();
            on_failure(&why);
            transfer.end(State::Failed(why));
        }
    }
    daemon.work.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_ends_once_and_wakes_its_waiters() {
        let t = Transfer::in_flight();
        assert!(t.in_flight_now());
        assert_eq!(t.wait(Duration::from_millis(5)), State::InFlight);
        let t2 = t.clone();
        let waiter = std::thread::spawn(move || t2.wait(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        t.end(State::Done);
        assert_eq!(waiter.join().unwrap(), State::Done);
        t.end(State::Failed("late".into()));
        assert_eq!(t.state(), State::Done, "the first end stays");
        assert!(!Transfer::done().in_flight_now());
    }

    #[test]
    fn the_log_tail_names_the_last_error_of_a_long_log() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(log_tail(d.path()), "", "no log, nothing to say");
        let mut log = String::from("(00.1) Error (criu/uffd.c:1): an early one\n");
        while log.len() < 200 << 10 {
            log.push_str("(00.2) uffd: 1-12: uffd_copy: 0x7f0000/4096\n");
        }
        log.push_str("(00.3) Error (criu/uffd.c:2): the last one\n(00.4) done\n");
        std::fs::write(d.path().join(LOG), log).unwrap();
        assert_eq!(
            log_tail(d.path()),
            ": (00.3) Error (criu/uffd.c:2): the last one"
        );
    }

    #[tokio::test]
    async fn a_daemon_that_cannot_start_says_why() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("file");
        std::fs::write(&file, "").unwrap();
        let e = Daemon::start(Path::new("/bin/true"), d.path(), &file.join("work"))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&e, LazyError::WorkDir { path, .. } if path.ends_with("file/work")),
            "{e}"
        );
        assert_eq!(
            LazyError::Exited {
                code: 1,
                log: ": (00.1) Error (criu/uffd.c:1): no".into()
            }
            .to_string(),
            "criu lazy-pages exited (status 1) before listening: (00.1) Error (criu/uffd.c:1): no"
        );
        assert_eq!(
            LazyError::NotListening { log: String::new() }.to_string(),
            "criu lazy-pages did not listen within 5s"
        );
    }

    #[test]
    fn page_bytes_counts_page_files_only() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("pages-1.img"), vec![0u8; 8192]).unwrap();
        std::fs::write(d.path().join("pages-2.img"), vec![0u8; 4096]).unwrap();
        std::fs::write(d.path().join("pagemap-1.img"), vec![0u8; 100]).unwrap();
        std::fs::create_dir(d.path().join("pages-3.img")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.path().join("pages-4.img")).unwrap();
        assert_eq!(page_bytes(d.path()), 12288);
        assert_eq!(page_bytes(&d.path().join("missing")), 0);
    }
}
