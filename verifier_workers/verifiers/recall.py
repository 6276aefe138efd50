"""The `recall` verifier: the values of the needles against hidden gold, field by field.

Guarantees:
- The answer is the last `<answer>...</answer>` of the final text (`schemas.answers.tagged_answer`).
- One-field variants (`single`, `kv`, `combine`): correct iff the answer equals the gold
  text, compared case-insensitively with spaces and trailing dots ignored; a number (the
  `combine` sum) is read by `findoc.parse_amount`, so `1,234` equals `1234`.
- `multi`: the answer's `key=value` (or `key: value`) pairs, separated by `;`, `,` or new
  lines, are matched to the gold's keys case-insensitively; failing pairs, values in the
  gold's order. Component `fields` is the fraction right; `correct` 1 only when all are.
- An answer with no value at all (no tag content, nothing readable) scores 0 with
  `answer_rejected` = 1 and `format` = 0; never an infrastructure error.
- Components, always all of them: `correct`, `fields`, `format`, `answer_rejected`.
- A task without its hidden payload is a `VerifierInputError`; a gold the scorer cannot read
  (it does not score 1 against itself) is a `VerifierInfraError`.
"""

from __future__ import annotations

import re

from schemas import Trajectory
from schemas.answers import tagged_answer
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import Verdict, VerifierInputError
from verifier_workers.verifiers.findoc import MAX_ANSWER_CHARS, parse_amount

_SPLIT = re.compile(r"[;\n,]")
_PAIR = re.compile(r"^\s*([^=:]+?)\s*[=:]\s*(.+?)\s*$")


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text).strip(".").lower()


def same(answer: str, gold: str) -> bool:
    """Whether one answered value is the gold value (see the module guarantees)."""
    if _norm(answer) == _norm(gold):
        return True
    a, g = parse_amount(answer), parse_amount(gold)
    return a is not None and g is not None and g[1] == "plain" and a[1] == "plain" and a[0] == g[0]


def _values(answer: str, keys: list[str]) -> dict[str, str]:
    parts = [p for p in _SPLIT.split(answer) if p.strip()]
    pairs = {}
    for p in parts:
        m = _PAIR.match(p)
        if m:
            pairs[_norm(m.group(1))] = m.group(2)
    found = {k: pairs[_norm(k)] for k in keys if _norm(k) in pairs}
    if found:
        return found
    return {k: v.strip() for k, v in zip(keys, parts)}


def score(hidden: dict, answer: str | None) -> tuple[float, bool]:
    """(fraction of fields right, an answer was read)."""
    gold: dict[str, str] = hidden["gold"]
    if not answer or len(answer) > MAX_ANSWER_CHARS * 4:
        return 0.0, False
    keys = list(gold)
    if keys == ["value"]:
        return float(same(answer, gold["value"])), True
    got = _values(answer, keys)
    if not got:
        return 0.0, False
    return sum(k in got and same(got[k], gold[k]) for k in keys) / len(keys), True


def gold_text(hidden: dict) -> str:
    """The gold written as an answer."""
    gold = hidden["gold"]
    return gold["value"] if list(gold) == ["value"] else "; ".join(f"{k}={v}" for k, v in gold.items())


def verify_recall(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the answered needle values (see the module guarantees)."""
    if not isinstance(hidden, dict) or not isinstance(hidden.get("gold"), dict) or not hidden["gold"]:
        raise VerifierInputError("recall task without its hidden gold (hidden_ref unresolved or empty)")
    try:
        gold_ok = score(hidden, gold_text(hidden)) == (1.0, True)
    except (TypeError, ValueError, AttributeError) as exc:
        raise VerifierInfraError(f"recall scorer fails on its gold: {type(exc).__name__}: {exc}") from exc
    if not gold_ok:
        raise VerifierInfraError(f"recall gold does not score 1 against itself: {str(hidden['gold'])[:200]!r}")
    answer = tagged_answer(traj.final_text or "")
    fields, parsed = score(hidden, answer)
    return Verdict(
        {
            "correct": float(fields == 1.0),
            "fields": fields,
            "format": float(parsed),
            "answer_rejected": float(not parsed),
        },
        details=f"variant={hidden.get('variant')} answer={(answer or '')[:100]!r}",
    )
