"""Zero-shot (held-out) domains: a domain source's own eval set (`eval_set`) of drawn tasks is
scored only through the pipeline, its hidden gold put by the scheduler;
the scheduler evaluates it right after the first weight version and records the scores as
`eval.<domain>` with purpose `heldout`, never gating them."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from bus.conn import ensure_topology
from bus.session import WorkerContext
from bus.subjects import Registry
from producers import domains as domain_registry
from producers.domains import DomainContext, Drawn, finish_task
from producers.eval_set import EvalSet, drawn_set
from rlbus.model.tiny_model import build_tiny_model
from scheduler.evaluation import EvalSuite
from scheduler.pipeline_eval import eval_tasks
from scheduler.store import open_store
from scheduler.store_rows import EvalResultRow, GateCheckRow
from schemas import ChatMessage
from schemas.config import load_config

N = 9


@dataclass
class EvalOnlyDomain:
    """A test domain kind: math-verified problems whose gold is 0 for every third one."""

    ctx: DomainContext

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        raise AssertionError("a held-out domain is never sampled for training")

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        from bus.hidden import hidden_ref_for

        out = []
        for i in range(n + 5):  # more than asked: eval_set_for keeps n
            task = finish_task(
                self.ctx,
                task_id=f"{self.ctx.name}-e{i}",
                prompt=[ChatMessage(role="user", content=f"q{i}")],
                verifier="math",
                verifier_params={"problem_id": f"e{i}"},
                hidden_ref=hidden_ref_for(self.ctx.name, f"e{seed}-{i}"),
            )
            out.append(Drawn(task, {"gold": "0" if i % 3 == 0 else "5"}))
        return drawn_set(self.ctx.name, seed, level, out)


CONFIG = f"""
[sampler]
max_tokens = 4
[sampler.domains.arith]
[sampler.domains.zs]
kind = "evalonly"
heldout = true
[rollout]
engine = "null"
[learner]
policy = "null"
[scheduler.eval]
n = {N}
difficulty = 1
every_versions = 1
timeout_s = 60
[scheduler.curriculum]
every_s = 0.2
"""


@pytest.fixture
def evalonly_kind(monkeypatch):
    monkeypatch.setitem(domain_registry.BUILTINS, "evalonly", "tests.test_heldout_eval:EvalOnlyDomain")


def _config(tmp_path):
    path = tmp_path / "heldout.toml"
    path.write_text(CONFIG)
    return path


def test_suite_has_a_drawn_heldout_set(tmp_path, evalonly_kind):
    suite = EvalSuite.from_config(load_config(_config(tmp_path)))
    assert suite.local() == ["arith"] and suite.pipeline_only() == ["zs"]
    assert (
        suite.purpose("zs") == "heldout" and suite.purpose("arith") == "train" and suite.purpose("general_x") == "train"
    )
    assert (
        len(suite.sets["zs"]) == N
        and suite.sets["zs"].sha256 == EvalSuite.from_config(load_config(_config(tmp_path))).sets["zs"].sha256
    )  # pinned
    tasks = eval_tasks(suite, "r1", 3, ["zs"])
    assert len(tasks) == N and {t.purpose for t in tasks} == {"eval"} and {t.group_size for t in tasks} == {1}
    assert {t.temperature for t in tasks} == {0.0} and {t.verifier for t in tasks} == {"math"}
    assert tasks[0].msg_id == "ev3.zs.0-rr1" and tasks[0].run_id == "r1" and tasks[0].hidden_ref.startswith("zs.")
    assert "gold" not in tasks[0].verifier_params


@pytest.mark.usefixtures("drop_run")
async def test_scheduler_scores_the_heldout_domain_through_the_pipeline(
    js, nats_url, run_id, tmp_path, spawn_worker, evalonly_kind
):
    from scheduler.worker import run

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    config = _config(tmp_path)
    for role in ("learner", "rollout", "verifier"):  # null pipeline: the learner announces version 0
        spawn_worker(role, run_id, config)
    run_path = tmp_path / "runs" / run_id
    build_tiny_model(run_path / "model" / "start", hidden_size=32, num_layers=1, num_heads=2)
    cfg = load_config(config)
    # one gated evaluation (the local baseline), then the held-out round, then it stops
    counters = await asyncio.wait_for(
        run(cfg, WorkerContext(run_id=run_id, nats_url=nats_url, run_path=run_path, max_messages=1)), 240
    )
    assert counters["evals"] == 1
    want = sum(i % 3 == 0 for i in range(N)) / N  # the null engine answers "0"
    assert counters["eval_zs"] == pytest.approx(want)

    store = await asyncio.to_thread(open_store, None, run_path)
    try:
        evals = await asyncio.to_thread(store.rows, EvalResultRow, run_id)
        gates = await asyncio.to_thread(store.rows, GateCheckRow, run_id)
    finally:
        store.close()
    by = {(e.domain, e.purpose): e for e in evals}
    assert set(by) == {("arith", "train"), ("zs", "heldout")}, evals
    assert by[("zs", "heldout")].score == pytest.approx(want) and by[("zs", "heldout")].n == N
    assert gates and all("zs" not in g.scores for g in gates)  # measured, never gated


async def test_identical_local_sets_are_scored_once(tmp_path):
    from rollout_workers.engines.null_engine import NullEngine

    lines = ["[scheduler.eval]", "n = 6", "difficulty = 1"]
    for i in range(100):
        lines += [f"[sampler.domains.d{i:03d}]", 'kind = "arith"']
    path = tmp_path / "copies.toml"
    path.write_text("\n".join(lines))
    suite = EvalSuite.from_config(load_config(path))
    calls = []

    class Counting(NullEngine):
        def generate(self, prompts, n, max_new_tokens, temperature):
            calls.append(len(prompts))
            return super().generate(prompts, n, max_new_tokens, temperature)

    scores = await suite.evaluate(Counting(), open_sandbox=None)
    assert len(scores) == 100 and calls == [6]  # one generation for a hundred identical sets
    assert len({v for v in scores.values()}) == 1


def test_an_older_store_gets_the_purpose_column(tmp_path):
    import sqlite3

    db = tmp_path / "run.db"
    con = sqlite3.connect(db)
    con.execute(
        "CREATE TABLE eval_results (msg_id VARCHAR NOT NULL PRIMARY KEY, run_id VARCHAR NOT NULL, "
        "version INTEGER NOT NULL, step INTEGER NOT NULL, domain VARCHAR NOT NULL, score FLOAT NOT NULL, "
        "n INTEGER NOT NULL, eval_set_sha256 VARCHAR NOT NULL, created_at FLOAT NOT NULL, "
        "cost_cpu_seconds FLOAT, cost_gpu_seconds FLOAT, cost_tokens INTEGER)"
    )
    con.execute("INSERT INTO eval_results VALUES ('m', 'r', 0, 0, 'arith', 0.5, 10, 'h', 1.0, NULL, NULL, NULL)")
    con.commit()
    con.close()
    store = open_store(None, tmp_path)
    try:
        assert [(e.domain, e.purpose) for e in store.rows(EvalResultRow)] == [("arith", "train")]
    finally:
        store.close()
    open_store(None, tmp_path).close()  # opening again changes nothing
