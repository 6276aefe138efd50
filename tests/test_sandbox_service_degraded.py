"""Degraded sandboxes are never silent (issue 27): the red warning reaches stderr whichever
way degraded mode was granted, a leftover RLBUS_SANDBOX_ALLOW_DEGRADED included.

Each case runs in a fresh interpreter (the warning is printed once per process) and opens a
real process sandbox in degraded mode, then runs a command in it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

OPEN = (
    "from sandbox_workers.process import ProcessSandbox\n"
    "sb = ProcessSandbox(isolation='degraded', allow_degraded={arg})\n"
    "sb.start()\n"
    "print(sb.isolation, sb.execute('echo ran').stdout.strip())\n"
    "sb.close()\n"
)


def _open_degraded(arg: bool, env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RLBUS_SANDBOX_ALLOW_DEGRADED"}
    if env_value is not None:
        env["RLBUS_SANDBOX_ALLOW_DEGRADED"] = env_value
    return subprocess.run(
        [sys.executable, "-c", OPEN.format(arg=arg)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "arg, env_value, source",
    [
        (False, "1", "env RLBUS_SANDBOX_ALLOW_DEGRADED=1"),  # a leftover variable: before, only a log line on stdout
        (True, None, "sandbox.allow_degraded"),
    ],
)
def test_degraded_mode_prints_the_red_warning_on_stderr(arg, env_value, source):
    r = _open_degraded(arg, env_value)
    assert r.returncode == 0, r.stderr
    assert "degraded ran" in r.stdout
    err = " ".join(r.stderr.split())
    assert "sandbox isolation: DEGRADED" in err and f"allowed by {source}" in err, r.stderr
    assert "WITHOUT network or filesystem isolation" in err and "NATS" in err


def test_without_permission_degraded_mode_is_refused():
    r = _open_degraded(False, None)
    assert r.returncode != 0 and "SandboxRefused" in r.stderr and "DEGRADED" not in r.stderr
