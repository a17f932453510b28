//! The processes of the host, as `/proc` lists them.

/// The pids `/proc` lists now (entries that are no number are left out; a process may be gone
/// by the time its pid is used).
pub fn pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_is_listed() {
        assert!(super::pids().any(|p| p == std::process::id()));
    }
}
