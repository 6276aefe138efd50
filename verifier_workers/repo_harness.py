"""The `repo` verifier's in-container program (standalone, stdlib only; the runner imports pytest
and the harness's guard, `verifier_workers/repo_harness_guard.py` joined with its parts,
installed as `_rlbus_guard`: `verifier_workers.harness_programs.repo_guard`).

Two processes, two uids, in a fresh container whose execs may run as uid 0 with only the
SETUID, SETGID and KILL capabilities (`sandbox_workers.docker_fresh`):

- The SUPERVISOR (`python3 -I -S -c <this file> supervise`, uid 0, trusted) reads the job
  from its stdin: the final repository tree (original + candidate diff minus protected
  paths + hidden tests, assembled by the host), the expected test ids, the deps, the
  deadline, the new top-level module names of the diff and a random per-call nonce. It writes
  the tree to /work/repo (root-owned, dirs 0755, files 0644), installs the deps from
  /opt/wheelhouse as root (no index, no network) into /work/.rlbus/site, refuses a new
  top-level module that an installed distribution of this interpreter (or a dep) provides,
  then starts the RUNNER and collects its reports. No job file exists: the runner's part of the
  job and its report key travel on a pipe (fd 4) that the runner reads to EOF and closes.
- The RUNNER (`python3 -I -B /work/.rlbus/harness.py runner`, uid/gid 65534, no
  capability, fresh memory image via execve, its own session, oom_score_adj 1000, not
  dumpable) imports pytest, every built-in plugin, unittest and the guard FIRST, with only the
  stdlib, site-packages and /work/.rlbus/lib on sys.path; only then are the deps' site and the
  repository appended (after them: a repository module never shadows an installed one), the
  guard's audit hook installed, and pytest run (`--import-mode=append`) over exactly the expected
  ids. One JSON line per report goes to the supervisor through fd 3; stdout/stderr go to a log
  file that is shown in the details and never parsed.

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
  (no PYTHON* variables, no user site, no script dir or cwd on sys.path); the repository's
  pytest config, sitecustomize and .pth files are never read (and are protected anyway).
- Each expected id counts as passed only with a passed setup, a passed (not xfail) call
  and a passed teardown; an expected id without those reports (vanished, deselected,
  skipped, a collection error, the runner killed or exiting early) counts as failed.
- Report lines carry a sequence number and an HMAC under a per-run key that exists only in the
  frame of the guard's sender generator, and the sender writes a passing report only from
  pytest's genuine call stack (see `repo_harness_guard_report`): calling the sender from candidate code,
  or reaching it through frames (refused by the audit hook) forges nothing. A line written to
  fd 3 by anything else, a malformed or duplicate report, or one for an unexpected id is tamper.
- In-process tamper (labelled `tamper`, all scores 0): the guard's audit hook and integrity
  checks (after every report: builtins, sys, os, pytest/pluggy/unittest, key classes, every
  hook's implementations, the test modules and test functions) -- see `repo_harness_guard`
  and `repo_harness_guard_audit`.
- Hidden-test comparisons see only plain data (the host rewrites the test files,
  `repo_harness_rewrite`), so a candidate-defined `__eq__`/`__bool__` decides nothing.
- Residual (documented in docs/architecture.md): candidate code runs inside the runner's
  interpreter, so it can read the test modules it is imported by; it can never forge the
  signed result, touch the tests, or outlive the run.
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
LIB = RL + "/lib"
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

    cmd = [
        sys.executable,
        "-I",
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        WHEELHOUSE,
        "--target",
        SITE,
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--no-compile",
        "-q",
        "--",
    ] + list(deps)
    try:
        p = subprocess.run(
            cmd,
            capture_output=True,
            timeout=max(5.0, deadline - time.monotonic()),
            env={"PATH": RUN_PATH, "HOME": RL, "TMPDIR": RL, "LANG": "C.UTF-8"},
        )
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


def _start_runner(log_fd, payload):
    """Fork the runner; `payload` (the key's hex, a newline, the runner's job) goes on its fd 4."""
    r, w = os.pipe()
    kr, kw = os.pipe()
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
            env = {
                "PATH": RUN_PATH,
                "HOME": "/tmp",
                "TMPDIR": "/tmp",
                "LANG": "C.UTF-8",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            }
            os.execve(sys.executable, [sys.executable, "-I", "-B", RL + "/harness.py", "runner"], env)
        finally:
            os._exit(127)
    os.close(w)
    os.close(kr)
    try:
        while payload:
            payload = payload[os.write(kw, payload) :]
    except OSError:
        pass  # the runner died before reading its job: it reports nothing, every test counts as failed
    os.close(kw)
    return pid, r


def installed_top_levels(site=None):
    """Top-level module names importable from this interpreter's site dirs (and `site`)."""
    import sysconfig

    dirs = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")} | {site}
    names = set()
    for d in sorted(x for x in dirs if x and os.path.isdir(x)):
        for entry in os.listdir(d):
            if entry.endswith((".dist-info", ".egg-info", ".pth", ".data")) or entry.startswith("__"):
                continue
            if entry.endswith(".py") or ".cpython-" in entry or entry.endswith((".so", ".pyd")):
                names.add(entry.split(".")[0])
            elif os.path.isdir(os.path.join(d, entry)) and "." not in entry:
                names.add(entry)
    return names


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
    os.mkdir(LIB, 0o755)
    with open(LIB + "/_rlbus_guard.py", "w") as f:
        f.write(job["guard"])
    with open(INI, "w") as f:
        f.write("[pytest]\naddopts =\n")
    deadline = t0 + float(job["install_timeout_s"])
    err = _install(job.get("deps") or [], deadline)
    if err:
        return {"infra": "installing %s from the wheelhouse failed: %s" % (job["deps"], err)}
    shadow = sorted(set(job.get("new_top") or ()) & installed_top_levels(SITE if job.get("deps") else None))
    if shadow:
        return {"refused": "the diff adds top-level module(s) %s that shadow installed distributions" % shadow}
    runner_job = {
        "expected": job["expected"],
        "paths": job["paths"],
        "pythonpath": job["pythonpath"],
        "site": SITE if job.get("deps") else None,
        "trusted_files": [os.path.join(REPO, p) for p in job.get("trusted_files") or ()],
    }
    before = _hash_files(job["protect_hash"])
    log_fd = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    t1 = time.monotonic()
    key = os.urandom(32)
    pid, rfd = _start_runner(log_fd, key.hex().encode() + b"\n" + json.dumps(runner_job).encode())
    os.close(log_fd)
    lines, timed_out, runner_exit = _collect(pid, rfd, t1 + float(job["timeout_s"]))
    passed, missing, notes, tamper, fin = _score(_verify_lines(lines, key), job["expected"])
    after = _hash_files(job["protect_hash"])
    if after != before:
        tamper = tamper or "a test file changed during the run"
    if runner_exit == TAMPER_EXIT and not tamper:
        tamper = "the runner was ended by the harness's guard"
    return {
        "passed": passed,
        "missing": missing,
        "notes": notes,
        "tamper": tamper,
        "fin": fin,
        "timed_out": timed_out,
        "runner_exit": runner_exit,
        "log": _read_log(),
        "setup_s": round(t1 - t0, 3),
        "run_s": round(time.monotonic() - t1, 3),
    }


# ---------------------------------------------------------------- runner (untrusted, uid 65534)
def _prctl_not_dumpable():
    """PR_SET_DUMPABLE 0: no other process of uid 65534 (a child the candidate spawns) can ptrace
    this one or open its /proc/<pid>/mem."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _runner_tamper(send):
    exit_ = os._exit

    def tamper(why):
        try:
            send(({"k": "tamper", "why": str(why)[:300]}, None))
        finally:
            exit_(TAMPER_EXIT)

    return tamper


def runner():
    sys.path.insert(0, LIB)
    import importlib

    import _pytest.config
    import _pytest.runner
    import pytest

    for name in _pytest.config.default_plugins:  # every built-in plugin loaded before any repository path
        try:
            importlib.import_module("_pytest." + name)
        except ImportError:
            pass
    import unittest  # noqa: F401 - snapshotted too

    import _rlbus_guard as guard

    trusted = guard.trusted_prefixes([RL])
    gen = guard.sender(KEY_FD, sys._getframe().f_code, trusted)
    job = next(gen)
    is_trusted = guard.make_is_trusted(trusted, frozenset(job.get("trusted_files") or ()))
    send = gen.send  # the key lives only in the generator's frame
    tamper = _runner_tamper(send)
    if job.get("site"):
        sys.path.append(job["site"])
    for p in job["pythonpath"]:  # the repository comes after the stdlib, site-packages and the deps
        sys.path.append(os.path.join(REPO, p) if p != "." else REPO)
    _prctl_not_dumpable()
    plugin = guard.Plugin(job["expected"], send, tamper, globals(), is_trusted, REPO)
    sys.addaudithook(guard.audit_hook(tamper, is_trusted))
    args = [
        "-c",
        INI,
        "--rootdir",
        REPO,
        "--confcutdir",
        REPO,
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--import-mode=append",
        "-q",
        "-rN",
        "--tb=short",
    ] + list(job["paths"])
    del job
    pytest.main(args, plugins=[plugin])
    send(({"k": "fin"}, None))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    {"supervise": supervise, "runner": runner}[sys.argv[1]]()
