"""The code harness's RUNNER: the untrusted process that loads and calls the candidate.

Part 2 of the harness program (`verifier_workers.harness`, whose docstring states what the
runner may and may not do; stdlib only, joined with the other parts into ONE program).

Guarantees: `runner(req_fd, resp_fd)` waits for the supervisor's "go", installs the audit
hook (`FORBIDDEN_EVENTS`/`IMPORTS`, writes, /proc), loads `candidate.py`, then answers
calls until "fin" with plain values or errors; any tamper it sees (and the integrity check
after every call) is reported and ends the runner with `TAMPER_EXIT`.
"""

import builtins
import marshal
import os
import struct
import sys

from verifier_workers.harness_protocol import PLAIN_ATOMS, PLAIN_CONTAINERS, TAMPER_EXIT, plain, read_exact, send

PRELOAD = ("typing", "math")
FORBIDDEN_EVENTS = frozenset(
    (
        "sys.settrace",
        "sys.setprofile",
        "sys._current_frames",
        "sys.addaudithook",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "subprocess.Popen",
        "pty.spawn",
        "os.chmod",
        "os.chown",
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.truncate",
        "os.utime",
        "os.link",
        "os.symlink",
        "os.mkdir",
        "shutil.rmtree",
        "socket.connect",
        "socket.bind",
    )
)
FORBIDDEN_IMPORTS = frozenset(
    ("ctypes", "_ctypes", "_posixsubprocess", "pty", "mmap", "_xxsubinterpreters", "_sqlite3", "_dbm", "_gdbm")
)  # the last three write files the open hook never sees
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
LAZY_TYPES = (
    "generator",
    "map",
    "filter",
    "zip",
    "range",
    "reversed",
    "list_iterator",
    "dict_keys",
    "dict_values",
    "dict_items",
)


# ---------------------------------------------------------------- runner (untrusted side)
def _recv_untimed(fd):
    return marshal.loads(read_exact(fd, struct.unpack(">I", read_exact(fd, 4, None))[0], None))


def _audit_hook(tamper):
    """The runner's audit hook: any forbidden operation is reported as tamper (and ends the runner)."""
    forbidden, imports, write_flags, realpath = FORBIDDEN_EVENTS, FORBIDDEN_IMPORTS, WRITE_FLAGS, os.path.realpath

    def hook(event, args):
        if event in forbidden or event.startswith("ctypes."):
            tamper("forbidden operation: %s" % event)
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, bytes):
                path = path.decode("utf-8", "replace")
            if isinstance(path, str):
                real = realpath(path)  # relative paths, `..` and symlinks resolved (an error aborts the open)
                if path.startswith("/proc") or "/proc/" in path or real == "/proc" or real.startswith("/proc/"):
                    tamper("opened %s" % path)
                if (mode and any(c in mode for c in "wax+")) or (not mode and flags and flags & write_flags):
                    tamper("opened %s for writing" % path)
        elif event == "import" and args and str(args[0]).split(".")[0] in imports:
            tamper("imported %s" % args[0])
        elif event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
            tamper("replaced a function's __code__")

    return hook


def _integrity_check(harness_globals):
    """integrity(): None, or what the candidate changed since now (exits, atexit, rebound names, tracing).
    Like the audit hook, it closes over values bound before the candidate runs."""
    import atexit

    watched = [("builtins", vars(builtins)), ("sys", vars(sys)), ("os", vars(os)), ("harness", harness_globals)]
    watched += [(m, vars(sys.modules[m])) for m in PRELOAD if m in sys.modules]
    snapshot = [(name, ns, dict(ns)) for name, ns in watched]
    sys_volatile = {"last_type", "last_value", "last_traceback", "exc_info", "_git", "ps1", "ps2"}
    exits = (sys.exit, os._exit, getattr(builtins, "exit", None))
    ncallbacks, gettrace, getprofile, missing = atexit._ncallbacks, sys.gettrace, sys.getprofile, object()

    def integrity():
        if ncallbacks():
            return "registered an atexit handler"
        if (sys.exit, os._exit, getattr(builtins, "exit", None)) != exits:
            return "patched exit"
        for name, now, before in snapshot:
            for key, val in before.items():
                if name == "sys" and (key in sys_volatile or not callable(val)):
                    continue
                if now.get(key, missing) is not val:
                    return "rebound %s.%s" % (name, key)
            if name == "builtins" and len(now) != len(before):
                return "added names to builtins"
        if gettrace() is not None or getprofile() is not None:
            return "installed a trace/profile function"
        return None

    return integrity


def _call(fn, req, tamper):
    """One call of the candidate function, as a reply (plain value or error)."""
    try:
        value = fn(*req["args"], **req["kwargs"])
        if type(value).__name__ in LAZY_TYPES:
            value = list(value)
        if plain(value):
            return {"kind": "value", "value": value}
        cls = type(value)
        if any(
            "__eq__" in vars(k) or "__ne__" in vars(k)
            for k in cls.__mro__[:-1]
            if k not in PLAIN_ATOMS + PLAIN_CONTAINERS
        ):
            tamper("returned a %s, whose class defines __eq__" % cls.__name__)
        return {"kind": "error", "type": "TypeError", "message": "returned a %s, not plain data" % cls.__name__}
    except SystemExit as exc:
        tamper("SystemExit(%r) during a call" % (exc.code,))
    except BaseException as exc:
        return {"kind": "error", "type": type(exc).__name__, "message": str(exc)[:500]}


def _serve(fn, req_fd, resp_fd, tamper, integrity, exit_):
    """Answer calls until "fin"; the integrity check runs after every call and at "fin"."""
    while True:
        try:
            req = _recv_untimed(req_fd)
        except BaseException:
            exit_(1)
        fin = req["kind"] == "fin"
        reply = {"kind": "fin"} if fin else _call(fn, req, tamper)
        bad = integrity()
        if bad:
            tamper(bad)
        try:
            send(resp_fd, reply)
        except Exception as exc:  # unpicklable / huge
            send(resp_fd, {"kind": "error", "type": "TypeError", "message": "unsendable value: %s" % exc})
        if fin:
            exit_(0)


def runner(req_fd, resp_fd):
    entry = _recv_untimed(req_fd)["entry_point"]  # "go": the supervisor holds its secrets
    exit_, write, dumps, pack, code = os._exit, os.write, marshal.dumps, struct.pack, TAMPER_EXIT

    def tamper(reason):  # report the attempt, then exit with TAMPER_EXIT
        data = dumps({"kind": "tamper", "reason": str(reason)}, 4)
        try:
            write(resp_fd, pack(">I", len(data)) + data)
        finally:
            exit_(code)

    integrity = _integrity_check(globals())
    with open("candidate.py", "rb") as f:
        source = f.read()
    sys.addaudithook(_audit_hook(tamper))
    sys.modules["candidate"] = module = type(sys)("candidate")
    module.__file__ = "candidate.py"
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
    _serve(fn, req_fd, resp_fd, tamper, integrity, exit_)
