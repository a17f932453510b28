//! OCI runtime specs for test containers, equivalent to what `ctr run` generates
//! (containerd's default unix spec), so gRPC- and ctr-created containers look alike to the shim.

use serde_json::{json, Value};

pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";
pub const PROCESS_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";

const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// The process part of a spec: what to run and how.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub args: Vec<String>,
    pub env: Vec<String>,
    /// `None`: the image's WorkingDir (or `/`).
    pub cwd: Option<String>,
    pub terminal: bool,
    /// Capabilities granted beyond the default set (bounding, effective, permitted).
    pub extra_caps: Vec<String>,
}

impl ProcessSpec {
    pub fn new<S: AsRef<str>>(args: &[S]) -> Self {
        ProcessSpec {
            args: args.iter().map(|a| a.as_ref().to_string()).collect(),
            env: Vec::new(),
            cwd: None,
            terminal: false,
            extra_caps: Vec::new(),
        }
    }

    /// `sh -c SCRIPT`.
    pub fn sh(script: &str) -> Self {
        Self::new(&["sh", "-c", script])
    }

    /// Grants `cap` (`CAP_NET_ADMIN`, ...) too.
    pub fn cap(mut self, cap: &str) -> Self {
        self.extra_caps.push(cap.to_string());
        self
    }

    pub fn cwd(mut self, cwd: &str) -> Self {
        self.cwd = Some(cwd.to_string());
        self
    }

    pub fn terminal(mut self, terminal: bool) -> Self {
        self.terminal = terminal;
        self
    }

    pub fn env(mut self, kv: &str) -> Self {
        self.env.push(kv.to_string());
        self
    }

    /// The OCI `process` object. `image_env`/`image_cwd` come from the image config; explicit
    /// settings win, and a PATH is always present (busybox images built by umoci may lack one).
    pub fn to_oci(&self, image_env: &[String], image_cwd: &str) -> Value {
        let mut env: Vec<String> = image_env.to_vec();
        for kv in &self.env {
            let key = kv.split('=').next().unwrap_or_default();
            env.retain(|e| e.split('=').next() != Some(key));
            env.push(kv.clone());
        }
        if !env.iter().any(|e| e.starts_with("PATH=")) {
            env.insert(0, DEFAULT_PATH.to_string());
        }
        let cwd = match (&self.cwd, image_cwd) {
            (Some(c), _) => c.clone(),
            (None, "") => "/".to_string(),
            (None, c) => c.to_string(),
        };
        let caps: Vec<&str> = CAPS
            .iter()
            .copied()
            .chain(self.extra_caps.iter().map(String::as_str))
            .collect();
        json!({
            "terminal": self.terminal,
            "user": {"uid": 0, "gid": 0, "additionalGids": [0]},
            "args": self.args,
            "env": env,
            "cwd": cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true,
        })
    }
}

/// A full runtime spec for container `id` in `namespace`. The cgroup path is `/<ns>/<id>`, as
/// `ctr` uses, which the leak checks rely on.
pub fn container_spec(id: &str, namespace: &str, process: Value) -> Value {
    let dev = |major: i64, minor: Option<i64>| {
        let mut d = json!({"allow": true, "type": "c", "major": major, "access": "rwm"});
        if let Some(m) = minor {
            d["minor"] = json!(m);
        }
        d
    };
    json!({
        "ociVersion": "1.1.0",
        "process": process,
        "root": {"path": "rootfs"},
        "hostname": id.chars().take(63).collect::<String>(),
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}
        ],
        "linux": {
            "resources": {"devices": [
                {"allow": false, "access": "rwm"},
                dev(1, Some(3)), dev(1, Some(8)), dev(1, Some(7)), dev(5, Some(0)), dev(1, Some(5)),
                dev(1, Some(9)), dev(5, Some(1)), dev(136, None), dev(5, Some(2))
            ]},
            "cgroupsPath": format!("/{namespace}/{id}"),
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}],
            "maskedPaths": [
                "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
                "/sys/devices/virtual/powercap", "/proc/scsi"
            ],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
        }
    })
}
