//! Installing crab without the development set-up, as the README's "Installing on a node"
//! says: `make install` into a staging root (DESTDIR), and `make deb`'s package installed with
//! `dpkg -i` in a clean Debian container (the agent test image, run by the stock runc shim so
//! that nothing of crab is on its path but the package).

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use crab_integration::{ctr::Ctr, sandbox::AGENT_IMAGE, TestEnv};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// `make <args>` in the repository: (exit code, stdout, stderr).
fn make(args: &[&str]) -> (i32, String, String) {
    let out = Command::new("make")
        .arg("--no-print-directory")
        .args(args)
        .current_dir(repo())
        .output()
        .expect("make runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// A directory under CRAB_HOME, removed when the test ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = TestEnv::from_env()
            .crab_home
            .join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn make_install_stages_the_binaries_and_never_overwrites_a_config() {
    let root = Scratch::new("install");
    let destdir = format!("DESTDIR={}", root.0.display());
    let args = ["install", &destdir, "PREFIX=/usr", "CONFDIR=/etc/crab"];
    let (code, out, err) = make(&args);
    assert_eq!(code, 0, "make install: {out}\n{err}");
    let (bin, conf) = (root.0.join("usr/bin"), root.0.join("etc/crab/config.toml"));
    for b in ["containerd-shim-crab-v1", "crabctl"] {
        assert_eq!(mode(&bin.join(b)), 0o755, "{b}");
    }
    assert_eq!(mode(&conf), 0o644);
    let example = repo().join("runtime-config/examples/crab.toml");
    assert_eq!(
        std::fs::read(&conf).unwrap(),
        std::fs::read(&example).unwrap()
    );
    // The printed snippets name where the shim and the config went.
    assert!(
        out.contains("runtime_path = \"/usr/bin/containerd-shim-crab-v1\"")
            && out.contains("\"ConfigPath\": \"/etc/crab/config.toml\""),
        "{out}"
    );
    // What was installed runs, and the installed config is one crab accepts.
    let v = Command::new(bin.join("containerd-shim-crab-v1"))
        .arg("-v")
        .output()
        .unwrap();
    let v = String::from_utf8_lossy(&v.stdout);
    assert!(v.contains("io.containerd.crab.v1"), "{v}");
    let shown = Command::new(bin.join("crabctl"))
        .arg("engine")
        .env("CRAB_CONFIG", &conf)
        .output()
        .unwrap();
    assert!(
        shown.status.success(),
        "crabctl refused the installed config: {}",
        String::from_utf8_lossy(&shown.stderr)
    );

    // A second install keeps the operator's config and puts the example beside it.
    std::fs::write(&conf, "[log]\nlevel = \"debug\"\n").unwrap();
    let (code, out, err) = make(&args);
    assert_eq!(code, 0, "second make install: {out}\n{err}");
    assert_eq!(
        std::fs::read_to_string(&conf).unwrap(),
        "[log]\nlevel = \"debug\"\n"
    );
    assert!(out.contains("kept"), "{out}");
    assert_eq!(
        std::fs::read(conf.with_extension("toml.example")).unwrap(),
        std::fs::read(&example).unwrap()
    );

    // A relative prefix is refused before anything is written.
    let other = Scratch::new("install-bad");
    let destdir = format!("DESTDIR={}", other.0.display());
    let (code, out, err) = make(&["install", &destdir, "PREFIX=usr/local"]);
    assert_ne!(code, 0, "a relative PREFIX was taken: {out}");
    assert!(err.contains("PREFIX must be an absolute path"), "{err}");
    assert_eq!(std::fs::read_dir(&other.0).unwrap().count(), 0);
}

#[test]
fn the_debian_package_installs_into_a_clean_debian_container() {
    let (code, out, err) = make(&["deb"]);
    assert_eq!(code, 0, "make deb: {out}\n{err}");
    let debian = repo().join("target/debian");
    let deb = std::fs::read_dir(&debian)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("crab_"))
                && p.extension().is_some_and(|x| x == "deb")
        })
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .expect("make deb wrote target/debian/crab_*.deb");

    // What the package says of itself and holds.
    let info = Command::new("dpkg-deb")
        .args(["--field", &deb.to_string_lossy()])
        .output()
        .unwrap();
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains("Package: crab"), "{info}");
    let depends = info
        .lines()
        .find(|l| l.starts_with("Depends:"))
        .unwrap_or_default();
    assert!(
        depends.contains("runc") && depends.contains("criu") && depends.contains("libc6"),
        "{info}"
    );

    // Installed in a clean Debian container (none of the package's dependencies there: the
    // check is what the package puts on a node and that it runs there), then removed.
    let pkg = Scratch::new("deb");
    std::fs::copy(&deb, pkg.0.join("crab.deb")).unwrap();
    let env = TestEnv::from_env();
    let ctr = Ctr::new(&env);
    let id = format!("it-deb-{}", std::process::id());
    let script = "set -e
        dpkg --force-depends -i /pkg/crab.deb >/dev/null 2>&1
        dpkg-query -W -f='status ${Status}\\n' crab
        stat -c 'mode %a %n' /usr/bin/containerd-shim-crab-v1 /usr/bin/crabctl /etc/crab/config.toml
        echo conffiles $(cat /var/lib/dpkg/info/crab.conffiles)
        containerd-shim-crab-v1 -v | grep Runtime
        crabctl --version
        ls /usr/share/doc/crab/examples
        dpkg -r crab >/dev/null 2>&1
        test ! -e /usr/bin/crabctl && echo removed
        test -e /etc/crab/config.toml && echo config kept";
    let mount = format!(
        "type=bind,src={},dst=/pkg,options=rbind:ro",
        pkg.0.display()
    );
    let run = ctr
        .run_with(
            &[
                "run",
                "--rm",
                "--runtime",
                "io.containerd.runc.v2",
                "--mount",
                &mount,
                AGENT_IMAGE,
                &id,
                "sh",
                "-c",
                script,
            ],
            None,
            Duration::from_secs(120),
        )
        .unwrap();
    let out = run.stdout.clone();
    assert_eq!(run.code(), 0, "in the container: {out}\n{}", run.stderr);
    let version = format!("crabctl {}", env!("CARGO_PKG_VERSION"));
    for want in [
        "status install ok installed",
        "mode 755 /usr/bin/containerd-shim-crab-v1",
        "mode 755 /usr/bin/crabctl",
        "mode 644 /etc/crab/config.toml",
        "conffiles /etc/crab/config.toml",
        "Runtime:  io.containerd.crab.v1",
        &version,
        "containerd-config.toml",
        "runtimeclass.yaml",
        "removed",
        "config kept",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}
