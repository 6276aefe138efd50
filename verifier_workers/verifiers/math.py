"""The `math` verifier: answer equivalence with `math-verify`.

Guarantees:
- The answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`) in
  `final_text`, braces matched; failing that, the text after the last "answer is" /
  "answer:" on its line; failing that, the last number in the text.
- Gold (a LaTeX string such as "\\frac{1}{2}", or a number) comes from the task's hidden
  payload `{"gold": ...}` (resolved from `traj.hidden_ref` by the verifier worker); a
  public/dev task may carry it in `verifier_params["gold"]` instead.
- The scalar is exactly 1.0 if the answer is mathematically equivalent to gold
  (`math_verify.verify`, e.g. 0.5 == \\frac{1}{2}, \\sqrt{18} == 3\\sqrt{2}) else 0.0.
  Components: `correct` (same as the scalar) and `format` (1.0 iff a boxed or final answer
  was found, the last-number fallback does not count as format).
- A missing or unparseable gold raises `VerifierInputError` (dead letter). An answer that
  does not parse, or whose parsing times out, scores 0.0 with status "ok" (policy's fault).
- The gold and the answer are parsed and compared (`equivalent_in_job`) in an `answer_pool`
  job, never in this process: sympy parsing is eval-based, so a policy answer is code there,
  held to the pool's CPU / memory / wall limits with no credentials. An answer that hits a
  limit scores 0 with status `answer_limit`. math-verify's timeouts (SIGALRM) apply, as the
  job runs them in its main thread; the pool failing is a `VerifierInfraError`.
"""

from __future__ import annotations

import re
import threading

from schemas import Trajectory
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import Verdict, VerifierInputError

TIMEOUT_S = 5
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FINAL = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_MAX_ANSWER_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, braces matched (None if none/unclosed)."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth, i = 1, m.end()
        while i < len(text):
            c = text[i]
            if c == "\\":  # skip escaped characters such as \{ and \}
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end() : i].strip()
            i += 1
    return None


def _strip_math(s: str) -> str:
    s = s.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s.rstrip(".").strip()


def extract_answer(text: str) -> tuple[str | None, bool]:
    """(answer, format_ok): last boxed, else the final "answer is X", else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    finals = list(_FINAL.finditer(text))
    if finals:
        answer = _strip_math(finals[-1].group(1).splitlines()[0] if finals[-1].group(1) else "")
        if answer:
            return answer, True
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", ""), False
    return None, False


def _timeouts() -> tuple[int | None, int | None]:
    main = threading.current_thread() is threading.main_thread()
    return (TIMEOUT_S, TIMEOUT_S) if main else (None, None)


def _parse(expr: str, *, fallback: bool):
    from math_verify import parse

    parse_timeout, _ = _timeouts()
    return parse(f"${expr}$", fallback_mode="first_match" if fallback else "no_fallback", parsing_timeout=parse_timeout)


def _gold_text(gold: object) -> str:
    """The gold's expression text, or VerifierInputError when it is missing or empty."""
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise VerifierInputError("math task without a string/number verifier_params.gold")
    text = _strip_math(str(gold))
    boxed = last_boxed(text)
    text = boxed if boxed is not None else text
    if not text:
        raise VerifierInputError("math task with an empty verifier_params.gold")
    return text


def parse_gold(gold: object) -> list:
    """The parsed gold answer, or VerifierInputError if it is missing or malformed (in this process:
    for the controlled-side gold only; answers are parsed in the answer pool)."""
    parsed = _parse(_gold_text(gold), fallback=False)
    if not parsed:
        raise VerifierInputError(f"math gold does not parse: {str(gold)[:200]!r}")
    return parsed


def equivalent_in_job(gold_text: str, answer: str | None) -> dict:
    """In an answer-pool job (its main thread: math-verify's SIGALRM timeouts apply): whether the
    gold parses and whether `answer` is equivalent to it."""
    from math_verify import verify

    gold = _parse(gold_text, fallback=False)
    if not gold:
        return {"gold": False, "correct": False}
    correct = False
    if answer is not None and len(answer) <= _MAX_ANSWER_CHARS:
        parsed = _parse(answer, fallback=True)
        if parsed:
            _, verify_timeout = _timeouts()
            correct = bool(verify(gold, parsed, timeout_seconds=verify_timeout))
    return {"gold": True, "correct": correct}


def verify_math(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """1.0 iff the final answer is equivalent to gold (math-verify, in the answer pool), else 0.0."""
    from verifier_workers import answer_pool

    raw_gold = (hidden or {}).get("gold", traj.verifier_params.get("gold"))
    gold_text = _gold_text(raw_gold)
    answer, format_ok = extract_answer(traj.final_text or "")
    out = answer_pool.call("verifier_workers.verifiers.math:equivalent_in_job", (gold_text, answer))
    if out.kind == "limit":
        return Verdict(
            {"correct": 0.0, "format": float(format_ok)},
            status="answer_limit",
            details=f"answer={answer!r} hit the answer pool's {out.limit} limit"[:400],
        )
    if out.kind != "ok" or not isinstance(out.value, dict):
        raise VerifierInfraError(f"math-verify failed in the answer pool: {out.error or out.value!r}"[:400])
    if not out.value.get("gold"):
        raise VerifierInputError(f"math gold does not parse: {str(raw_gold)[:200]!r}")
    correct = out.value.get("correct") is True
    return Verdict({"correct": float(correct), "format": float(format_ok)}, details=f"answer={answer!r}")
