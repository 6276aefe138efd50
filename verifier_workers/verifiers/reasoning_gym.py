"""The `reasoning_gym` verifier: a reasoning-gym dataset's own `score_answer`, on the controlled side.

Guarantees:
- The answer is `schemas.answers.tagged_answer(final_text)`: the last `<answer>...</answer>`,
  else an `<answer>` left open at the end, else the final non-empty line. None found:
  `correct` 0, `answer_found` 0, status ok (the policy's fault, not an error).
- Otherwise the dataset named in the hidden payload is rebuilt with the recipe the
  sampler used (level, range_mode, config: `schemas.rg_family.build`; cached per recipe),
  and `correct` is its `score_answer(answer, {question, answer, metadata})` (the packed
  metadata restored: `rg_family.unpack`), partial credit
  kept, clamped to [0, 1]; `answer_found` 1. Every `score_answer` call (the policy's answer,
  and the gold check below) runs in its own `answer_pool` job, never in this process: the
  dataset is built (and cached) in the pool's template from the recipe, the answer is scored
  in a pristine fork of it under CPU / memory / wall limits with no credentials. An answer
  that hits a limit scores 0 with status `answer_limit` (never infra); a scorer's bare
  `eval(answer)` takes Python literals only (so a list answer keeps its partial credit).
- A hidden payload without `dataset`/`question` is unusable: `VerifierInputError` (dead
  letter). A dataset this node's reasoning-gym lacks, a scorer that fails to build or
  raises, or a non-numeric / non-finite score is a `VerifierInfraError` (retried, then
  dead-lettered with its reason), never a reward of 0 - except when the scorer raises on the
  policy's answer yet scores the entry's gold answer: then the answer is malformed (e.g.
  prime_factorization's int() of "7 91 4U"), `correct` 0 with `answer_rejected` 1, status ok.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from typing import Any

from schemas import Trajectory
from schemas import rg_family as rg
from schemas.answers import tagged_answer
from verifier_workers import answer_pool
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import Verdict, VerifierInputError

CACHED = 256
"""Scorer dataset objects kept per process."""

_lock = threading.Lock()
_scorers: OrderedDict[str, Any] = OrderedDict()


def scorer(hidden: dict[str, Any]):
    """The dataset object that scores `hidden`'s task (VerifierInfraError when it cannot be built)."""
    name = str(hidden["dataset"])
    level, mode, extra = (
        int(hidden.get("level") or 1),
        str(hidden.get("range_mode") or "inclusive"),
        hidden.get("config") or {},
    )
    key = json.dumps([name, level, mode, extra], sort_keys=True, default=repr)
    with _lock:
        if key in _scorers:
            _scorers.move_to_end(key)
            return _scorers[key]
    if not rg.is_known(name):
        raise VerifierInfraError(f"reasoning-gym dataset {name!r} is unknown to this node's reasoning-gym")
    try:
        ds = rg.build(name, level, mode, extra, seed=0, size=1)
    except Exception as exc:  # any failure of the third-party dataset is infra, not a reward
        raise VerifierInfraError(
            f"reasoning-gym scorer {name!r} (level {level}) failed to build: {type(exc).__name__}: {exc}"
        ) from exc
    with _lock:
        _scorers[key] = ds
        while len(_scorers) > CACHED:
            _scorers.popitem(last=False)
    return ds


class AnswerRejected(ValueError):
    """The scorer raised on the policy's answer but scores the gold answer: a malformed answer."""


class AnswerLimit(Exception):
    """The answer hit a limit of the answer pool (cpu, memory, wall, output): the policy's 0."""


SCORE_REF = "verifier_workers.verifiers.reasoning_gym:score_in_job"
WARM_REF = "verifier_workers.verifiers.reasoning_gym:scorer"


def _entry(hidden: dict[str, Any]) -> dict:
    return {
        "question": hidden["question"],
        "answer": rg.unpack(hidden.get("answer")),
        "metadata": rg.unpack(hidden.get("metadata") or {}),
    }


def score_in_job(hidden: dict[str, Any], answer: str) -> float:
    """In an answer-pool job: the dataset's raw `score_answer(answer, entry)` as a float."""
    return float(scorer(hidden).score_answer(answer, _entry(hidden)))


def _texts(x: Any) -> list[str]:
    """Every string in the entry's metadata (a dataset may eval its own problem text)."""
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _texts(v)]
    if isinstance(x, (list, tuple, set, frozenset)):
        return [t for v in x for t in _texts(v)]
    return []


def _pool_score(hidden: dict[str, Any], answer: str) -> answer_pool.Outcome:
    trusted = tuple(t for t in _texts(rg.unpack(hidden.get("metadata") or {})) if t != answer)
    out = answer_pool.call(SCORE_REF, (hidden, answer), warm=(WARM_REF, (hidden,)), trusted_eval=trusted)
    if out.kind == "infra":
        raise VerifierInfraError(f"reasoning-gym scorer {hidden['dataset']!r} failed to build: {out.error}")
    return out


def gold_scores(hidden: dict[str, Any]) -> bool:
    """True when the entry has a gold answer and the scorer takes it without raising (in its own job)."""
    gold = rg.unpack(hidden.get("answer"))
    if not isinstance(gold, str) or not gold:
        return False
    return _pool_score(hidden, gold).kind == "ok"


def score(hidden: dict[str, Any], answer: str) -> tuple[float, list[str]]:
    """(the dataset's score of `answer` in [0, 1], operations the answer attempted and the pool
    refused). Raises VerifierInfraError (scorer broken), AnswerRejected, AnswerLimit."""
    out = _pool_score(hidden, answer)
    if out.kind == "limit":
        raise AnswerLimit(out.limit)
    if out.kind == "raised":  # the answer's fault only if the scorer takes the gold answer: else infra
        if not gold_scores(hidden):
            raise VerifierInfraError(f"reasoning-gym scorer {hidden['dataset']!r} raised: {out.error}")
        raise AnswerRejected(out.error)
    value = out.value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise VerifierInfraError(f"reasoning-gym scorer {hidden['dataset']!r} returned {str(value)[:80]!r}")
    return min(1.0, max(0.0, float(value))), out.blocked


def verify_reasoning_gym(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the final answer with the task's dataset scorer (see the module guarantees)."""
    if not isinstance(hidden, dict) or not hidden.get("dataset") or not isinstance(hidden.get("question"), str):
        raise VerifierInputError("reasoning_gym task without a hidden payload {dataset, question, answer, metadata}")
    answer = tagged_answer(traj.final_text)
    if answer is None:
        return Verdict({"correct": 0.0, "answer_found": 0.0}, details="no answer found")
    try:
        value, blocked = score(hidden, answer)
    except AnswerLimit as exc:  # the answer hit a CPU / memory / wall limit: a 0 it earned, never infra
        return Verdict(
            {"correct": 0.0, "answer_found": 1.0},
            status="answer_limit",
            details=f"answer={answer[:200]!r} hit the answer pool's {exc} limit"[:400],
        )
    except AnswerRejected as exc:  # the policy's malformed answer: a 0 it earned, status ok
        return Verdict(
            {"correct": 0.0, "answer_found": 1.0, "answer_rejected": 1.0},
            details=f"answer={answer[:200]!r} rejected by the scorer: {exc}"[:400],
        )
    refused = f" refused={blocked[:3]}" if blocked else ""
    return Verdict(
        {"correct": value, "answer_found": 1.0}, details=f"answer={answer[:200]!r} score={value:.4g}{refused}"[:600]
    )
