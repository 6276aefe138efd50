"""The test tiers stay by cost: `make test` starts exactly one `rlbus up` (the shared smoke
run, tests/smoke_run.py); every other test that starts one is marked `e2e`, `slow`,
`docker` or `vllm`, or is in REFUSED (its `up` is refused before any role starts).

Read from the tests' source (`ast`): a test starts `rlbus up` when its body, or a module
function it calls, holds a list with "rlbus.cli" then "up", calls `run_case` (a fault run),
or calls the launcher's `up` (imported from the launcher module)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
COSTLY = {"e2e", "slow", "docker", "vllm"}
REFUSED = {
    "test_demo_habits.py::test_rlbus_up_refuses_a_bad_share_before_anything_starts",
    "test_faults.py::test_a_model_path_that_is_not_a_model_folder_is_refused_before_anything_starts",
    "test_faults.py::test_up_with_the_docker_backend_and_no_image_is_refused_before_anything_starts",
    "test_sandbox_fail_closed.py::test_up_stops_before_sft_without_bwrap",
    "test_sharded_learner.py::test_up_refuses_too_many_ranks_before_anything_starts",
    "test_tracking.py::test_a_missing_tracking_package_names_the_extra",
    "test_vllm_cpu.py::test_up_without_vllm_stops_before_anything_starts",
}
"""`rlbus up` runs that must stop before any role starts (each test asserts the refusal)."""


def _marks(decorators: list[ast.expr], funcs: dict[str, ast.AST] | None = None) -> set[str]:
    """Names X of `pytest.mark.X` (called or not) among decorators or a `pytestmark` value; a
    decorator that is a module function (`@docker_only`) counts with the marks it applies."""
    out = set()
    for node in decorators:
        if funcs and isinstance(node, ast.Name) and node.id in funcs:
            node = funcs[node.id]
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                out.add(sub.attr)
    return out


def _starts_up_itself(fn: ast.AST, launcher_up: set[str]) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, (ast.List, ast.Tuple)):
            consts = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(a == "rlbus.cli" and b == "up" for a, b in zip(consts, consts[1:])):
                return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ({"run_case"} | launcher_up)
        ):
            return True
    return False


def up_starters(path: Path) -> dict[str, set[str]]:
    """{test name: its marks} for each test of the file that starts `rlbus up` (see the module doc)."""
    tree = ast.parse(path.read_text())
    launcher_up = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("launcher")
        for a in node.names
        if a.name == "up"
    }
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks |= _marks([node.value])
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    starters = {name for name, fn in funcs.items() if _starts_up_itself(fn, launcher_up)}
    grew = True
    while grew:  # a module function that calls a starter is a starter
        calls = {
            name: {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            for name, fn in funcs.items()
        }
        new = {name for name, called in calls.items() if called & starters} - starters
        starters |= new
        grew = bool(new)
    return {
        name: module_marks | _marks(funcs[name].decorator_list, funcs) for name in starters if name.startswith("test_")
    }


def test_only_the_smoke_run_starts_rlbus_up_in_make_test():
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        for name, marks in up_starters(path).items():
            if not marks & COSTLY and f"{path.name}::{name}" not in REFUSED:
                unmarked.append(f"{path.name}::{name}")
    assert not unmarked, (
        "these tests start `rlbus up` in `make test`; mark them @pytest.mark.e2e (or read the "
        f"shared `smoke_run` fixture instead): {unmarked}"
    )
    assert "smoke_run" in (TESTS / "conftest.py").read_text()


def test_the_guard_sees_an_unmarked_up_a_marked_one_and_a_fault_run(tmp_path):
    src = tmp_path / "test_x.py"
    src.write_text(
        "import pytest, subprocess, sys\n"
        "def _up(cfg):\n    return subprocess.run([sys.executable, '-m', 'rlbus.cli', 'up', cfg])\n"
        "def test_a():\n    _up('c')\n"
        "@pytest.mark.e2e\ndef test_b():\n    _up('c')\n"
        "def test_c():\n    run_case(None, None, 0)\n"
        "def test_d():\n    subprocess.run([sys.executable, '-m', 'rlbus.cli', 'report', 'x'])\n"
    )
    assert up_starters(src) == {"test_a": set(), "test_b": {"e2e"}, "test_c": set()}


def test_every_refused_up_still_exists_and_starts_up():
    for entry in REFUSED:
        file, name = entry.split("::")
        assert name in up_starters(TESTS / file), f"{entry} no longer starts `rlbus up`: drop it from REFUSED"
