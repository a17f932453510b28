//! Issue 29, item 5: idle servers stop costing a process checkpoint per turn. With
//! `io.crab/self-contained-changes: keep`, a process whose memory changed only by its own doing
//! (an HTTP server's poll timeouts, a sleeper's wake-ups, a poller of a FIFO nobody wrote) keeps
//! its last image: read-only turns are `none`. What reached a process (a request, bytes in its
//! FIFO, a signal) is still a process change, and a crash after the kept turns recovers a
//! sandbox whose servers answer as they would have. With the default (`checkpoint`) the same
//! read-only turns are process turns whenever a server's memory moved.
//!
//! Real containerd, runc, CRIU and eBPF.

use crab_integration::sandbox::{Sandbox, SandboxOptions};
use serde_json::Value;

/// A counter behind HTTP (socketserver's `serve_forever`: a poll that times out every 0.5 s),
/// a poller of a FIFO it holds open itself (one 0.5 s timeout after another; what comes is
/// kept), a sleeper that counts SIGUSR1. Each says its state when asked, by a rename as the
/// last thing it does about it (`say`): a test that sees the file knows the server is back to
/// its quiet wait, so the turn end that follows does not catch the tail of the interaction
/// (the close of a file, the shutdown of a connection), which the next turn would rightly count.
/// Each says it is ready the same way before it starts waiting, and the turn that starts them
/// waits for all three (a server still starting up is not idle).
const SERVERS: &str = r#"mkfifo /tmp/feed
cat > /app/servers.py <<'EOF'
import http.server, os, select, signal, sys, threading, time

def say(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)

def http_counter():
    n = 0
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            nonlocal n
            n += 1
            body = str(n).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    class S(http.server.HTTPServer):
        def shutdown_request(self, request):
            super().shutdown_request(request)
            say("/tmp/http-served", str(n))
    server = S(("127.0.0.1", 8000), H)
    say("/tmp/ready-http", "1")
    server.serve_forever()

def fifo_poller():
    fd = os.open("/tmp/feed", os.O_RDWR | os.O_NONBLOCK)
    got = []
    p = select.poll()
    p.register(fd, select.POLLIN)
    say("/tmp/ready-fifo", "1")
    while True:
        if p.poll(500):
            got.append(os.read(fd, 100))
            say("/tmp/feed-seen", repr(b"".join(got)))

def sig_counter():
    n = [0]
    def h(*_):
        n[0] += 1
        say("/tmp/sig-seen", str(n[0]))
    signal.signal(signal.SIGUSR1, h)
    say("/tmp/ready-sig", "1")
    while True:
        time.sleep(0.5)

{"http": http_counter, "fifo": fifo_poller, "sig": sig_counter}[sys.argv[1]]()
EOF
for role in http fifo sig; do nohup python3 /app/servers.py $role >/dev/null 2>&1 & done
for i in $(seq 200); do test -e /tmp/ready-http -a -e /tmp/ready-fifo -a -e /tmp/ready-sig && break; sleep 0.05; done
python3 - <<'EOF'
import os, time, urllib.request
for _ in range(100):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/").read()
        break
    except OSError:
        time.sleep(0.05)
for _ in range(100):
    if os.path.exists("/tmp/http-served"):
        break
    time.sleep(0.05)
EOF"#;

/// One request to the HTTP counter; prints its answer once the server has said it is done
/// with the connection.
const GET: &str = r#"python3 - <<'EOF'
import time, urllib.request
body = urllib.request.urlopen("http://127.0.0.1:8000/").read().decode()
for _ in range(100):
    try:
        if open("/tmp/http-served").read() == body:
            break
    except OSError:
        pass
    time.sleep(0.05)
print(body)
EOF"#;

/// A turn that only reads, long enough for every server to wake up a few times.
const READ_ONLY: &str = "cat /app/servers.py >/dev/null && ls -la /app && sleep 1.2";

/// Pids of the memory findings the policy kept.
fn kept(answer: &Value) -> Vec<u64> {
    answer["procs"]["memory"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter(|f| f["self_contained"] == true)
                .filter_map(|f| f["pid"].as_u64())
                .collect()
        })
        .unwrap_or_default()
}

/// Command lines of the processes whose memory changed and counted (not kept).
fn changed(answer: &Value) -> Vec<String> {
    answer["procs"]["memory"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter(|f| f["self_contained"] != true)
                .filter(|f| {
                    ["changed_pages", "added_pages", "removed_pages"]
                        .iter()
                        .any(|k| f[*k].as_u64() > Some(0))
                })
                .filter_map(|f| f["cmdline"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Why each change the policy could have kept was not (`not_kept`), by command line.
fn not_kept(answer: &Value) -> Vec<(String, String)> {
    answer["procs"]["memory"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter_map(|f| {
                    Some((
                        f["cmdline"].as_str()?.to_string(),
                        f["not_kept"].as_str()?.to_string(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A read-only turn under the keeping policy: `none`, or a process turn only for the reason
/// that is the safe answer under load: a server's thread caught awake when its image was read
/// (`running`: on a busy host a woken thread may wait for a CPU longer than a turn end waits
/// for it). Every change not kept says why, and any other reason fails; in particular
/// `interacted` right after a process checkpoint would be CRIU's own dump counted as the
/// server's (its parasite's SIGTRAPs, a skipped syscall's exit after the detach), which the
/// inspector does not count. Returns whether the turn was `none`.
fn quiet_turn(a: &Value, what: &str) -> bool {
    assert!(
        a["degraded"].as_array().unwrap().is_empty(),
        "{what}: {a:#}"
    );
    let why = not_kept(a);
    assert_eq!(
        why.len(),
        changed(a).len(),
        "{what}: every change not kept says why: {a:#}"
    );
    let allowed = |w: &str| w == "running";
    match a["kind"].as_str() {
        Some("none") => {
            assert!(why.is_empty(), "{what}: {a:#}");
            true
        }
        Some("proc") => {
            assert!(
                !why.is_empty() && why.iter().all(|(_, w)| allowed(w)),
                "{what}: a read-only turn counted a server's own change: {why:?}: {a:#}"
            );
            false
        }
        other => panic!("{what}: {other:?}: {a:#}"),
    }
}

fn changed_role(answer: &Value, role: &str) -> bool {
    changed(answer)
        .iter()
        .any(|c| c.ends_with(&format!("servers.py {role}")))
}

/// A turn running `script`, which reaches the server `role`: a process turn in which that
/// server's change counts (is not kept).
async fn reaches(s: &mut Sandbox, script: &str, role: &str) {
    s.run(script).await;
    let a = s.end_turn().await;
    assert!(
        matches!(a["kind"].as_str(), Some("proc" | "full")),
        "`{script}` reached the {role} server: {a:#}"
    );
    assert!(changed_role(&a, role), "{a:#}");
    s.sync().await;
}

/// Starts the servers, makes the HTTP counter count one request; returns the answers of
/// `read_only` read-only turns after that.
async fn servers_then_read_only(s: &mut Sandbox, read_only: usize) -> Vec<Value> {
    s.run(SERVERS).await;
    let first = s.end_turn().await;
    assert_ne!(first["kind"], "none", "servers started: {first:#}");
    s.sync().await;
    assert_eq!(s.run(GET).await.stdout.trim(), "2");
    let second = s.end_turn().await;
    assert!(
        matches!(second["kind"].as_str(), Some("proc" | "full")),
        "a request reached the server: {second:#}"
    );
    s.sync().await;
    let mut answers = Vec::new();
    for _ in 0..read_only {
        s.run(READ_ONLY).await;
        answers.push(s.end_turn().await);
        s.sync().await;
    }
    answers
}

/// Kept: read-only turns are `none` while the servers' memory moves by itself (at least once
/// in the run, or the test proves nothing); a request, bytes in the FIFO and a signal are each
/// a process turn again; a crash after kept turns recovers servers that answer as they would
/// have (the HTTP count goes on from the checkpointed one).
#[tokio::test(flavor = "multi_thread")]
async fn idle_servers_keep_their_images_and_lose_nothing() {
    let opts = SandboxOptions {
        annotations: &[("io.crab/self-contained-changes", "keep")],
        ..SandboxOptions::default()
    };
    let (mut s, _guard) = Sandbox::start("self-contained", opts).await;
    let answers = servers_then_read_only(&mut s, 4).await;
    let mut kept_turns = 0;
    for (i, a) in answers.iter().enumerate() {
        eprintln!(
            "read-only turn {}: {} (kept {:?}, not kept {:?}, syscalls {})",
            i + 1,
            a["kind"],
            kept(a),
            not_kept(a),
            a["fs"]["syscalls"]
        );
        let none = quiet_turn(a, &format!("read-only turn {}", i + 1));
        kept_turns += usize::from(none && !kept(a).is_empty());
    }
    assert!(
        kept_turns > 0,
        "no read-only turn was `none` with a server's own change kept: the test proved nothing"
    );

    // A crash after the kept turns: the recovered servers are the checkpointed ones, left to
    // run, which nobody can tell from the ones that ran on.
    s.h.kill(&s.id, "", libc::SIGKILL, true).await.unwrap();
    s.h.wait(&s.id, "", std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let (code, out, err) = s.crabctl(&["recover", &s.id]);
    assert_eq!(code, 0, "recover: {out}{err}");
    assert_eq!(
        s.run(GET).await.stdout.trim(),
        "3",
        "the count goes on from the request the checkpoint saw"
    );
    let after_get = s.end_turn().await;
    assert!(
        matches!(after_get["kind"].as_str(), Some("proc" | "full")),
        "a request reached the recovered server: {after_get:#}"
    );
    s.sync().await;

    // Bytes in the poller's FIFO: it reads them (a poll that returned an event, a read).
    reaches(
        &mut s,
        "printf hello > /tmp/feed && for i in $(seq 50); do test -e /tmp/feed-seen && break; sleep 0.1; done && cat /tmp/feed-seen",
        "fifo",
    )
    .await;
    // A signal: the sleeper's handler counts it.
    reaches(
        &mut s,
        "pkill -USR1 -f '[s]ervers.py sig' && for i in $(seq 50); do test -e /tmp/sig-seen && break; sleep 0.1; done && cat /tmp/sig-seen",
        "sig",
    )
    .await;

    // Quiet again afterwards.
    s.run(READ_ONLY).await;
    let a = s.end_turn().await;
    quiet_turn(&a, "read-only turn after the interactions");
    s.finish().await;
}

/// A ticker that wakes every 2 ms and changes its memory each time: awake between a turn end
/// and the process checkpoint that follows, so CRIU dumps it while it runs (the refresh of the
/// mark after a freeze is only for processes idle since the turn end). What the dump does in it
/// is not something that reached it: the parasite's breakpoints raise SIGTRAPs in the traced
/// process, and a syscall the dump skipped exits after the detach. Neither counts: the
/// read-only turn after each process checkpoint keeps the ticker's own change (`none`), or
/// says it caught it `running`, never `interacted`.
const TICKER: &str = r#"cat > /app/servers.py <<'EOF'
import os, signal, time

def say(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)

ticks, signals = [0], [0]
def h(*_):
    signals[0] += 1
    say("/tmp/tick-sig", str(signals[0]))
signal.signal(signal.SIGUSR1, h)
say("/tmp/ready-ticker", "1")
while True:
    ticks[0] += 1
    time.sleep(0.002)
EOF
nohup python3 /app/servers.py ticker >/dev/null 2>&1 &
for i in $(seq 200); do test -e /tmp/ready-ticker && break; sleep 0.05; done"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_server_dumped_while_awake_keeps_its_own_changes_after_the_dump() {
    let opts = SandboxOptions {
        annotations: &[("io.crab/self-contained-changes", "keep")],
        ..SandboxOptions::default()
    };
    let (mut s, _guard) = Sandbox::start("self-contained-ticker", opts).await;
    s.run(TICKER).await;
    let first = s.end_turn().await;
    assert!(
        matches!(first["kind"].as_str(), Some("proc" | "full")),
        "the ticker started: {first:#}"
    );
    s.sync().await;
    let mut kept_turns = 0;
    for round in 1..=3 {
        s.run(READ_ONLY).await;
        let a = s.end_turn().await;
        s.sync().await;
        eprintln!(
            "read-only turn after dump {round}: {} (kept {:?}, not kept {:?})",
            a["kind"],
            kept(&a),
            not_kept(&a)
        );
        let none = quiet_turn(&a, &format!("read-only turn after dump {round}"));
        kept_turns += usize::from(none && !kept(&a).is_empty());
        // A signal reaches it: a process checkpoint again, dumped while it ticks.
        reaches(
            &mut s,
            &format!("pkill -USR1 -f '[s]ervers.py ticker' && for i in $(seq 50); do test \"$(cat /tmp/tick-sig 2>/dev/null)\" = {round} && break; sleep 0.1; done && cat /tmp/tick-sig"),
            "ticker",
        )
        .await;
    }
    assert!(
        kept_turns > 0,
        "no read-only turn after a dump kept the ticker's own change: the test proved nothing"
    );
    s.finish().await;
}

/// The default checkpoints such changes: the same read-only turns are process turns whenever
/// a server's memory moved (and `none` only when none did), and nothing is ever kept.
#[tokio::test(flavor = "multi_thread")]
async fn by_default_an_idle_servers_own_changes_are_checkpointed() {
    let (mut s, _guard) = Sandbox::start("self-contained-off", SandboxOptions::default()).await;
    let answers = servers_then_read_only(&mut s, 4).await;
    let mut proc_turns = 0;
    for (i, a) in answers.iter().enumerate() {
        eprintln!(
            "read-only turn {}: {} (changed {:?})",
            i + 1,
            a["kind"],
            changed(a)
        );
        assert!(kept(a).is_empty(), "{a:#}");
        assert!(
            not_kept(a).is_empty(),
            "no reasons where nothing is kept: {a:#}"
        );
        match a["kind"].as_str() {
            Some("proc") => {
                assert!(!changed(a).is_empty(), "{a:#}");
                proc_turns += 1;
            }
            Some("none") => assert!(changed(a).is_empty(), "{a:#}"),
            other => panic!("read-only turn {}: {other:?}: {a:#}", i + 1),
        }
    }
    eprintln!("{proc_turns} of 4 read-only turns took a process checkpoint");
    // What the policy is for: without it, the servers' own wake-ups cost process checkpoints.
    assert!(
        proc_turns > 0,
        "no server's memory moved by itself in 4 turns: the test proved nothing"
    );
    s.finish().await;
}

/// A FIFO poller and, beside it in the container, a tracer that seized it (`PTRACE_SEIZE`, so
/// the poller runs on) and then only sleeps: the poller is traced across turn ends, by a tracer
/// that makes no ptrace call after the turn that attached it.
const TRACED_POLLER: &str = r#"mkfifo /tmp/feed
cat > /app/servers.py <<'EOF'
import ctypes, os, select, sys, time

def say(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)

def poller():
    fd = os.open("/tmp/feed", os.O_RDWR | os.O_NONBLOCK)
    got = []
    p = select.poll()
    p.register(fd, select.POLLIN)
    say("/tmp/ready-fifo", str(os.getpid()))
    while True:
        if p.poll(500):
            got.append(os.read(fd, 100))

def tracer():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    pid = int(open("/tmp/ready-fifo").read())
    if libc.ptrace(0x4206, pid, None, None) != 0:  # PTRACE_SEIZE
        say("/tmp/ready-tracer", "error %d" % ctypes.get_errno())
        return
    say("/tmp/ready-tracer", "seized %d" % pid)
    while True:
        time.sleep(0.5)

{"fifo": poller, "tracer": tracer}[sys.argv[1]]()
EOF
nohup python3 /app/servers.py fifo >/dev/null 2>&1 &
for i in $(seq 200); do test -e /tmp/ready-fifo && break; sleep 0.05; done
nohup python3 /app/servers.py tracer >/tmp/tracer.log 2>&1 &
for i in $(seq 200); do test -e /tmp/ready-tracer && break; sleep 0.05; done
cat /tmp/ready-tracer 2>/dev/null || cat /tmp/tracer.log"#;

/// A process traced by a tracer inside the container is counted like any other: its syscalls
/// are not CRIU's. Here the tracer attached in an earlier turn and sleeps; the turn that writes
/// to the poller's FIFO (the poller's poll returns an event and it reads the bytes, both while
/// traced) does not keep the poller's change, whatever became of the checkpoint of the turn
/// that attached the tracer (CRIU cannot seize a task that is already traced: each checkpoint
/// fails after CRIU's 10 s seize timeout, so the test takes one such turn).
#[tokio::test(flavor = "multi_thread")]
async fn a_process_traced_from_inside_the_container_is_still_counted() {
    let opts = SandboxOptions {
        annotations: &[("io.crab/self-contained-changes", "keep")],
        ..SandboxOptions::default()
    };
    let (mut s, _guard) = Sandbox::start("self-contained-traced", opts).await;
    let out = s.run(TRACED_POLLER).await.stdout;
    assert!(out.trim().starts_with("seized "), "the tracer: {out}");
    let first = s.end_turn().await;
    assert_ne!(first["kind"], "none", "{first:#}");
    s.sync().await;
    s.run("printf hello > /tmp/feed && sleep 0.6").await;
    let a = s.end_turn().await;
    eprintln!(
        "fifo turn: {} (kept {:?}, not kept {:?})",
        a["kind"],
        kept(&a),
        not_kept(&a)
    );
    assert!(
        not_kept(&a)
            .iter()
            .any(|(cmd, why)| cmd.ends_with("servers.py fifo") && why == "interacted"),
        "bytes reached the traced poller, its change was kept: {a:#}"
    );
    assert!(
        changed_role(&a, "fifo"),
        "the poller's change counts: {a:#}"
    );
    assert_ne!(a["kind"], "none", "{a:#}");
    s.finish().await;
}
