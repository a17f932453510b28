//! The cgroup freezer of a container: stops every process of a cgroup (v1 `freezer`
//! controller or cgroup2's core freezer) and resumes them, for checkpoints that must see a
//! container standing still.

use std::{
    io,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

/// Stops and resumes every process of a container.
pub trait Freezer {
    /// Returns once every process is stopped.
    fn freeze(&self) -> io::Result<()>;
    fn thaw(&self) -> io::Result<()>;
}

/// A container frozen by [`Frozen::freeze`]: thawed on drop unless thawed explicitly, so every
/// error path between freeze and thaw resumes it. `during` names the work in the log line of
/// a thaw on drop that failed ("a failed capture").
pub struct Frozen<'a> {
    freezer: &'a dyn Freezer,
    during: &'static str,
    armed: bool,
}

impl<'a> Frozen<'a> {
    pub fn freeze(freezer: &'a dyn Freezer, during: &'static str) -> io::Result<Frozen<'a>> {
        freezer.freeze()?;
        Ok(Frozen {
            freezer,
            during,
            armed: true,
        })
    }

    pub fn thaw(mut self) -> io::Result<()> {
        self.armed = false;
        self.freezer.thaw()
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.freezer.thaw() {
                log::error!("thawing the container after {}: {e}", self.during);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The v1 `freezer` controller: `freezer.state`.
    V1,
    /// cgroup2's core freezer: `cgroup.freeze`, `cgroup.events`.
    V2,
}

/// The cgroup freezer of a container. Nests: while frozen, `freeze` only counts and the
/// matching `thaw` resumes at the outermost level; a cgroup that was already frozen by someone
/// else (a user's pause) is left frozen.
#[derive(Debug)]
pub struct CgroupFreezer {
    dir: PathBuf,
    version: CgroupVersion,
    timeout: Duration,
    state: Mutex<FreezeState>,
}

#[derive(Debug, Default)]
struct FreezeState {
    depth: u32,
    /// Frozen before our outermost freeze: not ours to thaw.
    external: bool,
}

impl CgroupFreezer {
    /// The freezer of `pid`'s cgroup: the v1 `freezer` controller where it is mounted (hybrid
    /// hosts), cgroup2's otherwise.
    pub fn for_pid(pid: u32) -> io::Result<CgroupFreezer> {
        let cgroups = super::Cgroups::of(pid).map_err(|e| io::Error::other(e.to_string()))?;
        if let Some(dir) = cgroups.v1("freezer") {
            return Ok(CgroupFreezer::new(dir.clone(), CgroupVersion::V1));
        }
        match cgroups.unified {
            Some(dir) if dir.join("cgroup.freeze").exists() => Ok(CgroupFreezer::new(dir, CgroupVersion::V2)),
            Some(dir) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("pid {pid}: cgroup {} has no cgroup.freeze (the root cgroup, or a kernel before 5.2)", dir.display()),
            )),
            None => Err(io::Error::new(io::ErrorKind::NotFound, format!("pid {pid}: no freezer cgroup (neither v1 freezer nor cgroup2)"))),
        }
    }

    pub fn new(dir: PathBuf, version: CgroupVersion) -> CgroupFreezer {
        CgroupFreezer {
            dir,
            version,
            timeout: Duration::from_secs(5),
            state: Mutex::default(),
        }
    }

    /// How long `freeze` waits for every task to stop before giving up (and thawing).
    pub fn with_timeout(mut self, timeout: Duration) -> CgroupFreezer {
        self.timeout = timeout;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the cgroup was frozen by someone else (a user's pause) when this freezer's
    /// outermost `freeze` found it: `thaw` then leaves it frozen.
    pub fn frozen_by_someone_else(&self) -> bool {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.depth > 0 && st.external
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    fn control_file(&self) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => "freezer.state",
            CgroupVersion::V2 => "cgroup.freeze",
        })
    }

    fn request(&self, frozen: bool) -> io::Result<()> {
        let value = match (self.version, frozen) {
            (CgroupVersion::V1, true) => "FROZEN",
            (CgroupVersion::V1, false) => "THAWED",
            (CgroupVersion::V2, true) => "1",
            (CgroupVersion::V2, false) => "0",
        };
        let path = self.control_file();
        std::fs::write(&path, value).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("write {value} to {}: {e}", path.display()),
            )
        })
    }

    fn is_frozen(&self) -> io::Result<bool> {
        let (path, frozen) = match self.version {
            CgroupVersion::V1 => (self.dir.join("freezer.state"), "FROZEN"),
            CgroupVersion::V2 => (self.dir.join("cgroup.events"), "frozen 1"),
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("read {}: {e}", path.display())))?;
        Ok(text.lines().any(|l| l.trim() == frozen))
    }

    fn wait_frozen(&self) -> io::Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        let mut last_request = start;
        loop {
            if self.is_frozen()? {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{} did not freeze within {:?} (a task in uninterruptible sleep?)",
                        self.dir.display(),
                        self.timeout
                    ),
                ));
            }
            // v1 can stay FREEZING when tasks fork while it freezes; asking again moves it on.
            if self.version == CgroupVersion::V1
                && last_request.elapsed() > Duration::from_millis(10)
            {
                self.request(true)?;
                last_request = Instant::now();
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl Freezer for CgroupFreezer {
    fn freeze(&self) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.depth > 0 {
            st.depth += 1;
            return Ok(());
        }
        if self.is_frozen()? {
            log::debug!(
                "{} is already frozen: leaving it frozen after the checkpoint",
                self.dir.display()
            );
            *st = FreezeState {
                depth: 1,
                external: true,
            };
            return Ok(());
        }
        self.request(true)?;
        if let Err(e) = self.wait_frozen() {
            if let Err(t) = self.request(false) {
                log::error!("thawing {} after a failed freeze: {t}", self.dir.display());
            }
            return Err(e);
        }
        *st = FreezeState {
            depth: 1,
            external: false,
        };
        Ok(())
    }

    fn thaw(&self) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.depth == 0 {
            return Ok(());
        }
        st.depth -= 1;
        if st.depth > 0 {
            return Ok(());
        }
        if std::mem::take(&mut st.external) {
            return Ok(());
        }
        self.request(false)
    }
}

/// What the root-only tests of real freezers (`tests/root_sys.rs`) do besides freezing: freeze
/// and thaw as someone else (a user's pause) would, and wait for it.
#[doc(hidden)]
pub mod testing {
    use super::*;

    /// Writes the freezer's control file, frozen or thawed, without counting it as ours.
    pub fn request(f: &CgroupFreezer, frozen: bool) -> io::Result<()> {
        f.request(frozen)
    }

    /// Waits until the cgroup is frozen.
    pub fn wait_frozen(f: &CgroupFreezer) -> io::Result<()> {
        f.wait_frozen()
    }
}
