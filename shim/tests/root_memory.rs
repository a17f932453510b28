//! The inspector's memory captures of real processes: forked children that do exactly what
//! they are told (one byte, a mapping, the kernel's rseq writes) and python3 interpreters,
//! captured twice around an action. Forking a threaded test process is only safe in a binary
//! of its own, and reading page frame numbers needs root; fails without (see `support`).

mod support;

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crab_shim::inspector::memory::testing::PresenceScan;
use crab_shim::inspector::memory::{
    capture, capture_with, compare, page_size, CaptureOptions, MemError, MemoryImage, Region,
    RegionKind,
};
use crab_shim::inspector::procs;
use xxhash_rust::xxh3::xxh3_64;

/// Waits until `pid` sleeps in syscall `nr` (so that its state is quiescent for a capture).
fn wait_blocked(pid: u32, nr: u32) {
    let want = format!("{nr} ");
    for _ in 0..2000 {
        let sc = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
        let stat = procs::read_stat(pid).unwrap().expect("process alive");
        if sc.starts_with(&want) && stat.state == 'S' {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("process {pid} did not block in syscall {nr}");
}

const PAGES: usize = 64;

/// A forked copy of the test process that runs a tiny command loop using raw syscalls only
/// (async-signal-safe after fork in a threaded harness). Commands, one byte each:
/// 'n' nothing, 'p' flip one byte of page 5 of `data`, 'm' mmap 16 anonymous pages and touch
/// one, 'u' munmap them again. It acks each command with one byte.
struct Forked {
    // A fork inherits every mapping of the test process, including the shared ones other
    // tests' children use, so forked tests run one at a time.
    _serial: std::sync::MutexGuard<'static, ()>,
    pid: u32,
    cmd: File,
    ack: File,
    data: *mut u8,
    shared: *mut u8,
    /// The child's rseq area (that of the thread that forked it).
    rseq: Option<(u64, u64)>,
}

extern "C" {
    static __rseq_offset: isize;
    static __rseq_size: u32;
}

/// This thread's `struct rseq` as registered by glibc (thread pointer + `__rseq_offset`).
fn my_rseq() -> Option<(u64, u64)> {
    let tp: u64;
    // SAFETY: reads the thread pointer (x86_64: %fs:0 holds the TCB's own address).
    unsafe { std::arch::asm!("mov {}, fs:0", out(reg) tp) };
    // SAFETY: glibc (2.35+) exports both; size 0 means rseq is not registered.
    let (off, size) = unsafe { (__rseq_offset, __rseq_size) };
    (size > 0).then(|| (tp.wrapping_add_signed(off as i64), 32))
}

impl Forked {
    fn capture(&self) -> MemoryImage {
        capture_with(
            self.pid,
            &CaptureOptions {
                volatile: self.rseq.into_iter().collect(),
                ..Default::default()
            },
        )
        .unwrap()
    }

    fn capture_unmasked(&self) -> MemoryImage {
        capture(self.pid).unwrap()
    }

    fn spawn() -> Forked {
        static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let ps = page_size() as usize;
        // SAFETY: fresh anonymous mappings (no address hint), written only within their
        // lengths; the child after fork(2) calls only async-signal-safe functions
        // (open, dup2, then child_loop's read/write) before it exits; the descriptors
        // taken into OwnedFd are the pipe ends this process just created and owns.
        unsafe {
            let data = libc::mmap(
                std::ptr::null_mut(),
                PAGES * ps,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as *mut u8;
            assert_ne!(data as *mut libc::c_void, libc::MAP_FAILED);
            // Half the pages hold data, the other half were never touched.
            for i in 0..PAGES / 2 {
                std::ptr::write_bytes(data.add(i * ps), (i + 1) as u8, ps);
            }
            // A page that holds data and is then made inaccessible (as GCs and JITs do).
            let hidden = libc::mmap(
                std::ptr::null_mut(),
                ps,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as *mut u8;
            std::ptr::write_bytes(hidden, 0xab, ps);
            assert_eq!(
                libc::mprotect(hidden as *mut libc::c_void, ps, libc::PROT_NONE),
                0
            );
            let shared = libc::mmap(
                std::ptr::null_mut(),
                16 * ps,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as *mut u8;
            let (mut c, mut a) = ([0i32; 2], [0i32; 2]);
            assert_eq!(libc::pipe2(c.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(a.as_mut_ptr(), libc::O_CLOEXEC), 0);
            let rseq = my_rseq();
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                // Away from the test runner's stdout/stderr, whose shared file positions
                // move when anything else writes to them (CI logs to a file).
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                libc::dup2(null, 1);
                libc::dup2(null, 2);
                child_loop(c[0], a[1], data);
            }
            libc::close(c[0]);
            libc::close(a[1]);
            libc::munmap(data as *mut libc::c_void, PAGES * ps);
            libc::munmap(hidden as *mut libc::c_void, ps);
            let f = Forked {
                _serial: serial,
                pid: pid as u32,
                cmd: File::from(OwnedFd::from_raw_fd(c[1])),
                ack: File::from(OwnedFd::from_raw_fd(a[0])),
                data,
                shared,
                rseq,
            };
            wait_blocked(f.pid, libc::SYS_read as u32);
            f
        }
    }

    /// The child's stack pointer while it waits for a command.
    fn sp(&self) -> u64 {
        let sc = std::fs::read_to_string(format!("/proc/{}/syscall", self.pid)).unwrap();
        let f: Vec<&str> = sc.split_whitespace().collect();
        u64::from_str_radix(f[7].trim_start_matches("0x"), 16).unwrap()
    }

    fn send(&mut self, c: u8) {
        use std::io::Read;
        self.cmd.write_all(&[c]).unwrap();
        let mut b = [0u8];
        self.ack.read_exact(&mut b).unwrap();
        assert_eq!(b[0], c);
        wait_blocked(self.pid, libc::SYS_read as u32);
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        // SAFETY: kill and waitpid of our own child take no pointers we own (a null
        // status is allowed); `shared` is the mapping of 16 pages made in `spawn`, and
        // nothing refers into it after `self`.
        unsafe {
            libc::kill(self.pid as i32, libc::SIGKILL);
            libc::waitpid(self.pid as i32, std::ptr::null_mut(), 0);
            libc::munmap(self.shared as *mut libc::c_void, 16 * page_size() as usize);
        }
    }
}

fn child_loop(cmd: i32, ack: i32, data: *mut u8) -> ! {
    // Drop the fds inherited from other tests running in the harness (BPF maps, pipes):
    // their state is not ours to watch.
    let (lo, hi) = (cmd.min(ack) as u32, cmd.max(ack) as u32);
    // SAFETY: close_range takes no pointers; it closes descriptors of this forked child
    // that nothing in it uses (everything but the two pipe ends it talks over).
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, lo - 1, 0u32);
        libc::syscall(libc::SYS_close_range, lo + 1, hi - 1, 0u32);
        libc::syscall(libc::SYS_close_range, hi + 1, u32::MAX, 0u32);
    }
    let ps = page_size() as usize;
    let mut extra: *mut libc::c_void = std::ptr::null_mut();
    loop {
        let mut c = 0u8;
        // SAFETY: raw syscalls and plain memory accesses only (we are a fork of a threaded
        // process: no allocation, no locks).
        unsafe {
            if libc::syscall(libc::SYS_read, cmd, &mut c as *mut u8, 1) != 1 {
                libc::_exit(0);
            }
            match c {
                b'p' => {
                    let p = data.add(5 * ps + 123);
                    std::ptr::write_volatile(p, std::ptr::read_volatile(p) ^ 0xff);
                }
                b'm' => {
                    extra = libc::mmap(
                        std::ptr::null_mut(),
                        16 * ps,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    );
                    std::ptr::write_volatile(extra as *mut u8, 1);
                }
                b'u' => {
                    libc::munmap(extra, 16 * ps);
                }
                _ => {}
            }
            libc::syscall(libc::SYS_write, ack, &c as *const u8, 1);
        }
    }
}

/// Addresses of pages whose listed hashes differ (for tests on same-layout images).
fn changed_addresses(a: &MemoryImage, b: &MemoryImage) -> Vec<u64> {
    let set = |i: &MemoryImage| {
        i.regions
            .iter()
            .flat_map(|r| r.pages.iter().copied())
            .collect::<std::collections::BTreeMap<u64, u64>>()
    };
    let (x, y) = (set(a), set(b));
    let mut v: Vec<u64> = x
        .keys()
        .chain(y.keys())
        .filter(|k| x.get(k) != y.get(k))
        .copied()
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Is `va` covered by both images (not a page of an added or removed mapping)?
fn compare_is_same_layout(a: &MemoryImage, b: &MemoryImage, va: u64) -> bool {
    let has = |i: &MemoryImage| i.regions.iter().any(|r| r.start <= va && va < r.end);
    has(a) && has(b)
}

#[test]
fn forked_child_ran_but_changed_nothing_is_equal() {
    let mut f = Forked::spawn();
    f.send(b'n');
    let a = f.capture();
    assert_eq!(a.stats.unreadable_pages, 0);
    let b = f.capture();
    assert!(compare(&a, &b).is_empty(), "idle: {}", compare(&a, &b));
    // It runs (reads a command, acks it) but leaves every byte as it was.
    f.send(b'n');
    f.send(b'n');
    let c = f.capture();
    let d = compare(&a, &c);
    assert!(d.is_empty(), "ran, changed nothing: {d}");
    assert!(d.scanned_pages >= (PAGES / 2) as u64, "{d}");
}

#[test]
fn forked_child_one_byte_is_one_page() {
    let mut f = Forked::spawn();
    f.send(b'n');
    let a = f.capture();
    f.send(b'p');
    f.send(b'n'); // so that the command byte on its stack is the same again
    let b = f.capture();
    let d = compare(&a, &b);
    // The flipped page; in a debug build the 'p' arm may also leave a spilled temporary in
    // a stack slot that 'n' does not overwrite: that is a real change too.
    let poked = f.data as u64 + 5 * page_size();
    let changed = changed_addresses(&a, &b);
    assert!(changed.contains(&poked), "{d} {changed:x?}");
    assert_eq!(d.changed_pages, changed.len() as u64, "{d}");
    let sp = f.sp();
    for va in changed.iter().filter(|va| **va != poked) {
        assert!(
            va.abs_diff(sp) < 16 * page_size(),
            "{va:#x} is not on the stack (sp {sp:#x}): {d}"
        );
    }
    assert_eq!((d.added_pages, d.removed_pages), (0, 0), "{d}");
    assert!(d.state_changes.is_empty(), "{d}");
    // Flipping it back restores the image.
    f.send(b'p');
    f.send(b'n');
    let c = f.capture();
    assert!(!changed_addresses(&a, &c).contains(&poked));
    assert!(compare(&b, &c).changed_pages >= 1);
}

#[test]
fn forked_child_mmap_and_munmap_are_layout_changes() {
    let mut f = Forked::spawn();
    f.send(b'n');
    let a = f.capture();
    f.send(b'm');
    f.send(b'n');
    let b = f.capture();
    let d = compare(&a, &b);
    // The 16 new pages (one touched); the pointer stored on the child's stack (and debug-build
    // spills) change its stack.
    assert_eq!(d.added_pages, 16, "{d}");
    assert_eq!(d.removed_pages, 0, "{d}");
    let sp = f.sp();
    for va in changed_addresses(&a, &b)
        .iter()
        .filter(|va| compare_is_same_layout(&a, &b, **va))
    {
        assert!(
            va.abs_diff(sp) < 16 * page_size(),
            "{va:#x} is not on the stack (sp {sp:#x}): {d}"
        );
    }
    f.send(b'u');
    f.send(b'n');
    let c = f.capture();
    let d = compare(&b, &c);
    assert_eq!((d.added_pages, d.removed_pages), (0, 16), "{d}");
}

/// The kernel writes the current CPU into each thread's rseq area when the thread runs: a
/// process that only ran on another CPU shows exactly that page changed unless the area is
/// declared volatile.
#[test]
fn rseq_area_is_written_by_the_kernel_on_migration() {
    if std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        < 2
    {
        eprintln!("needs two CPUs");
        return;
    }
    let mut f = Forked::spawn();
    let Some((rseq, _)) = f.rseq else {
        eprintln!("glibc did not register rseq");
        return;
    };
    support::pin(f.pid, 0);
    f.send(b'n');
    let (a, am) = (f.capture_unmasked(), f.capture());
    support::pin(f.pid, 1);
    f.send(b'n');
    let (b, bm) = (f.capture_unmasked(), f.capture());
    let changed = changed_addresses(&a, &b);
    let ps = page_size();
    assert_eq!(changed, vec![rseq / ps * ps], "{}", compare(&a, &b));
    assert!(compare(&am, &bm).is_empty(), "{}", compare(&am, &bm));
    // An image that masked the area against one that did not (the area was learnt between
    // the two): the bytes as read are compared. Unchanged on one CPU; after the migration the
    // page differs, as it does unmasked (a false positive, never a miss).
    assert!(compare(&a, &am).is_empty(), "{}", compare(&a, &am));
    assert!(compare(&am, &a).is_empty(), "{}", compare(&am, &a));
    // (Masked against unmasked with equal hashes: the area held only zeros, CPU 0 and node 0;
    // the bytes are then equal everywhere else and the page counts as unchanged.)
    let page = |img: &MemoryImage, va: u64| {
        img.regions
            .iter()
            .flat_map(|r| r.pages.iter())
            .find(|p| p.0 == va)
            .map(|p| p.1)
    };
    let va = rseq / ps * ps;
    let want = u64::from(page(&a, va) != page(&bm, va));
    assert_eq!(compare(&a, &bm).changed_pages, want, "{}", compare(&a, &bm));
    assert_eq!(compare(&am, &b).changed_pages, 1, "{}", compare(&am, &b));
}

#[test]
fn prot_none_pages_are_read_and_untouched_pages_are_not() {
    let f = Forked::spawn();
    let img = f.capture();
    assert_eq!(img.stats.unreadable_pages, 0);
    let hidden: Vec<&Region> = img
        .regions
        .iter()
        .filter(|r| r.perms == "---p" && !r.pages.is_empty())
        .collect();
    assert!(
        hidden.iter().any(|r| r
            .pages
            .iter()
            .any(|p| p.1 == xxh3_64(&vec![0xab; page_size() as usize]))),
        "the PROT_NONE page with data is in the image"
    );
    let data = img
        .regions
        .iter()
        .find(|r| r.start <= f.data as u64 && (f.data as u64) < r.end)
        .unwrap();
    let ps = page_size();
    let listed = data
        .pages
        .iter()
        .filter(|p| p.0 >= f.data as u64 && p.0 < f.data as u64 + PAGES as u64 * ps)
        .count();
    assert_eq!(listed, PAGES / 2, "only the pages with data are listed");
}

#[test]
fn shared_anonymous_memory_written_by_another_process() {
    let mut f = Forked::spawn();
    f.send(b'n');
    let a = f.capture();
    assert!(a
        .regions
        .iter()
        .any(|r| r.kind == RegionKind::Shmem && r.start == f.shared as u64));
    // We (another process) write into the shared mapping; the child's page tables never
    // see it, the shmem object does.
    // SAFETY: page 3 of the 16-page shared mapping `f` holds until it is dropped.
    unsafe { std::ptr::write_volatile(f.shared.add(3 * page_size() as usize), 7) };
    let b = f.capture();
    let d = compare(&a, &b);
    assert_eq!(
        (d.changed_pages, d.added_pages, d.removed_pages),
        (1, 0, 0),
        "{d}"
    );
    f.send(b'n');
}

/// The pagemap read and the `PAGEMAP_SCAN` ioctl see the same pages. The child is blocked, but
/// the kernel still reclaims, swaps and faults in its pages while the test runs (file pages of
/// the binary under memory pressure, from a loaded host): a read and a scan are compared only
/// when a second read right after shows that nothing changed in between.
#[test]
fn pagemap_fallback_agrees_with_pagemap_scan() {
    support::require_root("reads another process's pagemap (page frame numbers)");
    let f = Forked::spawn();
    let pm = File::open(format!("/proc/{}/pagemap", f.pid)).unwrap();
    let mut s = PresenceScan::new(f.pid, &pm);
    for m in procs::read_maps(f.pid).unwrap() {
        if m.path.starts_with(b"[v") {
            continue;
        }
        let mut unstable = 0;
        loop {
            let by_read = s.by_read(m.start, m.end).unwrap();
            let by_ioctl = s.by_ioctl(m.start, m.end).unwrap_or_else(|e| {
                panic!("cannot run: no PAGEMAP_SCAN ioctl here (Linux 6.7+): {e}")
            });
            if s.by_read(m.start, m.end).unwrap() == by_read {
                assert_eq!(by_read, by_ioctl, "{:x}-{:x}", m.start, m.end);
                break;
            }
            unstable += 1;
            assert!(
                unstable < 50,
                "{:x}-{:x} changed under every one of {unstable} scans",
                m.start,
                m.end
            );
        }
    }
}

#[test]
fn gone_process_is_an_error() {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    assert!(matches!(capture(pid), Err(MemError::Gone(p)) if p == pid));
}

/// A python3 interpreter reading commands from stdin, answering "ok" to each.
struct Py {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

const PY: &str = r#"
import sys
buf = bytearray(4 << 20)
for i in range(0, len(buf), 4096):
    buf[i] = 1
data = list(range(100000))
blob = bytes(range(256)) * 4096
def ok():
    sys.stdout.write("ok\n"); sys.stdout.flush()
ok()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    cmd = line.split()
    if cmd[0] == "touch":
        for i in range(int(cmd[1])):
            buf[i * 4096 + 7] = 2
    elif cmd[0] == "alloc":
        extra = bytearray(int(cmd[1]) << 20)
        for i in range(0, len(extra), 4096):
            extra[i] = 3
    elif cmd[0] == "loop":
        s = 0
        for x in data:
            s += x
    elif cmd[0] == "count":
        blob.count(b"\xff")
    ok()
"#;

impl Py {
    fn spawn() -> Py {
        let mut child = Command::new("python3")
            .args(["-c", PY])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // Not the test runner's stderr: under CI it is a log file other processes
            // append to, whose shared position would (rightly) count as a change.
            .stderr(Stdio::null())
            .spawn()
            .expect("python3");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        assert_eq!(l, "ok\n");
        let p = Py { child, out };
        wait_blocked(p.pid(), libc::SYS_read as u32);
        p
    }
    fn pid(&self) -> u32 {
        self.child.id()
    }
    fn send(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
        stdin.flush().unwrap();
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        assert_eq!(l, "ok\n");
        wait_blocked(self.pid(), libc::SYS_read as u32);
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn python_blocked_on_stdin_is_equal() {
    let py = Py::spawn();
    let a = capture(py.pid()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let b = capture(py.pid()).unwrap();
    let d = compare(&a, &b);
    assert!(d.is_empty(), "{d}");
    assert!(
        a.stats.pages_read > 1024,
        "4 MiB bytearray and the interpreter: {:?}",
        a.stats
    );
}

#[test]
fn python_modifying_a_bytearray_changes_those_pages() {
    let mut py = Py::spawn();
    let a = capture(py.pid()).unwrap();
    py.send("touch 100");
    let b = capture(py.pid()).unwrap();
    let d = compare(&a, &b);
    eprintln!("python touch 100 pages: {d}");
    // The 100 pages plus what the interpreter itself wrote (stdin buffer, frames, allocator).
    assert!(d.changed_pages >= 100 && d.changed_pages < 100 + 200, "{d}");

    py.send("alloc 8");
    let c = capture(py.pid()).unwrap();
    let d = compare(&b, &c);
    eprintln!("python alloc 8 MiB: {d}");
    assert!(d.added_pages + d.changed_pages >= 2048, "{d}");
}

#[test]
fn python_reading_only_still_writes_memory() {
    // Observed (python 3.11): a pure-Python loop over a list changes pages (the loop's ints
    // are allocated and freed: allocator free lists; frames; the readline buffer), while a
    // single C-level read of a bytes object changes a handful of interpreter pages (the
    // command line, refcounts, the evaluation stack). Only what is net-changed counts:
    // refcounts that go up and down again leave no trace.
    let mut py = Py::spawn();
    py.send("loop");
    let a = capture(py.pid()).unwrap();
    py.send("loop");
    let b = capture(py.pid()).unwrap();
    let d_loop = compare(&a, &b);
    py.send("count");
    let c = capture(py.pid()).unwrap();
    py.send("count");
    let e = capture(py.pid()).unwrap();
    let d_count = compare(&c, &e);
    eprintln!("python read-only loop twice: {d_loop}");
    eprintln!("python bytes.count twice: {d_count}");
    assert!(d_loop.changed_pages < 100, "{d_loop}");
    assert!(d_count.changed_pages < 100, "{d_count}");
}

#[test]
fn sleep_captured_twice_is_equal() {
    let mut c = Command::new("sleep")
        .arg("100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_blocked(c.id(), libc::SYS_clock_nanosleep as u32);
    let a = capture(c.id()).unwrap();
    let b = capture(c.id()).unwrap();
    let _ = c.kill();
    let _ = c.wait();
    let d = compare(&a, &b);
    assert!(d.is_empty(), "{d}");
    assert!(a.regions.iter().any(|r| r.name == "[stack]"));
    assert!(!a
        .regions
        .iter()
        .any(|r| r.name == "[vdso]" || r.name == "[vvar]"));
}

#[test]
fn different_process_is_all_change() {
    let mut c1 = Command::new("sleep")
        .arg("100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut c2 = Command::new("sleep")
        .arg("100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_blocked(c1.id(), libc::SYS_clock_nanosleep as u32);
    wait_blocked(c2.id(), libc::SYS_clock_nanosleep as u32);
    let a = capture(c1.id()).unwrap();
    let b = capture(c2.id()).unwrap();
    for c in [&mut c1, &mut c2] {
        let _ = c.kill();
        let _ = c.wait();
    }
    let d = compare(&a, &b);
    assert!(
        !d.is_empty() && d.removed_pages > 0 && d.added_pages > 0,
        "{d}"
    );
}
