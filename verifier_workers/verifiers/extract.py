"""The `extract` verifier: structured extraction, JSON fields against gold.

Guarantees:
- The answer is the last JSON object in `final_text`: a ```json (or bare ```) fenced
  block if there is one, else the last `{...}` that parses as a JSON object.
- Gold is the dict under `gold` in the hidden payload (resolved from `traj.hidden_ref`),
  or `verifier_params["gold"]` for public/dev tasks. A missing or non-dict gold, or an
  empty one, raises `VerifierInputError` (dead letter).
- Per gold field a component `field_<name>` of 1.0/0.0: strings match after strip and
  casefold (and internal whitespace runs collapsed); numbers match numerically (1 == 1.0,
  "3" == 3, tolerance 1e-9 relative); bools only match bools; lists match element-wise in
  order; dicts match key-by-key recursively. A missing field scores 0.
- Components: `field_<name>` each, `fields` (their mean), `json_valid` (1.0 iff an
  object was found), `extra_fields` (count of keys not in gold; a penalty a config may
  weight in negatively; not in the default scalar), `correct` (1.0 iff every gold field
  matches).
- The default scalar is `correct`: 1.0 iff all gold fields match, else 0.0. Extra fields
  do not lower it unless a config weights `extra_fields`.
- Malformed or absent JSON is the policy's fault: `json_valid` 0, reward 0, status "ok".
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from schemas import Trajectory
from verifier_workers.verdict import Verdict, VerifierInputError

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_MAX_TEXT = 200_000


def find_json_object(text: str) -> dict | None:
    """The last JSON object in `text` (fenced blocks first), or None."""
    text = text[-_MAX_TEXT:]
    for block in reversed(_FENCE.findall(text)):
        try:
            obj = json.loads(block.strip())
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    decoder = json.JSONDecoder()
    best: dict | None = None
    i = text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            best = obj
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)
    return best


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip().replace(",", ""))
        except ValueError:
            return None
    return None


def _norm(s: str) -> str:
    return " ".join(s.split()).casefold()


def values_match(gold: Any, got: Any) -> bool:
    """Whether an extracted value matches the gold one (see module docstring)."""
    if isinstance(gold, bool) or isinstance(got, bool):
        return isinstance(gold, bool) and isinstance(got, bool) and gold == got
    if gold is None or got is None:
        return gold is None and got is None
    if isinstance(gold, dict):
        return isinstance(got, dict) and set(gold) == set(got) and all(values_match(gold[k], got[k]) for k in gold)
    if isinstance(gold, list):
        return isinstance(got, list) and len(gold) == len(got) and all(map(values_match, gold, got))
    if isinstance(gold, (int, float)) or isinstance(got, (int, float)):
        a, b = _number(gold), _number(got)
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(gold, str) and isinstance(got, str):
        return _norm(gold) == _norm(got)
    return gold == got


def verify_extract(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Per-field match of the answer's JSON object against the gold dict."""
    gold = (hidden or {}).get("gold", traj.verifier_params.get("gold"))
    if not isinstance(gold, dict) or not gold:
        raise VerifierInputError("extract task without a non-empty dict verifier_params.gold")
    obj = find_json_object(traj.final_text or "")
    components: dict[str, float] = {}
    if obj is None:
        for name in gold:
            components[f"field_{name}"] = 0.0
        components.update(fields=0.0, json_valid=0.0, extra_fields=0.0, correct=0.0)
        return Verdict(components, details="no JSON object in the answer")
    for name, want in gold.items():
        components[f"field_{name}"] = float(name in obj and values_match(want, obj[name]))
    scores = [components[f"field_{n}"] for n in gold]
    extra = sorted(k for k in obj if k not in gold)
    missing = sorted(k for k in gold if k not in obj)
    components.update(
        fields=sum(scores) / len(scores),
        json_valid=1.0,
        extra_fields=float(len(extra)),
        correct=float(all(s == 1.0 for s in scores)),
    )
    return Verdict(components, details=f"missing={missing} extra={extra}")
