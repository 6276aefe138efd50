"""AST mutation operators for repository tasks, and the unified diffs between versions.

A mutant is one small edit of one source file, found by walking its AST and applied as a
*text* edit at the node's position, so the rest of the file (comments, formatting) is
byte-identical and the gold patch is a one- or few-line diff.

Operators (`OPERATORS`):
- `flip_comparison`: the first operator of a comparison is replaced by its negation
  (`<` ↔ `>=`, `<=` ↔ `>`, `==` ↔ `!=`, `in` ↔ `not in`, `is` ↔ `is not`).
- `off_by_one`: an int literal that is an index / slice bound (`x[1]`, `x[:n-1]`), a
  `range(...)` argument, or a comparison operand becomes literal+1.
- `drop_branch`: an `if` body (starting on its own line) becomes `pass`, or a trailing
  `elif` block (one without its own `else`/`elif`) is removed.
- `swap_args`: the first two positional arguments of a call (not starred, textually
  different) are swapped.

Guarantees:
- `find_sites(source)` is deterministic (AST walk order) and lists only sites inside a
  function body (module-level code is never mutated, so imports keep working).
- `apply_site(source, site)` returns source that parses and differs from `source`, or
  raises `ValueError`; nothing else in the file changes.
- `unified_diff(old, new)` is a `difflib` unified diff with `a/` `b/` prefixes, and
  `apply_unified_diff(files, diff)` applies such a diff exactly (context must match, else
  `ValueError`); applying `unified_diff(old, new)` to `old` gives `new`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from schemas.repo_task import unified_diff  # noqa: F401 - re-exported: the diff format lives in schemas

OPERATORS = ("flip_comparison", "off_by_one", "drop_branch", "swap_args")
NEGATED = {
    ast.Lt: ">=",
    ast.GtE: "<",
    ast.LtE: ">",
    ast.Gt: "<=",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.In: "not in",
    ast.NotIn: "in",
    ast.Is: "is not",
    ast.IsNot: "is",
}
OP_TEXT = re.compile(r"not\s+in|is\s+not|<=|>=|==|!=|<|>|\bin\b|\bis\b")


@dataclass(frozen=True)
class Site:
    """One place an operator can edit: `op`, the node's span (1-based lines, byte columns), a label."""

    op: str
    lineno: int
    col: int
    end_lineno: int
    end_col: int
    label: str
    extra: tuple = ()
    """Operator data: for swap_args the second argument's span; for drop_branch the kind."""


class _Lines:
    """Source text addressed by (1-based line, UTF-8 byte column), as the AST gives them."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    def span(self, node_or_site) -> tuple[int, int]:
        n = node_or_site
        if isinstance(n, Site):
            return self.offset(n.lineno, n.col), self.offset(n.end_lineno, n.end_col)
        return self.offset(n.lineno, n.col_offset), self.offset(n.end_lineno, n.end_col_offset)


def _in_functions(tree: ast.AST):
    """Every node inside a function body, in walk order (nested functions once)."""
    seen: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in fn.body:
                for node in ast.walk(stmt):
                    if id(node) not in seen:
                        seen.add(id(node))
                        yield node


def _site(op: str, node: ast.AST, label: str, extra: tuple = ()) -> Site:
    return Site(op, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, label, extra)


def _int_literals(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            yield n


def _off_by_one_sites(node: ast.AST):
    targets: list[ast.AST] = []
    if isinstance(node, ast.Subscript):
        targets = [node.slice]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        targets = list(node.args)
    elif isinstance(node, ast.Compare):
        targets = [c for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
    for target in targets:
        for lit in _int_literals(target):
            yield _site("off_by_one", lit, f"{lit.value} -> {lit.value + 1}")


def _drop_branch_sites(node: ast.If, lines: list[str]):
    if node.body[0].lineno > node.lineno:
        yield _site("drop_branch", node, "if-body -> pass", ("body",))
    if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        elif_node = node.orelse[0]
        if not elif_node.orelse and lines[elif_node.lineno - 1].lstrip().startswith("elif"):
            yield _site("drop_branch", elif_node, "remove elif", ("elif",))


def find_sites(source: str) -> list[Site]:
    """Every mutation site of `source` (see the module guarantees)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    sites: list[Site] = []
    for node in _in_functions(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in NEGATED:
            sites.append(_site("flip_comparison", node, f"{type(node.ops[0]).__name__} negated"))
        if isinstance(node, ast.If):
            sites.extend(_drop_branch_sites(node, lines))
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            a, b = node.args[:2]
            if not any(isinstance(x, ast.Starred) for x in (a, b)) and ast.dump(a) != ast.dump(b):
                span_b = (b.lineno, b.col_offset, b.end_lineno, b.end_col_offset)
                sites.append(
                    Site(
                        "swap_args",
                        a.lineno,
                        a.col_offset,
                        a.end_lineno,
                        a.end_col_offset,
                        "first two arguments swapped",
                        span_b,
                    )
                )
        sites.extend(_off_by_one_sites(node))
    unique = {(s.op, s.lineno, s.col, s.end_lineno, s.end_col, s.extra): s for s in sites}
    return list(unique.values())


def _node_at(source: str, kind: type, site: Site) -> ast.AST:
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, kind) and (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) == (
            site.lineno,
            site.col,
            site.end_lineno,
            site.end_col,
        ):
            return n
    raise ValueError(f"no {kind.__name__} at line {site.lineno}")


def _flip(text: _Lines, site: Site) -> str:
    node = _node_at(text.source, ast.Compare, site)
    lo = text.offset(node.left.end_lineno, node.left.end_col_offset)
    hi = text.offset(node.comparators[0].lineno, node.comparators[0].col_offset)
    m = OP_TEXT.search(text.source, lo, hi)
    if m is None:
        raise ValueError("comparison operator not found")
    return text.source[: m.start()] + NEGATED[type(node.ops[0])] + text.source[m.end() :]


def _drop(text: _Lines, site: Site) -> str:
    node = _node_at(text.source, ast.If, site)
    lines = list(text.lines)
    if site.extra == ("body",):
        first, last = node.body[0].lineno, node.body[-1].end_lineno
        indent = re.match(r"\s*", lines[first - 1]).group(0)
        lines[first - 1 : last] = [f"{indent}pass\n"]
    else:
        del lines[node.lineno - 1 : node.end_lineno]
    return "".join(lines)


def _swap(text: _Lines, site: Site) -> str:
    a0, a1 = text.offset(site.lineno, site.col), text.offset(site.end_lineno, site.end_col)
    l2, c2, e2, ec2 = site.extra
    b0, b1 = text.offset(l2, c2), text.offset(e2, ec2)
    s = text.source
    return s[:a0] + s[b0:b1] + s[a1:b0] + s[a0:a1] + s[b1:]


def apply_site(source: str, site: Site) -> str:
    """`source` with `site`'s edit made (see the module guarantees)."""
    text = _Lines(source)
    if site.op == "flip_comparison":
        new = _flip(text, site)
    elif site.op == "off_by_one":
        start, end = text.span(site)
        value = int(source[start:end], 0)
        new = source[:start] + str(value + 1) + source[end:]
    elif site.op == "drop_branch":
        new = _drop(text, site)
    elif site.op == "swap_args":
        new = _swap(text, site)
    else:
        raise ValueError(f"unknown operator {site.op!r}")
    if new == source:
        raise ValueError("the edit changed nothing")
    try:
        ast.parse(new)
    except SyntaxError as exc:
        raise ValueError(f"the mutant does not parse: {exc}") from exc
    return new


HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _file_diffs(diff: str):
    """(old path or None, new path or None, hunk lines) per file of a unified diff."""
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = (lines[i][4:].strip().split("\t")[0], lines[i + 1][4:].strip().split("\t")[0])
            j = i + 2
            while j < len(lines) and not (
                lines[j].startswith("--- ") and j + 1 < len(lines) and lines[j + 1].startswith("+++ ")
            ):
                j += 1
            strip = lambda p: None if p == "/dev/null" else p.split("/", 1)[1] if "/" in p else p
            yield strip(old), strip(new), lines[i + 2 : j]
            i = j
        else:
            i += 1


def _apply_hunks(text: str, hunks: list[str], path: str) -> str:
    src = text.splitlines(keepends=True)
    out: list[str] = []
    pos, last = 0, ""
    for line in hunks:
        m = HUNK.match(line)
        if m:
            start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
            if start < pos:
                raise ValueError(f"{path}: overlapping hunks")
            out.extend(src[pos:start])
            pos = start
        elif line.startswith("\\"):
            if last in (" ", "+") and out and out[-1].endswith("\n"):
                out[-1] = out[-1][:-1]
        elif line[:1] in (" ", "-"):
            if pos >= len(src) or src[pos].rstrip("\n") != line[1:].rstrip("\n"):
                raise ValueError(f"{path}: context does not match at line {pos + 1}")
            if line[0] == " ":
                out.append(src[pos])
            pos += 1
        elif line[:1] == "+":
            out.append(line[1:] if line.endswith("\n") else line[1:] + "\n")
        last = line[:1]
    out.extend(src[pos:])
    return "".join(out)


def apply_unified_diff(files: dict[str, str], diff: str) -> dict[str, str]:
    """A copy of `files` with `diff` applied (see the module guarantees)."""
    result = dict(files)
    for old, new, hunks in _file_diffs(diff):
        path = new or old
        if old is not None and old not in result:
            raise ValueError(f"{old}: not in the repository")
        patched = _apply_hunks(result.get(old, "") if old else "", hunks, path)
        if new is None:
            result.pop(old, None)
        else:
            if old and old != new:
                result.pop(old, None)
            result[new] = patched
    return result
