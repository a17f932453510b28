//! Recorded agent trajectories (one JSON object per line, see the trajectories' README): the
//! commands to replay, the think time before each, and which to pick.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

/// The default selection: one run of each kind of work the recordings show, small enough that a
/// replay of all policies takes minutes. By trial name (exact).
pub const DEFAULT_SELECTION: [&str; 4] = [
    // git: commits, resets and merges in a repository the agent makes.
    "fix-git.1-of-1.2025-08-13__19-44-27",
    // Python files written with heredocs and run.
    "grid-pattern-transform.1-of-1.2025-08-13__19-44-27",
    // Background servers (nohup ... &), killed and restarted; pip installs.
    "hf-model-inference.1-of-1.2025-08-13__19-44-27",
    // Mostly reads (its tmux commands fail: the agent image has no tmux).
    "tmux-advanced-workflow.1-of-1.2025-08-13__19-44-27",
];

#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    pub task: String,
    /// Unique per recording (task, attempt and run date).
    pub trial: String,
    pub turns: Vec<Turn>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The turn's index in the recording.
    pub index: u64,
    pub cmd: String,
    /// The agent's think time before this command (the LLM call).
    pub think: Duration,
    /// How the command ended in the recording: ok, timeout, submit or cut.
    pub recorded_status: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TrajectoryError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {reason}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{}: no trajectory has a command to replay (a timing-only file?)", path.display())]
    NoCommands { path: PathBuf },
    #[error("no trajectory matches {pattern:?} (trials look like {example:?})")]
    NoMatch { pattern: String, example: String },
    #[error("no trajectory file: {0}")]
    NoFile(String),
}

/// Parses one JSONL file. Turns without a command (timing-only records) are left out.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Trajectory>, TrajectoryError> {
    let mut out = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |reason: String| TrajectoryError::Parse {
            path: path.to_path_buf(),
            line: n + 1,
            reason,
        };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let s = |key: &str| {
            v[key]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| bad(format!("`{key}` is not a string")))
        };
        let (task, trial) = (s("task")?, s("trial")?);
        let turns = v["turns"]
            .as_array()
            .ok_or_else(|| bad("`turns` is not an array".into()))?;
        let mut parsed = Vec::new();
        for (k, t) in turns.iter().enumerate() {
            let Some(cmd) = t["cmd"].as_str() else {
                continue;
            };
            let think = t["llm_wait_s"]
                .as_f64()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .unwrap_or(0.0);
            parsed.push(Turn {
                index: t["i"].as_u64().unwrap_or(k as u64),
                cmd: cmd.to_string(),
                think: Duration::from_secs_f64(think),
                recorded_status: t["status"].as_str().unwrap_or("?").to_string(),
            });
        }
        out.push(Trajectory {
            task,
            trial,
            turns: parsed,
        });
    }
    if !out.iter().any(|t| !t.turns.is_empty()) {
        return Err(TrajectoryError::NoCommands {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// Reads a JSONL file, or every `*mini-swe-agent*.jsonl` of a directory.
pub fn load(path: &Path) -> Result<Vec<Trajectory>, TrajectoryError> {
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| TrajectoryError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    if !path.is_dir() {
        return parse(path, &read(path)?);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|source| TrajectoryError::Read {
            path: path.to_path_buf(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.contains("mini-swe-agent") && n.ends_with(".jsonl"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(TrajectoryError::NoFile(format!(
            "no *mini-swe-agent*.jsonl in {}",
            path.display()
        )));
    }
    let mut all = Vec::new();
    for f in files {
        all.extend(parse(&f, &read(&f)?)?);
    }
    Ok(all)
}

/// The trajectories `patterns` name, in pattern order, each once: a pattern is a trial name,
/// a part of one (every trial containing it), or `all`.
pub fn select(all: &[Trajectory], patterns: &[String]) -> Result<Vec<Trajectory>, TrajectoryError> {
    let mut out: Vec<Trajectory> = Vec::new();
    for p in patterns {
        let exact: Vec<&Trajectory> = all.iter().filter(|t| &t.trial == p).collect();
        let matched: Vec<&Trajectory> = if p == "all" {
            all.iter().collect()
        } else if !exact.is_empty() {
            exact
        } else {
            all.iter()
                .filter(|t| t.trial.contains(p.as_str()))
                .collect()
        };
        if matched.is_empty() {
            return Err(TrajectoryError::NoMatch {
                pattern: p.clone(),
                example: all.first().map(|t| t.trial.clone()).unwrap_or_default(),
            });
        }
        for t in matched {
            if !out.iter().any(|o| o.trial == t.trial) && !t.turns.is_empty() {
                out.push(t.clone());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = concat!(
        r#"{"task": "a", "trial": "a.1-of-1.x", "turns": [{"i": 0, "cmd": "ls -la", "llm_wait_s": 2.5, "status": "ok"}, "#,
        r#"{"i": 1, "cmd": null, "llm_wait_s": 1.0, "status": "cut"}, "#,
        r#"{"i": 2, "cmd": "cat <<'EOF' > f\nx\nEOF", "llm_wait_s": 0.25, "status": "timeout"}]}"#,
        "\n\n",
        r#"{"task": "b", "trial": "b.1-of-1.y", "turns": [{"cmd": "echo hi", "status": "submit"}]}"#,
        "\n"
    );

    fn p() -> &'static Path {
        Path::new("t.jsonl")
    }

    #[test]
    fn parses_turns_with_commands() {
        let t = parse(p(), TWO).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].task.as_str(), t[0].trial.as_str()),
            ("a", "a.1-of-1.x")
        );
        assert_eq!(
            t[0].turns.len(),
            2,
            "the turn without a command is left out"
        );
        assert_eq!(t[0].turns[0].think, Duration::from_millis(2500));
        assert_eq!(t[0].turns[1].index, 2);
        assert_eq!(t[0].turns[1].cmd, "cat <<'EOF' > f\nx\nEOF");
        assert_eq!(t[0].turns[1].recorded_status, "timeout");
        // Missing think time and index: 0 and the position.
        assert_eq!(
            (t[1].turns[0].think, t[1].turns[0].index),
            (Duration::ZERO, 0)
        );
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse(
            p(),
            "{\"task\": \"a\", \"trial\": \"x\", \"turns\": []}\n{oops\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("t.jsonl:2: "), "{e}");
        let e = parse(p(), "{\"task\": 1}\n").unwrap_err().to_string();
        assert!(e.contains("`task`"), "{e}");
        let e = parse(
            p(),
            "{\"task\": \"a\", \"trial\": \"x\", \"turns\": [{\"cmd\": null}]}\n",
        )
        .unwrap_err();
        assert!(matches!(e, TrajectoryError::NoCommands { .. }), "{e}");
    }

    #[test]
    fn selection_by_name_part_and_all() {
        let all = parse(p(), TWO).unwrap();
        let names = |s: &[&str]| -> Vec<String> {
            select(&all, &s.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap()
                .into_iter()
                .map(|t| t.trial)
                .collect()
        };
        assert_eq!(names(&["b.1-of-1.y", "a."]), ["b.1-of-1.y", "a.1-of-1.x"]);
        assert_eq!(
            names(&["1-of-1", "a"]),
            ["a.1-of-1.x", "b.1-of-1.y"],
            "each once"
        );
        assert_eq!(names(&["all"]), ["a.1-of-1.x", "b.1-of-1.y"]);
        let e = select(&all, &["zzz".to_string()]).unwrap_err().to_string();
        assert!(e.contains("zzz") && e.contains("a.1-of-1.x"), "{e}");
    }
}
