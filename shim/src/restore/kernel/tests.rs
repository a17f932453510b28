use super::*;

const STATUS: &str = "Name:\tsleep\nUmask:\t0022\nState:\tt (tracing stop)\nTgid:\t42\n\
        Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nFDSize:\t64\nGroups:\t0 10 \nNoNewPrivs:\t0\n\
        Seccomp:\t2\nSeccomp_filters:\t1\nCapInh:\t0000000000000000\nCapPrm:\t00000000a80425fb\n\
        CapEff:\t00000000a80425fb\nCapBnd:\t00000000a80425fb\nCapAmb:\t0000000000000000\n";
const IDENTITY: &[(u32, u32, u32)] = &[(0, 0, u32::MAX)];

#[test]
fn status_is_read_with_ids_mapped_into_the_namespace() {
    let (comm, c, filters) = parse_status(STATUS, IDENTITY, IDENTITY).unwrap();
    assert_eq!(comm, "sleep");
    assert_eq!(c.uids, [0; 4]);
    assert_eq!(c.groups, vec![0, 10]);
    assert_eq!(c.cap_eff, 0xa804_25fb);
    assert_eq!(c.seccomp_mode, 2);
    assert_eq!(filters, Some(1));
    // A user namespace mapping 0..65536 to 100000..: host 100000 is root inside.
    let text = STATUS
        .replace("Uid:\t0\t0\t0\t0", "Uid:\t100000\t100000\t100000\t100000")
        .replace("Gid:\t0\t0\t0\t0", "Gid:\t101000\t101000\t101000\t101000")
        .replace("Groups:\t0 10 ", "Groups:\t100010");
    let map = [(0, 100_000, 65_536)];
    let (_, c, _) = parse_status(&text, &map, &map).unwrap();
    assert_eq!(c.uids, [0; 4]);
    assert_eq!(c.gids, [1000; 4]);
    assert_eq!(c.groups, vec![10]);
    // An id outside the map is an error, not a guess.
    let e = parse_status(STATUS, &map, &map).unwrap_err();
    assert_eq!(
        e,
        ProcTextError::Unmapped {
            field: "Uid",
            host: 0
        }
    );
    assert_eq!(
        e.to_string(),
        "Uid: host id 0 is not mapped in its namespace"
    );
}

#[test]
fn hostile_or_truncated_status_is_an_error() {
    for bad in [
        STATUS.replace("CapEff:\t00000000a80425fb", "CapEff:\tzz"),
        STATUS.replace("Uid:\t0\t0\t0\t0", "Uid:\t0\t0"),
        STATUS.replace("NoNewPrivs:\t0\n", ""),
        STATUS.replace("Seccomp:\t2", "Seccomp:\tx"),
        String::new(),
    ] {
        assert!(parse_status(&bad, IDENTITY, IDENTITY).is_err(), "{bad:?}");
    }
}

const LIMITS: &str =
    "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max file size             unlimited            unlimited            bytes     \n\
Max data size             unlimited            unlimited            bytes     \n\
Max stack size            8388608              unlimited            bytes     \n\
Max core file size        0                    unlimited            bytes     \n\
Max resident set          unlimited            unlimited            bytes     \n\
Max processes             95704                95704                processes \n\
Max open files            1024                 1024                 files     \n\
Max locked memory         8388608              8388608              bytes     \n\
Max address space         unlimited            unlimited            bytes     \n\
Max file locks            unlimited            unlimited            locks     \n\
Max pending signals       95704                95704                signals   \n\
Max msgqueue size         819200               819200               bytes     \n\
Max nice priority         0                    0                    \n\
Max realtime priority     0                    0                    \n\
Max realtime timeout      unlimited            unlimited            us        \n";

#[test]
fn limits_are_read_by_resource() {
    let l = parse_limits(LIMITS).unwrap();
    assert_eq!(l.len(), 16);
    assert_eq!(l[7], (1024, 1024));
    assert_eq!(l[3], (8_388_608, u64::MAX));
    assert_eq!(l[15], (u64::MAX, u64::MAX));
    assert!(parse_limits(&LIMITS.replace("Max open files ", "Max open filez ")).is_err());
    assert!(parse_limits(&LIMITS.replace("1024                 1024", "1024")).is_err());
}

#[test]
fn id_maps_parse_and_map() {
    let m = parse_id_map("         0     100000      65536\n").unwrap();
    assert_eq!(m, vec![(0, 100_000, 65_536)]);
    assert_eq!(to_inside(&m, 100_005), Some(5));
    assert_eq!(to_inside(&m, 99_999), None);
    assert_eq!(to_inside(&m, 165_536), None);
    // A hostile map whose inside range runs past u32: no overflow, no id.
    assert_eq!(to_inside(&[(u32::MAX, 0, 10)], 5), None);
    assert!(parse_id_map("0 1\n").is_err());
    assert!(parse_id_map("a b c\n").is_err());
}

fn mount(id: u32, at: &str, root: &str, fstype: &str, options: &str) -> Mount {
    Mount {
        mount_id: id,
        parent_id: 1,
        major: 0,
        minor: id,
        root: root.into(),
        mount_point: at.into(),
        options: options.into(),
        optional: vec![],
        fstype: fstype.into(),
        source: fstype.into(),
        super_options_raw: "rw".into(),
    }
}

/// containerd's default spec, as far as mounts go.
fn rules() -> MountRules {
    let m = |d: &str, t: &str, ro: bool| (PathBuf::from(d), t.to_string(), ro, false);
    MountRules {
        root_readonly: false,
        mounts: vec![
            m("/proc", "proc", false),
            m("/dev", "tmpfs", false),
            m("/dev/pts", "devpts", false),
            m("/dev/shm", "tmpfs", false),
            m("/dev/mqueue", "mqueue", false),
            m("/sys", "sysfs", true),
            m("/sys/fs/cgroup", "cgroup", true),
            m("/data", "bind", false),
        ],
        masked: vec![
            "/proc/kcore".into(),
            "/proc/acpi".into(),
            "/proc/nonesuch".into(),
        ],
        readonly: vec!["/proc/sys".into(), "/proc/sysrq-trigger".into()],
        devices: vec!["/dev/null".into(), "/dev/console".into()],
    }
}

/// What runc makes of [`rules`].
fn table() -> Vec<Mount> {
    vec![
        mount(1, "/", "/", "overlay", "rw,relatime"),
        mount(2, "/proc", "/", "proc", "rw,nosuid,nodev,noexec,relatime"),
        mount(3, "/dev", "/", "tmpfs", "rw,nosuid"),
        mount(4, "/dev/pts", "/", "devpts", "rw,nosuid,noexec,relatime"),
        mount(
            5,
            "/dev/shm",
            "/",
            "tmpfs",
            "rw,nosuid,nodev,noexec,relatime",
        ),
        mount(
            6,
            "/dev/mqueue",
            "/",
            "mqueue",
            "rw,nosuid,nodev,noexec,relatime",
        ),
        mount(7, "/sys", "/", "sysfs", "ro,nosuid,nodev,noexec,relatime"),
        mount(
            8,
            "/sys/fs/cgroup",
            "/",
            "cgroup2",
            "ro,nosuid,nodev,noexec,relatime",
        ),
        mount(9, "/data", "/srv/data", "ext4", "rw,relatime"),
        mount(10, "/proc/kcore", "/null", "tmpfs", "rw,nosuid"),
        mount(11, "/proc/acpi", "/", "tmpfs", "ro,relatime"),
        mount(
            12,
            "/proc/sys",
            "/sys",
            "proc",
            "ro,nosuid,nodev,noexec,relatime",
        ),
        mount(
            13,
            "/proc/sysrq-trigger",
            "/sysrq-trigger",
            "proc",
            "ro,relatime",
        ),
    ]
}

fn existing() -> Vec<PathBuf> {
    vec![
        "/proc/kcore".into(),
        "/proc/acpi".into(),
        "/proc/sys".into(),
        "/proc/sysrq-trigger".into(),
    ]
}

#[test]
fn runcs_own_table_passes() {
    check_mounts(&table(), &rules(), &existing()).unwrap();
    // A masked path the host lacks needs no mask; a v1 hierarchy below the cgroup mount
    // is runc's too.
    let mut t = table();
    t.push(mount(14, "/sys/fs/cgroup/cpu", "/", "cgroup", "ro,nosuid"));
    check_mounts(&t, &rules(), &existing()).unwrap();
}

#[test]
fn every_way_out_of_the_spec_is_refused() {
    type Edit = Box<dyn Fn(&mut Vec<Mount>)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "/proc/sys is mounted read-write",
            Box::new(|t| t[11].options = "rw,nosuid".into()),
        ),
        (
            "/sys is mounted read-write",
            Box::new(|t| t[6].options = "rw,nosuid".into()),
        ),
        (
            "a proc mount at /tmp/p",
            Box::new(|t| t.push(mount(20, "/tmp/p", "/", "proc", "rw"))),
        ),
        (
            "a proc mount at /data",
            Box::new(|t| t[8] = mount(9, "/data", "/", "proc", "rw")),
        ),
        (
            "a ext4 mount at /host",
            Box::new(|t| t.push(mount(20, "/host", "/", "ext4", "rw"))),
        ),
        (
            "/proc/kcore is not masked",
            Box::new(|t| {
                t.remove(9);
            }),
        ),
        (
            "/proc/acpi is not masked",
            Box::new(|t| t[10].options = "rw".into()),
        ),
        (
            "/proc/sysrq-trigger is not mounted read-only",
            Box::new(|t| {
                t.remove(12);
            }),
        ),
        (
            "a sysfs mount at /sys/fs/cgroup/x where",
            Box::new(|t| t.push(mount(20, "/sys/fs/cgroup/x", "/", "sysfs", "ro"))),
        ),
        (
            "/sys/fs/cgroup/cpu is mounted read-write",
            Box::new(|t| t.push(mount(20, "/sys/fs/cgroup/cpu", "/", "cgroup", "rw"))),
        ),
    ];
    for (want, edit) in cases {
        let mut t = table();
        edit(&mut t);
        let err = check_mounts(&t, &rules(), &existing()).unwrap_err().0;
        assert!(err.contains(want), "wanted {want:?}, got {err:?}");
    }
    // A writable tmpfs where the spec says read-only exposes nothing (runc's cgroup v1
    // tmpfs, as CRIU restores it).
    let mut t = table();
    t.push(mount(14, "/sys/fs/cgroup", "/", "tmpfs", "rw,nosuid"));
    t.push(mount(15, "/sys/fs/cgroup/cpu", "/", "cgroup", "ro,nosuid"));
    check_mounts(&t, &rules(), &existing()).unwrap();
    // A read-only root the spec asks for.
    let mut r = rules();
    r.root_readonly = true;
    let err = check_mounts(&table(), &r, &existing()).unwrap_err().0;
    assert!(err.contains("/ is mounted read-write"), "{err}");
}

fn process(pid: u32, creds: Creds) -> ProcessState {
    ProcessState {
        pid,
        threads: vec![ThreadState {
            pid,
            tid: pid,
            comm: "sh".into(),
            creds,
            seccomp_filters: Some(1),
            zombie: false,
        }],
        limits: vec![(1024, 1024); 16],
        namespaces: [
            ("mnt", (1, 100)),
            ("net", (1, 101)),
            ("pid", (1, 102)),
            ("user", (1, 1)),
        ]
        .into_iter()
        .collect(),
        cgroups: "0::/k8s/ctr\n".into(),
        lsm_label: None,
    }
}

fn security(tgid: u32) -> ThreadSecurity {
    ThreadSecurity {
        tgid,
        securebits: 0,
        seccomp_mode: 2,
        filter_count: 1,
        exiting: false,
        holds_reference: Some(true),
        compared: 1,
    }
}

fn setup() -> (Observed, Expected, Host) {
    let creds = Creds {
        cap_bnd: 0xa804_25fb,
        cap_prm: 0xa804_25fb,
        cap_eff: 0xa804_25fb,
        seccomp_mode: 2,
        ..Default::default()
    };
    let o = Observed {
        processes: vec![process(10, creds.clone()), process(11, creds)],
        uid_map: IDENTITY.to_vec(),
        gid_map: IDENTITY.to_vec(),
        mounts: table(),
        security: [(10, security(10)), (11, security(11))]
            .into_iter()
            .collect(),
    };
    let mut e = Expected {
        mounts: rules(),
        ..Default::default()
    };
    e.granted = Granted {
        gids: vec![0],
        bounding: 0xa804_25fb,
        effective: 0xa804_25fb,
        permitted: 0xa804_25fb,
        seccomp: true,
        ..Default::default()
    };
    for n in ["mnt", "net", "pid"] {
        e.namespaces.insert(n, None);
    }
    let h = Host {
        namespaces: [
            ("mnt", (1, 1)),
            ("net", (1, 2)),
            ("pid", (1, 3)),
            ("user", (1, 1)),
        ]
        .into_iter()
        .collect(),
        hard_limits: [1024; 16],
        cgroups: "0::/k8s/ctr\n".into(),
        existing: existing(),
        ..Default::default()
    };
    (o, e, h)
}

#[test]
fn a_tree_within_its_spec_passes() {
    let (o, e, h) = setup();
    let p = judge(&o, &e, &h).unwrap();
    assert_eq!((p.processes, p.threads, p.mounts), (2, 2, 13));
}

type Edit = Box<dyn Fn(&mut Observed, &mut Expected, &mut Host)>;

/// Edits of a tree that passes, each making one excess, with what the refusal must name.
fn excesses() -> Vec<(&'static str, Edit)> {
    vec![
        (
            "effective capabilities CAP_SYS_ADMIN",
            Box::new(|o, _, _| o.processes[1].threads[0].creds.cap_eff |= CAP_SYS_ADMIN),
        ),
        (
            "runs as uid 1000",
            Box::new(|o, e, _| {
                e.granted.permitted &= !(1 << 7);
                e.granted.bounding &= !(1 << 7);
                for p in &mut o.processes {
                    p.threads[0].creds.cap_prm &= !(1 << 7);
                    p.threads[0].creds.cap_eff &= !(1 << 7);
                    p.threads[0].creds.cap_bnd &= !(1 << 7);
                }
                o.processes[1].threads[0].creds.uids = [1000; 4];
            }),
        ),
        (
            "seccomp mode 0",
            Box::new(|o, _, _| o.processes[0].threads[0].creds.seccomp_mode = 0),
        ),
        (
            "has no seccomp filter",
            Box::new(|o, _, _| o.processes[0].threads[0].seccomp_filters = Some(0)),
        ),
        (
            "does not run under the seccomp filter runc installs",
            Box::new(|o, _, _| {
                let k = o.security.get_mut(&11).unwrap();
                k.holds_reference = Some(false);
            }),
        ),
        (
            "was not seen by the kernel's task iterator",
            Box::new(|o, _, _| {
                o.security.remove(&10);
            }),
        ),
        (
            "was not seen by the kernel's task iterator",
            // A record of another process under the same tid is not this thread's.
            Box::new(|o, _, _| o.security.get_mut(&10).unwrap().tgid = 99),
        ),
        (
            "has securebits 0x4",
            Box::new(|o, e, _| {
                e.granted.permitted &= !CAP_SETPCAP;
                e.granted.bounding &= !CAP_SETPCAP;
                e.granted.effective &= !CAP_SETPCAP;
                for p in &mut o.processes {
                    p.threads[0].creds.cap_prm &= !CAP_SETPCAP;
                    p.threads[0].creds.cap_eff &= !CAP_SETPCAP;
                    p.threads[0].creds.cap_bnd &= !CAP_SETPCAP;
                }
                o.security.get_mut(&10).unwrap().securebits = SECBIT_NO_SETUID_FIXUP;
            }),
        ),
        (
            "has securebits 0x100",
            Box::new(|o, _, _| o.security.get_mut(&10).unwrap().securebits = 0x100),
        ),
        (
            "has the LSM label \"unconfined\", the spec gives the AppArmor profile",
            Box::new(|o, e, h| {
                h.lsm_label = Some("unconfined".into());
                h.apparmor = true;
                e.apparmor = Some("crab-default".into());
                for p in &mut o.processes {
                    p.lsm_label = Some("crab-default (enforce)".into());
                }
                o.processes[1].lsm_label = Some("unconfined".into());
            }),
        ),
        (
            "has the LSM label \"system_u:system_r:spc_t:s0\"",
            Box::new(|o, e, h| {
                h.lsm_label = Some("system_u:system_r:container_runtime_t:s0".into());
                h.selinux = true;
                e.selinux = Some("system_u:system_r:container_t:s0:c1,c2".into());
                o.processes[0].lsm_label = Some("system_u:system_r:spc_t:s0".into());
            }),
        ),
        (
            "the spec gives none (the runtime's own",
            Box::new(|o, _, h| {
                h.lsm_label = Some("unconfined".into());
                h.apparmor = true;
                for p in &mut o.processes {
                    p.lsm_label = Some("unconfined".into());
                }
                o.processes[1].lsm_label = Some("some-other (complain)".into());
            }),
        ),
        (
            "hard RLIMIT_NOFILE of 1048576",
            Box::new(|o, _, _| o.processes[1].limits[7] = (1024, 1_048_576)),
        ),
        (
            "host's net namespace",
            Box::new(|o, _, _| {
                o.processes[0].namespaces.insert("net", (1, 2));
            }),
        ),
        (
            "a user namespace of its own",
            Box::new(|o, _, _| {
                o.processes[0].namespaces.insert("user", (1, 7));
                o.processes[1].namespaces.insert("user", (1, 7));
            }),
        ),
        (
            "process 11 is in another mnt namespace",
            Box::new(|o, _, _| {
                o.processes[1].namespaces.insert("mnt", (1, 555));
            }),
        ),
        (
            "outside the container's",
            Box::new(|o, _, _| o.processes[1].cgroups = "0::/\n".into()),
        ),
        (
            "outside the container's",
            Box::new(|o, _, _| o.processes[1].cgroups = "0::/k8s/ctr2\n".into()),
        ),
        (
            "/proc/sys is mounted read-write",
            Box::new(|o, _, _| o.mounts[11].options = "rw".into()),
        ),
        (
            "maps uids",
            Box::new(|o, e, _| {
                e.namespaces.insert("user", None);
                e.uid_map = vec![(0, 100_000, 65_536)];
                e.gid_map = vec![(0, 100_000, 65_536)];
                for p in &mut o.processes {
                    p.namespaces.insert("user", (1, 9));
                }
                o.gid_map = e.gid_map.clone();
                o.uid_map = vec![(0, 0, 65_536)];
            }),
        ),
    ]
}

#[test]
fn each_excess_is_refused_naming_it() {
    for (want, edit) in excesses() {
        let (mut o, mut e, mut h) = setup();
        edit(&mut o, &mut e, &mut h);
        let err = judge(&o, &e, &h).unwrap_err().to_string();
        assert!(err.contains(want), "wanted {want:?}, got {err:?}");
    }
}

#[test]
fn seccomp_securebits_and_labels_within_the_spec_pass() {
    let (mut o, mut e, mut h) = setup();
    // The reference among several filters; restrictive securebits (NOROOT and its lock,
    // NO_CAP_AMBIENT_RAISE); NO_SETUID_FIXUP with CAP_SETPCAP in reach.
    o.security.get_mut(&10).unwrap().filter_count = 3;
    o.security.get_mut(&10).unwrap().securebits = 0b0100_0011;
    o.security.get_mut(&11).unwrap().securebits = SECBIT_NO_SETUID_FIXUP;
    assert_ne!(e.granted.permitted_ceiling() & CAP_SETPCAP, 0);
    judge(&o, &e, &h).unwrap();
    // No reference asked for (no profile, or a notifying one).
    o.security.get_mut(&10).unwrap().holds_reference = None;
    judge(&o, &e, &h).unwrap();
    // AppArmor: the spec's profile in any mode; no profile: the runtime's own label.
    h.lsm_label = Some("unconfined".into());
    h.apparmor = true;
    for p in &mut o.processes {
        p.lsm_label = Some("unconfined".into());
    }
    judge(&o, &e, &h).unwrap();
    e.apparmor = Some("crab-default".into());
    assert!(judge(&o, &e, &h).is_err());
    o.processes[0].lsm_label = Some("crab-default (enforce)".into());
    o.processes[1].lsm_label = Some("crab-default (complain)".into());
    judge(&o, &e, &h).unwrap();
    // A profile named for AppArmor on a host without it: runc applies none.
    h.apparmor = false;
    for p in &mut o.processes {
        p.lsm_label = Some("unconfined".into());
    }
    judge(&o, &e, &h).unwrap();
    // No LSM labels on this host at all: nothing to compare.
    h.lsm_label = None;
    for p in &mut o.processes {
        p.lsm_label = Some("whatever".into());
    }
    judge(&o, &e, &h).unwrap();
}

#[test]
fn a_zombie_is_not_judged_by_the_credentials_criu_left_it() {
    let (mut o, e, h) = setup();
    o.processes[1].threads[0].creds.cap_bnd = u64::MAX >> 23;
    assert!(judge(&o, &e, &h).is_err());
    o.processes[1].threads[0].zombie = true;
    judge(&o, &e, &h).unwrap();
    // Nor by the limits or cgroups (CRIU restores none for it: it keeps CRIU's).
    o.processes[1].limits[7] = (1024, 1 << 20);
    o.processes[1].cgroups = "0::/\n".into();
    judge(&o, &e, &h).unwrap();
}

#[test]
fn what_the_spec_grants_is_not_an_excess() {
    // A sub-cgroup of the container's, limits the spec raises, CAP_SYS_RESOURCE.
    let (mut o, mut e, h) = setup();
    o.processes[1].cgroups = "0::/k8s/ctr/worker\n".into();
    o.processes[0].limits[7] = (4096, 65_536);
    e.spec_rlimits.insert(7, 65_536);
    judge(&o, &e, &h).unwrap();
    o.processes[0].limits[8] = (0, u64::MAX);
    assert!(judge(&o, &e, &h).is_err());
    e.granted.bounding |= CAP_SYS_RESOURCE;
    judge(&o, &e, &h).unwrap();
    // A privileged spec (CAP_SYS_ADMIN, no user namespace) may have any mount table.
    o.mounts[11].options = "rw".into();
    assert!(judge(&o, &e, &h).is_err());
    e.granted.bounding |= CAP_SYS_ADMIN;
    judge(&o, &e, &h).unwrap();
}
