# The state digest's raw material, gathered inside the sandbox (an exec of `python3 -c`, as root).
# What it means and which parts are noise: integration/src/replay/recovery.rs. Prints one
# tab-separated record a line:
#   file <path> <type f|d|l|o> <mode> <size or -> <sha256 of the content | link target | ->
#   proc <command line>                       (every live process but this one and zombies)
#   port tcp/<port> <what it answers to GET / HTTP/1.0>
import hashlib, os, socket, stat, sys

# Contents hashed here (where agents write: the project, homes, temp, local installs, config);
# anywhere else only type, mode and size (hashing the whole image every digest is too slow).
CONTENT = ("/app", "/root", "/home", "/tmp", "/var/tmp", "/srv", "/opt", "/usr/local", "/etc")
# Never walked: kernel and runtime pseudo-filesystems, caches and logs of the system.
PRUNE = {"/proc", "/sys", "/dev", "/run", "/var/cache", "/var/log"}


def clean(s):
    return s.replace("\t", " ").replace("\n", " ").replace("\r", " ")


def hashed(path):
    return any(path == d or path.startswith(d + "/") for d in CONTENT)


def file_record(path):
    try:
        st = os.lstat(path)
    except OSError:
        return
    mode = "%o" % stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        kind, size, what = "d", "-", "-"
    elif stat.S_ISLNK(st.st_mode):
        kind, size, what = "l", "-", os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        kind, size, what = "f", str(st.st_size), "-"
        if hashed(path):
            h = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    for b in iter(lambda: f.read(1 << 20), b""):
                        h.update(b)
                what = h.hexdigest()
            except OSError as e:
                what = "unreadable:%s" % e.errno
    else:
        kind, size, what = "o", "-", "-"
    print("file\t%s\t%s\t%s\t%s\t%s" % (clean(path), kind, mode, size, clean(what)))


def files():
    for root, dirs, names in os.walk("/"):
        dirs[:] = sorted(d for d in dirs if os.path.join(root, d) not in PRUNE)
        for n in sorted(dirs) + sorted(names):
            file_record(os.path.join(root, n))


def procs():
    me = os.getpid()
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me:
            continue
        try:
            with open("/proc/%s/stat" % p) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open("/proc/%s/cmdline" % p, "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
        except (OSError, IndexError):
            continue
        # Zombies: exited children the init (`sleep infinity`) never reaps; argv-less: kernel threads.
        if state in ("Z", "X") or argv == [b""]:
            continue
        print("proc\t%s" % clean(" ".join(a.decode("utf-8", "replace") for a in argv)))


def ports():
    found = set()
    for t in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(t) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for l in lines:
            c = l.split()
            if len(c) > 3 and c[3] == "0A":
                found.add(int(c[1].rsplit(":", 1)[1], 16))
    for port in sorted(found):
        print("port\ttcp/%d\t%s" % (port, clean(ask(port))))


def ask(port):
    for host in ("127.0.0.1", "::1"):
        try:
            s = socket.create_connection((host, port), timeout=3)
        except OSError:
            continue
        data = b""
        try:
            s.settimeout(3)
            s.sendall(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
            while len(data) < (1 << 20):
                b = s.recv(65536)
                if not b:
                    break
                data += b
        except OSError as e:
            if not data:
                return "no answer (%s)" % type(e).__name__
        finally:
            s.close()
        if data.startswith(b"HTTP/"):
            head, _, body = data.partition(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0].decode("latin-1")
            return "%s body sha256:%s" % (status, hashlib.sha256(body).hexdigest()[:16])
        return "raw sha256:%s (%d bytes)" % (hashlib.sha256(data).hexdigest()[:16], len(data))
    return "refused"


files()
procs()
ports()
sys.stdout.flush()
