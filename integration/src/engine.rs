//! A host engine of a test's own: its root under `$CRAB_HOME/engine`, and a crab config naming
//! it (for the sandboxes' runtime options and for `crabctl --config`), so tests running at the
//! same time (and the host's other shims) never share slots.

use std::path::PathBuf;

use serde_json::Value;

use crate::{env::TestEnv, sandbox::Sandbox};

/// A private engine: its root and a crab config naming it (for crabctl).
pub struct Engine {
    pub root: PathBuf,
    pub config: PathBuf,
    /// The config as TOML keys at the document root (for `SandboxOptions::config`).
    pub toml: String,
}

impl Engine {
    /// `settings`: more `engine.` keys, one per line.
    pub fn new(name: &str, settings: &str) -> Engine {
        let base = TestEnv::from_env().crab_home.join("engine");
        std::fs::create_dir_all(&base).unwrap();
        let root = base.join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let toml = format!("engine.root = \"{}\"\n{settings}", root.display());
        let config = root.with_extension("toml");
        std::fs::write(&config, format!("{toml}\n")).unwrap();
        Engine { root, config, toml }
    }

    /// `crabctl engine` (text, or the snapshot as JSON).
    pub fn crabctl(&self, s: &Sandbox, json: bool) -> (String, Value) {
        let config = self.config.to_str().unwrap();
        let mut args = vec!["--config", config, "engine"];
        if json {
            args.push("--json");
        }
        let (code, out, err) = s.crabctl(&args);
        assert_eq!(code, 0, "crabctl engine: {out}{err}");
        let v = if json {
            serde_json::from_str(&out).unwrap()
        } else {
            Value::Null
        };
        (out, v)
    }

    /// The finished job of `sandbox` in the stats.
    pub fn record<'a>(stats: &'a Value, sandbox: &str) -> &'a Value {
        let recent = stats["recent"].as_array().unwrap();
        let mine: Vec<&Value> = recent.iter().filter(|r| r["sandbox"] == sandbox).collect();
        assert_eq!(mine.len(), 1, "one job of {sandbox}: {stats:#}");
        mine[0]
    }

    pub fn remove(self) {
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_file(&self.config);
    }
}
