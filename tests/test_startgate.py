"""The start gate (`rlbus.run.startgate`): workers `rlbus up` starts before the model is ready wait
for the launcher, never outlive it, and a worker started any other way never waits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from rlbus.run.startgate import START_GATE_ENV, close_gate, loads_model, open_gate, pass_gate
from schemas.config import load_config


def test_no_gate_in_the_environment_returns_at_once(monkeypatch):
    monkeypatch.delenv(START_GATE_ENV, raising=False)
    assert pass_gate("sampler", "no.such.module.is.imported", load_config(None)) == 0.0


def test_an_open_gate_is_passed_without_importing(monkeypatch, tmp_path):
    gate = tmp_path / "start.gate"
    open_gate(gate)
    monkeypatch.setenv(START_GATE_ENV, str(gate))
    assert pass_gate("sampler", "no.such.module.is.imported", load_config(None)) == 0.0
    close_gate(gate)
    assert not gate.exists()
    close_gate(gate)  # a missing gate is fine


def test_a_worker_waits_until_the_launcher_opens_the_gate(monkeypatch, tmp_path):
    gate = tmp_path / "start.gate"
    monkeypatch.setenv(START_GATE_ENV, str(gate))
    monkeypatch.setenv("RLBUS_LAUNCHER_PID", str(os.getpid()))
    timer = threading.Timer(0.4, open_gate, args=(gate,))
    timer.start()
    t0 = time.monotonic()
    waited = pass_gate("sampler", "json", load_config(None))
    assert gate.exists() and 0.3 <= waited <= time.monotonic() - t0


def test_a_worker_whose_launcher_is_gone_exits(monkeypatch, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv(START_GATE_ENV, str(tmp_path / "never.gate"))
    monkeypatch.setenv("RLBUS_LAUNCHER_PID", str(dead.pid))
    with pytest.raises(SystemExit, match="launcher"):
        pass_gate("sampler", "json", load_config(None))


def test_which_roles_prewarm_the_model_code():
    cfg = load_config(None)
    assert loads_model("learner", cfg) and loads_model("rollout", cfg) and loads_model("scheduler", cfg)
    assert not loads_model("sampler", cfg) and not loads_model("verifier", cfg)
    null = load_config(None, ["learner.policy=null", "rollout.engine=null"])
    assert not loads_model("learner", null) and not loads_model("rollout", null)
