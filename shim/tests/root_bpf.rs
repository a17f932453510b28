//! The inspector's eBPF programs loaded into the running kernel: pinning, reuse across
//! processes, retiring versions, what they count. Needs root, bpffs and a cgroup2 hierarchy;
//! fails without (see `support`). Each test pins into its own root under /sys/fs/bpf and
//! removes it.

mod support;

use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crab_shim::inspector::bpf::testing::{
    cgroup_level, expected_links, program_names, watch_in_pins, watched_levels,
};
use crab_shim::inspector::bpf::{
    remove_pinned, version_dir_name, BpfError, CgroupCounters, FsClass, HostProbes, StateClass,
};
use crab_shim::sys::cgroup::{cgroup2_dir_of, cgroup2_mount, cgroup_id, cgroup_path_by_id};

const BPFFS_MOUNT: &str = "/sys/fs/bpf";

/// Tests count host-wide programs and links: one at a time, also across
/// test processes (several checkouts may run them on one host).
static SERIAL: Mutex<()> = Mutex::new(());

struct Serial {
    _process: nix::fcntl::Flock<fs::File>,
    _thread: std::sync::MutexGuard<'static, ()>,
}

fn serial() -> Serial {
    support::require_root("loads BPF programs");
    support::require_mount(Path::new(BPFFS_MOUNT), "bpf");
    let thread = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let path = std::env::temp_dir().join("crab-bpf-tests.lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    Serial {
        _process: nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .unwrap_or_else(|e| panic!("locking {}: {e}", path.display())),
        _thread: thread,
    }
}

struct TestRoot(PathBuf);

impl TestRoot {
    fn new(tag: &str) -> TestRoot {
        let root = PathBuf::from(format!(
            "{BPFFS_MOUNT}/crab-test-{}-{tag}",
            std::process::id()
        ));
        remove_pinned(&root).unwrap();
        remove_leftovers_of_dead_runs();
        TestRoot(root)
    }
}

impl Drop for TestRoot {
    fn drop(&mut self) {
        let ids: BTreeSet<u32> = fs::read_dir(&self.0)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|version| pinned_program_ids(&version.path()))
            .collect();
        if let Err(e) = remove_pinned(&self.0) {
            eprintln!("cleaning test pins {}: {e}", self.0.display());
        }
        // The kernel frees programs asynchronously once unpinned; wait, so
        // that the next test counts host-wide programs from a clean slate.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && aya::programs::loaded_programs()
                .flatten()
                .any(|p| ids.contains(&p.id()))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A killed test run leaves its pins (programs stay attached) and
/// cgroups behind: remove those whose process is gone.
fn remove_leftovers_of_dead_runs() {
    let dead = |name: &str, prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    };
    for entry in fs::read_dir(BPFFS_MOUNT).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if dead(&name, "crab-test-") || dead(&name, "crab-bench-") {
            let _ = remove_pinned(&entry.path());
        }
    }
    if let Ok(mount) = cgroup2_mount() {
        for entry in fs::read_dir(mount.mount_point)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if dead(&name, "crab-bpf-test-") || dead(&name, "crab-bpf-bench-") {
                let _ = fs::remove_dir(entry.path().join("nested"));
                let _ = fs::remove_dir(entry.path());
            }
        }
    }
}

struct TestCgroup {
    dir: PathBuf,
    id: u64,
}

impl TestCgroup {
    fn new(tag: &str) -> TestCgroup {
        let mount = cgroup2_mount().expect("cgroup2 mount").mount_point;
        TestCgroup::at(mount.join(format!("crab-bpf-test-{}-{tag}", std::process::id())))
    }

    fn at(dir: PathBuf) -> TestCgroup {
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let id = cgroup_id(&dir).unwrap();
        TestCgroup { dir, id }
    }

    /// Starts `sh -c script` in this cgroup: the shell waits for a line on
    /// stdin, sent once its pid is in cgroup.procs.
    fn spawn(&self, script: &str) -> Child {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("read _go; {script}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        fs::write(self.dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        child
    }

    fn run(&self, script: &str) -> Output {
        let out = self.spawn(script).wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{script}: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            // Child cgroups first.
            if let Ok(entries) = fs::read_dir(&self.dir) {
                for e in entries.flatten() {
                    if e.path().is_dir() {
                        let _ = fs::remove_dir(e.path());
                    }
                }
            }
            if fs::remove_dir(&self.dir).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn delta(probes: &HostProbes, cg: &TestCgroup, f: impl FnOnce()) -> CgroupCounters {
    let before = probes.counters(cg.id).unwrap();
    f();
    probes.counters(cg.id).unwrap().since(&before)
}

fn state(c: &CgroupCounters, class: StateClass) -> u64 {
    c.state_by_class[class.index()]
}

fn class(c: &CgroupCounters, class: FsClass) -> u64 {
    c.fs_by_class[class.index()]
}

fn explain(c: &CgroupCounters) -> String {
    format!(
        "{c:?} classes={:?}",
        c.fs_classes()
            .map(|(k, n)| (k.name(), n))
            .collect::<Vec<_>>()
    )
}

/// Links in the kernel (host-wide) attached to one of these programs.
fn links_to(programs: &BTreeSet<u32>) -> usize {
    aya::programs::loaded_links()
        .flatten()
        .filter(|l| programs.contains(&l.program_id()))
        .count()
}

fn pinned_program_ids(dir: &Path) -> BTreeSet<u32> {
    fs::read_dir(dir.join("progs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| aya::programs::ProgramInfo::from_pin(e.path()).ok())
        .map(|p| p.id())
        .collect()
}

#[test]
fn cgroup_ids_and_dirs() {
    let _serial = serial();
    let cg = TestCgroup::new("ids");
    let mount = cgroup2_mount().unwrap().mount_point;
    assert_eq!(cgroup_path_by_id(&mount, cg.id).unwrap(), cg.dir);
    assert_eq!(cgroup_level(cg.id).unwrap(), 1);
    let mut child = cg.spawn("exec sleep 5");
    assert_eq!(cgroup2_dir_of(child.id()).unwrap(), cg.dir);
    child.kill().unwrap();
    child.wait().unwrap();
    // cgroup v1 directories have inode numbers too, but not cgroup ids.
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if v1.is_dir() {
        assert!(cgroup_id(v1).is_err());
    }
}

/// Loads in this process, re-opens in this process and in other
/// processes (some racing on a fresh root): one set of programs and links.
#[test]
fn loads_once_and_reuses_pins() {
    let _serial = serial();
    let root = TestRoot::new("pins");
    let n_progs = program_names().len();
    let n_links = expected_links().unwrap().len();

    let started = Instant::now();
    let first = HostProbes::open_or_load_at(&root.0).unwrap();
    let load_time = started.elapsed();
    assert!(first.loaded_here());
    let stats = first.program_stats().unwrap();
    let names: Vec<String> = program_names()
        .iter()
        .map(|n| n.chars().take(15).collect())
        .collect();
    assert_eq!(
        stats.iter().map(|p| p.name.clone()).collect::<Vec<_>>(),
        names
    );
    assert_eq!(first.recursion_misses().unwrap(), 0);
    let ids = pinned_program_ids(&first.pin_dir());
    assert_eq!(ids.len(), n_progs);
    assert_eq!(links_to(&ids), n_links);

    let started = Instant::now();
    let second = HostProbes::open_or_load_at(&root.0).unwrap();
    let open_time = started.elapsed();
    assert!(!second.loaded_here());
    assert_eq!(second.pin_dir(), first.pin_dir());
    assert_eq!(pinned_program_ids(&second.pin_dir()), ids);
    drop((first, second));
    // Pins alone keep everything attached after our handles are gone,
    // and opening did not attach anything more.
    assert_eq!(links_to(&ids), n_links);

    // Other processes: 3 at once on the existing root, then 3 racing on
    // a fresh one: exactly one of those loads, all use its programs.
    let race_root = TestRoot::new("race");
    for (target, loaders) in [(&root.0, 0), (&race_root.0, 1)] {
        let children: Vec<Child> = (0..3)
            .map(|_| {
                Command::new(std::env::current_exe().unwrap())
                    .args([
                        "--exact",
                        "child_opens_pins",
                        "--ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("CRAB_BPF_CHILD_ROOT", target)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut reports = BTreeSet::new();
        let mut loaded = 0;
        for child in children {
            let out = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let report = stdout
                .lines()
                .find_map(|l| l.split_once("child opened ").map(|(_, r)| r))
                .unwrap_or_else(|| panic!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
            assert!(out.status.success());
            loaded += usize::from(report.starts_with("loaded "));
            reports.insert(report.trim_start_matches("loaded ").to_string());
        }
        assert_eq!(
            loaded, loaders,
            "processes that loaded programs into {target:?}"
        );
        assert_eq!(
            reports.len(),
            1,
            "processes used different programs: {reports:?}"
        );
        let dir = fs::read_dir(target)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let target_ids = pinned_program_ids(&dir);
        assert_eq!(links_to(&target_ids), n_links);
        assert_eq!(
            reports.into_iter().next().unwrap(),
            format!("{target_ids:?}")
        );
    }
    assert_eq!(links_to(&ids), n_links);
    assert_eq!(
        fs::read_dir(&race_root.0).unwrap().count(),
        1,
        "leftover temporary pins"
    );
    eprintln!("first load+attach+pin {load_time:?}, open of pins {open_time:?}, {n_progs} programs, {n_links} links");

    drop(race_root);
    drop(root);
    // TestRoot::drop waited for the kernel to free the programs.
    let still_loaded = aya::programs::loaded_programs()
        .flatten()
        .filter(|p| ids.contains(&p.id()))
        .count();
    assert_eq!(
        still_loaded, 0,
        "removing the pins detaches and frees everything"
    );
}

/// A static i386 program: creat(path, 0644) via int 0x80, then exit(0).
fn elf32_creat(path: &str) -> Vec<u8> {
    const BASE: u32 = 0x0804_8000;
    const CODE_AT: u32 = 52 + 32;
    let mut code = Vec::new();
    let path_addr = BASE + CODE_AT + 26;
    code.extend([0xb8, 8, 0, 0, 0]); // mov eax, 8 (creat)
    code.push(0xbb); // mov ebx, path
    code.extend(path_addr.to_le_bytes());
    code.extend([0xb9, 0xa4, 0x01, 0, 0]); // mov ecx, 0644
    code.extend([0xcd, 0x80]); // int 0x80
    code.extend([0xb8, 1, 0, 0, 0]); // mov eax, 1 (exit)
    code.extend([0x31, 0xdb]); // xor ebx, ebx
    code.extend([0xcd, 0x80]); // int 0x80
    assert_eq!(code.len(), 26);
    code.extend(path.as_bytes());
    code.push(0);
    let total = CODE_AT + code.len() as u32;
    let mut elf = vec![0x7f, b'E', b'L', b'F', 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    for v in [2u16, 3] {
        elf.extend(v.to_le_bytes()); // ET_EXEC, EM_386
    }
    for v in [1u32, BASE + CODE_AT, 52, 0, 0] {
        elf.extend(v.to_le_bytes()); // version, entry, phoff, shoff, flags
    }
    for v in [52u16, 32, 1, 0, 0, 0] {
        elf.extend(v.to_le_bytes()); // ehsize, phentsize, phnum, shentsize, shnum, shstrndx
    }
    for v in [1u32, 0, BASE, BASE, total, total, 5, 0x1000] {
        elf.extend(v.to_le_bytes()); // PT_LOAD r-x
    }
    assert_eq!(elf.len() as u32, CODE_AT);
    elf.extend(code);
    elf
}

/// 32-bit programs' syscalls bypass the syscall tracepoints: running one
/// must show up as errors, never as a quiet turn.
#[test]
fn thirty_two_bit_programs_are_errors() {
    use std::os::unix::fs::PermissionsExt;
    let _serial = serial();
    let root = TestRoot::new("compat");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("compat");
    probes.watch(cg.id).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let created = tmp.path().join("made-by-i386");
    let exe = tmp.path().join("creat32");
    fs::write(&exe, elf32_creat(created.to_str().unwrap())).unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();

    let c = delta(&probes, &cg, || {
        cg.run(&exe.display().to_string());
    });
    assert!(created.exists(), "the i386 program did not run");
    assert_eq!(
        c.fs_mutations,
        0,
        "tracepoints saw the compat creat after all? {}",
        explain(&c)
    );
    assert!(
        c.errors >= 1,
        "a 32-bit program ran unnoticed: {}",
        explain(&c)
    );
    eprintln!("i386 creat: {}", explain(&c));
    probes.unwatch(cg.id).unwrap();
}

/// Pins of other builds: removed when nothing is watched through them,
/// kept otherwise; a handle whose pins were retired recovers on watch.
#[test]
fn retires_unused_versions() {
    let _serial = serial();
    let root = TestRoot::new("gc");
    let current = root.0.join(version_dir_name());
    let n_links = expected_links().unwrap().len();

    let stale = HostProbes::open_or_load_at(&root.0).unwrap();
    let in_use = root.0.join("v0-inuse");
    fs::rename(&current, &in_use).unwrap();
    let in_use_ids = pinned_program_ids(&in_use);
    watch_in_pins(&in_use, 12345).unwrap();

    let second = HostProbes::open_or_load_at(&root.0).unwrap();
    assert!(second.loaded_here());
    assert!(
        in_use.exists(),
        "a version with watched cgroups was removed"
    );
    let unused = root.0.join("v0-unused");
    fs::rename(&current, &unused).unwrap();
    let unused_ids = pinned_program_ids(&unused);

    let third = HostProbes::open_or_load_at(&root.0).unwrap();
    assert!(third.loaded_here());
    assert!(!unused.exists(), "an unused version was kept");
    assert!(in_use.exists());
    assert_eq!(links_to(&unused_ids), 0);
    assert_eq!(links_to(&in_use_ids), n_links);
    assert_eq!(fs::read_dir(&root.0).unwrap().count(), 2);

    // `stale` and `second` hold maps whose pins moved or went: watching
    // through them reopens the current pins, and counting works.
    let cg = TestCgroup::new("gc");
    for probes in [&stale, &second] {
        probes.watch(cg.id).unwrap();
        assert_eq!(probes.pin_dir(), current);
        let c = delta(probes, &cg, || {
            cg.run("mkdir -p /tmp/crab-bpf-gc-test && rmdir /tmp/crab-bpf-gc-test");
        });
        assert_eq!(class(&c, FsClass::Rmdir), 1, "{}", explain(&c));
        assert_eq!(
            third.counters(cg.id).unwrap(),
            probes.counters(cg.id).unwrap()
        );
        probes.unwatch(cg.id).unwrap();
    }
    assert_eq!(links_to(&pinned_program_ids(&current)), n_links);
    assert_eq!(fs::read_dir(&root.0).unwrap().count(), 2);
}

/// Helper for `loads_once_and_reuses_pins`, run in a child process.
#[test]
#[ignore = "run by loads_once_and_reuses_pins in a child process"]
fn child_opens_pins() {
    let Some(root) = std::env::var_os("CRAB_BPF_CHILD_ROOT") else {
        println!("nothing to do: only meaningful as a child of loads_once_and_reuses_pins");
        return;
    };
    let probes = HostProbes::open_or_load_at(Path::new(&root)).unwrap();
    probes.watched().unwrap();
    println!(
        "child opened {}{:?}",
        if probes.loaded_here() { "loaded " } else { "" },
        pinned_program_ids(&probes.pin_dir())
    );
}

#[test]
fn counts_filesystem_mutations_by_class() {
    let _serial = serial();
    let root = TestRoot::new("fs");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("fs");
    probes.watch(cg.id).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().display();
    fs::write(tmp.path().join("existing"), "x").unwrap();

    let read_only = delta(&probes, &cg, || {
        let out = cg.run(&format!(
            "cat /etc/hostname; ls / >/dev/null; cat /etc/passwd > /dev/null 2>&1; grep -c root /etc/passwd; \
             find {d} -name existing; ls -la {d} >/dev/null; echo to-stdout; echo piped | cat; echo err >&2; \
             stat {d}/existing >/dev/null; head -c 10 /dev/zero >/dev/null"
        ));
        assert!(String::from_utf8_lossy(&out.stdout).contains("to-stdout"));
    });
    assert_eq!(
        read_only.fs_mutations,
        0,
        "read-only workload: {}",
        explain(&read_only)
    );
    assert!(
        read_only.forks >= 5 && read_only.execs >= 5 && read_only.exits >= 5,
        "{}",
        explain(&read_only)
    );

    let write = delta(&probes, &cg, || {
        cg.run(&format!("echo hello > {d}/f"));
    });
    assert_eq!(class(&write, FsClass::OpenWrite), 1, "{}", explain(&write));
    assert_eq!(class(&write, FsClass::Write), 1, "{}", explain(&write));
    assert_eq!(write.fs_mutations, 2, "{}", explain(&write));

    let append = delta(&probes, &cg, || {
        cg.run(&format!("echo more >> {d}/f"));
    });
    assert!(
        class(&append, FsClass::OpenWrite) == 1 && class(&append, FsClass::Write) == 1,
        "{}",
        explain(&append)
    );

    let tree = delta(&probes, &cg, || {
        cg.run(&format!(
            "mkdir {d}/dir && mv {d}/f {d}/g && chmod 600 {d}/g && ln -s g {d}/sym && ln {d}/g {d}/hard && \
             rm {d}/sym {d}/hard && rmdir {d}/dir && touch -d @0 {d}/g && truncate -s 0 {d}/g && mkfifo {d}/fifo && \
             chown 0:0 {d}/g && rm {d}/g {d}/fifo"
        ));
    });
    for (k, n) in [
        (FsClass::Mkdir, 1),
        (FsClass::Rename, 1),
        (FsClass::Chmod, 1),
        (FsClass::Symlink, 1),
        (FsClass::Link, 1),
        (FsClass::Unlink, 4),
        (FsClass::Rmdir, 1),
        (FsClass::Utimes, 1),
        (FsClass::Truncate, 1),
        (FsClass::Mknod, 1),
        (FsClass::Chown, 1),
    ] {
        assert!(class(&tree, k) >= n, "{}: {}", k.name(), explain(&tree));
    }

    // Shared writable file mapping (mmap, or mprotect adding write) counts;
    // a private one does not.
    let py = |flags: &str, body: &str| {
        format!(
            "/usr/bin/python3 -B -c 'import ctypes,os\nlibc=ctypes.CDLL(None,use_errno=True)\nlibc.mmap.restype=ctypes.c_void_p\n\
             libc.mmap.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int,ctypes.c_int,ctypes.c_int,ctypes.c_long]\n\
             libc.mprotect.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int]\n\
             fd=os.open(\"{d}/existing\",os.{flags})\n{body}\n'"
        )
    };
    let shared_rw = delta(&probes, &cg, || {
        cg.run(&py(
            "O_RDWR",
            "a=libc.mmap(None,4096,3,1,fd,0)\nassert a!=ctypes.c_void_p(-1).value",
        ));
    });
    let shared_upgrade = delta(&probes, &cg, || {
        cg.run(&py(
            "O_RDWR",
            "a=libc.mmap(None,4096,1,1,fd,0)\nassert libc.mprotect(a,4096,3)==0",
        ));
    });
    let private_upgrade = delta(&probes, &cg, || {
        cg.run(&py(
            "O_RDONLY",
            "a=libc.mmap(None,4096,1,2,fd,0)\nassert libc.mprotect(a,4096,3)==0",
        ));
    });
    assert_eq!(
        shared_rw.shared_writable_mmaps,
        1,
        "{}",
        explain(&shared_rw)
    );
    assert_eq!(
        shared_upgrade.shared_writable_mmaps,
        1,
        "{}",
        explain(&shared_upgrade)
    );
    assert_eq!(
        private_upgrade.shared_writable_mmaps,
        0,
        "{}",
        explain(&private_upgrade)
    );
    assert_eq!(
        private_upgrade.fs_mutations,
        0,
        "python with a private mapping only: {}",
        explain(&private_upgrade)
    );

    // Opens that change nothing: create of an existing file with O_EXCL,
    // write mode on a device, read-only; O_RDONLY|O_TRUNC truncates.
    let quiet_opens = delta(&probes, &cg, || {
        cg.run(&format!(
            "/usr/bin/python3 -B -c 'import os\ntry:\n  os.open(\"{d}/existing\",os.O_CREAT|os.O_EXCL|os.O_WRONLY)\n\
             except FileExistsError:\n  pass\nos.open(\"/dev/null\",os.O_WRONLY|os.O_TRUNC)\n\
             os.open(\"{d}/existing\",os.O_RDONLY)\nos.open(\"{d}/missing\",os.O_WRONLY)\n' 2>/dev/null; true"
        ));
    });
    assert_eq!(quiet_opens.fs_mutations, 0, "{}", explain(&quiet_opens));
    let rdonly_trunc = delta(&probes, &cg, || {
        cg.run(&format!(
            "/usr/bin/python3 -B -c 'import os\nos.open(\"{d}/existing\",os.O_RDONLY|os.O_TRUNC)'"
        ));
    });
    assert_eq!(
        class(&rdonly_trunc, FsClass::OpenWrite),
        1,
        "{}",
        explain(&rdonly_trunc)
    );
    assert_eq!(fs::metadata(tmp.path().join("existing")).unwrap().len(), 0);

    // Creating a unix socket file is a mknod; an abstract one is nothing.
    let sockets = delta(&probes, &cg, || {
        cg.run(&format!(
            "/usr/bin/python3 -B -c 'import socket\ns=socket.socket(socket.AF_UNIX)\ns.bind(\"{d}/sock\")\n\
             t=socket.socket(socket.AF_UNIX)\nt.bind(\"\\0crab-abstract-test\")\n'"
        ));
    });
    assert_eq!(class(&sockets, FsClass::Mknod), 1, "{}", explain(&sockets));

    // An unwatched cgroup next door sees nothing counted for it.
    let other = TestCgroup::new("fs-other");
    let before = probes.counters(cg.id).unwrap();
    other.run(&format!("echo x > {d}/other; mkdir {d}/otherdir"));
    assert_eq!(probes.counters(cg.id).unwrap(), before);
    assert!(matches!(
        probes.counters(other.id),
        Err(BpfError::NotWatched(_))
    ));

    // Tasks in a child cgroup of a watched one count for it.
    let nested = TestCgroup::at(cg.dir.join("nested"));
    let via_child = delta(&probes, &cg, || {
        nested.run(&format!("echo x > {d}/nested"));
    });
    assert_eq!(
        class(&via_child, FsClass::OpenWrite),
        1,
        "{}",
        explain(&via_child)
    );
    drop(nested);

    for (name, c) in [
        ("read-only", &read_only),
        ("write", &write),
        ("append", &append),
        ("tree ops", &tree),
        ("mmap shared rw", &shared_rw),
        ("mprotect shared", &shared_upgrade),
        ("mprotect private", &private_upgrade),
        ("unix sockets", &sockets),
        ("quiet opens", &quiet_opens),
        ("O_RDONLY|O_TRUNC", &rdonly_trunc),
        ("child cgroup", &via_child),
    ] {
        eprintln!("{name}: {}", explain(c));
    }
    let all = probes.counters(cg.id).unwrap();
    assert_eq!(all.errors, 0, "{}", explain(&all));
    probes.unwatch(cg.id).unwrap();
}

#[test]
fn counts_processes_and_run_counts() {
    let _serial = serial();
    let root = TestRoot::new("procs");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("procs");
    probes.watch(cg.id).unwrap();

    let procs = delta(&probes, &cg, || {
        cg.run("for i in 1 2 3; do /bin/true; done; (exit 0) & wait");
    });
    // 3 × /bin/true + 1 subshell, each forked and exited; the shell itself
    // exits too. exec: the 3 /bin/true.
    assert_eq!(procs.forks, 4, "{}", explain(&procs));
    assert_eq!(procs.execs, 3, "{}", explain(&procs));
    assert_eq!(procs.exits, 5, "{}", explain(&procs));

    let threads = delta(&probes, &cg, || {
        cg.run("/usr/bin/python3 -B -c 'import threading\nt=threading.Thread(target=lambda: None)\nt.start()\nt.join()'");
    });
    assert_eq!(threads.threads, 1, "{}", explain(&threads));

    // A sleeping process does not run: same count, reported as Some.
    let mut sleeper = cg.spawn("exec sleep 30");
    let pid = sleeper.id();
    std::thread::sleep(Duration::from_millis(500));
    let r1 = probes.run_count(pid).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let r2 = probes.run_count(pid).unwrap();
    assert!(
        r1.is_some() && r1 == r2,
        "sleeping process: {r1:?} then {r2:?}"
    );

    // A busy process runs: never two equal Some values.
    let mut busy = cg.spawn("while :; do :; done");
    let busy_pid = busy.id();
    let mut samples = Vec::new();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        samples.push(probes.run_count(busy_pid).unwrap());
    }
    for pair in samples.windows(2) {
        assert!(
            !(pair[0].is_some() && pair[0] == pair[1]),
            "busy process looked idle: {samples:?}"
        );
    }
    // Waking the sleeper moves its count.
    kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    kill(Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let r3 = probes.run_count(pid).unwrap();
    assert!(r3.is_none() || r3 > r2, "woken process: {r2:?} then {r3:?}");

    busy.kill().unwrap();
    busy.wait().unwrap();
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    // Exited processes leave no run entry behind, even while watched.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(probes.run_count(pid).unwrap(), None);
    assert_eq!(probes.entries_of(cg.id).unwrap(), 0);
    eprintln!("sleeper {r1:?} {r2:?} {r3:?}; busy samples {samples:?}");
    assert_eq!(probes.counters(cg.id).unwrap().errors, 0);
    probes.unwatch(cg.id).unwrap();
}

#[test]
fn sweep_dead_unwatches_only_removed_cgroups() {
    let _serial = serial();
    let root = TestRoot::new("sweep");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let live = TestCgroup::new("sweep-live");
    let dead = TestCgroup::new("sweep-dead");
    probes.watch(live.id).unwrap();
    probes.watch(dead.id).unwrap();
    fs::remove_dir(&dead.dir).unwrap();
    let dead_id = dead.id;
    // Already removed: nothing for its guard to clean up (it would wait for the directory).
    std::mem::forget(dead);
    assert_eq!(probes.sweep_dead().unwrap(), vec![dead_id]);
    let watched = probes.watched().unwrap();
    assert!(
        watched.contains(&live.id) && !watched.contains(&dead_id),
        "{watched:?}"
    );
    assert_eq!(probes.sweep_dead().unwrap(), Vec::<u64>::new());
    probes.unwatch(live.id).unwrap();
}

#[test]
fn unwatch_leaves_no_entries() {
    let _serial = serial();
    let root = TestRoot::new("unwatch");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("unwatch");
    let bystander = TestCgroup::new("unwatch-bystander");
    probes.watch(cg.id).unwrap();
    probes.watch(bystander.id).unwrap();
    let mut bystander_proc = bystander.spawn("while :; do sleep 0.02; done");
    // Live processes with run entries, still running at unwatch time.
    let mut children: Vec<Child> = (0..4)
        .map(|_| cg.spawn("while :; do sleep 0.01; echo x > /dev/null; done"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert!(probes.entries_of(cg.id).unwrap() >= 4);
    assert!(probes.watched().unwrap().contains(&cg.id));

    probes.unwatch(cg.id).unwrap();
    assert_eq!(probes.entries_of(cg.id).unwrap(), 0);
    assert!(!probes.watched().unwrap().contains(&cg.id));
    assert!(matches!(
        probes.counters(cg.id),
        Err(BpfError::NotWatched(_))
    ));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        probes.entries_of(cg.id).unwrap(),
        0,
        "entries came back after unwatch"
    );
    for pid in children.iter().map(Child::id) {
        assert_eq!(probes.run_count(pid).unwrap(), None);
    }
    // The other watched cgroup is untouched.
    assert!(probes.entries_of(bystander.id).unwrap() >= 1);
    assert!(probes.counters(bystander.id).unwrap().forks > 0);
    // Unwatching twice is fine.
    probes.unwatch(cg.id).unwrap();
    probes.unwatch(bystander.id).unwrap();
    assert_eq!(probes.entries_of(bystander.id).unwrap(), 0);
    assert!(probes.watched().unwrap().is_empty());
    assert_eq!(watched_levels(&probes).unwrap(), (0, 0));
    for c in &mut children {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    bystander_proc.kill().unwrap();
    bystander_proc.wait().unwrap();
}

/// The rseq area of each thread that leaves a CPU is noted per process (the inspector hashes
/// those 32 bytes as zeros: the kernel writes the current CPU there), exactly glibc's area
/// (thread pointer + `__rseq_offset`), and forgotten when the process execs.
#[test]
fn notes_the_rseq_areas_of_threads_that_ran() {
    let _serial = serial();
    let root = TestRoot::new("rseq");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("rseq");
    probes.watch(cg.id).unwrap();
    // Prints the rseq area of its main thread and of a second thread, then sleeps in short
    // steps (leaving the CPU each time) until its stdin closes.
    let script = r#"exec /usr/bin/python3 -B -u -c '
import ctypes, sys, threading, time
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_ulong
off = ctypes.c_long.in_dll(libc, "__rseq_offset").value
size = ctypes.c_uint.in_dll(libc, "__rseq_size").value
def area():
    return libc.pthread_self() + off if size else 0
other = []
t = threading.Thread(target=lambda: (other.append(area()), time.sleep(30)), daemon=True)
t.start()
while not other:
    time.sleep(0.01)
print(area(), other[0], flush=True)
while True:
    time.sleep(0.02)
'"#;
    let mut child = cg.spawn(script);
    let pid = child.id();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let want: Vec<u64> = line
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    if want.contains(&0) {
        eprintln!("glibc did not register rseq: nothing to check");
        let _ = child.kill();
        let _ = child.wait();
        return;
    }
    // Both threads have left a CPU by now (the other one went to sleep right after noting its
    // area; the main thread sleeps every 20 ms).
    let got = wait_for(|| {
        let (areas, complete) = probes.rseq_areas(pid).unwrap();
        (want.iter().all(|a| areas.contains(a)) && complete).then_some(areas)
    });
    assert!(
        got.is_some(),
        "want {want:?}, got {:?}",
        probes.rseq_areas(pid)
    );
    // An exec forgets them; the new image's thread is noted when it leaves a CPU.
    let mut sleeper = cg.spawn("exec sleep 30");
    let spid = sleeper.id();
    let noted = wait_for(|| {
        let (areas, _) = probes.rseq_areas(spid).unwrap();
        (!areas.is_empty()).then_some(areas)
    });
    let (areas, _) = probes.rseq_areas(spid).unwrap();
    assert!(
        noted.is_some() && areas.len() == 1 && !want.contains(&areas[0]),
        "after exec: {areas:?} (the shell's were {want:?})"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(probes.counters(cg.id).unwrap().errors, 0);
    probes.unwatch(cg.id).unwrap();
}

/// `f` until it gives something, for at most 5 s.
/// A thread that exits, or unregisters its rseq area, takes its own area out of the noted ones
/// and leaves the others' (of threads that sleep on and may not run for long): its final
/// switch-outs note nothing, so a freed area can never mask the data later stored there.
#[test]
fn a_thread_that_exits_or_unregisters_takes_only_its_own_area() {
    let _serial = serial();
    let root = TestRoot::new("rseq-exit");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("rseq-exit");
    probes.watch(cg.id).unwrap();
    // Threads: `b` sleeps; `w` waits, then exits on "exit"; `u` waits, then unregisters its
    // area on "unreg" (rseq(2), RSEQ_FLAG_UNREGISTER, glibc's x86 signature) and sleeps.
    let script = r#"exec /usr/bin/python3 -B -u -c '
import ctypes, sys, threading, time
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_ulong
libc.syscall.restype = ctypes.c_long
off = ctypes.c_long.in_dll(libc, "__rseq_offset").value
size = ctypes.c_uint.in_dll(libc, "__rseq_size").value
def area():
    return libc.pthread_self() + off if size else 0
areas, go_exit, go_unreg = {}, threading.Event(), threading.Event()
def b():
    areas["b"] = area(); time.sleep(60)
def w():
    areas["w"] = area(); go_exit.wait()
def u():
    a = areas["u"] = area(); go_unreg.wait()
    print("unreg", libc.syscall(334, ctypes.c_void_p(a), 32, 1, 0x53053053), flush=True)
    time.sleep(60)
for f in (b, w, u):
    threading.Thread(target=f, daemon=True).start()
while len(areas) < 3:
    time.sleep(0.01)
print(areas["b"], areas["w"], areas["u"], flush=True)
for line in sys.stdin:
    (go_exit if line.strip() == "exit" else go_unreg).set()
'"#;
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("read _go; {script}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    fs::write(cg.dir.join("cgroup.procs"), child.id().to_string()).unwrap();
    let pid = child.id();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    let finish = |mut child: Child| {
        let _ = child.kill();
        let _ = child.wait();
    };
    if v.contains(&0) {
        eprintln!("glibc did not register rseq: nothing to check");
        finish(child);
        return;
    }
    let (b, w, u) = (v[0], v[1], v[2]);
    let areas = || probes.rseq_areas(pid).unwrap().0;
    assert!(
        wait_for(|| [b, w, u].iter().all(|a| areas().contains(a)).then_some(())).is_some(),
        "all three noted: want {v:?}, got {:?}",
        areas()
    );
    stdin.write_all(b"exit\n").unwrap();
    assert!(
        wait_for(|| (!areas().contains(&w)).then_some(())).is_some(),
        "the exited thread's area stays noted: {:?} (it was {w})",
        areas()
    );
    let now = areas();
    assert!(now.contains(&b) && now.contains(&u), "{now:?}");
    stdin.write_all(b"unreg\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "unreg 0", "rseq(2) unregistered the area");
    assert!(
        wait_for(|| (!areas().contains(&u)).then_some(())).is_some(),
        "the unregistered area stays noted: {:?} (it was {u})",
        areas()
    );
    assert!(areas().contains(&b), "{:?}", areas());
    finish(child);
    assert_eq!(probes.counters(cg.id).unwrap().errors, 0);
    probes.unwatch(cg.id).unwrap();
}

fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One cgroup's processes cannot take what another's need: run entries are task storage (no
/// host-wide table), and a cgroup watched with a quota of 8 gets at most 8 of them, its excess
/// counted in its own `over_quota`; a neighbour of 40 processes (unbounded) gets a run count
/// for every one of them, with no error and nothing over any quota. Exits give the quota back.
#[test]
fn a_cgroup_over_its_quota_costs_only_itself() {
    let _serial = serial();
    let root = TestRoot::new("quota");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let filler = TestCgroup::new("quota-filler");
    let neighbour = TestCgroup::new("quota-neighbour");
    probes.watch_bounded(filler.id, Some(8)).unwrap();
    probes.watch(neighbour.id).unwrap();
    assert_eq!(probes.quota(filler.id).unwrap(), Some((0, 8)));
    assert_eq!(probes.quota(neighbour.id).unwrap(), None);

    // Each sleeper runs a little (a few switch-outs) before it settles.
    let sleepers = |cg: &TestCgroup, n: usize| -> Vec<Child> {
        (0..n)
            .map(|_| cg.spawn("for i in 1 2 3; do sleep 0.05; done; exec sleep 60"))
            .collect()
    };
    let mut filled = sleepers(&filler, 20);
    let mut neighbours = sleepers(&neighbour, 40);
    std::thread::sleep(Duration::from_millis(1500));

    let (used, max) = probes.quota(filler.id).unwrap().unwrap();
    assert!(used <= max && max == 8, "filler holds {used} of {max}");
    let with_count = filled
        .iter()
        .filter(|c| probes.run_count(c.id()).unwrap().is_some())
        .count();
    assert!(
        with_count <= 8,
        "{with_count} filler processes have run counts"
    );
    let f = probes.counters(filler.id).unwrap();
    assert!(f.over_quota > 0, "{f:?}");

    let n = probes.counters(neighbour.id).unwrap();
    assert_eq!((n.errors, n.over_quota), (0, 0), "{n:?}");
    for c in &neighbours {
        assert!(
            probes.run_count(c.id()).unwrap().is_some(),
            "neighbour {} has no run count",
            c.id()
        );
    }
    assert_eq!(probes.entries_of(neighbour.id).unwrap(), 40);

    for c in filled.iter_mut().chain(neighbours.iter_mut()) {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(probes.quota(filler.id).unwrap(), Some((0, 8)));
    probes.unwatch(filler.id).unwrap();
    probes.unwatch(neighbour.id).unwrap();
    assert_eq!(probes.quota(filler.id).unwrap(), None);
}

/// Python with ctypes' libc, then `body` (lines).
fn py(body: &str) -> String {
    format!(
        "/usr/bin/python3 -B -c 'import ctypes,os,resource,signal\nlibc=ctypes.CDLL(None,use_errno=True)\nsc=libc.syscall\nsc.restype=ctypes.c_long\n{body}\n'"
    )
}

#[test]
fn counts_signals_left_pending_and_kernel_state_outside_processes() {
    let _serial = serial();
    let root = TestRoot::new("state");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("state");
    probes.watch(cg.id).unwrap();

    // Signals queued to a process that blocks them: counted on it, without it running.
    let mut holder = cg.spawn(&format!(
        "exec {}",
        py("signal.pthread_sigmask(signal.SIG_BLOCK,[signal.SIGUSR1,signal.SIGRTMIN])\nimport time\ntime.sleep(60)")
    ));
    let pid = holder.id();
    let blocked = || {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|mask| mask & 0x200 != 0)
    };
    let q = wait_for(|| probes.signals_queued(pid).unwrap().filter(|_| blocked()));
    let before = q.expect("the holder's entry and mask");
    let runs = probes.run_count(pid).unwrap();
    let send = |sig: Signal| kill(Pid::from_raw(pid as i32), sig).unwrap();
    send(Signal::SIGUSR1);
    assert_eq!(probes.signals_queued(pid).unwrap(), Some(before + 1));
    send(Signal::SIGUSR1); // merged with the pending one: nothing new
    assert_eq!(probes.signals_queued(pid).unwrap(), Some(before + 1));
    let rt = libc::SIGRTMIN();
    for _ in 0..2 {
        // SAFETY: kill with a plain pid and signal number.
        assert_eq!(unsafe { libc::kill(pid as i32, rt) }, 0);
    }
    assert_eq!(
        probes.signals_queued(pid).unwrap(),
        Some(before + 3),
        "real-time signals queue one each"
    );
    assert_eq!(
        probes.run_count(pid).unwrap(),
        runs,
        "blocked: it did not run"
    );
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("ShdPnd:\t0000000"), "{status}");

    // Kernel state outside the processes: one class each; the same calls on oneself do not count.
    let case = |what: &str, body: &str| {
        let c = delta(&probes, &cg, || {
            cg.run(&py(body));
        });
        eprintln!("{what}: {}", explain(&c));
        c
    };
    let own = case(
        "own process",
        "os.setpriority(os.PRIO_PROCESS,0,1)\nresource.prlimit(0,resource.RLIMIT_NOFILE,resource.getrlimit(resource.RLIMIT_NOFILE))\n\
         os.sched_setaffinity(0,os.sched_getaffinity(0))",
    );
    assert_eq!(own.state_by_class, [0; 9], "{}", explain(&own));
    let other = case(
        "another process",
        &format!("os.setpriority(os.PRIO_PROCESS,{pid},2)\nresource.prlimit({pid},resource.RLIMIT_NOFILE,resource.getrlimit(resource.RLIMIT_NOFILE))\nos.sched_setaffinity({pid},os.sched_getaffinity(0))"),
    );
    assert_eq!(
        state(&other, StateClass::OtherProcess),
        3,
        "{}",
        explain(&other)
    );
    let getfd = case(
        "pidfd_getfd",
        &format!("p=os.pidfd_open({pid})\nfd=sc(438,p,0,0)\nassert fd>=0, ctypes.get_errno()"),
    );
    assert_eq!(
        state(&getfd, StateClass::PidfdGetfd),
        1,
        "{}",
        explain(&getfd)
    );
    let ipc = case(
        "SysV message queue",
        "q=libc.msgget(0,0o600|0o1000)\nassert q>=0\nassert libc.msgctl(q,0,None)==0",
    );
    assert_eq!(state(&ipc, StateClass::SysvIpc), 2, "{}", explain(&ipc));
    let procfs = case(
        "procfs",
        "open(\"/proc/self/oom_score_adj\",\"w\").write(\"100\")",
    );
    assert_eq!(
        state(&procfs, StateClass::Procfs),
        1,
        "{}",
        explain(&procfs)
    );
    assert_eq!(procfs.foreign_mem_writes, 0);
    let mem = case(
        "/proc/self/mem",
        "b=ctypes.create_string_buffer(8)\nf=open(\"/proc/self/mem\",\"r+b\",buffering=0)\nf.seek(ctypes.addressof(b))\nf.write(b\"x\")",
    );
    assert_eq!(mem.foreign_mem_writes, 1, "{}", explain(&mem));
    assert_eq!(state(&mem, StateClass::Procfs), 0, "{}", explain(&mem));
    let uring = case(
        "io_uring",
        "p=ctypes.create_string_buffer(120)\nfd=sc(425,4,p)\nassert fd>=0, ctypes.get_errno()",
    );
    assert_eq!(state(&uring, StateClass::AsyncIo), 1, "{}", explain(&uring));
    assert!(class(&uring, FsClass::Other) >= 1);
    let uffd = case(
        "userfaultfd",
        "fd=sc(323,1|0o2000000)\nassert fd>=0, ctypes.get_errno()\napi=(ctypes.c_uint64*3)(0xAA,0,0)\nassert libc.ioctl(fd,ctypes.c_ulong(0xc018aa3f),api)==0, ctypes.get_errno()",
    );
    assert_eq!(
        state(&uffd, StateClass::Userfaultfd),
        1,
        "{}",
        explain(&uffd)
    );
    let poke = case(
        "ptrace writes",
        "sc(101,5,1,0,0)\nsc(101,13,1,0,0)\nsc(101,2,1,0,0)",
    );
    assert_eq!(
        state(&poke, StateClass::PtraceWrite),
        2,
        "POKEDATA and SETREGS, not PEEKDATA: {}",
        explain(&poke)
    );
    assert_eq!(poke.foreign_mem_writes, 3);

    // A tmpfs file (the host's /dev/shm here, a container's /dev/shm or /dev there) and a
    // memfd: created and written, outside any upperdir.
    let shm = format!("/dev/shm/crab-bpf-test-{}", std::process::id());
    let tmpfs = case(
        "tmpfs",
        &format!("open({shm:?},\"w\").write(\"x\")\nos.unlink({shm:?})\nm=os.memfd_create(\"m\")\nos.write(m,b\"y\")"),
    );
    assert_eq!(
        state(&tmpfs, StateClass::Tmpfs),
        3,
        "create, write, memfd write: {}",
        explain(&tmpfs)
    );
    // A core dump is a file the kernel writes without a syscall of the process.
    let core = delta(&probes, &cg, || {
        let tmp = tempfile::tempdir().unwrap();
        let out = cg.spawn(&format!(
            "cd {}; ulimit -c unlimited; sleep 30 & p=$!; sleep 0.2; kill -SEGV $p; wait $p; echo status=$?",
            tmp.path().display()
        ))
        .wait_with_output()
        .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("status=139"),
            "{out:?}"
        );
    });
    assert_eq!(class(&core, FsClass::Coredump), 1, "{}", explain(&core));

    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(probes.counters(cg.id).unwrap().errors, 0);
    probes.unwatch(cg.id).unwrap();
}

/// An overlay mounted for a test, unmounted (lazily) when dropped.
struct TestOverlay {
    _dir: tempfile::TempDir,
    merged: PathBuf,
}

impl TestOverlay {
    fn new() -> TestOverlay {
        let dir = tempfile::tempdir().unwrap();
        for d in ["lower", "upper", "work", "merged"] {
            fs::create_dir(dir.path().join(d)).unwrap();
        }
        fs::write(dir.path().join("lower/image-file"), "from the image").unwrap();
        let merged = dir.path().join("merged");
        let options = format!(
            "lowerdir={0}/lower,upperdir={0}/upper,workdir={0}/work",
            dir.path().display()
        );
        nix::mount::mount(
            Some("overlay"),
            &merged,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(options.as_str()),
        )
        .unwrap_or_else(|e| panic!("mounting an overlay at {}: {e}", merged.display()));
        TestOverlay { _dir: dir, merged }
    }

    fn dev(&self) -> u64 {
        nix::sys::stat::stat(&self.merged).unwrap().st_dev
    }
}

impl Drop for TestOverlay {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.merged, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Runs `changes` in a child process outside every cgroup the test watches, after
/// `chroot(root)` (if given) and `chdir(cwd)`; the child never execs.
fn outside_child(root: Option<&Path>, cwd: &Path, changes: fn()) {
    use std::os::unix::process::CommandExt as _;
    let (root, cwd) = (root.map(Path::to_path_buf), cwd.to_path_buf());
    let mut cmd = Command::new("/nonexistent-never-run");
    // SAFETY: the closure runs in the forked child and makes only syscalls (chroot, chdir,
    // the changes' mkdir/chmod/unlink/open/write) before _exit: no allocation, no locks.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(root) = &root {
                nix::unistd::chroot(root.as_path())?;
            }
            nix::unistd::chdir(cwd.as_path())?;
            changes();
            libc::_exit(0)
        });
    }
    let status = cmd.status().unwrap();
    assert!(status.success(), "{status:?}");
}

/// Changes of a container's rootfs made by tasks outside every watched cgroup count for that
/// container (class `outside`): a task chrooted into it (how `docker cp` writes), one working
/// in it, one writing through its host path. The same changes elsewhere do not, and unwatching
/// forgets the rootfs.
#[test]
fn changes_from_outside_the_container_count_for_its_rootfs() {
    let _serial = serial();
    let root = TestRoot::new("outside");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("outside");
    let bystander = TestCgroup::new("outside-bystander");
    let overlay = TestOverlay::new();
    let elsewhere = tempfile::tempdir().unwrap();
    probes.watch(cg.id).unwrap();
    probes.watch(bystander.id).unwrap();
    probes.watch_rootfs(cg.id, overlay.dev()).unwrap();
    assert_eq!(
        probes
            .rootfs_registrations()
            .unwrap()
            .iter()
            .filter(|(_, c)| *c == cg.id)
            .count(),
        1
    );
    let outside = |c: &CgroupCounters| class(c, FsClass::Outside);

    // A task chrooted into the rootfs: mkdir, chmod, unlink by absolute paths (no fd).
    fn path_changes() {
        // SAFETY: NUL-terminated literals; plain syscalls.
        unsafe {
            libc::mkdir(c"/uploaded".as_ptr(), 0o755);
            libc::chmod(c"/uploaded".as_ptr(), 0o700);
            libc::unlink(c"/image-file".as_ptr());
        }
    }
    let chrooted = delta(&probes, &cg, || {
        outside_child(Some(&overlay.merged), Path::new("/"), path_changes)
    });
    assert_eq!(outside(&chrooted), 3, "{}", explain(&chrooted));
    assert_eq!(chrooted.fs_mutations, 3, "{}", explain(&chrooted));
    assert!(fs::metadata(overlay.merged.join("uploaded"))
        .unwrap()
        .is_dir());

    // A task working in it, by relative paths.
    fn relative_changes() {
        // SAFETY: a NUL-terminated literal; a plain syscall.
        unsafe {
            libc::mkdir(c"relative".as_ptr(), 0o755);
        }
    }
    let in_cwd = delta(&probes, &cg, || {
        outside_child(None, &overlay.merged, relative_changes)
    });
    assert_eq!(outside(&in_cwd), 1, "{}", explain(&in_cwd));

    // A writer through the host path (this test process): the open and the write, by fd.
    let by_host_path = delta(&probes, &cg, || {
        fs::write(overlay.merged.join("copied-in"), "x").unwrap()
    });
    assert_eq!(outside(&by_host_path), 2, "{}", explain(&by_host_path));

    // The same changes anywhere else, and reads of the rootfs, are nobody's.
    let bystander_before = probes.counters(bystander.id).unwrap();
    let not_ours = delta(&probes, &cg, || {
        outside_child(Some(elsewhere.path()), Path::new("/"), path_changes);
        outside_child(None, elsewhere.path(), relative_changes);
        fs::write(elsewhere.path().join("copied-in"), "x").unwrap();
        fs::read_to_string(overlay.merged.join("copied-in")).unwrap();
        fs::read_dir(&overlay.merged).unwrap().for_each(drop);
    });
    assert_eq!(not_ours.fs_mutations, 0, "{}", explain(&not_ours));
    let bystander_delta = probes
        .counters(bystander.id)
        .unwrap()
        .since(&bystander_before);
    assert_eq!(
        outside(&bystander_delta),
        0,
        "{}",
        explain(&bystander_delta)
    );

    // The container's own changes keep their classes: `outside` is only for others.
    let own = delta(&probes, &cg, || {
        cg.run(&format!("mkdir {}/own", overlay.merged.display()));
    });
    assert_eq!(class(&own, FsClass::Mkdir), 1, "{}", explain(&own));
    assert_eq!(outside(&own), 0, "{}", explain(&own));

    probes.unwatch(cg.id).unwrap();
    assert!(
        probes
            .rootfs_registrations()
            .unwrap()
            .iter()
            .all(|(_, c)| *c != cg.id),
        "the rootfs stays registered after unwatch"
    );
    fs::write(overlay.merged.join("after-unwatch"), "x").unwrap();
    probes.unwatch(bystander.id).unwrap();
}

/// Interactions (syscalls other than the quiet ones, and signals) counted per process once the
/// quiet program is attached: a process that only waits with timeouts, reads clocks and
/// allocates counts none however long it runs; a stat, a wait that returned an event, a file
/// mapped, a signal each count.
#[test]
fn counts_the_interactions_of_processes_once_asked() {
    let _serial = serial();
    let root = TestRoot::new("quiet");
    let probes = HostProbes::open_or_load_at(&root.0).unwrap();
    let cg = TestCgroup::new("quiet");
    probes.watch(cg.id).unwrap();
    assert!(!probes.interactions_tracked(), "attached only when asked");
    assert!(!expected_links().unwrap().contains("btf:sys_exit"));

    let fifo = std::env::temp_dir().join(format!("crab-quiet-{}", std::process::id()));
    let _ = fs::remove_file(&fifo);
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // Waits on a FIFO (nobody writes: each poll times out), allocates, reads the clock; after
    // an event it reads what came.
    let mut quiet = cg.spawn(&format!(
        "exec {}",
        py(&format!(
            "import select,time\nfd=os.open(\"{}\",os.O_RDONLY|os.O_NONBLOCK)\np=select.poll()\np.register(fd,select.POLLIN)\nkeep=[]\nwhile True:\n  if p.poll(50):\n    os.read(fd,100)\n  keep.append(time.monotonic())\n  keep=keep[-1000:]",
            fifo.display()
        ))
    ));
    let pid = quiet.id();
    // Opened for writing (and kept open) only now: until then poll times out.
    let settle = || std::thread::sleep(Duration::from_millis(400));
    settle();
    let before_attach = wait_for(|| probes.interactions(pid).unwrap()).expect("an entry");
    settle();
    assert_eq!(
        probes.interactions(pid).unwrap(),
        Some(before_attach),
        "not attached: nothing counted"
    );
    probes.track_interactions().unwrap();
    assert!(probes.interactions_tracked());
    probes.track_interactions().unwrap(); // a second ask changes nothing
    settle();
    let runs_before = probes.run_count(pid).unwrap();
    let quiet_before = probes.interactions(pid).unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let quiet_after = probes.interactions(pid).unwrap();
    let runs_after = probes.run_count(pid).unwrap();
    assert_ne!(runs_before, runs_after, "it ran");
    assert_eq!(
        quiet_before, quiet_after,
        "timed-out polls, clocks and allocation are no interaction"
    );

    // An event on what it waits for: the poll that returns it and the read count.
    let mut w = fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    w.write_all(b"x").unwrap();
    let moved = wait_for(|| {
        probes
            .interactions(pid)
            .unwrap()
            .filter(|n| Some(*n) > quiet_after)
    });
    assert!(moved.is_some(), "data that reached it counts");
    settle();
    let after_event = probes.interactions(pid).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        probes.interactions(pid).unwrap(),
        after_event,
        "quiet again (the writer stays open)"
    );
    drop(w);

    // Others, each alone in a process of its own, from its second iteration on.
    let counted = |what: &str, body: &str| {
        let mut child = cg.spawn(&format!("exec {}", py(body)));
        let pid = child.id();
        std::thread::sleep(Duration::from_millis(300));
        let a = wait_for(|| probes.interactions(pid).unwrap());
        std::thread::sleep(Duration::from_millis(500));
        let b = probes.interactions(pid).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        eprintln!("{what}: {a:?} -> {b:?}");
        b > a
    };
    assert!(counted(
        "stat",
        "import time\nwhile True:\n  os.stat(\"/\")\n  time.sleep(0.05)"
    ));
    assert!(counted(
        "private file mapping",
        "import time,mmap\nf=open(\"/etc/hostname\",\"rb\")\nwhile True:\n  m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\n  m.close()\n  time.sleep(0.05)"
    ));
    assert!(!counted(
        "anonymous mapping",
        "import time,mmap\nwhile True:\n  m=mmap.mmap(-1,1<<20,flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS)\n  m[0]=1\n  m.close()\n  time.sleep(0.05)"
    ));

    quiet.kill().unwrap();
    quiet.wait().unwrap();
    let _ = fs::remove_file(&fifo);
    assert_eq!(probes.counters(cg.id).unwrap().errors, 0);
    probes.unwatch(cg.id).unwrap();
}
