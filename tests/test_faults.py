"""The fault matrix (bench/faults.py) on real runs: the cheap cases here, every case in the
slow set; and the watchdog's parts (server keeper, heartbeat watch, full store) alone."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.faults import CASES, run_case
from bus.server import EmbeddedNats
from rlbus.run.watchdog import FatalStop, HeartbeatWatch, ServerKeeper, store_full

CHEAP = [c.fault for c in CASES if c.cheap]
SLOW = ["store-full", "postgres-restart", "docker-restart", "cluster-node"]
"""The cases that need more than a plain run (root, PostgreSQL, Docker, three servers); the
other cases are rows of `python bench/faults.py` (docs/reliability.md)."""


def _case(name: str):
    return next(c for c in CASES if c.fault == name)


def _check_row(row: dict) -> None:
    assert "skipped" not in row and "error" not in row, row
    assert row["lost"] == 0 and row["trained_twice"] == 0, row
    assert not row["traceback"], row


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CHEAP)
def test_a_cheap_fault_heals_by_itself_and_loses_nothing(tmp_path, name):
    case = _case(name)  # healing is the subject, not the warm start: no SFT
    row = run_case(dataclasses.replace(case, overrides=(*case.overrides, "sft.enabled=false")), tmp_path, seed=0)
    _check_row(row)
    assert row["healed"] and not row["resume_needed"], row
    assert row["dead_letters"] == 0, row
    assert row["recovery_s"] is not None and row["recovery_s"] < 120, row
    if name == "nats-server":
        assert "nats-server" in row["message"] and "restarted on the same store" in row["message"], row
    else:
        assert row["restarts"].get("rollout", 0) >= 1, row
    if name == "sigstop-rollout":  # found by its missing heartbeat, not by its exit
        assert "sent no heartbeat" in row["message"], row


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", SLOW)
def test_a_fault_outside_the_bus_heals_or_stops_with_the_next_step(tmp_path, name):
    row = run_case(_case(name), tmp_path, seed=0)
    if "skipped" in row:
        pytest.skip(row["skipped"])
    _check_row(row)
    if row["resume_needed"]:
        assert name in ("store-full", "kill-launcher"), row
        if name == "store-full":
            assert row["stopped_s"] <= 30, row
            assert "rlbus up --resume" in row["message"] and "free at least" in row["message"], row
    else:
        assert row["healed"], row
    if name == "postgres-restart":
        assert row["sql_missing"] == 0 and row["sql_reward_rows"] == row["sql_distinct"], row
    if name == "docker-restart":
        assert row["containers_left"] == 0, row
    assert row["dead_letters"] == 0, row


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_killing_rollout_with_weight_updates_in_flight_loses_nothing(tmp_path):
    """The fault matrix's `kill-rollout-inflight` row: a rollout worker generating in 1-token chunks
    (a new version between them) is SIGKILLed; restarted, it loses and duplicates nothing."""
    case = _case("kill-rollout-inflight")
    row = run_case(dataclasses.replace(case, overrides=(*case.overrides, "sft.enabled=false")), tmp_path, seed=0)
    _check_row(row)
    assert row["healed"] and not row["resume_needed"] and row["restarts"].get("rollout", 0) >= 1, row
    assert row["dead_letters"] == 0, row
    reloads = sum(p.read_text().count('"rollout.inflight_reload"') for p in tmp_path.rglob("rollout*.log"))
    assert reloads > 0, "no version was taken between chunks"


HARBOR = [c.fault for c in CASES if c.fault.startswith("harbor-")]
"""Harbor task containers (bench/fault_harbor.py): a private engine restarted mid-episode, a build
and a test.sh that never end. They need a Docker engine (skipped with the reason without one)."""
INFRA = ("infra_error", "HarborInfraError", "HarborEngineError", "sandbox failed")


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", HARBOR)
def test_a_harbor_fault_is_never_a_reward_and_the_run_goes_on(tmp_path, name):
    row = run_case(_case(name), tmp_path, seed=0)
    if "skipped" in row:
        pytest.skip(row["skipped"])
    _check_row(row)
    assert row["healed"] and not row["resume_needed"] and row["steps"] > 0, row
    if name == "harbor-engine-restart":  # the gold oracles score 1; an engine failure never scores 0
        assert row["train_rewards_below_1"] == 0 and row["containers_left"] == 0, row
        assert all(any(k in reason for k in INFRA) for reason in row["dead_letter_reasons"]), row
        return
    assert row["dead_letters"] == 0, row
    if name == "harbor-build-hang":  # disabled at start with the reason; the engine stopped the build
        assert row["passed_build_timeout"] and "passed build_timeout_sec" in row["console_disabled"][0], row
        assert row["build_containers_left"] == [] and row["train_rewards_below_1"] == 0, row
    if name == "harbor-test-hang":  # a verdict (timeout, 0) at the timeout, not an infra error, not a hang
        assert row["hang_all_timeout_0"] and row["good_all_ok_1"], row
        assert row["hang_verify_s"][1] < 60, row


def test_the_server_keeper_restarts_a_killed_server_on_its_port_and_store(tmp_path):
    server = EmbeddedNats(tmp_path / "nats").start()
    keeper = ServerKeeper(server, tmp_path / "nats", tmp_path)
    try:
        assert keeper.check() is None
        port, old = server.port, server.pid
        os.kill(old, signal.SIGKILL)
        server.proc.wait(5)
        said = keeper.check()
        assert said and "restarted on the same store" in said and str(port) in said
        assert keeper.pid != old and keeper.server.port == port
        assert keeper.check() is None
    finally:
        keeper.stop()


class _Proc:
    def __init__(self, pid: int, alive: bool = True):
        self.pid, self._alive = pid, alive

    def poll(self):
        return None if self._alive else 0


def test_the_heartbeat_watch_names_only_processes_that_went_quiet():
    hb = HeartbeatWatch(timeout_s=0.2)
    procs = {"rollout": _Proc(11), "learner": _Proc(12), "sampler": _Proc(13)}
    hb.seen(11)
    hb.seen(12)
    time.sleep(0.3)
    hb.seen(12)
    assert [r for r, _, _ in hb.hung(procs, connected=True)] == ["rollout"]  # sampler never reported: starting
    hb.hung(procs, connected=False)  # the launcher lost the bus: the clocks restart
    assert hb.hung(procs, connected=True) == []
    procs["rollout"] = _Proc(11, alive=False)
    time.sleep(0.3)
    assert [r for r, _, _ in hb.hung(procs, connected=True)] == ["learner"]  # an exited one is poll()'s business


def test_a_store_whose_server_logged_running_out_of_space_is_a_fatal_stop(tmp_path):
    store = tmp_path / "nats"
    store.mkdir()
    (store / "nats-server.log").write_text("[INF] Server is ready\n")
    offset = (store / "nats-server.log").stat().st_size
    assert store_full(store, tmp_path, offset) is None
    with (store / "nats-server.log").open("a") as f:
        f.write("[ERR] JetStream failed to store a msg on stream 'x': write: no space left on device\n")
    stop = store_full(store, tmp_path, offset)
    assert isinstance(stop, FatalStop) and stop.fault == "store-full"
    assert str(store) in stop.message and f"rlbus up --resume {tmp_path}" in stop.next_step


@pytest.mark.e2e
def test_an_unexpected_error_in_up_is_one_plain_line_with_the_resume_command(tmp_path):
    root = Path(__file__).resolve().parents[1]
    model = tmp_path / "model"  # a real tiny checkpoint whose weights file is then broken: SFT fails to load it
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "init-model",
            str(model),
            "--tokenizer",
            "char",
            "--hidden-size",
            "32",
            "--num-layers",
            "1",
            "--num-heads",
            "2",
        ],
        check=True,
        cwd=root,
        capture_output=True,
        timeout=120,
    )
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[model]\npath = "{model}"\n[sft]\nmax_steps = 2\n')
    run = [sys.executable, "-m", "rlbus.cli", "up", str(cfg), "--run-dir", str(tmp_path / "runs"), "--run-id", "bad1"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=root)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text and "rlbus up: stopped by an unexpected error" in text, text
    assert f"rlbus up --resume {tmp_path / 'runs' / 'bad1'}" in text and "--debug" in text, text
    dbg = subprocess.run([*run[:-1], "bad2", "--debug"], capture_output=True, text=True, timeout=120, cwd=root)
    assert dbg.returncode != 0 and "Traceback" in dbg.stdout + dbg.stderr


def test_a_model_path_that_is_not_a_model_folder_is_refused_before_anything_starts(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[model]\npath = "/nonexistent/model"\n')
    out = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "up", str(cfg), "--run-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    assert "/nonexistent/model" in text and "config.json" in text and "rlbus init-model" in text, text
    assert not (tmp_path / "runs").exists()


def test_up_with_the_docker_backend_and_no_image_is_refused_before_anything_starts(tmp_path):
    from sandbox_workers.factory import docker_available

    if not docker_available():
        pytest.skip("needs a Docker engine (none answers: `docker info`)")
    cfg = tmp_path / "nope.toml"
    cfg.write_text('[sandbox]\nbackend = "docker"\nimage = "rlbus-nope:1"\n')
    out = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "up", str(cfg), "--run-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    assert "rlbus sandbox build-image --tag rlbus-nope:1" in text, text
    assert not (tmp_path / "runs").exists()
