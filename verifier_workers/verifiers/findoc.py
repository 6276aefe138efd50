"""The `findoc` verifier: extraction, calculation and conclusion answers against hidden gold,
and the amount normaliser the long-context verifiers share.

Guarantees:
- `parse_amount(text)` reads one amount as written in filings and answers: currency marks
  (`$`, `US$`, `USD`, `dollars`) ignored; thousands separators; a leading `-`/`−` or
  parentheses `(1,200)` for a negative; a scale word or suffix (`k`/`thousand`, `m`/`mn`/
  `million`, `bn`/`b`/`billion`, `tn`/`trillion`); a trailing `%`/`percent`, or `x` for a
  ratio. It returns (value in millions for amounts with a scale, else the number as
  written; `plain`, `scaled` or `percent`), or None when the text is anything else: it never
  raises on policy text, and it reads at most `MAX_ANSWER_CHARS` characters. A percent
  answer to an amount in millions, or a scaled one to a percent or ratio, is not read.
- The answer is the last `<answer>...</answer>` of the final text (`schemas.answers.tagged_answer`).
  An answer that does not parse as the family requires scores 0 with component
  `answer_rejected` = 1 and `format` = 0: the policy's fault, never an infrastructure error.
- extraction: correct iff the amount equals the gold in millions (a bare number is read in
  millions, the unit the question asks for) to 1e-6. calculation: correct iff within the
  hidden `rel_tol` of the gold, or `abs_tol` (percent answers in percentage points, `0.123`
  never read as 12.3 %). conclusion: `label=...; driver=...` (or the two words in any
  order), each field checked on its own: component `conclusion` is the fraction right,
  `correct` 1 only when both are.
- Components, always all of them (so `reward_weights` may weight any): `correct`,
  `extraction`, `calculation`, `conclusion` (the task's own family carries its score, the
  others 0), `format`, `answer_rejected`. Default reward: `correct`.
- A task without a hidden payload, or of an unknown family, is a `VerifierInputError`
  (dead letter); a gold the scorer itself cannot read (it does not score 1 against
  itself) is a `VerifierInfraError`: retried, never a reward.
"""

from __future__ import annotations

import math
import re

from schemas import Trajectory
from schemas.answers import tagged_answer
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import Verdict, VerifierInputError

MAX_ANSWER_CHARS = 200
FAMILIES = ("extraction", "calculation", "conclusion")
_CURRENCY = re.compile(r"us\$|usd|\$|dollars?", re.IGNORECASE)
_AMOUNT = re.compile(
    r"(?P<neg>[-\u2212])?(?P<open>\()?\s*(?P<neg2>[-\u2212])?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)\s*"
    r"(?P<scale>thousand|million|billion|trillion|mn|mm|bn|tn|k|m|b)?\s*"
    r"(?P<close>\))?\s*(?P<pct>%|percent|pp|x)?",
    re.IGNORECASE,
)
SCALES = {"k": 0.001, "thousand": 0.001, "m": 1.0, "mm": 1.0, "mn": 1.0, "million": 1.0}
SCALES |= {"b": 1e3, "bn": 1e3, "billion": 1e3, "tn": 1e6, "trillion": 1e6}


def parse_amount(text: str | None) -> tuple[float, str] | None:
    """(value, how it was written: `plain`, `scaled` (a scale word: value in millions) or
    `percent`) of one written amount, or None (see the module guarantees)."""
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    cleaned = _CURRENCY.sub("", text).strip().rstrip(".").strip()
    m = _AMOUNT.fullmatch(cleaned)
    if m is None or bool(m["open"]) != bool(m["close"]) or (m["neg"] and m["neg2"]):
        return None
    value = float(m["num"].replace(",", ""))
    scale = (m["scale"] or "").lower()
    if scale:
        value *= SCALES[scale]
    if m["neg"] or m["neg2"] or m["open"]:
        value = -value
    pct = (m["pct"] or "").lower()
    if scale and pct:
        return None
    return value, "percent" if pct in ("%", "percent", "pp") else "scaled" if scale else "plain"


def _fields(text: str, choices: dict[str, list[str]]) -> dict[str, str | None]:
    """The value of each field: `field=value` / `field: value`, else the one choice the text names."""
    out: dict[str, str | None] = {}
    low = text.lower()
    for name, options in choices.items():
        m = re.search(rf"{re.escape(name)}\s*[=:]\s*([^;,\n]+)", low)
        said = m.group(1).strip() if m else None
        if said is not None:
            out[name] = next((o for o in options if o.lower() == said.strip(" .")), None)
        else:
            named = [o for o in options if re.search(rf"\b{re.escape(o.lower())}\b", low)]
            out[name] = named[0] if len(named) == 1 else None
    return out


def _score(family: str, hidden: dict, answer: str | None) -> tuple[float, bool]:
    """(score in [0, 1], answer parsed) of `answer` for the task's hidden gold."""
    gold = hidden.get("gold")
    if family == "conclusion":
        if answer is None or len(answer) > MAX_ANSWER_CHARS:
            return 0.0, False
        got = _fields(answer, hidden["choices"])
        if all(v is None for v in got.values()):
            return 0.0, False
        return sum(got[k] == gold[k] for k in gold) / len(gold), True
    parsed = parse_amount(answer)
    if parsed is None:
        return 0.0, False
    value, how = parsed
    if (how == "percent") != (hidden.get("unit") == "percent") and not (
        how == "plain" and hidden.get("unit") == "percent"
    ):
        return 0.0, False
    if how == "scaled" and hidden.get("unit") != "million":
        return 0.0, False
    if family == "extraction":
        return float(math.isclose(value, float(gold), rel_tol=1e-9, abs_tol=1e-6)), True
    ok = math.isclose(value, float(gold), rel_tol=float(hidden["rel_tol"]), abs_tol=float(hidden["abs_tol"]))
    return float(ok), True


def gold_text(hidden: dict) -> str:
    """The gold written as an answer (what a perfect policy would write)."""
    gold = hidden["gold"]
    if hidden["family"] == "conclusion":
        return f"label={gold['label']}; driver={gold['driver']}"
    return f"{float(gold):.10g}" + ("%" if hidden.get("unit") == "percent" else "")


def check_gold(family: str, hidden: dict) -> None:
    """VerifierInfraError unless the gold scores 1 against itself."""
    try:
        ok = _score(family, hidden, gold_text(hidden)) == (1.0, True)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise VerifierInfraError(f"findoc scorer fails on its gold: {type(exc).__name__}: {exc}") from exc
    if not ok:
        raise VerifierInfraError(f"findoc gold does not score 1 against itself: {str(hidden.get('gold'))[:200]!r}")


def verify_findoc(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the final answer for the task's family (see the module guarantees)."""
    if not isinstance(hidden, dict) or "gold" not in hidden:
        raise VerifierInputError("findoc task without its hidden gold (hidden_ref unresolved or empty)")
    family = hidden.get("family")
    if family not in FAMILIES:
        raise VerifierInputError(f"findoc task of unknown family {family!r}; known: {list(FAMILIES)}")
    check_gold(family, hidden)
    answer = tagged_answer(traj.final_text or "")
    score, parsed = _score(family, hidden, answer)
    components = {k: (score if k == family else 0.0) for k in FAMILIES}
    components |= {"correct": float(score == 1.0), "format": float(parsed), "answer_rejected": float(not parsed)}
    return Verdict(components, details=f"family={family} answer={(answer or '')[:100]!r}")
