"""Repository tasks (producers side): the committed cache, the mutation operators, the
builder end to end on a local package, the fixtures, and `rlbus tasks list|show --domain
repo` as a real subprocess. Suites run in the bubblewrap process sandbox; those tests are
skipped, with the reason, where bwrap cannot isolate. Nothing here reaches the network.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from producers import repo_cache, repo_fixtures
from producers.repo_build import BuildLimits, build, is_test_file
from producers.repo_mutate import Site, apply_site, apply_unified_diff, find_sites, unified_diff
from schemas.repo_task import RepoTask

RLBUS = Path(sys.executable).with_name("rlbus")


def _bwrap_status() -> tuple[bool, str]:
    from sandbox_workers.base import SandboxRefused
    from sandbox_workers.process import ProcessSandbox

    try:
        with ProcessSandbox(isolation="bwrap") as sbx:
            sbx.start()
            return sbx.execute(["python3", "-c", "pass"], timeout=20).exit_code == 0, "python3 fails in bwrap"
    except SandboxRefused as exc:
        return False, str(exc)[:200]


BWRAP_OK, BWRAP_WHY = _bwrap_status()
needs_bwrap = pytest.mark.skipif(not BWRAP_OK, reason=f"no bubblewrap sandbox here: {BWRAP_WHY}")


def rlbus(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(RLBUS), *argv], capture_output=True, text=True, timeout=120, env=env)


# -- the committed cache -----------------------------------------------------------------
def test_committed_cache_loads_with_matching_hashes():
    tasks = repo_cache.list_tasks()  # raises CacheCorrupt on any hash mismatch
    index = repo_cache.read_index()
    assert len(tasks) >= 20
    packages = {t.source for t in tasks}
    assert len(packages) >= 2 and all(s.startswith("sdist:") for s in packages)
    licences = repo_cache.package_licences()
    assert {s.removeprefix("sdist:") for s in packages} <= set(licences)
    assert set(licences.values()) <= {"MIT", "BSD", "Apache-2.0", "ISC", "PSF"}
    for t in tasks:
        assert index["tasks"][t.task_id]["content_hash"] == t.content_hash()
        assert t.target_tests and t.regression_tests and t.gold_patch.startswith("--- a/")
        assert {n.split("::")[0] for n in t.target_tests} == set(t.hidden_files)
        assert not set(t.hidden_files) & set(t.files)
        assert "@@" not in t.issue and t.gold_patch not in t.issue
        assert any(p.upper().startswith(("LICEN", "COPYING")) for p in t.files)
    total = sum(p.stat().st_size for p in repo_cache.default_cache_dir().iterdir())
    assert total < 2_000_000


def test_cache_roundtrip_missing_and_corrupt(tmp_path):
    task = repo_fixtures.fixture_tasks()["fixture-clamp"]
    assert repo_cache.list_tasks(tmp_path) == []
    repo_cache.save_task(task, tmp_path)
    assert repo_cache.load_task("fixture-clamp", tmp_path) == task
    with pytest.raises(KeyError, match="rlbus tasks build repo"):
        repo_cache.load_task("nope", tmp_path)
    entry = repo_cache.read_index(tmp_path)["tasks"]["fixture-clamp"]
    import lzma

    (tmp_path / entry["file"]).write_bytes(lzma.compress(task.to_json().replace("clamp(15", "clamp(16").encode()))
    with pytest.raises(repo_cache.CacheCorrupt):
        repo_cache.load_task("fixture-clamp", tmp_path)
    assert repo_cache.load_task("fixture-stack", tmp_path).source == "fixture:stack"  # fixtures resolve by id


# -- mutation operators and diffs --------------------------------------------------------
SRC = """X = 1 < 2


def f(xs, n):
    # a comment that must survive
    if n > 0:
        return xs[1]
    elif n == 0:
        return max(xs, n)
    for i in range(3):
        pass
    return "é" in xs
"""


def _mutants(op: str) -> list[str]:
    return [apply_site(SRC, s) for s in find_sites(SRC) if s.op == op]


def test_mutation_operators_edit_one_site_as_text():
    sites = find_sites(SRC)
    assert all(s.lineno > 3 for s in sites)  # module-level `X = 1 < 2` is never mutated
    assert "    if n <= 0:\n" in _mutants("flip_comparison")[0]
    assert {'    return "é" not in xs\n' in m for m in _mutants("flip_comparison")} == {True, False}
    offs = _mutants("off_by_one")
    assert any("xs[2]" in m for m in offs) and any("range(4)" in m for m in offs) and any("n == 1" in m for m in offs)
    drops = _mutants("drop_branch")
    assert any("    if n > 0:\n        pass\n    elif" in m for m in drops)
    assert any("elif" not in m and "max(xs, n)" not in m for m in drops)
    assert _mutants("swap_args") == [SRC.replace("max(xs, n)", "max(n, xs)")]
    for op in ("flip_comparison", "off_by_one", "drop_branch", "swap_args"):
        for m in _mutants(op):
            assert "# a comment that must survive" in m and m != SRC
            assert apply_unified_diff({"m.py": m}, unified_diff({"m.py": m}, {"m.py": SRC})) == {"m.py": SRC}
    with pytest.raises(ValueError):
        apply_site(SRC, Site("flip_comparison", 99, 0, 99, 1, "nowhere"))


def test_unified_diff_roundtrip_and_context_check():
    old = {"a.py": "x = 1\ny = 2", "b.py": "keep\n"}
    new = {"a.py": "x = 1\ny = 3\n", "c.py": "new\n", "b.py": "keep\n"}
    diff = unified_diff(old, new)
    assert diff.startswith("--- a/a.py\n+++ b/a.py\n") and "\\ No newline at end of file" in diff
    assert apply_unified_diff(old, diff) == new
    with pytest.raises(ValueError, match="context does not match"):
        apply_unified_diff({**old, "a.py": "x = 9\ny = 2"}, diff)


# -- the fixtures ------------------------------------------------------------------------
@needs_bwrap
def test_fixtures_gold_resolves_and_partial_is_partial():
    from producers.repo_pytest import SandboxedSuite, check_patch

    tasks = repo_fixtures.fixture_tasks()
    assert len(tasks) >= 3 and all(t.source.startswith("fixture:") for t in tasks.values())
    with SandboxedSuite({}) as suite:
        for task in tasks.values():
            before, after = check_patch(task, task.gold_patch, suite, regression=True)
            assert set(before.failing()) == set(task.target_tests), (task.task_id, before.log_tail)
            assert set(after.passing()) == set(task.target_tests + task.regression_tests), after.log_tail
        partial = tasks["fixture-partial"]
        _, after = check_patch(partial, repo_fixtures.partial_patch("fixture-partial"), suite)
        fixed = set(repo_fixtures.partial_fixes("fixture-partial"))
        assert set(after.passing()) == fixed and 0 < len(fixed) < len(partial.target_tests)


def _gold_check(tasks: list[RepoTask]) -> None:
    from producers.repo_pytest import SandboxedSuite, check_patch

    by_source: dict[str, list[RepoTask]] = {}
    for t in tasks:
        by_source.setdefault(t.source, []).append(t)
    for group in by_source.values():
        with SandboxedSuite({}) as suite:
            for task in group:
                before, after = check_patch(task, task.gold_patch, suite)
                assert set(before.failing()) == set(task.target_tests), (task.task_id, before.log_tail)
                assert set(after.passing()) == set(task.target_tests), (task.task_id, after.log_tail)


@pytest.mark.e2e
@needs_bwrap
def test_every_cached_task_gold_patch_resolves():
    """Unpatched, every target test fails; with the gold patch, every one passes (~20 s)."""
    _gold_check(repo_cache.list_tasks())


# -- the builder, end to end on a local package --------------------------------------------
TINY_SRC = """def clip(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def window(xs, n):
    return [xs[i:i + n] for i in range(len(xs) - n + 1)]
"""
TINY_TESTS = """from tiny import clip, window


def test_clip_low():
    assert clip(-5, 0, 9) == 0


def test_clip_high():
    assert clip(50, 0, 9) == 9


def test_clip_inside():
    assert clip(4, 0, 9) == 4


def test_window():
    assert window([1, 2, 3], 2) == [[1, 2], [2, 3]]
"""


@needs_bwrap
def test_builder_end_to_end_on_a_local_package(tmp_path):
    pkg = tmp_path / "tiny-0.1"
    (pkg / "tiny").mkdir(parents=True)
    (pkg / "tests").mkdir()
    (pkg / "tiny" / "__init__.py").write_text(TINY_SRC)
    (pkg / "tests" / "test_tiny.py").write_text(TINY_TESTS)
    (pkg / "tests" / "test_more.py").write_text(
        "from tiny import clip\n\n\ndef test_same():\n    assert clip(1, 1, 1) == 1\n"
    )
    (pkg / "LICENSE").write_text("MIT License\n\nPermission is hereby granted, free of charge...\n")
    (pkg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: tiny\nVersion: 0.1\nLicense: MIT\n")
    out = tmp_path / "cache"
    [report] = build([str(pkg)], out, BuildLimits(max_per_package=3, max_tries=10, timeout=60))
    assert not report.skipped and report.licence == "MIT" and report.spec == "tiny==0.1"
    tasks = repo_cache.list_tasks(out)
    assert 1 <= len(tasks) <= 3 and [t.task_id for t in tasks] == sorted(report.tasks)
    assert repo_cache.package_licences(out) == {"tiny==0.1": "MIT"}
    for t in tasks:
        assert t.source == "sdist:tiny==0.1"
        assert all(is_test_file(p) for p in t.hidden_files)
        assert set(t.files) | set(t.hidden_files) >= {"tiny/__init__.py", "LICENSE", "tests/test_tiny.py"}
        assert apply_unified_diff(t.files, t.gold_patch)["tiny/__init__.py"] == TINY_SRC
        assert "Regression in tiny 0.1" in t.issue and "It fails with:" in t.issue
    _gold_check(tasks)


@needs_bwrap
def test_builder_skips_a_package_whose_suite_fails(tmp_path):
    pkg = tmp_path / "bad"
    pkg.mkdir()
    (pkg / "bad.py").write_text("def one():\n    return 2\n")
    (pkg / "test_bad.py").write_text("from bad import one\n\n\ndef test_one():\n    assert one() == 1\n")
    (pkg / "LICENSE").write_text("BSD 3-Clause License\n")
    [report] = build([str(pkg)], tmp_path / "cache", BuildLimits(timeout=60))
    assert "does not pass" in report.skipped and "test_bad.py::test_one" in report.skipped
    assert repo_cache.list_tasks(tmp_path / "cache") == []


# -- the CLI, as a real subprocess -------------------------------------------------------
def test_cli_list_json_and_table():
    p = rlbus("tasks", "list", "--domain", "repo", "--json")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) >= 20 and all(set(r) == {"task_id", "source", "files"} for r in rows)
    assert all(isinstance(r["files"], int) and r["files"] > 0 for r in rows)
    table = rlbus("tasks", "list", "--domain", "repo")
    assert table.returncode == 0 and rows[0]["task_id"] in table.stdout and "licences:" in table.stdout


def test_cli_show_json_shapes():
    task_id = repo_cache.list_tasks()[0].task_id
    p = rlbus("tasks", "show", "--domain", "repo", "--task-id", task_id, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    task = repo_cache.load_task(task_id)
    assert set(out) == {"task_id", "issue", "files", "gold_patch"}
    assert out["files"] == sorted(task.files) and out["gold_patch"] is None and out["issue"] == task.issue
    full = json.loads(
        rlbus("tasks", "show", "--domain", "repo", "--task-id", task_id, "--json", "--files", "--gold-patch").stdout
    )
    assert full["files"] == task.files and full["gold_patch"] == task.gold_patch
    assert not set(full["files"]) & set(task.hidden_files)
    text = rlbus("tasks", "show", "--domain", "repo", "--task-id", task_id, "--gold-patch")
    assert text.returncode == 0 and "--- issue ---" in text.stdout and "--- gold patch ---" in text.stdout


def test_cli_empty_cache_and_unknown_id_name_the_build_command(tmp_path):
    p = rlbus("tasks", "list", "--domain", "repo", "--cache-dir", str(tmp_path))
    assert p.returncode == 1 and "rlbus tasks build repo --from-sdist" in p.stderr
    p = rlbus("tasks", "show", "--domain", "repo", "--task-id", "nope", "--cache-dir", str(tmp_path))
    assert p.returncode == 2 and "rlbus tasks build repo" in p.stderr
    p = rlbus(
        "tasks", "show", "--domain", "repo", "--task-id", "fixture-partial", "--json", "--cache-dir", str(tmp_path)
    )
    assert p.returncode == 0 and json.loads(p.stdout)["task_id"] == "fixture-partial"
    assert "--from-sdist" in rlbus("tasks", "build", "--help").stdout
