//! Progress of long operations on stderr (never stdout): the layers and bytes `export` has
//! written, the forks `fork` has started.
//!
//! Shown when stderr is a terminal (one line redrawn in place, ended by a newline when done),
//! or with `--progress` (then one line per step when stderr is not a terminal, for logs); never
//! with `-o json` unless `--progress` asks for it.

use std::{
    io::{IsTerminal, Write},
    sync::Arc,
};

/// Takes a line of progress, and whether it is the last.
type Sink = Arc<dyn Fn(&str, bool) + Send + Sync>;

/// Where progress goes; cheap to clone, quiet by default.
#[derive(Clone, Default)]
pub struct Progress {
    sink: Option<Sink>,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.sink {
            Some(_) => "Progress(on)",
            None => "Progress(off)",
        })
    }
}

impl Progress {
    /// Nothing is shown.
    pub fn off() -> Progress {
        Progress::default()
    }

    /// Progress on stderr as the command line asks: `forced` (`--progress`), `json` (`-o
    /// json`: none unless forced), else when stderr is a terminal.
    pub fn for_stderr(forced: bool, json: bool) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        if !(forced || (terminal && !json)) {
            return Progress::off();
        }
        Progress::to(move |line, done| {
            let mut err = std::io::stderr().lock();
            if line.is_empty() {
                // Interrupted: end the line drawn in place, so what follows starts afresh.
                if terminal {
                    let _ = writeln!(err);
                }
                return;
            }
            let _ = match (terminal, done) {
                // Redrawn in place: carriage return, the line, clear to its end.
                (true, false) => write!(err, "\r{line}\x1b[K"),
                (true, true) => writeln!(err, "\r{line}\x1b[K"),
                (false, _) => writeln!(err, "{line}"),
            };
            let _ = err.flush();
        })
    }

    /// Progress to `sink` (a line, and whether it is the last).
    pub fn to(sink: impl Fn(&str, bool) + Send + Sync + 'static) -> Progress {
        Progress {
            sink: Some(Arc::new(sink)),
        }
    }

    pub fn is_on(&self) -> bool {
        self.sink.is_some()
    }

    fn say(&self, line: &str, done: bool) {
        if let Some(sink) = &self.sink {
            sink(line, done);
        }
    }

    /// `export`: `done` of `total` layers written, `bytes` of `total_bytes`.
    pub fn layers(&self, what: &str, done: usize, total: usize, bytes: u64, total_bytes: u64) {
        if !self.is_on() {
            return;
        }
        self.say(
            &format!(
                "crabctl: {what}: {done}/{total} layers, {} of {}",
                mib(bytes),
                mib(total_bytes)
            ),
            done == total,
        );
    }

    /// The operation stopped before its last step (it failed): ends the progress line.
    pub fn interrupted(&self) {
        self.say("", true);
    }

    /// `fork`: `done` of `total` forks started.
    pub fn forks(&self, done: usize, total: usize) {
        self.say(
            &format!("crabctl: fork: {done}/{total} forks started"),
            done == total,
        );
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    type Lines = Arc<Mutex<Vec<(String, bool)>>>;

    fn recording() -> (Progress, Lines) {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let p = Progress::to(move |l, done| sink.lock().unwrap().push((l.to_string(), done)));
        (p, lines)
    }

    #[test]
    fn reports_steps_and_ends_with_the_last() {
        let (p, lines) = recording();
        p.layers("export", 1, 3, 1 << 20, 3 << 20);
        p.layers("export", 3, 3, 3 << 20, 3 << 20);
        p.forks(1, 2);
        p.interrupted();
        p.forks(2, 2);
        let lines = lines.lock().unwrap();
        assert_eq!(
            *lines,
            [
                (
                    "crabctl: export: 1/3 layers, 1.0 MiB of 3.0 MiB".into(),
                    false
                ),
                (
                    "crabctl: export: 3/3 layers, 3.0 MiB of 3.0 MiB".into(),
                    true
                ),
                ("crabctl: fork: 1/2 forks started".into(), false),
                (String::new(), true),
                ("crabctl: fork: 2/2 forks started".into(), true),
            ]
        );
    }

    #[test]
    fn off_says_nothing_and_json_without_progress_is_off() {
        Progress::off().forks(1, 1);
        assert!(!Progress::off().is_on());
        // -o json without --progress: never, terminal or not.
        assert!(!Progress::for_stderr(false, true).is_on());
        // --progress: always.
        assert!(Progress::for_stderr(true, true).is_on());
        assert!(Progress::for_stderr(true, false).is_on());
    }
}
