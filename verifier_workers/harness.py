"""Test harness for the `code` verifier: runs INSIDE a fresh sandbox (standalone file, stdlib only).

The verifier uploads, in this order, `candidate.py` (the policy's final program, nothing
else), then `tests.py` (the hidden check code, every `assert` rewritten by the verifier
into a counted `__rlbus_assert__(lambda: X, line)` call) and `job.marshal` (entry point,
the public prompt, the deadline and a random per-run nonce), then `harness.py` (this
file), and runs `python3 -I -S harness.py`. Stdlib only, and only cheap modules: every
millisecond of start-up is paid once per verification. Nothing else from the policy's
episode reaches the sandbox.

Design: two processes, and the candidate never runs where a secret or a test lives.

    supervisor (trusted)                        runner (untrusted: runs the candidate)
    ----------------------------------------   ----------------------------------------
    fork() first, before reading anything      closes every fd but its two pipes; its
    read job + tests.py, hash, unlink          stdout/stderr go to /tmp/runner.out
    prctl(PR_SET_DUMPABLE, 0)                  waits for "go"
    send "go"                          ----->  installs an audit hook, snapshots builtins,
                                               exec()s candidate.py, reports "ready"
    exec prompt (helpers) + tests.py, call
    check(proxy); every `candidate(...)` is ----> calls the function, sends back the
    an RPC; replies are unmarshalled and   <----  value (plain Python data only)
    must be plain data
    "fin" -> runner re-checks its integrity
    prints ONE result line (a literal), and if
    every assertion passed and nothing was
    flagged: `RLBUS-PASS <proof>`, proof =
    HMAC-SHA256(nonce, "pass:<tests sha256>:<candidate sha256>")

Threat model (the policy controls candidate.py entirely):
- It cannot print the proof: the nonce exists only in the supervisor's memory (read and
  unlinked from disk before any candidate code runs; the runner was forked before it was
  read; the supervisor is made non-dumpable so /proc/<pid>/mem and ptrace are refused),
  and the runner has no handle on the sandbox's stdout (its fds 1/2 are a file).
- It cannot subvert the tests: the assertions, `check` and the prompt's helper functions
  (e.g. `encode_cyclic`) run in the supervisor; the candidate only ever returns values.
  Return values travel as `marshal` data, which cannot hold instances of any class, and
  are checked to be plain data (exact None/bool/int/float/complex/str/bytes and
  list/tuple/dict/set/frozenset of them), so an "always equal" object, a patched
  `__eq__`, a patched `assert`/`check`/`exit`/builtin have no effect on the verdict.
- It cannot read the tests to hard-code answers: they are unlinked before it runs, and
  the runner's audit hook kills it on any open() under /proc.
- Exiting early (`sys.exit(0)` at import, `os._exit(0)` via atexit or anywhere) ends the
  runner before the checks finish: no proof. It is labelled tamper when it exits with 0
  before finishing or raises SystemExit while loading.
- Labelled tamper (status `tamper`, never a pass): SystemExit during import; an exit 0
  mid-protocol; atexit registrations; builtins / sys / preloaded stdlib modules rebound;
  a top-level `check` defined; sys.settrace/setprofile, ctypes, gc introspection, frames
  of other threads, subprocess/fork/exec/kill, any file opened for writing, chmod/remove/
  rename/truncate, opening /proc (the runner's audit hook reports these and exits);
  return values of a class defining `__eq__`; a test file reappearing. The candidate's
  output is forwarded to stderr, where the verifier flags pass-like lines ("PASSED",
  "All tests passed", fake RLBUS lines) as tamper.
- Residual: a candidate that escapes the runner's audit hook (e.g. through a CPython
  memory-corruption bug) still only controls the runner: it can return values, never
  print the proof. Denial of service (hangs, memory) is bounded by the deadline and the
  sandbox's limits, and scores 0.

With the docker backend the sandbox's resident agent (`sandbox_workers.docker_agent`) runs
this file as `__main__` in a process it forked from its pre-imported `python3 -I -S`
interpreter and that dropped from uid 0 to the sandbox user (no interpreter start, no
recompilation): the same two processes follow, and the supervisor is already
non-dumpable (a uid change), which `_nondumpable` sees without importing ctypes.

Exit status is irrelevant: the verifier reads only the result line and the proof line.
"""

import builtins
import io
import marshal
import os
import select
import struct
import sys
import time

try:
    from _sha256 import sha256  # CPython <= 3.11: no OpenSSL import (startup time matters here)
except ImportError:  # pragma: no cover - newer / other interpreters
    from hashlib import sha256

START = "RLBUS-HARNESS-START"
RESULT = "RLBUS-RESULT "
PASS = "RLBUS-PASS "
RUNNER_OUT = "/tmp/runner.out"
MAX_MSG = 16 * 1024 * 1024
TAMPER_EXIT = 86
PLAIN_ATOMS = (type(None), bool, int, float, complex, str, bytes)
PLAIN_CONTAINERS = (list, tuple, set, frozenset, dict)
PRELOAD = ("typing", "math")
FORBIDDEN_EVENTS = frozenset((
    "sys.settrace", "sys.setprofile", "sys._current_frames", "sys.addaudithook",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
    "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn",
    "os.chmod", "os.chown", "os.remove", "os.rename", "os.rmdir", "os.truncate", "os.utime",
    "os.link", "os.symlink", "os.mkdir", "shutil.rmtree", "socket.connect", "socket.bind",
))
FORBIDDEN_IMPORTS = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "pty", "mmap", "_xxsubinterpreters"))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


# ---------------------------------------------------------------- framing (both sides)
def send(fd, obj):
    data = marshal.dumps(obj, 4)
    msg = struct.pack(">I", len(data)) + data
    while msg:
        msg = msg[os.write(fd, msg):]


def _read_exact(fd, n, deadline):
    buf = b""
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Deadline()
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise Deadline()
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise RunnerGone()
        buf += chunk
    return buf


class Deadline(BaseException):
    """The run's deadline passed (not an Exception: test code cannot swallow it)."""


class RunnerGone(BaseException):
    """The runner closed its pipe (exited or crashed)."""


class RunnerTamper(BaseException):
    """The runner reported a tamper attempt."""


def hmac_sha256(key, msg):
    """RFC 2104 HMAC-SHA256 (hex), without importing hmac/hashlib."""
    if len(key) > 64:
        key = sha256(key).digest()
    key = key.ljust(64, b"\0")
    inner = sha256(bytes(b ^ 0x36 for b in key) + msg).digest()
    return sha256(bytes(b ^ 0x5C for b in key) + inner).hexdigest()


def plain(value, depth=0):
    """True iff value is plain data (exact builtin types, bounded depth)."""
    if depth > 200:
        return False
    t = type(value)
    if t in PLAIN_ATOMS:
        return True
    if t in (list, tuple, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if t is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False


# ---------------------------------------------------------------- runner (untrusted side)
def runner(req_fd, resp_fd):
    go = marshal.loads(_read_exact(req_fd, struct.unpack(">I", _read_exact(req_fd, 4, None))[0], None))
    entry = go["entry_point"]
    import atexit

    exit_ = os._exit
    write = os.write
    dumps = marshal.dumps
    pack = struct.pack

    def tamper(reason):
        data = dumps({"kind": "tamper", "reason": str(reason)}, 4)
        try:
            write(resp_fd, pack(">I", len(data)) + data)
        finally:
            exit_(TAMPER_EXIT)

    def hook(event, args):
        if event in FORBIDDEN_EVENTS or event.startswith("ctypes."):
            tamper("forbidden operation: %s" % event)
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, bytes):
                path = path.decode("utf-8", "replace")
            if isinstance(path, str):
                if path.startswith("/proc") or "/proc/" in path:
                    tamper("opened %s" % path)
                if (mode and any(c in mode for c in "wax+")) or (not mode and flags and flags & WRITE_FLAGS):
                    tamper("opened %s for writing" % path)
        elif event == "import" and args and str(args[0]).split(".")[0] in FORBIDDEN_IMPORTS:
            tamper("imported %s" % args[0])
        elif event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
            tamper("replaced a function's __code__")

    watched = [builtins, sys, os] + [sys.modules[m] for m in PRELOAD if m in sys.modules]
    snapshot = [(m, dict(vars(m))) for m in watched]
    sys_volatile = {"last_type", "last_value", "last_traceback", "exc_info", "_git", "ps1", "ps2"}
    exits = (sys.exit, os._exit, builtins.exit if hasattr(builtins, "exit") else None)

    def integrity():
        if atexit._ncallbacks():
            return "registered an atexit handler"
        if (sys.exit, os._exit, getattr(builtins, "exit", None)) != exits:
            return "patched exit"
        for mod, before in snapshot:
            now = vars(mod)
            for key, val in before.items():
                if mod is sys and key in sys_volatile:
                    continue
                if mod is sys and not callable(val):
                    continue
                if now.get(key, hook) is not val:
                    return "rebound %s.%s" % (mod.__name__, key)
            if mod is builtins and len(now) != len(before):
                return "added names to builtins"
        if sys.gettrace() is not None or sys.getprofile() is not None:
            return "installed a trace/profile function"
        return None

    with open("candidate.py", "rb") as f:
        source = f.read()
    sys.addaudithook(hook)
    module = type(sys)("candidate")
    module.__file__ = "candidate.py"
    sys.modules["candidate"] = module
    try:
        exec(compile(source, "candidate.py", "exec"), module.__dict__)
    except SystemExit as exc:
        tamper("SystemExit(%r) while loading the candidate" % (exc.code,))
    except BaseException as exc:
        send(resp_fd, {"kind": "import_error", "error": "%s: %s" % (type(exc).__name__, exc)})
        exit_(0)
    bad = integrity()
    if bad is None and "check" in module.__dict__:
        bad = "defined a top-level `check` (the test's name)"
    if bad:
        tamper(bad)
    fn = module.__dict__.get(entry)
    if not callable(fn):
        send(resp_fd, {"kind": "import_error", "error": "the candidate defines no function %r" % entry})
        exit_(0)
    send(resp_fd, {"kind": "ready"})
    while True:
        try:
            n = struct.unpack(">I", _read_exact(req_fd, 4, None))[0]
            req = marshal.loads(_read_exact(req_fd, n, None))
        except BaseException:
            exit_(1)
        if req["kind"] == "fin":
            bad = integrity()
            if bad:
                tamper(bad)
            send(resp_fd, {"kind": "fin"})
            exit_(0)
        try:
            value = fn(*req["args"], **req["kwargs"])
            if type(value).__name__ in ("generator", "map", "filter", "zip", "range", "reversed",
                                        "list_iterator", "dict_keys", "dict_values", "dict_items"):
                value = list(value)
            if plain(value):
                reply = {"kind": "value", "value": value}
            else:
                cls = type(value)
                if any("__eq__" in vars(k) or "__ne__" in vars(k) for k in cls.__mro__[:-1]
                       if k not in PLAIN_ATOMS + PLAIN_CONTAINERS):
                    tamper("returned a %s, whose class defines __eq__" % cls.__name__)
                reply = {"kind": "error", "type": "TypeError",
                         "message": "returned a %s, not plain data" % cls.__name__}
        except SystemExit as exc:
            tamper("SystemExit(%r) during a call" % (exc.code,))
        except BaseException as exc:
            reply = {"kind": "error", "type": type(exc).__name__, "message": str(exc)[:500]}
        bad = integrity()
        if bad:
            tamper(bad)
        try:
            send(resp_fd, reply)
        except Exception as exc:  # unpicklable / huge
            send(resp_fd, {"kind": "error", "type": "TypeError", "message": "unsendable value: %s" % exc})


# ---------------------------------------------------------------- supervisor (trusted side)
class Proxy:
    """Stands in for the candidate function inside the tests: each call is one RPC."""

    def __init__(self, sup):
        self.sup = sup

    def __call__(self, *args, **kwargs):
        return self.sup.call(args, kwargs)


class Supervisor:
    def __init__(self, pid, req_fd, resp_fd, deadline):
        self.pid, self.req_fd, self.resp_fd, self.deadline = pid, req_fd, resp_fd, deadline
        self.calls = 0

    def recv(self):
        n = struct.unpack(">I", _read_exact(self.resp_fd, 4, self.deadline))[0]
        if n > MAX_MSG:
            raise RunnerTamper("reply of %d bytes" % n)
        try:
            msg = marshal.loads(_read_exact(self.resp_fd, n, self.deadline))
        except Exception as exc:  # malformed, absurdly nested
            raise RunnerTamper("reply refused: %s: %s" % (type(exc).__name__, exc)) from exc
        if type(msg) is not dict or not plain(msg):
            raise RunnerTamper("malformed reply")
        if msg.get("kind") == "tamper":
            raise RunnerTamper(str(msg.get("reason")))
        return msg

    def call(self, args, kwargs):
        self.calls += 1
        try:
            send(self.req_fd, {"kind": "call", "args": args, "kwargs": kwargs})
        except OSError:
            raise RunnerGone() from None
        msg = self.recv()
        if msg.get("kind") == "value":
            return msg.get("value")
        if msg.get("kind") == "error":
            name, text = str(msg.get("type")), str(msg.get("message"))
            cls = getattr(builtins, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(text)
            raise RuntimeError("%s: %s" % (name, text))
        raise RunnerTamper("unexpected reply %r" % msg.get("kind"))


class Counter:
    def __init__(self):
        self.passed = self.failed = 0
        self.first_failure = None

    def __call__(self, test, line):
        try:
            ok = bool(test())
        except Exception as exc:
            ok, why = False, "%s: %s" % (type(exc).__name__, exc)
        else:
            why = "assertion failed"
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            if self.first_failure is None:
                self.first_failure = "line %d: %s" % (line, why[:300])
        return ok


def supervise(pid, req_fd, resp_fd, job, tests, tests_sha):
    out = {"result": "fail", "passed": 0, "failed": 0, "detail": "", "tests_sha256_before": tests_sha}
    sup = Supervisor(pid, req_fd, resp_fd, time.monotonic() + float(job.get("timeout_s", 10)))
    counter = Counter()
    try:
        send(req_fd, {"entry_point": job["entry_point"]})
        msg = sup.recv()
        if msg.get("kind") == "import_error":
            out["detail"] = "candidate failed to load: %s" % msg.get("error")
            return out
        ns = {"__name__": "__rlbus_tests__", "__rlbus_assert__": counter}
        if job.get("prompt"):
            exec(compile(job["prompt"], "prompt.py", "exec"), ns)
        ns[job["entry_point"]] = Proxy(sup)
        exec(compile(tests, "tests.py", "exec"), ns)
        try:
            ns["check"](Proxy(sup))
        except Exception as exc:
            counter.failed += 1
            if counter.first_failure is None:
                counter.first_failure = "%s: %s" % (type(exc).__name__, str(exc)[:300])
        try:
            send(req_fd, {"kind": "fin"})
        except OSError:
            raise RunnerGone() from None
        if sup.recv().get("kind") != "fin":
            raise RunnerTamper("bad fin")
        out.update(passed=counter.passed, failed=counter.failed)
        if counter.failed == 0:
            out["result"] = "pass"
        else:
            out["detail"] = counter.first_failure or ""
    except Deadline:
        out.update(result="timeout", passed=counter.passed, failed=counter.failed,
                   detail="deadline of %ss passed after %d calls" % (job.get("timeout_s"), sup.calls))
    except RunnerTamper as exc:
        out.update(result="tamper", detail=str(exc))
    except RunnerGone:
        out.update(passed=counter.passed, failed=counter.failed)
        out["detail"] = "the candidate's process ended early"
    return out


def _nondumpable():
    try:  # already non-dumpable (e.g. started by a root agent that dropped to this uid): no ctypes
        if os.geteuid() != 0 and os.stat("/proc/self").st_uid == 0:  # root owns a non-dumpable task
            return True
    except OSError:
        pass
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE = 4
    except Exception:
        return False


def main():
    sys.stdout.write(START + "\n")
    sys.stdout.flush()
    for name in PRELOAD:  # shared by both processes, and snapshotted by the runner
        try:
            __import__(name)
        except Exception:
            pass
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # runner: nothing secret has been read yet
        try:
            out = os.open(RUNNER_OUT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            keep = sorted((0, 1, 2, req_r, resp_w))
            for lo, hi in zip(keep, keep[1:] + [1 << 16]):
                os.closerange(lo + 1, hi)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            runner(req_r, resp_w)
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    os.close(req_r)
    os.close(resp_w)
    with open("job.marshal", "rb") as f:
        job = marshal.loads(f.read())  # written by the verifier (trusted)
    with open("tests.py", "rb") as f:
        tests_bytes = f.read()
    os.unlink("job.marshal")
    os.unlink("tests.py")
    nonce = job.pop("nonce").encode()
    dumpable_off = _nondumpable()
    tests_sha = sha256(tests_bytes).hexdigest()
    with open("candidate.py", "rb") as f:
        candidate_sha = sha256(f.read()).hexdigest()
    out = supervise(pid, req_w, resp_r, job, tests_bytes.decode("utf-8"), tests_sha)
    os.close(req_w)
    deadline = time.monotonic() + (0.5 if out["result"] != "timeout" else 0.0)
    status = None
    while status is None and time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        status = status if done else None
        if status is None:
            time.sleep(0.002)
    if status is None:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
    out["runner_exit"] = code
    if out["result"] not in ("tamper", "timeout") and code == TAMPER_EXIT:
        out.update(result="tamper", detail="the candidate's process exited with the tamper code")
    if out["result"] == "fail" and out["detail"] == "the candidate's process ended early" and code == 0:
        out.update(result="tamper", detail="the candidate's process exited with status 0 before the tests finished")
    try:
        with open(RUNNER_OUT, "rb") as f:
            printed = f.read(64 * 1024).decode("utf-8", "replace")
    except OSError:
        printed = ""
    sys.stderr.write(printed)  # the verifier scans it for pass-like lines
    for name in ("tests.py", "job.marshal"):
        if os.path.lexists(name) and out["result"] != "tamper":
            out.update(result="tamper", detail="the candidate wrote %s" % name)
    out["tests_sha256_after"] = sha256(tests_bytes).hexdigest()
    out["candidate_sha256"] = candidate_sha
    out["nondumpable"] = dumpable_off
    sys.stdout.write(RESULT + repr(out) + "\n")  # plain literals: the verifier reads it with literal_eval
    if out["result"] == "pass" and out["tests_sha256_after"] == tests_sha:
        proof = hmac_sha256(nonce, ("pass:%s:%s" % (tests_sha, candidate_sha)).encode())
        sys.stdout.write(PASS + proof + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
