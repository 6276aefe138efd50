"""`rlbus.run.folder`: one run's folder owns its paths, its run.json, its server URL, and the
single active run under a run dir."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from rlbus.run.folder import RunFolder, RunNotFound, alive, find_run


def test_paths_and_state(tmp_path):
    f = RunFolder.of(tmp_path, "r1")
    assert f.path == tmp_path / "r1" and os.fspath(f) == str(tmp_path / "r1")
    assert (f.run_json, f.config_json, f.summary_json) == tuple(
        tmp_path / "r1" / n for n in ("run.json", "config.json", "summary.json")
    )
    assert (f.start_model, f.base_model, f.nats, f.log("learner"), f.learner_checkpoint) == (
        f.path / "model" / "start",
        f.path / "model" / "base",
        f.path / "nats",
        f.path / "logs" / "learner.log",
        f.path / "checkpoints" / "learner.pt",
    )
    assert f.state() == {} and not f.is_run() and f.recorded_run_id() == "r1"
    f.path.mkdir()
    f.write_state({"run_id": "r1", "launcher_pid": 1})
    assert f.state() == {"run_id": "r1", "launcher_pid": 1} and f.is_run()
    assert not f.run_json.with_name("run.json.tmp").exists()
    f.run_json.write_text("[1, 2")  # unreadable: no state
    assert f.state() == {}
    f.run_json.write_text("[1, 2]")  # not an object: no state
    assert f.state() == {}


def test_server_url_is_the_recorded_one_without_credentials(tmp_path):
    f = RunFolder.of(tmp_path, "r")
    f.path.mkdir()
    assert f.server_url() is None
    f.config_json.write_text(json.dumps({"run": {"run_id": "r", "nats_url": "nats://u:***@cfg:4222"}}))
    assert f.server_url() == "nats://cfg:4222"
    f.write_state({"run_id": "r", "nats_url": "nats://admin:***@127.0.0.1:4333"})
    assert f.server_url() == "nats://127.0.0.1:4333"  # run.json first; the login comes from the environment


def test_find_active_takes_the_single_run_whose_launcher_lives(tmp_path):
    with pytest.raises(RunNotFound, match="0 active runs .*pass --run-id"):
        RunFolder.find_active(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid in (("old", dead.pid), ("live", os.getpid())):
        RunFolder.of(tmp_path, name).path.mkdir()
        RunFolder.of(tmp_path, name).write_state({"run_id": name, "launcher_pid": pid, "nats_url": "nats://h:1"})
    (tmp_path / "not-a-run").mkdir()
    assert RunFolder.find_active(tmp_path).path == tmp_path / "live"
    assert find_run(tmp_path, None, None) == ("live", "nats://h:1")
    assert find_run(tmp_path, "old", "nats://given:2") == ("old", "nats://given:2")
    assert find_run(None, "x", "nats://n:3") == ("x", "nats://n:3")
    with pytest.raises(RunNotFound, match="no run.json for run 'nope'"):
        find_run(tmp_path, "nope", None)
    RunFolder.of(tmp_path, "old").write_state({"run_id": "old", "launcher_pid": os.getpid()})
    with pytest.raises(RunNotFound, match=r"2 active runs .*\(live, old\); pass --run-id"):
        RunFolder.find_active(tmp_path)


def test_alive_sees_through_zombies_and_recycled_pids():
    me = os.getpid()
    argv0 = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()
    assert alive(me) and RunFolder.alive(me) and alive(me, argv0)
    assert not alive(me, "no-such-program-xyz") and not alive(None) and not alive(0)
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
        time.sleep(0.05)
    assert not alive(child.pid)  # exited, not reaped yet: a zombie is dead
    child.wait()
    assert not alive(child.pid)
