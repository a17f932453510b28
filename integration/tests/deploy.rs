//! Installing crab on a cluster (deploy/): the node installer `deploy/install-node.sh`, run
//! against a temporary root the way the crab-installer DaemonSet runs it against a node's root
//! mounted at /host (HOST_ROOT), with small fake binaries in place of crab's; and the manifests
//! agree with what it registers. Needs no containerd: nothing here starts, stops or restarts
//! one (RESTART_CONTAINERD is never set).

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use tempfile::TempDir;

const SHIM: &str = "containerd-shim-crab-v1";
const CTL: &str = "crabctl";
const CONTAINERD_CONFIG: &str = "etc/containerd/config.toml";
const BACKUP: &str = "etc/containerd/config.toml.crab-backup";
const CRAB_CONFIG: &str = "etc/crab/config.toml";
const BEGIN_MARK: &str =
    "# crab runtime (added by crab's node installer; install-node.sh --uninstall removes it)";

/// containerd 1.7's kind of config: version 2, runc the default runtime, with its options.
const V2_CONFIG: &str = r#"# The node's own containerd config.
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.10"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
"#;

/// containerd 2.x's: version 3, single-quoted plugin names, and no newline at the end.
const V3_CONFIG: &str = "version = 3\n\n\
    [plugins.'io.containerd.cri.v1.runtime'.containerd]\n  default_runtime_name = 'runc'\n\n\
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  \
    runtime_type = 'io.containerd.runc.v2'\n\n\
    [plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = 'registry.k8s.io/pause:3.10'";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn example_config() -> Vec<u8> {
    fs::read(repo().join("runtime-config/examples/crab.toml")).unwrap()
}

/// What a directory holds, recursively: each entry's kind, mode and bytes (a link: its target).
#[derive(Debug, PartialEq, Eq, Clone)]
enum Entry {
    Dir(u32),
    File(u32, Vec<u8>),
    Link(PathBuf),
}

fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Entry> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Entry>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(base).unwrap().to_path_buf();
            let md = fs::symlink_metadata(&p).unwrap();
            let mode = md.permissions().mode() & 0o7777;
            if md.file_type().is_symlink() {
                out.insert(rel, Entry::Link(fs::read_link(&p).unwrap()));
            } else if md.is_dir() {
                out.insert(rel, Entry::Dir(mode));
                walk(base, &p, out);
            } else {
                out.insert(rel, Entry::File(mode, fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// A node's root (HOST_ROOT) and a directory of fake crab binaries to install from.
struct Node {
    root: TempDir,
    src: TempDir,
}

impl Node {
    fn new() -> Node {
        let node = Node {
            root: tempfile::tempdir().unwrap(),
            src: tempfile::tempdir().unwrap(),
        };
        for b in [SHIM, CTL] {
            let p = node.src.path().join(b);
            fs::write(&p, format!("#!/bin/sh\necho fake {b}\n")).unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(0o700)).unwrap();
        }
        node
    }

    /// A path below the node's root.
    fn path(&self, p: &str) -> PathBuf {
        self.root.path().join(p)
    }

    fn write(&self, p: &str, content: &str, mode: u32) {
        let p = self.path(p);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, content).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    }

    fn read(&self, p: &str) -> String {
        fs::read_to_string(self.path(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    /// deploy/install-node.sh with these arguments, HOST_ROOT this node's root.
    fn run(&self, args: &[&str]) -> Run {
        run_script(
            &repo().join("deploy/install-node.sh"),
            self.root.path(),
            args,
        )
    }

    fn install(&self) -> String {
        let src = self.src.path().to_str().unwrap().to_owned();
        let r = self.run(&[&src]);
        assert_eq!(r.code, 0, "install: {}\n{}", r.stdout, r.stderr);
        r.stdout
    }

    fn uninstall(&self) -> String {
        let r = self.run(&["--uninstall"]);
        assert_eq!(r.code, 0, "uninstall: {}\n{}", r.stdout, r.stderr);
        r.stdout
    }

    fn snapshot(&self) -> BTreeMap<PathBuf, Entry> {
        snapshot(self.root.path())
    }

    /// The binaries are the fake ones, mode 0755 (whatever the source's mode).
    fn assert_binaries_installed(&self) {
        for b in [SHIM, CTL] {
            let p = self.path("usr/local/bin").join(b);
            let md = fs::metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert_eq!(md.permissions().mode() & 0o7777, 0o755, "{b}");
            assert_eq!(
                fs::read(&p).unwrap(),
                fs::read(self.src.path().join(b)).unwrap(),
                "{b}"
            );
        }
    }
}

fn run_script(script: &Path, host_root: &Path, args: &[&str]) -> Run {
    let out = Command::new(script)
        .args(args)
        .env("HOST_ROOT", host_root)
        .env_remove("RESTART_CONTAINERD")
        .env_remove("CRAB_SOURCE_DIR")
        .env_remove("CRAB_EXAMPLE_CONFIG")
        .env_remove("CONTAINERD_CONFIG")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn parse(text: &str) -> toml::Table {
    text.parse::<toml::Table>()
        .unwrap_or_else(|e| panic!("not TOML: {e}\n{text}"))
}

/// `plugins.<plugin>.containerd.runtimes.<name>` of a parsed containerd config.
fn runtime<'a>(cfg: &'a toml::Table, plugin: &str, name: &str) -> Option<&'a toml::Table> {
    cfg.get("plugins")?
        .get(plugin)?
        .get("containerd")?
        .get("runtimes")?
        .get(name)?
        .as_table()
}

/// The crab runtime handler the installer registers, under `plugin`.
fn assert_crab_runtime(cfg: &toml::Table, plugin: &str) {
    let crab = runtime(cfg, plugin, "crab")
        .unwrap_or_else(|| panic!("no runtime crab under plugin {plugin}: {cfg:#?}"));
    assert_eq!(
        crab.get("runtime_type").and_then(|v| v.as_str()),
        Some("io.containerd.crab.v1")
    );
    let annotations = toml::Value::Array(vec!["io.crab/*".into()]);
    assert_eq!(crab.get("pod_annotations"), Some(&annotations));
    assert_eq!(crab.get("container_annotations"), Some(&annotations));
    let keys: Vec<&str> = crab.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["container_annotations", "pod_annotations", "runtime_type"]
    );
}

/// The config with crab's handler taken out, parsed: what the node had, semantically.
fn without_crab(mut cfg: toml::Table, plugin: &str) -> toml::Table {
    cfg["plugins"][plugin]["containerd"]["runtimes"]
        .as_table_mut()
        .unwrap()
        .remove("crab")
        .expect("a crab runtime");
    cfg
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

// (a)
#[test]
fn a_node_without_a_containerd_config_gets_a_version_2_one() {
    let node = Node::new();
    let out = node.install();
    node.assert_binaries_installed();
    assert_eq!(fs::read(node.path(CRAB_CONFIG)).unwrap(), example_config());
    assert_eq!(mode(&node.path(CRAB_CONFIG)), 0o644);

    let text = node.read(CONTAINERD_CONFIG);
    let cfg = parse(&text);
    assert_eq!(cfg.get("version").and_then(|v| v.as_integer()), Some(2));
    assert_crab_runtime(&cfg, "io.containerd.grpc.v1.cri");
    assert!(
        runtime(&cfg, "io.containerd.cri.v1.runtime", "crab").is_none(),
        "{text}"
    );
    assert_eq!(mode(&node.path(CONTAINERD_CONFIG)), 0o644);
    assert!(
        out.contains("created") && out.contains("containerd was not restarted"),
        "{out}"
    );

    // Exactly these were written: no backup (there was nothing to keep), no temporary file
    // left behind.
    let names: Vec<PathBuf> = node.snapshot().into_keys().collect();
    let want: Vec<PathBuf> = [
        "etc",
        "etc/containerd",
        "etc/containerd/config.toml",
        "etc/crab",
        "etc/crab/config.toml",
        "usr",
        "usr/local",
        "usr/local/bin",
        "usr/local/bin/containerd-shim-crab-v1",
        "usr/local/bin/crabctl",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(names, want);
}

// (b)
#[test]
fn an_existing_version_2_config_gets_the_section_the_rest_byte_for_byte_and_a_backup() {
    let node = Node::new();
    node.write(CONTAINERD_CONFIG, V2_CONFIG, 0o600);
    let out = node.install();
    node.assert_binaries_installed();

    let text = node.read(CONTAINERD_CONFIG);
    let added = text
        .strip_prefix(V2_CONFIG)
        .unwrap_or_else(|| panic!("the node's config was not kept as its prefix:\n{text}"));
    assert!(
        added.starts_with(&format!("\n{BEGIN_MARK}\n"))
            && added.ends_with("# end of crab runtime\n"),
        "{added}"
    );
    let cfg = parse(&text);
    assert_crab_runtime(&cfg, "io.containerd.grpc.v1.cri");
    assert_eq!(
        without_crab(cfg, "io.containerd.grpc.v1.cri"),
        parse(V2_CONFIG)
    );
    // The original, once, with its mode; the config keeps its mode too.
    assert_eq!(node.read(BACKUP), V2_CONFIG);
    assert_eq!(mode(&node.path(BACKUP)), 0o600);
    assert_eq!(mode(&node.path(CONTAINERD_CONFIG)), 0o600);
    assert!(out.contains("crab-backup"), "{out}");
}

// (c)
#[test]
fn a_version_3_config_gets_the_version_3_section() {
    let node = Node::new();
    node.write(CONTAINERD_CONFIG, V3_CONFIG, 0o644);
    node.install();

    let text = node.read(CONTAINERD_CONFIG);
    assert!(text.starts_with(V3_CONFIG), "{text}");
    assert!(
        text.contains("[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.crab]"),
        "{text}"
    );
    let cfg = parse(&text);
    assert_crab_runtime(&cfg, "io.containerd.cri.v1.runtime");
    // Nothing in version 2's spelling, which containerd 2.x would migrate or reject.
    assert!(
        cfg["plugins"].get("io.containerd.grpc.v1.cri").is_none(),
        "{text}"
    );
    assert_eq!(
        without_crab(cfg, "io.containerd.cri.v1.runtime"),
        parse(V3_CONFIG)
    );
    assert_eq!(node.read(BACKUP), V3_CONFIG);
}

// (d)
#[test]
fn a_second_run_changes_no_byte() {
    for original in [None, Some(V2_CONFIG), Some(V3_CONFIG)] {
        let node = Node::new();
        if let Some(text) = original {
            node.write(CONTAINERD_CONFIG, text, 0o644);
        }
        node.install();
        let first = node.snapshot();
        let out = node.install();
        assert_eq!(node.snapshot(), first, "after a second run ({original:?})");
        assert!(
            out.contains("already has the crab runtime: unchanged"),
            "{out}"
        );
        assert_eq!(
            node.read(CONTAINERD_CONFIG).matches(BEGIN_MARK).count(),
            1,
            "{original:?}"
        );
    }
}

// (e)
#[test]
fn an_existing_crab_config_is_kept() {
    let node = Node::new();
    let mine = "[log]\nlevel = \"debug\"\n";
    node.write(CRAB_CONFIG, mine, 0o600);
    let out = node.install();
    assert_eq!(node.read(CRAB_CONFIG), mine);
    assert_eq!(mode(&node.path(CRAB_CONFIG)), 0o600);
    assert!(out.contains("kept"), "{out}");
    // Not even written beside it: the directory holds the operator's file only.
    assert_eq!(fs::read_dir(node.path("etc/crab")).unwrap().count(), 1);
    node.assert_binaries_installed();
}

#[test]
fn a_crab_runtime_of_the_operators_own_is_left_alone() {
    let node = Node::new();
    let mine = format!(
        "{V2_CONFIG}\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crab]\n  \
         runtime_type = \"io.containerd.runc.v2\"\n  \
         runtime_path = \"/opt/crab/containerd-shim-crab-v1\"\n"
    );
    node.write(CONTAINERD_CONFIG, &mine, 0o644);
    let out = node.install();
    assert_eq!(node.read(CONTAINERD_CONFIG), mine);
    assert!(
        !node.path(BACKUP).exists(),
        "a backup of an unchanged config"
    );
    assert!(out.contains("of its own: left as it is"), "{out}");
    // ... and uninstalling leaves it too (it is not the installer's).
    node.uninstall();
    assert_eq!(node.read(CONTAINERD_CONFIG), mine);
}

// (f)
#[test]
fn uninstall_removes_the_binaries_and_the_section_and_restores_the_bytes() {
    for original in [V2_CONFIG, V3_CONFIG] {
        let node = Node::new();
        node.write(CONTAINERD_CONFIG, original, 0o640);
        node.install();
        node.install();
        let out = node.uninstall();
        assert_eq!(node.read(CONTAINERD_CONFIG), original);
        assert_eq!(mode(&node.path(CONTAINERD_CONFIG)), 0o640);
        for b in [SHIM, CTL] {
            let p = node.path("usr/local/bin").join(b);
            assert!(fs::symlink_metadata(&p).is_err(), "{} is left", p.display());
        }
        // crab's config stays; the backup goes, the config being its bytes again.
        assert_eq!(fs::read(node.path(CRAB_CONFIG)).unwrap(), example_config());
        assert!(!node.path(BACKUP).exists(), "{out}");
        assert!(out.contains("removed the crab runtime"), "{out}");

        // A second uninstall finds nothing to do and changes nothing.
        let before = node.snapshot();
        node.uninstall();
        assert_eq!(node.snapshot(), before);
    }
}

#[test]
fn uninstall_removes_a_config_the_installer_created_and_keeps_later_edits() {
    // Created by the installer: removed again.
    let node = Node::new();
    node.install();
    node.uninstall();
    assert!(!node.path(CONTAINERD_CONFIG).exists());
    assert!(node.path(CRAB_CONFIG).exists());

    // The operator changed the config after the install: the change stays, and so does the
    // backup (the config no longer matches it).
    let node = Node::new();
    node.write(CONTAINERD_CONFIG, V2_CONFIG, 0o644);
    node.install();
    let later = "\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.kata]\n  \
                 runtime_type = \"io.containerd.kata.v2\"\n";
    let text = node.read(CONTAINERD_CONFIG) + later;
    node.write(CONTAINERD_CONFIG, &text, 0o644);
    let out = node.uninstall();
    assert_eq!(node.read(CONTAINERD_CONFIG), format!("{V2_CONFIG}{later}"));
    assert_eq!(node.read(BACKUP), V2_CONFIG, "{out}");
}

// (g)
#[test]
fn a_symlink_out_of_the_node_root_is_refused_before_anything_is_written() {
    // Each case: what to put in the node's root, and the arguments.
    type Setup = fn(&Node, &Path);
    let cases: [(&str, Setup, bool); 5] = [
        (
            "usr/local/bin -> outside",
            |n, out| {
                fs::create_dir_all(n.path("usr/local")).unwrap();
                std::os::unix::fs::symlink(out, n.path("usr/local/bin")).unwrap();
            },
            false,
        ),
        (
            "usr -> outside (a directory above the target)",
            |n, out| {
                fs::create_dir_all(out.join("local/bin")).unwrap();
                std::os::unix::fs::symlink(out, n.path("usr")).unwrap();
            },
            false,
        ),
        (
            "etc/crab -> outside",
            |n, out| {
                fs::create_dir_all(n.path("etc")).unwrap();
                std::os::unix::fs::symlink(out, n.path("etc/crab")).unwrap();
            },
            false,
        ),
        (
            "containerd's config -> a file outside",
            |n, out| {
                fs::write(out.join("config.toml"), V2_CONFIG).unwrap();
                fs::create_dir_all(n.path("etc/containerd")).unwrap();
                std::os::unix::fs::symlink(out.join("config.toml"), n.path(CONTAINERD_CONFIG))
                    .unwrap();
            },
            false,
        ),
        (
            "uninstall with usr/local/bin -> outside, holding files of crab's names",
            |n, out| {
                for b in [SHIM, CTL] {
                    fs::write(out.join(b), "not the node's").unwrap();
                }
                fs::create_dir_all(n.path("usr/local")).unwrap();
                std::os::unix::fs::symlink(out, n.path("usr/local/bin")).unwrap();
            },
            true,
        ),
    ];
    for (what, setup, uninstall) in cases {
        let node = Node::new();
        let outside = tempfile::tempdir().unwrap();
        setup(&node, outside.path());
        let (root_before, outside_before) = (node.snapshot(), snapshot(outside.path()));
        let src = node.src.path().to_str().unwrap().to_owned();
        let r = if uninstall {
            node.run(&["--uninstall"])
        } else {
            node.run(&[&src])
        };
        assert_ne!(r.code, 0, "{what}: not refused: {}", r.stdout);
        assert!(
            r.stderr.contains("symbolic link"),
            "{what}: refused, but not for the link: {}",
            r.stderr
        );
        assert_eq!(snapshot(outside.path()), outside_before, "{what}: outside");
        assert_eq!(node.snapshot(), root_before, "{what}: node root");
    }
}

#[test]
fn a_config_of_another_version_is_refused_before_anything_is_written() {
    for original in [
        // containerd 1.x's version 1 (no version line), and Docker's containerd.io default.
        "[plugins.cri.containerd]\n  snapshotter = \"overlayfs\"\n",
        "disabled_plugins = [\"cri\"]\n",
        "version = 4\n",
    ] {
        let node = Node::new();
        node.write(CONTAINERD_CONFIG, original, 0o644);
        let before = node.snapshot();
        let src = node.src.path().to_str().unwrap().to_owned();
        let r = node.run(&[&src]);
        assert_ne!(r.code, 0, "{original:?}: taken: {}", r.stdout);
        assert!(r.stderr.contains("config version"), "{}", r.stderr);
        assert_eq!(node.snapshot(), before, "{original:?}");
    }
}

/// The installer image's layout (deploy/Dockerfile.installer): the script next to the binaries
/// in /opt/crab/bin, crab's example config in /opt/crab/share. Run from there it needs no
/// argument.
#[test]
fn the_installer_image_layout_needs_no_arguments() {
    let node = Node::new();
    let image = tempfile::tempdir().unwrap();
    let (bin, share) = (
        image.path().join("opt/crab/bin"),
        image.path().join("opt/crab/share"),
    );
    fs::create_dir_all(&bin).unwrap();
    fs::create_dir_all(&share).unwrap();
    for b in [SHIM, CTL] {
        fs::copy(node.src.path().join(b), bin.join(b)).unwrap();
    }
    fs::copy(
        repo().join("deploy/install-node.sh"),
        bin.join("install-node.sh"),
    )
    .unwrap();
    fs::write(share.join("crab.toml"), "# the image's copy\n").unwrap();
    let r = run_script(&bin.join("install-node.sh"), node.root.path(), &[]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    node.assert_binaries_installed();
    assert_eq!(node.read(CRAB_CONFIG), "# the image's copy\n");

    // The Dockerfile lays the image out so.
    let dockerfile = fs::read_to_string(repo().join("deploy/Dockerfile.installer")).unwrap();
    for want in [
        "FROM debian:bookworm-slim",
        "deploy/install-node.sh /opt/crab/bin/",
        "${BIN_DIR}/containerd-shim-crab-v1 ${BIN_DIR}/crabctl",
        "COPY runtime-config/examples/crab.toml /opt/crab/share/crab.toml",
    ] {
        assert!(
            dockerfile.contains(want),
            "Dockerfile.installer: no {want:?}"
        );
    }
}

/// The manifests name what the installer registers: handler `crab`, the installer's path in
/// its image, the node's root at /host.
#[test]
fn the_manifests_agree_with_the_installer() {
    let read = |f: &str| fs::read_to_string(repo().join("deploy").join(f)).unwrap();
    let lines = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .map(|l| l.trim().to_owned())
            .collect()
    };
    let has = |file: &str, want: &[&str]| {
        let l = lines(&read(file));
        for w in want {
            assert!(l.iter().any(|x| x == w), "{file}: no line {w:?}");
        }
    };
    has(
        "runtimeclass.yaml",
        &[
            "apiVersion: node.k8s.io/v1",
            "kind: RuntimeClass",
            "name: crab",
            "handler: crab",
        ],
    );
    has(
        "statefulset-example.yaml",
        &[
            "kind: StatefulSet",
            "kind: Service",
            "clusterIP: None",
            "serviceName: agent-sandbox",
            "runtimeClassName: crab",
            "io.crab/resume: newest",
            "io.crab/turn-boundary: exec",
            "image: debian:bookworm-slim",
            "command: [\"sleep\", \"infinity\"]",
        ],
    );
    has(
        "crab-installer.yaml",
        &[
            "kind: DaemonSet",
            "namespace: kube-system",
            "hostPID: true",
            "privileged: true",
            "image: crab-installer:latest",
            "- /opt/crab/bin/install-node.sh \"$@\" && exec sleep infinity",
            "mountPath: /host",
            "path: /",
            "value: /host",
        ],
    );
    // The handler the RuntimeClass names is the runtime the installer writes.
    let node = Node::new();
    node.install();
    assert!(runtime(
        &parse(&node.read(CONTAINERD_CONFIG)),
        "io.containerd.grpc.v1.cri",
        "crab"
    )
    .is_some());
}

#[test]
fn the_installer_script_is_clean_bash() {
    let script = repo().join("deploy/install-node.sh");
    assert_eq!(
        mode(&script) & 0o111,
        0o111,
        "install-node.sh is not executable"
    );
    let text = fs::read_to_string(&script).unwrap();
    assert!(text.starts_with("#!/usr/bin/env bash\n"));
    assert!(text.contains("\nset -euo pipefail\n"));
    let n = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(n.status.success(), "{}", String::from_utf8_lossy(&n.stderr));
    // shellcheck where it is installed (make deps does not install it).
    if let Ok(sc) = Command::new("shellcheck").arg(&script).output() {
        assert!(
            sc.status.success(),
            "shellcheck: {}",
            String::from_utf8_lossy(&sc.stdout)
        );
    } else {
        eprintln!("shellcheck is not installed: only bash -n checked");
    }
}
