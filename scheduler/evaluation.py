"""Greedy regression evaluation on a fixed, seeded, content-hashed held-out set.

Guarantees:
- The eval set is a pure function of (seed, n, difficulty); its sha256 travels with
  every `EvalResult`, so scores from different runs are comparable only when the
  hashes match.
- Scoring uses the same verifier as training (`verifier_workers.verifiers`), on
  greedy (temperature 0) completions.
"""

from __future__ import annotations

import hashlib
import json

from producers import arith


def eval_set(seed: int, n: int, difficulty: int) -> tuple[list[arith.ArithProblem], str]:
    """The held-out problems and their content hash."""
    problems = arith.heldout_set(seed, n, difficulty)
    digest = hashlib.sha256(json.dumps([(p.expression, p.answer) for p in problems]).encode()).hexdigest()
    return problems, digest


def greedy_accuracy(engine, problems: list[arith.ArithProblem], max_tokens: int, batch: int = 256) -> float:
    """Fraction of problems whose greedy completion is exactly the answer."""
    correct = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        groups = engine.generate([p.prompt for p in chunk], 1, max_tokens, 0.0)
        correct += sum(arith.parse_answer(g[0].text) == p.answer for p, g in zip(chunk, groups, strict=True))
    return correct / max(1, len(problems))
