//! Where the private containerd and its state live, from the variables in CONVENTIONS
//! (`CRAB_HOME`, `CRAB_CONTAINERD_ADDRESS`, `CRAB_NAMESPACE`, `CRAB_RUNTIME`).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub const DEFAULT_NAMESPACE: &str = "crab-test";
pub const DEFAULT_RUNTIME: &str = "io.containerd.crab.v1";
pub const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
pub const BUSYBOX_IMAGE: &str = "localhost/crab/busybox:latest";

#[derive(Debug, Clone)]
pub struct TestEnv {
    pub crab_home: PathBuf,
    /// containerd's gRPC socket.
    pub address: PathBuf,
    pub namespace: String,
    pub runtime: String,
    pub image: String,
    /// The crab config of the CRI handlers `crab` and `crab-v1` (`CRAB_CRI_CONFIG`, default
    /// `$CRAB_HOME/containerd/cri-crab.toml`, as hack/containerd.sh writes it).
    pub cri_config: PathBuf,
    /// `CRAB_CONTAINERD=1.7`: the tests talk to the containerd 1.7 instance.
    pub containerd_17: bool,
}

impl TestEnv {
    pub fn from_env() -> Self {
        let crab_home = var("CRAB_HOME").map(PathBuf::from).unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(".crab")
        });
        let crab_home = crab_home.canonicalize().unwrap_or(crab_home);
        let address = var("CRAB_CONTAINERD_ADDRESS")
            .map(PathBuf::from)
            .unwrap_or_else(|| default_address(&crab_home));
        TestEnv {
            address,
            namespace: var("CRAB_NAMESPACE").unwrap_or_else(|| DEFAULT_NAMESPACE.into()),
            runtime: var("CRAB_RUNTIME").unwrap_or_else(|| DEFAULT_RUNTIME.into()),
            image: BUSYBOX_IMAGE.into(),
            cri_config: var("CRAB_CRI_CONFIG")
                .map(PathBuf::from)
                .unwrap_or_else(|| crab_home.join("containerd").join("cri-crab.toml")),
            containerd_17: var("CRAB_CONTAINERD").as_deref() == Some("1.7"),
            crab_home,
        }
    }

    /// containerd's state dir (`--state`): task bundles, shim sockets, rootfs mounts.
    pub fn containerd_state(&self) -> PathBuf {
        self.containerd_home().join("run").join("state")
    }

    /// The bundle containerd made for task `id` (config.json, rootfs, the shim's
    /// `bootstrap.json` with its socket address).
    pub fn task_bundle(&self, id: &str) -> PathBuf {
        self.containerd_state()
            .join("io.containerd.runtime.v2.task")
            .join(&self.namespace)
            .join(id)
    }

    pub fn containerd_root(&self) -> PathBuf {
        self.containerd_home().join("containerd").join("root")
    }

    /// The log of the containerd under test (hack/lib.sh's `CRAB_CONTAINERD_LOG`): with
    /// `CRAB_CONTAINERD=1.7` the 1.7 instance's, not 2.x's.
    pub fn containerd_log(&self) -> PathBuf {
        self.containerd_home()
            .join("containerd")
            .join("containerd.log")
    }

    /// The containerd log's length now: where the lines of what a test does next begin.
    pub fn containerd_log_len(&self) -> u64 {
        std::fs::metadata(self.containerd_log()).map_or(0, |m| m.len())
    }

    /// The containerd log from byte `from` on (the shims' log lines land there too).
    pub fn containerd_log_since(&self, from: u64) -> String {
        let text = std::fs::read(self.containerd_log()).unwrap_or_default();
        String::from_utf8_lossy(text.get(from as usize..).unwrap_or_default()).into_owned()
    }

    /// Where the containerd under test keeps its `containerd/` and `run/` (hack/lib.sh's
    /// `CRAB_CONTAINERD_HOME`): `CRAB_HOME`, or `CRAB_HOME/containerd-1.7-run` for 1.7.
    pub fn containerd_home(&self) -> PathBuf {
        if self.containerd_17 {
            self.crab_home.join("containerd-1.7-run")
        } else {
            self.crab_home.clone()
        }
    }

    /// Where this harness puts the FIFOs it hands to containerd.
    pub fn fifo_root(&self) -> PathBuf {
        self.crab_home.join("tmp").join("integration-fifo")
    }

    /// The directory `ctr` creates its FIFOs in (containerd's `defaults.DefaultFIFODir`).
    pub fn ctr_fifo_dir(&self) -> PathBuf {
        PathBuf::from("/run/containerd/fifo")
    }

    pub fn bench_dir(&self) -> PathBuf {
        self.crab_home.join("bench")
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Mirrors hack/lib.sh: a unix socket path must fit in sun_path and containerd derives a longer
/// `.ttrpc` path from it, so a deep CRAB_HOME puts the socket under /run/crab-<hash of CRAB_HOME>.
fn default_address(crab_home: &Path) -> PathBuf {
    let run = crab_home.join("run");
    let longest = run.join("containerd.sock.ttrpc");
    let dir = if longest.as_os_str().len() >= 104 {
        let hash = Sha256::digest(crab_home.as_os_str().as_encoded_bytes());
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        PathBuf::from(format!("/run/crab-{}", &hex[..12]))
    } else {
        run
    };
    dir.join("containerd.sock")
}
