"""The child side of `answer_pool`: the template process and the per-answer jobs it forks.

Guarantees (the pool's module docstring says why):
- The template reads pickled requests from its parent (the only party that writes its stdin)
  and writes JSON frames; it runs only `warm` steps (controlled-side data) itself, never the
  answer-dependent `ref`.
- Each request runs in a job forked from the template (a spare forked ahead when possible):
  descriptors closed but its pipes, stdin/stdout/stderr on /dev/null, RLIMIT_CPU / RLIMIT_AS /
  RLIMIT_FSIZE 0 / RLIMIT_CORE 0, bare `eval(text)` is `ast.literal_eval` (but for the request's `trusted_eval` texts), the audit hook of
  `install_guard`, and a MemoryError seen in answer code (frames compiled from a string) or
  escaping the call reported as the memory limit. Its result is one JSON frame of at most
  `MAX_RESULT_BYTES`; a larger one is the `output` limit.
- The template SIGKILLs a job at its wall limit and reports `limit: wall`; a job killed by
  SIGXCPU / SIGKILL without the template's doing is `limit: cpu`; any other death without a
  result is `crash`.
"""

from __future__ import annotations

import ast
import builtins
import gc
import importlib
import json
import math
import os
import pickle
import re
import resource
import selectors
import signal
import sys
import time

from verifier_workers.answer_pool import MAX_RESULT_BYTES, _read_frame, _write_frame

SPARES = 2
BLOCKED_EVENTS = (
    "os.system",
    "os.exec",
    "os.spawn",
    "os.posix_spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "subprocess.Popen",
    "socket.",
    "ctypes.",
    "gc.get_",
    "sys._current_frames",
    "os.putenv",
    "os.unsetenv",
    "sys.setprofile",
    "sys.settrace",
    "os.chmod",
    "os.chown",
    "os.remove",
    "os.rename",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.rmdir",
    "os.mkdir",
    "shutil.",
    "_posixsubprocess",
    "pty.",
    "resource.setrlimit",
    "fcntl.",
    "mmap.",
    "signal.",
)
FRAME_EVENTS = ("sys._getframe", "object.__getattr__")


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _jsonable(value):
    """The value as plain JSON data (floats may be non-finite; the parent checks)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)[:2000]


# -- the job -----------------------------------------------------------------------------


class _State:
    blocked: list[str] = []
    memory = False
    trusted_eval: frozenset[str] = frozenset()


_CODE_ATTACK = re.compile(r"__|\.\s*[A-Za-z_]|\blambda\b|:=")


def _make_hook():
    """The audit hook (a closure: its re-entry flag is reachable from no Python object)."""
    inside = [False]

    def from_string_code() -> bool:
        inside[0] = True
        try:
            f = sys._getframe(2)
            while f is not None:
                if f.f_code.co_filename == "<string>":
                    return True
                f = f.f_back
            return False
        finally:
            inside[0] = False

    def hook(event: str, args) -> None:
        if inside[0]:
            return
        if event == "open" and (
            str(args[0]).startswith("/proc")
            or (len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
        ):
            _refuse(f"open({str(args[0])[:60]!r})")
        elif (
            event == "compile"
            and args[1] in ("<string>", "<unknown>")
            and isinstance(args[0], (str, bytes))
            and _CODE_ATTACK.search(args[0] if isinstance(args[0], str) else args[0].decode("latin-1"))
        ):
            _refuse("compile of code with attribute access, dunder names or lambda")
        elif event.startswith(BLOCKED_EVENTS):
            _refuse(event)
        elif (
            event in FRAME_EVENTS and (event != "object.__getattr__" or "frame" in str(args[1])) and from_string_code()
        ):
            _refuse(event)

    return hook


def _refuse(what: str) -> None:
    if len(_State.blocked) < 20:
        _State.blocked.append(what)
    raise PermissionError(f"refused in the answer pool: {what}")


_real_eval = builtins.eval


def _literal_eval(source, globals=None, locals=None, /):
    """`eval(text)` as scorers call it: Python literals only, unless `text` is one of the request's
    controlled-side texts (`trusted_eval`: a dataset that evals its own problem); other forms go to
    the real eval."""
    if globals is None and locals is None and isinstance(source, str) and source not in _State.trusted_eval:
        return ast.literal_eval(source.strip())
    return _real_eval(source, globals, locals)


def _tracer(frame, event, arg):
    if frame.f_code.co_filename != "<string>":
        return None
    frame.f_trace_lines = False

    def local(f, ev, a):
        if ev == "exception" and isinstance(a[1], MemoryError):
            _State.memory = True
        return local

    return local


def install_guard(cpu_s: float, memory_mb: int, trusted_eval=()) -> None:
    """The job's limits and guards (see the module docstring)."""
    _State.trusted_eval = frozenset(str(t) for t in trusted_eval)
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(math.ceil(used.ru_utime + used.ru_stime + cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    with open("/proc/self/statm") as f:
        vsz = int(f.read().split()[0]) * resource.getpagesize()
    cap = vsz + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    builtins.eval = _literal_eval
    sys.settrace(_tracer)
    sys.addaudithook(_make_hook())


def _job(req_fd: int, out_fd: int) -> None:
    """A forked job: wait for its request, run it under the guard, write one JSON frame."""
    result: dict
    try:
        req = pickle.loads(_read_frame(req_fd) or b"")
        install_guard(req["cpu_s"], req["memory_mb"], req.get("trusted_eval") or ())
        try:
            value = _resolve(req["ref"])(*req["args"])
            result = {"kind": "ok", "value": _jsonable(value)}
        except MemoryError:
            _State.memory = True
            result = {"kind": "ok"}
        except BaseException as exc:  # noqa: BLE001  (whatever the scorer raised goes back as data)
            result = {"kind": "raised", "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        if _State.memory:
            result = {"kind": "limit", "limit": "memory"}
        result["blocked"] = list(_State.blocked)
        data = json.dumps(result).encode()
        if len(data) > MAX_RESULT_BYTES:
            data = json.dumps({"kind": "limit", "limit": "output"}).encode()
        _write_frame(out_fd, data)
    except BaseException as exc:  # noqa: BLE001  (the job's own failure: reported, the parent calls it infra)
        try:
            _write_frame(out_fd, json.dumps({"kind": "crash", "error": f"{type(exc).__name__}: {exc}"[:500]}).encode())
        except OSError:
            pass
    finally:
        os._exit(0)


def _fork_job() -> tuple[int, int, int]:
    """(pid, request write fd, result read fd) of a new spare job."""
    req_r, req_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            keep = sorted({req_r, out_w})
            os.closerange(3, keep[0])
            for lo, hi in zip(keep, [*keep[1:], 1 << 16]):
                os.closerange(lo + 1, hi)
            _job(req_r, out_w)
        finally:
            os._exit(70)
    os.close(req_r)
    os.close(out_w)
    return pid, req_w, out_r


# -- the template ------------------------------------------------------------------------


class Template:
    """The template's loop: requests in, jobs forked, results out."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.spares: list[tuple[int, int, int]] = []
        self.active: dict[int, dict] = {}  # result fd -> job
        self.inbuf = b""

    def reply(self, msg: dict) -> None:
        _write_frame(1, json.dumps(msg).encode())

    def start(self, req: dict) -> None:
        rid = req["id"]
        if req.get("warm"):
            ref, args = req["warm"]
            try:
                _resolve(ref)(*args)
            except Exception as exc:  # noqa: BLE001  (the warm step's failure is the scorer's: infra)
                self.reply({"id": rid, "kind": "infra", "error": f"{type(exc).__name__}: {exc}"[:1000]})
                return
        pid, req_w, out_r = self.spares.pop(0) if self.spares else _fork_job()
        try:
            _write_frame(req_w, pickle.dumps(req))
        except OSError as exc:
            self.reply({"id": rid, "kind": "crash", "error": f"job pipe: {exc}"})
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        finally:
            os.close(req_w)
        self.active[out_r] = {"id": rid, "pid": pid, "buf": b"", "deadline": time.monotonic() + req["wall_s"]}
        self.sel.register(out_r, selectors.EVENT_READ)

    def finish(self, fd: int, killed: bool) -> None:
        job = self.active.pop(fd)
        self.sel.unregister(fd)
        os.close(fd)
        if killed:
            os.kill(job["pid"], signal.SIGKILL)
        _, status = os.waitpid(job["pid"], 0)
        msg: dict = {"kind": "crash", "error": f"job exited with status {status} and no result"}
        if killed:
            msg = {"kind": "limit", "limit": "wall"}
        elif len(job["buf"]) > MAX_RESULT_BYTES + 4:
            msg = {"kind": "limit", "limit": "output"}
        elif os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
            msg = {"kind": "limit", "limit": "cpu"}
        elif len(job["buf"]) >= 4:
            try:
                parsed = json.loads(job["buf"][4 : 4 + int.from_bytes(job["buf"][:4], "big")])
                if isinstance(parsed, dict):
                    msg = parsed
            except ValueError:
                pass
        msg["id"] = job["id"]
        self.reply(msg)

    def on_result(self, fd: int) -> None:
        chunk = os.read(fd, 65536)
        job = self.active[fd]
        job["buf"] += chunk
        if not chunk or len(job["buf"]) > MAX_RESULT_BYTES + 4:
            self.finish(fd, killed=False)

    def on_request(self) -> bool:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return False
        self.inbuf += chunk
        while len(self.inbuf) >= 4:
            n = int.from_bytes(self.inbuf[:4], "big")
            if len(self.inbuf) < 4 + n:
                break
            req, self.inbuf = pickle.loads(self.inbuf[4 : 4 + n]), self.inbuf[4 + n :]
            self.start(req)
        return True

    def loop(self) -> None:
        self.sel.register(0, selectors.EVENT_READ)
        while True:
            while len(self.spares) < SPARES and not self.active:
                self.spares.append(_fork_job())
            now = time.monotonic()
            timeout = min([j["deadline"] for j in self.active.values()], default=now + 1.0) - now
            for key, _ in self.sel.select(max(0.0, timeout)):
                if key.fd == 0:
                    if not self.on_request():
                        return
                elif key.fd in self.active:
                    self.on_result(key.fd)
            now = time.monotonic()
            for fd in [fd for fd, j in self.active.items() if j["deadline"] <= now]:
                self.finish(fd, killed=True)
            if not self.active and len(self.spares) < SPARES:
                self.spares.append(_fork_job())


def main(preload: list[str]) -> None:
    """The template process: import `preload`, report ready, serve until stdin closes."""
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()
    t = Template()
    t.reply({"ready": True, "pid": os.getpid()})
    try:
        t.loop()
    finally:
        for pid, _req_w, _out_r in t.spares:
            os.kill(pid, signal.SIGKILL)
