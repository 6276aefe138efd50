"""Answer formats that a domain and its verifier agree on, so neither imports the other.

A producer renders a task and, for SFT, a demonstration in one of these formats; the
verifier (controlled side) reads the completion back with the same function. They live
below both roles.

Guarantees:
- `arith_value` is exact integer arithmetic over non-negative integers and `+ - *` with
  the usual precedence, never `eval`; anything else raises ValueError (a malformed
  expression is an error, not a 0).
- `arith_answer` / `calc_answer` return the integer answered, or None when the
  completion is not one: a wrong format scores as wrong, never as an exception.
  `arith_answer` takes a bare integer (`72`) or a worked answer, the work in parentheses
  then `=` and the integer (`(70+2)=72`, as `worked_completion` writes it). The work is
  digits and `+ -` only and is never scored: only the final integer counts, so showing
  work can neither earn nor cost reward by itself. One work group at most.
- `tagged_answer` (the reasoning-gym family's format) is the text of the last
  `<answer>...</answer>`; without one, the text after the last `<answer>` left open (a
  generation cut by its token budget); without that, the final non-empty line; stripped;
  None when nothing non-empty remains.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\s*(\d+|[+\-*])")
_CALC_ANSWER = re.compile(r"^\s*=?\s*(-?\d+)\s*$")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def arith_value(expression: str) -> int:
    """Exact value of an expression of non-negative integers and + - * (usual precedence).

    Raises ValueError on anything else, so a malformed expression is an error, not a 0.
    """
    tokens = _TOKEN.findall(expression)
    if "".join(tokens) != expression.replace(" ", "") or not tokens:
        raise ValueError(f"not an arith expression: {expression!r}")
    terms: list[int] = []
    sign, product, expect_number = 1, 0, True
    pending_op = "+"
    for tok in tokens:
        if expect_number:
            if not tok.isdigit():
                raise ValueError(f"expected a number in {expression!r}, got {tok!r}")
            n = int(tok)
            product = n if pending_op != "*" else product * n
            expect_number = False
        else:
            if tok == "*":
                pending_op = "*"
            else:
                terms.append(sign * product)
                sign, pending_op = (1 if tok == "+" else -1), tok
            expect_number = True
    if expect_number:
        raise ValueError(f"expression ends with an operator: {expression!r}")
    terms.append(sign * product)
    return sum(terms)


_ARITH_ANSWER = re.compile(r"(?:\([-+\d]{1,40}\)=)?(-?\d{1,12})")


def arith_answer(completion: str) -> int | None:
    """The integer the model answered: the whole completion, stripped, either a bare integer
    or `(work)=integer`; None if it is neither."""
    m = _ARITH_ANSWER.fullmatch(completion.strip())
    return int(m.group(1)) if m else None


def worked_completion(expression: str, answer: int) -> str | None:
    """The worked answer to a one-operator `a+b` / `a-b` of operands with 2+ digits: the high
    parts and the last digits combined first, `(70+2)=72` for `21+51`, `(40-4)=36` for
    `83-47`; None for other expressions (one digit, several operators, `*`)."""
    m = re.fullmatch(r"(\d{2,})([+-])(\d{2,})", expression)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    sign = 1 if op == "+" else -1
    high, low = (a // 10 + sign * (b // 10)) * 10, a % 10 + sign * (b % 10)
    return f"({high}{'+' if low >= 0 else '-'}{abs(low)})={answer}"


def calc_answer(text: str) -> int | None:
    """The integer of a final answer `=123` / `123`, else None."""
    m = _CALC_ANSWER.match(text or "")
    return int(m.group(1)) if m else None


def tagged_answer(text: str) -> str | None:
    """The answer of a completion in the `<answer>...</answer>` format (see the module guarantees)."""
    text = text or ""
    closed = _TAGGED.findall(text)
    if closed:
        found = closed[-1].strip()
    elif ANSWER_OPEN in text:
        found = text[text.rfind(ANSWER_OPEN) + len(ANSWER_OPEN) :].strip()
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        found = lines[-1] if lines else ""
    return found or None
