use super::*;

const HOOK_ARG: &str = "loopback-hook";

fn spec(edit: impl FnOnce(&mut serde_json::Value)) -> Spec {
    let mut v = serde_json::json!({
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs"},
        "process": {
            "cwd": "/",
            "args": ["sh"],
            "user": {"uid": 0, "gid": 0},
            "capabilities": {
                "bounding": ["CAP_CHOWN", "CAP_NET_RAW", "CAP_NET_BIND_SERVICE"],
                "effective": ["CAP_CHOWN"],
                "permitted": ["CAP_CHOWN"]
            }
        },
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "mount"}]
        }
    });
    edit(&mut v);
    serde_json::from_value(v).unwrap()
}

fn own_hook() -> serde_json::Value {
    serde_json::json!({
        "path": "/usr/local/bin/containerd-shim-crab-v1",
        "args": ["/usr/local/bin/containerd-shim-crab-v1", HOOK_ARG]
    })
}

#[test]
fn a_plain_container_with_its_own_namespace_may_leave_it_out() {
    assert!(spec_allows(&spec(|_| {}), HOOK_ARG));
    // crab's own loopback hook (added for restores) does not count.
    let with_hook = spec(|v| v["hooks"] = serde_json::json!({"createRuntime": [own_hook()]}));
    assert!(spec_allows(&with_hook, HOOK_ARG));
    // No capabilities at all: none held.
    let bare = spec(|v| {
        v["process"]
            .as_object_mut()
            .unwrap()
            .remove("capabilities")
            .map(drop)
            .unwrap()
    });
    assert!(spec_allows(&bare, HOOK_ARG));
}

#[test]
fn anything_that_may_configure_the_namespace_keeps_it_dumped() {
    let cases: Vec<(&str, Spec)> = vec![
        (
            "a namespace given by path (a pod's, Docker's)",
            spec(|v| v["linux"]["namespaces"][1]["path"] = "/var/run/netns/x".into()),
        ),
        (
            "the host's namespace",
            spec(|v| v["linux"]["namespaces"] = serde_json::json!([{"type": "pid"}])),
        ),
        (
            "no linux section",
            spec(|v| drop(v.as_object_mut().unwrap().remove("linux"))),
        ),
        (
            "CAP_NET_ADMIN in the init's bounding set",
            spec(|v| v["process"]["capabilities"]["bounding"][0] = "CAP_NET_ADMIN".into()),
        ),
        (
            "a net.* sysctl",
            spec(|v| {
                v["linux"]["sysctl"] =
                    serde_json::json!({"net.ipv4.ip_unprivileged_port_start": "0"})
            }),
        ),
        (
            "a prestart hook (CNI set-up by the host)",
            spec(|v| v["hooks"] = serde_json::json!({"prestart": [{"path": "/bin/true"}]})),
        ),
        (
            "a createRuntime hook that is not crab's",
            spec(
                |v| v["hooks"] = serde_json::json!({"createRuntime": [own_hook(), {"path": "/usr/bin/nerdctl", "args": ["nerdctl", "internal", "oci-hook", "createRuntime"]}]}),
            ),
        ),
        (
            "a hook disguised with crab's argument but another binary",
            spec(
                |v| v["hooks"] = serde_json::json!({"createRuntime": [{"path": "/bin/evil", "args": ["/bin/evil", HOOK_ARG]}]}),
            ),
        ),
        (
            "a poststart hook",
            spec(|v| v["hooks"] = serde_json::json!({"poststart": [{"path": "/bin/true"}]})),
        ),
    ];
    for (why, s) in cases {
        assert!(!spec_allows(&s, HOOK_ARG), "{why}");
    }
    // Other sysctls do not matter.
    let kernel =
        spec(|v| v["linux"]["sysctl"] = serde_json::json!({"kernel.shm_rmid_forced": "1"}));
    assert!(spec_allows(&kernel, HOOK_ARG));
}

#[test]
fn an_exec_granted_net_admin_taints_for_good() {
    let e = Eligibility::default();
    assert!(!e.holds(), "not before the spec is read");
    e.read_spec(&spec(|_| {}), HOOK_ARG);
    assert!(e.holds());
    let plain: Process = serde_json::from_value(serde_json::json!({
        "cwd": "/", "args": ["ls"], "user": {"uid": 0, "gid": 0},
        "capabilities": {"bounding": ["CAP_CHOWN"]}
    }))
    .unwrap();
    e.exec_added(&plain);
    assert!(e.holds());
    let admin: Process = serde_json::from_value(serde_json::json!({
        "cwd": "/", "args": ["ip", "addr", "add"], "user": {"uid": 0, "gid": 0},
        "capabilities": {"bounding": ["CAP_CHOWN", "CAP_NET_ADMIN"]}
    }))
    .unwrap();
    let shared = e.clone();
    shared.exec_added(&admin);
    assert!(!e.holds(), "the taint is shared by clones");
    e.exec_added(&plain);
    e.read_spec(&spec(|_| {}), HOOK_ARG);
    assert!(!e.holds(), "and kept");
    let t = Eligibility::default();
    t.read_spec(&spec(|_| {}), HOOK_ARG);
    t.taint("restored from an image with a network namespace");
    assert!(!t.holds());
}

#[test]
fn the_bounding_set_is_read_from_status() {
    let status = |bnd: &str| format!("Name:\tsh\nCapInh:\t0\nCapBnd:\t{bnd}\nCapAmb:\t0\n");
    assert_eq!(
        bounding_has_net_admin(status("00000000a80425fb").as_bytes()),
        Some(false)
    );
    assert_eq!(
        bounding_has_net_admin(status("000001ffffffffff").as_bytes()),
        Some(true)
    );
    assert_eq!(
        bounding_has_net_admin(status("0000000000001000").as_bytes()),
        Some(true)
    );
    for bad in ["", "zz", "1 2", "-1", "10000000000000000000"] {
        assert_eq!(
            bounding_has_net_admin(status(bad).as_bytes()),
            None,
            "{bad:?}"
        );
    }
    assert_eq!(bounding_has_net_admin(b"Name:\tsh\n"), None);
    assert_eq!(bounding_has_net_admin(&[0xff, 0xfe, b'\n']), None);
}

#[test]
fn interfaces_are_read_from_net_dev_and_oddities_count_as_interfaces() {
    let dev = b"Inter-|   Receive                 |  Transmit\n face |bytes    packets errs\n    lo:       0       0    0\n";
    assert_eq!(interfaces(dev), ["lo"]);
    let two = b"h1\nh2\n    lo: 0 0\n  eth0: 1 2\n";
    assert_eq!(interfaces(two), ["lo", "eth0"]);
    assert_eq!(
        interfaces(b"h1\nh2\ngarbage without colon\n"),
        ["garbage without colon"]
    );
    assert!(interfaces(b"h1\nh2\n\n").is_empty());
    assert!(interfaces(b"").is_empty());
}

#[test]
fn the_kernel_is_asked_about_this_process() {
    // This test process: its own namespace, whatever its interfaces and capabilities are.
    let me = std::process::id();
    let verdict = kernel_agrees(Path::new("/proc"), me, &[me]).unwrap();
    let status = std::fs::read(format!("/proc/{me}/status")).unwrap();
    let dev = std::fs::read(format!("/proc/{me}/net/dev")).unwrap();
    let want = if bounding_has_net_admin(&status) != Some(false) {
        Err(Dissent::NetAdmin(me))
    } else {
        match interfaces(&dev).into_iter().find(|i| i != "lo") {
            Some(i) => Err(Dissent::Interface(i)),
            None => Ok(()),
        }
    };
    assert_eq!(verdict, want);
    // A pid that is gone is skipped; an init that is gone is an error.
    let gone = 1 << 30;
    assert!(kernel_agrees(Path::new("/proc"), gone, &[]).is_err());
    assert_eq!(
        kernel_agrees(Path::new("/proc"), me, &[gone])
            .unwrap()
            .is_ok(),
        want.is_ok()
    );
}

#[test]
fn a_process_in_another_namespace_dissents() {
    // A fake /proc: init and a child with different ns/net inodes (two distinct files).
    let dir = tempfile::tempdir().unwrap();
    for (pid, bnd) in [(10, "0"), (11, "0")] {
        let p = dir.path().join(format!("{pid}"));
        std::fs::create_dir_all(p.join("ns")).unwrap();
        std::fs::create_dir_all(p.join("net")).unwrap();
        std::fs::write(p.join("ns/net"), format!("{pid}")).unwrap();
        std::fs::write(p.join("status"), format!("CapBnd:\t{bnd}\n")).unwrap();
        std::fs::write(p.join("net/dev"), "h\nh\n lo: 0\n").unwrap();
    }
    let proc = dir.path();
    assert_eq!(
        kernel_agrees(proc, 10, &[10, 11]).unwrap(),
        Err(Dissent::OtherNamespace(11))
    );
    // The same namespace (a hard link stands for the same inode): agreed.
    std::fs::remove_file(proc.join("11/ns/net")).unwrap();
    std::fs::hard_link(proc.join("10/ns/net"), proc.join("11/ns/net")).unwrap();
    assert_eq!(kernel_agrees(proc, 10, &[10, 11]).unwrap(), Ok(()));
    std::fs::write(proc.join("11/status"), "CapBnd:\t1000\n").unwrap();
    assert_eq!(
        kernel_agrees(proc, 10, &[10, 11]).unwrap(),
        Err(Dissent::NetAdmin(11))
    );
    std::fs::write(proc.join("11/status"), "no caps line\n").unwrap();
    assert_eq!(
        kernel_agrees(proc, 10, &[10, 11]).unwrap(),
        Err(Dissent::NetAdmin(11))
    );
    std::fs::write(proc.join("11/status"), "CapBnd:\t0\n").unwrap();
    std::fs::write(proc.join("10/net/dev"), "h\nh\n lo: 0\n veth0: 1\n").unwrap();
    assert_eq!(
        kernel_agrees(proc, 10, &[10, 11]).unwrap(),
        Err(Dissent::Interface("veth0".into()))
    );
}

#[test]
fn an_image_holds_a_namespace_when_it_has_a_netns_file() {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "core-1.img",
        "pstree.img",
        "netns-ct-9.img.bak",
        "ipcns-var-10.img",
    ] {
        std::fs::write(dir.path().join(f), "").unwrap();
    }
    assert!(!image_holds_one(dir.path()));
    std::fs::write(dir.path().join("netns-9.img"), "").unwrap();
    assert!(image_holds_one(dir.path()));
    assert!(
        image_holds_one(&dir.path().join("missing")),
        "unreadable counts as holding one"
    );
}
