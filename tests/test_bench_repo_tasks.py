"""`bench/repo_tasks.py --quick`: 2 tasks (a fixture and a cached mutant), gold and empty patches
through 2 real verifier worker processes (fresh containers) and through plain pytest in one
container of the same image; the result JSON has the headline fields and the verdicts are right.
Marked `docker`; skipped with the reason when no engine answers (~20 s at load 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _engine() -> bool:
    from sandbox_workers.factory import docker_available

    return docker_available()


@pytest.mark.docker
@pytest.mark.skipif(not _engine(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)")
def test_quick_bench_resolves_gold_and_not_mutants(tmp_path):
    out = tmp_path / "repo_tasks.json"
    r = subprocess.run(
        [sys.executable, "bench/repo_tasks.py", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["resolved_gold"], res["unresolved_mutants"], res["n_tasks"], res["n_jobs"]) == ("2/2", "2/2", 2, 4)
    assert (res["peer_resolved_gold"], res["peer_unresolved_mutants"], res["infra_errors"]) == ("2/2", "2/2", 0)
    assert res["ours"] > 0 and res["peer"] > 0 and res["ratio"] == pytest.approx(res["ours"] / res["peer"], rel=0.01)
    assert res["workers"] == 2 and res["unit"] == "verified tasks/s" and len(res["load_avg"]) == 3
    for key in ("start_s", "remove_s", "fresh_cost_s", "reset_s"):
        assert res["sandbox"][key]["p50"] > 0, key
    (rnd,) = res["rounds"]
    assert rnd["overhead_s"]["n"] == 4 and rnd["harness_run_s"]["p50"] > 0
