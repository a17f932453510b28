//! A second (or third) private containerd on this machine, standing for another node: its own
//! CRAB_HOME (state, socket, crab store), the shim this checkout built.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use crate::TestEnv;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A second private containerd (hack/containerd.sh with its own CRAB_HOME); stopped, with its
/// containers, when dropped.
pub struct Node {
    pub env: TestEnv,
}

impl Node {
    pub fn start(home: &Path) -> Node {
        let bin = home.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let shim = repo()
            .join("target/release/containerd-shim-crab-v1")
            .canonicalize()
            .unwrap();
        let link = bin.join("containerd-shim-crab-v1");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(shim, link).unwrap();
        let node = Node {
            env: Node::env(home),
        };
        node.hack("start");
        node
    }

    fn env(home: &Path) -> TestEnv {
        let out = Command::new(repo().join("hack/containerd.sh"))
            .arg("env")
            .env("CRAB_HOME", home)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let address = text
            .lines()
            .find_map(|l| l.strip_prefix("export CRAB_CONTAINERD_ADDRESS="))
            .map(|v| PathBuf::from(v.trim_matches(|c| c == '\'' || c == '"')))
            .unwrap_or_else(|| panic!("hack/containerd.sh env: {text}"));
        TestEnv {
            crab_home: home.to_path_buf(),
            address,
            ..TestEnv::from_env()
        }
    }

    pub fn hack(&self, cmd: &str) {
        let out = Command::new(repo().join("hack/containerd.sh"))
            .arg(cmd)
            .env("CRAB_HOME", &self.env.crab_home)
            .env_remove("CRAB_CONTAINERD_ADDRESS")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "hack/containerd.sh {cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.hack("stop");
    }
}
