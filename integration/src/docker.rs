//! Docker Engine as crab's client: the real `docker` CLI (Debian's `/usr/bin/docker`) against
//! the private dockerds `hack/dockerd.sh` runs on the private containerd, one per Docker
//! storage mode ([`Store`]). Containers run under crab either by the shim's name
//! (`--runtime io.containerd.crab.v1`, crab's default config) or through daemon.json's runtime
//! `crab` (options `ConfigPath`, a store under `CRAB_HOME/docker/<store>`). crab's side is read
//! with `crabctl --namespace <the dockerd's containerd namespace>` and from the store directory;
//! [`DockerGuard`] removes what a test made even when it panics, and [`Docker::leaks`] finds what
//! a removed container left on the host.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{
    ctr::{run_command, Output},
    host,
    sandbox::{json_files, read_layer, AGENT_IMAGE},
    Error, Result, TestEnv,
};

/// Debian's docker CLI (docker-cli): never another `docker` on PATH.
pub const DOCKER_BIN: &str = "/usr/bin/docker";
/// The runtime name Docker passes to containerd as is: containerd finds crab's shim on its PATH.
pub const SHIM_RUNTIME: &str = "io.containerd.crab.v1";
/// The daemon.json runtime hack/dockerd.sh registers (`runtimeType` [`SHIM_RUNTIME`],
/// `options.ConfigPath` = [`Docker::crab_config`]).
pub const NAMED_RUNTIME: &str = "crab";
/// Where crab keeps its store when a container's runtime has no options.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/crab";
const T: Duration = Duration::from_secs(60);

/// Docker's storage mode: which of the two private dockerds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// The overlay2 graph driver (daemon.json `{}`), containerd namespace `moby`.
    Overlay2,
    /// The containerd image store (`features.containerd-snapshotter`), namespace `moby-c8d`.
    Containerd,
}

impl Store {
    pub const ALL: [Store; 2] = [Store::Overlay2, Store::Containerd];

    pub fn name(self) -> &'static str {
        match self {
            Store::Overlay2 => "overlay2",
            Store::Containerd => "containerd",
        }
    }

    fn env_prefix(self) -> &'static str {
        match self {
            Store::Overlay2 => "CRAB_DOCKER_OVERLAY2",
            Store::Containerd => "CRAB_DOCKER_CONTAINERD",
        }
    }

    fn default_namespace(self) -> &'static str {
        match self {
            Store::Overlay2 => "moby",
            Store::Containerd => "moby-c8d",
        }
    }
}

/// Which runtime `docker run` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// `--runtime io.containerd.crab.v1`: crab's default config, store [`DEFAULT_STATE_DIR`].
    Shim,
    /// `--runtime crab`: daemon.json's entry with crab's config ([`Docker::crab_config`]).
    Named,
}

/// One private dockerd, as the tests reach it.
#[derive(Debug, Clone)]
pub struct Docker {
    pub store: Store,
    /// The private containerd, with `namespace` set to the one this dockerd uses.
    pub env: TestEnv,
    /// `DOCKER_HOST` (`unix://...`).
    pub host: String,
    /// The crab config daemon.json's runtime `crab` names.
    pub crab_config: PathBuf,
    /// The store directory (`store.state_dir`) of that config.
    pub crab_store: PathBuf,
    /// dockerd's `--exec-root` (FIFOs of its containers' stdio).
    pub exec_root: PathBuf,
    /// `DOCKER_CONFIG` of the CLI (so no user's ~/.docker is read).
    cli_config: PathBuf,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Docker {
    /// The dockerd of `store`, from `CRAB_DOCKER_<STORE>_*` (hack/dockerd.sh env) or, without
    /// them, from CRAB_HOME the way hack/dockerd.sh places it.
    pub fn from_env(store: Store) -> Docker {
        let base = TestEnv::from_env();
        let dir = base.crab_home.join("docker").join(store.name());
        let prefix = store.env_prefix();
        let host = var(&format!("{prefix}_HOST"))
            .unwrap_or_else(|| format!("unix://{}", default_socket(&dir).display()));
        let namespace = var(&format!("{prefix}_NAMESPACE"))
            .unwrap_or_else(|| store.default_namespace().to_string());
        let crab_config = var(&format!("{prefix}_CRAB_CONFIG"))
            .map(PathBuf::from)
            .unwrap_or_else(|| dir.join("crab.toml"));
        let socket = PathBuf::from(host.trim_start_matches("unix://"));
        let exec_root = socket.parent().unwrap_or(Path::new("/")).join("exec");
        Docker {
            store,
            env: TestEnv {
                namespace,
                runtime: SHIM_RUNTIME.into(),
                image: AGENT_IMAGE.into(),
                ..base
            },
            host,
            crab_store: dir.join("crab-store"),
            crab_config,
            exec_root,
            cli_config: dir.join("cli"),
        }
    }

    /// [`Docker::from_env`], checked: the dockerd answers and has crab's images.
    pub fn connect(store: Store) -> Result<Docker> {
        let d = Docker::from_env(store);
        let v = d.docker(&["version", "--format", "{{.Server.Version}}"])?;
        if !v.status.success() {
            return Err(Error::Command {
                command: format!("docker version (DOCKER_HOST={})", d.host),
                detail: format!(
                    "the private dockerd ({}) does not answer: {}. Run `make test`, or \
                     `make docker-up` and `eval \"$(hack/dockerd.sh env)\"` before the tests",
                    store.name(),
                    v.stderr.trim()
                ),
            });
        }
        for image in [AGENT_IMAGE, crate::env::BUSYBOX_IMAGE] {
            if !d.docker(&["image", "inspect", image])?.status.success() {
                return Err(Error::Image {
                    image: image.into(),
                    reason: format!(
                        "not in the {} dockerd; `make docker-up` loads it",
                        store.name()
                    ),
                });
            }
        }
        Ok(d)
    }

    /// [`Docker::connect`] or a panic saying how to bring the dockerd up.
    pub fn for_test(store: Store) -> Docker {
        Docker::connect(store).unwrap_or_else(|e| panic!("Docker test setup failed: {e}"))
    }

    /// A `docker` command against this dockerd, for callers that run it themselves.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(DOCKER_BIN);
        self.set_env(&mut cmd);
        cmd
    }

    /// Points `cmd` (docker or anything running docker) at this dockerd.
    pub fn set_env(&self, cmd: &mut Command) {
        cmd.env("DOCKER_HOST", &self.host)
            .env("DOCKER_CONFIG", &self.cli_config);
    }

    /// `docker ARGS` with a deadline (a hung command fails the test instead of hanging it).
    pub fn docker<S: AsRef<str>>(&self, args: &[S]) -> Result<Output> {
        self.docker_with(args, T)
    }

    pub fn docker_with<S: AsRef<str>>(&self, args: &[S], timeout: Duration) -> Result<Output> {
        let args: Vec<&str> = args.iter().map(|a| a.as_ref()).collect();
        let mut cmd = self.command();
        cmd.args(&args);
        run_command(
            cmd,
            &format!("docker {} ({})", args.join(" "), self.store.name()),
            None,
            timeout,
        )
    }

    /// `docker run -d ARGS`: the new container's full id.
    pub fn run_detached(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["run", "-d"];
        full.extend_from_slice(args);
        Ok(self.docker(&full)?.ok()?.stdout.trim().to_string())
    }

    /// `docker exec ID ARGV`, not checked.
    pub fn exec(&self, id: &str, argv: &[&str]) -> Result<Output> {
        let mut full = vec!["exec", id];
        full.extend_from_slice(argv);
        self.docker(&full)
    }

    /// `docker inspect -f FORMAT ID`, trimmed.
    pub fn inspect(&self, id: &str, format: &str) -> Result<String> {
        Ok(self
            .docker(&["inspect", "-f", format, id])?
            .ok()?
            .stdout
            .trim()
            .to_string())
    }

    /// `docker rm -f ID`.
    pub fn rm(&self, id: &str) -> Result<()> {
        self.docker(&["rm", "-f", id])?.ok().map(|_| ())
    }

    /// crabctl against the private containerd in this dockerd's namespace.
    pub fn crabctl(&self, args: &[&str]) -> Output {
        let bin = crabctl_bin();
        let mut cmd = Command::new(&bin);
        cmd.arg("--address")
            .arg(&self.env.address)
            .args(["--namespace", &self.env.namespace])
            .args(args);
        run_command(cmd, &format!("crabctl {}", args.join(" ")), None, T)
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()))
    }

    /// crab's store root for containers of `runtime`.
    pub fn state_dir(&self, runtime: Runtime) -> PathBuf {
        match runtime {
            Runtime::Shim => PathBuf::from(DEFAULT_STATE_DIR),
            Runtime::Named => self.crab_store.clone(),
        }
    }

    /// A guard that removes the containers named `names` (and later added store dirs) on drop.
    pub fn guard(&self, names: &[&str]) -> DockerGuard {
        DockerGuard {
            docker: self.clone(),
            names: names.iter().map(|s| s.to_string()).collect(),
            dirs: Vec::new(),
        }
    }

    /// Everything the removed container `id` (full id) left: what [`host::leaks`] finds in
    /// this dockerd's containerd namespace, its FIFO dir in dockerd's exec root, a mount at
    /// `rootfs` (overlay2's merged dir, which is not named after the container), and Docker's
    /// or containerd's record of it.
    pub fn leaks(&self, id: &str, rootfs: Option<&Path>) -> Vec<String> {
        let mut l = host::leaks(&self.env, id);
        let fifos = self.exec_root.join("containerd").join(id);
        if fifos.exists() {
            l.push(format!("docker FIFO dir {}", fifos.display()));
        }
        if let Some(rootfs) = rootfs {
            l.extend(
                host::mountinfo()
                    .into_iter()
                    .filter(|m| m.mount_point == rootfs)
                    .map(|m| format!("rootfs mount {}", m.line)),
            );
        }
        if self
            .docker(&["inspect", id])
            .is_ok_and(|o| o.status.success())
        {
            l.push(format!("docker still knows container {id}"));
        }
        let ctr = crate::ctr::Ctr::new(&self.env);
        if ctr
            .run(&["containers", "info", id])
            .is_ok_and(|o| o.status.success())
        {
            l.push(format!(
                "containerd still has container {}/{id}",
                self.env.namespace
            ));
        }
        l
    }

    pub fn assert_no_leaks(&self, id: &str, rootfs: Option<&Path>) {
        let l = host::eventually(Duration::from_secs(10), || {
            let l = self.leaks(id, rootfs);
            l.is_empty().then_some(())
        });
        if l.is_none() {
            panic!(
                "Docker container {id} ({}) leaked:\n  {}",
                self.store.name(),
                self.leaks(id, rootfs).join("\n  ")
            );
        }
    }
}

/// The socket hack/dockerd.sh uses for the dockerd whose directory is `dir`.
fn default_socket(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    let run = if run.as_os_str().len() + 20 >= 104 {
        let hash = Sha256::digest(dir.as_os_str().as_encoded_bytes());
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        PathBuf::from(format!("/run/crab-docker-{}", &hex[..12]))
    } else {
        run
    };
    run.join("docker.sock")
}

/// Why a stored turn answer is what it is, for messages and oracles: what degraded it, and
/// "memory changed" (with the pids) when an existing process's memory did.
pub fn answer_why(answer: &Value) -> String {
    let mut why: Vec<String> = answer["degraded"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d.as_str().map(|d| format!("DEGRADED: {d}")))
        .collect();
    if answer["procs"]["memory"]
        .as_array()
        .is_some_and(|m| !m.is_empty())
    {
        why.push(format!("memory changed: {}", answer["procs"]["memory"]));
    }
    why.join("; ")
}

/// The workspace's crabctl (release build, `make build`).
pub fn crabctl_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl")
}

/// Removes Docker containers by name or id, and directories (crab stores), when dropped.
pub struct DockerGuard {
    docker: Docker,
    names: Vec<String>,
    dirs: Vec<PathBuf>,
}

impl DockerGuard {
    pub fn add(&mut self, name: &str) {
        self.names.push(name.to_string());
    }

    pub fn add_dir(&mut self, dir: PathBuf) {
        self.dirs.push(dir);
    }
}

impl Drop for DockerGuard {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = self
                .docker
                .docker_with(&["rm", "-f", name], Duration::from_secs(30));
        }
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// How to start a [`DockerSandbox`].
pub struct DockerSandboxOptions<'a> {
    pub runtime: Runtime,
    /// `--annotation K=V` each.
    pub annotations: &'a [(&'a str, &'a str)],
    /// More `docker run` arguments, before the image.
    pub run_args: &'a [&'a str],
    pub image: &'a str,
}

impl Default for DockerSandboxOptions<'_> {
    fn default() -> Self {
        DockerSandboxOptions {
            runtime: Runtime::Named,
            annotations: &[],
            run_args: &[],
            image: AGENT_IMAGE,
        }
    }
}

/// An agent sandbox as a harness on Docker has one: `docker run -d IMAGE sleep infinity` under
/// crab, one `docker exec` (`bash -c` in /app) per action, turn ends from `crabctl turn-end`
/// (the same turn ids as [`crate::sandbox::Sandbox`]: `t1`, `t2`, ...) or from the exec
/// boundary annotation; crab's answers and checkpoints read from its store.
pub struct DockerSandbox {
    pub d: Docker,
    pub name: String,
    /// The full container id (containerd's container id).
    pub id: String,
    pub runtime: Runtime,
    pub turn: u64,
    /// overlay2's merged dir (None under the containerd store, whose rootfs is in the bundle).
    pub rootfs: Option<PathBuf>,
}

impl DockerSandbox {
    /// Starts the sandbox; panics with the reason on failure.
    pub fn start(
        store: Store,
        name: &str,
        o: DockerSandboxOptions,
    ) -> (DockerSandbox, DockerGuard) {
        let d = Docker::for_test(store);
        let name = crate::harness::unique_id(name);
        let mut guard = d.guard(&[&name]);
        let runtime = match o.runtime {
            Runtime::Shim => SHIM_RUNTIME,
            Runtime::Named => NAMED_RUNTIME,
        };
        let mut args = vec!["--name", &name, "--runtime", runtime];
        let annotations: Vec<String> = o
            .annotations
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        for a in &annotations {
            args.extend(["--annotation", a.as_str()]);
        }
        args.extend_from_slice(o.run_args);
        args.extend([o.image, "sleep", "infinity"]);
        let id = d
            .run_detached(&args)
            .unwrap_or_else(|e| panic!("docker run ({}): {e}", store.name()));
        guard.add_dir(d.state_dir(o.runtime).join(&d.env.namespace).join(&id));
        let rootfs = d
            .inspect(&id, "{{.GraphDriver.Data.MergedDir}}")
            .ok()
            .filter(|m| m.starts_with('/'))
            .map(PathBuf::from);
        (
            DockerSandbox {
                d,
                name,
                id,
                runtime: o.runtime,
                turn: 0,
                rootfs,
            },
            guard,
        )
    }

    /// `docker exec -w /app ID bash -c SCRIPT`; must succeed.
    pub fn run(&mut self, script: &str) -> Output {
        self.turn += 1;
        let out = self
            .d
            .docker(&["exec", "-w", "/app", &self.id, "bash", "-c", script])
            .unwrap_or_else(|e| panic!("turn {} `{script}`: {e}", self.turn));
        assert!(
            out.status.success(),
            "turn {} `{script}` failed ({}): {}{}",
            self.turn,
            self.d.store.name(),
            out.stdout,
            out.stderr
        );
        out
    }

    /// Ends the turn (`crabctl turn-end ID --turn t<n>`) and returns crab's stored answer.
    pub fn end_turn(&self) -> Value {
        let turn = format!("t{}", self.turn);
        let out = self.d.crabctl(&["turn-end", &self.id, "--turn", &turn]);
        assert!(
            out.status.success(),
            "crabctl turn-end ({}): {}{}",
            self.d.store.name(),
            out.stdout,
            out.stderr
        );
        json_files(&self.store().join("turns"))
            .into_iter()
            .last()
            .expect("an answer was stored")
    }

    /// The sandbox's directory in crab's store.
    pub fn store(&self) -> PathBuf {
        self.d
            .state_dir(self.runtime)
            .join(&self.d.env.namespace)
            .join(&self.id)
    }

    /// Every stored turn answer, oldest first.
    pub fn answers(&self) -> Vec<Value> {
        json_files(&self.store().join("turns"))
    }

    /// Every published manifest, oldest first.
    pub fn lineage(&self) -> Vec<Value> {
        json_files(&self.store().join("checkpoints"))
    }

    /// The checkpoints turn ends published (without the origin manifest).
    pub fn manifests(&self) -> Vec<Value> {
        self.lineage()
            .into_iter()
            .filter(|m| !matches!(m["kind"].as_str(), Some("created" | "restored")))
            .collect()
    }

    /// Waits until `n` checkpoints are published.
    pub fn wait_manifests(&self, n: usize) -> Vec<Value> {
        host::eventually(Duration::from_secs(30), || {
            let m = self.manifests();
            (m.len() >= n).then_some(m)
        })
        .unwrap_or_else(|| {
            panic!(
                "{n} manifests expected ({}), have {:#?}",
                self.d.store.name(),
                self.manifests()
            )
        })
    }

    pub fn layer(&self, desc: &Value) -> BTreeMap<String, (String, Vec<u8>)> {
        read_layer(&self.store(), desc)
    }

    /// Removes the container, checks nothing leaked, removes crab's store of it.
    pub fn finish(self) {
        self.d
            .rm(&self.id)
            .unwrap_or_else(|e| panic!("docker rm ({}): {e}", self.d.store.name()));
        self.d.assert_no_leaks(&self.id, self.rootfs.as_deref());
        let _ = std::fs::remove_dir_all(self.store());
    }
}
