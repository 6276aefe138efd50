"""`rlbus status --json` against a live null-model pipeline of real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("drop_run")


def test_status_json_reports_steps_stages_and_every_worker(nats_url, run_id, null_pipeline):
    procs = null_pipeline
    out = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlbus.cli",
                "status",
                "--nats-url",
                nats_url,
                "--run-id",
                run_id,
                "--json",
                "--listen",
                "2",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        lines = res.stdout.strip().splitlines()
        assert len(lines) == 1
        out = json.loads(lines[0])
        if out["step"] > 0 and len(out["workers"]) == 4 and out["stages"]["rollout"]["rate_per_s"] > 0:
            break
        time.sleep(1)
    assert out is not None and out["run_id"] == run_id
    assert out["step"] > 0 and out["weight_version"] >= 1
    assert {w["role"] for w in out["workers"]} == set(procs)
    assert {w["pid"] for w in out["workers"]} == {p.pid for p in procs.values()}
    assert all(w["host"] and w["last_heartbeat"] > time.time() - 30 for w in out["workers"])
    assert out["stages"]["rollout"]["rate_per_s"] > 0 and out["stages"]["learner"]["total"] > 0
    assert {"queue_depth"} <= set(out["stages"]["rollout"]) and "messages" in out["stages"]["dlq"]


def test_status_without_a_run_says_what_to_pass(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "status", "--run-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "pass --run-id" in res.stderr
