"""Workers forked from the launcher (`rlbus.run.forked`): the child runs `rlbus <argv>` in its own
session with exactly the given environment, its output in the log, and is driven like a Popen.

Forking is safe only from a process with no thread but the main one (`can_fork`, as the launcher
checks): a pytest process may hold others (pytest-xdist's execnet threads, threads earlier tests
left), and a child forked there can hang on a lock one of them held. So the fork tests run in a
fresh single-threaded pytest that `test_fork_tests_in_a_fresh_single_threaded_process` starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.run.forked import can_fork, fork_worker
from rlbus.run.startgate import START_GATE_ENV

FRESH_ENV = "RLBUS_FORK_TESTS_FRESH"
FRESH = os.environ.get(FRESH_ENV) == "1"
fresh_only = pytest.mark.skipif(not FRESH, reason="forks its process: run by the fresh-process test below")


def test_fork_tests_in_a_fresh_single_threaded_process():
    if FRESH:
        pytest.skip("this is the fresh process")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env[FRESH_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[1])
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


@fresh_only
def test_a_forked_command_writes_its_log_and_exits_with_its_code(tmp_path):
    assert can_fork(), "the fresh pytest process must have one thread"
    log = tmp_path / "w.log"
    proc = fork_worker(["config-help", "run.max_steps"], {"PATH": os.environ.get("PATH", "")}, log)
    assert proc.wait(30) == 0 and proc.poll() == 0
    assert "run.max_steps (int)" in log.read_text()


@fresh_only
def test_a_forked_worker_that_fails_exits_non_zero_with_its_reason_in_the_log(tmp_path):
    assert can_fork(), "the fresh pytest process must have one thread"
    log = tmp_path / "w.log"
    proc = fork_worker(["worker", "sampler", "--config", str(tmp_path / "missing.toml")], {}, log)
    assert proc.wait(30) != 0
    assert "missing.toml" in log.read_text()


@fresh_only
def test_a_forked_worker_has_its_own_session_and_obeys_signals(tmp_path):
    assert can_fork(), "the fresh pytest process must have one thread"
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nrun_id = "r1"\n')
    env = {START_GATE_ENV: str(tmp_path / "never.gate"), "RLBUS_LAUNCHER_PID": str(os.getpid())}
    proc = fork_worker(["worker", "sampler", "--config", str(cfg), "--run-dir", str(tmp_path)], env, tmp_path / "w.log")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)  # waiting at the closed gate
        assert os.getsid(proc.pid) == proc.pid
        want, deadline = f"rlbus.cli worker sampler --config {cfg}", time.monotonic() + 10
        while want not in (cmdline := open(f"/proc/{proc.pid}/cmdline").read()) and time.monotonic() < deadline:
            time.sleep(0.05)  # what ps, pgrep -f and --resume's checks read, once the child has set it
        assert want in cmdline, cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM
    proc.kill()  # a no-op once it has exited
    time.sleep(0.05)
    assert proc.poll() == -signal.SIGTERM
