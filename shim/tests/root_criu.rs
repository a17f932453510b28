//! Process checkpoints of real containers: runc and CRIU run containers built by hand from
//! busybox-static (and a helper compiled with gcc), which are checkpointed, deduplicated and
//! restored. Needs root, runc, CRIU, busybox-static, gcc and iproute2; fails without (see
//! `support`).

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Mutex, Once},
    time::{Duration, Instant},
};

use crab_shim::checkpoint::pages;
use crab_shim::checkpoint::process::testing::{boot_ticks, verify_image};
use crab_shim::checkpoint::process::{
    check_dumpable, checkpoint, read_pstree, work_dir, Dumper, ProcError,
};
use crab_shim::inspector::procs::{self, ProcInfo};
use crab_shim::runc::{CheckpointOpts, OciRuntime as _, Runc};
use crab_shim::{reaper, sys::cgroup::Cgroups};

/// Unit tests have no shim reaper: this thread stands in for it, for runc and CRIU only. It
/// reaps exited children of this process named runc or criu (everything else the tests spawn
/// is waited for by std) and publishes their exits on the shim's monitor, which [`reaper::run`] waits on.
fn start_runc_reaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            loop {
                for pid in zombie_runc_children() {
                    let mut status = 0;
                    // SAFETY: waiting for a child of ours that is known to be a zombie.
                    if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                        let code = if libc::WIFEXITED(status) {
                            libc::WEXITSTATUS(status)
                        } else {
                            128 + libc::WTERMSIG(status)
                        };
                        rt.block_on(
                            containerd_shim::asynchronous::monitor::monitor_notify_by_pid(
                                pid, code,
                            ),
                        )
                        .unwrap();
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
    });
}

/// Removes what a killed earlier run of these tests left: the containers' processes and
/// cgroups (`crab-proc-<name>-<pid>` at the root of each hierarchy, pid no longer alive)
/// and their network namespaces. Only names of this exact form are touched.
fn sweep_stale() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let stale = |name: &str| {
            let rest = name.strip_prefix("crab-proc-")?;
            let pid: u32 = rest.rsplit('-').next()?.parse().ok()?;
            (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
        };
        let roots = crab_shim::sys::cgroup::hierarchy_mount_points(
            &crab_shim::sys::mountinfo::read_self().unwrap(),
        );
        for root in roots {
            for e in fs::read_dir(&root).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if stale(&name).is_none() || !e.path().is_dir() {
                    continue;
                }
                eprintln!("removing stale test cgroup {}", e.path().display());
                // A dump killed midway can leave it frozen, and frozen tasks do not die.
                let _ = fs::write(e.path().join("freezer.state"), "THAWED");
                let _ = fs::write(e.path().join("cgroup.freeze"), "0");
                for _ in 0..100 {
                    let procs =
                        fs::read_to_string(e.path().join("cgroup.procs")).unwrap_or_default();
                    if procs.trim().is_empty() {
                        break;
                    }
                    for pid in procs
                        .split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok())
                    {
                        // SAFETY: plain syscall.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = fs::remove_dir(e.path());
            }
        }
        for e in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if stale(&name).is_some() {
                let _ = Command::new("ip").args(["netns", "delete", &name]).status();
            }
        }
    });
}

fn zombie_runc_children() -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let children = fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for pid in children
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
        {
            if let Ok(Some(st)) = procs::read_stat(pid) {
                if st.state == 'Z' && (st.comm.starts_with("runc") || st.comm.starts_with("criu")) {
                    out.push(pid as i32);
                }
            }
        }
    }
    out
}

fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The test helper program: `mem MB` keeps MB of distinct pages resident and, per SIGUSR1,
/// rewrites 1% of them (scattered) and reports the turn in /state; `lock FILE` holds a
/// flock and a POSIX lock on FILE.
const HELPER_C: &str = r#"
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>
static volatile sig_atomic_t go;
static void on_usr1(int s) { (void)s; go = 1; }
static unsigned long long x = 88172645463325252ULL;
static unsigned long long rnd(void) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; }
static void fill(char *p, size_t n) { for (size_t i = 0; i + 8 <= n; i += 8) { unsigned long long r = rnd(); memcpy(p + i, &r, 8); } }
static void report(const char *s) {
    int fd = open("/state.tmp", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, s, strlen(s)) < 0) _exit(3);
    close(fd);
    rename("/state.tmp", "/state");
}
int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "lock")) {
        int fd = open(argv[2], O_RDWR | O_CREAT, 0644);
        struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1 };
        if (fd < 0 || flock(fd, LOCK_EX) || fcntl(fd, F_SETLK, &fl)) return 2;
        report("locked");
        for (;;) pause();
    }
    if (argc != 3 || strcmp(argv[1], "mem")) return 1;
    size_t pages = (size_t)atol(argv[2]) * 256;
    char *buf = mmap(0, pages * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return 2;
    fill(buf, pages * 4096);
    struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = on_usr1; sigaction(SIGUSR1, &sa, 0);
    sigset_t block, old; sigemptyset(&block); sigaddset(&block, SIGUSR1); sigprocmask(SIG_BLOCK, &block, &old);
    long turn = 0; char msg[32];
    report("0");
    for (;;) {
        while (!go) sigsuspend(&old);
        go = 0; turn++;
        size_t start = rnd() % pages;
        /* 97 is prime and does not divide pages: 1% distinct pages spread over the buffer. */
        for (size_t j = 0; j < pages / 100; j++) fill(buf + ((start + j * 97) % pages) * 4096, 64);
        snprintf(msg, sizeof msg, "%ld", turn);
        report(msg);
    }
}
"#;

/// A runc state root, a busybox bundle and the containers made from it; everything is
/// deleted on drop, also when a test fails.
struct Sandbox {
    tmp: tempfile::TempDir,
    bundle: PathBuf,
    runc: Runc,
    base: String,
    containers: Mutex<Vec<String>>,
    netns: Option<String>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("iproute2 is installed");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Sandbox {
    /// `helper`: compile the test helper into the rootfs; `netns`: run in a network
    /// namespace made beforehand (loopback up), as CNI would.
    async fn new(name: &str, args: &[&str], helper: bool, netns: bool) -> Sandbox {
        support::require_root("runs containers with runc and CRIU");
        for program in ["runc", "criu"] {
            support::require_program(program);
        }
        if helper {
            support::require_program("gcc");
        }
        if netns {
            support::require_program("ip");
        }
        start_runc_reaper();
        sweep_stale();
        let tmp = tempfile::tempdir().unwrap();
        let bundle = tmp.path().join("bundle");
        let rootfs = bundle.join("rootfs");
        for d in ["bin", "proc", "dev", "sys", "tmp"] {
            fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static is installed");
        for applet in ["sh", "sleep", "nc", "httpd", "wget", "cat", "kill"] {
            symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        if helper {
            let src = tmp.path().join("helper.c");
            fs::write(&src, HELPER_C).unwrap();
            let out = Command::new("gcc")
                .args(["-static", "-O2", "-o"])
                .arg(rootfs.join("bin/helper"))
                .arg(&src)
                .output()
                .expect("gcc is installed");
            assert!(
                out.status.success(),
                "gcc -static: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let base = format!("crab-proc-{name}-{}", std::process::id());
        let runc = Runc {
            binary: "runc".into(),
            root: tmp.path().join("runc"),
            systemd_cgroup: false,
            log: tmp.path().join("runc.log"),
            no_pivot_root: false,
            no_new_keyring: false,
            io_owner: None,
            merge_memory: false,
        };
        let sb = Sandbox {
            tmp,
            bundle,
            runc,
            base,
            containers: Mutex::new(Vec::new()),
            netns: None,
        };
        let mut sb = sb;
        if netns {
            ip(&["netns", "add", &sb.base]);
            sb.netns = Some(sb.base.clone());
            ip(&["-n", &sb.base, "link", "set", "lo", "up"]);
        }
        sb.raw(&["spec", "--bundle"], &[sb.bundle.as_os_str()])
            .await;
        let path = sb.bundle.join("config.json");
        let mut spec: serde_json::Value =
            serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        spec["process"]["terminal"] = false.into();
        spec["process"]["args"] = args.into();
        spec["root"]["readonly"] = false.into();
        spec["linux"]["cgroupsPath"] = format!("/{}", sb.base).into();
        if let Some(ns) = &sb.netns {
            for n in spec["linux"]["namespaces"].as_array_mut().unwrap() {
                if n["type"] == "network" {
                    n["path"] = format!("/run/netns/{ns}").into();
                }
            }
        }
        fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        sb
    }

    fn path(&self, p: &str) -> PathBuf {
        self.tmp.path().join(p)
    }

    fn rootfs(&self, p: &str) -> PathBuf {
        self.bundle.join("rootfs").join(p)
    }

    fn runc_cmd(&self, args: &[&str], extra: &[&std::ffi::OsStr]) -> Command {
        let mut cmd = Command::new(&self.runc.binary);
        cmd.arg("--root")
            .arg(&self.runc.root)
            .arg("--log")
            .arg(&self.runc.log)
            .arg("--log-format")
            .arg("json");
        cmd.args(args).args(extra);
        cmd
    }

    /// A short runc command; panics with its output on failure.
    async fn raw(&self, args: &[&str], extra: &[&std::ffi::OsStr]) -> String {
        let out = reaper::run(self.runc_cmd(args, extra), true).await.unwrap();
        assert_eq!(
            out.code,
            0,
            "runc {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A runc command whose child outlives it (run -d, exec -d, restore -d): its stdio must
    /// not be a pipe we wait on. Returns the pid from its pid file.
    async fn detached(&self, args: &[&str], id: &str, process_args: &[&str]) -> u32 {
        let pid_file = self.path(&format!("{id}-{}.pid", args[0]));
        let _ = fs::remove_file(&pid_file);
        let mut cmd = self.runc_cmd(args, &[]);
        cmd.arg("--pid-file").arg(&pid_file);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if args[0] != "exec" {
            self.containers.lock().unwrap().push(id.to_string());
        }
        cmd.arg(id).args(process_args);
        let out = reaper::run(cmd, false).await.unwrap();
        assert_eq!(
            out.code,
            0,
            "runc {args:?} {id}: {}",
            fs::read_to_string(&self.runc.log).unwrap_or_default()
        );
        fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Starts the bundle as container `<base>-<suffix>`; returns (id, init pid, cgroup dir).
    async fn run(&self, suffix: &str) -> (String, u32, PathBuf) {
        let id = format!("{}-{suffix}", self.base);
        let b = self.bundle.to_string_lossy().into_owned();
        let init = self
            .detached(&["run", "-d", "--bundle", &b], &id, &[])
            .await;
        (id, init, cgroup_of(init))
    }

    async fn restore(&self, image: &Path, suffix: &str) -> (String, u32, PathBuf) {
        let id = format!("{}-{suffix}", self.base);
        let work = self.path(&format!("restore-{suffix}"));
        let (b, i, w) = (
            self.bundle.to_string_lossy().into_owned(),
            image.to_string_lossy().into_owned(),
            work.to_string_lossy().into_owned(),
        );
        let args = [
            "restore",
            "-d",
            "--bundle",
            &b,
            "--image-path",
            &i,
            "--work-path",
            &w,
            "--tcp-established",
            "--file-locks",
            "--ext-unix-sk",
        ];
        let init = self.detached(&args, &id, &[]).await;
        (id, init, cgroup_of(init))
    }

    async fn delete(&self, id: &str) {
        self.raw(&["delete", "--force", id], &[]).await;
        self.containers.lock().unwrap().retain(|c| c != id);
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut *self.containers.lock().unwrap());
        let runc = self.runc.clone();
        // Our own runtime on our own thread: drop may run while a test's runtime unwinds.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            for id in ids {
                if let Err(e) = rt.block_on(runc.delete(&id, true)) {
                    eprintln!("cleanup: runc delete {id}: {e}");
                }
            }
        })
        .join()
        .unwrap();
        if let Some(ns) = &self.netns {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
    }
}

/// The direct CRIU driver, with `criu` from `PATH`.
fn criu() -> Dumper {
    Dumper::Criu {
        binary: "criu".into(),
    }
}

/// A short name of the driver, for container names.
fn tag(d: &Dumper) -> &'static str {
    match d {
        Dumper::Runc => "runc",
        Dumper::Criu { .. } => "criu",
    }
}

fn cgroup_of(pid: u32) -> PathBuf {
    let c = Cgroups::of(pid).unwrap();
    c.unified
        .clone()
        .or_else(|| c.v1("pids").cloned())
        .expect("a cgroup directory")
}

fn live(cgroup: &Path) -> Vec<ProcInfo> {
    procs::list(cgroup).unwrap()
}

/// The processes of `cgroup` once they are exactly those running `cmdlines` (in any order). A
/// count alone is not enough: a process forked but not yet exec'ed (slow under load) counts
/// with its parent's command line, and so would every comparison made with it.
fn wait_procs(cgroup: &Path, cmdlines: &[&str]) -> Vec<ProcInfo> {
    let mut want: Vec<String> = cmdlines.iter().map(|c| c.to_string()).collect();
    want.sort();
    wait_until(
        &format!("processes {want:?} in {}", cgroup.display()),
        Duration::from_secs(10),
        || {
            let l = live(cgroup);
            (self::cmdlines(&l) == want).then_some(l)
        },
    )
}

fn pages_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("pages-") && n.ends_with(".img"))
        .map(|n| (n.clone(), fs::read(dir.join(&n)).unwrap()))
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn cmdline_of(p: &ProcInfo) -> String {
    if p.cmdline.is_empty() {
        format!("[{}]", p.comm)
    } else {
        p.cmdline.join(" ")
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: plain syscall.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0, "kill {pid}");
}

fn cmdlines(l: &[ProcInfo]) -> Vec<String> {
    let mut v: Vec<String> = l.iter().map(cmdline_of).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_child_is_dumped_pages_round_trip_and_image_restores_criu() {
    background_child_is_dumped_pages_round_trip_and_image_restores(criu()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_child_is_dumped_pages_round_trip_and_image_restores_runc() {
    background_child_is_dumped_pages_round_trip_and_image_restores(Dumper::Runc).await
}

async fn background_child_is_dumped_pages_round_trip_and_image_restores(d: Dumper) {
    let sb = Sandbox::new(
        &format!("bg-{}", tag(&d)),
        &["sh", "-c", "sleep 100000 & wait"],
        false,
        false,
    )
    .await;
    let (id, init, cg) = sb.run("a").await;
    let before = wait_procs(&cg, &["sh -c sleep 100000 & wait", "sleep 100000"]);
    let expected: Vec<u32> = before.iter().map(|p| p.pid).collect();
    assert_eq!(check_dumpable(init, &cg).unwrap(), expected);

    // A plain dump, deduplicated and materialized again: byte-identical pages files.
    let raw = sb.path("raw");
    let opts = CheckpointOpts {
        image_path: raw.clone(),
        work_path: Some(sb.path("raw.work")),
        leave_running: true,
        ..Default::default()
    };
    sb.runc.checkpoint(&id, &opts).await.unwrap();
    let chunks = sb.path("chunks");
    let copy = sb.path("copy");
    copy_dir(&raw, &copy);
    let originals = pages_files(&raw);
    assert!(!originals.is_empty());
    let stats = pages::dedup(&copy, &chunks).unwrap();
    assert!(pages_files(&copy).is_empty());
    assert_eq!(
        stats.bytes_logical,
        originals.values().map(|d| d.len() as u64).sum::<u64>()
    );
    assert_eq!(
        pages::materialize(&copy, &chunks).unwrap(),
        stats.bytes_logical
    );
    assert_eq!(
        pages_files(&copy),
        originals,
        "materialized pages files differ from CRIU's"
    );

    // crab's checkpoint.
    let dir = sb.path("proc/000001");
    let cp = checkpoint(&sb.runc, &d, &id, init, &cg, &dir, &chunks, None)
        .await
        .unwrap();
    assert_eq!(cp.pids, expected);
    assert!(pages_files(&dir).is_empty() && cp.dedup.files > 0);
    assert!(cp.bytes_stored < cp.bytes_logical, "{cp:?}");
    assert!(!work_dir(&dir).exists());
    let tree = read_pstree(&dir).unwrap();
    assert_eq!(tree.len(), 2);
    assert_eq!((tree[0].pid, tree[0].ppid, tree[1].ppid), (1, 0, 1));
    eprintln!(
        "simple container: {} processes, logical {} B, stored {} B (chunks reused from the raw dump: {} of {}), dump {:?}, total {:?}",
        cp.pids.len(), cp.bytes_logical, cp.bytes_stored, cp.dedup.chunks - cp.dedup.chunks_new, cp.dedup.chunks, cp.dump, cp.duration
    );

    // The image is good: restore it (after the original is gone) from materialized pages.
    sb.delete(&id).await;
    pages::materialize(&dir, &chunks).unwrap();
    let (_rid, rinit, rcg) = sb.restore(&dir, "r").await;
    let after = wait_procs(&rcg, &["sh -c sleep 100000 & wait", "sleep 100000"]);
    assert_eq!(cmdlines(&after), cmdlines(&before));
    assert!(after.iter().any(|p| p.pid == rinit));
    // The restored tree is dumpable again.
    assert_eq!(check_dumpable(rinit, &rcg).unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_exec_is_refused_and_runc_alone_would_miss_it_criu() {
    running_exec_is_refused_and_runc_alone_would_miss_it(criu()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_exec_is_refused_and_runc_alone_would_miss_it_runc() {
    running_exec_is_refused_and_runc_alone_would_miss_it(Dumper::Runc).await
}

async fn running_exec_is_refused_and_runc_alone_would_miss_it(d: Dumper) {
    let sb = Sandbox::new(
        &format!("exec-{}", tag(&d)),
        &["sleep", "100000"],
        false,
        false,
    )
    .await;
    let (id, init, cg) = sb.run("a").await;
    wait_procs(&cg, &["sleep 100000"]);
    let exec_pid = sb.detached(&["exec", "-d"], &id, &["sleep", "5555"]).await;
    wait_procs(&cg, &["sleep 100000", "sleep 5555"]);

    let err = check_dumpable(init, &cg).unwrap_err();
    eprintln!("check_dumpable: {err}");
    match &err {
        ProcError::Undumpable {
            init: i,
            pids,
            cmdlines,
        } => {
            assert_eq!(
                (*i, pids.as_slice(), cmdlines.as_slice()),
                (init, &[exec_pid][..], &["sleep 5555".to_string()][..])
            );
        }
        e => panic!("unexpected {e}"),
    }
    let chunks = sb.path("chunks");
    let dir = sb.path("proc/000001");
    let err = checkpoint(&sb.runc, &d, &id, init, &cg, &dir, &chunks, None)
        .await
        .unwrap_err();
    assert!(matches!(err, ProcError::Undumpable { .. }), "{err}");
    assert!(!dir.exists());

    // DESIGN's claim: runc alone reports success and its image lacks the exec.
    let raw = sb.path("raw");
    let opts = CheckpointOpts {
        image_path: raw.clone(),
        work_path: Some(sb.path("raw.work")),
        leave_running: true,
        ..Default::default()
    };
    sb.runc
        .checkpoint(&id, &opts)
        .await
        .expect("runc checkpoint succeeds despite the exec");
    let tree = read_pstree(&raw).unwrap();
    assert_eq!(tree.len(), 1, "image: {tree:?}");
    let log = fs::read_to_string(sb.path("raw.work/dump.log")).unwrap();
    assert!(
        log.contains(&format!("Unexpected process {exec_pid}")),
        "CRIU only warns"
    );
    eprintln!(
        "runc checkpoint with a running exec: success, {} process in the image, 2 live",
        tree.len()
    );
    // The check after the dump catches it too (a process that appeared after check_dumpable).
    let err = verify_image(init, &cg, &raw, boot_ticks()).unwrap_err();
    assert!(
        matches!(&err, ProcError::Incomplete { pids, .. } if *pids == [exec_pid]),
        "{err}"
    );

    // An exec that leaves a background process behind and exits: it is re-parented to
    // init and dumped; once the running exec ends, the container is dumpable.
    sb.detached(
        &["exec", "-d"],
        &id,
        &["sh", "-c", "sleep 7777 >/dev/null 2>&1 </dev/null &"],
    )
    .await;
    signal(exec_pid, libc::SIGKILL);
    let l = wait_until(
        "the exec's sleep 5555 gone, sleep 7777 there",
        Duration::from_secs(10),
        || {
            let l = live(&cg);
            (cmdlines(&l) == ["sleep 100000", "sleep 7777"]).then_some(l)
        },
    );
    let left = l.iter().find(|p| p.cmdline == ["sleep", "7777"]).unwrap();
    assert_eq!(left.ppid, init);
    let cp = checkpoint(&sb.runc, &d, &id, init, &cg, &dir, &chunks, None)
        .await
        .unwrap();
    assert_eq!(cp.pids, l.iter().map(|p| p.pid).collect::<Vec<_>>());
    assert_eq!(read_pstree(&dir).unwrap().len(), 2);
}

/// `(local port, state)` of the TCP sockets in `pid`'s network namespace (state in hex as
/// the kernel prints it: 0A listening, 01 established).
fn tcp_sockets(pid: u32) -> Vec<(u16, String)> {
    let text = ["tcp", "tcp6"]
        .map(|f| fs::read_to_string(format!("/proc/{pid}/net/{f}")).unwrap_or_default())
        .join("\n");
    let mut v: Vec<(u16, String)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
            Some((port, f.get(3)?.to_string()))
        })
        .collect();
    v.sort();
    v
}

/// Kinds of the locks (FLOCK, POSIX) held by processes of `cgroup`.
fn locks_held(cgroup: &Path) -> Vec<String> {
    let pids: BTreeSet<String> = live(cgroup).iter().map(|p| p.pid.to_string()).collect();
    let mut v: Vec<String> = fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(4)
                .is_some_and(|p| pids.contains(p))
        })
        .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
        .collect();
    v.sort();
    v
}

/// (major, minor) of the first `N.N` in `text`.
fn version(text: &str) -> (u32, u32) {
    let v = text
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .find(|w| w.contains('.'))
        .unwrap_or("0.0");
    let mut it = v.split('.').map(|n| n.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_locks_survive_restore_criu() {
    file_locks_survive_restore(criu()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_locks_survive_restore_runc() {
    file_locks_survive_restore(Dumper::Runc).await
}

async fn file_locks_survive_restore(d: Dumper) {
    let sb = Sandbox::new(
        &format!("lock-{}", tag(&d)),
        &["sh", "-c", "helper lock /tmp/lock & wait"],
        true,
        false,
    )
    .await;
    let (id, init, cg) = sb.run("a").await;
    let before = wait_until("the locks", Duration::from_secs(10), || {
        (locks_held(&cg) == ["FLOCK", "POSIX"]
            && fs::read_to_string(sb.rootfs("state")).ok()? == "locked")
            .then(|| live(&cg))
    });
    let chunks = sb.path("chunks");
    let dir = sb.path("proc/000001");
    let cp = checkpoint(&sb.runc, &d, &id, init, &cg, &dir, &chunks, None)
        .await
        .unwrap();
    assert_eq!(cp.pids, before.iter().map(|p| p.pid).collect::<Vec<_>>());
    sb.delete(&id).await;
    pages::materialize(&dir, &chunks).unwrap();
    let (_rid, _rinit, rcg) = sb.restore(&dir, "r").await;
    let after = wait_until("the restored locks", Duration::from_secs(10), || {
        (locks_held(&rcg) == ["FLOCK", "POSIX"]).then(|| live(&rcg))
    });
    assert_eq!(cmdlines(&after), cmdlines(&before));
}

/// A listening socket and an established connection, in a network namespace that exists
/// before the container (as CNI makes them; runc does not manage network devices, so in
/// a namespace of its own loopback would come back down and connections could not be
/// restored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_listener_and_connection_survive_restore_criu() {
    tcp_listener_and_connection_survive_restore(criu()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_listener_and_connection_survive_restore_runc() {
    tcp_listener_and_connection_survive_restore(Dumper::Runc).await
}

async fn tcp_listener_and_connection_survive_restore(d: Dumper) {
    let script = "httpd -f -p 8080 & (sleep 100000 | nc -l -p 9000 >/dev/null) & \
                  sleep 0.3; (sleep 100000 | nc 127.0.0.1 9000 >/dev/null) & wait";
    let sb = Sandbox::new(
        &format!("tcp-{}", tag(&d)),
        &["sh", "-c", script],
        false,
        true,
    )
    .await;
    let (id, init, cg) = sb.run("a").await;
    // httpd listens; busybox nc -l stops listening once it accepted its connection; the
    // connecting nc's ephemeral port is the second established socket.
    let ready = |pid: u32| {
        let s = tcp_sockets(pid);
        s.contains(&(8080, "0A".into()))
            && s.contains(&(9000, "01".into()))
            && s.iter().filter(|(_, st)| st == "01").count() == 2
    };
    let before = wait_until(
        "a listener and a connection",
        Duration::from_secs(10),
        || ready(init).then(|| live(&cg)),
    );
    let chunks = sb.path("chunks");
    let dir = sb.path("proc/000001");
    // Through the stand-in reaper, which reaps every child named criu.
    let criu = reaper::run(
        {
            let mut c = Command::new("criu");
            c.arg("--version");
            c
        },
        true,
    )
    .await
    .expect("criu is installed");
    let criu = version(&String::from_utf8_lossy(&criu.stdout));
    let kernel = version(
        &nix::sys::utsname::uname()
            .unwrap()
            .release()
            .to_string_lossy(),
    );
    let result = checkpoint(&sb.runc, &d, &id, init, &cg, &dir, &chunks, None).await;
    if criu < (4, 2) && kernel >= (6, 16) {
        let err = result.unwrap_err();
        assert!(
            matches!(err, ProcError::Dump { hint: Some(_), .. }),
            "{err}"
        );
        eprintln!("LIMITATION: CRIU {criu:?} on Linux {kernel:?} cannot dump TCP sockets; crab says: {err}");
        return;
    }
    let cp = result.unwrap();
    assert_eq!(cp.pids, before.iter().map(|p| p.pid).collect::<Vec<_>>());
    sb.delete(&id).await;
    pages::materialize(&dir, &chunks).unwrap();
    let (rid, rinit, rcg) = sb.restore(&dir, "r").await;
    let after = wait_until(
        "the restored listener and connection",
        Duration::from_secs(10),
        || ready(rinit).then(|| live(&rcg)),
    );
    assert_eq!(cmdlines(&after), cmdlines(&before));
    // The restored httpd serves.
    let out = reaper::run(
        sb.runc_cmd(
            &[
                "exec",
                &rid,
                "wget",
                "-S",
                "-O",
                "/dev/null",
                "http://127.0.0.1:8080/",
            ],
            &[],
        ),
        true,
    )
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("HTTP/1."), "wget: {text}");
}

async fn wait_turn(sb: &Sandbox, turn: u32) {
    let state = sb.rootfs("state");
    wait_until(&format!("turn {turn}"), Duration::from_secs(30), || {
        (fs::read_to_string(&state).ok()?.trim() == turn.to_string()).then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_checkpoints_store_only_changed_pages_criu() {
    repeated_checkpoints_store_only_changed_pages(criu()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_checkpoints_store_only_changed_pages_runc() {
    repeated_checkpoints_store_only_changed_pages(Dumper::Runc).await
}

async fn repeated_checkpoints_store_only_changed_pages(d: Dumper) {
    let sb = Sandbox::new(
        &format!("dedup-{}", tag(&d)),
        &["helper", "mem", "50"],
        true,
        false,
    )
    .await;
    let (id, init, cg) = sb.run("a").await;
    wait_turn(&sb, 0).await;
    let chunks = sb.path("chunks");
    eprintln!("turn  logical_B   stored_B  stored/logical  new_chunks  dump      total");
    let mut last = PathBuf::new();
    for turn in 0..10u32 {
        if turn > 0 {
            signal(init, libc::SIGUSR1);
            wait_turn(&sb, turn).await;
        }
        let dir = sb.path(&format!("proc/{turn:06}"));
        let cp = checkpoint(&sb.runc, &d, &id, init, &cg, &dir, &chunks, None)
            .await
            .unwrap();
        let ratio = cp.bytes_stored as f64 / cp.bytes_logical as f64;
        eprintln!(
            "{turn:>4}  {:>9}  {:>9}  {:>13.2}%  {:>10}  {:>7.0?}  {:>7.0?}",
            cp.bytes_logical,
            cp.bytes_stored,
            ratio * 100.0,
            cp.dedup.chunks_new,
            cp.dump,
            cp.duration
        );
        eprintln!("      {:?}", cp.timings);
        assert!(cp.bytes_logical > 50 << 20);
        if turn > 0 {
            assert!(
                ratio <= 0.05,
                "turn {turn}: stored {:.2}% of a full image",
                ratio * 100.0
            );
        }
        last = dir;
    }
    // The last image restores, and the restored process takes another turn.
    sb.delete(&id).await;
    pages::materialize(&last, &chunks).unwrap();
    let (_rid, rinit, _rcg) = sb.restore(&last, "r").await;
    signal(rinit, libc::SIGUSR1);
    wait_turn(&sb, 10).await;
}

/// CRIU's gate (`restore::gate`), through real runc and CRIU: a restore stops at post-restore
/// with every process restored and none of them running (a loop that appends to a file every
/// 20 ms appends nothing while held), a refusal makes the restore fail with nothing left
/// running; past it, the kernel check (`restore::kernel`) runs at pre-resume against the
/// bundle's own spec and lets the same image restore and run, and against a spec that grants
/// no capability refuses it: the stopped tree and CRIU are killed and runc fails at once
/// (before, CRIU waited forever for the killed init), nothing of it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restore_gate_holds_every_process_until_the_verdict() {
    use crab_shim::restore::{
        gate::{Gate, Resumed, GATE_DIR},
        kernel,
    };
    let sb = Sandbox::new(
        "gate",
        &[
            "sh",
            "-c",
            "while true; do echo x >> /tmp/beat; sleep 0.02; done",
        ],
        false,
        false,
    )
    .await;
    let (id, _init, cg) = sb.run("a").await;
    let beat = sb.rootfs("tmp/beat");
    let len = || fs::metadata(&beat).map(|m| m.len()).unwrap_or(0);
    wait_until("the loop to beat", Duration::from_secs(10), || {
        (len() > 0).then_some(())
    });
    let image = sb.path("image");
    let opts = CheckpointOpts {
        image_path: image.clone(),
        work_path: Some(sb.path("image.work")),
        ..Default::default()
    };
    sb.runc.checkpoint(&id, &opts).await.unwrap();
    assert!(
        !cg.exists() || live(&cg).is_empty(),
        "the dump ended the container"
    );
    sb.delete(&id).await;

    let spec: oci_spec::runtime::Spec =
        serde_json::from_slice(&fs::read(sb.bundle.join("config.json")).unwrap()).unwrap();
    let own = kernel::Expected::from_spec(&spec);
    let mut strict = own.clone();
    strict.granted.bounding = 0;
    strict.granted.permitted = 0;
    strict.granted.effective = 0;
    for (n, ok, expected) in [
        (1, false, None),
        (2, true, Some(own)),
        (3, true, Some(strict)),
    ] {
        let refuse = expected.as_ref().is_some_and(|e| e.granted.bounding == 0);
        let gate = Gate::install(&sb.bundle, None).unwrap();
        let opener = gate.opener().unwrap();
        let (resume, cancel) = gate.resume().unwrap();
        let checked = std::thread::spawn(move || {
            resume.wait(|script, init| match &expected {
                Some(e) => kernel::check_restored(e, script, init),
                None => Err(kernel::Refusal("no kernel check here".into()).into()),
            })
        });
        let rid = format!("{}-r{n}", sb.base);
        let work = sb.path(&format!("restore-{n}"));
        let pid_file = sb.path(&format!("restore-{n}.pid"));
        let mut cmd = sb.runc_cmd(&["restore", "-d", "--bundle"], &[sb.bundle.as_os_str()]);
        cmd.arg("--image-path")
            .arg(&image)
            .arg("--work-path")
            .arg(&work)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg(&rid)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        sb.containers.lock().unwrap().push(rid.clone());
        let restore = tokio::spawn(async move { reaper::run(cmd, false).await.unwrap().code });
        // CRIU reaches the gate; the restored loop does not run while it waits there.
        wait_until("CRIU to reach the gate", Duration::from_secs(30), || {
            gate.reached()
        });
        let held = len();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(len(), held, "a restored process ran before the verdict");
        assert!(!restore.is_finished(), "runc restore waits at the gate");
        opener.open(ok).unwrap();
        let code = tokio::time::timeout(Duration::from_secs(30), restore)
            .await
            .expect("the restore ends once the verdict is given")
            .unwrap();
        cancel.cancel();
        let checked = checked.join().unwrap();
        gate.finish();
        let restore_log = fs::read_to_string(work.join("restore.log")).unwrap_or_default();
        if refuse {
            match checked {
                Resumed::Checked(Err(why @ kernel::CheckError::Refused(_))) => {
                    assert!(why.to_string().contains("capabilities"), "{why}")
                }
                other => panic!("the strict spec: {other:?}"),
            }
            assert_ne!(code, 0, "a refused kernel check fails the restore");
            // A killed CRIU leaves its cgroup yard mounted in the work directory (the shim
            // unmounts it the same way).
            let mounts = crab_shim::sys::mountinfo::read_self().unwrap();
            for p in crab_shim::sys::mountinfo::mount_points_under(&mounts, &work) {
                nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(len(), held, "nothing of the refused restore ran");
            let _ = sb.runc.delete(&rid, true).await;
        } else if ok {
            assert!(
                matches!(checked, Resumed::Checked(Ok(_))),
                "the bundle's own spec: {checked:?}"
            );
            assert_eq!(code, 0, "{restore_log}");
            let pid: u32 = fs::read_to_string(&pid_file)
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let rcg = cgroup_of(pid);
            wait_until("the restored loop to beat", Duration::from_secs(10), || {
                (len() > held).then_some(())
            });
            assert!(!live(&rcg).is_empty());
            // The next case restores the same image: this one goes first.
            let _ = sb.runc.delete(&rid, true).await;
            wait_until("the restored loop to end", Duration::from_secs(10), || {
                (!rcg.exists() || live(&rcg).is_empty()).then_some(())
            });
        } else {
            assert_ne!(code, 0, "a refused verdict fails the restore");
            assert!(
                restore_log.contains("post-restore script"),
                "CRIU names the gate: {restore_log}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(len(), held, "nothing of the refused restore ran");
            let _ = sb.runc.delete(&rid, true).await;
        }
        // The gate is gone but for the configuration runc's state names.
        let left: Vec<String> = fs::read_dir(sb.bundle.join(GATE_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["criu.conf"]);
    }
}

use crab_shim::restore::seccomp::encode_insn as insn;

const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;

/// Issue 24, item 2: the task iterator reads what the kernel holds and `/proc` does not show.
/// A process installs two filters of its own (an allow-all one, then one denying syscall 9999)
/// and sets SECBIT_NOROOT before it execs `sleep`: the iterator reports exactly that process's
/// thread, its securebits and filter count, and finds each program at its place in the chain
/// (oldest first) and a third, never installed, nowhere.
#[test]
fn the_task_iterator_reads_each_thread_s_filters_and_securebits() {
    use crab_shim::restore::seccomp;
    use std::os::unix::process::CommandExt;
    support::require_root("loads a BPF task iterator");
    let allow_all: Vec<u8> = insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW).to_vec();
    let deny_9999: Vec<u8> = [
        insn(0x20, 0, 0, 0),                // ld [0]: the syscall number
        insn(0x15, 0, 1, 9999),             // jeq 9999
        insn(BPF_RET_K, 0, 0, 0x0005_0001), // SECCOMP_RET_ERRNO | EPERM
        insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    .concat();
    let never = insn(BPF_RET_K, 0, 0, 0x0005_0002).to_vec();
    let (a, b) = (allow_all.clone(), deny_9999.clone());
    let mut cmd = Command::new("sleep");
    cmd.arg("60");
    // SAFETY: only async-signal-safe prctl(2) calls between fork and exec, on memory
    // allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let install = |prog: &[u8]| {
                let fprog = libc::sock_fprog {
                    len: (prog.len() / 8) as u16,
                    filter: prog.as_ptr() as *mut libc::sock_filter,
                };
                libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &fprog)
            };
            if libc::prctl(libc::PR_SET_SECUREBITS, 1) != 0
                || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || install(&a) != 0
                || install(&b) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let pid = child.id();
    let read = |reference: &[u8]| seccomp::read(&[pid], Some(reference)).unwrap();
    let t = read(&allow_all);
    assert_eq!(t.keys().copied().collect::<Vec<_>>(), [pid], "{t:?}");
    let k = &t[&pid];
    assert_eq!((k.tgid, k.securebits, k.seccomp_mode), (pid, 1, 2));
    assert_eq!(k.filter_count, 2);
    assert_eq!((k.holds_reference, k.compared), (Some(true), 1));
    let k = &read(&deny_9999)[&pid];
    assert_eq!((k.holds_reference, k.compared), (Some(true), 2));
    let k = &read(&never)[&pid];
    assert_eq!((k.holds_reference, k.compared), (Some(false), 2));
    // This process (not listed, no filters) is never reported.
    let own = std::process::id();
    assert!(seccomp::read(&[own], None).unwrap()[&own].filter_count == 0);
    child.kill().unwrap();
    child.wait().unwrap();
}

/// runc from PATH with its state and log in `dir` (the seccomp probe tests' own).
fn plain_runc(dir: &Path) -> Runc {
    Runc {
        binary: "runc".into(),
        root: dir.join("runc"),
        systemd_cgroup: false,
        log: dir.join("runc.log"),
        no_pivot_root: false,
        no_new_keyring: false,
        io_owner: None,
        merge_memory: false,
    }
}

/// A seccomp profile in the OCI form: everything allowed but the syscalls `denied`.
fn profile(denied: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32",
                          "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
        "syscalls": [{"names": denied, "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
    })
}

/// Issue 24, item 2: the seccomp program the kernel check looks for is runc's own. A probe
/// container learns it for a profile (cached after); a real container run by runc with that
/// profile (no_new_privs on, so runc installs it at another moment than the probe) holds
/// exactly that program. Dumped and restored through the gate, the tree passes the kernel check
/// against its own profile, and is refused (killed at pre-resume, nothing run) against a spec
/// whose profile differs by one syscall: the filter CRIU restored is not that spec's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kernel_check_requires_runc_s_seccomp_program() {
    use crab_shim::restore::{
        gate::{Gate, Resumed},
        kernel,
        seccomp::{self, Reference},
    };
    let sb = Sandbox::new(
        "seccomp",
        &[
            "sh",
            "-c",
            "while true; do echo x >> /tmp/beat; sleep 0.02; done",
        ],
        false,
        false,
    )
    .await;
    let path = sb.bundle.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    spec["linux"]["seccomp"] = profile(&["swapon", "swapoff"]);
    assert_eq!(spec["process"]["noNewPrivileges"], true);
    fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    let spec: oci_spec::runtime::Spec = serde_json::from_value(spec).unwrap();
    let mut other = spec.clone();
    let mut linux = other.linux().clone().unwrap();
    linux.set_seccomp(Some(
        serde_json::from_value(profile(&["swapon", "swapoff", "reboot"])).unwrap(),
    ));
    other.set_linux(Some(linux));

    let cache = sb.path("seccomp-cache");
    let t = Instant::now();
    let Reference::Program(program) = seccomp::reference(&spec, &sb.runc, &cache).await.unwrap()
    else {
        panic!("a profile without a listener is compared")
    };
    eprintln!(
        "runc's program: {} instructions, learnt in {:?}",
        program.len() / 8,
        t.elapsed()
    );
    // Cached on disk, under the profile's key; no probe container or bundle left.
    let cached: Vec<_> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    assert_eq!(fs::read(&cached[0]).unwrap(), *program);
    assert!(fs::read_dir("/sys/fs/cgroup").unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with("crab-seccomp-probe")));
    let Reference::Program(again) = seccomp::reference(&spec, &sb.runc, &cache).await.unwrap()
    else {
        panic!()
    };
    assert_eq!(again, program);
    let Reference::Program(other_program) =
        seccomp::reference(&other, &sb.runc, &cache).await.unwrap()
    else {
        panic!()
    };
    assert_ne!(other_program, program);

    let (id, init, _cg) = sb.run("a").await;
    let beat = sb.rootfs("tmp/beat");
    let len = || fs::metadata(&beat).map(|m| m.len()).unwrap_or(0);
    wait_until("the loop to beat", Duration::from_secs(10), || {
        (len() > 0).then_some(())
    });
    let k = &seccomp::read(&[init], Some(&program)).unwrap()[&init];
    assert_eq!(
        (k.holds_reference, k.filter_count),
        (Some(true), 1),
        "the running container holds the probe's program"
    );
    let image = sb.path("image");
    let opts = CheckpointOpts {
        image_path: image.clone(),
        work_path: Some(sb.path("image.work")),
        ..Default::default()
    };
    sb.runc.checkpoint(&id, &opts).await.unwrap();
    sb.delete(&id).await;

    let mut own = kernel::Expected::from_spec(&spec);
    own.seccomp = Reference::Program(program.clone());
    let mut narrower = kernel::Expected::from_spec(&other);
    narrower.seccomp = Reference::Program(other_program.clone());
    for (n, expected, pass) in [(1, narrower, false), (2, own, true)] {
        let gate = Gate::install(&sb.bundle, None).unwrap();
        gate.opener().unwrap().open(true).unwrap();
        let (resume, cancel) = gate.resume().unwrap();
        let checked = std::thread::spawn(move || {
            resume.wait(|script, init| kernel::check_restored(&expected, script, init))
        });
        let rid = format!("{}-r{n}", sb.base);
        let work = sb.path(&format!("restore-{n}"));
        let mut cmd = sb.runc_cmd(&["restore", "-d", "--bundle"], &[sb.bundle.as_os_str()]);
        cmd.arg("--image-path")
            .arg(&image)
            .arg("--work-path")
            .arg(&work)
            .arg(&rid)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        sb.containers.lock().unwrap().push(rid.clone());
        let held = len();
        let code = tokio::time::timeout(Duration::from_secs(60), reaper::run(cmd, false))
            .await
            .expect("the restore ends")
            .unwrap()
            .code;
        cancel.cancel();
        let checked = checked.join().unwrap();
        gate.finish();
        if pass {
            assert!(matches!(checked, Resumed::Checked(Ok(_))), "{checked:?}");
            assert_eq!(code, 0);
            wait_until("the restored loop to beat", Duration::from_secs(10), || {
                (len() > held).then_some(())
            });
        } else {
            match checked {
                Resumed::Checked(Err(why @ kernel::CheckError::Refused(_))) => assert!(
                    why.to_string()
                        .contains("does not run under the seccomp filter runc installs"),
                    "{why}"
                ),
                other => panic!("the narrower profile: {other:?}"),
            }
            assert_ne!(code, 0, "a refused kernel check fails the restore");
            let mounts = crab_shim::sys::mountinfo::read_self().unwrap();
            for p in crab_shim::sys::mountinfo::mount_points_under(&mounts, &work) {
                nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(len(), held, "nothing of the refused restore ran");
        }
        let _ = sb.runc.delete(&rid, true).await;
    }
}

/// runc emits its ENOSYS stub's architecture sections in Go map order, so one profile gives
/// programs that differ from run to run (seen: 1 run in 6 on a three-architecture profile).
/// Every variant runc makes is accepted as runc's program for the profile by the kernel check's
/// rule (`decides_as`), whichever run taught the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_program_runc_makes_for_a_profile_is_accepted_as_runc_s() {
    use crab_shim::restore::seccomp::{self, decides_as, Reference};
    support::require_root("runs runc");
    support::require_program("runc");
    start_runc_reaper();
    let dir = tempfile::tempdir().unwrap();
    let runc = plain_runc(dir.path());
    let mut programs = Vec::new();
    for i in 0..8 {
        let mut p = profile(&["swapon", "swapoff", "kexec_load"]);
        p["architectures"] =
            serde_json::json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]);
        // Not used without a listener, but part of the cache key: every run probes anew.
        p["listenerMetadata"] = format!("run {i}").into();
        let spec: oci_spec::runtime::Spec = serde_json::from_value(
            serde_json::json!({"ociVersion": "1.0.2", "linux": {"seccomp": p}}),
        )
        .unwrap();
        let Reference::Program(program) =
            seccomp::reference(&spec, &runc, &dir.path().join("cache"))
                .await
                .unwrap()
        else {
            panic!("compared")
        };
        programs.push(program);
    }
    let distinct: BTreeSet<_> = programs.iter().collect();
    eprintln!(
        "{} distinct programs in {} runs of runc",
        distinct.len(),
        programs.len()
    );
    for a in &programs {
        for b in &programs {
            assert!(
                decides_as(a, b),
                "two of runc's own programs for one profile"
            );
        }
    }
}

/// A shim killed while it probed runc leaves a runc init waiting on its FIFO forever, in a
/// cgroup of its own: the next probe on the host sweeps it (runc delete --force, then the
/// bundle), and leaves a live shim's probe alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_of_dead_shims_are_swept() {
    use crab_shim::restore::seccomp::{probe_id, sweep_stale_probes, write_probe_bundle};
    support::require_root("runs runc");
    support::require_program("runc");
    start_runc_reaper();
    let dir = tempfile::tempdir().unwrap();
    let runc = plain_runc(dir.path());
    let profile: oci_spec::runtime::LinuxSeccomp =
        serde_json::from_value(profile(&["swapon"])).unwrap();
    // No pid is ever this large (pid_max is at most 2^22): its shim is dead.
    let (dead, live) = (probe_id(999_999_999, 0), probe_id(std::process::id(), 999));
    let mut inits = Vec::new();
    for id in [&dead, &live] {
        let bundle = dir.path().join(id);
        write_probe_bundle(&bundle, id, &profile).unwrap();
        let r = Runc {
            root: bundle.join("runc"),
            log: bundle.join("log.json"),
            ..runc.clone()
        };
        r.create(
            id,
            &bundle,
            &bundle.join("pid"),
            None,
            crab_shim::runc::ChildStdio::null(),
        )
        .await
        .unwrap();
        let pid: u32 = fs::read_to_string(bundle.join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        inits.push((id.clone(), pid, r));
    }
    assert_eq!(sweep_stale_probes(&runc, dir.path()).await, 1);
    let (_, dead_init, _) = &inits[0];
    wait_until(
        "the dead shim's probe to end",
        Duration::from_secs(10),
        || (!Path::new(&format!("/proc/{dead_init}")).exists()).then_some(()),
    );
    assert!(!dir.path().join(&dead).exists());
    assert!(!Path::new("/sys/fs/cgroup").join(&dead).exists());
    // The live shim's probe is its own to finish.
    let (_, live_init, r) = &inits[1];
    assert!(Path::new(&format!("/proc/{live_init}")).exists());
    r.delete(&live, true).await.unwrap();
}

/// A `runc restore` killed mid-way leaves the rootfs bind-mounted at runc's
/// `<root>/<id>/criu-root` (here stacked twice, as a CRIU killed after its own mount there
/// leaves it): the leftovers are detached and removed, the files of the rootfs behind them stay,
/// and a state directory that holds a state is kept.
#[test]
fn a_killed_restores_criu_root_is_detached_without_touching_the_rootfs() {
    support::require_root("bind mounts");
    let dir = tempfile::tempdir().unwrap();
    let runc = plain_runc(dir.path());
    let rootfs = dir.path().join("rootfs");
    fs::create_dir_all(rootfs.join("etc")).unwrap();
    fs::write(rootfs.join("etc/hostname"), "agent\n").unwrap();
    let bind = |id: &str| {
        let criu_root = runc.root.join(id).join("criu-root");
        fs::create_dir_all(&criu_root).unwrap();
        for _ in 0..2 {
            nix::mount::mount(
                Some(&rootfs),
                &criu_root,
                None::<&str>,
                nix::mount::MsFlags::MS_BIND | nix::mount::MsFlags::MS_REC,
                None::<&str>,
            )
            .unwrap();
        }
        criu_root
    };
    let mounted = |p: &Path| {
        fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()))
    };

    // runc never wrote a state: everything goes.
    let criu_root = bind("never-started");
    assert!(mounted(&criu_root));
    assert_eq!(runc.clear_restore_leftovers("never-started"), 2);
    assert!(!mounted(&criu_root));
    assert!(!runc.root.join("never-started").exists());
    assert_eq!(
        fs::read_to_string(rootfs.join("etc/hostname")).unwrap(),
        "agent\n"
    );

    // A state runc wrote stays for `runc delete`.
    let criu_root = bind("known");
    fs::write(runc.root.join("known/state.json"), "{}").unwrap();
    assert_eq!(runc.clear_restore_leftovers("known"), 2);
    assert!(!mounted(&criu_root) && !criu_root.exists());
    assert!(runc.root.join("known/state.json").exists());

    // Nothing left over: nothing to do.
    assert_eq!(runc.clear_restore_leftovers("known"), 0);
    assert_eq!(runc.clear_restore_leftovers("absent"), 0);
    assert!(rootfs.join("etc/hostname").exists());
}
