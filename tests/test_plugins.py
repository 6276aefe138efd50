"""Plugins: the example package in examples/plugin, pip-installed into the venv for this
module (and uninstalled after), provides a domain and a verifier through the
`rlbus.domains` / `rlbus.verifiers` entry points; both work through the registries
like built-ins, in this process and in a fresh one."""

from __future__ import annotations

import importlib
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from producers import domains
from schemas import Trajectory
from schemas.config import load_config
from verifier_workers import registry
from verifier_workers.verdict import VerifierInputError
from verifier_workers.worker import score

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "examples" / "plugin"
DIST = "rlbus-example-plugin"
NAME = "example_palindrome"


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def forget() -> None:
    registry.reset_entry_points()
    domains.reset_entry_points()
    sys.modules.pop("rlbus_example_plugin", None)
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def installed():
    """The example plugin installed (as a wheel build) into the running venv; removed afterwards."""
    leftovers = [PLUGIN_DIR / "build", PLUGIN_DIR / "rlbus_example_plugin.egg-info"]
    fresh = [p for p in leftovers if not p.exists()]
    if pip("show", DIST).returncode == 0:
        pytest.fail(f"{DIST} is already installed in this venv; uninstall it first")
    done = pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(PLUGIN_DIR))
    assert done.returncode == 0, done.stderr
    forget()
    try:
        yield
    finally:
        gone = pip("uninstall", "-y", DIST)
        forget()
        for p in fresh:  # the in-tree build's by-products
            shutil.rmtree(p, ignore_errors=True)
        assert gone.returncode == 0, gone.stderr


def palindrome_traj(task, answer: str) -> Trajectory:
    return Trajectory(
        run_id=task.run_id,
        task_id=task.task_id,
        task_msg_id=task.msg_id,
        domain=task.domain,
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier=task.verifier,
        verifier_params=task.verifier_params,
        reward_weights=task.reward_weights,
        policy_version=0,
        final_text=answer,
    )


def test_plugin_domain_and_verifier_through_the_registries(installed, tmp_path):
    assert NAME in registry.names() and NAME in domains.kinds()
    factory = domains.get_factory(NAME)
    assert factory.__module__ == "rlbus_example_plugin"
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(
        f"[sampler.domains.{NAME}]\nmax_level = 3\nreward_weights = {{ correct = 0.9, format = 0.1 }}\n"
    )
    cfg = load_config(cfg_path)
    assert domains.kind_of(NAME, cfg.sampler.domains[NAME]) == NAME
    task = domains.make_source("r1", NAME, cfg).make_task(random.Random(3), 3, 0).task
    first, min_len = task.verifier_params["first"], task.verifier_params["min_len"]
    assert task.verifier == NAME and min_len == 5 and task.reward_weights["correct"] == 0.9

    right = first + "x" * (min_len - 2) + first
    fn = registry.get(NAME)
    assert fn(palindrome_traj(task, right)).reward == 1.0
    assert fn(palindrome_traj(task, right + "q")).reward == 0.0
    assert score(palindrome_traj(task, right.upper() + "!")).reward == pytest.approx(1.0)
    assert score(palindrome_traj(task, "")).reward == 0.0
    wrong = score(palindrome_traj(task, right + "q"))
    assert wrong.reward == pytest.approx(0.1) and wrong.components["length"] == min_len + 1
    bad = palindrome_traj(task, right).model_copy(update={"verifier_params": {}})
    with pytest.raises(VerifierInputError):
        fn(bad)


def test_plugin_is_found_by_a_fresh_process(installed):
    code = (
        "from verifier_workers import registry; from producers import domains; "
        f"print(registry.get({NAME!r}).__name__, domains.get_factory({NAME!r}).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["verify_palindrome", "PalindromeDomain"]


def test_plugin_cannot_shadow_builtins(installed):
    assert registry.get("arith").__module__ == "verifier_workers.verifiers.arith"
    assert domains.get_factory("arith").__module__ == "producers.domains.arith"
