//! The kernel's same-page merging (KSM) as crab uses it: marking the processes of a container
//! mergeable, and what the host's `ksmd` does.
//!
//! `prctl(PR_SET_MEMORY_MERGE, 1)` (Linux 6.4) marks the caller's whole address space
//! mergeable, now and for every mapping it makes later; the mark is inherited across `fork`
//! and kept across `execve`. Set in runc's child before it execs, it reaches runc, CRIU (which
//! forks the restored tree from itself) and every process of the container: the memory of N
//! forks restored from one image becomes identical pages that `ksmd` merges into one
//! copy-on-write copy. Nothing is merged while the host's `ksmd` does not run
//! (`/sys/kernel/mm/ksm/run` is the host operator's switch; crab never turns it on).

use std::{io, path::Path, sync::OnceLock};

/// Where the host's KSM settings and counters are.
pub const KSM_SYSFS: &str = "/sys/kernel/mm/ksm";

/// Whether this kernel can mark a whole process mergeable (`PR_GET_MEMORY_MERGE` answers);
/// asked once per process.
pub fn merge_any_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: PR_GET_MEMORY_MERGE takes no pointer and changes nothing; the unused
        // arguments must be zero.
        let r = unsafe { libc::prctl(libc::PR_GET_MEMORY_MERGE, 0, 0, 0, 0) };
        r >= 0
    })
}

/// Marks the calling process's memory mergeable (inherited by its children and kept across
/// exec). Async-signal-safe: one system call, no allocation, so it may run between `fork` and
/// `exec` (`Command::pre_exec`).
pub fn set_merge_any() -> io::Result<()> {
    // SAFETY: PR_SET_MEMORY_MERGE takes an integer and no pointer; the unused arguments must
    // be zero.
    let r = unsafe { libc::prctl(libc::PR_SET_MEMORY_MERGE, 1, 0, 0, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The host's `ksmd`: `Some(true)` merging, `Some(false)` stopped (or unmerging), `None` no
/// KSM in this kernel.
pub fn ksmd_running() -> Option<bool> {
    ksmd_running_in(Path::new(KSM_SYSFS))
}

fn ksmd_running_in(sysfs: &Path) -> Option<bool> {
    let run = std::fs::read_to_string(sysfs.join("run")).ok()?;
    Some(run.trim() == "1")
}

/// What `/proc/PID/ksm_stat` says of one process: whether its memory is marked mergeable as a
/// whole, and how many of its pages are merged now. `None` when it cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KsmStat {
    pub merge_any: bool,
    pub merging_pages: u64,
}

/// Reads `/proc/<pid>/ksm_stat`.
pub fn stat(pid: u32) -> Option<KsmStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/ksm_stat")).ok()?)
}

/// Parses the text of a `ksm_stat` file; lines it does not know are skipped, a line it knows
/// with a value it cannot read makes the whole `None`.
pub fn parse_stat(text: &str) -> Option<KsmStat> {
    let mut s = KsmStat::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let value = value.trim();
        match key.trim_end_matches(':') {
            "ksm_merge_any" => {
                s.merge_any = match value {
                    "yes" => true,
                    "no" => false,
                    _ => return None,
                }
            }
            "ksm_merging_pages" => s.merging_pages = value.parse().ok()?,
            _ => {}
        }
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksm_stat_as_the_kernel_writes_it() {
        let text = "ksm_rmap_items 0\nksm_zero_pages 0\nksm_merging_pages 9781\n\
                    ksm_process_profit 0\nksm_merge_any: yes\nksm_mergeable: yes\n";
        assert_eq!(
            parse_stat(text),
            Some(KsmStat {
                merge_any: true,
                merging_pages: 9781
            })
        );
        // An older kernel without the merge-any line: not marked.
        assert_eq!(
            parse_stat("ksm_rmap_items 0\nksm_merging_pages 0\n"),
            Some(KsmStat::default())
        );
    }

    #[test]
    fn hostile_ksm_stat_is_none_or_ignored() {
        assert_eq!(parse_stat("ksm_merging_pages -1\n"), None);
        assert_eq!(
            parse_stat("ksm_merging_pages 99999999999999999999999\n"),
            None
        );
        assert_eq!(parse_stat("ksm_merge_any: maybe\n"), None);
        assert_eq!(parse_stat(""), Some(KsmStat::default()));
        assert_eq!(
            parse_stat("\0\0garbage\nno-space-line\n\u{fffd} x\n"),
            Some(KsmStat::default())
        );
    }

    #[test]
    fn ksmd_state_from_its_run_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ksmd_running_in(dir.path()), None);
        for (run, want) in [("0\n", false), ("1\n", true), ("2\n", false)] {
            std::fs::write(dir.path().join("run"), run).unwrap();
            assert_eq!(ksmd_running_in(dir.path()), Some(want), "{run:?}");
        }
    }

    /// In a child (the mark is inherited and cannot be taken back by a test): set, then read
    /// back from the child's own `ksm_stat`.
    #[test]
    fn a_process_marked_mergeable_says_so() {
        if !merge_any_supported() {
            eprintln!("skipped: no PR_SET_MEMORY_MERGE in this kernel");
            return;
        }
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("cat");
        cmd.arg("/proc/self/ksm_stat");
        // SAFETY: set_merge_any is one system call, async-signal-safe.
        unsafe {
            cmd.pre_exec(set_merge_any);
        }
        let out = cmd.output().unwrap();
        let s = parse_stat(&String::from_utf8_lossy(&out.stdout)).unwrap();
        assert!(s.merge_any, "{out:?}");
        let plain = std::process::Command::new("cat")
            .arg("/proc/self/ksm_stat")
            .output()
            .unwrap();
        let p = parse_stat(&String::from_utf8_lossy(&plain.stdout)).unwrap();
        assert!(
            !p.merge_any,
            "the test process itself is not marked: {plain:?}"
        );
    }
}
