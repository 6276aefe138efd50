"""The `files` verifier: a file the policy wrote, checked against the task's requirements.

Where the file comes from (in this order):
- `traj.artifacts[path]`: the files the rollout worker exported from the episode's
  sandbox (`path` matched after dropping a leading "./" or "/");
- for a single-turn episode (at most one assistant turn) that exported no artifacts,
  `final_text`: the content of its last fenced block (```<any info>\\n...```), or the
  whole text when it has no fence. A multi-turn episode must export the file.

Public task params: `path` (the file name) and `format` (`json`, `csv` or `svg`).
Hidden payload (the requirements; `verifier_params["requirements"]` for dev tasks):
- json: `schema`, a JSON Schema subset (type, required, properties, items, enum, const,
  minimum, maximum, minLength, maxLength, minItems, maxItems), and/or `expected`
  {field: value} of gold values (compared like the `extract` verifier).
- csv: `columns` (header names that must be present), `types` {column: int|float|bool|str},
  `min_rows`, `max_rows`, `rows` (gold rows as {column: value}, each must appear).
- svg: `elements`, a list of {"tag", "min" (default 1), "max"?, "attrs" {name: value or
  null for "present"}, "text"? (substring)}, and `root_attrs` {name: value|null}.

Guarantees:
- Components: `exists` (the file was found, non-empty), `parses` (it is valid JSON / CSV
  with a header / XML without DTD), `schema` (fraction of requirements met, 0 unless it
  parses), `correct` (1.0 iff it exists, parses and meets every requirement). The default
  scalar is `correct`. `details` lists the unmet requirements.
- A missing, unparseable or wrong file is the policy's fault: reward 0, status "ok".
- Unusable params or requirements (no path, unknown format, nothing to check) raise
  `VerifierInputError` (dead letter).
- XML with a DOCTYPE or entity declaration is refused (no entity expansion); files
  larger than MAX_BYTES count as not parsing.
"""

from __future__ import annotations

import csv
import io
import json
import re
import xml.etree.ElementTree as ET
from typing import Any

from schemas import Trajectory
from verifier_workers.verdict import Verdict, VerifierInputError
from verifier_workers.verifiers.extract import values_match

FORMATS = ("json", "csv", "svg")
MAX_BYTES = 1_000_000
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_DTD = re.compile(r"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)

Requirement = tuple[str, bool]


# -- finding the file ------------------------------------------------------------------


def _norm_path(p: str) -> str:
    p = p.strip()
    while p.startswith("./"):
        p = p[2:]
    return p.lstrip("/")


def file_content(traj: Trajectory, path: str) -> str | None:
    """The file's text (see the module docstring for where it comes from), or None."""
    if traj.artifacts:
        by_path = {_norm_path(k): v for k, v in traj.artifacts.items()}
        data = by_path.get(_norm_path(path))
        return None if data is None else data[: MAX_BYTES + 1].decode("utf-8", errors="replace")
    if sum(t.role == "assistant" for t in traj.turns) > 1:
        return None
    text = traj.final_text or ""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


# -- format checks: each returns (parsed_ok, requirements) -------------------------------

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _type_ok(want: str | list[str], value: Any) -> bool:
    names = [want] if isinstance(want, str) else list(want)
    for name in names:
        if name not in _TYPES:
            raise VerifierInputError(f"files: unsupported JSON Schema type {name!r}")
    return any(_TYPES[n](value) for n in names)


def _bounds(schema: dict, value: Any, at: str) -> list[Requirement]:
    out: list[Requirement] = []
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    for key, test in (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b)):
        if key in schema:
            out.append((f"{at} {key} {schema[key]}", number and test(value, schema[key])))
    for key, kind, test in (
        ("minLength", str, lambda n, b: n >= b),
        ("maxLength", str, lambda n, b: n <= b),
        ("minItems", list, lambda n, b: n >= b),
        ("maxItems", list, lambda n, b: n <= b),
    ):
        if key in schema:
            out.append((f"{at} {key} {schema[key]}", isinstance(value, kind) and test(len(value), schema[key])))
    return out


def check_schema(schema: dict, value: Any, at: str = "$") -> list[Requirement]:
    """Requirements of a JSON Schema subset, one per keyword (nested properties recurse)."""
    if not isinstance(schema, dict):
        raise VerifierInputError(f"files: schema at {at} is not an object")
    out: list[Requirement] = []
    if "type" in schema:
        out.append((f"{at} is {schema['type']}", _type_ok(schema["type"], value)))
    if "enum" in schema:
        out.append((f"{at} in {schema['enum']}", any(values_match(e, value) for e in schema["enum"])))
    if "const" in schema:
        out.append((f"{at} == {schema['const']!r}", values_match(schema["const"], value)))
    out += _bounds(schema, value, at)
    obj = value if isinstance(value, dict) else {}
    for name in schema.get("required", []):
        out.append((f"{at}.{name} present", name in obj))
    for name, sub in (schema.get("properties") or {}).items():
        if name in obj:
            out += check_schema(sub, obj[name], f"{at}.{name}")
    if "items" in schema:
        items = value if isinstance(value, list) else []
        bad = [i for i, item in enumerate(items) if not all(ok for _, ok in check_schema(schema["items"], item))]
        out.append(
            (f"{at}[*] match items schema" + (f" (bad: {bad[:5]})" if bad else ""), isinstance(value, list) and not bad)
        )
    return out


def check_json(text: str, req: dict) -> tuple[bool, list[Requirement]]:
    try:
        value = json.loads(text)
    except ValueError:
        return False, []
    out: list[Requirement] = []
    if "schema" in req:
        out += check_schema(req["schema"], value)
    for name, want in (req.get("expected") or {}).items():
        got = value.get(name) if isinstance(value, dict) else None
        out.append((f"{name} == {want!r}", isinstance(value, dict) and name in value and values_match(want, got)))
    return True, out


_CELL_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "bool": lambda s: {"true": True, "false": False}[s.strip().lower()],
}


def _cell_ok(kind: str, cell: str) -> bool:
    if kind not in _CELL_TYPES:
        raise VerifierInputError(f"files: unsupported csv column type {kind!r}; one of {sorted(_CELL_TYPES)}")
    try:
        _CELL_TYPES[kind](cell.strip())
        return True
    except (ValueError, KeyError):
        return False


def check_csv(text: str, req: dict) -> tuple[bool, list[Requirement]]:
    try:
        rows = list(csv.reader(io.StringIO(text), strict=True))
    except csv.Error:
        return False, []
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows or not any(h.strip() for h in rows[0]):
        return False, []
    header, body = [h.strip() for h in rows[0]], rows[1:]
    out: list[Requirement] = [(f"every row has {len(header)} fields", all(len(r) == len(header) for r in body))]
    records = [dict(zip(header, r)) for r in body]
    out += [(f"column {c!r} present", c in header) for c in req.get("columns", [])]
    for col, kind in (req.get("types") or {}).items():
        out.append(
            (f"column {col!r} is {kind}", col in header and all(_cell_ok(kind, r.get(col, "")) for r in records))
        )
    if "min_rows" in req:
        out.append((f"at least {req['min_rows']} rows", len(body) >= req["min_rows"]))
    if "max_rows" in req:
        out.append((f"at most {req['max_rows']} rows", len(body) <= req["max_rows"]))
    for gold in req.get("rows", []):
        found = any(all(k in r and values_match(v, r[k]) for k, v in gold.items()) for r in records)
        out.append((f"row {gold} present", found))
    return True, out


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _attrs_ok(el: ET.Element, want: dict) -> bool:
    have = {_local(k): v for k, v in el.attrib.items()}
    return all(k in have and (v is None or values_match(str(v), have[k])) for k, v in want.items())


def _element_requirement(root: ET.Element, spec: dict) -> Requirement:
    if not isinstance(spec, dict) or not isinstance(spec.get("tag"), str):
        raise VerifierInputError(f"files: svg element requirement needs a 'tag': {spec!r}")
    lo, hi = int(spec.get("min", 1)), spec.get("max")
    n = sum(
        1
        for el in root.iter()
        if _local(str(el.tag)) == spec["tag"]
        and _attrs_ok(el, spec.get("attrs") or {})
        and ("text" not in spec or spec["text"].casefold() in "".join(el.itertext()).casefold())
    )
    return (
        f"<{spec['tag']}> x{n} within [{lo}, {hi if hi is not None else 'inf'}] {spec.get('attrs') or ''}",
        n >= lo and (hi is None or n <= int(hi)),
    )


def check_svg(text: str, req: dict) -> tuple[bool, list[Requirement]]:
    if _DTD.search(text):
        return False, []
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError:
        return False, []
    out: list[Requirement] = [("root element is <svg>", _local(str(root.tag)) == "svg")]
    if req.get("root_attrs"):
        out.append((f"<svg> has {req['root_attrs']}", _attrs_ok(root, req["root_attrs"])))
    out += [_element_requirement(root, spec) for spec in req.get("elements", [])]
    return True, out


CHECKS = {"json": check_json, "csv": check_csv, "svg": check_svg}
_REQUIREMENT_KEYS = {
    "json": ("schema", "expected"),
    "csv": ("columns", "types", "min_rows", "max_rows", "rows"),
    "svg": ("elements", "root_attrs"),
}


def task_spec(traj: Trajectory, hidden: dict | None) -> tuple[str, str, dict]:
    """(path, format, requirements) of the task, or VerifierInputError."""
    params = traj.verifier_params
    path, fmt = params.get("path"), params.get("format")
    if not isinstance(path, str) or not path.strip():
        raise VerifierInputError("files task without a verifier_params.path")
    if fmt not in FORMATS:
        raise VerifierInputError(f"files task format {fmt!r} is not one of {FORMATS}")
    req = hidden if hidden is not None else params.get("requirements")
    if not isinstance(req, dict) or not any(req.get(k) for k in _REQUIREMENT_KEYS[fmt]):
        raise VerifierInputError(f"files task ({fmt}) without requirements: give one of {_REQUIREMENT_KEYS[fmt]}")
    return path, fmt, req


def verify_files(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the exported file: exists, parses, fraction of requirements met, all met."""
    path, fmt, req = task_spec(traj, hidden)
    text = file_content(traj, path)
    if text is None or not text.strip():
        return Verdict({"exists": 0.0, "parses": 0.0, "schema": 0.0, "correct": 0.0}, details=f"no file {path!r}")
    parsed, reqs = (False, []) if len(text) > MAX_BYTES else CHECKS[fmt](text, req)
    if not parsed:
        return Verdict(
            {"exists": 1.0, "parses": 0.0, "schema": 0.0, "correct": 0.0}, details=f"{path!r} is not valid {fmt}"
        )
    met = sum(ok for _, ok in reqs)
    frac = met / len(reqs) if reqs else 1.0
    unmet = [what for what, ok in reqs if not ok]
    return Verdict(
        {"exists": 1.0, "parses": 1.0, "schema": frac, "correct": float(not unmet)},
        details=f"{met}/{len(reqs)} requirements met" + (f"; unmet: {unmet[:10]}" if unmet else ""),
    )
