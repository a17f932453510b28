//! Shared by the benchmark binaries: their messages, the host facts every report starts with,
//! where and how results are written ([`Bench`]), the statistics they print ([`stats`]) and the
//! agent sandbox they drive ([`sandbox`]).

pub mod sandbox;
pub mod stats;

use std::{
    fmt::Display,
    path::Path,
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::{json, Value};

/// A benchmark by name: its messages go to stderr prefixed with the name.
#[derive(Clone, Copy)]
pub struct Bench {
    pub name: &'static str,
}

impl Bench {
    pub const fn new(name: &'static str) -> Bench {
        Bench { name }
    }

    /// Says what went wrong and exits 1.
    pub fn die(&self, msg: impl Display) -> ! {
        eprintln!("{}: {msg}", self.name);
        std::process::exit(1)
    }

    /// A progress line on stderr.
    pub fn progress(&self, msg: impl Display) {
        eprintln!("{}: {msg}", self.name);
    }

    /// Prints the report `md` on stdout and writes it with `json` as `<file>-<stamp>.{json,md}`
    /// (and `<file>-latest.*`) into `dir`; exits 1 if they cannot be written.
    pub fn finish(&self, dir: &Path, file: &str, stamp: impl Display, json: &Value, md: &str) {
        print!("{md}");
        if !md.ends_with('\n') {
            println!();
        }
        match write_results(dir, file, &stamp, json, md) {
            Ok(()) => self.progress(format!(
                "results in {}/{file}-{stamp}.{{json,md}} (and {file}-latest.*)",
                dir.display()
            )),
            Err(e) => self.die(format!("writing results to {}: {e}", dir.display())),
        }
    }

    /// The test environment with the agent image, for a benchmark of what only crab does
    /// (`what`: "checkpoints", "turns and checkpoints", ...); dies when `CRAB_RUNTIME` names
    /// another runtime.
    pub fn crab_env(&self, what: &str) -> crate::TestEnv {
        let env = crate::TestEnv {
            image: crate::sandbox::AGENT_IMAGE.into(),
            ..crate::TestEnv::from_env()
        };
        if env.runtime != crate::env::DEFAULT_RUNTIME {
            self.die(format!(
                "{what} are crab's own: unset CRAB_RUNTIME (it is {})",
                env.runtime
            ));
        }
        env
    }

    /// Removes the crab store dirs of this run's sandboxes, named `<name>-<pid>-*` under
    /// `state` (a failed run leaves some behind).
    pub fn remove_state_dirs(&self, state: &Path, pid: u32) {
        let prefix = format!("{}-{pid}-", self.name);
        for e in std::fs::read_dir(state).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// The host a run measured, as every report states it.
#[derive(Debug, Clone)]
pub struct Host {
    pub unix_time: u64,
    pub kernel: String,
    pub cpus: usize,
    pub loadavg: String,
}

impl Host {
    pub fn now() -> Host {
        Host {
            unix_time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            kernel: kernel(),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            loadavg: loadavg(),
        }
    }

    pub fn json(&self) -> Value {
        json!({"kernel": self.kernel, "cpus": self.cpus, "loadavg": self.loadavg})
    }
}

/// Writes `<name>-<stamp>.{json,md}` and `<name>-latest.{json,md}` into `dir`, each through a
/// temp file and a rename, so a reader never sees half a result.
pub fn write_results(
    dir: &Path,
    name: &str,
    stamp: impl std::fmt::Display,
    json: &serde_json::Value,
    md: &str,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let json_text = serde_json::to_string_pretty(json).expect("json serializes") + "\n";
    for (file, text) in [
        (format!("{name}-{stamp}.json"), &json_text),
        (format!("{name}-{stamp}.md"), &md.to_string()),
        (format!("{name}-latest.json"), &json_text),
        (format!("{name}-latest.md"), &md.to_string()),
    ] {
        let tmp = dir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.join(file))?;
    }
    Ok(())
}

/// Parses a benchmark's command line: each flag of `counts` takes a positive integer and
/// overwrites its default; `-h`/`--help` prints `usage` and exits 0; anything else exits 1
/// with a message naming `bench`.
pub fn parse_counts(bench: &str, usage: &str, counts: &mut [(&str, &mut usize)]) {
    let die = |msg: String| -> ! {
        eprintln!("{bench}: {msg}");
        std::process::exit(1)
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "-h" || a == "--help" {
            eprintln!("usage: {bench} {usage}");
            std::process::exit(0);
        }
        let Some((name, slot)) = counts.iter_mut().find(|(name, _)| *name == a) else {
            die(format!("unknown argument {a:?} (see --help)"))
        };
        let v = args
            .next()
            .unwrap_or_else(|| die(format!("{name} needs a value")));
        **slot = v
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or_else(|| die(format!("{name}: positive integer expected, got {v:?}")));
    }
}

/// The host's 1, 5 and 15 minute load averages, as `/proc/loadavg` has them ("" if unreadable).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The running kernel's release ("" if unreadable).
pub fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}
