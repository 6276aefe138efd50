"""The folders are the architecture: imports run one way, and names are defined once.

- Layer order (DESIGN.md): schemas -> bus -> sandbox_workers -> producers / learner /
  rollout_workers / verifier_workers -> scheduler -> rlbus. A module may import its own
  package and any package of a LOWER layer; never a higher one, and never a sibling role
  (no role imports another role's internals). Every import counts, including lazy ones
  inside functions and under TYPE_CHECKING.
- Inside `rlbus/`, the rooms run one way too (RLBUS_ROOMS, rlbus/__init__.py): the neutral
  leaves `rlbus.log` and `rlbus.natsauth` -> `rlbus.model` / `rlbus.tracking` /
  `rlbus.report` -> `rlbus.run` -> `rlbus.commands` -> `rlbus.cli` -> `rlbus.entrypoint`.
  A module may import its own room and lower rooms, never a higher or sibling one: so
  `rlbus.run`, `rlbus.model`, `rlbus.tracking` and `rlbus.report` never import
  `rlbus.commands` or `rlbus.cli`, and every rlbus module belongs to a room.
- Every KV key of the control plane is a constant in `bus/kv.py`; no module outside
  `bus/` spells one as a string literal (docstrings and log event names aside).
- Every telemetry counter and stage name is a constant in `bus/telemetry.py`; no module of
  `rlbus/` or `bench/` spells one as a literal where heartbeats are read.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from bus import kv, telemetry
from bus.subjects import ROLES as ROLE_NAMES

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "schemas": 0,
    "bus": 1,
    "sandbox_workers": 2,
    "producers": 3,
    "learner": 3,
    "rollout_workers": 3,
    "verifier_workers": 3,
    "scheduler": 4,
    "rlbus": 5,
}


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
    assert layer_violations(tmp_path) == [
        "learner/x.py:2 learner -> rlbus",
        "verifier_workers/y.py:1 verifier_workers -> producers",
    ]


RLBUS_ROOMS = {
    "rlbus.log": 0,
    "rlbus.natsauth": 0,
    "rlbus.model": 1,
    "rlbus.tracking": 1,
    "rlbus.report": 1,
    "rlbus.deploy": 1,
    "rlbus.run": 2,
    "rlbus.commands": 3,
    "rlbus.cli": 4,
    "rlbus.entrypoint": 5,
}
"""Room of the rlbus application -> its level; `rlbus/__init__.py` (a docstring) is no room."""


def _room(module: str) -> str | None:
    """The room of a dotted rlbus module name (`rlbus.run.folder` -> `rlbus.run`), else None."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rlbus" and len(parts) > 1 else None


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in a module, relative ones resolved, including
    `from rlbus import x` as `rlbus.x`."""
    out = []
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out += [
                (node.lineno, f"{name}.{a.name}" if name == "rlbus" or not node.module else name) for a in node.names
            ]
    return out


def room_violations(root: Path) -> list[str]:
    """`file:line room -> other` for every upward or sideways import between rlbus rooms, and
    `file: no room` for a module that belongs to none."""
    bad = []
    for path in sorted((root / "rlbus").rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        room = _room(module)
        if module == "rlbus":
            continue
        if room not in RLBUS_ROOMS:
            bad.append(f"{rel}: no room (add it to RLBUS_ROOMS and rlbus/__init__.py)")
            continue
        for line, name in imported_modules(path, module):
            other = _room(name)
            if other is None or other == room:
                continue
            if other not in RLBUS_ROOMS or RLBUS_ROOMS[other] >= RLBUS_ROOMS[room]:
                bad.append(f"{rel}:{line} {room} -> {other}")
    return bad


def test_rlbus_rooms_run_one_way():
    bad = room_violations(ROOT)
    assert not bad, "imports between rlbus rooms that run the wrong way (see rlbus/__init__.py):\n" + "\n".join(bad)


def test_the_room_check_fires(tmp_path):
    """The room check can fail: a run module importing a command or the CLI, a sibling room,
    `from rlbus import cli`, a relative import upwards, and a module outside every room."""
    for room in ("run", "model", "commands", "report"):
        (tmp_path / "rlbus" / room).mkdir(parents=True)
    (tmp_path / "rlbus" / "run" / "a.py").write_text("def f():\n    from rlbus.commands.status import main\n")
    (tmp_path / "rlbus" / "run" / "b.py").write_text("from rlbus import cli\nfrom rlbus.run.folder import RunFolder\n")
    (tmp_path / "rlbus" / "model" / "c.py").write_text("from rlbus.report import plots\n")
    (tmp_path / "rlbus" / "report" / "d.py").write_text("from ..commands import report\nfrom . import plots\n")
    (tmp_path / "rlbus" / "commands" / "ok.py").write_text(
        "from rlbus.run.folder import RunFolder\nfrom rlbus.model import tiny_model\nimport rlbus.log\n"
    )
    (tmp_path / "rlbus" / "stray.py").write_text("import os\n")
    assert room_violations(tmp_path) == [
        "rlbus/model/c.py:1 rlbus.model -> rlbus.report",
        "rlbus/report/d.py:1 rlbus.report -> rlbus.commands",
        "rlbus/run/a.py:2 rlbus.run -> rlbus.commands",
        "rlbus/run/b.py:1 rlbus.run -> rlbus.cli",
        "rlbus/stray.py: no room (add it to RLBUS_ROOMS and rlbus/__init__.py)",
    ]


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
                if (
                    isinstance(body, list)
                    and body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                ):
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
                hit = wanted.get(n.value) or next(
                    (k for v, k in wanted.items() if "." in v and v.endswith(".") and n.value.startswith(v)), None
                )
                if hit and ("." in n.value or id(n) in kv_args):
                    bad.append(f"{path.relative_to(root)}:{n.lineno} {n.value!r} (use bus.kv.{hit})")
    return bad


def test_kv_keys_are_defined_only_in_bus():
    keys = kv_keys()
    assert {
        "WEIGHTS_LATEST",
        "LEARNER_PROGRESS",
        "DURATIONS",
        "RELEASE_LATEST",
        "LEARNER_OVERRIDES",
        "LEARNER_LEASE",
        "EVAL_BASELINE",
        "DLQ_REPLAYED",
    } <= set(keys)
    bad = key_literals(ROOT, keys)
    assert not bad, "KV key literals outside bus/ (import the constant from bus.kv):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        'latest = get_json(js, reg, "weights.latest")\n',
        'KEY = "dlq.replayed." + str(seq)\n',
        'plan = await get_json(js, reg, "curriculum")\n',
        'entry = await self._kv.get("status")\n',
    ],
)
def test_the_key_check_fires(tmp_path, source):
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "learner" / "w.py").write_text(
        '"""Reads weights.latest."""\nlog.info("weights.latest")\n'
        'row = {"status": "ok", "curriculum": 1}\nrow.get("status")\n' + source
    )
    assert len(key_literals(tmp_path, kv_keys())) == 1


HEARTBEAT_RECEIVER = re.compile(r"values|counters|beats|tele", re.IGNORECASE)
"""An expression that holds heartbeat counters (`m.values`, `session.counters`, `beats`, `tele0`, ...)."""
READER_METHODS = {"role_sum", "role_sums", "role_total", "gain"}
"""Methods of `bus.telemetry.Heartbeats` (and the launcher's Monitor) whose arguments name a counter."""


def _counter_uses(tree: ast.AST) -> set[int]:
    """ids of the nodes under which a string names a telemetry counter: the key of a read
    (`x[k]`, `x.get(k)`, `k in x`) on a heartbeat receiver, an argument of a reader method,
    and the values of a role-keyed table (`{"sampler": "published", ...}`)."""
    uses: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and HEARTBEAT_RECEIVER.search(ast.unparse(node.value)):
            uses.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            on_beats = HEARTBEAT_RECEIVER.search(ast.unparse(node.func.value))
            if node.func.attr in READER_METHODS or (node.func.attr in {"get", "pop", "setdefault"} and on_beats):
                uses |= {id(a) for a in node.args}
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and HEARTBEAT_RECEIVER.search(ast.unparse(node.comparators[0]))
        ):
            uses.add(id(node.left))
        elif isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value in ROLE_NAMES for k in node.keys
        ):
            for v in node.values:  # a table's cells: a name, or a tuple/list of names
                uses |= {id(v)} | ({id(e) for e in v.elts} if isinstance(v, (ast.Tuple, ast.List)) else set())
    return uses


def telemetry_literals(root: Path, names: frozenset[str] = telemetry.COUNTERS) -> list[str]:
    """`file:line` of every telemetry counter name spelled as a literal where heartbeats are
    read in `rlbus/` or `bench/` (see `_counter_uses`)."""
    bad = []
    for pkg in ("rlbus", "bench"):
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            uses = _counter_uses(tree)
            for node in ast.walk(tree):
                if id(node) in uses and isinstance(node, ast.Constant) and node.value in names:
                    bad.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r} (use bus.telemetry)")
    return bad


def test_telemetry_names_are_defined_only_in_bus_telemetry():
    assert {
        telemetry.PUBLISHED,
        telemetry.TRAJECTORIES,
        telemetry.REWARDS,
        telemetry.SAMPLES_TRAINED,
        telemetry.CPU_SECONDS,
        telemetry.METRICS_PORT,
    } <= telemetry.COUNTERS
    assert {s.counter for s in telemetry.STAGES} <= telemetry.COUNTERS
    assert {s.role for s in telemetry.STAGES} <= set(ROLE_NAMES)
    assert list(telemetry.STAGE_COUNTER) == ["sampler", "rollout", "verifier", "learner"]
    bad = telemetry_literals(ROOT)
    assert not bad, "telemetry counter names spelled outside bus/telemetry.py (import the constant):\n" + "\n".join(bad)


BENIGN = (
    '"""Counts published tasks and samples_trained."""\nlog.info("published", n=1)\n'
    'row = {"trajectories": s.get("trajectories"), "tasks": 3}\nstep = progress.get("samples_trained")\n'
    'mean = wv.metrics["reward_mean"]\nself._count("evals", 2)\n'
)


@pytest.mark.parametrize(
    "source",
    [
        'n = m.values.get("published", 0)\n',
        'cpu = session.counters["cpu_seconds"]\n',
        'port = "metrics_port" in m.values\n',
        'tokens = mon.role_sum("rollout", "tokens")\n',
        'STAGE_COUNTER = {"sampler": "published"}\n',
        'STAGES = {"sandbox": ("execs", "execs")}\n',
        'x = tele0.get(role, {}).get("trajectories")\n',
    ],
)
def test_the_telemetry_name_check_fires(tmp_path, source):
    for pkg in ("rlbus", "bench"):
        (tmp_path / pkg).mkdir()
    (tmp_path / "bench" / "ok.py").write_text(BENIGN)
    (tmp_path / "rlbus" / "w.py").write_text(BENIGN + source)
    bad = telemetry_literals(tmp_path)
    assert bad and all(b.startswith("rlbus/w.py:7 ") for b in bad), bad
