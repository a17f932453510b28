//! A container registry on 127.0.0.1 (Debian's `docker-registry`), for tests that push and
//! pull: another node's restore, the CRI's restore of a checkpoint archive (which pulls its
//! base image by digest).

use std::{
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::Duration,
};

/// A registry serving from a temporary directory; killed when dropped.
pub struct Registry {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    idle: bool,
    _dir: tempfile::TempDir,
}

impl Registry {
    pub fn start() -> Registry {
        Registry::start_apart(false)
    }

    /// With `apart`, the registry stands in for one on another host, in a benchmark on one
    /// host: it runs under SCHED_IDLE (`chrt --idle 0`: a CPU only when nothing else wants
    /// one) and keeps its storage in /dev/shm (its writes are not flushed by the `syncfs` that
    /// makes a checkpoint durable on the host's disk).
    pub fn start_apart(apart: bool) -> Registry {
        let dir = match apart {
            true => tempfile::tempdir_in("/dev/shm").unwrap(),
            false => tempfile::tempdir().unwrap(),
        };
        let idle = apart;
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        Registry::serve(dir, addr, idle)
    }

    /// Kills the registry (SIGKILL: a crash, mid-push or not); [`Registry::restart`] brings it
    /// back with the same storage and address.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The registry again, on its storage and address (after [`Registry::kill`]).
    pub fn restart(mut self) -> Registry {
        self.kill();
        let dir = std::mem::replace(&mut self._dir, tempfile::tempdir().unwrap());
        let (addr, idle) = (self.addr.clone(), self.idle);
        drop(self);
        Registry::serve(dir, addr, idle)
    }

    /// Where the registry keeps its blobs and manifests.
    pub fn data_dir(&self) -> std::path::PathBuf {
        self._dir.path().join("data")
    }

    fn serve(dir: tempfile::TempDir, addr: String, idle: bool) -> Registry {
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        let mut command = match idle {
            true => {
                let mut c = Command::new("chrt");
                c.args(["--idle", "0", "docker-registry"]);
                c
            }
            false => Command::new("docker-registry"),
        };
        let mut child = command
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry (hack/install-deps.sh installs it)");
        for _ in 0..100 {
            if std::net::TcpStream::connect(&addr).is_ok() {
                return Registry {
                    child,
                    addr,
                    idle,
                    _dir: dir,
                };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("docker-registry did not listen on {addr}");
    }
}

impl Registry {
    /// The CPU time the registry has used so far (user + system), in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        (ticks(11) + ticks(12)) / hz
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
