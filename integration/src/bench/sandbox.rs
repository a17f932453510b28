//! The agent sandbox the benchmarks drive: `sleep infinity` as init in the agent image, turns
//! as `bash -c` execs in /app, a turn ended with `Tasks.Update` carrying `io.crab/turn-end`,
//! crab's answers and checkpoints read from the store dir given in its runtime options.

use std::{
    collections::HashMap,
    path::PathBuf,
    time::{Duration, Instant},
};

use serde_json::Value;

use super::{stats::ms, Bench};
use crate::{
    api::crab_runtime_options,
    env::DEFAULT_RUNTIME,
    {Harness, ProcessSpec, StdioOptions},
};

const TURN_END: &str = "io.crab/turn-end";

pub type Res<T> = Result<T, String>;

pub struct AgentSandbox {
    pub h: Harness,
    pub id: String,
    /// The crab store dir given in the runtime options (`None` under another runtime).
    pub state_dir: Option<PathBuf>,
    /// How long one exec, one output read or one wait for a checkpoint may take.
    pub timeout: Duration,
    execs: u64,
    /// Turn ends so far: the shim numbers its answers by the same count.
    pub ends: u64,
}

/// A checkpoint published after a turn end, as this client saw it.
pub struct Published {
    pub manifest: Value,
    /// From the turn-end `Tasks.Update` returning until the manifest was published.
    pub publish_ms: f64,
}

impl AgentSandbox {
    /// Creates and starts sandbox `id` under `runtime` (crab's gets a store dir of its own under
    /// `$CRAB_HOME/state/<id>`).
    pub async fn start(
        base: &Harness,
        runtime: &str,
        id: String,
        timeout: Duration,
    ) -> Res<AgentSandbox> {
        Self::start_with(base, runtime, id, timeout, "").await
    }

    /// [`AgentSandbox::start`] with `config` (TOML tables) added to crab's config.
    pub async fn start_with(
        base: &Harness,
        runtime: &str,
        id: String,
        timeout: Duration,
        config: &str,
    ) -> Res<AgentSandbox> {
        let h = base.with_runtime(runtime);
        let spec = ProcessSpec::new(&["sleep", "infinity"]);
        let state_dir = if runtime == DEFAULT_RUNTIME {
            let dir = h.env.crab_home.join("state").join(&id);
            let config = format!("[store]\nstate_dir = \"{}\"\n{config}", dir.display());
            h.create_container_with_runtime_options(
                &id,
                &spec,
                crab_runtime_options(None, Some(&config)),
            )
            .await
            .map_err(|e| format!("create {id}: {e}"))?;
            Some(dir)
        } else {
            h.create_container(&id, &spec)
                .await
                .map_err(|e| format!("create {id}: {e}"))?;
            None
        };
        h.create_task(&id, None)
            .await
            .map_err(|e| format!("{runtime}: create task {id}: {e}\n{}", h.log_excerpt(&id)))?;
        h.start(&id, "")
            .await
            .map_err(|e| format!("start {id}: {e}"))?;
        Ok(AgentSandbox {
            h,
            id,
            state_dir,
            timeout,
            execs: 0,
            ends: 0,
        })
    }

    /// Runs `script` to completion; its stdout (an error when it exits non-zero).
    pub async fn run(&mut self, script: &str) -> Res<String> {
        self.execs += 1;
        let exec_id = format!("x{}", self.execs);
        let t = self.timeout;
        let mut io = self
            .h
            .stdio(&self.id, &exec_id, StdioOptions::default())
            .map_err(|e| e.to_string())?;
        let spec = ProcessSpec::new(&["bash", "-c", script]).cwd("/app");
        let what = |e: &dyn std::fmt::Display| {
            format!(
                "{}: `{}`: {e}",
                self.id,
                script.lines().next().unwrap_or("")
            )
        };
        self.h
            .exec(&self.id, &exec_id, &spec, &io)
            .await
            .map_err(|e| what(&e))?;
        self.h
            .start(&self.id, &exec_id)
            .await
            .map_err(|e| what(&e))?;
        let status = self
            .h
            .wait(&self.id, &exec_id, t)
            .await
            .map_err(|e| what(&e))?;
        let stdout = io.stdout_string(t).map_err(|e| what(&e))?;
        let stderr = io.stderr_string(t).map_err(|e| what(&e))?;
        self.h
            .delete_process(&self.id, &exec_id)
            .await
            .map_err(|e| what(&e))?;
        if status != 0 {
            return Err(what(&format!("exit {status}: {stdout}{stderr}")));
        }
        Ok(stdout)
    }

    fn store_dir(&self) -> Res<PathBuf> {
        let dir = self.state_dir.as_ref().ok_or("turn ends are crab's")?;
        Ok(dir.join(&self.h.env.namespace).join(&self.id))
    }

    /// Sends the next turn end (`b<n>`); its id.
    async fn send_turn_end(&mut self) -> Res<String> {
        self.ends += 1;
        let turn_id = format!("b{}", self.ends);
        let annotations = HashMap::from([(TURN_END.to_string(), turn_id.clone())]);
        self.h
            .update(&self.id, None, annotations)
            .await
            .map_err(|e| format!("{}: turn end: {e}", self.id))?;
        Ok(turn_id)
    }

    /// Ends a turn: the client's `Tasks.Update` round trip and the stored answer.
    pub async fn end_turn(&mut self) -> Res<(Duration, Value)> {
        let dir = self.store_dir()?.join("turns");
        let t0 = Instant::now();
        let turn_id = self.send_turn_end().await?;
        let rtt = t0.elapsed();
        // Answers are numbered by the shim's turn sequence, which counts our turn ends.
        let path = dir.join(format!("{:06}.json", self.ends));
        let answer = read_json(&path)?;
        if answer["turn_id"] != turn_id.as_str() {
            return Err(format!(
                "{} holds turn {}, expected {turn_id}",
                path.display(),
                answer["turn_id"]
            ));
        }
        Ok((rtt, answer))
    }

    /// The published checkpoint manifests, oldest first.
    pub fn manifest_files(&self) -> Vec<PathBuf> {
        let Ok(dir) = self.store_dir() else {
            return Vec::new();
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.retain(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        });
        files.sort();
        files
    }

    /// Ends a turn that changed something and waits for its checkpoint to be published.
    pub async fn end_turn_checkpointed(&mut self) -> Res<Published> {
        let before = self.manifest_files().len();
        let turn_id = self.send_turn_end().await?;
        let t0 = Instant::now();
        loop {
            let files = self.manifest_files();
            if files.len() > before {
                let publish_ms = ms(t0.elapsed());
                let manifest = read_json(files.last().expect("non-empty"))?;
                if manifest["turn_id"] != turn_id.as_str() {
                    return Err(format!(
                        "{}: manifest of turn {}, expected {turn_id}",
                        self.id, manifest["turn_id"]
                    ));
                }
                return Ok(Published {
                    manifest,
                    publish_ms,
                });
            }
            if t0.elapsed() > self.timeout {
                return Err(format!(
                    "{}: no checkpoint published for turn {turn_id} in {:?}",
                    self.id, self.timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Kills and removes the sandbox and its store dir (a failure is reported, not fatal).
    pub async fn remove(self, bench: &Bench) {
        if let Err(e) = self.h.kill_and_remove(&self.id).await {
            bench.progress(format!("removing {}: {e}", self.id));
        }
        if let Some(dir) = &self.state_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn read_json(path: &std::path::Path) -> Res<Value> {
    std::fs::read(path)
        .map_err(|e| format!("{}: {e}", path.display()))
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display())))
}

/// How a memory holder fills its pages: every page resident and non-zero (all-zero pages are
/// left out of memory images).
#[derive(Clone, Copy)]
pub enum Fill {
    /// Random bytes: every page distinct, so page dedup finds nothing to share.
    Random,
    /// One non-zero page repeated.
    Pattern,
}

/// A turn that starts a python3 holding `mb` MB in the background and prints its pid. It
/// runs one line of python per line written to `/tmp/cmd` and acks each on `/tmp/ack` (FIFO
/// opens are no file mutation: turns that poke it are proc turns).
pub fn holder_script(mb: usize, fill: Fill) -> String {
    let init = match fill {
        Fill::Random => format!("b = bytearray(os.urandom({mb} << 20))"),
        Fill::Pattern => format!(
            "page = bytes((i * 7 + 1) % 251 + 1 for i in range(4096))\nb = bytearray(page) * ({mb} * 256)"
        ),
    };
    format!(
        r#"rm -f /tmp/cmd /tmp/ack; mkfifo /tmp/cmd /tmp/ack
nohup python3 -u -c '
import os
{init}
print("ready", os.getpid(), flush=True)
while True:
    with open("/tmp/cmd") as f:
        for line in f:
            exec(line)
            print("ok", flush=True)
' >/tmp/ack 2>/dev/null &
exec 3</tmp/ack
read -r line pid <&3
[ "$line" = ready ] || {{ echo "holder said: $line" >&2; exit 1; }}
echo $pid"#
    )
}

/// Has the holder run `code` (one line of python) and waits for its ack.
pub fn poke(code: &str) -> String {
    format!(r#"exec 3</tmp/ack; echo '{code}' > /tmp/cmd; read -r line <&3; [ "$line" = ok ]"#)
}

/// "kind xN, ..." of a count of checkpoint or answer kinds, sorted.
pub fn kinds_str(k: &HashMap<String, usize>) -> String {
    let mut v: Vec<_> = k.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    v.sort();
    v.join(", ")
}
