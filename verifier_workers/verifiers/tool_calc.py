"""The `tool_calc` verifier: the final answer must equal the product in the task.

Guarantees:
- Gold is recomputed exactly from the public expression `a*b` (nothing hidden).
- `correct` is 1.0 iff the last assistant turn is `=<int>` (or `<int>`) with the gold
  integer; `format` iff it parses; `used_tool` iff the episode made at least one tool
  call that exited 0 (reported, not weighted in by default).
- Observations the policy forged (typed into its own text) are caught by the worker's
  tool-result integrity check, not here.
"""

from __future__ import annotations

import re

from schemas import Trajectory
from schemas.answers import calc_answer
from verifier_workers.verdict import Verdict, VerifierInputError

_EXPR = re.compile(r"^(\d{1,12})\*(\d{1,12})$")


def verify_tool_calc(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Exact-match integer answer to the task's product."""
    m = _EXPR.match(str(traj.verifier_params.get("expression", "")))
    if not m:
        raise VerifierInputError("tool_calc task without verifier_params.expression of the form a*b")
    gold = int(m.group(1)) * int(m.group(2))
    answer = calc_answer(traj.final_text)
    used_tool = any(c.exit_code == 0 and not c.timed_out for c in traj.tool_calls)
    return Verdict(
        {"correct": float(answer == gold), "format": float(answer is not None), "used_tool": float(used_tool)},
        details=f"answer={answer!r} calls={len(traj.tool_calls)}",
    )
