"""The `recall` generator: needles in a haystack of records that look like them (pure, no I/O).

Guarantees:
- The haystack is records of an inventory ledger: depots, months, crate counts, access
  codes, written in a handful of sentence shapes. A needle is a record of the same shapes
  about a depot that no filler record names, so neither vocabulary nor format tells a
  needle from filler: only its key does.
- Variants: `single` (one needle, its value), `multi` (three needles, every value, checked
  field by field), `combine` (two needles whose numbers must be added; filler holds the same
  depot-month pattern for other depots), `kv` (a `key: value` table of ids that share
  prefixes with the asked key).
- `make_case(rng, variant)` returns a `Case`: needle texts, the question, the gold (one string
  per field) and the filler factory; the same rng state gives the same case.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

VARIANTS = ("single", "multi", "combine", "kv")
CITIES = (
    "Ostrava Brno Plzen Olomouc Liberec Zlin Opava Kladno Jihlava Tabor Pisek Most Kolin Cheb Trutnov Znojmo "
    "Breda Tilburg Zwolle Delft Leiden Haarlem Arnhem Venlo Assen Lund Umea Boras Gavle Kalmar Falun Visby"
).split()
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October")
SHAPES = (
    "The {city} depot received {n} crates in {month}.",
    "In {month}, the {city} depot logged {n} crates of incoming stock.",
    "Access code for the {city} depot loading bay: {code}.",
    "The {city} depot's night shift counted {n} pallets during {month}.",
    "Inspectors at the {city} depot signed off on {n} crates in {month}.",
)


@dataclass(frozen=True)
class Case:
    """One recall problem before it is laid out."""

    variant: str
    needles: tuple[str, ...]
    question: str
    gold: dict[str, str]
    """Field -> exact expected text (numbers as digits)."""
    filler_cities: tuple[str, ...]
    key: str = ""
    """The asked key of a `kv` case (its filler is other keys)."""


def code(rng: random.Random) -> str:
    """An access code such as `K7-4821-QX`."""
    letters = string.ascii_uppercase
    return (
        f"{rng.choice(letters)}{rng.randint(1, 9)}-{rng.randint(1000, 9999)}-{rng.choice(letters)}{rng.choice(letters)}"
    )


def make_case(rng: random.Random, variant: str) -> Case:
    """A recall problem of `variant` (see the module guarantees)."""
    cities = list(CITIES)
    rng.shuffle(cities)
    asked, rest = cities[:3], tuple(cities[3:])
    if variant == "single":
        c = code(rng)
        return Case(
            variant,
            (SHAPES[2].format(city=asked[0], code=c),),
            f"What is the access code for the {asked[0]} depot loading bay?",
            {"value": c},
            rest,
        )
    if variant == "multi":
        codes = [code(rng) for _ in asked]
        needles = tuple(SHAPES[2].format(city=c, code=k) for c, k in zip(asked, codes))
        q = f"List the access codes of the loading bays of the {', '.join(asked[:2])} and {asked[2]} depots, in that order."
        return Case(variant, needles, q, {c: k for c, k in zip(asked, codes)}, rest)
    if variant == "combine":
        m1, m2 = rng.sample(MONTHS, 2)
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        needles = (SHAPES[0].format(city=asked[0], n=a, month=m1), SHAPES[1].format(city=asked[0], n=b, month=m2))
        q = f"How many crates did the {asked[0]} depot receive in {m1} and {m2} together?"
        return Case(variant, needles, q, {"value": str(a + b)}, rest)
    key = f"{rng.choice(asked)[:3].upper()}-{rng.randint(100, 999)}"
    value = code(rng)
    q = f"In the registry of dock keys, what is the value of key {key}?"
    return Case(variant, (f"{key}: {value}",), q, {"value": value}, rest, key=key)


def filler_lines(rng: random.Random, case: Case, n: int) -> list[str]:
    """`n` haystack records for `case` (none repeats a needle's key)."""
    out = []
    for _ in range(n):
        if case.key:
            prefix, num = case.key.split("-")
            other = case.key
            while other == case.key:  # a distractor shares the prefix or the number, never both
                other = (
                    f"{prefix}-{rng.randint(100, 999)}"
                    if rng.random() < 0.5
                    else f"{rng.choice(case.filler_cities)[:3].upper()}-{num}"
                )
            out.append(f"{other}: {code(rng)}")
            continue
        city = rng.choice(case.filler_cities)
        out.append(
            rng.choice(SHAPES).format(city=city, n=rng.randint(100, 999), month=rng.choice(MONTHS), code=code(rng))
        )
    return out


def answer_text(case: Case) -> str:
    """The gold written as an answer: the value, or `city=code; ...` for several."""
    if case.variant == "multi":
        return "; ".join(f"{k}={v}" for k, v in case.gold.items())
    return case.gold["value"]
