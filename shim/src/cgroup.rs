//! A process's cgroup directories, on cgroup v1, v2 or the hybrid of both: from
//! `/proc/PID/cgroup` and the mount table (never assuming where hierarchies are mounted).

use std::{fs, path::PathBuf};

use crate::error::{Error, Result};

/// Where a process's cgroups are.
#[derive(Debug, Clone, Default)]
pub struct Cgroups {
    /// v1 hierarchies: (controllers, directory of the process in that hierarchy).
    v1: Vec<(Vec<String>, PathBuf)>,
    /// The process's directory in the cgroup2 (unified) hierarchy, if mounted.
    pub unified: Option<PathBuf>,
}

impl Cgroups {
    pub fn of(pid: u32) -> Result<Cgroups> {
        let membership = fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map_err(Error::io(format!("read /proc/{pid}/cgroup")))?;
        let mountinfo =
            fs::read_to_string("/proc/self/mountinfo").map_err(Error::io("read mountinfo"))?;
        Ok(Self::parse(&membership, &mountinfo))
    }

    fn parse(membership: &str, mountinfo: &str) -> Cgroups {
        // (fstype, super options, mount point), cgroup mounts only.
        let mounts: Vec<(&str, Vec<&str>, PathBuf)> = mountinfo
            .lines()
            .filter_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                let mut r = right.split_whitespace();
                let fstype = r.next()?;
                let super_opts = r.nth(1).unwrap_or("").split(',').collect();
                let mount_point = left.split_whitespace().nth(4)?;
                matches!(fstype, "cgroup" | "cgroup2")
                    .then(|| (fstype, super_opts, PathBuf::from(mount_point)))
            })
            .collect();
        let mut out = Cgroups::default();
        for line in membership.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let rel = path.trim_start_matches('/');
            if controllers.is_empty() {
                if let Some((_, _, mp)) = mounts.iter().find(|(t, _, _)| *t == "cgroup2") {
                    out.unified = Some(mp.join(rel));
                }
                continue;
            }
            let names: Vec<String> = controllers.split(',').map(str::to_owned).collect();
            let mount = mounts.iter().find(|(t, opts, _)| {
                *t == "cgroup" && names.iter().all(|n| opts.contains(&n.as_str()))
            });
            if let Some((_, _, mp)) = mount {
                out.v1.push((names, mp.join(rel)));
            }
        }
        out
    }

    /// The v1 directory of `controller`, when that controller is on a v1 hierarchy.
    pub fn v1(&self, controller: &str) -> Option<&PathBuf> {
        self.v1
            .iter()
            .find(|(names, _)| names.iter().any(|n| n == controller))
            .map(|(_, dir)| dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
30 25 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
33 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
";

    #[test]
    fn hybrid_and_pure_v2() {
        let c = Cgroups::parse(
            "4:memory:/ns/c1\n3:cpu,cpuacct:/ns/c1\n0::/ns/c1\n",
            MOUNTINFO,
        );
        assert_eq!(
            c.v1("memory").unwrap(),
            &PathBuf::from("/sys/fs/cgroup/memory/ns/c1")
        );
        assert_eq!(
            c.v1("cpuacct").unwrap(),
            &PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/ns/c1")
        );
        assert_eq!(c.v1("pids"), None);
        assert_eq!(
            c.unified.as_deref(),
            Some(std::path::Path::new("/sys/fs/cgroup/unified/ns/c1"))
        );
        let v2 = Cgroups::parse(
            "0::/kubepods/pod1/c2\n",
            "31 25 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        );
        assert_eq!(v2.v1("memory"), None);
        assert_eq!(
            v2.unified.as_deref(),
            Some(std::path::Path::new("/sys/fs/cgroup/kubepods/pod1/c2"))
        );
    }
}
