//! The host's KSM settings a test or benchmark changes, put back when it ends (also on
//! failure). Leaving `run` at anything but 1 unmerges first (`2`), so that nothing stays
//! merged that the host did not merge.

use std::path::Path;

use crab_shim::sys::ksm::KSM_SYSFS;

const KEYS: [&str; 3] = ["run", "pages_to_scan", "sleep_millisecs"];

pub struct KsmPace(Vec<(&'static str, String)>);

impl KsmPace {
    /// Runs the host's ksmd at `pages` pages every `sleep_ms` milliseconds.
    pub fn set(pages: u64, sleep_ms: u64) -> Result<KsmPace, String> {
        let dir = Path::new(KSM_SYSFS);
        let mut saved = Vec::new();
        for k in KEYS {
            let v = std::fs::read_to_string(dir.join(k))
                .map_err(|e| format!("{}/{k}: {e} (no KSM here)", dir.display()))?;
            saved.push((k, v.trim().to_string()));
        }
        let pace = KsmPace(saved);
        // The pace first: run=1 then starts at it.
        for (k, v) in [
            ("pages_to_scan", pages.to_string()),
            ("sleep_millisecs", sleep_ms.to_string()),
            ("run", "1".to_string()),
        ] {
            std::fs::write(dir.join(k), v).map_err(|e| format!("{}/{k}: {e}", dir.display()))?;
        }
        Ok(pace)
    }
}

impl Drop for KsmPace {
    fn drop(&mut self) {
        let dir = Path::new(KSM_SYSFS);
        if self.0.iter().any(|(k, v)| *k == "run" && v != "1") {
            let _ = std::fs::write(dir.join("run"), "2");
        }
        for (k, v) in &self.0 {
            let _ = std::fs::write(dir.join(k), v);
        }
    }
}
