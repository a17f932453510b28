//! Where the shim itself runs: its cgroup and its OOM score.
//!
//! A container can make its shim do work (scans, layers, memory images). That work is bounded
//! (`[limits]`), and the shim is also placed so that the kernel charges and kills it like the
//! sandbox it serves, not like containerd:
//! - when containerd gives a `shim_cgroup` (runc's options, field `ShimCgroup`, written to the
//!   `start` command's stdin), the shim daemon joins that cgroup in every mounted hierarchy, as
//!   containerd's runc shim does;
//! - the shim starts one above containerd's `oom_score_adj` (typically -998: killed nearly last
//!   of all, before every tenant). It raises its own to that of the containers it serves when
//!   they are higher (the spec's `process.oomScoreAdj`). Raising needs no privilege; lowering
//!   needs `CAP_SYS_RESOURCE`, which crab never asks for (and hosts may withhold).

use std::{fs, io, path::PathBuf};

use crate::sys::{cgroup, mountinfo};

/// The environment variable `start` hands the daemon the cgroup in.
pub const SHIM_CGROUP_ENV: &str = "CRAB_SHIM_CGROUP";

/// Moves `pid` into cgroup `path` (absolute within each hierarchy, as runc's `ShimCgroup`) in
/// every mounted cgroup hierarchy that has it. Returns the directories joined; a hierarchy where
/// the cgroup exists but cannot be joined (a v1 cpuset cgroup without CPUs, say) is an error
/// that names every such hierarchy and those joined anyway: one failure does not stop the
/// others.
pub fn join_cgroup(pid: u32, path: &str) -> io::Result<Vec<PathBuf>> {
    let rel = path.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("shim cgroup {path:?} has a `..` component"),
        ));
    }
    let mounts = mountinfo::read_self()?;
    let mut joined = Vec::new();
    let mut failed: Vec<(PathBuf, io::Error)> = Vec::new();
    for mount_point in cgroup::hierarchy_mount_points(&mounts) {
        let dir = mount_point.join(rel);
        if !dir.is_dir() {
            continue;
        }
        match fs::write(dir.join("cgroup.procs"), pid.to_string()) {
            Ok(()) => joined.push(dir),
            Err(e) => failed.push((dir, e)),
        }
    }
    if let Some((_, first)) = failed.first() {
        return Err(io::Error::new(
            first.kind(),
            format!(
                "cannot join {} (joined: {})",
                failed
                    .iter()
                    .map(|(d, e)| format!("{}: {e}", d.display()))
                    .collect::<Vec<_>>()
                    .join("; "),
                if joined.is_empty() {
                    "none".to_string()
                } else {
                    joined
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        ));
    }
    if joined.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("shim cgroup {path:?} exists in no mounted cgroup hierarchy"),
        ));
    }
    Ok(joined)
}

pub fn oom_score_adj(pid: u32) -> io::Result<i32> {
    fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))?
        .trim()
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("oom_score_adj: {e}")))
}

/// Raises this process's `oom_score_adj` to `to` (clamped to 1000); never lowers it. Returns
/// the value in effect afterwards.
pub fn raise_own_oom_score_adj(to: i32) -> io::Result<i32> {
    let now = oom_score_adj(std::process::id())?;
    let to = to.min(1000);
    if to <= now {
        return Ok(now);
    }
    fs::write("/proc/self/oom_score_adj", to.to_string())?;
    Ok(to)
}

/// At daemon start: joins the cgroup `start` was given. (The framework's `start` already set
/// the daemon's `oom_score_adj` to containerd's + 1.)
pub fn place_daemon() {
    let Ok(path) = std::env::var(SHIM_CGROUP_ENV) else {
        return;
    };
    match join_cgroup(std::process::id(), &path) {
        Ok(dirs) => log::info!(
            "shim joined cgroup {path} ({})",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Err(e) => log::warn!("shim cannot join cgroup {path}: {e}"),
    }
}

/// A container this shim serves runs with `oom_score_adj` `score`: the shim, whose memory the
/// container can drive, is raised to it, so the kernel never prefers a neighbour over it.
pub fn follow_container_oom_score(container_id: &str, score: i32) {
    match raise_own_oom_score_adj(score) {
        Ok(now) => log::debug!("shim oom_score_adj {now} (container {container_id}: {score})"),
        Err(e) => {
            log::warn!("cannot raise the shim's oom_score_adj to {score} ({container_id}): {e}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shim_cgroup_with_dot_dot_is_refused() {
        let e = join_cgroup(1, "/a/../../etc").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }

    /// In a child (the test process must keep its score): raising works without privileges,
    /// lowering is never attempted.
    #[test]
    fn oom_score_is_only_raised() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "placement::tests::oom_child",
                "--nocapture",
                "--include-ignored",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("oom child ok"),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    #[ignore = "run by oom_score_is_only_raised in a child process"]
    fn oom_child() {
        let before = oom_score_adj(std::process::id()).unwrap();
        let target = (before + 7).min(1000);
        assert_eq!(raise_own_oom_score_adj(target).unwrap(), target);
        assert_eq!(
            raise_own_oom_score_adj(target - 3).unwrap(),
            target,
            "never lowered"
        );
        assert_eq!(oom_score_adj(std::process::id()).unwrap(), target);
        println!("oom child ok");
    }
}
