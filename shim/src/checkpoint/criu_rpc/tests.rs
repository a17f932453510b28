use super::*;

/// A runc state file as runc 1.3 writes it (the fields read here, and others around them).
const STATE: &str = r#"{
        "id": "c1", "init_process_pid": 4242, "init_process_start": 123, "created": "x",
        "config": {
            "no_pivot_root": false, "rootfs": "/ROOTFS",
            "mounts": [
                {"source": "proc", "destination": "/proc", "device": "proc", "flags": 14},
                {"source": "/host/hosts", "destination": "/etc/hosts", "device": "bind", "flags": 20480},
                {"source": "/host/app", "destination": "/app/../app/", "device": "bind"},
                {"source": "cgroup", "destination": "/sys/fs/cgroup", "device": "cgroup"}
            ],
            "devices": [{"type": 99, "major": 1, "minor": 3, "path": "/dev/null"}, {"path": ""}],
            "mask_paths": ["/proc/kcore", "/nonexistent"],
            "namespaces": [{"type": "NEWPID", "path": ""}, {"type": "NEWNET", "path": ""}],
            "labels": ["bundle=/b", "io.crab/x=1"],
            "cgroups": {"path": "/c1"}
        },
        "rootless": false,
        "cgroup_paths": {"": "/sys/fs/cgroup/c1"},
        "namespace_paths": {"NEWPID": "/proc/4242/ns/pid"},
        "external_descriptors": ["/dev/null", "pipe:[77]", "pipe:[78]"]
    }"#;

/// The string fields with number `field` of message `m`.
fn strings(m: &[u8], field: u64) -> Vec<String> {
    proto_fields(m)
        .unwrap()
        .into_iter()
        .filter_map(|(f, v)| match (f, v) {
            (f2, ProtoValue::Bytes(b)) if f2 == field => {
                Some(String::from_utf8(b.to_vec()).unwrap())
            }
            _ => None,
        })
        .collect()
}

fn varints(m: &[u8]) -> HashMap<u64, u64> {
    proto_fields(m)
        .unwrap()
        .into_iter()
        .filter_map(|(f, v)| match v {
            ProtoValue::Varint(x) => Some((f, x)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_host_cgroup_mounts_serve_as_criu_s_yard_only_when_each_hierarchy_is_there() {
    use crate::sys::mountinfo::parse;
    let hybrid = parse(
        b"30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
32 30 0:28 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 / /sys/fs/cgroup/memory rw,nosuid shared:16 - cgroup cgroup rw,memory
",
    );
    let procs = "4:memory:/c1\n3:cpu,cpuacct:/c1\n1:name=systemd:/c1\n0::/c1\n";
    assert_eq!(
        cgroup_yard(&hybrid, procs).as_deref(),
        Some("/sys/fs/cgroup")
    );
    // A hierarchy with no mount of its own there, a controller the mount lacks, another
    // filesystem, a subtree bind-mounted, a name with a path in it: CRIU mounts its own.
    for bad in [
        "5:pids:/c1\n",
        "3:cpu,cpuset:/c1\n",
        "9:name=../../etc:/c1\n",
        "garbage\n",
        "",
    ] {
        assert_eq!(cgroup_yard(&hybrid, bad), None, "{bad:?}");
    }
    let sub = parse(b"36 30 0:32 /docker /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n");
    assert_eq!(cgroup_yard(&sub, "4:memory:/c1\n"), None);
    // cgroup v2 only: the root is /sys/fs/cgroup itself, with no `unified` below it.
    let v2 = parse(b"30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n");
    assert_eq!(cgroup_yard(&v2, "0::/c1\n"), None);
    // The request carries it when given.
    let st = RuncState::parse(STATE.as_bytes()).unwrap();
    let opts = DumpOptions {
        cgroup_yard: Some("/sys/fs/cgroup".into()),
        ..Default::default()
    };
    assert_eq!(
        strings(&dump_opts(&st, &opts, &[], 1, 2).unwrap().0, 60),
        ["/sys/fs/cgroup"]
    );
    assert!(strings(
        &dump_opts(&st, &DumpOptions::default(), &[], 1, 2)
            .unwrap()
            .0,
        60
    )
    .is_empty());
}

#[test]
fn only_tcp_connections_need_the_network_lock() {
    // Nothing, or only listening / closed / time-wait sockets: no lock.
    assert!(!needs_network_lock(&[]));
    assert!(!needs_network_lock(&[10, 7, 6, 10]));
    // An established connection, a connect in progress, a closing one, a request: lock.
    for st in [1, 2, 3, 4, 5, 8, 9, 11, 12, 0, 200] {
        assert!(needs_network_lock(&[10, st]), "{st}");
    }
    // A process that does not exist: the kernel cannot be asked, the lock stays.
    assert!(netns_needs_network_lock(u32::MAX));
}

#[test]
fn dump_request_carries_runcs_options() {
    let st = RuncState::parse(STATE.as_bytes()).unwrap();
    assert_eq!(st.external_descriptors.len(), 3);
    let opts = DumpOptions {
        leave_running: true,
        tcp_established: true,
        ext_unix_sk: true,
        file_locks: true,
        ..Default::default()
    };
    let v1 = vec!["cpu".to_string(), "systemd".to_string()];
    let o = dump_opts(&st, &opts, &v1, 7, 8).unwrap().0;
    let v = varints(&o);
    for (field, want) in [
        (1, 7),    // images_dir_fd
        (2, 4242), // pid
        (3, 1),    // leave_running
        (4, 1),    // ext_unix_sk
        (5, 1),    // tcp_established
        (7, 0),    // shell_job
        (8, 1),    // file_locks
        (9, 4),    // log_level
        (12, 1),   // notify_scripts
        (17, 8),   // work_dir_fd
        (24, 1),   // manage_cgroups
        (34, 6),   // manage_cgroups_mode: DEFAULT
        (45, 10),  // timeout
        (50, 1),   // orphan_pts_master
    ] {
        assert_eq!(v.get(&field), Some(&want), "field {field}");
    }
    // runc's network lock (the default) and in-flight connections refused.
    assert_eq!((v.get(&64), v.get(&46)), (None, Some(&0)));
    let skip = DumpOptions {
        skip_network_lock: true,
        ..opts.clone()
    };
    let v = varints(&dump_opts(&st, &skip, &v1, 7, 8).unwrap().0);
    assert_eq!((v.get(&64), v.get(&46)), (Some(&3), Some(&1)));
    // The network namespace: dumped (empty_ns 0, as runc asks) unless left out.
    assert_eq!(varints(&o).get(&38), Some(&0));
    let empty = DumpOptions {
        empty_netns: true,
        ..opts.clone()
    };
    let v = varints(&dump_opts(&st, &empty, &v1, 7, 8).unwrap().0);
    assert_eq!(v.get(&38), Some(&0x4000_0000), "CLONE_NEWNET");
    assert_eq!(strings(&o, 10), ["dump.log"]);
    assert_eq!(strings(&o, 13), ["/ROOTFS"]);
    assert_eq!(strings(&o, 44), ["/sys/fs/cgroup/c1"]);
    // A dump that seizes with ptrace names no freezer cgroup.
    let seize = DumpOptions {
        ptrace_seize: true,
        ..opts.clone()
    };
    let seized = dump_opts(&st, &seize, &v1, 7, 8).unwrap().0;
    assert!(strings(&seized, 44).is_empty());
    assert_eq!(strings(&o, 51), ["/etc/criu/runc.conf"]);
    assert!(strings(&o, 37).is_empty(), "no joined namespaces");
    // ext_mnt: the bind mounts (cleaned) and the devices; /proc/kcore only if it is a file
    // in the container (pid 4242 is not ours to look at: absent here).
    let mnts: Vec<(String, String)> = proto_fields(&o)
        .unwrap()
        .into_iter()
        .filter_map(|(f, v)| match (f, v) {
            (23, ProtoValue::Bytes(m)) => Some((strings(m, 1).remove(0), strings(m, 2).remove(0))),
            _ => None,
        })
        .collect();
    let pair = |k: &str| (k.to_string(), k.to_string());
    let mut want = vec![
        pair("/etc/hosts"),
        pair("/app"),
        pair("/sys/fs/cgroup/cpu"),
        pair("/sys/fs/cgroup/systemd"),
        pair("/dev/null"),
    ];
    if std::path::Path::new("/proc/4242/root/proc/kcore").is_file() {
        want.insert(4, ("/proc/kcore".into(), "/dev/null".into()));
    }
    assert_eq!(mnts, want);
    // In a cgroup namespace the cgroup mount is a real one.
    let mut ns = st.clone();
    ns.config.namespaces.push(RuncNamespace {
        kind: "NEWCGROUP".into(),
        path: String::new(),
    });
    let o = dump_opts(&ns, &opts, &v1, 7, 8).unwrap().0;
    assert_eq!(
        proto_fields(&o)
            .unwrap()
            .iter()
            .filter(|(f, _)| *f == 23)
            .count(),
        want.len() - 2
    );

    // A CRIU config named by annotation, or none; another cgroup mode; negative fds.
    let mut st2 = st.clone();
    st2.config
        .labels
        .push("org.criu.config=/etc/my.conf".into());
    let o = dump_opts(&st2, &DumpOptions::default(), &[], -1, 3)
        .unwrap()
        .0;
    assert_eq!(strings(&o, 51), ["/etc/my.conf"]);
    assert_eq!(varints(&o).get(&1), Some(&u64::MAX), "-1 sign-extended");
    st2.config.labels.pop();
    st2.config.labels.push("org.criu.config=".into());
    assert!(strings(
        &dump_opts(&st2, &DumpOptions::default(), &[], 1, 2)
            .unwrap()
            .0,
        51
    )
    .is_empty());
    let soft = DumpOptions {
        manage_cgroups_mode: Some("soft".into()),
        ..Default::default()
    };
    assert_eq!(
        varints(&dump_opts(&st, &soft, &[], 1, 2).unwrap().0).get(&34),
        Some(&3)
    );
    let bad = DumpOptions {
        manage_cgroups_mode: Some("loose".into()),
        ..Default::default()
    };
    assert!(matches!(
        dump_opts(&st, &bad, &[], 1, 2),
        Err(StateError::CgroupsMode(m)) if m == "loose"
    ));

    // A joined network namespace is external, by inode.
    let mut st3 = st.clone();
    st3.config.namespaces[1].path = "/proc/self/ns/net".into();
    let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata("/proc/self/ns/net").unwrap());
    let o = dump_opts(&st3, &DumpOptions::default(), &[], 1, 2)
        .unwrap()
        .0;
    assert_eq!(strings(&o, 37), [format!("net[{ino}]:extRootNetNS")]);
    st3.config.namespaces[1].path = "/nonexistent/ns".into();
    let Err(e) = dump_opts(&st3, &DumpOptions::default(), &[], 1, 2) else {
        panic!("a namespace that is not there");
    };
    assert!(
        matches!(&e, StateError::Namespace { name: "net", source, .. } if source.kind() == io::ErrorKind::NotFound),
        "{e}"
    );
}

#[test]
fn hostile_state_files_are_refused() {
    for bad in [
        "",
        "null",
        "[]",
        "{}",
        r#"{"init_process_pid": 1}"#,
        r#"{"init_process_pid": 0, "config": {"rootfs": "/r"}}"#,
        r#"{"init_process_pid": 1, "config": {"rootfs": "relative"}}"#,
        r#"{"init_process_pid": -1, "config": {"rootfs": "/r"}}"#,
        r#"{"init_process_pid": 1, "config": {"rootfs": "/r", "mounts": [{"device": "bind"}]}}"#,
        r#"{"init_process_pid": 1, "config": {"rootfs": "/r", "namespaces": "NEWNET"}}"#,
    ] {
        assert!(RuncState::parse(bad.as_bytes()).is_err(), "{bad}");
    }
    let relative = r#"{"init_process_pid": 1, "config": {"rootfs": "relative"}}"#;
    let e = RuncState::parse(relative.as_bytes()).unwrap_err();
    assert_eq!(e.to_string(), "rootfs relative is not absolute");
    let no_init = r#"{"init_process_pid": 0, "config": {"rootfs": "/r"}}"#;
    assert!(matches!(
        RuncState::parse(no_init.as_bytes()),
        Err(StateError::NoInit)
    ));
    assert!(matches!(RuncState::parse(b"[]"), Err(StateError::Json(_))));
    // Go's nil slices, maps and strings are null.
    let nulls = r#"{"init_process_pid": 1, "cgroup_paths": null, "external_descriptors": null,
            "config": {"rootfs": "/r", "mounts": [{"destination": "/d", "device": null}], "devices": null,
            "mask_paths": null, "namespaces": [{"type": "NEWNET", "path": null}], "labels": null}}"#;
    let st = RuncState::parse(nulls.as_bytes()).unwrap();
    assert!(st.config.devices.is_empty() && st.config.namespaces[0].path.is_empty());
    assert!(dump_opts(&st, &DumpOptions::default(), &[], 1, 2).is_ok());
    let ok = r#"{"init_process_pid": 1, "config": {"rootfs": "/r"}}"#;
    let st = RuncState::parse(ok.as_bytes()).unwrap();
    assert!(st.external_descriptors.is_empty() && st.freezer_cgroup().is_none());

    // Too large, a symlink, missing: errors naming the file.
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("big")).unwrap();
    fs::write(
        dir.path().join("big/state.json"),
        vec![b' '; MAX_STATE_FILE as usize + 1],
    )
    .unwrap();
    let e = RuncState::read(dir.path(), "big").unwrap_err();
    assert!(matches!(e, CriuError::BadState { .. }), "{e}");
    fs::create_dir(dir.path().join("link")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link/state.json")).unwrap();
    assert!(RuncState::read(dir.path(), "link").is_err());
    let e = RuncState::read(dir.path(), "missing").unwrap_err();
    assert!(e.to_string().contains("missing/state.json"), "{e}");
}

#[test]
fn criu_answers_decode_and_hostile_ones_are_refused() {
    let mut notify = Enc::default();
    notify.str(1, "post-dump").int32(2, 7);
    let mut r = Enc::default();
    r.uint(1, REQ_NOTIFY).bool(2, true).msg(5, &notify);
    assert_eq!(
        decode_resp(&r.0).unwrap(),
        Resp {
            kind: REQ_NOTIFY,
            success: true,
            script: Some("post-dump".into()),
            ..Default::default()
        }
    );
    let mut r = Enc::default();
    r.uint(1, REQ_DUMP)
        .bool(2, false)
        .int32(7, 1)
        .str(9, "Dumping FAILED. ")
        .uint(99, 5);
    let got = decode_resp(&r.0).unwrap();
    assert_eq!(
        (got.success, got.errno, got.message.as_deref()),
        (false, Some(1), Some("Dumping FAILED."))
    );
    // Missing required fields, wrong wire types, truncation, garbage.
    let mut no_success = Enc::default();
    no_success.uint(1, REQ_DUMP);
    let mut wrong = Enc::default();
    wrong.str(1, "dump").bool(2, true);
    let mut bad_notify = Enc::default();
    bad_notify
        .uint(1, REQ_NOTIFY)
        .bool(2, true)
        .bytes(5, &[0xff]);
    assert_eq!(decode_resp(&no_success.0), Err(RespError::Incomplete));
    assert_eq!(decode_resp(&wrong.0), Err(RespError::WrongType(1)));
    assert_eq!(
        decode_resp(&bad_notify.0),
        Err(RespError::Notify(DecodeError::BadKey { offset: 0 }))
    );
    let full = {
        let mut r = Enc::default();
        r.uint(1, REQ_DUMP).bool(2, true).str(9, "long message");
        r.0
    };
    for n in 0..full.len() {
        let _ = decode_resp(&full[..n]);
    }
    assert!(decode_resp(&full[..full.len() - 1]).is_err());
    assert!(decode_resp(&[0xff; 16]).is_err());
    assert_eq!(
        decode_resp(&[0x0b]).unwrap_err().to_string(),
        "not a protobuf message: wire type 3 at byte 0"
    );
    assert!(proto_fields(&[0x0d, 1, 2]).is_none(), "fixed32 cut short");
}

#[test]
fn mount_destinations_resolve_inside_the_rootfs() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    fs::create_dir_all(r.join("real/dir")).unwrap();
    std::os::unix::fs::symlink("/real", r.join("abs")).unwrap();
    std::os::unix::fs::symlink("../../real", r.join("real/dir/up")).unwrap();
    std::os::unix::fs::symlink("/", r.join("escape")).unwrap();
    assert_eq!(container_path(r, "/abs/dir"), "/real/dir");
    assert_eq!(container_path(r, "/real/dir/up/dir"), "/real/dir");
    // `..` and absolute links stay inside the root, as in a chroot.
    assert_eq!(container_path(r, "/escape/real"), "/real");
    assert_eq!(container_path(r, "/../../real//dir/."), "/real/dir");
    // Missing: the destination cleaned lexically.
    assert_eq!(container_path(r, "/missing/../gone/x/"), "/gone/x");
    assert_eq!(container_path(r, "/"), "/");
    assert_eq!(
        container_path(Path::new("/nonexistent-root"), "a/b"),
        "/a/b"
    );
}

#[test]
fn cgroup_v1_hierarchies_as_runc_lists_them() {
    let table = b"30 25 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n\
31 30 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n\
32 30 0:28 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd\n\
33 30 0:29 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
34 25 0:27 / /mnt/again/cpu rw - cgroup cgroup rw,cpu\n";
    let mounts = crate::sys::mountinfo::parse(table);
    assert_eq!(cgroup_v1_dirs(&mounts, false), ["cpu", "systemd"]);
    assert!(cgroup_v1_dirs(&mounts, true).is_empty());
}

#[test]
fn encoding() {
    let mut e = Enc::default();
    e.uint(1, 300).int32(2, -2).bool(3, true).str(4, "ab");
    assert_eq!(
        e.0,
        [
            0x08, 0xac, 0x02, 0x10, 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            0x18, 0x01, 0x22, 0x02, b'a', b'b'
        ]
    );
}

#[test]
fn the_kdat_link_is_made_once_and_nothing_else_is_touched() {
    let run = tempfile::tempdir().unwrap();
    let link = run.path().join("criu.kdat");
    let target = Path::new("/dev/shm/crab-criu-run/criu.kdat");
    // Nothing there: linked (the target need not exist yet: crab's next dump writes it).
    link_kdat_cache_at(&link, target);
    assert_eq!(fs::read_link(&link).unwrap(), target);
    // Linked already: kept.
    link_kdat_cache_at(&link, target);
    assert_eq!(fs::read_link(&link).unwrap(), target);
    // Someone else's link or file: left as it is.
    fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink("/elsewhere", &link).unwrap();
    link_kdat_cache_at(&link, target);
    assert_eq!(fs::read_link(&link).unwrap(), Path::new("/elsewhere"));
    fs::remove_file(&link).unwrap();
    fs::write(&link, b"a CRIU's own cache").unwrap();
    link_kdat_cache_at(&link, target);
    assert_eq!(fs::read(&link).unwrap(), b"a CRIU's own cache");
    // A directory it cannot write into: logged, nothing made, no panic.
    let missing = run.path().join("no-such-dir/criu.kdat");
    link_kdat_cache_at(&missing, target);
    assert!(fs::symlink_metadata(&missing).is_err());
}
