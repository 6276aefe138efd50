"""The code harness's SUPERVISOR side: runs the tests, each candidate call an RPC to the runner.

Part 3 of the harness program (`verifier_workers.harness`; stdlib only, joined with the
other parts into ONE program).

Guarantees: `supervise(...)` runs the prompt's helpers, the tests and `check` in this
(trusted) process; a reply is accepted only as a plain `dict` frame of at most `MAX_MSG`
bytes, and every assertion is counted (`Counter`). It returns the result dict: `pass` only
when every assertion passed and the runner acknowledged "fin"; `timeout` past the
deadline; `tamper` on a runner's tamper report or a malformed reply.
"""

import builtins
import marshal
import struct
import time

from verifier_workers.harness_protocol import MAX_MSG, Deadline, RunnerGone, RunnerTamper, plain, read_exact, send


# ---------------------------------------------------------------- supervisor (trusted side)
class Supervisor:
    """The runner's peer; stands in for the candidate function inside the tests (a call is one RPC)."""

    def __init__(self, pid, req_fd, resp_fd, deadline):
        self.pid, self.req_fd, self.resp_fd, self.deadline = pid, req_fd, resp_fd, deadline
        self.calls = 0

    def __call__(self, *args, **kwargs):
        return self.call(args, kwargs)

    def recv(self):
        n = struct.unpack(">I", read_exact(self.resp_fd, 4, self.deadline))[0]
        if n > MAX_MSG:
            raise RunnerTamper("reply of %d bytes" % n)
        try:
            msg = marshal.loads(read_exact(self.resp_fd, n, self.deadline))
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
    """`__rlbus_assert__`: counts every assertion (a failure does not stop the tests)."""

    passed = failed = 0
    first_failure = None

    def __call__(self, test, line):
        try:
            ok = bool(test())
        except Exception as exc:
            ok, why = False, "%s: %s" % (type(exc).__name__, exc)
        else:
            why = "assertion failed"
        self.passed, self.failed = self.passed + ok, self.failed + (not ok)
        if not ok and self.first_failure is None:
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
        ns[job["entry_point"]] = sup
        exec(compile(tests, "tests.py", "exec"), ns)
        try:
            ns["check"](sup)
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
        out.update(
            result="timeout",
            passed=counter.passed,
            failed=counter.failed,
            detail="deadline of %ss passed after %d calls" % (job.get("timeout_s"), sup.calls),
        )
    except RunnerTamper as exc:
        out.update(result="tamper", detail=str(exc))
    except RunnerGone:
        out.update(passed=counter.passed, failed=counter.failed, detail="the candidate's process ended early")
    return out
