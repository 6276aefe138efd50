"""`rlbus top --once` against a live null-model pipeline of real worker processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, logs

pytestmark = pytest.mark.usefixtures("drop_run")


def cells(line: str) -> list[str]:
    """The cells of one rendered table row."""
    return [c.strip() for c in line.split("│")[1:-1]]


def top_once(nats_url: str, run_id: str) -> str:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "top",
            "--once",
            "--nats-url",
            nats_url,
            "--run-id",
            run_id,
            "--listen",
            "2.5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_top_once_renders_every_panel_from_a_live_run(tmp_path, nats_url, run_id, null_pipeline):
    procs = null_pipeline
    out, deadline = "", time.monotonic() + 90
    while time.monotonic() < deadline:
        out = top_once(nats_url, run_id)
        arith_rows = [cells(line) for line in out.splitlines() if line.startswith("│ arith")]
        has_rewards = any(len(r) > 1 and r[1].isdigit() and int(r[1]) > 0 for r in arith_rows)
        if has_rewards and all(str(p.pid) in out for p in procs.values()) and "weight version 0" not in out:
            break
        time.sleep(1)
    assert "\x1b[" not in out, "--once prints plain text"
    for panel in ("stages", "consumer lag", "reward and eval by domain", "staleness", "workers (heartbeats)"):
        assert panel in out, f"{panel!r} missing:\n{out}"
    assert f"run {run_id}" in out and "dead letters 0" in out
    rows = [cells(line) for line in out.splitlines() if line.startswith("│")]
    assert any(r[0] == "arith" and int(r[1]) > 0 for r in rows), out  # recent rewards of the domain
    consumers = {(r[0] or None, r[2]) for r in rows if len(r) == 7}
    assert {"rollout", "verifier", "learner"} <= {name for _, name in consumers}, out
    assert any(r[0] == "TRAJ" for r in rows) and any(r[0] == "DLQ" and r[1] == "0" for r in rows), out
    heartbeats = {(r[0], r[3]) for r in rows if len(r) == 6}
    for role, p in procs.items():
        assert (role, str(p.pid)) in heartbeats, f"{role} heartbeat missing:\n{out}\n{logs(tmp_path)}"
    assert any(r[0] == "rollout" and r[2].endswith("traj/s") for r in rows if len(r) == 4), out
    assert sum(int(r[1]) for r in rows if len(r) == 3 and r[0] in ("0", "1", "2", "3", "4+", "unknown")) > 0, out
    assert "weight version 0" not in out, f"learner never published a new version:\n{out}"


def test_top_help_explains_usage():
    res = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "top", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and "--once" in res.stdout and "monitor" in res.stdout
