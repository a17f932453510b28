"""A scripted mini-swe-agent episode on crab through Docker Engine.

mini-swe-agent's DefaultAgent drives a DockerEnvironment whose container runs under crab
(`--runtime io.containerd.crab.v1`) with the exec turn boundary
(`--annotation io.crab/turn-boundary=exec`): every action is one `docker exec`, so every action
is one crab turn. The model is mini-swe-agent's DeterministicModel replaying the steps below,
each with the turn answer crab must give for it (none/fs/proc/full).

  python episode.py run --report phase1.json
      phase 1: edits files, makes and installs a local package, starts a background server;
      leaves the container running and writes its id, the steps' outputs and the expected
      answers to the report
  python episode.py resume --image CHECKPOINT_IMAGE --report phase2.json
      phase 2, in a container started from a checkpoint image (`crabctl export`): the server,
      the package and the files of phase 1 are there; the remaining steps succeed
  python episode.py demo --crabctl PATH
      both phases, with the sandbox killed in between and brought back from crab's newest
      checkpoint (`crabctl export` + `docker run`); prints what happened
  python episode.py heal --report heal.json
      one episode through two crashes, with the crash-proof recipe (`--restart on-failure
      --annotation io.crab/resume=newest`): each crash kills the sandbox's init from the host
      in the middle of a turn, dockerd restarts it, crab resumes it as of its last turn end,
      and the agent carries on (files, git, sqlite, directory modes, processes, memory)

The docker CLI is --docker (default /usr/bin/docker) and talks to DOCKER_HOST.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.docker import DockerEnvironment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo {}"

# An in-tree PEP 517 backend: the agent image has pip but no setuptools, and nothing can be
# downloaded (`pip install --no-index`), so the package builds its wheel with the standard
# library.
MAKE_PACKAGE = r"""mkdir -p /app/pkg/tinypkg && cd /app/pkg
cat > pyproject.toml <<'EOF'
[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]
EOF
cat > tinypkg/__init__.py <<'EOF'
def answer():
    return 42
EOF
cat > backend.py <<'EOF'
import base64, hashlib, os, zipfile

NAME, VERSION = "tinypkg", "0.1"
DIST = NAME + "-" + VERSION + ".dist-info"


def _record(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel = NAME + "-" + VERSION + "-py3-none-any.whl"
    with open(os.path.join(NAME, "__init__.py"), "rb") as f:
        init = f.read()
    files = {
        NAME + "/__init__.py": init,
        DIST + "/METADATA": ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (NAME, VERSION)).encode(),
        DIST + "/WHEEL": b"Wheel-Version: 1.0\nGenerator: backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record(p, d) for p, d in files.items()] + [DIST + "/RECORD,,"]
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(DIST + "/RECORD", "\n".join(record) + "\n")
    return wheel
EOF
ls -R /app/pkg"""

FETCH = (
    "python3 -c \"import urllib.request; "
    "print(urllib.request.urlopen('http://127.0.0.1:8123/proj/calc.py').read().decode())\""
)

# (command, the turn answer crab must give, what its output must contain)
PHASE1 = [
    ("cat /etc/os-release | head -n1", "none", "PRETTY_NAME"),
    (
        "mkdir -p /app/proj && printf 'def add(a, b):\\n    return a - b\\n' > /app/proj/calc.py",
        "fs",
        "",
    ),
    ("sed -i 's/a - b/a + b/' /app/proj/calc.py && cat /app/proj/calc.py", "fs", "a + b"),
    (MAKE_PACKAGE, "fs", "backend.py"),
    (
        "pip install --no-index --break-system-packages --root-user-action=ignore ./pkg",
        "fs",
        "Successfully installed tinypkg-0.1",
    ),
    (
        "python3 -c 'import tinypkg; print(\"answer\", tinypkg.answer())' && cat /app/proj/calc.py",
        "none",
        "answer 42",
    ),
    (
        "nohup python3 -m http.server 8123 --bind 127.0.0.1 --directory /app >/dev/null 2>&1 & sleep 1",
        "proc",
        "",
    ),
    ("echo 'fixed add' > /app/notes.txt; nohup sleep 5000 >/dev/null 2>&1 & sleep 0.2", "full", ""),
    (SUBMIT.format("phase1"), "none", "phase1"),
]

# After the restore: the server (a restored process with its listening socket), the installed
# package and the files are there.
PHASE2 = [
    (FETCH, None, "a + b"),
    ("python3 -c 'import tinypkg; print(\"answer\", tinypkg.answer())'", None, "answer 42"),
    ("cat /app/notes.txt && pgrep -f 'sleep 5000' >/dev/null && echo sleeper-alive", None, "sleeper-alive"),
    (SUBMIT.format("phase2"), None, "phase2"),
]

# A server holding a counter in memory (nothing on disk), and its client.
COUNTER = r"""cat > /app/counter.py <<'EOF'
import http.server
n = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global n
        n += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(str(n).encode())
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 8124), H).serve_forever()
EOF
cat > /app/ask.py <<'EOF'
import urllib.request
print("counter", urllib.request.urlopen("http://127.0.0.1:8124/").read().decode())
EOF
nohup python3 /app/counter.py >/dev/null 2>&1 &
sleep 1"""

# No automatic maintenance: git 2.47 (Debian trixie) detaches `git maintenance run --auto`
# after a commit, a process that may still be alive when a busy host ends the turn (crab then
# rightly answers `full`, and the next turn, in which it exits, too): the oracle counts only the
# agent's own processes.
GIT = "git -c user.email=agent@example.com -c user.name=agent -c maintenance.auto=false"
SQL = "python3 -c \"import sqlite3; c = sqlite3.connect('/app/db.sqlite'); {}; c.commit()\""
COUNT_ROWS = SQL.format("print('rows', c.execute('select count(*) from t').fetchone()[0])")
VERIFY = (
    "cat /app/proj/calc.py && " + f"echo commits $({GIT} -C /app/proj rev-list --count HEAD) && "
    + COUNT_ROWS + " && stat -c '%n %a' /tmp /app/private && "
    "test ! -e /app/interrupted.txt && echo interrupted-turn-rolled-back && "
    "pgrep -f 'sleep 5000' >/dev/null && echo sleeper-alive"
)
CRASH = "#crash"

# The crash-proof episode: (command, the turn answer crab must give, what its output must
# contain). CRASH is no action of the agent's: the harness kills the sandbox from the host.
HEAL = [
    ("cat /etc/os-release | head -n1", "none", "PRETTY_NAME"),
    (
        "mkdir -p /app/proj && cd /app/proj && printf 'def add(a, b):\\n    return a - b\\n' > calc.py && "
        f"git init -q && {GIT} add . && {GIT} commit -qm init && echo ok",
        "fs",
        "ok",
    ),
    (f"cd /app/proj && sed -i 's/a - b/a + b/' calc.py && {GIT} commit -qam fix && cat calc.py", "fs", "a + b"),
    (SQL.format("c.execute('create table t(x)'); c.execute('insert into t values (1)')"), "fs", ""),
    ("mkdir -m 700 /app/private && echo s > /app/private/s && echo t > /tmp/scratch.txt && echo ok", "fs", "ok"),
    (COUNTER + "; nohup sleep 5000 >/dev/null 2>&1 & sleep 0.2", "full", ""),
    ("python3 /app/ask.py", "proc", "counter 1"),
    ("python3 /app/ask.py", "proc", "counter 2"),
    (CRASH, None, "crashed and restarted"),
    (VERIFY, "none", "interrupted-turn-rolled-back"),
    ("python3 /app/ask.py", "proc", "counter 3"),
    (f"echo 'after crash 1' >> /app/notes.txt && cd /app/proj && echo '# checked' >> calc.py && {GIT} commit -qam check && echo ok", "fs", "ok"),
    (SQL.format("c.execute('insert into t values (2)')"), "fs", ""),
    (CRASH, None, "crashed and restarted"),
    (VERIFY + " && cat /app/notes.txt", "none", "after crash 1"),
    ("python3 /app/ask.py", "proc", "counter 4"),
    (SUBMIT.format("healed"), "none", "healed"),
]

# What the verifications must print, in order (checked beyond `want`).
HEAL_VERIFY = [
    ["a + b", "commits 2", "rows 1", "/tmp 1777", "/app/private 700", "sleeper-alive"],
    ["commits 3", "rows 2", "/tmp 1777", "/app/private 700", "sleeper-alive", "after crash 1"],
]

CONFIG = {
    "system_template": "You are a scripted agent on crab.",
    "instance_template": "{{task}}",
    "step_limit": 0,
    "cost_limit": 0,
}


class RecordingDockerEnvironment(DockerEnvironment):
    """DockerEnvironment that keeps every action's result; with `image_cmd` unset, the
    container runs its image's own command (a checkpoint image restores its processes)."""

    def __init__(self, *, keep_image_cmd=False, **kwargs):
        self.keep_image_cmd = keep_image_cmd
        self.results = []
        super().__init__(**kwargs)

    def _start_container(self):
        if not self.keep_image_cmd:
            return super()._start_container()
        cmd = [self.config.executable, "run", "-d", "-w", self.config.cwd, *self.config.run_args, self.config.image]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=self.config.pull_timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")
        self.container_id = result.stdout.strip()

    def execute(self, action, cwd="", *, timeout=None):
        try:
            out = super().execute(action, cwd, timeout=timeout)
        except Submitted as e:  # the last action, which succeeded: its output is the submission
            output = e.messages[0].get("content", "") if e.messages else ""
            self.results.append({"command": action["command"], "returncode": 0, "output": output})
            raise
        self.results.append({"command": action["command"], "returncode": out["returncode"], "output": out["output"]})
        return out


def run_args(runtime):
    return ["--rm", "--runtime", runtime, "--annotation", "io.crab/turn-boundary=exec"]


# The crash-proof recipe (README, "Surviving crashes and node loss"): dockerd restarts a
# crashed sandbox and crab resumes it as of its last turn end.
def heal_run_args(runtime):
    return ["--runtime", runtime, "--restart", "on-failure",
            "--annotation", "io.crab/turn-boundary=exec", "--annotation", "io.crab/resume=newest"]


def docker_state(docker, cid):
    out = subprocess.run(
        [docker, "inspect", "-f", "{{.RestartCount}} {{.State.Running}} {{.State.Restarting}} {{.State.Pid}}", cid],
        capture_output=True, text=True,
    ).stdout.split()
    if len(out) != 4:
        return None
    return int(out[0]), out[1] == "true" and out[2] == "false" and int(out[3]) > 0, int(out[3])


class CrashingDockerEnvironment(RecordingDockerEnvironment):
    """Executes CRASH by killing the sandbox in the middle of a turn: a `docker exec` writes
    /app/interrupted.txt and sleeps, and the container's init is killed from the host (as an
    OOM kill or a crashed runtime would; `docker kill` would count as a stop by hand, which
    restart policies leave alone). Then waits for dockerd's restart."""

    def __init__(self, *, docker, **kwargs):
        self.docker = docker
        self.crashes = []
        super().__init__(**kwargs)

    def execute(self, action, cwd="", *, timeout=None):
        if action["command"] != CRASH:
            return super().execute(action, cwd, timeout=timeout)
        before = docker_state(self.docker, self.container_id)
        interrupted = subprocess.Popen(
            [self.docker, "exec", self.container_id, "bash", "-c", "echo half > /app/interrupted.txt; sleep 300"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # Watched from the host (an exec would be a turn of its own).
        written = f"/proc/{before[2]}/root/app/interrupted.txt"
        deadline = time.time() + 10
        while time.time() < deadline and not os.path.exists(written):
            time.sleep(0.05)
        os.kill(before[2], signal.SIGKILL)
        interrupted.wait(timeout=60)
        deadline = time.time() + 120
        state = None
        while time.time() < deadline:
            state = docker_state(self.docker, self.container_id)
            if state and state[0] > before[0] and state[1] and state[2] != before[2]:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"dockerd did not restart the sandbox: {state}")
        self.crashes.append({"killed_pid": before[2], "restart_count": state[0], "new_pid": state[2]})
        out = {"output": f"crashed and restarted ({state[0]})", "returncode": 0, "exception_info": ""}
        self.results.append({"command": CRASH, **out})
        return out


def episode(env, steps, task):
    model = DeterministicModel(outputs=[make_output(f"step {i + 1}", [{"command": c}]) for i, (c, _, _) in enumerate(steps)])
    agent = DefaultAgent(model, env, **CONFIG)
    result = agent.run(task)
    failures = []
    for i, ((command, _, want), got) in enumerate(zip(steps, env.results)):
        if got["returncode"] != 0 or want not in got["output"]:
            failures.append({"step": i + 1, "command": command, "want": want, **got})
    if len(env.results) != len(steps):
        failures.append({"error": f"{len(env.results)} actions ran, {len(steps)} expected"})
    return {
        "container_id": env.container_id,
        "exit_status": result.get("exit_status"),
        "steps": env.results,
        "expect": [kind for _, kind, _ in steps],
        "failures": failures,
    }


def phase1(args):
    env = RecordingDockerEnvironment(
        image=args.image, cwd="/app", executable=args.docker, run_args=run_args(args.runtime), timeout=120
    )
    report = episode(env, PHASE1, "phase 1: fix add, install tinypkg, serve /app")
    env.container_id = None  # leave the sandbox running: the caller kills it
    return report


def phase2(args):
    env = RecordingDockerEnvironment(
        image=args.image,
        cwd="/app",
        executable=args.docker,
        run_args=run_args(args.runtime),
        timeout=120,
        keep_image_cmd=True,
    )
    try:
        return episode(env, PHASE2, "phase 2: check the work survived")
    finally:
        subprocess.run([args.docker, "rm", "-f", env.container_id], capture_output=True)
        env.container_id = None


def heal(args):
    env = CrashingDockerEnvironment(
        image=args.image, cwd="/app", executable=args.docker, run_args=heal_run_args(args.runtime),
        timeout=120, docker=args.docker,
    )
    try:
        report = episode(env, HEAL, "heal: work through two crashes")
        verify = [r["output"] for (c, _, _), r in zip(HEAL, env.results) if c.startswith(VERIFY)]
        for i, (out, wants) in enumerate(zip(verify, HEAL_VERIFY)):
            for want in wants:
                if want not in out:
                    report["failures"].append({"verify": i + 1, "want": want, "output": out})
        if len(verify) != len(HEAL_VERIFY):
            report["failures"].append({"error": f"{len(verify)} verifications ran"})
        report["crashes"] = env.crashes
        # The turns crab answers: every step but the crashes.
        report["expect"] = [kind for c, kind, _ in HEAL if c != CRASH]
        report["commands"] = [c for c, _, _ in HEAL if c != CRASH]
        return report
    finally:
        if not args.keep and env.container_id:
            subprocess.run([args.docker, "rm", "-f", env.container_id], capture_output=True)
            env.container_id = None


def demo(args):
    first = phase1(args)
    print(json.dumps({k: first[k] for k in ("container_id", "exit_status", "failures")}, indent=2))
    cid = first["container_id"]
    subprocess.run([args.crabctl, "--namespace", args.namespace, "turns", cid], check=True)
    subprocess.run([args.docker, "kill", cid], check=True, capture_output=True)
    print(f"killed {cid}; exporting crab's newest checkpoint as {args.checkpoint_image}")
    # --rm removed the container with the kill: the base layers come from the image it ran.
    subprocess.run(
        [args.crabctl, "--namespace", args.namespace, "export", cid, "--base-image", args.image, args.checkpoint_image],
        check=True,
    )
    args.image = args.checkpoint_image
    second = phase2(args)
    print(json.dumps({k: second[k] for k in ("exit_status", "failures")}, indent=2))
    return {"phase1": first, "phase2": second}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["run", "resume", "demo", "heal"])
    p.add_argument("--image", default="localhost/crab/agent:latest")
    p.add_argument("--runtime", default="io.containerd.crab.v1")
    p.add_argument("--docker", default="/usr/bin/docker")
    p.add_argument("--crabctl", default="crabctl")
    p.add_argument("--namespace", default="moby", help="Docker's containerd namespace (demo)")
    p.add_argument("--checkpoint-image", default="localhost/crab/mini-swe-agent-restored:latest")
    p.add_argument("--report", help="write the report (JSON) here")
    p.add_argument("--keep", action="store_true", help="heal: leave the sandbox (the caller removes it)")
    args = p.parse_args()
    report = {"run": phase1, "resume": phase2, "demo": demo, "heal": heal}[args.mode](args)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
    failed = report.get("failures") or any(r.get("failures") for r in report.values() if isinstance(r, dict))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
