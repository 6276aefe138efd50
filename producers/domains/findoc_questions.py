"""The `findoc` questions: extraction, calculation and conclusion, each with its gold, its
derivation and its demonstration (lookup, then arithmetic, then the answer).

Guarantees:
- `ask(rng, filing, family)` returns a `Question`: the text the model sees, the tables it
  needs (`needs`: those are kept in every document), the verifier-only `hidden` payload
  (family, gold, unit, tolerance or fields, derivation) and the demonstrated completion.
- Every gold is computed from figures as the document shows them (tenths of a million),
  after the footnote's restatement where a question touches the restated figure.
- extraction: a named line for a year (and segment), gold in millions of dollars, exact
  after unit normalisation. calculation: a growth rate, margin (percent), ratio or free
  cash flow (millions), with a relative tolerance `rel_tol` and `abs_tol` in the gold's unit.
  conclusion: whether consolidated operating margin improved or declined between two
  years, and the segment whose operating income moved most in that direction (the
  generator's figures never tie: a tie is redrawn by the caller's next rng draws).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from producers.domains.findoc_gen import LABELS, TABLES, Filing, money
from schemas.answers import ANSWER_CLOSE, ANSWER_OPEN

FAMILIES = ("extraction", "calculation", "conclusion")
TABLE_OF = {key: name for name, (_, keys) in TABLES.items() for key in keys}
"""The table each consolidated line is shown in."""
REL_TOL = 0.01
"""Relative tolerance of a calculation's answer."""


@dataclass(frozen=True)
class Question:
    """One question about a filing."""

    family: str
    text: str
    needs: tuple[str, ...]
    hidden: dict
    completion: str


def _m(tenths: int) -> float:
    return tenths / 10


def _fmt(x: float, places: int = 2) -> str:
    return f"{x:,.{places}f}"


def _seg_lookup(f: Filing, seg: str, year: int, what: str) -> tuple[int, str]:
    """(figure, lookup line) of a segment figure, the restatement applied."""
    if what == "revenue":
        value = f.seg_rev(seg, year)
        line = (
            f"{seg} revenue {year}: Segment Information (in thousands) {money(f.seg_revenue[(seg, year)], 'thousands')}"
        )
        if (seg, year) == f.restated[:2]:
            line += f", restated by Note 7 to ${money(value)} million"
        else:
            line += f" = ${money(value)} million"
        return value, line
    value = f.seg_oi[(seg, year)]
    line = f"{seg} operating income {year}: Segment Information (in thousands) {money(value, 'thousands')} = ${money(value)} million"
    return value, line


def _line_lookup(f: Filing, key: str, year: int) -> tuple[int, str]:
    value = f.lines[(key, year)]
    unit = f.bs_unit if TABLE_OF[key] == "balance" else "millions"
    shown = money(value, unit)
    conv = f" = ${money(value)} million" if unit == "thousands" else " million"
    return value, f"{LABELS[key]} {year}: {shown} (in {unit}){conv}"


def _answer(text: str) -> str:
    return f"{ANSWER_OPEN}{text}{ANSWER_CLOSE}"


def extraction(rng: random.Random, f: Filing) -> Question:
    """A named figure for a year (and segment), in millions."""
    year = rng.choice(f.years)
    if rng.random() < 0.6:
        seg, what = rng.choice(f.segments), rng.choice(("revenue", "revenue", "operating income"))
        if what == "revenue" and rng.random() < 0.4:
            seg, year = f.restated[:2]  # the footnote matters
        value, lookup = _seg_lookup(f, seg, year, "revenue" if what == "revenue" else "oi")
        text = f"What was the {seg} segment's {what} in fiscal {year}?"
        needs = ("segments", "note")
    else:
        key = rng.choice(
            ("revenue", "operating_income", "net_income", "total_assets", "total_equity", "operating_cash_flow")
        )
        value, lookup = _line_lookup(f, key, year)
        text = f"What was {f.company}'s {LABELS[key].lower()} in fiscal {year}?"
        needs = (TABLE_OF[key],)
    text += " Answer in millions of US dollars."
    hidden = {"family": "extraction", "gold": _m(value), "unit": "million", "derivation": lookup}
    return Question("extraction", text, needs, hidden, f"Lookup: {lookup}.\n{_answer(_fmt(_m(value), 1))}")


def calculation(rng: random.Random, f: Filing) -> Question:
    """A growth rate, margin, ratio or free cash flow."""
    kind = rng.choice(("growth", "segment_margin", "operating_margin", "debt_to_equity", "free_cash_flow"))
    y0, y1 = sorted(rng.sample(f.years, 2))
    seg = rng.choice(f.segments)
    if kind == "growth":
        if rng.random() < 0.5:
            seg = f.restated[0]
            y0 = f.restated[1]
            y1 = rng.choice([y for y in f.years if y > y0])
        (a, la), (b, lb) = _seg_lookup(f, seg, y0, "revenue"), _seg_lookup(f, seg, y1, "revenue")
        gold, unit, method = (
            (b - a) / a * 100,
            "percent",
            f"({_fmt(_m(b), 1)} - {_fmt(_m(a), 1)}) / {_fmt(_m(a), 1)} x 100",
        )
        text = f"By what percentage did the {seg} segment's revenue change from fiscal {y0} to fiscal {y1}?"
        lookups, needs = [la, lb], ("segments", "note")
    elif kind == "segment_margin":
        (r, lr), (o, lo) = _seg_lookup(f, seg, y1, "revenue"), _seg_lookup(f, seg, y1, "oi")
        gold, unit, method = o / r * 100, "percent", f"{_fmt(_m(o), 1)} / {_fmt(_m(r), 1)} x 100"
        text = (
            f"What was the {seg} segment's operating margin (operating income over revenue) in fiscal {y1}, in percent?"
        )
        lookups, needs = [lr, lo], ("segments", "note")
    elif kind == "operating_margin":
        (r, lr), (o, lo) = _line_lookup(f, "revenue", y1), _line_lookup(f, "operating_income", y1)
        gold, unit, method = o / r * 100, "percent", f"{_fmt(_m(o), 1)} / {_fmt(_m(r), 1)} x 100"
        text = f"What was {f.company}'s consolidated operating margin in fiscal {y1}, in percent?"
        lookups, needs = [lr, lo], ("income",)
    elif kind == "debt_to_equity":
        (d, ld), (e, le) = _line_lookup(f, "long_term_debt", y1), _line_lookup(f, "total_equity", y1)
        gold, unit, method = d / e, "ratio", f"{_fmt(_m(d), 1)} / {_fmt(_m(e), 1)}"
        text = (
            f"What was {f.company}'s ratio of long-term debt to total shareholders' equity at the end of fiscal {y1}?"
        )
        lookups, needs = [ld, le], ("balance",)
    else:
        (o, lo), (c, lc) = _line_lookup(f, "operating_cash_flow", y1), _line_lookup(f, "capex", y1)
        gold, unit, method = _m(o + c), "million", f"{_fmt(_m(o), 1)} - {_fmt(_m(-c), 1)}"
        text = (
            f"Compute {f.company}'s free cash flow in fiscal {y1} as net cash provided by operating activities "
            f"minus capital expenditures, in millions of US dollars."
        )
        lookups, needs = [lo, lc], ("cash",)
    shown = f"{_fmt(gold)}%" if unit == "percent" else _fmt(gold)
    hidden = {
        "family": "calculation",
        "kind": kind,
        "gold": gold,
        "unit": unit,
        "rel_tol": REL_TOL,
        "abs_tol": 0.05 if unit != "ratio" else 0.005,
        "method": method,
        "derivation": lookups,
    }
    completion = "".join(f"Lookup: {x}.\n" for x in lookups) + f"Arithmetic: {method} = {shown}\n{_answer(shown)}"
    return Question("calculation", text, needs, hidden, completion)


def conclusion(rng: random.Random, f: Filing) -> Question | None:
    """Did consolidated operating margin improve, and which segment drove it (None on a tie)."""
    y0, y1 = sorted(rng.sample(f.years, 2))
    m = [f.lines[("operating_income", y)] / f.lines[("revenue", y)] for y in (y0, y1)]
    if abs(m[1] - m[0]) < 0.0005:
        return None
    up = m[1] > m[0]
    moves = {s: f.seg_oi[(s, y1)] - f.seg_oi[(s, y0)] for s in f.segments}
    ranked = sorted(moves, key=lambda s: moves[s], reverse=up)
    if moves[ranked[0]] == moves[ranked[1]] or (moves[ranked[0]] > 0) != up:
        return None
    label, driver = ("improved" if up else "declined"), ranked[0]
    text = (
        f"Did {f.company}'s consolidated operating margin improve or decline from fiscal {y0} to fiscal {y1}, "
        f"and which segment drove the change (the segment whose operating income moved most in the same direction)? "
        f"Answer as: label=<improved|declined>; driver=<segment>."
    )
    lookups = [
        f"operating margin {y}: {_fmt(_m(f.lines[('operating_income', y)]), 1)} / {_fmt(_m(f.lines[('revenue', y)]), 1)} = {_fmt(v * 100)}%"
        for y, v in zip((y0, y1), m)
    ]
    lookups += [f"{s} operating income change {y0}->{y1}: {_fmt(_m(moves[s]), 1)}" for s in f.segments]
    hidden = {
        "family": "conclusion",
        "gold": {"label": label, "driver": driver},
        "choices": {"label": ["improved", "declined"], "driver": list(f.segments)},
        "derivation": lookups,
    }
    answer = f"label={label}; driver={driver}"
    completion = (
        "".join(f"Lookup: {x}.\n" for x in lookups)
        + f"Arithmetic: margin {_fmt(m[0] * 100)}% -> {_fmt(m[1] * 100)}%, {label}; largest move: {driver}\n{_answer(answer)}"
    )
    return Question("conclusion", text, ("income", "segments"), hidden, completion)


def ask(rng: random.Random, f: Filing, family: str) -> Question | None:
    """A question of `family` about `f` (None when this draw has no clean answer: draw again)."""
    return {"extraction": extraction, "calculation": calculation, "conclusion": conclusion}[family](rng, f)
