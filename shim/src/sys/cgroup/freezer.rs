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

/// A real process to freeze, for the tests here and the checkpoint tests that freeze one.
#[cfg(test)]
pub(crate) mod test_support {
    use std::{
        fs,
        os::unix::fs::MetadataExt,
        path::{Path, PathBuf},
        process::{Child, Command, Stdio},
        time::Duration,
    };

    use nix::mount::{mount, umount2, MntFlags, MsFlags};

    /// A small tmpfs mounted on a directory, unmounted on drop.
    struct Tmpfs(PathBuf);

    impl Tmpfs {
        fn mount(dir: &Path) -> Tmpfs {
            mount(
                Some("tmpfs"),
                dir,
                Some("tmpfs"),
                MsFlags::empty(),
                Some("size=1m"),
            )
            .unwrap_or_else(|e| {
                panic!("mount tmpfs on {}: {e} (tests run as root)", dir.display())
            });
            Tmpfs(dir.to_path_buf())
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = umount2(&self.0, MntFlags::MNT_DETACH);
        }
    }

    /// A process that counts as fast as it can into `<dir>/f`, in its own cgroup; everything
    /// is undone on drop.
    pub(crate) struct Counter {
        pub(crate) child: Child,
        file: PathBuf,
        pub(crate) cgroup: PathBuf,
        // On tmpfs: ext4 flushes a file truncated by `>` (auto_da_alloc), so the counter there
        // spends its time in open() and reads as empty.
        _tmpfs: Tmpfs,
        _dir: tempfile::TempDir,
    }

    impl Counter {
        /// In a new cgroup `crab-test-<our pid>-<tag>` under `parent`.
        pub(crate) fn start(parent: &Path, tag: &str) -> Option<Counter> {
            remove_stale_cgroups(parent);
            let cgroup = parent.join(format!("crab-test-{}-{tag}", std::process::id()));
            if let Err(e) = fs::create_dir(&cgroup) {
                eprintln!("cannot create cgroup {}: {e}", cgroup.display());
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let tmpfs = Tmpfs::mount(dir.path());
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "i=0; while :; do i=$((i+1)); echo $i > f; done"])
                .current_dir(dir.path())
                .stdout(Stdio::null());
            // Dies with the test even if the test run is killed.
            // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
            // which is async-signal-safe; it touches no memory shared with the parent.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let child = cmd.spawn().unwrap();
            while !dir.path().join("f").exists() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let c = Counter {
                file: dir.path().join("f"),
                child,
                cgroup,
                _tmpfs: tmpfs,
                _dir: dir,
            };
            fs::write(c.cgroup.join("cgroup.procs"), c.child.id().to_string()).unwrap();
            Some(c)
        }

        /// The counter file's content and mtime: a freeze may catch the shell between the
        /// truncation and the write, so an empty file is a valid state too.
        fn snapshot(&self) -> (String, i64, i64) {
            let md = fs::metadata(&self.file).unwrap();
            (
                fs::read_to_string(&self.file).unwrap(),
                md.mtime(),
                md.mtime_nsec(),
            )
        }

        pub(crate) fn is_counting(&self) -> bool {
            let a = self.snapshot();
            std::thread::sleep(Duration::from_millis(300));
            self.snapshot() != a
        }
    }

    impl Drop for Counter {
        fn drop(&mut self) {
            let _ = self.child.kill();
            for (file, value) in [("freezer.state", "THAWED"), ("cgroup.freeze", "0")] {
                if self.cgroup.join(file).exists() {
                    let _ = fs::write(self.cgroup.join(file), value);
                }
            }
            let _ = self.child.wait();
            for _ in 0..100 {
                if fs::remove_dir(&self.cgroup).is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            eprintln!("could not remove {}", self.cgroup.display());
        }
    }

    /// Test cgroups of test runs that were killed (their pid is gone): thawed, emptied, removed.
    fn remove_stale_cgroups(parent: &Path) {
        let Ok(entries) = fs::read_dir(parent) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // Exactly `crab-test-<pid>-<tag>`, never a containerd namespace's cgroup.
            let Some((pid, tag)) = name
                .strip_prefix("crab-test-")
                .and_then(|r| r.split_once('-'))
            else {
                continue;
            };
            if pid.is_empty()
                || !pid.bytes().all(|b| b.is_ascii_digit())
                || !["v1", "v2", "bench"].contains(&tag)
            {
                continue;
            }
            if Path::new("/proc").join(pid).exists() {
                continue;
            }
            let dir = e.path();
            for (file, value) in [("freezer.state", "THAWED"), ("cgroup.freeze", "0")] {
                let _ = fs::write(dir.join(file), value);
            }
            for p in fs::read_to_string(dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
            {
                if let Ok(p) = p.parse::<i32>() {
                    // SAFETY: kill(2) has no memory-safety preconditions.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
            for _ in 0..100 {
                if fs::remove_dir(&dir).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::Counter;
    use super::*;

    fn exercise(counter: &Counter, f: &CgroupFreezer) {
        assert!(counter.is_counting(), "counts before the freeze");
        let t = Instant::now();
        f.freeze().unwrap();
        eprintln!("{:?} froze in {:?}", f.version(), t.elapsed());
        assert!(!counter.is_counting(), "stopped while frozen");
        // Nested use keeps it frozen until the outermost thaw.
        f.freeze().unwrap();
        f.thaw().unwrap();
        assert!(!counter.is_counting(), "still frozen after a nested thaw");
        f.thaw().unwrap();
        assert!(counter.is_counting(), "counts again after the thaw");
        // Frozen by someone else (a user's pause): left frozen.
        f.request(true).unwrap();
        f.wait_frozen().unwrap();
        f.freeze().unwrap();
        f.thaw().unwrap();
        assert!(
            !counter.is_counting(),
            "a pause from outside survives our thaw"
        );
        f.request(false).unwrap();
        assert!(counter.is_counting());
    }

    #[test]
    fn cgroup_v1_freezer_stops_a_real_process() {
        let root = Path::new("/sys/fs/cgroup/freezer");
        if !root.join("freezer.state").exists() && !root.join("cgroup.procs").exists() {
            eprintln!("no v1 freezer hierarchy here (pure cgroup v2): see the v2 test");
            return;
        }
        let counter = Counter::start(root, "v1").expect("v1 freezer cgroup");
        let f = CgroupFreezer::for_pid(counter.child.id()).unwrap();
        assert_eq!(
            (f.version(), f.dir()),
            (CgroupVersion::V1, counter.cgroup.as_path())
        );
        exercise(&counter, &f);
    }

    #[test]
    fn cgroup_v2_freezer_stops_a_real_process() {
        let Ok(mount) = super::super::cgroup2_mount() else {
            eprintln!("no cgroup2 mount: skipped");
            return;
        };
        let mp = &mount.mount_point;
        let Some(counter) = Counter::start(mp, "v2") else {
            panic!("cannot create a cgroup2 cgroup under {}", mp.display());
        };
        let f = CgroupFreezer::new(counter.cgroup.clone(), CgroupVersion::V2);
        exercise(&counter, &f);
    }
}
