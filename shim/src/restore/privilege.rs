//! Least privilege for restored processes: a CRIU image may not ask for more than the new
//! container's OCI spec grants.
//!
//! CRIU restores credentials, capability sets, no_new_privs, seccomp and namespaces from the
//! image, and runc does not re-apply the spec's process settings on restore. So a process
//! image is a request to run processes with whatever it records, and it is checked against
//! the spec before CRIU runs. This holds whoever signed the image: an image crab itself
//! exported from a privileged container is still refused under an unprivileged spec.
//!
//! What "grants" means, per item (each the most a process of the new container could reach
//! by itself, never less than what it starts with):
//! - bounding set: within the spec's bounding set;
//! - permitted and effective sets: within the spec's bounding set (a root process or a
//!   set-uid program reaches it by exec), or within the spec's permitted set when the spec
//!   sets no_new_privs (then no exec can raise them);
//! - inheritable and ambient sets: within the spec's inheritable set plus what the permitted
//!   sets may reach;
//! - uids and gids: the spec's user and groups, unless CAP_SETUID (CAP_SETGID) is within
//!   reach, with which a process may take any id of its user namespace;
//! - no_new_privs: set on every thread when the spec sets it;
//! - seccomp: a filter on every thread when the spec has one. Which filter is not compared
//!   (the spec's profile is compiled by runc; the image holds CRIU's copy of the loaded
//!   programs): a filter other than the spec's can only come from an image whose signature
//!   a trusted key made (see `provenance`);
//! - namespaces: every namespace type the spec lists is one CRIU creates for the root task
//!   (otherwise CRIU would restore the processes into its own, the host's, namespace).

use oci_spec::runtime::{LinuxNamespaceType, Spec};

use crate::checkpoint::criu_image::{ns, Creds, ImageFacts};

/// Capability numbers by name (`include/uapi/linux/capability.h`).
const CAP_NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];
const CAP_SETGID: u64 = 1 << 6;
const CAP_SETUID: u64 = 1 << 7;
const CAP_SETPCAP: u64 = 1 << 8;

/// The names of the capabilities in `set` (numbers for those without a name).
pub fn cap_names(set: u64) -> Vec<String> {
    (0..64)
        .filter(|bit| set & (1u64 << bit) != 0)
        .map(|bit| {
            CAP_NAMES
                .get(bit)
                .map_or_else(|| format!("capability {bit}"), |n| n.to_string())
        })
        .collect()
}

fn cap_bit(name: &str) -> Option<u64> {
    CAP_NAMES
        .iter()
        .position(|n| *n == name)
        .map(|bit| 1u64 << bit)
}

/// What the new container's spec grants its processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Granted {
    pub uid: u32,
    pub gids: Vec<u32>,
    pub bounding: u64,
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
    pub ambient: u64,
    pub no_new_privs: bool,
    pub seccomp: bool,
    /// The namespace types the spec lists (`clone(2)` flags), created or joined.
    pub namespaces: u32,
}

impl Granted {
    pub fn from_spec(spec: &Spec) -> Granted {
        let mut g = Granted::default();
        if let Some(p) = spec.process() {
            g.uid = p.user().uid();
            g.gids.push(p.user().gid());
            g.gids
                .extend(p.user().additional_gids().iter().flatten().copied());
            g.no_new_privs = p.no_new_privileges().unwrap_or(false);
            if let Some(caps) = p.capabilities() {
                let set = |s: &Option<oci_spec::runtime::Capabilities>| -> u64 {
                    s.iter()
                        .flatten()
                        .filter_map(|c| {
                            let name = serde_json::to_value(c).ok()?;
                            cap_bit(name.as_str()?)
                        })
                        .fold(0, |acc, bit| acc | bit)
                };
                g.bounding = set(caps.bounding());
                g.effective = set(caps.effective());
                g.permitted = set(caps.permitted());
                g.inheritable = set(caps.inheritable());
                g.ambient = set(caps.ambient());
            }
        }
        if let Some(linux) = spec.linux() {
            g.seccomp = linux.seccomp().is_some();
            for n in linux.namespaces().iter().flatten() {
                g.namespaces |= match n.typ() {
                    LinuxNamespaceType::Mount => ns::MNT,
                    LinuxNamespaceType::Uts => ns::UTS,
                    LinuxNamespaceType::Ipc => ns::IPC,
                    LinuxNamespaceType::User => ns::USER,
                    LinuxNamespaceType::Pid => ns::PID,
                    LinuxNamespaceType::Network => ns::NET,
                    LinuxNamespaceType::Time => ns::TIME,
                    // CRIU handles the cgroup namespace apart from the others: not compared.
                    LinuxNamespaceType::Cgroup => 0,
                };
            }
        }
        g
    }

    /// The most the permitted and effective sets may hold.
    pub fn permitted_ceiling(&self) -> u64 {
        if self.no_new_privs {
            self.permitted
        } else {
            self.bounding | self.permitted
        }
    }

    fn inheritable_ceiling(&self) -> u64 {
        let reach = if self.permitted_ceiling() & CAP_SETPCAP != 0 {
            self.bounding
        } else {
            self.permitted_ceiling()
        };
        self.inheritable | reach
    }
}

/// What an image asks for beyond the spec, for the error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("checkpoint image asks for more privilege than the container's spec grants: {0}")]
pub struct Excess(pub String);

/// Checks every thread of `facts` against `granted`: the first excess found is the error.
pub fn check(facts: &ImageFacts, granted: &Granted) -> Result<(), Excess> {
    let missing = granted.namespaces & !facts.namespaces;
    if missing != 0 {
        return Err(Excess(format!(
            "the spec isolates the {} namespace(s) but the image's processes would share CRIU's \
             (the host's): it was dumped outside such namespaces",
            ns::names(missing).join(", ")
        )));
    }
    for t in &facts.threads {
        let Some(c) = &t.creds else { continue };
        check_creds(c, granted).map_err(|what| {
            Excess(format!(
                "process {} (thread {}, {:?}) {what}",
                t.pid, t.tid, t.comm
            ))
        })?;
    }
    Ok(())
}

/// What one thread's credentials hold beyond what the spec grants ([`check_creds`]); its
/// text follows the thread ("process 7 (thread 7, \"sh\") has effective capabilities ...").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredsExcess {
    /// Capabilities of set `set` (bounding, permitted, ...) beyond its ceiling.
    #[error("has {set} capabilities {} the spec does not grant", cap_names(*.extra).join(", "))]
    Capabilities { set: &'static str, extra: u64 },
    #[error("runs as uid {uid}, the spec grants uid {granted} and no CAP_SETUID")]
    Uid { uid: u32, granted: u32 },
    #[error("runs with gid {gid}, the spec grants gids {granted:?} and no CAP_SETGID")]
    Gid { gid: u32, granted: Vec<u32> },
    #[error("runs without no_new_privs, which the spec sets")]
    NoNewPrivs,
    #[error(
        "runs with seccomp mode {mode} ({}), the spec requires a filter",
        seccomp_mode_name(.mode)
    )]
    SeccompMode { mode: u32 },
}

fn seccomp_mode_name(mode: &u32) -> &'static str {
    match mode {
        0 => "none",
        1 => "strict",
        _ => "unknown",
    }
}

/// One thread's credentials against `g`: the first excess.
pub fn check_creds(c: &Creds, g: &Granted) -> Result<(), CredsExcess> {
    let over = |set: &'static str, have: u64, ceiling: u64| -> Result<(), CredsExcess> {
        let extra = have & !ceiling;
        match extra {
            0 => Ok(()),
            _ => Err(CredsExcess::Capabilities { set, extra }),
        }
    };
    let prm = g.permitted_ceiling();
    over("bounding", c.cap_bnd, g.bounding)?;
    over("permitted", c.cap_prm, prm)?;
    over("effective", c.cap_eff, prm)?;
    over("inheritable", c.cap_inh, g.inheritable_ceiling())?;
    over(
        "ambient",
        c.cap_amb,
        g.ambient | (prm & g.inheritable_ceiling()),
    )?;
    if prm & CAP_SETUID == 0 {
        if let Some(uid) = c.uids.iter().find(|u| **u != g.uid) {
            return Err(CredsExcess::Uid {
                uid: *uid,
                granted: g.uid,
            });
        }
    }
    if prm & CAP_SETGID == 0 {
        if let Some(gid) = c.gids.iter().chain(&c.groups).find(|x| !g.gids.contains(x)) {
            return Err(CredsExcess::Gid {
                gid: *gid,
                granted: g.gids.clone(),
            });
        }
    }
    if g.no_new_privs && !c.no_new_privs {
        return Err(CredsExcess::NoNewPrivs);
    }
    if g.seccomp && c.seccomp_mode != 2 {
        return Err(CredsExcess::SeccompMode {
            mode: c.seccomp_mode,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::criu_image::testing::with_caps as creds;
    use crate::checkpoint::criu_image::Thread;

    /// containerd's default capability set for an unprivileged container.
    const DEFAULT_CAPS: u64 = 0xa804_25fb;
    const ALL_CAPS: u64 = 0x1ff_ffff_ffff;

    fn granted() -> Granted {
        Granted {
            uid: 0,
            gids: vec![0],
            bounding: DEFAULT_CAPS,
            effective: DEFAULT_CAPS,
            permitted: DEFAULT_CAPS,
            inheritable: 0,
            ambient: 0,
            no_new_privs: false,
            seccomp: false,
            namespaces: ns::PID | ns::NET | ns::IPC | ns::UTS | ns::MNT,
        }
    }

    /// Init and a second process, both with `c`.
    fn facts(c: Creds) -> ImageFacts {
        facts2(c.clone(), c)
    }

    fn facts2(init: Creds, c: Creds) -> ImageFacts {
        ImageFacts {
            root_pid: 1,
            namespaces: ns::PID | ns::NET | ns::IPC | ns::UTS | ns::MNT,
            threads: vec![
                Thread {
                    pid: 1,
                    tid: 1,
                    comm: "sh".into(),
                    creds: Some(init),
                    rseq: None,
                },
                Thread {
                    pid: 7,
                    tid: 7,
                    comm: "server".into(),
                    creds: Some(c),
                    rseq: None,
                },
            ],
        }
    }

    #[test]
    fn an_image_within_the_spec_passes() {
        check(&facts(creds(DEFAULT_CAPS)), &granted()).unwrap();
        // Fewer capabilities, another uid with CAP_SETUID in reach: fine.
        let mut c = creds(0);
        c.uids = [1000; 4];
        c.gids = [1000; 4];
        check(&facts(c), &granted()).unwrap();
    }

    #[test]
    fn a_privileged_image_under_an_unprivileged_spec_is_refused() {
        let err = check(&facts2(creds(DEFAULT_CAPS), creds(ALL_CAPS)), &granted())
            .unwrap_err()
            .0;
        assert!(err.contains("process 7"), "{err}");
        assert!(err.contains("CAP_SYS_ADMIN"), "{err}");
        assert!(!err.contains("CAP_CHOWN"), "{err}");
    }

    #[test]
    fn each_capability_set_is_checked() {
        for set in 0..5 {
            let mut c = creds(DEFAULT_CAPS);
            let admin = 1u64 << 21;
            match set {
                0 => c.cap_bnd |= admin,
                1 => c.cap_prm |= admin,
                2 => c.cap_eff |= admin,
                3 => c.cap_inh |= admin,
                _ => c.cap_amb |= admin,
            }
            let err = check(&facts2(creds(DEFAULT_CAPS), c), &granted())
                .unwrap_err()
                .0;
            assert!(err.contains("CAP_SYS_ADMIN"), "set {set}: {err}");
        }
    }

    #[test]
    fn ids_need_the_capability_to_change_them() {
        let mut g = granted();
        g.uid = 1000;
        g.gids = vec![1000, 27];
        g.bounding = 0;
        g.permitted = 0;
        g.effective = 0;
        let mut c = creds(0);
        c.uids = [1000; 4];
        c.gids = [1000; 4];
        c.groups = vec![27];
        check(&facts(c.clone()), &g).unwrap_or_else(|e| panic!("{e}"));
        let mut root = c.clone();
        root.uids[1] = 0;
        let err = check(&facts(root), &g).unwrap_err().0;
        assert!(err.contains("uid 0"), "{err}");
        let mut group = c;
        group.groups.push(0);
        let err = check(&facts(group), &g).unwrap_err().0;
        assert!(err.contains("gid 0"), "{err}");
    }

    #[test]
    fn no_new_privs_limits_permitted_to_the_spec_and_must_be_kept() {
        let mut g = granted();
        g.no_new_privs = true;
        g.permitted = 1; // CAP_CHOWN only, bounding wider
        g.effective = 1;
        let mut c = creds(1);
        c.cap_bnd = DEFAULT_CAPS;
        c.no_new_privs = true;
        check(&facts(c.clone()), &g).unwrap_or_else(|e| panic!("{e}"));
        let mut wider = c.clone();
        wider.cap_prm |= 1 << 5;
        let err = check(&facts(wider), &g).unwrap_err().0;
        assert!(err.contains("CAP_KILL"), "{err}");
        c.no_new_privs = false;
        let err = check(&facts(c), &g).unwrap_err().0;
        assert!(err.contains("no_new_privs"), "{err}");
    }

    #[test]
    fn a_seccomp_filter_is_required_when_the_spec_has_one() {
        let mut g = granted();
        g.seccomp = true;
        let mut c = creds(DEFAULT_CAPS);
        let err = check(&facts(c.clone()), &g).unwrap_err().0;
        assert!(err.contains("seccomp mode 0"), "{err}");
        c.seccomp_mode = 2;
        check(&facts(c), &g).unwrap();
    }

    #[test]
    fn namespaces_the_spec_isolates_must_be_the_images_own() {
        let mut f = facts(creds(DEFAULT_CAPS));
        f.namespaces &= !ns::NET;
        let err = check(&f, &granted()).unwrap_err().0;
        assert!(err.contains("network"), "{err}");
        // More isolation than the spec asks for is not an excess.
        let mut f = facts(creds(DEFAULT_CAPS));
        f.namespaces |= ns::USER;
        check(&f, &granted()).unwrap();
    }

    #[test]
    fn zombies_are_not_checked() {
        let mut f = facts2(creds(DEFAULT_CAPS), creds(ALL_CAPS));
        f.threads[1].creds = None;
        check(&f, &granted()).unwrap();
    }

    #[test]
    fn granted_from_a_spec() {
        let spec: Spec = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","process":{"user":{"uid":5,"gid":6,"additionalGids":[7]},
            "cwd":"/","noNewPrivileges":true,"capabilities":{"bounding":["CAP_CHOWN","CAP_KILL"],
            "permitted":["CAP_CHOWN"],"effective":["CAP_CHOWN"]}},
            "linux":{"namespaces":[{"type":"pid"},{"type":"network","path":"/proc/1/ns/net"},
            {"type":"cgroup"}],"seccomp":{"defaultAction":"SCMP_ACT_ERRNO"}}}"#,
        )
        .unwrap();
        let g = Granted::from_spec(&spec);
        assert_eq!(
            g,
            Granted {
                uid: 5,
                gids: vec![6, 7],
                bounding: 1 | 1 << 5,
                effective: 1,
                permitted: 1,
                inheritable: 0,
                ambient: 0,
                no_new_privs: true,
                seccomp: true,
                namespaces: ns::PID | ns::NET,
            }
        );
    }
}
