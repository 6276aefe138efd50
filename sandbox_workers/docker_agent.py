"""The resident agent of a docker sandbox: runs one command per request, then proves the container clean.

Standalone, stdlib only (Python 3.9+), in three parts joined into one program, in this
order: `sandbox_workers.docker_agent_protocol` (the frames both sides speak),
`sandbox_workers.docker_agent_clean` (the agent's file work, kill, wipe and proof) and
this module (the zygote, one run, the request loop). The sandbox image carries no
project code: the host joins the parts (`sandbox_workers.docker_oneshot.agent_source`,
which drops their imports of each other) and starts the program as the container's
main process (under `docker-init`) with `python3 -I -S -c <program>`, so the agent is
always the host's version. It attaches to the container's stdin/stdout (the container
has no network) and speaks the protocol of `docker_agent_protocol`. From the repository
root, `python3 -S -m sandbox_workers.docker_agent` runs the same code from the package
(only ever inside a throwaway container: it kills every process it can and empties
/work and /tmp).

One `run` (any other op gets an `ERROR` reply):
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
   is not clean, and the agent exits after such a reply. Then the next zygote is forked
   and the agent reads the next request.
A request whose files cannot be written gets an `ERROR` reply after the same kill,
wipe and proof (steps 3-4); nothing runs.

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

import builtins  # in every interpreter anyway
import io
import marshal
import os
import select
import sys
import time

from sandbox_workers.docker_agent_clean import (
    CHILD_ENV,
    USER,
    WORK,
    kill_all,
    oom_kills,
    report_exists,
    wipe_and_prove,
    write_files,
)
from sandbox_workers.docker_agent_protocol import (
    CLEAN,
    ERROR,
    HEADER,
    HELLO,
    MAX_REQUEST,
    RESULT,
    TIMED_OUT,
    TRUNC_ERR,
    TRUNC_OUT,
    VERSION,
    HeadTail,
    read_exact,
    send,
    write_all,
)

# what a fresh `python3 -I -S harness.py` holds once the harness imported its modules
# (computed after every part's imports: the joined program imports them all above this)
for _name in ("typing", "math", "_sha256"):
    try:
        __import__(_name)
    except ImportError:  # pragma: no cover
        pass
BASE_MODULES = frozenset(sys.modules)

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
    path = req["python"]
    source = next((bytes(data) for p, data in req["files"] if p == path), None)
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


# ------------------------------------------------------------------ the zygote (child side)
def run_python(path):
    """Run `path` as __main__ like `python3 -I -S path`; returns the exit status."""
    for name in set(sys.modules) - BASE_MODULES:
        del sys.modules[name]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
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

    lim = req["limits"]
    for res, value in (
        (resource.RLIMIT_CPU, lim["cpu"]),
        (resource.RLIMIT_FSIZE, lim["fsize"]),
        (resource.RLIMIT_NOFILE, lim["nofile"]),
        (resource.RLIMIT_CORE, 0),
    ):
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


# ------------------------------------------------------------------ one run, in steps
def refuse_files(z, exc):
    """The files could not be written: kill, wipe and prove, then an ERROR reply; True if clean."""
    problems = [] if kill_all(z) else ["processes survive"]
    z.close()  # its pipes and process handle: a refused request must not leak descriptors
    problems += wipe_and_prove()
    send(ERROR, flags=0 if problems else CLEAN, msg=("cannot write the files: %s" % exc).encode())
    return not problems


def start(z, req):
    """Hand the command to the zygote (one that died already shows up as the command's status)."""
    go = marshal.dumps({k: req.get(k) for k in ("argv", "python", "limits")}, 4)
    try:
        write_all(z.go, HEADER.pack(len(go)) + go)
    except OSError:
        pass


def collect(z, deadline, open_fds):
    """Feed the command's pipes (fd -> HeadTail; a pipe at EOF is removed) until the command
    exits or the deadline passes; True when it was still running at the deadline."""
    watch = [z.pidfd] if z.pidfd is not None else []
    while True:
        if z.poll():
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return not z.poll()
        ready, _, _ = select.select(list(open_fds) + watch, [], [], min(left, 0.05 if not watch else left))
        for fd in ready:
            if fd in open_fds:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    open_fds[fd].feed(chunk)
                else:
                    del open_fds[fd]


def drain(open_fds):
    """Read what the pipes still hold once every writer is dead (at most ~1 s per pipe)."""
    for fd, buf in list(open_fds.items()):
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            r, _, _ = select.select([fd], [], [], 0.1)
            if not r:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf.feed(chunk)


def exit_code(z, timed_out):
    """137 for a command killed at the deadline (or never reaped), else its status as a shell shows it."""
    if timed_out or z.status is None:
        return 137
    code = os.waitstatus_to_exitcode(z.status)
    return 128 - code if code < 0 else code


def run(req, z):
    """Serve one `run` request with the zygote `z` (steps 1-4 above); True when the container is proven clean."""
    t0 = time.monotonic()
    timeout = max(float(req["timeout"]), 0.001)
    cap = int(req["cap"])
    out, err = HeadTail(cap), HeadTail(cap)
    try:
        write_files(req["files"])
    except (OSError, ValueError) as exc:
        return refuse_files(z, exc)
    before = oom_kills()
    start(z, req)
    open_fds = {z.out: out, z.err: err}
    timed_out = collect(z, t0 + timeout, open_fds)
    killed = kill_all(z)
    drain(open_fds)
    z.close()
    exists = report_exists(req["report"])
    oom = max(0, oom_kills() - before)
    problems = ([] if killed else ["processes survive the kill"]) + wipe_and_prove()
    code = exit_code(z, timed_out)
    out_b, out_t = out.value()
    err_b, err_t = err.value()
    flags = (
        (TIMED_OUT if timed_out else 0)
        | (TRUNC_OUT if out_t else 0)
        | (TRUNC_ERR if err_t else 0)
        | (0 if problems else CLEAN)
    )
    send(RESULT, code, flags, oom, time.monotonic() - t0, exists, out_b, err_b, "; ".join(problems).encode())
    return not problems


def main():
    os.chdir("/")
    problems = [] if os.getuid() == 0 else ["agent is not root"]
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
