"""The folders are the architecture: imports run one way, and names are defined once.

- Layer order (DESIGN.md): schemas -> bus -> sandbox_workers -> producers / learner /
  rollout_workers / verifier_workers -> scheduler -> rlbus. A module may import its own
  package and any package of a LOWER layer; never a higher one, and never a sibling role
  (no role imports another role's internals). Every import counts, including lazy ones
  inside functions and under TYPE_CHECKING.
- Every KV key of the control plane is a constant in `bus/kv.py`; no module outside
  `bus/` spells one as a string literal (docstrings and log event names aside).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bus import kv

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"schemas": 0, "bus": 1, "sandbox_workers": 2, "producers": 3, "learner": 3, "rollout_workers": 3,
          "verifier_workers": 3, "scheduler": 4, "rlbus": 5}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def layer_violations(root: Path) -> list[str]:
    """`file:line pkg -> other` for every upward or sideways import under `root`."""
    bad = []
    for pkg, level in LAYERS.items():
        for path in sorted((root / pkg).rglob("*.py")):
            for line, other in imported_packages(path):
                if other == pkg or other not in LAYERS:
                    continue
                if LAYERS[other] >= level:
                    bad.append(f"{path.relative_to(root)}:{line} {pkg} -> {other}")
    return bad


def test_imports_run_one_way():
    bad = layer_violations(ROOT)
    assert not bad, "upward or sideways imports (move the shared thing down a layer):\n" + "\n".join(bad)


def test_the_layer_check_fires(tmp_path):
    """The check itself can fail: a role importing the application, or a sibling role, is caught."""
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "learner" / "x.py").write_text("def f():\n    from rlbus.cli import main\n")
    (tmp_path / "verifier_workers" / "y.py").write_text("from producers import arith\n")
    (tmp_path / "bus" / "ok.py").write_text("from schemas import Task\nimport json\n")
    assert layer_violations(tmp_path) == ["learner/x.py:2 learner -> rlbus",
                                          "verifier_workers/y.py:1 verifier_workers -> producers"]


def kv_keys() -> dict[str, str]:
    """Constant name -> key of every KV key defined in bus/kv.py (templates by their fixed prefix)."""
    keys = {}
    for name in dir(kv):
        value = getattr(kv, name)
        if name.isupper() and isinstance(value, str) and name != "STOP_REQUESTED":
            keys[name] = value.split("{")[0]
    return keys


KV_HELPERS = {"get_json", "put_json"}
KV_METHODS = {"get", "put", "create", "update", "delete", "purge", "watch"}  # on a receiver named *kv*


def key_literals(root: Path, keys: dict[str, str]) -> list[str]:
    """`file:line` of every KV key spelled as a literal outside bus/: a dotted key anywhere
    (docstrings and log event names aside), any key as an argument of a KV call."""
    wanted = {v: k for k, v in keys.items()}
    bad = []
    for pkg in LAYERS:
        if pkg == "bus":
            continue
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            skip, kv_args = set(), set()
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                        and isinstance(body[0].value, ast.Constant):
                    skip.add(id(body[0].value))  # a docstring
                if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                    name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                    if name in {"debug", "info", "warning", "error", "exception", "critical"} and node.args:
                        skip.add(id(node.args[0]))  # a log event name
                    on_kv = isinstance(node.func, ast.Attribute) and "kv" in ast.unparse(node.func.value).lower()
                    if name in KV_HELPERS or (name in KV_METHODS and on_kv):
                        kv_args |= {id(a) for a in ast.walk(node) if isinstance(a, ast.Constant)}
            for n in ast.walk(tree):
                if not (isinstance(n, ast.Constant) and isinstance(n.value, str)) or id(n) in skip:
                    continue
                hit = wanted.get(n.value) or next((k for v, k in wanted.items() if "." in v and v.endswith(".")
                                                   and n.value.startswith(v)), None)
                if hit and ("." in n.value or id(n) in kv_args):
                    bad.append(f"{path.relative_to(root)}:{n.lineno} {n.value!r} (use bus.kv.{hit})")
    return bad


def test_kv_keys_are_defined_only_in_bus():
    keys = kv_keys()
    assert {"WEIGHTS_LATEST", "LEARNER_PROGRESS", "DURATIONS", "RELEASE_LATEST", "LEARNER_OVERRIDES",
            "LEARNER_LEASE", "EVAL_BASELINE", "DLQ_REPLAYED"} <= set(keys)
    bad = key_literals(ROOT, keys)
    assert not bad, "KV key literals outside bus/ (import the constant from bus.kv):\n" + "\n".join(bad)


@pytest.mark.parametrize("source", ['latest = get_json(js, reg, "weights.latest")\n',
                                    'KEY = "dlq.replayed." + str(seq)\n',
                                    'plan = await get_json(js, reg, "curriculum")\n',
                                    'entry = await self._kv.get("status")\n'])
def test_the_key_check_fires(tmp_path, source):
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "learner" / "w.py").write_text('"""Reads weights.latest."""\nlog.info("weights.latest")\n'
                                               'row = {"status": "ok", "curriculum": 1}\nrow.get("status")\n' + source)
    assert len(key_literals(tmp_path, kv_keys())) == 1
