"""Eval sets as data (`producers.eval_set`): a domain kind the scheduler has never heard of gets
its local eval, its general regression set and its pipeline tasks from its source's
`eval_set(n, seed, level)` hook alone (issue 28, item 7)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from producers import domains as domain_registry
from producers.domains import DomainContext, Drawn
from producers.eval_set import EvalItem, EvalSet, content_sha256, drawn_set
from rollout_workers.engines.null_engine import NullEngine
from scheduler.evaluation import EvalSuite
from scheduler.gates import add_general_set
from scheduler.pipeline_eval import eval_tasks
from schemas import ChatMessage, Task
from schemas.config import load_config


def _task(i: int, domain: str = "echo", max_tokens: int = 4) -> Task:
    return Task(
        run_id="eval",
        task_id=f"{domain}-{i}",
        domain=domain,
        group_size=1,
        max_tokens=max_tokens,
        temperature=0.0,
        prompt=[ChatMessage(role="user", content=f"say {i % 2}")],
        verifier="constant",
    )


def first_char(text: str) -> str:
    return text[:1]


@dataclass
class EchoDomain:
    """A test kind: `say <d>` prompts whose gold is the digit; scored locally by the first character."""

    ctx: DomainContext

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        raise AssertionError("never sampled here")

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        level = 1 if level is None else level
        items = tuple(EvalItem(_task(i, self.ctx.name), gold=str(i % 2), row=[seed, level, i]) for i in range(n + 3))
        return EvalSet(self.ctx.name, seed, level, items, local="generate", answer=first_char)


@pytest.fixture
def echo_kind(monkeypatch):
    monkeypatch.setitem(domain_registry.BUILTINS, "echo", "tests.test_eval_set:EchoDomain")


def test_a_new_kind_is_evaluated_without_a_scheduler_edit(echo_kind):
    cfg = load_config(
        None,
        [
            "sampler.domains.e1.kind=echo",
            "sampler.domains.e2.kind=echo",
            "scheduler.eval.n=6",
            "scheduler.eval.general=echo",
            "scheduler.eval.general_n=4",
            "scheduler.eval.general_level=3",
        ],
    )
    suite = EvalSuite.from_config(cfg)
    assert add_general_set(suite, cfg) == "general_echo"
    assert suite.local() == ["e1", "e2", "general_echo"] and suite.pipeline_only() == []
    assert len(suite.sets["e1"]) == 6 and suite.sets["e1"].sha256 == content_sha256([[1234, 1, i] for i in range(6)])
    assert suite.sets["general_echo"].level == 3 and len(suite.sets["general_echo"]) == 4
    tasks = eval_tasks(suite, "r1", 5, ["e1"])
    assert [t.msg_id for t in tasks[:2]] == ["ev5.e1.0-rr1", "ev5.e1.1-rr1"] and {t.purpose for t in tasks} == {"eval"}
    calls = []

    class Zero(NullEngine):  # answers "0": right on the even items
        def generate(self, prompts, n, max_new_tokens, temperature):
            calls.append(len(prompts))
            return super().generate(prompts, n, max_new_tokens, temperature)

    import asyncio

    scores = asyncio.run(suite.evaluate(Zero(), open_sandbox=None))
    assert scores["e1"] == scores["e2"] == (0.5, 6, suite.sets["e1"].sha256)  # e2: the same set, scored once
    assert scores["general_echo"][:2] == (0.5, 4)
    assert calls == [6, 4]  # e1 (= e2), general_echo


def test_the_general_set_must_be_scored_locally(echo_kind, monkeypatch):
    kind = domain_registry.get_factory("echo")  # the class the registry imported (tests.test_eval_set's)
    monkeypatch.setattr(
        kind, "eval_set", lambda self, n, seed, level=None: drawn_set(self.ctx.name, seed, level, [Drawn(_task(0))])
    )
    cfg = load_config(None, ["scheduler.eval.general=echo"])
    with pytest.raises(ValueError, match="no locally scored eval set"):
        add_general_set(EvalSuite.from_config(cfg), cfg)


def test_eval_set_contract():
    items = tuple(EvalItem(_task(i), hidden={"gold": i}) for i in range(5))
    es = drawn_set("d", 7, None, [Drawn(it.task, it.hidden) for it in items])
    assert es.local is None and len(es) == 5 and es.head(9) is es and len(es.head(2)) == 2
    rows = [[[m.model_dump() for m in it.task.prompt], "constant", {}, {"gold": i}] for i, it in enumerate(items)]
    assert es.sha256 == content_sha256(rows) and es.head(2).sha256 == content_sha256(rows[:2])
    assert es.with_purpose("heldout").purpose == "heldout" and es.purpose == "train"
    with pytest.raises(ValueError, match="needs `answer`"):
        EvalSet("d", 0, 1, items, local="generate")
    mixed = EvalSet(
        "d",
        0,
        1,
        (EvalItem(_task(0), gold="0"), EvalItem(_task(1, max_tokens=9), gold="1")),
        local="generate",
        answer=first_char,
    )
    assert len(mixed.score_key[3]) == 2  # budgets are part of what makes two sets score alike
