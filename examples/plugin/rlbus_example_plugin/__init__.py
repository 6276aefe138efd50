"""Example rlbus plugin: the `example_palindrome` domain and verifier.

Tasks ask for a palindrome of at least `2 + level` letters that starts with a given
letter; the verifier recomputes everything from the public params (nothing hidden).

Guarantees:
- `verify_palindrome` scores 1.0 iff the answer's letters (case and non-letters ignored)
  read the same both ways, are at least `min_len` long and start with `first`.
  Components: `correct`, `format` (an answer was given), `length` (letters).
- A task without `min_len`/`first` raises `VerifierInputError`.
- `PalindromeDomain(ctx)` builds tasks with `producers.domains.finish_task`, so the
  run config's per-domain settings (weights, budgets) apply as for built-ins.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any


def verify_palindrome(traj: Any, hidden: dict | None = None):
    from verifier_workers.verdict import Verdict, VerifierInputError

    min_len, first = traj.verifier_params.get("min_len"), traj.verifier_params.get("first")
    if not isinstance(min_len, int) or not isinstance(first, str) or len(first) != 1:
        raise VerifierInputError("example_palindrome task needs int min_len and one-letter first")
    letters = "".join(c for c in (traj.final_text or "").lower() if c.isalpha())
    ok = len(letters) >= min_len and letters == letters[::-1] and letters.startswith(first.lower())
    return Verdict(
        {"correct": float(ok), "format": float(bool(letters)), "length": float(len(letters))},
        details=f"letters={letters[:40]!r}",
    )


@dataclass
class PalindromeDomain:
    """Task source of one `example_palindrome` config domain."""

    ctx: Any

    def make_task(self, rng: random.Random, level: int, index: int):
        from producers.domains import Drawn, finish_task
        from schemas import ChatMessage

        first, min_len = rng.choice(string.ascii_lowercase), 2 + level
        prompt = f"Write a palindrome of at least {min_len} letters starting with '{first}'."
        return Drawn(
            finish_task(
                self.ctx,
                task_id=f"{self.ctx.name}-{level}-{index}",
                difficulty=level,
                prompt=[ChatMessage(role="user", content=prompt)],
                verifier="example_palindrome",
                verifier_params={"min_len": min_len, "first": first},
            )
        )
