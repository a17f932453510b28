//! Crash recovery end to end: a multi-turn agent script covering every kind of turn (edits,
//! deletes, a package install, a background HTTP server, a Python process holding state in
//! memory) is run once without faults; then, for each turn, a fresh sandbox runs the script up
//! to that turn, crashes (SIGKILL of the container's processes, or of its shim), is brought
//! back with `crabctl recover`, runs the remaining turns, and must end in exactly the state of
//! the fault-free run (see [`STATE`] for what is compared and what is left out).
//!
//! Real containerd, runc and CRIU; no fakes.

use std::time::Duration;

use crab_integration::harness::log_once;
use crab_integration::sandbox::{Sandbox, SandboxOptions};

/// The agent's turns, as it would type them (`bash -c` in /app).
const TURNS: &[&str] = &[
    // fs: a project with two files, and scripts used later.
    r#"mkdir -p proj && echo v1 > proj/a.txt && echo scratch > junk.txt
cat > kv.py <<'EOF'
import socket
g = {}
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000))
s.listen()
while True:
    c, _ = s.accept()
    src = c.recv(65536).decode()
    try:
        try:
            out = repr(eval(src, g))
        except SyntaxError:
            exec(src, g)
            out = "ok"
    except Exception as e:
        out = "error: %r" % (e,)
    c.sendall(out.encode())
    c.close()
EOF
cat > cli.py <<'EOF'
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection(("127.0.0.1", 9000))
        break
    except OSError:
        time.sleep(0.05)
c.sendall(sys.argv[1].encode())
print(c.recv(65536).decode())
EOF"#,
    // none: reads only.
    "cat proj/a.txt && ls -la && grep -r v1 proj",
    // proc: an interpreter that keeps state in memory.
    "nohup python3 /app/kv.py >/dev/null 2>&1 & python3 /app/cli.py 'x = 41'",
    // proc: its memory changes.
    "python3 /app/cli.py 'x += 1' && python3 /app/cli.py 'names = [\"a\", \"b\"]'",
    // fs: an edit and a delete.
    "rm junk.txt && echo v2 >> proj/a.txt && mkdir -p proj/sub && echo deep > proj/sub/b.txt",
    // fs: a package install (a wheel built on the spot: there is no network).
    r#"mkdir -p /tmp/whl && cd /tmp/whl && python3 - <<'EOF'
import zipfile
with zipfile.ZipFile("crabdemo-1.0-py3-none-any.whl", "w") as z:
    z.writestr("crabdemo/__init__.py", "ANSWER = 42\n")
    z.writestr("crabdemo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: crabdemo\nVersion: 1.0\n")
    z.writestr("crabdemo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: crab\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr("crabdemo-1.0.dist-info/RECORD", "")
EOF
pip install -q --no-index --no-deps --break-system-packages /tmp/whl/crabdemo-1.0-py3-none-any.whl && rm -rf /tmp/whl"#,
    // full: a web server in the background, and a file it serves.
    "echo '<h1>crab</h1>' > index.html && (nohup python3 -m http.server 8000 --bind 127.0.0.1 --directory /app >/dev/null 2>&1 &) && sleep 0.5",
    // proc: more interpreter state.
    "python3 /app/cli.py 'x *= 2' && python3 /app/cli.py 'names.append(\"c\")'",
];

/// What a sandbox's state is compared by: file contents under /app and of the installed
/// package (paths and hashes, not times), the command lines of live processes (not pids: a
/// restore keeps them, a fresh start would not, and both are harmless), the web server's
/// answer and the interpreter's variables. The pipeline's own processes are left out, also
/// while one is between fork and exec (its command line then reads empty: `ps` shows `[sort]`,
/// as a run beside a compiler found).
const STATE: &str = r#"cd /app && find . -type f -not -name '*.pyc' | sort | xargs sha256sum
python3 -c 'import crabdemo; print("crabdemo", crabdemo.ANSWER)'
ps -eo args --no-headers | grep -v -e '^ps ' -e '^bash -c' -e '^grep ' -e '^sort' -e '^\[bash\]$' -e '^\[grep\]$' -e '^\[sort\]$' | sort
python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8000/index.html").read().decode().strip())'
python3 /app/cli.py 'x' && python3 /app/cli.py 'names'"#;

#[derive(Debug, Clone, Copy)]
enum Crash {
    /// SIGKILL of every process of the container (the task stops, the shim lives).
    Processes,
    /// SIGKILL of the container's shim (the task is gone with it).
    Shim,
}

async fn end_turn_durably(s: &mut Sandbox) {
    s.end_turn().await;
    s.sync().await;
}

fn shim_pid(s: &Sandbox) -> i32 {
    let out = std::process::Command::new("pgrep")
        .args(["-f", &format!("containerd-shim-crab-v1 .*-id {} ", s.id)])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let pids: Vec<i32> = text
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    assert_eq!(pids.len(), 1, "one shim for {}: {text}", s.id);
    pids[0]
}

async fn crash(s: &Sandbox, how: Crash) {
    match how {
        Crash::Processes => {
            s.h.kill(&s.id, "", libc::SIGKILL, true).await.unwrap();
            s.h.wait(&s.id, "", Duration::from_secs(30)).await.unwrap();
        }
        Crash::Shim => {
            let pid = shim_pid(s);
            // SAFETY: plain kill(2).
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
            for _ in 0..200 {
                if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }
}

/// Runs `TURNS`, crashing after turn `crash_after` (1-based) when given; returns the final state.
async fn run_script(name: &str, crash_after: Option<(usize, Crash)>) -> String {
    let (mut s, _guard) = Sandbox::start(name, SandboxOptions::default()).await;
    for (i, script) in TURNS.iter().enumerate() {
        s.run(script).await;
        end_turn_durably(&mut s).await;
        if let Some((at, how)) = crash_after {
            if at == i + 1 {
                crash(&s, how).await;
                let (code, out, err) = s.crabctl(&["recover", &s.id]);
                assert_eq!(code, 0, "recover after turn {at} ({how:?}): {out}{err}");
                let lineage = s.lineage();
                let last = lineage.last().unwrap();
                assert_eq!(
                    last["kind"], "restored",
                    "the lineage records the recovery: {lineage:#?}"
                );
            }
        }
    }
    let state = s.run(STATE).await.stdout;
    s.finish().await;
    state
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_at_every_turn_recovers_the_fault_free_state() {
    let reference = run_script("rec-ref", None).await;
    eprintln!("fault-free state:\n{reference}");
    for needle in [
        "./proj/a.txt",
        "crabdemo 42",
        "python3 /app/kv.py",
        "http.server 8000",
        "<h1>crab</h1>",
        "84",
        "['a', 'b', 'c']",
    ] {
        assert!(
            reference.contains(needle),
            "the fault-free run is not what the script makes ({needle}): {reference}"
        );
    }
    assert!(!reference.contains("junk.txt"), "{reference}");
    let runs = (1..=TURNS.len()).map(|at| {
        let how = if at % 2 == 0 {
            Crash::Shim
        } else {
            Crash::Processes
        };
        async move {
            (
                at,
                how,
                run_script(&format!("rec-{at}"), Some((at, how))).await,
            )
        }
    });
    // A few at a time: each is a full agent sandbox.
    let mut failures = Vec::new();
    let runs: Vec<_> = runs.collect();
    let mut pending = runs.into_iter();
    loop {
        let batch: Vec<_> = pending.by_ref().take(4).collect();
        if batch.is_empty() {
            break;
        }
        for (at, how, state) in futures_join_all(batch).await {
            if state != reference {
                failures.push(format!(
                    "crash after turn {at} ({how:?}):\n{}",
                    diff(&reference, &state)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "recovered runs differ from the fault-free run:\n{}",
        failures.join("\n")
    );
}

async fn futures_join_all<F>(futs: Vec<F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("a recovery run panicked"));
    }
    out
}

fn diff(want: &str, got: &str) -> String {
    let w: Vec<&str> = want.lines().collect();
    let g: Vec<&str> = got.lines().collect();
    let missing = w
        .iter()
        .filter(|l| !g.contains(l))
        .map(|l| format!("  - {l}"));
    let extra = g
        .iter()
        .filter(|l| !w.contains(l))
        .map(|l| format!("  + {l}"));
    missing.chain(extra).collect::<Vec<_>>().join("\n")
}

/// What the rollback test looks at after each rollback: files, the interpreter's variables and
/// whether the web server runs (absent before the turn that started it).
const PROBE: &str = r#"cd /app && ls junk.txt proj/sub 2>&1 | sort; cat proj/a.txt
python3 /app/cli.py 'x' && python3 /app/cli.py 'names' 2>&1 | tail -1
python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8000/index.html")' 2>/dev/null && echo server-up || echo server-down"#;

/// Rollback in place (same container id) across fs-only and process checkpoints, backwards and
/// forwards: each time the files, the interpreter's memory and the set of servers are those
/// of the turn rolled back to, and the lineage records every rollback.
#[tokio::test(flavor = "multi_thread")]
async fn rollback_across_process_checkpoints_backwards_and_forwards() {
    let (mut s, _guard) = Sandbox::start("rec-rollback", SandboxOptions::default()).await;
    for script in TURNS {
        s.run(script).await;
        end_turn_durably(&mut s).await;
    }
    let now = s.run(PROBE).await.stdout;
    assert!(
        now.contains("84") && now.contains("['a', 'b', 'c']") && now.contains("server-up"),
        "{now}"
    );
    // (turn, what its state shows): t4 = interpreter x=42 and names, junk still there, no server;
    // t7 = after the delete, the install and the server; t3 = x=41, names not yet defined.
    for (turn, want, not) in [
        (
            "t4",
            vec!["junk.txt", "v1\n42\n['a', 'b']", "server-down"],
            vec!["v2", "server-up"],
        ),
        (
            "t7",
            vec!["v1\nv2\n42\n['a', 'b']", "server-up"],
            vec!["junk.txt\n", "server-down"],
        ),
        (
            "t3",
            vec!["junk.txt", "v1\n41\n", "server-down"],
            vec!["['a', 'b']", "server-up"],
        ),
        (
            "t8",
            vec!["84", "['a', 'b', 'c']", "server-up"],
            vec!["junk.txt\n"],
        ),
    ] {
        let (code, out, err) = s.crabctl(&["rollback", &s.id, "--to", turn]);
        assert_eq!(code, 0, "rollback to {turn}: {out}{err}");
        let state = s.run(PROBE).await.stdout;
        for w in want {
            assert!(
                state.contains(w),
                "after rollback to {turn}, expected {w:?} in:\n{state}"
            );
        }
        for n in not {
            assert!(
                !state.contains(n),
                "after rollback to {turn}, unexpected {n:?} in:\n{state}"
            );
        }
        let last = s.lineage().last().cloned().unwrap();
        assert_eq!(last["kind"], "restored", "{last:#}");
        assert_eq!(
            last["turn_id"], turn,
            "the lineage records which turn was rolled back to: {last:#}"
        );
    }
    s.finish().await;
}

/// A process holding a file lock and serving on a unix socket comes back from a crash with both:
/// the lock still held (another process cannot take it) and the socket answering.
#[tokio::test(flavor = "multi_thread")]
async fn unix_sockets_and_file_locks_survive_a_crash() {
    let (mut s, _guard) = Sandbox::start("rec-unix", SandboxOptions::default()).await;
    s.run(
        r#"cat > holder.py <<'EOF'
import fcntl, os, socket
lock = open("/app/lockfile", "w")
fcntl.flock(lock, fcntl.LOCK_EX)
try:
    os.unlink("/app/u.sock")
except FileNotFoundError:
    pass
s = socket.socket(socket.AF_UNIX)
s.bind("/app/u.sock")
s.listen()
open("/app/ready", "w").close()
while True:
    c, _ = s.accept()
    c.sendall(b"unix-ok")
    c.close()
EOF
nohup python3 /app/holder.py >/dev/null 2>&1 &
for i in $(seq 100); do [ -e /app/ready ] && break; sleep 0.05; done"#,
    )
    .await;
    end_turn_durably(&mut s).await;
    const PROBE: &str = r#"python3 -c '
import fcntl, socket
c = socket.socket(socket.AF_UNIX); c.connect("/app/u.sock"); print(c.recv(100).decode())
try:
    fcntl.flock(open("/app/lockfile"), fcntl.LOCK_EX | fcntl.LOCK_NB); print("lock-free")
except BlockingIOError:
    print("lock-held")'"#;
    assert_eq!(s.run(PROBE).await.stdout, "unix-ok\nlock-held\n");
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    assert_eq!(
        s.run(PROBE).await.stdout,
        "unix-ok\nlock-held\n",
        "after the crash and recover"
    );
    s.finish().await;
}

/// Established TCP connections inside the sandbox (a client and a server talking over
/// loopback, both idle between requests) come back from a crash still connected: the dump
/// locked the network for them (a sandbox with only listening sockets is dumped without the
/// lock, which the other tests of this file cover).
#[tokio::test(flavor = "multi_thread")]
async fn established_tcp_connections_survive_a_crash() {
    let (mut s, _guard) = Sandbox::start("rec-tcp", SandboxOptions::default()).await;
    let out = s
        .run(
            r#"cat > pair.py <<'EOF'
import os, socket, threading
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 9100))
srv.listen()
cli = socket.create_connection(("127.0.0.1", 9100))
conn, _ = srv.accept()
def echo():
    while True:
        data = conn.recv(100)
        if not data:
            return
        conn.sendall(b"echo:" + data)
threading.Thread(target=echo, daemon=True).start()
try:
    os.unlink("/app/ask")
except FileNotFoundError:
    pass
os.mkfifo("/app/ask")
open("/app/ready", "w").close()
while True:
    with open("/app/ask") as f:
        word = f.read().strip()
    cli.sendall(word.encode())
    with open("/app/answer.tmp", "w") as out:
        out.write(cli.recv(100).decode())
    os.rename("/app/answer.tmp", "/app/answer")
EOF
nohup python3 /app/pair.py >/dev/null 2>&1 &
for i in $(seq 100); do [ -e /app/ready ] && break; sleep 0.05; done
grep -c ' 01 ' /proc/net/tcp"#,
        )
        .await;
    assert_eq!(out.stdout, "2\n", "two established ends: {out:?}");
    end_turn_durably(&mut s).await;
    let ask = |w: &str| {
        format!(
            r#"rm -f /app/answer; echo {w} > /app/ask
for i in $(seq 100); do [ -e /app/answer ] && break; sleep 0.05; done; cat /app/answer"#
        )
    };
    assert_eq!(s.run(&ask("before")).await.stdout, "echo:before");
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    assert_eq!(
        s.run(&ask("after")).await.stdout,
        "echo:after",
        "the connection after the crash and recover"
    );
    s.finish().await;
}

/// A zombie at checkpoint time (a child that exited and that its parent has not reaped, as a
/// server killed by `pkill` is until its parent waits): the image lists it with a thread id
/// CRIU never filled in, and recovery still restores the sandbox, zombie and parent included.
#[tokio::test(flavor = "multi_thread")]
async fn a_zombie_at_checkpoint_time_does_not_stop_recovery() {
    let (mut s, _guard) = Sandbox::start("rec-zombie", SandboxOptions::default()).await;
    s.run(
        r#"nohup python3 -c '
import os, time
if os.fork() == 0:
    os._exit(0)
open("/app/forked", "w").close()
time.sleep(1000000)' >/dev/null 2>&1 &
for i in $(seq 100); do [ -e /app/forked ] && break; sleep 0.05; done; sleep 0.2"#,
    )
    .await;
    const ZOMBIES: &str = "ps -eo stat,args | grep -c '^Z'";
    assert_eq!(s.run(ZOMBIES).await.stdout, "1\n", "one zombie before");
    end_turn_durably(&mut s).await;
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    let procs = s.run("ps -eo stat,args").await.stdout;
    assert!(procs.contains("time.sleep(1000000)"), "{procs}");
    assert_eq!(
        s.run(ZOMBIES).await.stdout,
        "1\n",
        "the zombie is back: {procs}"
    );
    s.finish().await;
}

/// The containerd log from byte `from` on (shim stderr lands there).
fn log_since(s: &Sandbox, from: u64) -> String {
    s.h.env.containerd_log_since(from)
}

fn log_len(s: &Sandbox) -> u64 {
    s.h.env.containerd_log_len()
}

/// A Python interpreter holding `MB` MiB in which every page carries its own number (a page
/// lost on the way reads as zeros, and its hash tells).
const HOLDER_MB: u32 = 96;

async fn start_holder(s: &mut Sandbox) -> String {
    s.run(TURNS[0]).await;
    s.run("nohup python3 /app/kv.py >/dev/null 2>&1 & python3 /app/cli.py 'import hashlib'")
        .await;
    s.run(&format!(
        r#"python3 /app/cli.py 'b = bytearray({HOLDER_MB} << 20)' && python3 /app/cli.py 'for i in range(0, len(b), 4096): b[i:i + 8] = (i * 2654435761 % (1 << 64)).to_bytes(8, "little")'"#
    ))
    .await;
    memory_hash(s).await
}

async fn memory_hash(s: &mut Sandbox) -> String {
    let out = s
        .run("python3 /app/cli.py 'hashlib.sha256(b).hexdigest()'")
        .await
        .stdout;
    assert_eq!(out.trim().len(), 66, "a quoted sha256: {out}");
    out
}

/// A restore of more than `[restore] lazy_pages_min_mib` of memory runs the processes before
/// their pages are copied (CRIU's lazy-pages daemon over userfaultfd): the memory read at once
/// after the recovery (every page touched while the rest is still arriving) is exactly the
/// memory at the checkpoint; the next turn's process checkpoint (which waits for the last
/// page) holds the changed memory, and a second lazy recovery brings that back.
#[tokio::test(flavor = "multi_thread")]
async fn a_large_process_restored_lazily_comes_back_whole_and_checkpoints_again() {
    let (mut s, _guard) = Sandbox::start(
        "rec-lazy",
        SandboxOptions {
            config: "restore.lazy_pages_min_mib = 32",
            ..Default::default()
        },
    )
    .await;
    let before = start_holder(&mut s).await;
    end_turn_durably(&mut s).await;
    assert!(
        !s.manifests().last().unwrap()["process"].is_null(),
        "a process checkpoint: {:#?}",
        s.manifests().last()
    );
    recover_lazily(&mut s, &before).await;
    s.run("python3 /app/cli.py 'b[4096:4104] = b\"changed!\"'")
        .await;
    let changed = memory_hash(&mut s).await;
    assert_ne!(changed, before);
    end_turn_durably(&mut s).await;
    let last = s.manifests().last().cloned().unwrap();
    assert!(
        !last["process"].is_null() && last["status"] != "failed",
        "the turn after a lazy restore is checkpointed with its processes: {last:#}"
    );
    recover_lazily(&mut s, &changed).await;
    s.finish().await;
}

/// Crashes the sandbox, recovers it, and checks at once (while pages are still arriving) that
/// the holder's memory hashes to `want`, and that the restore was lazy and ended well.
async fn recover_lazily(s: &mut Sandbox, want: &str) {
    crash(s, Crash::Processes).await;
    let from = log_len(s);
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    assert_eq!(
        memory_hash(s).await,
        want,
        "memory right after the recovery"
    );
    let restored = |log: &str| {
        log.lines().any(|l| {
            l.contains(&format!("container {} restored from", s.id))
                && l.contains("memory arriving lazily")
        })
    };
    let log = log_once(&s.h.env, from, Duration::from_secs(15), restored).await;
    assert!(restored(&log), "restored lazily:\n{log}");
    assert!(
        !log.contains("did not all arrive"),
        "the transfer ended well:\n{log}"
    );
}

/// A lazy restore puts the command line and environment of every process back before the
/// processes run (the rest of the memory arrives later): tools that read them from outside
/// (`pgrep -f`, `pkill -f`, `ps`, `/proc/PID/cmdline`) see a restored process at once. The
/// lazy-pages daemon is held stopped (a CRIU wrapper SIGSTOPs it at its first background copy,
/// once the restore has ended; the server's stack, highest in its memory, comes after its
/// 96 MB), so its command line is there only if the restore put it back eagerly; then the
/// daemon goes on and the memory is whole. (It cannot be stopped earlier: the restore itself
/// faults on lazy pages, registering rseq areas for one, and waits for the daemon to serve
/// them.)
#[tokio::test(flavor = "multi_thread")]
async fn a_lazy_restore_shows_command_lines_before_the_memory_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("criu");
    let (paused, resume, moved) = (
        dir.path().join("paused"),
        dir.path().join("resume"),
        dir.path().join("moved-before-resume"),
    );
    std::fs::write(
        &wrapper,
        format!(
            r#"#!/bin/sh
# CRIU, except that lazy-pages is stopped at its first background copy (a copy that no
# page fault asked for: the restore has ended) until {resume} exists (at most 60 s).
[ "$1" = lazy-pages ] || exec {criu} "$@"
prev=; for a in "$@"; do [ "$prev" = --work-dir ] && work=$a; prev=$a; done
{criu} "$@" -v4 & pid=$!
until awk '/#PF/ {{ pf = 1; next }} /uffd_copy/ {{ if (!pf) {{ f = 1; exit }}; pf = 0 }} END {{ exit !f }}' \
        "$work/lazy-pages.log" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || {{ wait $pid; exit $?; }}
done
kill -STOP $pid
touch {paused}
for i in $(seq 6000); do [ -e {resume} ] && break; sleep 0.01; done
grep 'UFFD transferred pages' "$work/lazy-pages.log" > {moved}
kill -CONT $pid
wait $pid
"#,
            criu = criu_path(),
            resume = resume.display(),
            paused = paused.display(),
            moved = moved.display(),
        ),
    )
    .unwrap();
    let config = lazy_config_with_criu(&wrapper);
    let (mut s, _guard) = Sandbox::start(
        "rec-lazy-cmdline",
        SandboxOptions {
            config: &config,
            ..Default::default()
        },
    )
    .await;
    let before = start_holder(&mut s).await;
    end_turn_durably(&mut s).await;
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    let held = std::time::Instant::now();
    while !paused.exists() && held.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(paused.exists(), "the lazy-pages daemon was held");
    // `[k]v.py`: the pattern does not match the shell running it.
    let seen = s
        .run(
            "pgrep -f '[k]v.py'; pkill -0 -f '[k]v.py' && echo signalled; \
             tr '\\0' ' ' < /proc/$(pgrep -f '[k]v.py' | head -1)/cmdline; echo; \
             tr '\\0' '\\n' < /proc/$(pgrep -f '[k]v.py' | head -1)/environ | grep -c '^PATH='",
        )
        .await
        .stdout;
    std::fs::write(&resume, b"").unwrap();
    let lines: Vec<&str> = seen.lines().collect();
    assert!(
        lines.len() == 4
            && lines[0].parse::<u32>().is_ok()
            && lines[1..] == ["signalled", "python3 /app/kv.py ", "1"],
        "pgrep -f, pkill -f, cmdline and environ of the restored server while its memory \
         is still held back: {seen}"
    );
    assert_eq!(
        memory_hash(&mut s).await,
        before,
        "the memory after it arrived"
    );
    // The server's pages had not all arrived while the tools looked (the daemon logs each
    // process's total when it is done with it, `<pid>-<uffd>: UFFD transferred pages`).
    let moved = std::fs::read_to_string(&moved).unwrap();
    let server = format!(" {}-", lines[0]);
    assert!(
        !moved.lines().any(|l| l.contains(&server)),
        "the server's memory was still arriving when the tools looked: {moved}"
    );
    s.finish().await;
}

/// Makes `wrapper` executable; the sandbox config that restores lazily (from 32 MiB) through it.
fn lazy_config_with_criu(wrapper: &std::path::Path) -> String {
    std::fs::set_permissions(wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    format!(
        "restore.lazy_pages_min_mib = 32\nrunc.criu = \"{}\"",
        wrapper.display()
    )
}

/// The `criu` the tests run (the wrappers call it).
fn criu_path() -> String {
    String::from_utf8(
        std::process::Command::new("sh")
            .args(["-c", "command -v criu"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .to_string()
}

/// A sandbox holding [`HOLDER_MB`] in a process checkpoint, crashed and recovered through a
/// CRIU wrapper whose lazy-pages daemon is SIGKILLed once its log has `kill_at` lines
/// matching `pattern`.
async fn recover_with_dying_daemon(name: &str, pattern: &str, kill_at: u32) -> Dying {
    let criu = criu_path();
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("criu");
    std::fs::write(
        &wrapper,
        format!(
            r#"#!/bin/sh
# CRIU, except that lazy-pages is killed once its log has {kill_at} lines with '{pattern}'.
[ "$1" = lazy-pages ] || exec {criu} "$@"
prev=; for a in "$@"; do [ "$prev" = --work-dir ] && work=$a; prev=$a; done
{criu} "$@" -v4 & pid=$!
until [ "$(grep -c '{pattern}' "$work/lazy-pages.log" 2>/dev/null)" -ge {kill_at} ]; do
    kill -0 $pid 2>/dev/null || exit 1
    sleep 0.002
done
kill -9 $pid
exit 137
"#,
            criu = criu,
        ),
    )
    .unwrap();
    let config = lazy_config_with_criu(&wrapper);
    let (mut s, guard) = Sandbox::start(
        name,
        SandboxOptions {
            config: &config,
            ..Default::default()
        },
    )
    .await;
    start_holder(&mut s).await;
    end_turn_durably(&mut s).await;
    crash(&s, Crash::Processes).await;
    let from = log_len(&s);
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    Dying {
        s,
        _guard: guard,
        _wrapper: dir,
        code,
        out: format!("{out}{err}"),
        from,
    }
}

struct Dying {
    s: Sandbox,
    _guard: crab_integration::harness::CleanupGuard,
    _wrapper: tempfile::TempDir,
    /// crabctl recover's exit code and output.
    code: i32,
    out: String,
    /// Where the containerd log stood before the recovery.
    from: u64,
}

/// Removes a sandbox whose recovery may have failed (its container and a stopped task stay).
async fn remove_recovered(d: Dying) {
    let s = d.s;
    let _ = s.h.kill(&s.id, "", libc::SIGKILL, true).await;
    let _ = s.h.wait(&s.id, "", Duration::from_secs(10)).await;
    let _ = s.h.delete_task(&s.id).await;
    let _ = s.h.delete_container(&s.id).await;
    s.h.assert_no_leaks(&s.id).await;
    let _ = std::fs::remove_dir_all(&s.state_dir);
}

/// The lazy-pages daemon dies after the restore, with pages still to hand over (its log shows
/// it moving pages in the background): the kernel would let the processes read zeros where
/// their pages should be, so the shim kills the container and says why. It never runs on with
/// memory missing. (On a slow host the daemon may die before runc has returned: then the
/// restore fails at once, as in the next test.)
#[tokio::test(flavor = "multi_thread")]
async fn a_lazy_restore_whose_page_daemon_dies_kills_the_container() {
    let d = recover_with_dying_daemon("rec-lazy-dies", "Read page from self", 40).await;
    let (s, out) = (&d.s, &d.out);
    if d.code == 0 {
        let status = s.h.wait(&s.id, "", Duration::from_secs(30)).await;
        assert_eq!(
            status.as_ref().ok(),
            Some(&137),
            "the restored container is killed: {status:?}"
        );
        // The shim logs why right after it killed the processes: the exit may reach us first.
        let says_why = |log: &str| {
            log.contains("its memory did not all arrive")
                && log.contains("criu lazy-pages failed (status 137)")
        };
        let log = log_once(&s.h.env, d.from, Duration::from_secs(15), says_why).await;
        assert!(says_why(&log), "the shim says why:\n{log}");
    } else {
        eprintln!("the daemon died before runc returned: the restore failed");
        assert!(
            out.contains("the lazy restore's page daemon failed"),
            "recover fails with the reason: {out}\n{}",
            log_since(s, d.from)
        );
    }
    remove_recovered(d).await;
}

/// The lazy-pages daemon dies as soon as the restore has handed it the first process (before
/// the restore ended): CRIU cannot finish, and the shim abandons the restore at once rather
/// than after `[checkpoint] restore_timeout_ms`, saying why.
#[tokio::test(flavor = "multi_thread")]
async fn a_lazy_restore_whose_page_daemon_dies_during_the_restore_fails_at_once() {
    let started = std::time::Instant::now();
    let d = recover_with_dying_daemon("rec-lazy-dies-early", "Received PID", 1).await;
    let out = &d.out;
    assert_ne!(d.code, 0, "the recovery fails: {out}");
    assert!(
        out.contains("the lazy restore's page daemon failed")
            && out.contains("criu lazy-pages failed (status 137)"),
        "with the reason: {out}\n{}",
        log_since(&d.s, d.from)
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "well before the 120 s restore bound: {:?}",
        started.elapsed()
    );
    remove_recovered(d).await;
}

/// Sets the immutable attribute on a directory (no entry can be created, renamed or removed in
/// it, by root included) and clears it when dropped, also when the test fails.
struct Immutable(std::path::PathBuf);

impl Immutable {
    fn set(dir: &std::path::Path) -> Immutable {
        chattr("+i", dir);
        Immutable(dir.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        chattr("-i", &self.0);
    }
}

fn chattr(flag: &str, dir: &std::path::Path) {
    let st = std::process::Command::new("chattr")
        .arg(flag)
        .arg(dir)
        .status()
        .unwrap_or_else(|e| panic!("cannot run chattr: {e}"));
    assert!(st.success(), "chattr {flag} {}: {st}", dir.display());
}

/// A turn end whose answer cannot be stored (the turns directory is read-only here; a full
/// state disk does the same) still reaches the checkpoint coordinator: the inspection's mark
/// has moved, so the turn's changes are in that answer only. Its checkpoint takes the whole
/// container, a crash then brings the turn's files back, the caller is told the answer was not
/// stored and that the turn was checkpointed whole, and once the directory is writable again
/// turns are answered and checkpointed as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_whose_answer_cannot_be_stored_is_checkpointed_whole() {
    use crab_integration::sandbox::{json_files, TURN_END};
    let (mut s, _guard) = Sandbox::start("rec-unstored", SandboxOptions::default()).await;
    s.run("echo one > one.txt").await;
    end_turn_durably(&mut s).await;
    let turns = s.store().join("turns");
    let stored_before = json_files(&turns).len();
    assert!(stored_before >= 1, "t1's answer is stored");
    let read_only = Immutable::set(&turns);
    s.run("mkdir -p kept && echo two > kept/two.txt && echo more >> one.txt")
        .await;
    let annotations = std::collections::HashMap::from([(TURN_END.to_string(), "t2".to_string())]);
    let ended = s.h.update(&s.id, None, annotations).await;
    s.sync().await;
    assert_eq!(
        json_files(&turns).len(),
        stored_before,
        "no answer could be stored for t2"
    );
    let last = s.manifests().last().cloned().unwrap();
    assert_eq!(
        (last["turn_id"].as_str(), last["kind"].as_str()),
        (Some("t2"), Some("full")),
        "t2 is checkpointed whole (files and processes): {last:#}"
    );
    let layer = s.layer(last["fs_layers"].as_array().unwrap().last().unwrap());
    for path in ["app/kept/two.txt", "app/one.txt"] {
        assert!(
            layer.contains_key(path),
            "t2's layer takes the whole upperdir, {path} included: {:?}",
            layer.keys().collect::<Vec<_>>()
        );
    }
    let e = ended.expect_err("the turn end says its answer was not stored");
    let e = e.to_string();
    assert!(
        e.contains("the answer of turn t2 (fs) could not be stored")
            && e.contains("checkpointed whole"),
        "the error says the turn was checkpointed whole anyway: {e}"
    );
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    const FILES: &str = "cd /app && cat one.txt kept/two.txt; cat three.txt 2>/dev/null; true";
    assert_eq!(
        s.run(FILES).await.stdout,
        "one\nmore\ntwo\n",
        "t2's files after the crash and recover"
    );
    // Writable again: turns are answered, stored and checkpointed by their changes.
    drop(read_only);
    s.run("echo three > three.txt").await;
    let answer = s.end_turn().await;
    s.sync().await;
    assert_eq!(answer["turn_id"], format!("t{}", s.turn), "{answer:#}");
    assert_eq!(answer["kind"], "fs", "{answer:#}");
    let last = s.manifests().last().cloned().unwrap();
    assert_eq!(
        (last["turn_id"].as_str(), last["kind"].as_str()),
        (answer["turn_id"].as_str(), Some("fs")),
        "{last:#}"
    );
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    assert_eq!(
        s.run(FILES).await.stdout,
        "one\nmore\ntwo\nthree\n",
        "every turn's files after a second crash and recover"
    );
    s.finish().await;
}

/// What a container sees of its network namespace: its interfaces, lo's flags and MTU, its
/// addresses (IPv6 from /proc; IPv4 by binding: 127.0.0.1 and the test's alias), and the
/// interpreter server's answer over 127.0.0.1.
const NETNS_STATE: &str = r#"awk 'NR>2 {print $1}' /proc/net/dev
cat /sys/class/net/lo/flags /sys/class/net/lo/mtu
awk '{print $1, $6}' /proc/net/if_inet6 | sort
python3 -c '
import socket
for a in ("127.0.0.1", "10.7.7.7"):
    s = socket.socket()
    try:
        s.bind((a, 0)); print(a, "bindable")
    except OSError as e:
        print(a, "not bindable", e.errno)
'
python3 /app/cli.py 'x'"#;

/// Sets lo's MTU and adds the address 10.7.7.7 (alias lo:1): needs CAP_NET_ADMIN.
const CONFIGURE_NETNS: &str = r#"python3 -c '
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
fcntl.ioctl(s, 0x8922, struct.pack("16si20x", b"lo", 1500))
fcntl.ioctl(s, 0x8916, struct.pack("16sH2s4s16x", b"lo:1", socket.AF_INET, b"\0\0", socket.inet_aton("10.7.7.7")))
'"#;

fn netns_left_out(m: &serde_json::Value) -> bool {
    assert!(
        m["timings"]["process"].is_object(),
        "a process checkpoint: {m:#}"
    );
    m["timings"]["process"]["netns_left_out"].as_bool() == Some(true)
}

/// A sandbox whose interpreter server (TURNS[0] and [2]) is in a process image that left the
/// network namespace out.
async fn start_server_left_out(name: &str) -> (Sandbox, crab_integration::CleanupGuard) {
    let (mut s, guard) = Sandbox::start(name, SandboxOptions::default()).await;
    s.run(TURNS[0]).await;
    end_turn_durably(&mut s).await;
    s.run(TURNS[2]).await;
    end_turn_durably(&mut s).await;
    let last = s.manifests().pop().unwrap();
    assert!(netns_left_out(&last), "left out: {last:#}");
    (s, guard)
}

/// A sandbox with a network namespace of its own, and nothing that could change it: its
/// process images leave the namespace out (no `ip`/`iptables-save` with the container
/// frozen), and a recovery gives it a fresh one that looks exactly like the one it had (lo
/// up, the same addresses), the server on 127.0.0.1 answering with its memory.
#[tokio::test(flavor = "multi_thread")]
async fn a_network_namespace_that_cannot_change_is_left_out_and_comes_back_the_same() {
    let (mut s, _guard) = start_server_left_out("netns-fresh").await;
    let before = s.run(NETNS_STATE).await.stdout;
    assert!(
        before.contains("127.0.0.1 bindable") && before.contains("41"),
        "{before}"
    );
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    let after = s.run(NETNS_STATE).await.stdout;
    assert_eq!(after, before, "{}", diff(&before, &after));
    // The restored sandbox leaves it out again.
    s.run("python3 /app/cli.py 'x += 1'").await;
    end_turn_durably(&mut s).await;
    let last = s.manifests().pop().unwrap();
    assert!(netns_left_out(&last), "after the recovery: {last:#}");
    s.finish().await;
}

/// An exec granted CAP_NET_ADMIN configures the namespace (lo's MTU, an address): from then on
/// process images hold the namespace, as `runc checkpoint` writes it. A recovery still starts
/// from a blank namespace with `lo` up: `runc restore` always asks CRIU for an empty network
/// namespace ("runc doesn't manage network devices and their configuration"), so such a
/// configuration never came back through runc, with or without crab (docs/design.md).
#[tokio::test(flavor = "multi_thread")]
async fn a_network_namespace_an_exec_could_change_is_dumped_from_then_on() {
    let (mut s, _guard) = start_server_left_out("netns-admin").await;
    let spec = crab_integration::spec::ProcessSpec::new(&["bash", "-c", CONFIGURE_NETNS])
        .cwd("/app")
        .cap("CAP_NET_ADMIN");
    s.run_with(CONFIGURE_NETNS, spec).await;
    end_turn_durably(&mut s).await;
    // A process the next image holds (one started by the privileged exec would carry
    // CAP_NET_ADMIN, which the spec does not grant: its image would be refused at restore).
    s.run("(sleep 1000 >/dev/null 2>&1 &)").await;
    end_turn_durably(&mut s).await;
    let last = s.manifests().pop().unwrap();
    assert!(!netns_left_out(&last), "dumped after the exec: {last:#}");
    let seq = last["seq"].as_u64().unwrap();
    let image = s.store().join(format!("proc/{seq:06}"));
    let ifaddr = std::fs::read_dir(&image)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("ifaddr-"))
        .unwrap_or_else(|| panic!("no ifaddr image in {}", image.display()));
    let shown = std::process::Command::new("ip")
        .args(["addr", "showdump"])
        .stdin(std::fs::File::open(ifaddr.path()).unwrap())
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains("10.7.7.7"),
        "the image holds the address: {shown:?}"
    );
    let before = s.run(NETNS_STATE).await.stdout;
    assert!(
        before.contains("1500") && before.contains("10.7.7.7 bindable"),
        "configured: {before}"
    );
    crash(&s, Crash::Processes).await;
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    let after = s.run(NETNS_STATE).await.stdout;
    assert!(
        after.contains("127.0.0.1 bindable") && after.ends_with("41\n"),
        "lo up, the server answering: {after}"
    );
    // Restored from an image that holds a namespace: still dumped.
    s.run("python3 /app/cli.py 'x += 1'").await;
    end_turn_durably(&mut s).await;
    assert!(
        !netns_left_out(&s.manifests().pop().unwrap()),
        "after the recovery"
    );
    s.finish().await;
}
