"""The names test on a real run (issue 34): `rlbus up` of a tiny config, its own nats-server's
monitoring endpoint read from run.json (`monitor_url`), and every ScaledObject of `rlbus k8s render`
for the same config and run id found in `/jsz?consumers=true` under exactly its stream and consumer
names: the consumers the running workers created, not ones the test made. e2e: it starts a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from rlbus.deploy import k8s
from schemas.config import load_config
from tests.smoke_run import CONFIG

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def _jsz(url: str) -> set[tuple[str, str, str]]:
    with urllib.request.urlopen(f"{url}/jsz?consumers=true", timeout=5) as resp:
        data = json.load(resp)
    return {
        (a["name"], s["name"], c["name"])
        for a in data.get("account_details") or []
        for s in a.get("stream_detail") or []
        for c in s.get("consumer_detail") or []
    }


def _steps(run_path: Path) -> int:
    try:
        return int(json.loads((run_path / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError):
        return 0


def test_scaled_objects_match_a_running_run(tmp_path):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(
        CONFIG.replace("max_steps = 25", "max_steps = 4").replace("[sft]\n", "[sft]\nenabled = false\n")
    )
    run_id = f"k8s-{os.getpid()}"
    run_path = tmp_path / "runs" / run_id
    cmd = [
        sys.executable,
        "-m",
        "rlbus.cli",
        "up",
        str(cfg_path),
        "--run-id",
        run_id,
        "--run-dir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen: set = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and _steps(run_path) < 1:
            time.sleep(1)
        state = json.loads((run_path / "run.json").read_text())
        assert state["monitor_url"].startswith("http://127.0.0.1:"), state
        seen = _jsz(state["monitor_url"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = tmp_path / "k8s"
    k8s.render(load_config(cfg_path), run_id, out, image="i")
    docs = list(yaml.safe_load_all((out / "overlays" / run_id / "keda.yaml").read_text()))
    triggers = [t["metadata"] for d in docs for t in d["spec"]["triggers"]]
    assert len(triggers) >= 2
    for m in triggers:
        assert (m["account"], m["stream"], m["consumer"]) in seen, (m, sorted(seen))
