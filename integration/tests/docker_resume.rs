//! Docker's restart policies heal with crab: a container run with `--restart on-failure` and
//! `--annotation io.crab/resume=newest`, killed in the middle of a turn, is restarted by
//! dockerd (same container id, a new task) and comes back as of its last turn end: the files
//! the interrupted turn wrote are gone, the processes of the last turn end run again with
//! their memory, and the sandbox goes on checkpointing in the same store. Both Docker storage
//! modes; the real dockerd, containerd, runc and CRIU.

use std::time::Duration;

use crab_integration::docker::{DockerSandbox, DockerSandboxOptions, Store};
use crab_integration::host;

const KV: &str = r#"cat > /app/kv.py <<'EOF'
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
cat > /app/cli.py <<'EOF'
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection(("127.0.0.1", 9000))
        break
    except OSError:
        time.sleep(0.05)
c.sendall(sys.argv[1].encode())
print(c.recv(65536).decode())
EOF
mkdir -p /app/proj && echo v1 > /app/proj/a.txt"#;

/// `(restart count, pid)` of the container, once it runs.
fn running(s: &DockerSandbox) -> Option<(u64, u32)> {
    let out =
        s.d.inspect(
            &s.id,
            "{{.RestartCount}} {{.State.Running}} {{.State.Restarting}} {{.State.Pid}}",
        )
        .ok()?;
    let f: Vec<&str> = out.split_whitespace().collect();
    match f.as_slice() {
        // While dockerd restarts it, Running is true too.
        [n, "true", "false", pid] => {
            Some((n.parse().ok()?, pid.parse().ok()?)).filter(|(_, p)| *p > 0)
        }
        _ => None,
    }
}

fn restart_policy_heals(store: Store) {
    let (mut s, _guard) = DockerSandbox::start(
        store,
        &format!("dres-{}", store.name()),
        DockerSandboxOptions {
            annotations: &[("io.crab/resume", "newest")],
            run_args: &["--restart", "on-failure"],
            ..DockerSandboxOptions::default()
        },
    );
    s.run(KV);
    s.end_turn();
    s.wait_manifests(1);
    s.run("(nohup python3 /app/kv.py >/dev/null 2>&1 &) ; python3 /app/cli.py 'x = 41'");
    s.end_turn();
    s.run("python3 /app/cli.py 'x += 1' && echo v2 >> /app/proj/a.txt");
    s.end_turn();
    s.wait_manifests(3);
    // The interrupted turn: a file written, a file deleted, a process started, memory changed.
    s.run(
        "echo half > /app/interrupted.txt && rm /app/proj/a.txt && \
         (nohup sleep 1000 >/dev/null 2>&1 &) ; python3 /app/cli.py 'x = 0'",
    );
    let (_, pid) = running(&s).expect("it runs");
    // SAFETY: plain kill(2) of the container's init (not `docker kill`, which dockerd
    // remembers as a stop by hand and does not restart).
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let (restarts, new_pid) = host::eventually(Duration::from_secs(60), || {
        running(&s).filter(|(n, p)| *n >= 1 && *p != pid)
    })
    .unwrap_or_else(|| {
        panic!(
            "dockerd did not restart it ({}): {:?}",
            store.name(),
            s.d.inspect(&s.id, "{{json .State}}")
        )
    });
    assert_eq!(restarts, 1);
    assert_ne!(new_pid, pid);
    let state = s
        .run(
            "cat /app/proj/a.txt; ls /app/interrupted.txt 2>&1; python3 /app/cli.py 'x'; \
             ps -eo args | grep -c '^sleep 1000' || true",
        )
        .stdout;
    assert_eq!(
        state,
        "v1\nv2\nls: cannot access '/app/interrupted.txt': No such file or directory\n42\n0\n",
        "as of the last turn end ({})",
        store.name()
    );
    // The same store goes on: the restore recorded, then a new turn checkpointed.
    let lineage = s.lineage();
    let last = lineage.last().unwrap();
    assert_eq!(last["kind"], "restored", "{lineage:#?}");
    // The probe above was a turn (it asked the server, whose memory then changed).
    let taken = s.manifests().len();
    let probe = s.end_turn();
    assert_eq!(probe["kind"], "proc", "{probe:#}");
    let before = s.wait_manifests(taken + 1).len();
    s.run("echo v3 >> /app/proj/a.txt");
    let answer = s.end_turn();
    assert_eq!(answer["kind"], "fs", "{answer:#}");
    s.wait_manifests(before + 1);
    s.finish();
}

#[test]
fn overlay2_restart_policy_comes_back_as_of_the_last_turn_end() {
    restart_policy_heals(Store::Overlay2);
}

#[test]
fn containerd_store_restart_policy_comes_back_as_of_the_last_turn_end() {
    restart_policy_heals(Store::Containerd);
}
