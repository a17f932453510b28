//! crabctl with Docker Engine as crab's client: a private dockerd (Debian's docker.io) on the
//! private containerd, in both of Docker's storage modes, runs containers on crab; crabctl
//! finds them by Docker name and short id in namespace `moby`, exports their checkpoints (as an
//! archive for `docker load` under overlay2, into Docker's images under the containerd image
//! store), `docker run` of the image needs no command and brings back files and processes, and
//! fork/rollback/recover of a container dockerd owns are refused with what to do instead.
//!
//! The dockerd is this file's own: data root, exec root, socket and crab config under
//! `$CRAB_HOME/docker-crabctl/`, no bridge or iptables, stopped and removed after each test.
//! Nothing of a system Docker is used. The tests run one at a time (two dockerds would share
//! containerd's `moby` namespace).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use crab_integration::{ctr::Ctr, TestEnv};

const AGENT_IMAGE: &str = "localhost/crab/agent:latest";
const USAGE: i32 = 2;
const NOT_FOUND: i32 = 3;
const REFUSED: i32 = 4;

/// One dockerd at a time (they would share containerd's `moby` namespace).
static ONE_DOCKERD: Mutex<()> = Mutex::new(());

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A private dockerd on the private containerd.
struct Dockerd {
    env: TestEnv,
    dir: PathBuf,
    socket: PathBuf,
    child: Child,
}

impl Dockerd {
    /// Starts dockerd with the overlay2 graph driver, or (`containerd_store`) containerd's
    /// image store; its runtime `crab` is io.containerd.crab.v1 with a config of its own.
    fn start(name: &str, containerd_store: bool) -> Dockerd {
        Dockerd::start_with(name, containerd_store, "")
    }

    /// [`Dockerd::start`] with `extra` appended to its crab config.
    fn start_with(name: &str, containerd_store: bool, extra: &str) -> Dockerd {
        let env = TestEnv::from_env();
        let dir = env.crab_home.join("docker-crabctl").join(name);
        cleanup_dir(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("crab.toml");
        std::fs::write(
            &config,
            format!(
                "[store]\nstate_dir = \"{}\"\n{extra}",
                dir.join("crab-state").display()
            ),
        )
        .unwrap();
        let mut daemon = serde_json::json!({
            "runtimes": {"crab": {"runtimeType": "io.containerd.crab.v1",
                                   "options": {"ConfigPath": config}}},
        });
        if containerd_store {
            daemon["features"] = serde_json::json!({"containerd-snapshotter": true});
        }
        std::fs::write(dir.join("daemon.json"), daemon.to_string()).unwrap();
        let socket = dir.join("docker.sock");
        let log = std::fs::File::create(dir.join("dockerd.log")).unwrap();
        let child = Command::new("dockerd")
            .arg(format!("--containerd={}", env.address.display()))
            .args(["--data-root".as_ref(), dir.join("root").as_os_str()])
            .args(["--exec-root".as_ref(), dir.join("exec").as_os_str()])
            .arg(format!("--host=unix://{}", socket.display()))
            .args(["--pidfile".as_ref(), dir.join("docker.pid").as_os_str()])
            .args(["--bridge=none", "--iptables=false", "--ip6tables=false"])
            .args([
                "--config-file".as_ref(),
                dir.join("daemon.json").as_os_str(),
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start dockerd (is docker.io installed?): {e}"));
        let d = Dockerd {
            env,
            dir,
            socket,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if d.docker(&["version", "--format", "{{.Server.Version}}"]).0 == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "dockerd did not come up; its log: {}",
                std::fs::read_to_string(d.dir.join("dockerd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let driver = d.ok(&["info", "--format", "{{.Driver}}"]);
        let expected = if containerd_store {
            "overlayfs"
        } else {
            "overlay2"
        };
        assert_eq!(driver.trim(), expected, "dockerd's storage");
        d
    }

    fn docker_host(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// `docker ARGS`: (status, stdout, stderr).
    fn docker(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new("docker")
            .env("DOCKER_HOST", self.docker_host())
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run docker: {e}"));
        (
            out.status.code().unwrap_or(-1),
            text(&out.stdout),
            text(&out.stderr),
        )
    }

    /// `docker ARGS`, which must succeed: its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.docker(args);
        assert_eq!(code, 0, "docker {args:?}: {out}{err}");
        out
    }

    /// `crabctl -n moby ARGS` with this dockerd as DOCKER_HOST: (status, stdout, stderr).
    fn crabctl(&self, args: &[&str]) -> (i32, String, String) {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let out = Command::new(&bin)
            .env("DOCKER_HOST", self.docker_host())
            .arg("--address")
            .arg(&self.env.address)
            .args(["--namespace", "moby"])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        (
            out.status.code().unwrap_or(-1),
            text(&out.stdout),
            text(&out.stderr),
        )
    }

    fn crabctl_ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.crabctl(args);
        assert_eq!(code, 0, "crabctl {args:?}: {out}{err}");
        out
    }

    /// The test image, from the private containerd (`make images`) into dockerd.
    fn load_agent(&self) {
        let tar = self.dir.join("agent.tar");
        Ctr::new(&self.env)
            .export_image(AGENT_IMAGE, &tar)
            .unwrap_or_else(|e| panic!("exporting {AGENT_IMAGE} (make images): {e}"));
        self.ok(&["load", "-i", &tar.display().to_string()]);
        std::fs::remove_file(&tar).unwrap();
    }

    /// Starts a container on crab running `sleep infinity`; its full id.
    fn run(&self, name: &str) -> String {
        let id = self.ok(&[
            "run",
            "-d",
            "--name",
            name,
            "--runtime",
            "crab",
            AGENT_IMAGE,
            "sleep",
            "infinity",
        ]);
        id.trim().to_string()
    }

    fn exec(&self, name: &str, script: &str) -> String {
        self.ok(&["exec", name, "bash", "-c", script])
    }

    /// Ends turn `turn` of container `name` (by its Docker name) and waits for its checkpoint
    /// (an exec goes through the shim's checkpoint gate).
    fn turn(&self, name: &str, turn: &str) {
        self.crabctl_ok(&["turn-end", name, "--turn", turn]);
        self.exec(name, "true");
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let (_, ids, _) = self.docker(&["ps", "-aq"]);
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if !ids.is_empty() {
            let mut args = vec!["rm", "-f"];
            args.extend(ids);
            self.docker(&args);
        }
        // Images too: with the containerd image store they are containerd's (namespace moby).
        let (_, images, _) = self.docker(&["images", "-aq"]);
        let images: Vec<&str> = images.split_whitespace().collect();
        if !images.is_empty() {
            let mut args = vec!["rmi", "-f"];
            args.extend(images);
            self.docker(&args);
        }
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        cleanup_dir(&self.dir);
    }
}

/// Removes `dir` after unmounting whatever dockerd left mounted below it.
fn cleanup_dir(dir: &Path) {
    if !dir.exists() {
        return;
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<&str> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| Path::new(p).starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = Command::new("umount").args(["-l", p]).status();
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The first `n` characters of `id` (Docker's short id is 12).
fn short(id: &str, n: usize) -> &str {
    &id[..n]
}

/// The modes [`agent_with_two_turns`] leaves on the directories above its changes.
const MODES: &str = "/tmp 1777\n/root 700\n/app 755\n/app/src 755\n";

/// A container with files changed (added, modified in a directory of the image, deleted from
/// the image) in turn t1 and a background counter started in turn t2.
fn agent_with_two_turns(d: &Dockerd, name: &str) -> String {
    let id = d.run(name);
    assert_eq!(
        d.exec(
            name,
            "mkdir -p /app && stat -c '%n %a' /tmp /root /app && umask"
        ),
        "/tmp 1777\n/root 700\n/app 755\n0022\n",
        "the image's directory modes and the umask the agent's files get"
    );
    d.exec(
        name,
        "echo hello > /root/hello.txt && mkdir -p /app/src && echo v1 > /app/src/v \
         && rm /etc/issue.net",
    );
    d.turn(name, "t1");
    d.exec(
        name,
        "setsid bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; \
         mv /tmp/c.new /tmp/count; sleep 0.1; done' \
         >/dev/null 2>&1 </dev/null & sleep 1",
    );
    d.turn(name, "t2");
    let (_, out, _) = d.crabctl(&["checkpoints", name]);
    assert!(
        out.contains(" t1 ") && out.contains(" t2 "),
        "both turns have checkpoints:\n{out}"
    );
    id
}

/// A container started from a checkpoint image of [`agent_with_two_turns`] at t2 has its files
/// and its counter (the image's command is `sleep infinity`: only a restore runs the loop).
fn assert_restored_at_t2(d: &Dockerd, name: &str) {
    let files = d.exec(
        name,
        "cat /root/hello.txt /app/src/v; test -e /etc/issue.net && echo issue-there; \
         test -e /.crab-checkpoint && echo reserved-visible; true",
    );
    assert_eq!(files, "hello\nv1\n", "files of the checkpoint");
    // The directories above the changed files keep the image's modes: a layer without their
    // entries had Docker's layer store make them 0755 (a /tmp no other user could write).
    let modes = d.exec(name, "stat -c '%n %a' /tmp /root /app /app/src");
    assert_eq!(
        modes, MODES,
        "directory modes after the restore (the image's, and /app/src as the agent made it)"
    );
    let ps = d.exec(name, "ps -eo args");
    assert!(
        ps.contains("while true"),
        "the counter was restored, processes:\n{ps}"
    );
    let first: u64 = d.exec(name, "cat /tmp/count").trim().parse().unwrap();
    std::thread::sleep(Duration::from_millis(600));
    let later: u64 = d.exec(name, "cat /tmp/count").trim().parse().unwrap();
    assert!(
        later > first,
        "the restored counter counts: {first} then {later}"
    );
}

#[test]
fn overlay2_docker_containers_export_as_archives_and_restore_through_docker_run() {
    let _one = ONE_DOCKERD.lock().unwrap_or_else(|e| e.into_inner());
    let d = Dockerd::start("overlay2", false);
    d.load_agent();
    let id = agent_with_two_turns(&d, "dx-agent");

    // Short ids and names resolve; the note says to what.
    let (code, _, err) = d.crabctl(&["turns", short(&id, 12)]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&id), "{err}");
    let (code, _, err) = d.crabctl(&["turns", "dx-agent"]);
    assert!(
        code == 0 && err.contains(&format!("Docker container dx-agent is {id}")),
        "{err}"
    );
    let (code, _, err) = d.crabctl(&["turns", "no-such-name"]);
    assert_eq!(code, NOT_FOUND, "{err}");

    // In-place operations are refused, saying what to do instead; nothing is touched.
    for args in [
        &["rollback", "dx-agent", "--to", "t1"][..],
        &["recover", "dx-agent"],
        &["fork", "dx-agent", "--at", "t1", "--count", "1"],
    ] {
        let (code, out, err) = d.crabctl(args);
        assert_eq!(code, REFUSED, "crabctl {args:?}: {out}{err}");
        for needle in [
            "run by Docker",
            "export",
            "--output",
            "docker load",
            "docker run",
        ] {
            assert!(
                err.contains(needle),
                "crabctl {args:?}: no {needle:?} in {err}"
            );
        }
    }
    assert_eq!(
        d.ok(&["inspect", "-f", "{{.State.Running}} {{.Id}}", "dx-agent"])
            .trim(),
        format!("true {id}")
    );

    // Without an image in containerd, the base comes from the rootfs's lower layers.
    let archive = d.dir.join("cp.tar");
    let out = d.crabctl_ok(&[
        "export",
        "dx-agent",
        "--turn",
        "t2",
        "localhost/crab/dx-cp:t2",
        "--output",
        &archive.display().to_string(),
    ]);
    assert!(out.contains("with the process image"), "{out}");
    assert!(out.contains(&archive.display().to_string()), "{out}");
    let loaded = d.ok(&["load", "-i", &archive.display().to_string()]);
    assert!(loaded.contains("localhost/crab/dx-cp:t2"), "{loaded}");
    // The config runs the container's process: no command needed.
    let config = d.ok(&[
        "inspect",
        "-f",
        "{{json .Config}}",
        "localhost/crab/dx-cp:t2",
    ]);
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(
        config["Cmd"],
        serde_json::json!(["sleep", "infinity"]),
        "{config}"
    );
    assert!(config["Entrypoint"].is_null(), "{config}");
    assert_eq!(config["WorkingDir"], "/app", "{config}");
    assert!(
        config["Env"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| !e.as_str().unwrap().starts_with("HOSTNAME=")),
        "{config}"
    );
    d.ok(&[
        "run",
        "-d",
        "--name",
        "dx-restored",
        "--runtime",
        "crab",
        "localhost/crab/dx-cp:t2",
    ]);
    assert_restored_at_t2(&d, "dx-restored");

    // The restored sandbox's own checkpoints export too (its chain begins with the image's
    // layers, which are in the first container's store, not in containerd): a second crash is
    // as recoverable as the first.
    d.exec("dx-restored", "echo second > /root/second.txt");
    d.turn("dx-restored", "t3");
    let archive3 = d.dir.join("cp3.tar");
    d.crabctl_ok(&[
        "export",
        "dx-restored",
        "--turn",
        "t3",
        "localhost/crab/dx-cp:t3",
        "--output",
        &archive3.display().to_string(),
    ]);
    d.ok(&["load", "-i", &archive3.display().to_string()]);
    // Generations do not stack: the second image is the first plus t3's layer (not the first's
    // layers again as its base, its checkpoint layer among them).
    let layers = |image: &str| -> usize {
        d.ok(&["image", "inspect", "-f", "{{len .RootFS.Layers}}", image])
            .trim()
            .parse()
            .unwrap()
    };
    assert_eq!(
        layers("localhost/crab/dx-cp:t3"),
        layers("localhost/crab/dx-cp:t2") + 1,
        "one layer more per generation"
    );
    d.ok(&[
        "run",
        "-d",
        "--name",
        "dx-restored-twice",
        "--runtime",
        "crab",
        "localhost/crab/dx-cp:t3",
    ]);
    assert_restored_at_t2(&d, "dx-restored-twice");
    assert_eq!(
        d.exec("dx-restored-twice", "cat /root/second.txt"),
        "second\n"
    );
    d.ok(&["rm", "-f", "dx-restored-twice"]);

    // Publishing a restored sandbox's files: `--files-only` is a plain image without the
    // checkpoint layer (`docker commit` would carry the processes' memory under a whiteout), and
    // it starts its command afresh.
    let files = d.dir.join("files.tar");
    let out = d.crabctl_ok(&[
        "export",
        "dx-restored",
        "localhost/crab/dx-files:t3",
        "--files-only",
        "-o",
        &files.display().to_string(),
    ]);
    assert!(out.contains("no checkpoint layer"), "{out}");
    d.ok(&["load", "-i", &files.display().to_string()]);
    assert_eq!(
        layers("localhost/crab/dx-files:t3"),
        layers("localhost/crab/dx-cp:t3") - 1,
        "the checkpoint image less its checkpoint layer"
    );
    // No layer holds the reserved directory, or a whiteout of it.
    let holds_checkpoint = |image: &str| -> bool {
        let data = d.ok(&[
            "image",
            "inspect",
            "-f",
            "{{json .GraphDriver.Data}}",
            image,
        ]);
        let data: serde_json::Value = serde_json::from_str(&data).unwrap();
        let mut dirs: Vec<String> = data["LowerDir"]
            .as_str()
            .unwrap_or_default()
            .split(':')
            .map(str::to_string)
            .collect();
        dirs.extend(data["UpperDir"].as_str().map(str::to_string));
        dirs.iter()
            .filter(|d| !d.is_empty())
            .any(|d| std::fs::symlink_metadata(Path::new(d).join(".crab-checkpoint")).is_ok())
    };
    assert!(
        holds_checkpoint("localhost/crab/dx-cp:t3"),
        "the check can see one"
    );
    assert!(!holds_checkpoint("localhost/crab/dx-files:t3"));
    for runtime in ["runc", "crab"] {
        let name = format!("dx-files-{runtime}");
        d.ok(&[
            "run",
            "-d",
            "--name",
            &name,
            "--runtime",
            runtime,
            "localhost/crab/dx-files:t3",
        ]);
        assert_eq!(
            d.exec(
                &name,
                "cat /root/hello.txt /root/second.txt; stat -c '%a' /tmp; \
                 test -e /.crab-checkpoint && echo reserved; \
                 ps -eo args | grep -q '[w]hile true' && echo counter; true"
            ),
            "hello\nsecond\n1777\n",
            "{runtime}: the files, a fresh start"
        );
        d.ok(&["rm", "-f", &name]);
    }

    // A files-only checkpoint (t1) by short id: the files, no counter.
    let archive1 = d.dir.join("cp1.tar");
    d.crabctl_ok(&[
        "export",
        short(&id, 12),
        "localhost/crab/dx-cp:t1",
        "--turn",
        "t1",
        "-o",
        &archive1.display().to_string(),
    ]);
    d.ok(&["load", "-i", &archive1.display().to_string()]);
    d.ok(&[
        "run",
        "-d",
        "--name",
        "dx-t1",
        "--runtime",
        "crab",
        "localhost/crab/dx-cp:t1",
    ]);
    let files = d.exec(
        "dx-t1",
        "cat /root/hello.txt /app/src/v; test -e /etc/issue.net && echo issue-there; \
         test -e /tmp/count && echo counted; true",
    );
    assert_eq!(files, "hello\nv1\n");

    // A name no container has and an unusable output are clear errors; no half archive.
    let bad = d.dir.join("no-such-dir").join("x.tar");
    let (code, _, err) = d.crabctl(&["export", "dx-agent", "x", "-o", &bad.display().to_string()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("archive"), "{err}");
    assert!(!bad.exists());

    // After a crash: the container killed, dockerd removes its containerd record (and keeps
    // the container). Its export works from dockerd's description of it and its store (found
    // with --config: the crab config of dockerd's runtime), and restores as before.
    d.ok(&["kill", "dx-agent"]);
    let (code, _, err) = d.crabctl(&["checkpoints", "dx-agent"]);
    assert_eq!(code, NOT_FOUND, "no record, no config: {err}");
    let config = d.dir.join("crab.toml").display().to_string();
    let archive3 = d.dir.join("cp3.tar").display().to_string();
    let out = d.crabctl_ok(&[
        "export",
        "dx-agent",
        "localhost/crab/dx-cp:after-kill",
        "--config",
        &config,
        "-o",
        &archive3,
    ]);
    assert!(
        out.contains("(turn \"t2\", full)"),
        "the newest recovery point: {out}"
    );
    d.ok(&["load", "-i", &archive3]);
    // The docs' recipe for a hostname in step: the source's, given to the restore.
    let source_hostname = d
        .ok(&["inspect", "-f", "{{.Config.Hostname}}", "dx-agent"])
        .trim()
        .to_string();
    d.ok(&[
        "run",
        "-d",
        "--name",
        "dx-after-kill",
        "--hostname",
        &source_hostname,
        "--runtime",
        "crab",
        "localhost/crab/dx-cp:after-kill",
    ]);
    assert_restored_at_t2(&d, "dx-after-kill");
    assert_eq!(
        d.exec("dx-after-kill", "hostname; cat /etc/hostname"),
        format!("{source_hostname}\n{source_hostname}\n"),
        "the restored kernel hostname and Docker's /etc/hostname agree"
    );
    let (code, _, err) = d.crabctl(&["recover", "dx-agent", "--config", &config]);
    assert_eq!(code, REFUSED, "{err}");
    assert!(err.contains("docker run"), "{err}");

    removed_container_recovers(&d, true);
}

/// `docker run --rm`, crashed: Docker deletes the container, its record and its layers.
/// crab's store keeps what an export needs (the image's layers in rootfs.json, the container's
/// command, env and cwd in spec.json): no --base-image, and the image runs the container's own
/// command (`sleep infinity`), not its base image's (`bash`, which exits). `archive`: export an
/// archive and `docker load` it (overlay2), else into Docker's images (the containerd store).
fn removed_container_recovers(d: &Dockerd, archive: bool) {
    let rm_id = d
        .ok(&[
            "run",
            "-d",
            "--rm",
            "--name",
            "dx-rm",
            "--runtime",
            "crab",
            "-w",
            "/app",
            "-e",
            "AGENT_TOKEN=t-1",
            AGENT_IMAGE,
            "sleep",
            "infinity",
        ])
        .trim()
        .to_string();
    d.exec("dx-rm", "echo kept > /app/kept.txt");
    d.turn("dx-rm", "t1");
    d.ok(&["kill", "dx-rm"]);
    let removed = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        d.docker(&["inspect", &rm_id]).0 != 0
    });
    assert!(removed, "--rm removed the container");
    let config = d.dir.join("crab.toml").display().to_string();
    let archive_rm = d.dir.join("rm.tar").display().to_string();
    let mut args = vec![
        "export",
        &rm_id,
        "localhost/crab/dx-rm:t1",
        "--config",
        &config,
    ];
    if archive {
        args.extend(["-o", &archive_rm]);
    }
    let out = d.crabctl_ok(&args);
    assert!(out.contains("(turn \"t1\", fs)"), "{out}");
    if archive {
        d.ok(&["load", "-i", &archive_rm]);
    }
    let config_rm: serde_json::Value = serde_json::from_str(&d.ok(&[
        "inspect",
        "-f",
        "{{json .Config}}",
        "localhost/crab/dx-rm:t1",
    ]))
    .unwrap();
    assert_eq!(
        config_rm["Cmd"],
        serde_json::json!(["sleep", "infinity"]),
        "{config_rm}"
    );
    assert_eq!(config_rm["WorkingDir"], "/app", "{config_rm}");
    assert!(
        config_rm["Env"].to_string().contains("AGENT_TOKEN=t-1"),
        "{config_rm}"
    );
    d.ok(&[
        "run",
        "-d",
        "--name",
        "dx-rm-back",
        "--runtime",
        "crab",
        "localhost/crab/dx-rm:t1",
    ]);
    assert_eq!(
        d.exec(
            "dx-rm-back",
            "cat /app/kept.txt; tr '\\0' ' ' < /proc/1/cmdline; echo; stat -c '%n %a' /tmp"
        ),
        "kept\nsleep infinity \n/tmp 1777\n"
    );
}

#[test]
fn containerd_store_docker_containers_export_into_dockers_images() {
    let _one = ONE_DOCKERD.lock().unwrap_or_else(|e| e.into_inner());
    let d = Dockerd::start("containerd-store", true);
    d.load_agent();
    let id = agent_with_two_turns(&d, "dx-agent");

    // Docker's images are containerd's images in namespace moby: an export there is one.
    for (reference, extra) in [
        ("localhost/crab/dx-cp:rootfs", &[][..]),
        (
            "localhost/crab/dx-cp:based",
            &["--base-image", AGENT_IMAGE][..],
        ),
    ] {
        let mut args = vec!["export", short(&id, 16), reference, "--turn", "t2"];
        args.extend(extra);
        let out = d.crabctl_ok(&args);
        assert!(out.contains("with the process image"), "{out}");
        let images = d.ok(&["images", "--format", "{{.Repository}}:{{.Tag}}"]);
        assert!(images.contains(reference), "{reference} in {images}");
        let name = format!("dx-{}", reference.rsplit(':').next().unwrap());
        d.ok(&["run", "-d", "--name", &name, "--runtime", "crab", reference]);
        assert_restored_at_t2(&d, &name);
    }
    // A base image that is not there is named.
    let (code, _, err) = d.crabctl(&["export", "dx-agent", "x:1", "--base-image", "no/such:1"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no/such:1"), "{err}");
    removed_container_recovers(&d, false);
}

#[test]
fn ambiguous_id_prefixes_list_their_candidates() {
    let env = TestEnv::from_env();
    let ctr = Ctr::new(&env);
    let ids = ["dacafe0001", "dacafe0002"];
    for id in ids {
        let _ = ctr.run(&["containers", "rm", id]);
        ctr.run(&["containers", "create", &env.image, id])
            .and_then(|o| o.ok())
            .unwrap();
    }
    let crabctl = |args: &[&str]| {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let out = Command::new(&bin)
            .arg("--address")
            .arg(&env.address)
            .args(["--namespace", &env.namespace])
            .args(args)
            .output()
            .unwrap();
        (out.status.code().unwrap_or(-1), text(&out.stderr))
    };
    let (code, err) = crabctl(&["checkpoints", "dacafe"]);
    for id in ids {
        let _ = ctr.run(&["containers", "rm", id]);
    }
    assert_eq!(code, USAGE, "{err}");
    assert!(
        err.contains("ambiguous") && err.contains(ids[0]) && err.contains(ids[1]),
        "{err}"
    );
    // Outside namespace moby, a name is never asked of Docker.
    let (code, err) = crabctl(&["checkpoints", "dx-agent"]);
    assert_eq!(code, NOT_FOUND, "{err}");
    assert!(!err.contains("Docker"), "{err}");
}

/// `[limits] max_image_layers` of the long-episode tests: fewer than their chains of fs layers.
const LAYER_BOUND: usize = 8;

/// What the long episode leaves, as the tests compare it: every path under /app and /etc/skel
/// with its type, mode, owner and mtime (and size, link count and target of what is not a
/// directory), every file's content, and what is gone from the image. (A directory's own
/// timestamp is not state to crab's inspector: `touch` of a directory alone is no change; a
/// directory's mtime travels with the layer of the turn that changed something below it.)
const EPISODE_STATE: &str =
    "{ find /app /etc/skel -xdev ! -type d -printf '%p %y %m %u:%g %s %n %l %T@\\n'; \
     find /app /etc/skel -xdev -type d -printf '%p %y %m %u:%g %T@\\n'; } | sort; \
     find /app /etc/skel -xdev -type f -exec md5sum {} + | sort -k2; \
     test -e /etc/issue.net && echo issue-there; test -e /etc/skel/.bashrc && echo skel-there; \
     ps -eo args | grep -c '^sleep 4242' ; true";

/// A turn of the long episode: `script`, then the turn's end (each one changes files: an fs
/// checkpoint, a layer of the chain).
fn episode_turn(d: &Dockerd, name: &str, turn: &str, script: &str) {
    d.exec(name, script);
    d.turn(name, turn);
}

/// Layers of image `image` in dockerd.
fn image_layers(d: &Dockerd, image: &str) -> usize {
    d.ok(&["image", "inspect", "-f", "{{len .RootFS.Layers}}", image])
        .trim()
        .parse()
        .unwrap()
}

/// Exports `name`'s newest checkpoint as `reference` (through an archive when `archive`),
/// checks the image keeps within [`LAYER_BOUND`] layers, runs it as `restored` and checks that
/// the restored sandbox is what `name` was at its last turn end.
fn export_squashed_and_restore(
    d: &Dockerd,
    name: &str,
    reference: &str,
    restored: &str,
    archive: bool,
) {
    let want = d.exec(name, EPISODE_STATE);
    let mut args = vec!["export", name, reference];
    let path = d.dir.join(format!("{restored}.tar")).display().to_string();
    if archive {
        args.extend(["--output", path.as_str()]);
    }
    let out = d.crabctl_ok(&args);
    if archive {
        d.ok(&["load", "-i", &path]);
    }
    let layers = image_layers(d, reference);
    d.ok(&[
        "run",
        "-d",
        "--name",
        restored,
        "--runtime",
        "crab",
        reference,
    ]);
    assert_eq!(
        d.exec(restored, EPISODE_STATE),
        want,
        "{restored} (from {reference}, {layers} layers) against {name} at its last turn"
    );
    assert!(
        layers <= LAYER_BOUND,
        "{reference}: {layers} layers, more than [limits] max_image_layers ({LAYER_BOUND}): {out}"
    );
}

/// A sandbox with more fs checkpoints than an image may have layers exports within the bound
/// (runs of its chain squashed into one layer each), and what comes back is exact: deletions of
/// the image's files and directories (a directory deleted and made again hides the image's
/// content), renames, hard links, symlinks, a FIFO, a sparse file, modes, owners and mtimes, a
/// process. The restored sandbox's own checkpoints export the same way (its chain begins with
/// the squashed layers): a second generation.
fn long_episode(d: &Dockerd, archive: bool) {
    d.load_agent();
    d.run("sq-agent");
    let turns = [
        "mkdir -p /app/w && echo one > /app/w/f1 && echo keep > /app/keep && ln /app/keep /app/keep-link \
         && mkdir -m 700 /app/secret && echo s > /app/secret/s && chown 1000:1000 /app/secret/s",
        "rm /etc/issue.net && echo two > /app/w/f2",
        "rm -rf /etc/skel && mkdir /etc/skel && echo new > /etc/skel/only",
        "truncate -s 20M /app/sparse && printf x | dd of=/app/sparse bs=1 seek=10485760 conv=notrunc status=none",
        "mv /app/w/f1 /app/w/f1-renamed",
        "ln -s /app/keep /app/sym && mkfifo -m 600 /app/fifo",
        "echo changed >> /app/keep",
        "rm /app/w/f2 && chmod 640 /app/keep",
        "echo 9 > /app/n9 && touch -d '2001-02-03 04:05:06' /app/w/f1-renamed",
        "echo 10 > /app/n10 && mkdir -p /app/deep/a/b/c && echo deep > /app/deep/a/b/c/f",
        "echo 11 > /app/n11 && rm -rf /app/deep/a/b",
        "echo 12 > /app/n12 && (setsid sleep 4242 >/dev/null 2>&1 </dev/null &)",
    ];
    for (i, script) in turns.iter().enumerate() {
        episode_turn(d, "sq-agent", &format!("t{}", i + 1), script);
    }
    let state = d.exec("sq-agent", EPISODE_STATE);
    assert!(
        !state.contains("issue-there") && !state.contains("skel-there") && state.ends_with("1\n"),
        "the episode's own state: {state}"
    );
    export_squashed_and_restore(d, "sq-agent", "localhost/crab/sq:g1", "sq-g1", archive);
    for (i, script) in [
        "echo g2 > /app/g2 && rm /app/n9",
        "rm /app/keep-link && echo g2b >> /app/w/f1-renamed",
        "mkdir -p /etc/skel/sub && echo x > /etc/skel/sub/x",
    ]
    .iter()
    .enumerate()
    {
        episode_turn(d, "sq-g1", &format!("g{}", i + 1), script);
    }
    export_squashed_and_restore(d, "sq-g1", "localhost/crab/sq:g2", "sq-g2", archive);
}

#[test]
fn overlay2_long_episodes_export_within_the_layer_bound() {
    let _one = ONE_DOCKERD.lock().unwrap_or_else(|e| e.into_inner());
    let d = Dockerd::start_with(
        "overlay2-long",
        false,
        &format!("[limits]\nmax_image_layers = {LAYER_BOUND}\n"),
    );
    long_episode(&d, true);
}

#[test]
fn containerd_store_long_episodes_export_within_the_layer_bound() {
    let _one = ONE_DOCKERD.lock().unwrap_or_else(|e| e.into_inner());
    let d = Dockerd::start_with(
        "containerd-store-long",
        true,
        &format!("[limits]\nmax_image_layers = {LAYER_BOUND}\n"),
    );
    long_episode(&d, false);
}

/// Whether the rootfs of Docker container `name` (containerd image store) is mounted in the
/// compact form: lower directories relative to containerd's snapshots directory (what
/// containerd does when absolute ones do not fit in a page, from about 60 layers).
fn compact_rootfs_mount(d: &Dockerd, name: &str) -> bool {
    let id = d.ok(&["inspect", "-f", "{{.Id}}", name]);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4).is_some_and(|p| p.ends_with(id.trim())))
        .unwrap_or_else(|| panic!("no mount of {name}'s rootfs"));
    line.split(',')
        .find_map(|o| o.strip_prefix("lowerdir="))
        .is_some_and(|l| !l.starts_with('/'))
}

/// A checkpoint image deep enough that containerd mounts it in the compact form (relative
/// lower directories) restores under Docker's containerd image store, and the restored
/// sandbox's checkpoints export and restore again. The shim once resolved those directories
/// against Docker's data root: the restore was refused ("the rootfs mounted is not overlayfs
/// snapshot ...") and a record of the rootfs named layers that do not exist.
#[test]
fn containerd_store_deep_images_restore_and_export_again() {
    const TURNS: usize = 70;
    let _one = ONE_DOCKERD.lock().unwrap_or_else(|e| e.into_inner());
    let d = Dockerd::start("containerd-store-deep", true);
    d.load_agent();
    d.run("deep");
    for i in 1..=TURNS {
        episode_turn(&d, "deep", &format!("t{i}"), &format!("echo {i} > /n{i}"));
    }
    // Exported whole (no squashing): a config of its own with a higher bound.
    let config = d.dir.join("deep.toml");
    let base = std::fs::read_to_string(d.dir.join("crab.toml")).unwrap();
    std::fs::write(
        &config,
        format!("{base}[limits]\nmax_image_layers = 1000\n"),
    )
    .unwrap();
    let config = config.display().to_string();
    d.crabctl_ok(&[
        "export",
        "deep",
        "localhost/crab/deep:g1",
        "--config",
        &config,
    ]);
    assert!(image_layers(&d, "localhost/crab/deep:g1") > TURNS);
    d.ok(&[
        "run",
        "-d",
        "--name",
        "deep-g1",
        "--runtime",
        "crab",
        "localhost/crab/deep:g1",
    ]);
    assert!(
        compact_rootfs_mount(&d, "deep-g1"),
        "the test needs containerd's compact mount form: more layers"
    );
    assert_eq!(d.exec("deep-g1", "cat /n1 /n70"), "1\n70\n");
    episode_turn(&d, "deep-g1", "g1", "echo g1 > /g1 && rm /n1");
    d.crabctl_ok(&[
        "export",
        "deep-g1",
        "localhost/crab/deep:g2",
        "--config",
        &config,
    ]);
    d.ok(&[
        "run",
        "-d",
        "--name",
        "deep-g2",
        "--runtime",
        "crab",
        "localhost/crab/deep:g2",
    ]);
    assert_eq!(
        d.exec(
            "deep-g2",
            "cat /n2 /n70 /g1; test -e /n1 && echo n1-there; true"
        ),
        "2\n70\ng1\n"
    );
}
