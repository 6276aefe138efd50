"""The `repo` verifier's in-container program (standalone, stdlib only; the runner imports pytest).

Two processes, two uids, in a fresh container whose execs may run as uid 0 with only the
SETUID, SETGID and KILL capabilities (`sandbox_workers.docker_fresh`):

- The SUPERVISOR (`python3 -I -S -c <this file> supervise`, uid 0, trusted) reads the job
  from its stdin: the final repository tree (original + candidate diff minus protected
  paths + hidden tests, assembled by the host), the expected test ids, the deps, the
  deadline and a random per-call nonce. It writes the tree to /work/repo (root-owned,
  dirs 0755, files 0644), installs the deps from /opt/wheelhouse as root (no index, no
  network) into /work/.rlbus/site, then starts the RUNNER and collects its reports.
- The RUNNER (`python3 -I -B /work/.rlbus/harness.py runner`, uid/gid 65534, no
  capability, fresh memory image via execve, its own session, oom_score_adj 1000) runs
  pytest with the harness's plugin over exactly the expected ids, and sends one JSON line
  per report to the supervisor through fd 3 (a pipe); its stdout/stderr go to a log file
  that is shown in the details and never parsed.

Guarantees (the policy controls every non-protected file of the repository):
- The verdict only comes from /work/.rlbus/result.json, written by the supervisor after
  every uid-65534 process is dead, as `{"body": <json>, "mac": HMAC-SHA256(nonce, body)}`.
  The nonce exists only in the supervisor's memory (read from the exec's stdin, which the
  runner never inherits; the runner is another uid, so it can neither ptrace it, read its
  /proc/<pid>/mem or environ, nor signal it), and /work is root-owned and read-only to
  the runner: it cannot write, replace or delete the result, the tests or the repository.
  Exit codes and output count for nothing.
- pytest runs with `-c` the harness's own ini, `--rootdir /work/repo`, `--confcutdir`,
  `-p no:cacheprovider`, `-o addopts=`, `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1` and `python -I`
  (no PYTHON* variables, no user site, no cwd on sys.path at start-up); the repository's
  pytest config, sitecustomize and .pth files are never read (and are protected anyway).
- Each expected id counts as passed only with a passed setup, a passed (not xfail) call
  and a passed teardown; an expected id without those reports (vanished, deselected,
  skipped, a collection error, the runner killed or exiting early) counts as failed.
- In-process tamper (labelled `tamper`, all scores 0): the runner's audit hook flags
  `gc` object walks, `sys._current_frames`, ctypes memory access,
  replacing a function's `__code__`, and any write, delete, rename or chmod under /work
  (which the runner's uid could not do anyway); after every test's teardown and at the end, an
  integrity check flags rebound callables/classes in builtins, sys, os, every
  `_pytest`/`pytest`/`pluggy`/`unittest` module, and any entry of key pytest/pluggy/unittest
  classes (snapshotted before any repository code ran; see `Plugin`). A malformed or duplicate
  report line, or a report for an id that was not expected, is tamper too.
- Report lines carry a sequence number and an HMAC under a per-run runner key (sent on a
  pipe the runner reads once and closes; it lives only in closures of the runner), so a
  line written to fd 3 by anything but the harness's sender is tamper.
- Residual (documented): repository code runs inside the runner's interpreter, so code
  written to dig the sender out of pytest's plugin manager or the stack frames could
  still forge report lines; it can never forge the signed result, touch the tests, or
  outlive the run.
"""

import hashlib
import hmac
import json
import os
import select
import sys
import time

RUN_UID = 65534
WORK = "/work"
REPO = "/work/repo"
RL = "/work/.rlbus"
RESULT = RL + "/result.json"
JOB = RL + "/job.json"
INI = RL + "/pytest.ini"
LOG = RL + "/runner.log"
SITE = RL + "/site"
WHEELHOUSE = "/opt/wheelhouse"
REPORT_FD = 3
KEY_FD = 4
MAX_LINE = 1 << 20
TAMPER_EXIT = 86
RUN_PATH = "/usr/local/bin:/usr/bin:/bin"


# ---------------------------------------------------------------- supervisor (trusted, uid 0)
def _write_tree(files):
    for path, text in sorted(files.items()):
        parts = path.split("/")
        if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError("bad path %r" % path)
        d = REPO
        for p in parts[:-1]:
            d = os.path.join(d, p)
            if not os.path.isdir(d):
                os.mkdir(d, 0o755)
        fd = os.open(os.path.join(REPO, path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8", "surrogateescape"))


def _hash_files(paths):
    out = {}
    for p in paths:
        try:
            with open(os.path.join(REPO, p), "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            out[p] = None
    return out


def _install(deps, deadline):
    """Install deps from the image's wheelhouse as root; '' or the failure's tail."""
    if not deps:
        return ""
    import subprocess
    cmd = [sys.executable, "-I", "-m", "pip", "install", "--no-index", "--find-links", WHEELHOUSE, "--target", SITE,
           "--disable-pip-version-check", "--no-cache-dir", "--no-compile", "-q", "--"] + list(deps)
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=max(5.0, deadline - time.monotonic()),
                           env={"PATH": RUN_PATH, "HOME": RL, "TMPDIR": RL, "LANG": "C.UTF-8"})
    except subprocess.TimeoutExpired:
        return "pip install timed out"
    return "" if p.returncode == 0 else (p.stdout + p.stderr).decode("utf-8", "replace")[-1500:]


def _uid_pids():
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/status" % name) as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == RUN_UID:
                            pids.append(int(name))
                        break
        except (OSError, ValueError):
            pass
    return pids


def _kill_all(child):
    """Kill every uid-65534 process (as uid 0 with CAP_KILL, pid by pid, until a scan finds none: a
    killed process forks no more, so a fork bomb converges). Returns `child`'s wait status if this
    reaped it."""
    status = None
    for _ in range(2000):
        pids = _uid_pids()
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        try:
            done, st = os.waitpid(child, os.WNOHANG) if child is not None else (0, 0)
            status = st if done else status
        except ChildProcessError:
            pass
        if not pids:
            return status
        time.sleep(0.002)
    raise RuntimeError("processes of uid %d survived 2000 kill rounds" % RUN_UID)


def _start_runner(log_fd, key):
    r, w = os.pipe()
    kr, kw = os.pipe()
    os.write(kw, key)  # 32 bytes: fits the pipe buffer; read once by the runner, then closed
    os.close(kw)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
            null = os.open("/dev/null", os.O_RDONLY)
            for fd, target in ((null, 0), (log_fd, 1), (log_fd, 2), (w, REPORT_FD), (kr, KEY_FD)):
                os.dup2(fd, target)
            os.closerange(KEY_FD + 1, 1 << 16)
            os.chdir(REPO)
            os.setgroups([])
            os.setresgid(RUN_UID, RUN_UID, RUN_UID)
            os.setresuid(RUN_UID, RUN_UID, RUN_UID)
            env = {"PATH": RUN_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
            os.execve(sys.executable, [sys.executable, "-I", "-B", RL + "/harness.py", "runner"], env)
        finally:
            os._exit(127)
    os.close(w)
    os.close(kr)
    return pid, r


def _collect(pid, fd, deadline):
    """(report lines, timed_out, runner exit code): read fd 3 until the runner exits or the deadline."""
    buf, lines, exited, timed_out, status = b"", [], False, False, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.05))
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
        else:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                exited, status = True, st
                break
    reaped = _kill_all(None if exited else pid)  # every writer is dead now: what the pipe holds is final
    status = reaped if reaped is not None else status
    while True:
        ready, _, _ = select.select([fd], [], [], 0)
        chunk = os.read(fd, 1 << 16) if ready else b""
        if not chunk:
            break
        buf += chunk
    for raw in buf.split(b"\n"):
        if raw:
            lines.append(raw)
    return lines, timed_out, (None if status is None else os.waitstatus_to_exitcode(status))


def _verify_lines(lines, key):
    """The payloads of the runner's lines, in order, while each carries the next sequence number and
    its MAC under the runner key; a bad line ends the list with a tamper payload."""
    out = []
    for seq, raw in enumerate(lines):
        body, _, mac = raw.rpartition(b"\t")
        want = hmac.new(key, b"%d:" % seq + body, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, want):
            out.append(b'{"k": "tamper", "why": "a report line with a bad MAC or out of sequence (#%d)"}' % seq)
            break
        out.append(body)
    return out


def _score(lines, expected):
    """Per-id outcome and flags from the runner's report lines (see the module guarantees)."""
    phases = {tid: {} for tid in expected}
    notes, tamper, fin = [], None, False
    for raw in lines:
        try:
            msg = json.loads(raw) if len(raw) <= MAX_LINE else None
        except ValueError:
            msg = None
        if type(msg) is not dict:
            tamper = tamper or "a malformed report line"
            continue
        kind = msg.get("k")
        if kind == "tamper":
            tamper = tamper or str(msg.get("why"))[:300]
        elif kind == "report":
            tid, when = msg.get("id"), msg.get("when")
            if tid not in phases or when not in ("setup", "call", "teardown") or when in phases[tid]:
                tamper = tamper or "an unexpected report for %r (%s)" % (str(tid)[:100], when)
                continue
            ok = msg.get("outcome") == "passed" and not msg.get("xfail")
            phases[tid][when] = ok
            if not ok and msg.get("msg") and len(notes) < 20:
                notes.append("%s [%s %s]: %s" % (tid, when, msg.get("outcome"), str(msg.get("msg"))[:300]))
        elif kind == "collect_error" and len(notes) < 20:
            notes.append("collection error in %s: %s" % (str(msg.get("id"))[:100], str(msg.get("msg"))[:300]))
        elif kind == "fin":
            fin = True
    passed = {tid: all(p.get(w) is True for w in ("setup", "call", "teardown")) for tid, p in phases.items()}
    missing = [tid for tid, p in phases.items() if "call" not in p and "setup" not in p]
    return passed, missing, notes, tamper, fin


def _read_log():
    try:
        fd = os.open(LOG, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 3000))
            return f.read(3000).decode("utf-8", "replace")
    except OSError:
        return ""


def _write_result(nonce, body):
    data = json.dumps(body, sort_keys=True)
    mac = hmac.new(nonce.encode(), data.encode(), hashlib.sha256).hexdigest()
    fd = os.open(RESULT, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"body": data, "mac": mac}))


def supervise():
    job = json.loads(sys.stdin.buffer.read())
    nonce = job.pop("nonce")
    body = {"call": job["call"]}
    try:
        body.update(_supervised_run(job))
    except Exception as exc:  # noqa: BLE001 - a supervisor failure is infrastructure, reported as such
        import traceback
        body["infra"] = "supervisor failed: %s: %s\n%s" % (type(exc).__name__, exc, traceback.format_exc()[-800:])
    _write_result(nonce, body)
    sys.stdout.write("RLBUS-REPO-DONE\n")


def _supervised_run(job):
    if os.geteuid() != 0:
        return {"infra": "the supervisor must run as uid 0 (with SETUID/SETGID/KILL), not %d" % os.geteuid()}
    t0 = time.monotonic()
    os.umask(0o022)
    os.mkdir(RL, 0o755)
    os.mkdir(REPO, 0o755)
    _write_tree(job["files"])
    with open(RL + "/harness.py", "w") as f:
        f.write(job["harness"])
    with open(INI, "w") as f:
        f.write("[pytest]\naddopts =\n")
    deadline = t0 + float(job["install_timeout_s"])
    err = _install(job.get("deps") or [], deadline)
    if err:
        return {"infra": "installing %s from the wheelhouse failed: %s" % (job["deps"], err)}
    runner_job = {"expected": job["expected"], "paths": job["paths"], "pythonpath": job["pythonpath"],
                  "site": SITE if job.get("deps") else None}
    with open(JOB, "w") as f:
        json.dump(runner_job, f)
    before = _hash_files(job["protect_hash"])
    log_fd = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    t1 = time.monotonic()
    key = os.urandom(32)
    pid, rfd = _start_runner(log_fd, key)
    os.close(log_fd)
    lines, timed_out, runner_exit = _collect(pid, rfd, t1 + float(job["timeout_s"]))
    passed, missing, notes, tamper, fin = _score(_verify_lines(lines, key), job["expected"])
    after = _hash_files(job["protect_hash"])
    if after != before:
        tamper = tamper or "a test file changed during the run"
    return {"passed": passed, "missing": missing, "notes": notes, "tamper": tamper, "fin": fin,
            "timed_out": timed_out, "runner_exit": runner_exit, "log": _read_log(), "setup_s": round(t1 - t0, 3),
            "run_s": round(time.monotonic() - t1, 3)}


# ---------------------------------------------------------------- runner (untrusted, uid 65534)
def _make_sender(key):
    """send(obj): one line `json \t HMAC(key, seq:json)` on fd 3; the key lives only in this closure."""
    mac, write, dumps, counter = hmac.new, os.write, json.dumps, [0]

    def send(obj):
        body = dumps(obj).encode()
        data = body + b"\t" + mac(key, b"%d:" % counter[0] + body, hashlib.sha256).hexdigest().encode() + b"\n"
        counter[0] += 1
        while data:
            data = data[write(REPORT_FD, data):]

    return send


def _make_tamper(send):
    """tamper(why): report the attempt, then end the runner with TAMPER_EXIT."""
    exit_ = os._exit

    def tamper(why):
        try:
            send({"k": "tamper", "why": why})
        finally:
            exit_(TAMPER_EXIT)

    return tamper


WATCHED_PREFIXES = ("_pytest", "pytest", "pluggy", "unittest")
SYS_VOLATILE = frozenset(("unraisablehook", "excepthook", "displayhook", "breakpointhook", "last_type",
                          "last_value", "last_traceback", "last_exc", "ps1", "ps2", "exc_info"))
KEY_CLASSES = ("_pytest.reports:BaseReport", "_pytest.reports:TestReport", "_pytest.reports:CollectReport",
               "_pytest.runner:CallInfo", "_pytest.nodes:Node", "_pytest.nodes:Item", "_pytest.python:Function",
               "_pytest.main:Session", "_pytest.config:Config", "_pytest.outcomes:OutcomeException",
               "pluggy._hooks:HookCaller", "pluggy._manager:PluginManager", "unittest.case:TestCase")


def _watched_modules():
    return sorted(name for name in list(sys.modules)
                  if name.split(".")[0] in WATCHED_PREFIXES and sys.modules[name] is not None)


def _integrity_check(extra):
    """A check() that names what changed since now: callables and classes rebound in builtins, sys,
    os, the watched modules and key classes (their whole dicts), or '' when nothing did."""
    import builtins

    spaces = [("builtins", vars(builtins)), ("sys", vars(sys)), ("os", vars(os)), ("harness", extra)]
    spaces += [(m, vars(sys.modules[m])) for m in _watched_modules()]
    for ref in KEY_CLASSES:
        mod, _, cls = ref.partition(":")
        if mod in sys.modules and hasattr(sys.modules[mod], cls):
            spaces.append((ref, getattr(sys.modules[mod], cls).__dict__))
    snap = []
    for name, ns in spaces:
        keep = {k: v for k, v in ns.items()
                if (":" in name or callable(v) or isinstance(v, type)) and not (name == "sys" and k in SYS_VOLATILE)}
        snap.append((name, ns, keep))
    missing = object()

    def check():
        for name, ns, keep in snap:
            for k, v in keep.items():
                if ns.get(k, missing) is not v:
                    return "rebound %s.%s" % (name, k)
        return ""

    return check


def _audit_hook(_tamper):
    """Flags what only tampering needs (see the module guarantees), and any write under /work
    (the repository, the tests, the harness and its result are read-only to the runner anyway)."""
    forbidden = frozenset(("sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents"))
    path_events = frozenset(("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                             "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree"))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, work = os.path.realpath, WORK + "/"

    def under_work(path):
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        return isinstance(path, str) and (realpath(path) + "/").startswith(work)

    def hook(event, args):
        if event in forbidden:
            _tamper("forbidden operation: %s" % event)
        elif event.startswith("ctypes.") and event not in ("ctypes.dlopen", "ctypes.dlsym"):
            _tamper("forbidden operation: %s" % event)
        elif event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
            _tamper("replaced a function's __code__")
        elif event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writing = (mode and any(c in str(mode) for c in "wax+")) or (not mode and flags and flags & write_flags)
            if writing and under_work(path):
                _tamper("tried to write %s" % path)
        elif event in path_events and args and any(under_work(a) for a in args[:2]):
            _tamper("tried %s on %s" % (event, args[0]))

    return hook


class Plugin:
    """Reports every phase of every expected test to the supervisor; deselects the rest.

    The integrity snapshot is taken in `pytest_load_initial_conftests` (no tryfirst/trylast): after
    pytest's own early patches (legacypath's, tryfirst) and before the conftests, the first place
    where repository code can run, are imported (pytest's own impl, trylast)."""

    def __init__(self, expected, send, tamper):
        self.expected, self.check, self._send, self._tamper = frozenset(expected), None, send, tamper

    def pytest_load_initial_conftests(self, early_config, parser, args):
        self.check = _integrity_check(globals())

    def pytest_collection_modifyitems(self, session, config, items):
        keep = [it for it in items if it.nodeid in self.expected]
        drop = [it for it in items if it.nodeid not in self.expected]
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)

    def pytest_collectreport(self, report):
        if report.failed:
            self._send({"k": "collect_error", "id": report.nodeid, "msg": str(report.longrepr)[-600:]})

    def pytest_runtest_logreport(self, report):
        msg = ""
        if not report.passed:
            crash = getattr(report.longrepr, "reprcrash", None)
            msg = crash.message if crash is not None else str(report.longrepr)[-400:]
        self._send({"k": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
               "xfail": hasattr(report, "wasxfail"), "msg": msg})
        if report.when == "teardown":
            bad = self.check() if self.check else "no integrity snapshot"
            if bad:
                self._tamper(bad)

    def pytest_sessionfinish(self, session, exitstatus):
        bad = self.check() if self.check else "no integrity snapshot"
        if bad:
            self._tamper(bad)


def runner():
    key = os.read(KEY_FD, 64)
    os.close(KEY_FD)
    send = _make_sender(key)  # the key and the sender live in closures, never in a module global
    tamper = _make_tamper(send)
    del key
    with open(JOB) as f:
        job = json.load(f)
    for p in reversed(job["pythonpath"]):
        sys.path.insert(0, os.path.join(REPO, p) if p != "." else REPO)
    if job.get("site"):
        sys.path.insert(len(job["pythonpath"]), job["site"])
    import importlib

    import _pytest.config
    import pytest
    for name in _pytest.config.default_plugins:  # every built-in plugin loaded before the snapshot
        try:
            importlib.import_module("_pytest." + name)
        except ImportError:
            pass
    import unittest  # noqa: F401 - snapshotted too
    plugin = Plugin(job["expected"], send, tamper)
    sys.addaudithook(_audit_hook(tamper))
    args = ["-c", INI, "--rootdir", REPO, "--confcutdir", REPO, "-p", "no:cacheprovider", "-o", "addopts=",
            "-q", "-rN", "--tb=short"] + list(job["paths"])
    pytest.main(args, plugins=[plugin])
    send({"k": "fin"})
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    {"supervise": supervise, "runner": runner}[sys.argv[1]]()
