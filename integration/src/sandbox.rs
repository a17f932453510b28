//! An agent sandbox under the crab runtime, driven the way agent harnesses drive one: each
//! turn an exec (`bash -c` in /app), a turn end through `Tasks.Update` with
//! `io.crab/turn-end`; the shim's store (turn answers, checkpoint manifests, layers) is read
//! back from the state directory the sandbox's config names.

use std::{
    collections::{BTreeMap, HashMap},
    io::Read,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::Value;

use crate::{
    api::crab_runtime_options, env::TestEnv, CleanupGuard, Harness, ProcessSpec, RunOutput,
    StdioOptions,
};

pub const AGENT_IMAGE: &str = "localhost/crab/agent:latest";

/// A shell command (for [`Sandbox::run`]) that writes `/app/kv.py`, an interpreter on
/// 127.0.0.1:9000 whose variables live in its memory only (`python3 /app/cli.py 'x = 41'`,
/// then `'x'`), and `/app/cli.py`, its client (retrying until the server listens).
pub const KV_SCRIPTS: &str = r#"cat > /app/kv.py <<'EOF'
import socket
g = {}
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000))
s.listen()
while True:
    c, _ = s.accept()
    src = c.recv(65536).decode()
    try:
        try:
            out = repr(eval(src, g))
        except SyntaxError:
            exec(src, g)
            out = "ok"
    except Exception as e:
        out = "error: %r" % (e,)
    c.sendall(out.encode())
    c.close()
EOF
cat > /app/cli.py <<'EOF'
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection(("127.0.0.1", 9000))
        break
    except OSError:
        time.sleep(0.05)
c.sendall(sys.argv[1].encode())
print(c.recv(65536).decode())
EOF"#;
pub const TURN_END: &str = "io.crab/turn-end";
const T: Duration = Duration::from_secs(60);

/// How to start a sandbox.
#[derive(Default)]
pub struct SandboxOptions<'a> {
    /// Spec annotations (e.g. `io.crab/turn-boundary`).
    pub annotations: &'a [(&'a str, &'a str)],
    /// A host directory bind-mounted at a container path, marked as tracked in the config.
    pub volume: Option<(&'a Path, &'a str)>,
    /// Where the shim keeps its state (default: `$CRAB_HOME/state/<id>`).
    pub state_dir: Option<PathBuf>,
    /// More crab config: TOML keys at the document root, dotted (`checkpoint.enabled = false`).
    pub config: &'a str,
    /// A change to the OCI spec before the container is created (e.g. all capabilities).
    pub spec_edit: Option<&'a (dyn Fn(&mut Value) + Sync)>,
    /// The image (default [`AGENT_IMAGE`]; [`Sandbox::run`] needs bash and /app).
    pub image: Option<&'a str>,
    /// Another containerd (another node, [`crate::node::Node`]); default the test's.
    pub env: Option<&'a TestEnv>,
}

pub struct Sandbox {
    pub h: Harness,
    pub id: String,
    pub state_dir: PathBuf,
    pub turn: u64,
}

impl Sandbox {
    /// Starts `sleep infinity` in the agent image under crab. Panics (with the reason) on failure.
    pub async fn start(name: &str, o: SandboxOptions<'_>) -> (Sandbox, CleanupGuard) {
        Sandbox::try_start(name, o)
            .await
            .unwrap_or_else(|e| panic!("sandbox {name}: {e}"))
    }

    /// [`Sandbox::start`], or why the container or its task could not be created or started
    /// (what was made is removed by the guard).
    pub async fn try_start(
        name: &str,
        o: SandboxOptions<'_>,
    ) -> Result<(Sandbox, CleanupGuard), String> {
        let env = TestEnv {
            image: o.image.unwrap_or(AGENT_IMAGE).into(),
            ..o.env.cloned().unwrap_or_else(TestEnv::from_env)
        };
        assert_eq!(
            env.runtime, "io.containerd.crab.v1",
            "turns and checkpoints are crab's own: run with CRAB_RUNTIME unset"
        );
        let h = Harness::connect_env(env)
            .await
            .unwrap_or_else(|e| panic!("integration test setup failed: {e}"));
        let id = h.unique_id(name);
        let guard = h.guard(&[&id]);
        let state_dir = o
            .state_dir
            .unwrap_or_else(|| h.env.crab_home.join("state").join(&id));
        let mut config = format!("{}\n", o.config);
        let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
        let mut spec = crate::spec::container_spec(&id, &h.env.namespace, process);
        for (k, v) in o.annotations {
            spec["annotations"][*k] = Value::String(v.to_string());
        }
        if let Some(edit) = o.spec_edit {
            edit(&mut spec);
        }
        if let Some((source, at)) = o.volume {
            config.push_str(&format!("checkpoint.tracked_volumes = [\"{at}\"]\n"));
            spec["mounts"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({
                    "destination": at, "type": "bind", "source": source, "options": ["rbind", "rw"]
                }));
        }
        config.push_str(&format!(
            "[store]\nstate_dir = \"{}\"\n",
            state_dir.display()
        ));
        h.create_container_with_spec_and_options(
            &id,
            &spec,
            Some(crab_runtime_options(None, Some(&config))),
        )
        .await
        .map_err(|e| format!("creating the container: {e}"))?;
        h.create_task(&id, None)
            .await
            .map_err(|e| format!("creating the task: {e}"))?;
        h.start(&id, "")
            .await
            .map_err(|e| format!("starting the task: {e}"))?;
        Ok((
            Sandbox {
                h,
                id,
                state_dir,
                turn: 0,
            },
            guard,
        ))
    }

    /// Runs one agent command to completion (it must succeed).
    pub async fn run(&mut self, script: &str) -> RunOutput {
        self.run_with(
            script,
            ProcessSpec::new(&["bash", "-c", script]).cwd("/app"),
        )
        .await
    }

    /// [`Sandbox::run`] as `spec` says (`bash -c script` with more capabilities, ...).
    pub async fn run_with(&mut self, script: &str, spec: ProcessSpec) -> RunOutput {
        self.turn += 1;
        let exec_id = format!("turn-{}", self.turn);
        let mut io = self
            .h
            .stdio(&self.id, &exec_id, StdioOptions::default())
            .unwrap();
        self.h.exec(&self.id, &exec_id, &spec, &io).await.unwrap();
        self.h.start(&self.id, &exec_id).await.unwrap();
        let exit_status = self.h.wait(&self.id, &exec_id, T).await.unwrap();
        // The output is waited for off the runtime's workers: a test that runs several
        // sandboxes at once on a 2-worker runtime must not have one sandbox's wait hold up the
        // others' (seen under load: four sandboxes stalled together until one wait timed out).
        let (stdout, stderr) =
            tokio::task::spawn_blocking(move || (io.stdout_string(T), io.stderr_string(T)))
                .await
                .unwrap();
        // An output that never ends: the shim's log names who holds it (after its drain).
        let held = |e| {
            panic!(
                "turn {} `{script}`: {e}\n{}",
                self.turn,
                crate::harness::log_excerpt(&self.h.env, &self.id, 20)
            )
        };
        let stdout = stdout.unwrap_or_else(held);
        let stderr = stderr.unwrap_or_else(held);
        self.h.delete_process(&self.id, &exec_id).await.unwrap();
        assert_eq!(
            exit_status, 0,
            "turn {} `{script}` failed: {stdout}{stderr}",
            self.turn
        );
        RunOutput {
            exit_status,
            stdout,
            stderr,
        }
    }

    /// Runs crabctl against the sandbox's containerd and namespace: (exit code, stdout, stderr).
    pub fn crabctl(&self, args: &[&str]) -> (i32, String, String) {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let out = std::process::Command::new(&bin)
            .arg("--address")
            .arg(&self.h.env.address)
            .args(["--namespace", &self.h.env.namespace])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (
            out.status.code().unwrap_or(-1),
            text(&out.stdout),
            text(&out.stderr),
        )
    }

    /// Waits until the checkpoints of the turns ended so far are durable: a no-op exec goes
    /// through the same gate as the agent's next action.
    pub async fn sync(&mut self) {
        let exec_id = format!("sync-{}", self.turn);
        let io = self
            .h
            .stdio(&self.id, &exec_id, StdioOptions::default())
            .unwrap();
        self.h
            .exec(&self.id, &exec_id, &ProcessSpec::new(&["true"]), &io)
            .await
            .unwrap();
        self.h.start(&self.id, &exec_id).await.unwrap();
        self.h.wait(&self.id, &exec_id, T).await.unwrap();
        self.h.delete_process(&self.id, &exec_id).await.unwrap();
    }

    /// The sandbox's directory in the store.
    pub fn store(&self) -> PathBuf {
        self.state_dir.join(&self.h.env.namespace).join(&self.id)
    }

    /// Ends the turn and returns the inspector's stored answer.
    pub async fn end_turn(&self) -> Value {
        let annotations = HashMap::from([(TURN_END.to_string(), format!("t{}", self.turn))]);
        self.h.update(&self.id, None, annotations).await.unwrap();
        let answers = json_files(&self.store().join("turns"));
        answers.into_iter().last().expect("an answer was stored")
    }

    /// The checkpoints turn ends published, oldest first (without the origin manifest,
    /// `created` or `restored`, that begins the lineage: see [`Sandbox::lineage`]).
    pub fn manifests(&self) -> Vec<Value> {
        self.lineage()
            .into_iter()
            .filter(|m| !matches!(m["kind"].as_str(), Some("created" | "restored")))
            .collect()
    }

    /// Every published manifest of the sandbox's store, oldest first.
    pub fn lineage(&self) -> Vec<Value> {
        json_files(&self.store().join("checkpoints"))
    }

    /// Waits until `n` manifests are published (checkpoints run in the background).
    pub async fn wait_manifests(&self, n: usize) -> Vec<Value> {
        for _ in 0..600 {
            let m = self.manifests();
            if m.len() >= n {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} manifests expected, have {:#?}", n, self.manifests());
    }

    /// The entries of a layer blob: path -> (tar entry type, content).
    pub fn layer(&self, desc: &Value) -> BTreeMap<String, (String, Vec<u8>)> {
        read_layer(&self.store(), desc)
    }

    /// Kills and removes the sandbox, checks nothing leaked, removes its state.
    pub async fn finish(self) {
        self.h.kill_and_remove(&self.id).await.unwrap();
        self.h.assert_no_leaks(&self.id).await;
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

/// The entries of the layer blob `desc` names in the container store `store`:
/// path -> (tar entry type, content).
pub fn read_layer(store: &Path, desc: &Value) -> BTreeMap<String, (String, Vec<u8>)> {
    let digest = desc["digest"]
        .as_str()
        .unwrap()
        .strip_prefix("sha256:")
        .unwrap();
    let blob = std::fs::read(store.join("blobs/sha256").join(digest)).unwrap();
    let tar = zstd::decode_all(&blob[..]).unwrap();
    let mut out = BTreeMap::new();
    for e in tar::Archive::new(&tar[..]).entries().unwrap() {
        let mut e = e.unwrap();
        let path = e
            .path()
            .unwrap()
            .to_string_lossy()
            .trim_end_matches('/')
            .to_string();
        let kind = format!("{:?}", e.header().entry_type());
        let mut data = Vec::new();
        e.read_to_end(&mut data).unwrap();
        out.insert(path, (kind, data));
    }
    out
}

/// The `*.json` files of `dir` (not temp files), parsed, in name order.
pub fn json_files(dir: &Path) -> Vec<Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| {
        p.extension().is_some_and(|x| x == "json")
            && !p.file_name().unwrap().to_string_lossy().starts_with('.')
    });
    files.sort();
    files
        .iter()
        .map(|f| serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap())
        .collect()
}
