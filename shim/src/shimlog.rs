//! The shim's log: logrus text lines on the `log` FIFO containerd opened in the bundle, as
//! the framework's own logger writes them, but each record in **one** `write(2)`.
//!
//! `containerd_shim::logger::FifoLogger` formats a record with `writeln!` straight into the
//! FIFO, i.e. one write per fragment; containerd copies the FIFO into its own log in whatever
//! chunks it reads, between its own lines, so a record could come out torn in two with a
//! containerd line in the middle (seen: `... verified in 0.time="..." level=info
//! msg="connecting to shim ..."`), and every record was followed by an empty line. Writes of
//! at most `PIPE_BUF` (4096) bytes to a pipe are atomic: records up to that size now arrive
//! whole; longer ones are cut there, marked, so that none is ever torn.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::sync::Mutex;

/// At most this many bytes per record (`PIPE_BUF` on Linux).
pub const MAX_RECORD: usize = 4096;

/// Writes each record with a single `write(2)`.
pub struct FifoLog {
    out: Mutex<File>,
}

impl FifoLog {
    pub fn new(out: File) -> FifoLog {
        FifoLog {
            out: Mutex::new(out),
        }
    }
}

/// Installs the logger on the `log` FIFO in the current directory (the bundle) at the level
/// `RUST_LOG` names, else `default_level`, raised to debug by containerd's `-debug`: what the
/// framework's logger does, which must then be turned off (`no_setup_logger`).
pub fn init(debug: bool, default_level: &str) -> std::io::Result<()> {
    let file = OpenOptions::new().write(true).open("log")?;
    let level = std::env::var("RUST_LOG").unwrap_or_else(|_| default_level.to_string());
    let level: log::LevelFilter = level.parse().unwrap_or(log::LevelFilter::Info);
    let level = if debug {
        level.max(log::LevelFilter::Debug)
    } else {
        level
    };
    log::set_boxed_logger(Box::new(FifoLog::new(file))).map_err(std::io::Error::other)?;
    log::set_max_level(level);
    Ok(())
}

/// One record as a logrus text line: `time="..." level=... msg="..."\n`, cut to
/// [`MAX_RECORD`] bytes at a character boundary (the cut marked with `...`).
pub fn line(time: &str, level: log::Level, msg: &std::fmt::Arguments<'_>) -> String {
    let mut s = String::with_capacity(128);
    let _ = write!(
        s,
        "time=\"{time}\" level={} msg=\"{msg}\"",
        level.as_str().to_lowercase()
    );
    if s.len() + 1 > MAX_RECORD {
        let mut end = MAX_RECORD - 5;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...\"");
    }
    s.push('\n');
    s
}

/// `2026-12-03T06:41:33.931792054Z`, as logrus and containerd write times.
pub fn rfc3339_utc(t: std::time::SystemTime) -> String {
    crate::checkpoint::store::rfc3339_nanos(t)
}

impl log::Log for FifoLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let time = rfc3339_utc(std::time::SystemTime::now());
        let text = line(&time, record.level(), record.args());
        // A closed reader (containerd restarting) is not the shim's failure.
        let _ = self.out.lock().unwrap().write_all(text.as_bytes());
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    #[test]
    fn times_are_rfc3339_utc() {
        let at =
            |s: u64, n: u32| rfc3339_utc(std::time::UNIX_EPOCH + std::time::Duration::new(s, n));
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(
            at(1_796_279_993, 931_792_054),
            "2026-12-03T06:39:53.931792054Z"
        );
        assert_eq!(at(951_782_400, 1), "2000-02-29T00:00:00.000000001Z");
    }

    #[test]
    fn a_record_is_one_line_and_long_ones_are_cut_whole() {
        let l = line("t", log::Level::Warn, &format_args!("a \"b\" {}", 1));
        assert_eq!(l, "time=\"t\" level=warn msg=\"a \"b\" 1\"\n");
        let long = "é".repeat(5000);
        let l = line("t", log::Level::Info, &format_args!("{long}"));
        assert!(
            l.len() <= MAX_RECORD && l.ends_with("...\"\n"),
            "{}",
            l.len()
        );
        assert_eq!(l.matches('\n').count(), 1);
    }

    /// Each record reaches a pipe in one write: many threads logging at once never interleave.
    #[test]
    fn records_from_many_threads_arrive_whole() {
        log::set_max_level(log::LevelFilter::Trace);
        let (r, w) = nix::unistd::pipe().unwrap();
        let log = std::sync::Arc::new(FifoLog::new(File::from(w)));
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            File::from(r).read_to_string(&mut text).unwrap();
            text
        });
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        log::Log::log(
                            &*log,
                            &log::Record::builder()
                                .level(log::Level::Error)
                                .args(format_args!("thread {t} record {i} {}", "x".repeat(300)))
                                .build(),
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(log);
        let text = reader.join().unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 800);
        for l in lines {
            assert!(
                l.starts_with("time=\"") && l.ends_with(&format!("{}\"", "x".repeat(300))),
                "{l}"
            );
        }
    }
}
