//! Syscall overhead of the inspector's BPF programs (prints figures, asserts nothing).
//!
//! `sudo cargo run --release -p crab-shim --example bpf-overhead [-- ITERS REPS]`
//!
//! A worker process (this binary, re-executed) moves itself into a fresh
//! cgroup2 directory and runs `open(O_WRONLY|O_CREAT|O_TRUNC) + write(64 B) +
//! close` ITERS times on a tmpfs file, then 10 × ITERS `getppid()` (a syscall
//! no program is attached to). Scenarios, interleaved in REPS rounds (median
//! and minimum reported): programs not loaded; loaded but the worker's cgroup
//! not watched; the same with another container's rootfs registered (the
//! `outside` check every write of an unwatched task then makes); watched;
//! watched among 16 and among 256 watched cgroups; then with the interactions program
//! attached (`[checkpoint] self_contained_changes = "keep"`: it runs at every syscall's return
//! on the host), watched and not. A third loop times 10 × ITERS `getpid()` through syscall(2),
//! a quiet syscall for that program (its first check returns).
//! Then one more run per case with `kernel.bpf_stats_enabled=1` for the
//! kernel's own per-program cost (restored afterwards). The programs are
//! pinned in a private root and removed at the end. Inspector programs of
//! other pin roots (e.g. /sys/fs/bpf/crab) stay attached throughout and are
//! part of every figure: the output says how many there are.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crab_shim::inspector::bpf::{remove_pinned, HostProbes};
use crab_shim::sys::cgroup::{cgroup2_mount, cgroup_id};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--worker") {
        worker(Path::new(&args[2]), args[3].parse().expect("iterations"));
        return;
    }
    let iters: u64 = args
        .get(1)
        .map(|a| a.parse().expect("ITERS"))
        .unwrap_or(100_000);
    let reps: usize = args.get(2).map(|a| a.parse().expect("REPS")).unwrap_or(5);
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "bpf-overhead loads BPF programs: run it as root"
    );

    let mount = cgroup2_mount().expect("cgroup2 mount").mount_point;
    let pid = std::process::id();
    let bench_cg = Cgroup::new(mount.join(format!("crab-bpf-bench-{pid}")));
    let extra: Vec<Cgroup> = (0..255)
        .map(|i| Cgroup::new(mount.join(format!("crab-bpf-bench-{pid}-{i}"))))
        .collect();
    let root = PathBuf::from(format!("/sys/fs/bpf/crab-bench-{pid}"));

    let others = foreign_crab_programs();
    println!("bpf-overhead: {iters} × open+write+close and {} × getppid per run, {reps} runs per scenario", iters * 10);
    if others > 0 {
        println!("note: {others} crab_* BPF programs of other pin roots are attached on this host; the baseline includes their (unwatched) filter cost");
    }

    // Scenarios interleaved within each round, so that drift in the host's
    // load hits all of them alike; medians over rounds.
    const SCENARIOS: [&str; 8] = [
        "not loaded",
        "loaded, unwatched",
        "unwatched, rootfs reg.",
        "watched (1 cgroup)",
        "watched, 16 watched",
        "watched, 256 watched",
        "+quiet, watched",
        "+quiet, unwatched",
    ];
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); SCENARIOS.len()];
    let mut counted = None;
    let mut load_times = Vec::new();
    let mut unwatch_times = Vec::new();
    for _ in 0..reps {
        samples[0].push(run_worker(&bench_cg, iters));

        let started = Instant::now();
        let probes = HostProbes::open_or_load_at(&root).expect("loading BPF programs");
        load_times.push(started.elapsed());
        samples[1].push(run_worker(&bench_cg, iters));

        // Another container's rootfs registered: every write of an unwatched task now also
        // asks whether its file is on a registered rootfs (a device no file here is on).
        probes.watch(extra[0].id).unwrap();
        probes
            .watch_rootfs(extra[0].id, libc::makedev(0, 0xffff0))
            .unwrap();
        samples[2].push(run_worker(&bench_cg, iters));

        probes.watch(bench_cg.id).unwrap();
        let before = probes.counters(bench_cg.id).unwrap();
        samples[3].push(run_worker(&bench_cg, iters));
        counted = Some(probes.counters(bench_cg.id).unwrap().since(&before));

        for cg in &extra[..15] {
            probes.watch(cg.id).unwrap();
        }
        samples[4].push(run_worker(&bench_cg, iters));
        for cg in &extra[15..] {
            probes.watch(cg.id).unwrap();
        }
        samples[5].push(run_worker(&bench_cg, iters));
        // The interactions program: what a host that keeps self-contained changes pays.
        probes.track_interactions().unwrap();
        samples[6].push(run_worker(&bench_cg, iters));
        probes.unwatch(bench_cg.id).unwrap();
        samples[7].push(run_worker(&bench_cg, iters));
        probes.watch(bench_cg.id).unwrap();

        let started = Instant::now();
        for cg in extra.iter().chain([&bench_cg]) {
            probes.unwatch(cg.id).unwrap();
        }
        unwatch_times.push(started.elapsed() / 256);
        let ids = our_program_ids(&probes);
        drop(probes);
        remove_pinned(&root).unwrap();
        // Programs are freed asynchronously after their pins go.
        while aya::programs::loaded_programs()
            .flatten()
            .any(|p| ids.contains(&p.id()))
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    // Median, and minimum: other load on the host only ever adds time, so
    // the minimum is the steadier figure on a busy machine.
    let results: Vec<(&str, Sample, Sample)> = SCENARIOS
        .iter()
        .zip(&samples)
        .map(|(name, s)| (*name, Sample::median(s), Sample::min(s)))
        .collect();
    load_times.sort();
    unwatch_times.sort();
    println!(
        "load+attach+pin (median): {:?}",
        load_times[load_times.len() / 2]
    );
    let counted = counted.expect("at least one round");

    let (base, base_min) = (&results[0].1, &results[0].2);
    println!();
    println!(
        "{:<22} {:>24} {:>24} {:>20} {:>20}",
        "scenario",
        "open+write+close median",
        "open+write+close min",
        "getppid median",
        "getpid median"
    );
    for (name, s, m) in &results {
        println!(
            "{:<22} {:>13.0} ns {:>+7.1}% {:>13.0} ns {:>+7.1}% {:>9.1} ns {:>+7.1}% {:>9.1} ns {:>+7.1}%",
            name,
            s.open_write_close,
            pct(s.open_write_close, base.open_write_close),
            m.open_write_close,
            pct(m.open_write_close, base_min.open_write_close),
            s.getppid,
            pct(s.getppid, base.getppid),
            s.getpid,
            pct(s.getpid, base.getpid)
        );
    }
    println!();
    println!(
        "counted in one watched run ({iters} iterations): fs_mutations {} (open-write {}, write {}), errors {}",
        counted.fs_mutations, counted.fs_by_class[0], counted.fs_by_class[1], counted.errors
    );
    println!(
        "unwatch (median): {:?} per cgroup",
        unwatch_times[unwatch_times.len() / 2]
    );

    program_costs(&root, &bench_cg, &extra, iters);
}

/// Per-program cost measured by the kernel (kernel.bpf_stats_enabled=1 for
/// the duration: adds two clock reads per run, so only for this phase).
fn program_costs(root: &Path, cg: &Cgroup, others: &[Cgroup], iters: u64) {
    const STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let previous = fs::read_to_string(STATS).unwrap_or_else(|_| "0".into());
    let probes = HostProbes::open_or_load_at(root).expect("loading BPF programs");
    probes
        .track_interactions()
        .expect("attaching the interactions program");
    fs::write(STATS, "1").expect("enabling BPF stats");
    let mut per_scenario = Vec::new();
    for step in 0..3 {
        match step {
            1 => probes.watch(cg.id).unwrap(),
            2 => others.iter().for_each(|o| probes.watch(o.id).unwrap()),
            _ => {}
        }
        let before = probes.program_stats().unwrap();
        run_worker(cg, iters);
        let after = probes.program_stats().unwrap();
        per_scenario.push((step, before, after));
    }
    let _ = fs::write(STATS, previous.trim());
    for c in others.iter().chain([cg]) {
        probes.unwatch(c.id).unwrap();
    }
    println!();
    println!("BPF program cost per run, as measured by the kernel (bpf_stats), host-wide during one worker run:");
    println!(
        "{:<18} {:>20} {:>20} {:>20}",
        "program",
        "worker unwatched",
        "watched (1)",
        format!("watched ({})", others.len() + 1)
    );
    let names: Vec<String> = per_scenario[0].1.iter().map(|p| p.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        let cells: Vec<String> = per_scenario
            .iter()
            .map(|(_, before, after)| {
                let runs = after[i].run_count - before[i].run_count;
                let ns = after[i].run_time_ns - before[i].run_time_ns;
                if runs == 0 {
                    "-".to_string()
                } else {
                    format!("{:.0} ns × {runs}", ns as f64 / runs as f64)
                }
            })
            .collect();
        if cells.iter().any(|c| c != "-") {
            println!(
                "{name:<18} {:>20} {:>20} {:>20}",
                cells[0], cells[1], cells[2]
            );
        }
    }
    let ids = our_program_ids(&probes);
    drop(probes);
    remove_pinned(root).unwrap();
    while aya::programs::loaded_programs()
        .flatten()
        .any(|p| ids.contains(&p.id()))
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn pct(value: f64, base: f64) -> f64 {
    (value / base - 1.0) * 100.0
}

#[derive(Clone, Copy, Default)]
struct Sample {
    open_write_close: f64,
    getppid: f64,
    getpid: f64,
}

impl Sample {
    fn median(samples: &[Sample]) -> Sample {
        Sample {
            open_write_close: median(samples.iter().map(|s| s.open_write_close).collect()),
            getppid: median(samples.iter().map(|s| s.getppid).collect()),
            getpid: median(samples.iter().map(|s| s.getpid).collect()),
        }
    }

    fn min(samples: &[Sample]) -> Sample {
        let min = |f: fn(&Sample) -> f64| samples.iter().map(f).fold(f64::INFINITY, f64::min);
        Sample {
            open_write_close: min(|s| s.open_write_close),
            getppid: min(|s| s.getppid),
            getpid: min(|s| s.getpid),
        }
    }
}

fn run_worker(cg: &Cgroup, iters: u64) -> Sample {
    let out = Command::new(std::env::current_exe().unwrap())
        .arg("--worker")
        .arg(&cg.dir)
        .arg(iters.to_string())
        .stdout(Stdio::piped())
        .output()
        .expect("worker");
    assert!(out.status.success(), "worker failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().unwrap());
    Sample {
        open_write_close: fields.next().unwrap(),
        getppid: fields.next().unwrap(),
        getpid: fields.next().unwrap(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Ids of the programs pinned by this benchmark.
fn our_program_ids(probes: &HostProbes) -> Vec<u32> {
    fs::read_dir(probes.pin_dir().join("progs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| aya::programs::ProgramInfo::from_pin(e.path()).ok())
        .map(|p| p.id())
        .collect()
}

fn worker(cgroup_dir: &Path, iters: u64) {
    fs::write(cgroup_dir.join("cgroup.procs"), "0").expect("joining the cgroup");
    // One CPU: no migrations in the measurement.
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET on index 0.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    let path = format!("/dev/shm/crab-bpf-bench-{}\0", std::process::id());
    let data = [b'x'; 64];
    let started = Instant::now();
    for _ in 0..iters {
        // SAFETY: NUL-terminated path, valid buffer.
        unsafe {
            let fd = libc::open(
                path.as_ptr().cast(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                0o644,
            );
            assert!(fd >= 0);
            assert_eq!(libc::write(fd, data.as_ptr().cast(), data.len()), 64);
            libc::close(fd);
        }
    }
    let owc = started.elapsed().as_nanos() as f64 / iters as f64;
    let started = Instant::now();
    for _ in 0..iters * 10 {
        // SAFETY: no preconditions.
        unsafe { libc::getppid() };
    }
    let ppid = started.elapsed().as_nanos() as f64 / (iters * 10) as f64;
    let started = Instant::now();
    for _ in 0..iters * 10 {
        // SAFETY: getpid through syscall(2) (glibc caches nothing then): no preconditions.
        unsafe { libc::syscall(libc::SYS_getpid) };
    }
    let pid = started.elapsed().as_nanos() as f64 / (iters * 10) as f64;
    let _ = fs::remove_file(path.trim_end_matches('\0'));
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "{owc} {ppid} {pid}").unwrap();
}

/// crab_* programs not from this benchmark.
fn foreign_crab_programs() -> usize {
    aya::programs::loaded_programs()
        .flatten()
        .filter(|p| p.name_as_str().is_some_and(|n| n.starts_with("crab_")))
        .count()
}

struct Cgroup {
    dir: PathBuf,
    id: u64,
}

impl Cgroup {
    fn new(dir: PathBuf) -> Cgroup {
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let id = cgroup_id(&dir).unwrap();
        Cgroup { dir, id }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.dir);
    }
}
