"""Test harness for the `code` verifier: runs INSIDE a fresh sandbox (one program, stdlib only).

The verifier uploads `candidate.py` (the policy's program, nothing else), `tests.py` (the
hidden checks, each `assert` rewritten into a counted `__rlbus_assert__(lambda: X, line)`),
`job.marshal` (entry point, public prompt, deadline, per-run nonce) and this program as
`harness.py`, then runs it as `python3 -I -S harness.py` (or the docker agent, as
`__main__` in a fork that dropped from uid 0). A trusted supervisor runs the tests; each `candidate(...)` in them is
an RPC to the runner, which runs the candidate. The supervisor prints ONE result line and,
iff every assertion passed and nothing was flagged, `RLBUS-PASS HMAC-SHA256(nonce,
"pass:<tests sha256>:<candidate sha256>")`; the exit status counts for nothing.

Guarantees (the policy controls candidate.py entirely):
- It cannot print the proof: the nonce lives only in the supervisor's memory (read and
  unlinked after the runner was forked, before any candidate code runs; the supervisor is
  non-dumpable, so /proc/<pid>/mem, /proc/<pid>/fd and ptrace are refused), and the
  runner's stdout/stderr are a file, not the sandbox's.
- It cannot subvert the tests: the assertions, `check` and the prompt's helpers run in
  the supervisor, from the bytes read before the candidate existed; return values travel
  as `marshal` data and must be exact None/bool/int/float/complex/str/bytes or
  list/tuple/dict/set/frozenset of them, so "always equal" objects or patched
  builtins/`assert`/`check`/`exit` have no effect on the verdict.
- It cannot read the tests: they are unlinked before it runs, and the audit hook ends it
  on any open() resolving under /proc.
- The test file cannot change unnoticed: once the runner is dead, the supervisor re-reads
  the uploaded file through the fd it opened before any candidate code ran (the runner
  never holds it) and reports its sha256 as `tests_sha256_after`; a change, or any file
  at tests.py or job.marshal, is tamper and withholds the proof.
- Labelled tamper (never a pass): SystemExit or exit 0 before the end; atexit handlers;
  rebinding builtins, sys, os, preloaded modules or this file's globals; a top-level
  `check`; returned objects whose class defines `__eq__`; whatever the audit hook forbids
  (FORBIDDEN_EVENTS/IMPORTS, files opened for writing, /proc). The verifier also flags
  pass-like lines in the candidate's output.
- Residual: a candidate that escapes the audit hook still only controls the runner: it
  can return values, never print the proof. Hangs and memory are bounded by the deadline
  and the sandbox's limits, and score 0.

The program is four parts, joined into ONE text before it is shipped
(`verifier_workers.harness_programs.code_harness`, which drops their imports of each
other: in the sandbox every name below is a global of `__main__`, watched by the
runner's integrity check): `harness_protocol` (framing, plain data, the HMAC),
`harness_runner` (the untrusted side), `harness_supervisor` (the trusted side, the
tests) and this module (the two processes' set-up, the checks after the run, `main`).
"""

import io
import marshal
import os
import sys
import time

from verifier_workers.harness_protocol import PASS, RESULT, START, TAMPER_EXIT, hmac_sha256, sha256
from verifier_workers.harness_runner import PRELOAD, runner
from verifier_workers.harness_supervisor import supervise

# the sandbox's own temp dir: /tmp is private with bwrap and docker; a degraded sandbox shares the
# host's /tmp, so there TMPDIR is its private work dir (no collision or planted file between sandboxes)
RUNNER_OUT = os.path.join(os.environ.get("TMPDIR") or "/tmp", "runner.out")


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


def _start_runner():
    """(pid, request fd, reply fd) of the runner: only its pipes open, output to RUNNER_OUT."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            out = os.open(RUNNER_OUT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            null = os.open("/dev/null", os.O_RDONLY)
            for fd, target in ((null, 0), (out, 1), (out, 2)):
                os.dup2(fd, target)
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
    return pid, req_w, resp_r


def _read_fd(fd, limit=-1):
    """The file's bytes from offset 0 (at most `limit`), read through `fd` whatever its path now is."""
    f = io.open(fd, "rb", closefd=False)
    f.seek(0)
    return f.read(limit)


def _take_job_and_tests():
    """(job, test bytes, test fd): read, unlinked; the fd (the runner has none) stays open for the re-hash."""
    with open("job.marshal", "rb") as f:
        job = marshal.loads(f.read())  # written by the verifier (trusted)
    tests_fd = os.open("tests.py", os.O_RDONLY)
    tests_bytes = _read_fd(tests_fd)
    os.unlink("job.marshal")
    os.unlink("tests.py")
    return job, tests_bytes, tests_fd


def _reap(pid, grace_s):
    """The runner's exit code, once it is dead (killed after `grace_s`)."""
    deadline, done, status = time.monotonic() + grace_s, 0, 0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.002)
    if not done:
        os.kill(pid, 9)  # not reaped yet, so it exists (a zombie at worst): this cannot fail
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8


def _after_run(out, pid, tests_fd, tests_size, tests_sha):
    """Reap the runner, label its exit, forward its output, re-check the files (a read error: no result)."""
    code = out["runner_exit"] = _reap(pid, 0.5 if out["result"] != "timeout" else 0.0)
    if out["result"] not in ("tamper", "timeout") and code == TAMPER_EXIT:
        out.update(result="tamper", detail="the candidate's process exited with the tamper code")
    if out["result"] == "fail" and out["detail"] == "the candidate's process ended early" and code == 0:
        out.update(result="tamper", detail="the candidate's process exited with status 0 before the tests finished")
    try:
        with open(RUNNER_OUT, "rb") as f:
            sys.stderr.write(f.read(64 * 1024).decode("utf-8", "replace"))  # scanned for pass-like lines
    except OSError:
        pass
    for name in ("tests.py", "job.marshal"):
        if os.path.lexists(name) and out["result"] != "tamper":
            out.update(result="tamper", detail="the candidate wrote %s" % name)
    out["tests_sha256_after"] = sha256(_read_fd(tests_fd, tests_size + 1)).hexdigest()
    os.close(tests_fd)
    if out["tests_sha256_after"] != tests_sha and out["result"] != "tamper":
        out.update(result="tamper", detail="the test file changed on disk while the candidate ran")


def main():
    sys.stdout.write(START + "\n")
    sys.stdout.flush()
    for name in PRELOAD:  # shared by both processes, and snapshotted by the runner
        try:
            __import__(name)
        except Exception:
            pass
    pid, req_w, resp_r = _start_runner()  # runner: nothing secret has been read yet
    job, tests_bytes, tests_fd = _take_job_and_tests()
    nonce = job.pop("nonce").encode()
    dumpable_off = _nondumpable()
    tests_sha = sha256(tests_bytes).hexdigest()
    with open("candidate.py", "rb") as f:
        candidate_sha = sha256(f.read()).hexdigest()
    out = supervise(pid, req_w, resp_r, job, tests_bytes.decode("utf-8"), tests_sha)
    os.close(req_w)
    _after_run(out, pid, tests_fd, len(tests_bytes), tests_sha)
    out["candidate_sha256"] = candidate_sha
    out["nondumpable"] = dumpable_off
    sys.stdout.write(RESULT + repr(out) + "\n")  # plain literals: the verifier reads it with literal_eval
    if out["result"] == "pass" and out["tests_sha256_after"] == tests_sha:
        proof = hmac_sha256(nonce, ("pass:%s:%s" % (tests_sha, candidate_sha)).encode())
        sys.stdout.write(PASS + proof + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
