//! What a container leaves on the host, found by scanning /proc, /sys/fs/cgroup and containerd's
//! directories. Everything is matched on whole path components or argv entries equal to the
//! container id, so ids that share a prefix never match each other.

use std::fs;
use std::path::{Path, PathBuf};

use crate::TestEnv;

/// A pid with its argv, for reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    pub pid: i32,
    pub argv: Vec<String>,
}

impl std::fmt::Display for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} [{}]", self.pid, self.argv.join(" "))
    }
}

fn pids() -> Vec<i32> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

fn argv(pid: i32) -> Option<Vec<String>> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None; // kernel thread or zombie
    }
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// True when argv[0] is a containerd shim binary (`containerd-shim-crab-v1`, `-runc-v2`, ...).
fn is_shim(argv: &[String]) -> bool {
    argv.first()
        .and_then(|a0| Path::new(a0).file_name())
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("containerd-shim-"))
}

fn flag_value<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    argv.windows(2)
        .find(|w| w[0] == flag || w[0] == format!("-{flag}"))
        .map(|w| w[1].as_str())
}

/// Shim processes serving container `id` (`-id <id>` in their command line).
pub fn shim_processes(id: &str) -> Vec<Proc> {
    pids()
        .into_iter()
        .filter_map(|pid| {
            let argv = argv(pid)?;
            (is_shim(&argv) && flag_value(&argv, "-id") == Some(id)).then_some(Proc { pid, argv })
        })
        .collect()
}

/// Every shim process of the containerd listening on `address`, with its `-id`.
pub fn shims_of(address: &Path) -> Vec<(String, Proc)> {
    let address = address.to_string_lossy();
    pids()
        .into_iter()
        .filter_map(|pid| {
            let argv = argv(pid)?;
            if !is_shim(&argv) || flag_value(&argv, "-address") != Some(address.as_ref()) {
                return None;
            }
            let id = flag_value(&argv, "-id")?.to_string();
            Some((id, Proc { pid, argv }))
        })
        .collect()
}

/// Processes inside container `id`: those whose cgroup path (any hierarchy) has a component `id`.
pub fn container_processes(id: &str) -> Vec<Proc> {
    pids()
        .into_iter()
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|cg| {
                cg.lines().any(|l| {
                    l.splitn(3, ':')
                        .nth(2)
                        .is_some_and(|path| path.split('/').any(|c| c == id))
                })
            })
        })
        .filter_map(|pid| {
            Some(Proc {
                pid,
                argv: argv(pid)?,
            })
        })
        .collect()
}

/// The cgroup hierarchies mounted on this host (v1 controllers and the v2 tree).
pub fn cgroup_mounts() -> Vec<PathBuf> {
    mountinfo()
        .into_iter()
        .filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2")
        .map(|m| m.mount_point)
        .collect()
}

/// Directories named `id` in any cgroup hierarchy (at the depths containerd and runc use).
pub fn cgroup_dirs(id: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for root in cgroup_mounts() {
        find_named(&root, id, 4, false, &mut found);
    }
    found
}

#[derive(Debug, Clone)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fstype: String,
    pub source: String,
    pub line: String,
}

pub fn mountinfo() -> Vec<MountEntry> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            Some(MountEntry {
                mount_point: PathBuf::from(unescape_mountinfo(fields.get(4)?)),
                fstype: fields.get(sep + 1)?.to_string(),
                source: fields.get(sep + 2)?.to_string(),
                line: line.to_string(),
            })
        })
        .collect()
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mounts whose mount point has a path component equal to `id`.
pub fn mounts_of(id: &str) -> Vec<MountEntry> {
    mountinfo()
        .into_iter()
        .filter(|m| m.mount_point.iter().any(|c| c == id))
        .collect()
}

/// Files or directories whose name starts with `id` under containerd's state dir, the runc
/// state dirs of both shims (the stock one's and crab's default `runc.root`) and the FIFO dir
/// ctr uses: bundles, sockets, FIFOs left behind.
pub fn state_entries(env: &TestEnv, id: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let roots = [
        env.containerd_state(),
        env.ctr_fifo_dir(),
        PathBuf::from("/run/containerd/runc").join(&env.namespace),
        crab_runtime_config::RuncConfig::default()
            .root
            .join(&env.namespace),
    ];
    for root in roots {
        find_named(&root, id, 6, true, &mut found);
    }
    found
}

/// Depth-limited walk for entries named `name` (or, with `prefix`, starting with `name-` or equal
/// to it). Does not follow symlinks and never descends into rootfs mounts of live containers.
fn find_named(dir: &Path, name: &str, depth: usize, prefix: bool, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let fname = e.file_name();
        let fname = fname.to_string_lossy();
        let matches = fname == name
            || (prefix
                && (fname.starts_with(&format!("{name}-"))
                    || fname.starts_with(&format!("{name}."))));
        if matches {
            out.push(e.path());
            continue;
        }
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && depth > 1 && fname != "rootfs" {
            find_named(&e.path(), name, depth - 1, prefix, out);
        }
    }
}

/// Everything container `id` left on the host; empty means clean.
pub fn leaks(env: &TestEnv, id: &str) -> Vec<String> {
    let mut l = Vec::new();
    l.extend(
        shim_processes(id)
            .iter()
            .map(|p| format!("shim process {p}")),
    );
    l.extend(
        container_processes(id)
            .iter()
            .map(|p| format!("container process {p}")),
    );
    l.extend(
        cgroup_dirs(id)
            .iter()
            .map(|d| format!("cgroup dir {}", d.display())),
    );
    l.extend(mounts_of(id).iter().map(|m| format!("mount {}", m.line)));
    l.extend(
        state_entries(env, id)
            .iter()
            .map(|p| format!("state entry {}", p.display())),
    );
    l
}

/// Polls `f` every 50 ms until it returns `Some` or `timeout` passes.
pub fn eventually<T>(timeout: std::time::Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Reads the shared counter file of a process's root, for freeze checks (works while frozen).
pub fn read_in_root(pid: u32, path: &str) -> std::io::Result<String> {
    fs::read_to_string(format!("/proc/{pid}/root/{}", path.trim_start_matches('/')))
}

/// The file `file` of `controller` (a v1 controller such as `memory` or `pids`; `""` for the
/// v2 tree) in the cgroup of process `pid`, as the host sees it.
pub fn cgroup_file(pid: u32, controller: &str, file: &str) -> Option<PathBuf> {
    let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = cg.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        let hit = if controller.is_empty() {
            ctrls.is_empty()
        } else {
            ctrls.split(',').any(|c| c == controller)
        };
        hit.then(|| path.to_string())
    })?;
    let mount = mountinfo().into_iter().find(|m| {
        if controller.is_empty() {
            return m.fstype == "cgroup2";
        }
        // The super options (last field of a mountinfo line) name the controllers.
        m.fstype == "cgroup"
            && m.line
                .rsplit(' ')
                .next()
                .is_some_and(|opts| opts.split(',').any(|o| o == controller))
    })?;
    Some(
        mount
            .mount_point
            .join(rel.trim_start_matches('/'))
            .join(file),
    )
}

/// A host directory's tree as a sorted listing, one line per entry: `path/` for a directory,
/// `path -> target` for a symlink (never followed: a volume may hold links a co-tenant made),
/// `path content` (trimmed) for anything else; for comparing a volume's host directory with
/// what a checkpoint held.
pub fn tree_listing(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let kind = fs::symlink_metadata(&p).unwrap().file_type();
            if kind.is_dir() {
                out.push(format!("{rel}/"));
                walk(root, &p, out);
            } else if kind.is_symlink() {
                let target = fs::read_link(&p).unwrap();
                out.push(format!("{rel} -> {}", target.display()));
            } else {
                let data = fs::read(&p).unwrap();
                out.push(format!("{rel} {}", String::from_utf8_lossy(&data).trim()));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}
