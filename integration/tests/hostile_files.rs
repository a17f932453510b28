//! A container names files the shim opens as host root (issue 16, item 2): the paths in its
//! processes' `/proc/PID/maps` (a memfd is named by its creator: any string, slashes and `..`
//! included, printed as `/memfd:<name> (deleted)`) and what it plants at those names in its
//! own upperdir. Through containerd and the crab shim, a process in the sandbox maps memfds
//! shared and writable whose names lead, joined onto the upperdir, to a FIFO, a device node,
//! through symlinks to a host directory (absolute, and via `/proc/self/root`, the shim's own
//! root), and with `..` out of the upperdir. Turn ends must answer within a bound, the shim must
//! open none of those (inotify on the upperdir and on a host sentinel directory; the shim's
//! open fds sampled during every turn end), and the memfd's memory must still be compared: a
//! change to it is a process turn. The second test maps a real file shared and writable, unlinks
//! it and plants a FIFO at its printed name: that mapping cannot be armed, and the turn is
//! `full` (said as DEGRADED), never a missed change.

use std::{
    ffi::CString,
    os::unix::{ffi::OsStrExt, fs::MetadataExt},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use crab_integration::{
    host,
    sandbox::{Sandbox, SandboxOptions},
};
use serde_json::Value;

/// A turn end must answer within this (one answers in milliseconds; an open that blocks on a
/// FIFO would hang it).
const BOUND: Duration = Duration::from_secs(15);

/// The upperdir of the container whose init is `pid` (its root mount's overlay options).
fn upperdir(pid: u32) -> PathBuf {
    let mi = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    for line in mi.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields[4] != "/" || fields[sep + 1] != "overlay" {
            continue;
        }
        let opts = fields[sep + 3];
        if let Some(upper) = opts.split(',').find_map(|o| o.strip_prefix("upperdir=")) {
            return PathBuf::from(upper);
        }
    }
    panic!("no overlay root with an upperdir in /proc/{pid}/mountinfo:\n{mi}");
}

/// Opens (IN_OPEN, IN_ACCESS) of non-directories in the watched directories.
struct OpenWatch {
    fd: i32,
    dirs: Vec<(i32, PathBuf)>,
}

impl OpenWatch {
    fn new(dirs: &[&Path]) -> OpenWatch {
        // SAFETY: plain syscalls; the fd is closed on drop.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(
            fd >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        let mut w = OpenWatch {
            fd,
            dirs: Vec::new(),
        };
        for d in dirs {
            let c = CString::new(d.as_os_str().as_bytes()).unwrap();
            // SAFETY: valid fd and NUL-terminated path.
            let wd =
                unsafe { libc::inotify_add_watch(fd, c.as_ptr(), libc::IN_OPEN | libc::IN_ACCESS) };
            assert!(
                wd >= 0,
                "inotify_add_watch {}: {}",
                d.display(),
                std::io::Error::last_os_error()
            );
            w.dirs.push((wd, d.to_path_buf()));
        }
        w
    }

    /// The forbidden files opened or read since the last call.
    fn opened(&self, forbidden: &Forbidden) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return out;
            }
            let mut off = 0usize;
            while off < n as usize {
                // SAFETY: the kernel writes whole events; the header is read unaligned.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name_at = off + std::mem::size_of::<libc::inotify_event>();
                let name = &buf[name_at..name_at + ev.len as usize];
                let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
                let dir = self
                    .dirs
                    .iter()
                    .find(|d| d.0 == ev.wd)
                    .map(|d| d.1.clone())
                    .unwrap_or_default();
                let path = dir.join(std::ffi::OsStr::from_bytes(name));
                if forbidden.paths.contains(&path) {
                    out.push(path);
                }
                off = name_at + ev.len as usize;
            }
        }
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        // SAFETY: our own fd.
        unsafe { libc::close(self.fd) };
    }
}

/// Files the shim must never open: the planted nodes and the host sentinels, by path (for the
/// inotify events) and by identity (for the shim's fds: a memfd's fd reads back as the same
/// "/memfd:fifo (deleted)" as the FIFO planted at that name, so names cannot tell them apart).
#[derive(Clone)]
struct Forbidden {
    paths: Vec<PathBuf>,
    ids: Vec<(u64, u64)>,
}

impl Forbidden {
    fn new(paths: Vec<PathBuf>) -> Forbidden {
        let ids = paths
            .iter()
            .map(|p| {
                let m =
                    std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                (m.dev(), m.ino())
            })
            .collect();
        Forbidden { paths, ids }
    }
}

/// Samples the shim's open fds while a turn end runs: any that is a forbidden file is recorded
/// (an open that blocks, or one held, shows up here). [`FdSampler::start`] returns once the
/// first sample is taken, so a turn end starts with the sampler running: on a busy host a
/// thread just spawned may otherwise not run before a short turn end is over.
struct FdSampler {
    stop: Arc<AtomicBool>,
    hits: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl FdSampler {
    fn start(shim: i32, forbidden: Forbidden) -> FdSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let hits = Arc::new(Mutex::new(Vec::new()));
        let (s, h) = (stop.clone(), hits.clone());
        let (running_tx, running) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let mut samples = 0u64;
            while !s.load(Ordering::Relaxed) {
                let Ok(fds) = std::fs::read_dir(format!("/proc/{shim}/fd")) else {
                    break;
                };
                for fd in fds.flatten() {
                    // stat through the magic link: the open file itself, nothing is opened.
                    let Ok(m) = std::fs::metadata(fd.path()) else {
                        continue;
                    };
                    if forbidden.ids.contains(&(m.dev(), m.ino())) {
                        let target = std::fs::read_link(fd.path()).unwrap_or_default();
                        h.lock().unwrap().push(target.display().to_string());
                    }
                }
                samples += 1;
                if samples == 1 {
                    let _ = running_tx.send(());
                }
            }
            samples
        });
        // The first sample is taken (or the shim's fds could not be read: `finish` counts 0).
        let _ = running.recv();
        FdSampler {
            stop,
            hits,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (Vec<String>, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.thread.take().unwrap().join().unwrap();
        (std::mem::take(&mut *self.hits.lock().unwrap()), samples)
    }
}

/// Ends a turn while the shim's fds are sampled and the watches listen; checks the bound and
/// that nothing planted or on the host was opened. Returns the answer.
async fn guarded_turn_end(
    s: &Sandbox,
    shim: i32,
    watch: &OpenWatch,
    forbidden: &Forbidden,
) -> Value {
    let before = watch.opened(forbidden);
    assert!(
        before.is_empty(),
        "forbidden files opened before turn {}: {before:?}",
        s.turn
    );
    let sampler = FdSampler::start(shim, forbidden.clone());
    let started = Instant::now();
    let answer = tokio::time::timeout(BOUND, s.end_turn())
        .await
        .unwrap_or_else(|_| panic!("turn {} did not answer within {BOUND:?}", s.turn));
    let took = started.elapsed();
    let (hits, samples) = sampler.finish();
    assert!(
        hits.is_empty(),
        "the shim held planted or host files open during turn {}: {hits:?}",
        s.turn
    );
    assert!(samples > 0, "the shim's fds were never sampled");
    let opened = watch.opened(forbidden);
    assert!(
        opened.is_empty(),
        "turn {}: the shim opened files the container named: {opened:?}\n{answer:#}",
        s.turn
    );
    eprintln!(
        "turn {}: {} in {took:?} ({samples} fd samples)",
        s.turn, answer["kind"]
    );
    answer
}

/// The shim's checkpoint (layer) of the last turn is written too: nothing is opened then either.
async fn guarded_sync(s: &mut Sandbox, watch: &OpenWatch, forbidden: &Forbidden) {
    tokio::time::timeout(BOUND, s.sync())
        .await
        .expect("checkpoint within the bound");
    let opened = watch.opened(forbidden);
    assert!(
        opened.is_empty(),
        "writing the checkpoint opened files the container named: {opened:?}"
    );
}

fn memory_changed(answer: &Value, needle: &str) -> bool {
    answer["procs"]["memory"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| {
            m["cmdline"].as_str().unwrap_or_default().contains(needle)
                && m["changed_pages"].as_u64().unwrap() + m["added_pages"].as_u64().unwrap() > 0
        })
}

fn shim_of(s: &Sandbox) -> i32 {
    let shims = host::shim_processes(&s.id);
    assert_eq!(shims.len(), 1, "one shim serves {}: {shims:?}", s.id);
    shims[0].pid
}

/// Host files the container must never get the shim to open: `secret (deleted)` (a memfd's
/// printed name always ends in " (deleted)"), a FIFO, and a host directory for symlinks.
fn host_sentinel() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("crab-hostile-")
        .tempdir()
        .unwrap();
    std::fs::write(dir.path().join("secret (deleted)"), "host secret\n").unwrap();
    let fifo = CString::new(dir.path().join("fifo (deleted)").as_os_str().as_bytes()).unwrap();
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    dir
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_memfd_names_never_make_the_shim_open_anything() {
    let sentinel = host_sentinel();
    let host_dir = sentinel.path().to_str().unwrap().to_string();
    let (mut s, _g) = Sandbox::start("hostile_memfd", SandboxOptions::default()).await;
    let (_, init) = s.h.status(&s.id, "").await.unwrap();
    let upper = upperdir(init);
    let shim = shim_of(&s);
    // Enough `..` to climb from the upperdir to the host's root, whatever its depth.
    let climb = "../".repeat(upper.components().count() + 2);

    // The holder: memfds named after what the container plants, mapped shared and writable,
    // alive across turns; it stores into the first one whenever a line comes through /tmp/ctl.
    let holder = format!(
        r#"import mmap, os
names = ["fifo", "null", "last", "host/secret", "host/fifo", "proc/secret", "up/{climb}{host_dir}/secret"]
maps = []
for n in names:
    fd = os.memfd_create(n)
    os.ftruncate(fd, 1 << 16)
    m = mmap.mmap(fd, 1 << 16, mmap.MAP_SHARED)
    m[0:1] = b"x"
    maps.append(m)
open("/tmp/holder.ready", "w").close()
while True:
    with open("/tmp/ctl") as ctl:
        for line in ctl:
            i = int(line)
            maps[0][i * 4096:(i + 1) * 4096] = os.urandom(4096)
"#
    );
    s.run(&format!(
        r#"set -e
cat > /app/holder.py <<'EOF'
{holder}EOF
mkfifo /tmp/ctl
mkfifo '/memfd:fifo (deleted)'
mknod '/memfd:null (deleted)' c 1 3
ln -s '{host_dir}/secret (deleted)' '/memfd:last (deleted)'
ln -s '{host_dir}' /memfd:host
ln -s '/proc/self/root{host_dir}' /memfd:proc
mkdir /memfd:up
nohup python3 /app/holder.py >/dev/null 2>&1 &
for i in $(seq 100); do [ -e /tmp/holder.ready ] && break; sleep 0.05; done
[ -e /tmp/holder.ready ]
grep -c 'memfd:' /proc/$!/maps"#
    ))
    .await;

    // Every planted node and the whole sentinel directory are watched from here on.
    let watch = OpenWatch::new(&[&upper, sentinel.path()]);
    let mut planted: Vec<PathBuf> = std::fs::read_dir(&upper)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("memfd:")
        })
        .collect();
    assert_eq!(planted.len(), 6, "{planted:?}");
    // The directory on the `..` path is the container's own and scanned like any other.
    planted.retain(|p| !std::fs::symlink_metadata(p).unwrap().is_dir());
    planted.extend(["secret (deleted)", "fifo (deleted)"].map(|n| sentinel.path().join(n)));
    let forbidden = Forbidden::new(planted);

    // Turn 1: the planted names and the holder: files and a process.
    let a = guarded_turn_end(&s, shim, &watch, &forbidden).await;
    assert_eq!(a["kind"], "full", "{a:#}");
    assert!(
        a["degraded"].as_array().unwrap().is_empty(),
        "memfds are no files to arm: {a:#}"
    );
    let added: Vec<&str> = a["fs"]["added"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for p in [
        "/memfd:fifo (deleted)",
        "/memfd:null (deleted)",
        "/memfd:host",
        "/memfd:up",
    ] {
        assert!(added.contains(&p), "{p} not seen as added: {a:#}");
    }
    assert!(
        a["procs"]["started"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["cmdline"].as_str().unwrap().contains("holder.py")),
        "{a:#}"
    );
    guarded_sync(&mut s, &watch, &forbidden).await;

    // Turn 2: the holder writes into its memfd. The memory is read through map_files (the memfd
    // itself), not through the names: a process turn, with the holder's pages changed.
    s.run("echo 3 > /tmp/ctl; sleep 0.5").await;
    let a = guarded_turn_end(&s, shim, &watch, &forbidden).await;
    assert!(matches!(a["kind"].as_str(), Some("proc" | "full")), "{a:#}");
    assert!(
        memory_changed(&a, "holder.py"),
        "the memfd store was missed: {a:#}"
    );
    assert!(a["degraded"].as_array().unwrap().is_empty(), "{a:#}");
    guarded_sync(&mut s, &watch, &forbidden).await;

    // Turn 3: nothing happens; the arming pass runs again (a shared writable mapping exists)
    // and opens nothing; the memfds are compared and unchanged.
    s.run("true").await;
    let a = guarded_turn_end(&s, shim, &watch, &forbidden).await;
    assert!(a["degraded"].as_array().unwrap().is_empty(), "{a:#}");

    // The planted nodes are still there, untouched (the FIFO was never opened by anyone).
    assert!(std::fs::symlink_metadata(upper.join("memfd:fifo (deleted)")).is_ok());
    assert_eq!(
        std::fs::read_to_string(sentinel.path().join("secret (deleted)")).unwrap(),
        "host secret\n"
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mapped_file_whose_name_leads_elsewhere_makes_the_turn_full() {
    let (mut s, _g) = Sandbox::start("hostile_unlinked", SandboxOptions::default()).await;
    let (_, init) = s.h.status(&s.id, "").await.unwrap();
    let upper = upperdir(init);
    let shim = shim_of(&s);
    // A real file in the rootfs, mapped shared and writable, then unlinked; a FIFO takes its
    // printed name "/app/data (deleted)".
    s.run(
        r#"set -e
cat > /app/mapper.py <<'EOF'
import mmap, os
with open("/app/data", "wb") as f:
    f.write(b"\0" * 65536)
f = open("/app/data", "r+b")
m = mmap.mmap(f.fileno(), 65536, mmap.MAP_SHARED)
os.unlink("/app/data")
os.mkfifo("/app/data (deleted)")
open("/tmp/mapper.ready", "w").close()
while True:
    with open("/tmp/ctl") as ctl:
        for line in ctl:
            m[int(line)] = 1
EOF
mkfifo /tmp/ctl
nohup python3 /app/mapper.py >/dev/null 2>&1 &
for i in $(seq 100); do [ -e /tmp/mapper.ready ] && break; sleep 0.05; done
[ -e /tmp/mapper.ready ]"#,
    )
    .await;
    let watch = OpenWatch::new(&[&upper.join("app")]);
    let forbidden = Forbidden::new(vec![upper.join("app/data (deleted)")]);
    for turn in 0..2 {
        if turn == 1 {
            s.run("echo 5 > /tmp/ctl; sleep 0.3").await;
        }
        let a = guarded_turn_end(&s, shim, &watch, &forbidden).await;
        assert_eq!(a["kind"], "full", "turn {turn}: {a:#}");
        let degraded: Vec<&str> = a["degraded"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            degraded
                .iter()
                .any(|d| d.contains("/app/data (deleted)") && d.contains("no longer leads to it")),
            "turn {turn}: the unarmable mapping must be said: {a:#}"
        );
        guarded_sync(&mut s, &watch, &forbidden).await;
    }
    s.finish().await;
}
