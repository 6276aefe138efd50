"""Host-side preparation of the repo verifier's test run (pure, no I/O): the plain-data rewrite of
the test files and the refusal of shadowing modules.

Guarantees:
- `rewrite_tests(text)` is the test file with every comparison (`==`, `!=`, `<`, `<=`, `>`, `>=`,
  `in`, `not in`; chains of `is` / `is not` alone are left as they are) made over
  `__rlbus_plain__(operand)`, every bare `assert X` over `__rlbus_truth__(X)` (a `BoolOp`, `not` and
  comparisons recursively), and the value arguments of unittest's `assertEqual`-style methods over
  `__rlbus_plain__`. Both names are bound as keyword-only defaults of every `test*` function and
  method (so rebinding the test module's globals at run time changes nothing inside a running
  test; other functions, whose signatures tests may inspect, see them by scope) and
  imported at the top from the harness's guard (`_rlbus_guard.plain` / `truth`, which raise
  AssertionError for anything that is not comparable data: see `repo_harness_guard_data`); each
  check carries `changed_functions` of the diff as a constant (the repository functions the
  candidate wrote, whose comparison methods are never trusted). A
  `pytest.approx(...)` / `approx(...)` operand written in the test keeps its call; its arguments
  are made plain instead. A file that does not parse is returned unchanged (it cannot collect).
- Limits: only comparisons written in the test files are rewritten; a comparison that the tests
  delegate to library code (`sorted(objs)`, `set(objs)`, `mock.assert_called_with`) still runs
  the objects' own methods, and instances of a class whose comparison the diff changed (a
  dataclass of a changed file included) fail the check.
- `shadowing(names)` is the sorted subset of `names` (new top-level modules of a diff) that would
  shadow a stdlib module, pytest, pluggy, _pytest, a pytest dependency or the harness's own
  (`_rlbus*`); the in-container supervisor adds the interpreter's installed distributions.
- `new_top_levels(old, new, roots)` is the top-level module names that files of `new` add under
  the import roots (`.` and `src`) that no file of `old` had.
"""

from __future__ import annotations

import ast
import sys
import threading

PLAIN, TRUTH = "__rlbus_plain__", "__rlbus_truth__"
GUARD_MODULE = "_rlbus_guard"
RESERVED = frozenset(
    {
        "pytest",
        "_pytest",
        "pluggy",
        "py",
        "iniconfig",
        "packaging",
        "pygments",
        "pip",
        "setuptools",
        "pkg_resources",
        "_distutils_hack",
        "wheel",
        GUARD_MODULE,
    }
)
MODULE_SUFFIXES = (".py", ".pyi", ".pyc", ".so", ".pyd", ".pth")
UNITTEST_VALUES = {
    "assertEqual": 2,
    "assertNotEqual": 2,
    "assertAlmostEqual": 2,
    "assertNotAlmostEqual": 2,
    "assertListEqual": 2,
    "assertTupleEqual": 2,
    "assertSetEqual": 2,
    "assertDictEqual": 2,
    "assertSequenceEqual": 2,
    "assertCountEqual": 2,
    "assertMultiLineEqual": 2,
    "assertIn": 2,
    "assertNotIn": 2,
    "assertGreater": 2,
    "assertGreaterEqual": 2,
    "assertLess": 2,
    "assertLessEqual": 2,
    "assertTrue": 1,
    "assertFalse": 1,
    "assertIsNone": 0,
    "assertIsNotNone": 0,
}


_CHANGED: tuple[str, ...] = ()
_AST_LOCK = threading.RLock()  # CPython 3.11's ast is not safe across threads (recursion-depth SystemError)


def _call(name: str, node: ast.expr) -> ast.expr:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=[node, ast.Constant(value=_CHANGED)], keywords=[])


def _is_approx(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == "approx")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "approx")
    )


def _plain(node: ast.expr) -> ast.expr:
    if _is_approx(node):
        node.args = [_call(PLAIN, a) for a in node.args]
        for kw in node.keywords:
            kw.value = _call(PLAIN, kw.value)
        return node
    return _call(PLAIN, node)


class _Rewrite(ast.NodeTransformer):
    def __init__(self):
        self.depth = 0  # functions entered

    def _func(self, node):
        self.depth += 1
        try:
            self.generic_visit(node)
        finally:
            self.depth -= 1
        if self.depth or not node.name.startswith("test"):
            return node  # only the functions pytest calls get the bound names; others see them by scope
        names = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        for name in (PLAIN, TRUTH):
            if name not in names:
                node.args.kwonlyargs.append(ast.arg(arg=name))
                node.args.kw_defaults.append(ast.Name(id=name, ctx=ast.Load()))
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _func

    def visit_Compare(self, node: ast.Compare):
        self.generic_visit(node)
        if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            return node
        node.left = _plain(node.left)
        node.comparators = [_plain(c) for c in node.comparators]
        return node

    def _truthy(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Compare):
            return node
        if isinstance(node, ast.BoolOp):
            node.values = [self._truthy(v) for v in node.values]
            return node
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node.operand = self._truthy(node.operand)
            return node
        return _call(TRUTH, node)

    def visit_Assert(self, node: ast.Assert):
        self.generic_visit(node)
        node.test = self._truthy(node.test)
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr in UNITTEST_VALUES:
            n = UNITTEST_VALUES[node.func.attr]
            wrap = TRUTH if n == 1 else PLAIN
            node.args = [_call(wrap, a) if i < n else a for i, a in enumerate(node.args)]
        return node


def _qualnames(text: str) -> dict[str, str] | None:
    """{qualname: ast dump} of every function of `text` (None when it does not parse)."""
    with _AST_LOCK:
        return _qualnames_locked(text)


def _qualnames_locked(text: str) -> dict[str, str] | None:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    out: dict[str, str] = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + child.name
                out[q] = ast.dump(child)
                walk(child, q + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def changed_functions(old: dict[str, str], new: dict[str, str], paths) -> tuple[str, ...]:
    """'path::qualname' of every function that `paths` of `new` add or change against `old`, plus
    'path::<lambda>' for each changed file (its lambdas) and 'path::*' for one that does not parse."""
    out: list[str] = []
    for path in sorted(p for p in paths if p.endswith(".py") and p in new):
        after = _qualnames(new[path])
        if after is None:
            out.append(f"{path}::*")
            continue
        before = _qualnames(old[path]) if path in old else {}
        out += [f"{path}::{q}" for q, dump in sorted(after.items()) if (before or {}).get(q) != dump]
        out.append(f"{path}::<lambda>")
    return tuple(out)


def rewrite_tests(text: str, changed: tuple[str, ...] = ()) -> str:
    """The test file with plain-data comparisons (see the module docstring); `changed`:
    `changed_functions` of the candidate's diff, embedded as a constant of every check."""
    with _AST_LOCK:
        return _rewrite_locked(text, changed)


def _rewrite_locked(text: str, changed: tuple[str, ...]) -> str:
    global _CHANGED
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text
    _CHANGED = tuple(changed)
    try:
        tree = _Rewrite().visit(tree)
    finally:
        _CHANGED = ()
    at = 0
    body = tree.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        at = 1
    while at < len(body) and isinstance(body[at], ast.ImportFrom) and body[at].module == "__future__":
        at += 1
    body.insert(
        at,
        ast.ImportFrom(
            module=GUARD_MODULE,
            names=[ast.alias(name="plain", asname=PLAIN), ast.alias(name="truth", asname=TRUTH)],
            level=0,
        ),
    )
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def shadowing(names) -> list[str]:
    """The names that shadow the stdlib, pytest and its dependencies, or the harness."""
    std = sys.stdlib_module_names
    return sorted(n for n in set(names) if n in std or n in RESERVED or n.startswith("_rlbus"))


def new_top_levels(old: dict[str, str], new: dict[str, str], roots: list[str]) -> list[str]:
    """Top-level module names that `new` adds under `roots` and no file of `old` had."""

    def tops(files) -> set[str]:
        out = set()
        for path in files:
            for root in roots:
                prefix = "" if root == "." else root.rstrip("/") + "/"
                if path.startswith(prefix) and path.endswith(MODULE_SUFFIXES):
                    rest = path[len(prefix) :]
                    out.add(rest.split(".", 1)[0] if "/" not in rest else rest.split("/", 1)[0])
        return out

    return sorted(n for n in tops(new) - tops(old) if n)
