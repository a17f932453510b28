//! Shared by the benchmark binaries: where and how results are written.

use std::path::Path;

/// Writes `<name>-<stamp>.{json,md}` and `<name>-latest.{json,md}` into `dir`, each through a
/// temp file and a rename, so a reader never sees half a result.
pub fn write_results(dir: &Path, name: &str, stamp: impl std::fmt::Display, json: &serde_json::Value, md: &str) -> std::io::Result<()> {
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
