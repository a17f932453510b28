//! A process that keeps writing, in a cgroup of its own: frozen, it stops.

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
        .unwrap_or_else(|e| panic!("mount tmpfs on {}: {e} (tests run as root)", dir.display()));
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
pub struct Counter {
    pub child: Child,
    file: PathBuf,
    pub cgroup: PathBuf,
    // On tmpfs: ext4 flushes a file truncated by `>` (auto_da_alloc), so the counter there
    // spends its time in open() and reads as empty.
    _tmpfs: Tmpfs,
    _dir: tempfile::TempDir,
}

impl Counter {
    /// In a new cgroup `crab-test-<our pid>-<tag>` under `parent`.
    pub fn start(parent: &Path, tag: &str) -> Option<Counter> {
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

    pub fn is_counting(&self) -> bool {
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
