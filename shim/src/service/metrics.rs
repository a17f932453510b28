//! Task metrics in containerd's cgroup formats: `io.containerd.cgroups.v1.Metrics` when the
//! container's memory controller is on a v1 hierarchy (hybrid hosts), else
//! `io.containerd.cgroups.v2.Metrics`, as containerd's runc shim reports them.

use std::{fs, path::Path};

use containerd_shim_protos::{
    cgroups::metrics as v1,
    cgroups_v2::metrics as v2,
    protobuf::{self, well_known_types::any::Any, Message},
};

use crate::sys::cgroup::{CgroupError, Cgroups};

/// Why a task's metrics could not be collected.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("no cgroups found for pid {0}")]
    NoCgroup(u32),
    #[error("{0}")]
    Encode(#[from] protobuf::Error),
}

fn read_u64(dir: &Path, file: &str) -> u64 {
    fs::read_to_string(dir.join(file))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `key value` lines (memory.stat, cpu.stat, cpuacct.stat).
fn read_kv(dir: &Path, file: &str) -> Vec<(String, u64)> {
    fs::read_to_string(dir.join(file))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

fn get(kv: &[(String, u64)], key: &str) -> u64 {
    kv.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| *v)
        .unwrap_or(0)
}

/// The metrics of the cgroup of `pid`, as containerd's `Stats` returns them.
pub fn collect(pid: u32) -> Result<Any, MetricsError> {
    let cgroups = Cgroups::of(pid)?;
    let (type_url, value) = if cgroups.v1("memory").is_some() {
        (
            "io.containerd.cgroups.v1.Metrics",
            v1_metrics(&cgroups).write_to_bytes(),
        )
    } else if let Some(dir) = &cgroups.unified {
        (
            "io.containerd.cgroups.v2.Metrics",
            v2_metrics(dir).write_to_bytes(),
        )
    } else {
        return Err(MetricsError::NoCgroup(pid));
    };
    Ok(Any {
        type_url: type_url.into(),
        value: value?,
        ..Default::default()
    })
}

fn v1_metrics(c: &Cgroups) -> v1::Metrics {
    let mut m = v1::Metrics::default();
    if let Some(dir) = c.v1("pids") {
        m.pids = Some(v1::PidsStat {
            current: read_u64(dir, "pids.current"),
            limit: read_u64(dir, "pids.max"),
            ..Default::default()
        })
        .into();
    }
    let mut cpu = v1::CPUStat::default();
    if let Some(dir) = c.v1("cpuacct") {
        let stat = read_kv(dir, "cpuacct.stat");
        // cpuacct.stat is in USER_HZ ticks; containerd reports nanoseconds.
        let tick_ns = 1_000_000_000 / clock_ticks();
        cpu.usage = Some(v1::CPUUsage {
            total: read_u64(dir, "cpuacct.usage"),
            user: get(&stat, "user") * tick_ns,
            kernel: get(&stat, "system") * tick_ns,
            per_cpu: fs::read_to_string(dir.join("cpuacct.usage_percpu"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect(),
            ..Default::default()
        })
        .into();
    }
    if let Some(dir) = c.v1("cpu") {
        let stat = read_kv(dir, "cpu.stat");
        cpu.throttling = Some(v1::Throttle {
            periods: get(&stat, "nr_periods"),
            throttled_periods: get(&stat, "nr_throttled"),
            throttled_time: get(&stat, "throttled_time"),
            ..Default::default()
        })
        .into();
    }
    m.cpu = Some(cpu).into();
    if let Some(dir) = c.v1("memory") {
        let s = read_kv(dir, "memory.stat");
        let entry = |prefix: &str| v1::MemoryEntry {
            limit: read_u64(dir, &format!("{prefix}.limit_in_bytes")),
            usage: read_u64(dir, &format!("{prefix}.usage_in_bytes")),
            max: read_u64(dir, &format!("{prefix}.max_usage_in_bytes")),
            failcnt: read_u64(dir, &format!("{prefix}.failcnt")),
            ..Default::default()
        };
        m.memory = Some(v1::MemoryStat {
            cache: get(&s, "cache"),
            rss: get(&s, "rss"),
            rss_huge: get(&s, "rss_huge"),
            mapped_file: get(&s, "mapped_file"),
            dirty: get(&s, "dirty"),
            writeback: get(&s, "writeback"),
            pg_pg_in: get(&s, "pgpgin"),
            pg_pg_out: get(&s, "pgpgout"),
            pg_fault: get(&s, "pgfault"),
            pg_maj_fault: get(&s, "pgmajfault"),
            inactive_anon: get(&s, "inactive_anon"),
            active_anon: get(&s, "active_anon"),
            inactive_file: get(&s, "inactive_file"),
            active_file: get(&s, "active_file"),
            unevictable: get(&s, "unevictable"),
            hierarchical_memory_limit: get(&s, "hierarchical_memory_limit"),
            hierarchical_swap_limit: get(&s, "hierarchical_memsw_limit"),
            total_cache: get(&s, "total_cache"),
            total_rss: get(&s, "total_rss"),
            total_rss_huge: get(&s, "total_rss_huge"),
            total_mapped_file: get(&s, "total_mapped_file"),
            total_dirty: get(&s, "total_dirty"),
            total_writeback: get(&s, "total_writeback"),
            total_pg_pg_in: get(&s, "total_pgpgin"),
            total_pg_pg_out: get(&s, "total_pgpgout"),
            total_pg_fault: get(&s, "total_pgfault"),
            total_pg_maj_fault: get(&s, "total_pgmajfault"),
            total_inactive_anon: get(&s, "total_inactive_anon"),
            total_active_anon: get(&s, "total_active_anon"),
            total_inactive_file: get(&s, "total_inactive_file"),
            total_active_file: get(&s, "total_active_file"),
            total_unevictable: get(&s, "total_unevictable"),
            usage: Some(entry("memory")).into(),
            swap: Some(entry("memory.memsw")).into(),
            kernel: Some(entry("memory.kmem")).into(),
            kernel_tcp: Some(entry("memory.kmem.tcp")).into(),
            ..Default::default()
        })
        .into();
        let oom = read_kv(dir, "memory.oom_control");
        m.memory_oom_control = Some(v1::MemoryOomControl {
            oom_kill_disable: get(&oom, "oom_kill_disable"),
            under_oom: get(&oom, "under_oom"),
            oom_kill: get(&oom, "oom_kill"),
            ..Default::default()
        })
        .into();
    }
    m
}

fn v2_metrics(dir: &Path) -> v2::Metrics {
    let max_or = |file: &str| -> u64 {
        match fs::read_to_string(dir.join(file)) {
            Ok(s) if s.trim() == "max" => u64::MAX,
            Ok(s) => s.trim().parse().unwrap_or(0),
            Err(_) => 0,
        }
    };
    let cpu = read_kv(dir, "cpu.stat");
    let mem = read_kv(dir, "memory.stat");
    let events = read_kv(dir, "memory.events");
    v2::Metrics {
        pids: Some(v2::PidsStat {
            current: read_u64(dir, "pids.current"),
            limit: max_or("pids.max"),
            ..Default::default()
        })
        .into(),
        cpu: Some(v2::CPUStat {
            usage_usec: get(&cpu, "usage_usec"),
            user_usec: get(&cpu, "user_usec"),
            system_usec: get(&cpu, "system_usec"),
            nr_periods: get(&cpu, "nr_periods"),
            nr_throttled: get(&cpu, "nr_throttled"),
            throttled_usec: get(&cpu, "throttled_usec"),
            ..Default::default()
        })
        .into(),
        memory: Some(v2::MemoryStat {
            anon: get(&mem, "anon"),
            file: get(&mem, "file"),
            kernel_stack: get(&mem, "kernel_stack"),
            slab: get(&mem, "slab"),
            sock: get(&mem, "sock"),
            shmem: get(&mem, "shmem"),
            file_mapped: get(&mem, "file_mapped"),
            file_dirty: get(&mem, "file_dirty"),
            file_writeback: get(&mem, "file_writeback"),
            anon_thp: get(&mem, "anon_thp"),
            inactive_anon: get(&mem, "inactive_anon"),
            active_anon: get(&mem, "active_anon"),
            inactive_file: get(&mem, "inactive_file"),
            active_file: get(&mem, "active_file"),
            unevictable: get(&mem, "unevictable"),
            slab_reclaimable: get(&mem, "slab_reclaimable"),
            slab_unreclaimable: get(&mem, "slab_unreclaimable"),
            pgfault: get(&mem, "pgfault"),
            pgmajfault: get(&mem, "pgmajfault"),
            usage: read_u64(dir, "memory.current"),
            usage_limit: max_or("memory.max"),
            swap_usage: read_u64(dir, "memory.swap.current"),
            swap_limit: max_or("memory.swap.max"),
            ..Default::default()
        })
        .into(),
        memory_events: Some(v2::MemoryEvents {
            low: get(&events, "low"),
            high: get(&events, "high"),
            max: get(&events, "max"),
            oom: get(&events, "oom"),
            oom_kill: get(&events, "oom_kill"),
            ..Default::default()
        })
        .into(),
        ..Default::default()
    }
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}
