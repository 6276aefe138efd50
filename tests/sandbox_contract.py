"""Checks every Sandbox backend must pass (the guarantees stated in sandbox_workers/base.py).

Shared by tests/test_sandbox_process.py and tests/test_sandbox_docker.py: each backend's
test calls the check with its own started `sbx` (whose fixture also proves that nothing
of the sandbox is left once the test ends). A check only asserts; it never cleans up.
"""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from sandbox_workers.base import Limits


def py(code: str) -> list[str]:
    """argv running `code` with the sandbox's python3."""
    return ["python3", "-c", code]


@contextlib.contextmanager
def host_listener():
    """A listening TCP port on the host's 127.0.0.1 for a sandbox to try; on a clean exit,
    asserts that nothing connected to it. The socket is closed either way."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)
    try:
        yield srv.getsockname()[1]
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def infinite_loop_times_out(sbx) -> None:
    """A busy loop is a timed-out result (killed, 137), returned within a few seconds."""
    t0 = time.monotonic()
    r = sbx.execute(py("while True: pass"), timeout=1)
    assert r.timed_out and r.exit_code == 137 and not r.oom, r
    assert time.monotonic() - t0 < 5


def fork_bomb_contained(sbx) -> None:
    """A shell fork bomb ends as a result (timed out or failed) well before 8 s."""
    r = sbx.execute("f() { f | f & }; f; sleep 30", timeout=2)
    assert r.timed_out or r.exit_code != 0, r
    assert r.duration_ms < 8000


def stdout_flood_is_capped(sbx) -> None:
    """200 MiB on stdout: the command still succeeds, stdout is capped and marked, stderr intact."""
    code = (
        "import sys\nb = b'x' * (1 << 20)\nfor _ in range(200): sys.stdout.buffer.write(b)\n"
        "sys.stdout.flush(); sys.stderr.write('done')"
    )
    r = sbx.execute(py(code), timeout=30)
    assert r.exit_code == 0 and r.truncated and not r.timed_out, r.stderr
    assert len(r.stdout) <= Limits().output_cap_bytes + 100
    assert "truncated" in r.stdout and r.stderr == "done"


def child_ignoring_sigterm_killed(sbx) -> None:
    """A command and a setsid child that both ignore SIGTERM are killed at the timeout (137)."""
    code = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    os.setsid()\n    time.sleep(300)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)\n"
    )
    r = sbx.execute(py(code), timeout=1)
    assert r.timed_out and r.exit_code == 137, r
