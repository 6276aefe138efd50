"""The resident agent of a docker sandbox: runs one command per request, then proves the container clean.

Standalone, stdlib only: the host starts it as the container's main process (under
`docker-init`) with `python3 -I -S -c <this file's source>` (the sandbox image carries
no project code, so the source travels in the container's command and is always the
host's version), attaches to the container's stdin/stdout (the container has no
network) and talks to it with the framed protocol below. `python3 -I -S
docker_agent.py` works as well (that is how the tests run it outside docker).

Protocol (both directions: a 4-byte big-endian length, then the payload):
- host -> agent: `marshal` data (the host is the only writer of the agent's stdin),
  `{"op": "ping"}` or `{"op": "run", "files": [(path, bytes)...], "argv": [...] |
  "python": path, "timeout": s, "cap": bytes per stream, "report": [paths], "limits":
  {"cpu": s, "fsize": bytes, "nofile": n}}`.
- agent -> host: `REPLY` (fixed fields, no object decoding on the host) + stdout +
  stderr + message. The first frame, unasked, is a `hello`.

One `run`:
1. The agent (uid 0) writes `files` in order into /work with its effective uid set to
   the sandbox user (65534): `seteuid` only, its real and saved uid stay 0.
2. A child forked BEFORE this request was read (the "zygote": it never held these
   files, so a Python-level candidate cannot find the nonce or the tests in its memory)
   gets the command: it drops to 65534 for good (`setgroups([])`, `setresgid`,
   `setresuid`: every capability is gone, `no-new-privileges` keeps it that way), sets
   rlimits (cpu, fsize, nofile, core 0) and oom_score_adj 1000, gets /dev/null as stdin
   and two fresh pipes as stdout/stderr, closes every other fd (the host stream is
   never reachable from it), `cd /work`, then either execs `argv` or, for `python`,
   runs that file as `__main__` in its own pre-imported interpreter (the equivalent of
   `python3 -I -S <file>` without the ~20 ms start: modules the agent itself imported
   beyond a fresh `-I -S` interpreter + `typing`/`math` are dropped from sys.modules
   first).
3. The agent reads the pipes (head and tail kept up to `cap`) until the child exits or
   the deadline passes (`timed_out`, exit 137), then `kill(-1, SIGKILL)` until no
   process but pid 1 (docker-init) and itself is left: every process the command
   started, daemons included. It reports which `report` paths exist at that point.
4. Wipe and proof (as 65534 again): `/work`, `/tmp` and `/dev/mqueue` emptied (modes
   repaired first), SysV IPC removed (`ipcrm -a`, only when /proc/sysvipc lists
   something), then checked: the dirs are empty, /proc/sysvipc is empty, the only pids
   are 1 and the agent. The reply carries `clean`; the host discards a container that
   is not clean. Then the next zygote is forked and the agent reads the next request.

Threat model (the command is hostile; the agent and the host are trusted):
- Capabilities: the container drops all and adds back only SETUID, SETGID (to become
  65534) and KILL (to kill 65534's processes without needing a fork, so a fork bomb at
  the pids limit cannot stop the clean-up). The agent is uid 0 with only those; it
  runs no untrusted code. `no-new-privileges`, a read-only root, no network, Docker's
  default seccomp profile, memory/pids/cpu limits stay as for the exec containers.
- A command runs as 65534 with no capabilities and cannot signal or ptrace the agent
  (different real/saved uid; the agent's /proc entries are not its own), nor
  docker-init. It never holds an fd of the host stream, so it cannot forge a reply:
  everything it writes reaches the host only as capped stdout/stderr inside the
  agent's frame. It cannot stop the clean-up: the agent never waits on it beyond the
  deadline and kills with its own CAP_KILL.
- Nothing of one request reaches the next: processes are killed, the writable places
  (/work, /tmp, /dev/mqueue, SysV IPC; the root is read-only) are wiped and proven
  empty, the next command starts in a fresh process forked from the agent. A request's
  secrets (the verifier's nonce file) are read by the agent after the zygote that runs
  it was forked, so they are on disk only; residue of *earlier* requests may linger in
  freed agent memory that the zygote inherited (used nonces, no value).
- The agent's memory is small; a command that exhausts the container's memory is the
  OOM killer's first choice (oom_score_adj 1000, and it holds the memory). If the agent
  dies or stops answering anyway, the host sees it (EOF / deadline), kills the
  container and reports an infrastructure error; it never turns into a verdict.
"""

import builtins  # noqa: F401 - in every interpreter anyway
import io
import marshal
import os
import select
import stat
import struct
import sys
import time

# what a fresh `python3 -I -S harness.py` holds once the harness imported its modules
for _name in ("typing", "math", "_sha256"):
    try:
        __import__(_name)
    except ImportError:  # pragma: no cover
        pass
BASE_MODULES = frozenset(sys.modules)

VERSION = 1
USER = 65534
WORK = "/work"
WIPE_DIRS = ("/work", "/tmp", "/dev/mqueue")
MAX_REQUEST = 256 * 1024 * 1024
HEADER = struct.Struct(">I")
REPLY = struct.Struct(">BiBIdIIII")
"""kind, exit_code, flags, oom_kills, duration_s, exists mask, len stdout, len stderr, len message."""
HELLO, RESULT, ERROR = 0, 1, 2
TIMED_OUT, TRUNC_OUT, TRUNC_ERR, CLEAN = 1, 2, 4, 8
OOM_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")
CHILD_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": WORK,
             "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


try:
    from _sha256 import sha256
except ImportError:  # pragma: no cover - other interpreters
    from hashlib import sha256

CODE_CACHE = {}
"""(sha256 of the source, path) -> code object of a `python` file a request ran (e.g. the
verifier's harness: compiling it costs more than running it). Filled by the agent after a
run, so later zygotes inherit it; a file whose bytes differ is compiled afresh."""
CODE_CACHE_MAX = 8


def remember_code(req):
    path = req.get("python")
    source = next((bytes(data) for p, data in req.get("files") or () if p == path), None)
    if source is None:
        return
    key = (sha256(source).digest(), path)
    if key in CODE_CACHE:
        return
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return
    if len(CODE_CACHE) >= CODE_CACHE_MAX:
        CODE_CACHE.pop(next(iter(CODE_CACHE)))
    CODE_CACHE[key] = code


# ------------------------------------------------------------------ framing
def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send(kind, exit_code=0, flags=0, oom=0, duration=0.0, exists=0, out=b"", err=b"", msg=b""):
    head = REPLY.pack(kind, exit_code, flags, oom, duration, exists, len(out), len(err), len(msg))
    body = head + out + err + msg
    write_all(1, HEADER.pack(len(body)) + body)


class HeadTail:
    """Keeps the first cap//2 and last cap - cap//2 bytes of a stream."""

    def __init__(self, cap):
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk):
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_cap:
            self.tail += chunk
            if len(self.tail) > self.tail_cap:
                del self.tail[:len(self.tail) - self.tail_cap]

    def value(self):
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped <= 0:
            return bytes(self.head + self.tail), False
        return bytes(self.head) + ("\n...[truncated %d bytes]...\n" % dropped).encode() + bytes(self.tail), True


# ------------------------------------------------------------------ the zygote (child side)
def run_python(path):
    """Run `path` as __main__ like `python3 -I -S path`; returns the exit status."""
    for name in set(sys.modules) - BASE_MODULES:
        del sys.modules[name]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                   encoding="utf-8", errors="backslashreplace",
                                                   line_buffering=True)
    sys.argv = [path]
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        compiled = CODE_CACHE.get((sha256(source).digest(), path))
        if compiled is None:
            compiled = compile(source, path, "exec", dont_inherit=True)
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            sys.stderr.write("%s\n" % (exc.code,))
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return code


def zygote(go_fd, out_fd, err_fd):
    """Wait for a command, become the sandbox user, run it (never returns)."""
    head = read_exact(go_fd, 4)
    if head is None:
        os._exit(0)
    req = marshal.loads(read_exact(go_fd, HEADER.unpack(head)[0]))
    import resource

    lim = req.get("limits") or {}
    for res, value in ((resource.RLIMIT_CPU, lim.get("cpu")), (resource.RLIMIT_FSIZE, lim.get("fsize")),
                       (resource.RLIMIT_NOFILE, lim.get("nofile")), (resource.RLIMIT_CORE, 0)):
        if value is None:
            continue
        hard = resource.getrlimit(res)[1]
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        # cpu: SIGXCPU at the soft limit, SIGKILL a second later
        top = value + 1 if res == resource.RLIMIT_CPU else value
        resource.setrlimit(res, (value, top if hard == resource.RLIM_INFINITY else min(top, hard)))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    os.setgroups([])
    os.setresgid(USER, USER, USER)
    os.setresuid(USER, USER, USER)
    if os.getresuid() != (USER, USER, USER) or os.getresgid() != (USER, USER, USER):
        os._exit(126)
    os.umask(0o022)
    os.chdir(WORK)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.closerange(3, 1 << 16)
    os.environ.clear()
    os.environ.update(CHILD_ENV)
    if req.get("python"):
        code = run_python(req["python"])
        os._exit(code)
    argv = [str(a) for a in req["argv"]]
    import _signal

    for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # Python ignores them; a command expects the default
        _signal.signal(sig, _signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, dict(CHILD_ENV))
    except OSError as exc:
        os.write(2, ("rlbus-agent: cannot run %s: %s\n" % (argv[0], exc.strerror)).encode())
        os._exit(127 if exc.errno == 2 else 126)


class Zygote:
    """The agent's handle on a pre-forked child."""

    def __init__(self):
        go_r, go_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)
                os.close(out_r)
                os.close(err_r)
                zygote(go_r, out_w, err_w)
            finally:
                os._exit(125)
        for fd in (go_r, out_w, err_w):
            os.close(fd)
        self.pid, self.go, self.out, self.err = pid, go_w, out_r, err_r
        self.status = None
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # pragma: no cover - old kernel/Python: poll instead
            self.pidfd = None

    def close(self):
        for fd in (self.go, self.out, self.err, self.pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.go = self.out = self.err = self.pidfd = None

    def poll(self):
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid:
                self.status = status
        return self.status is not None


# ------------------------------------------------------------------ the agent's own work
class AsUser:
    """Effective uid/gid 65534 for file work (real and saved uid stay 0)."""

    def __enter__(self):
        os.setegid(USER)
        os.seteuid(USER)

    def __exit__(self, *exc):
        os.seteuid(0)
        os.setegid(0)


def safe_path(path):
    if path.startswith(WORK + "/"):
        path = path[len(WORK) + 1:]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or path.startswith("/"):
        raise ValueError("bad path %r" % path)
    return parts


def write_files(files):
    with AsUser():
        for path, data in files:
            parts = safe_path(path)
            d = WORK
            for part in parts[:-1]:
                d = d + "/" + part
                try:
                    os.mkdir(d, 0o755)
                except FileExistsError:
                    if os.path.islink(d) or not os.path.isdir(d):
                        raise ValueError("not a directory: %r" % d) from None
            fd = os.open(d + "/" + parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)


def oom_kills():
    for name in OOM_FILES:
        try:
            with open(name) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def others():
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def kill_all(z, wait_s=3.0):
    """SIGKILL every process but pid 1 and the agent, reap ours; True once none is left."""
    end = time.monotonic() + wait_s
    delay = 0.0005
    while True:
        try:
            os.kill(-1, 9)
        except OSError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if z is not None and pid == z.pid and z.status is None:
                z.status = status
        if not others():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def remove_tree(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
        for entry in os.listdir(path):
            remove_tree(path + "/" + entry)
        os.rmdir(path)
    else:
        os.unlink(path)


def ipc_left():
    left = []
    for kind in ("shm", "msg", "sem"):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        left += ["%s %s" % (kind, r.split()[1] if len(r.split()) > 1 else "?") for r in rows if r.strip()]
    return left


def run_ipcrm():
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(USER, USER, USER)
            os.setresuid(USER, USER, USER)
            fd = os.open("/dev/null", os.O_RDWR)
            for i in (0, 1, 2):
                os.dup2(fd, i)
            os.closerange(3, 1 << 16)
            os.execvpe("ipcrm", ["ipcrm", "-a"], dict(CHILD_ENV))
        finally:
            os._exit(127)
    os.waitpid(pid, 0)


def _entries(d, problems):
    """Names in directory `d` ([] if it does not exist; an unreadable one is a problem)."""
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []
    except OSError as exc:
        problems.append("list %s: %s" % (d, exc.strerror))
        return []


def wipe_and_prove():
    """Empty the writable places as 65534, then prove it; returns the problems found."""
    problems = []
    with AsUser():
        try:
            os.chmod(WORK, 0o700)
        except OSError as exc:
            problems.append("chmod /work: %s" % exc.strerror)
        for d in WIPE_DIRS:
            for entry in _entries(d, problems):
                try:
                    remove_tree(d + "/" + entry)
                except OSError:
                    pass
        for d in WIPE_DIRS:
            problems += ["left %s/%s" % (d, e) for e in _entries(d, problems)[:5]]
    if ipc_left():
        run_ipcrm()
        problems += ipc_left()
    if others():
        problems += ["pid %d" % p for p in others()[:5]]
    return problems


def run(req, z):
    t0 = time.monotonic()
    timeout = max(float(req.get("timeout", 30.0)), 0.001)
    cap = int(req.get("cap", 1 << 20))
    out, err = HeadTail(cap), HeadTail(cap)
    try:
        write_files(req.get("files") or [])
    except (OSError, ValueError) as exc:
        problems = [] if kill_all(z) else ["processes survive"]
        problems += wipe_and_prove()
        flags = 0 if problems else CLEAN
        send(ERROR, flags=flags, msg=("cannot write the files: %s" % exc).encode())
        return not problems
    before = oom_kills()
    go = marshal.dumps({k: req.get(k) for k in ("argv", "python", "limits")}, 4)
    try:
        write_all(z.go, HEADER.pack(len(go)) + go)
    except OSError:
        pass
    deadline = t0 + timeout
    timed_out = False
    open_fds = {z.out: out, z.err: err}
    watch = [z.pidfd] if z.pidfd is not None else []
    while True:
        if z.poll():
            break
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = not z.poll()
            break
        ready, _, _ = select.select(list(open_fds) + watch, [], [], min(left, 0.05 if not watch else left))
        for fd in ready:
            if fd in open_fds:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    open_fds[fd].feed(chunk)
                else:
                    del open_fds[fd]
    killed = kill_all(z)
    for fd, buf in list(open_fds.items()):  # every writer is dead (or reported): drain
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            r, _, _ = select.select([fd], [], [], 0.1)
            if not r:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf.feed(chunk)
    z.close()
    exists = 0
    with AsUser():
        for i, path in enumerate((req.get("report") or [])[:32]):
            try:
                if os.path.lexists(WORK + "/" + "/".join(safe_path(path))):
                    exists |= 1 << i
            except ValueError:
                pass
    oom = max(0, oom_kills() - before)
    problems = ([] if killed else ["processes survive the kill"]) + wipe_and_prove()
    if timed_out:
        code = 137
    elif z.status is None:
        code = 137
    else:
        code = os.waitstatus_to_exitcode(z.status)
        code = 128 - code if code < 0 else code
    out_b, out_t = out.value()
    err_b, err_t = err.value()
    flags = (TIMED_OUT if timed_out else 0) | (TRUNC_OUT if out_t else 0) | (TRUNC_ERR if err_t else 0) \
        | (0 if problems else CLEAN)
    send(RESULT, code, flags, oom, time.monotonic() - t0, exists, out_b, err_b, "; ".join(problems).encode())
    return not problems


def main():
    os.chdir("/")
    z = None
    problems = ([] if os.getuid() == 0 else ["agent is not root"])
    if not kill_all(None, 1.0):
        problems.append("foreign processes")
    problems += wipe_and_prove()
    send(HELLO, VERSION, 0 if problems else CLEAN, msg=("; ".join(problems) or "pid %d" % os.getpid()).encode())
    if problems:
        return 1
    z = Zygote()
    while True:
        head = read_exact(0, 4)
        if head is None:
            return 0
        n = HEADER.unpack(head)[0]
        if n > MAX_REQUEST:
            return 2
        data = read_exact(0, n)
        if data is None:
            return 0
        req = marshal.loads(data)
        del data
        if req.get("op") == "ping":
            send(HELLO, VERSION, CLEAN)
            continue
        if req.get("op") != "run":
            send(ERROR, msg=b"unknown op")
            continue
        clean = run(req, z)
        if clean and req.get("python"):
            remember_code(req)
        del req
        if not clean:
            return 3  # the host discards this container
        z = Zygote()


if __name__ == "__main__":
    sys.exit(main())
