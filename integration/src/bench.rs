//! Shared by the benchmark binaries: where and how results are written.

use std::path::Path;

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
