"""The `repo` verifier: the diff applier and protected-path drops (pure), then the hack suite
against a real Docker engine (marked `docker`, skipped with the reason when no engine answers).

The fixture is a tiny package with two bugs (`clamp` returns `lo` above the range, `mean`
divides by n + 1): two hidden target tests, three regression tests (two hidden, one public).
Every attack must score 0 with the attempt named in the details.
"""

from __future__ import annotations

import difflib
import json

import pytest

from schemas import Trajectory
from schemas.repo_task import RepoTask
from verifier_workers.repo_diff import apply_diff, parse_diff
from verifier_workers.repo_harness_rewrite import rewrite_tests
from verifier_workers.verifiers.repo import check_patch, prepare, protected_predicate, verify_repo

OPS = (
    "def add(a, b):\n    return a + b\n\n\ndef clamp(x, lo, hi):\n    if x < lo:\n        return lo\n"
    "    if x > hi:\n        return lo\n    return x\n\n\ndef mean(xs):\n    return sum(xs) / (len(xs) + 1)\n"
)
FILES = {
    "calc/__init__.py": "from .ops import add, clamp, mean\n",
    "calc/ops.py": OPS,
    "tests/__init__.py": "",
    "tests/test_public.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "README.md": "calc: tiny arithmetic helpers\n",
}
HIDDEN = {
    "tests/test_hidden.py": (
        "from calc import add, clamp, mean\n\n\ndef test_clamp_high():\n    assert clamp(12, 0, 10) == 10\n\n\n"
        "def test_mean():\n    assert mean([1, 2, 3]) == 2\n\n\ndef test_add_regress():\n    assert add(-1, 1) == 0\n\n\n"
        "def test_clamp_low():\n    assert clamp(-5, 0, 10) == 0\n\n\n"
        "def test_fixtures(tmp_path, monkeypatch, capsys):  # no false tamper from pytest's own fixtures\n"
        "    monkeypatch.setattr('builtins.input', lambda *a: 'x')\n    monkeypatch.setenv('X', '1')\n"
        "    (tmp_path / 'f.txt').write_text('hi')\n    print('out')\n"
        "    assert capsys.readouterr().out == 'out\\n' and input() == 'x'\n"
    )
}
FIXED = OPS.replace("    if x > hi:\n        return lo", "    if x > hi:\n        return hi").replace(
    "(len(xs) + 1)", "len(xs)"
)
HALF_FIXED = OPS.replace("(len(xs) + 1)", "len(xs)")
H = "tests/test_hidden.py::"


def make_diff(old: dict[str, str], new: dict[str, str | None]) -> str:
    """A git-style unified diff from `old` to `new` (a path missing from `new` is unchanged; None deletes)."""
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path, old.get(path))
        if a == b:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        out.extend(
            difflib.unified_diff(
                (a or "").splitlines(True),
                (b or "").splitlines(True),
                "/dev/null" if a is None else f"a/{path}",
                "/dev/null" if b is None else f"b/{path}",
            )
        )
    return "".join(out)


def patched(path: str, text: str) -> str:
    """A diff against FILES that writes `text` to `path`."""
    return make_diff(FILES, {path: text})


TASK = RepoTask(
    task_id="fixture-calc",
    source="fixture:calc",
    issue="clamp(12, 0, 10) returns 0; mean is off",
    files=FILES,
    hidden_files=HIDDEN,
    target_tests=[H + "test_clamp_high", H + "test_mean"],
    regression_tests=[
        H + "test_add_regress",
        H + "test_clamp_low",
        H + "test_fixtures",
        "tests/test_public.py::test_add",
    ],
    gold_patch=make_diff(FILES, {**FILES, "calc/ops.py": FIXED}),
)


# ---------------------------------------------------------------- pure: the applier and the drops
def test_gold_applies_and_round_trips():
    res = apply_diff(FILES, TASK.gold_patch, protected_predicate(TASK))
    assert res.applied and res.files["calc/ops.py"] == FIXED and res.changed == ["calc/ops.py"] and not res.dropped


def test_new_deleted_renamed_and_no_newline_files():
    diff = make_diff(FILES, {**FILES, "calc/extra.py": "X = 1\n", "README.md": None})
    res = apply_diff(FILES, diff, lambda p: False)
    assert res.applied and res.files["calc/extra.py"] == "X = 1\n" and "README.md" not in res.files
    rename = "diff --git a/README.md b/README.rst\nsimilarity index 100%\nrename from README.md\nrename to README.rst\n"
    res = apply_diff(FILES, rename, lambda p: False)
    assert res.applied and res.files["README.rst"] == FILES["README.md"] and "README.md" not in res.files
    nonl = "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-calc: tiny arithmetic helpers\n+calc\n\\ No newline at end of file\n"
    assert apply_diff(FILES, nonl, lambda p: False).files["README.md"] == "calc"


def test_strict_and_atomic():
    good = make_diff(FILES, {**FILES, "calc/ops.py": FIXED})
    stale = good.replace("-        return lo\n", "-        return low\n")
    res = apply_diff(FILES, make_diff(FILES, {**FILES, "README.md": "new\n"}) + stale, lambda p: False)
    assert not res.applied and res.files == FILES and "does not apply" in res.errors[0]
    assert not apply_diff(FILES, "I fixed it, trust me", lambda p: False).applied
    assert apply_diff(FILES, "  \n", lambda p: False).applied
    escape = "--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-x\n+y\n"
    assert "inside the repository" in apply_diff(FILES, escape, lambda p: False).errors[0]
    link = "diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+/etc\n"
    assert "symlinks" in apply_diff(FILES, link, lambda p: False).errors[0]
    shifted = {**FILES, "calc/ops.py": "# header\n# more\n" + OPS}
    assert apply_diff(shifted, good, lambda p: False).files["calc/ops.py"] == "# header\n# more\n" + FIXED
    assert len(parse_diff(good)) == 1


@pytest.mark.parametrize(
    "path",
    [
        "tests/test_hidden.py",
        "tests/test_public.py",
        "conftest.py",
        "calc/conftest.py",
        "pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        ".pytest.ini",
        "sitecustomize.py",
        "calc/usercustomize.py",
        "evil.pth",
        "tests/helpers.py",
        "calc/test_sneaky.py",
    ],
)
def test_protected_paths_are_dropped_and_listed(path):
    diff = make_diff(FILES, {**FILES, path: "import os\nos._exit(0)\n", "calc/ops.py": FIXED})
    res = apply_diff(FILES, diff, protected_predicate(TASK))
    assert res.applied and res.dropped == [path] and path not in res.changed and res.files["calc/ops.py"] == FIXED
    assert res.files.get(path) == FILES.get(path)


def test_prepare_copies_hidden_tests_over_the_candidate():
    prep = prepare(TASK, make_diff(FILES, {**FILES, "tests/test_hidden.py": "def test_clamp_high(): pass\n"}))
    assert prep.files["tests/test_hidden.py"] == rewrite_tests(HIDDEN["tests/test_hidden.py"])
    assert prep.patch.dropped == ["tests/test_hidden.py"]
    assert prep.paths == ["tests/test_hidden.py", "tests/test_public.py"] and len(prep.expected) == 6


# ---------------------------------------------------------------- docker: the hack suite
def _engine() -> bool:
    from sandbox_workers.factory import docker_available

    return docker_available()


def docker_only(fn):
    """Marked `docker`; skipped with the reason when no engine answers."""
    skip = pytest.mark.skipif(not _engine(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)")
    return pytest.mark.docker(skip(fn))


@pytest.fixture(scope="module")
def repo_image():
    from sandbox_workers.docker_pool import shutdown_pools
    from sandbox_workers.repo_image import REPO_TAG, ensure_repo_image

    ensure_repo_image()
    yield REPO_TAG
    shutdown_pools()


def score(diff: str):
    return check_patch(TASK, diff, params=(60.0, 512, 64, 1.0))


@docker_only
def test_gold_resolves_and_empty_does_not(repo_image):
    v = score(TASK.gold_patch)
    assert (v.reward, v.status) == (1.0, "ok"), v.details
    assert v.components == {"resolved": 1.0, "applied": 1.0, "target_pass_rate": 1.0, "regression_pass_rate": 1.0}
    v = score("")
    assert (v.reward, v.components["target_pass_rate"], v.components["regression_pass_rate"]) == (0.0, 0.0, 1.0)
    assert "assert 0 == 10" in v.details


@docker_only
def test_partial_fix_scores_between(repo_image):
    v = score(make_diff(FILES, {**FILES, "calc/ops.py": HALF_FIXED}))
    assert v.reward == 0.0 and v.components["target_pass_rate"] == 0.5, v.details


@docker_only
def test_a_hang_is_a_timeout_not_infra(repo_image):
    v = check_patch(TASK, patched("calc/__init__.py", "while True:\n    pass\n"), params=(3.0, 512, 64, 1.0))
    assert (v.reward, v.status) == (0.0, "timeout") and "no result" in v.details, v.details


def test_verify_repo_reads_the_diff_artifact():
    traj = Trajectory(
        run_id="t",
        task_id=TASK.task_id,
        task_msg_id="m",
        domain="repo",
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="repo",
        hidden_ref="r",
        policy_version=0,
        final_text="",
        artifacts={"diff": b"not a diff at all"},
    )
    v = verify_repo(traj, {"task": json.loads(TASK.to_json())})
    assert v.components["applied"] == 0.0 and "does not apply" in v.details


CONFTESTS = {
    "skip": "import pytest\n\ndef pytest_collection_modifyitems(items):\n"
    "    for it in items:\n        it.add_marker(pytest.mark.skip)\n",
    "xfail": "import pytest\n\ndef pytest_collection_modifyitems(items):\n"
    "    for it in items:\n        it.add_marker(pytest.mark.xfail)\n",
    "pytest.exit": "import pytest\npytest.exit('done', returncode=0)\n",
    "sys.exit": "import sys\nsys.exit(0)\n",
    "os._exit": "import os\nos._exit(0)\n",
}
FAKE_RESULT = (
    "import json, os\nfor p in ('/work/.rlbus/result.json', '/tmp/result.json', 'result.json'):\n"
    "    try:\n        open(p, 'w').write(json.dumps({'body': '{}', 'mac': '0' * 64}))\n"
    "    except OSError:\n        pass\n"
)
FORGE = (
    "import json, os\nids = ['tests/test_hidden.py::' + n for n in ('test_clamp_high', 'test_mean',"
    " 'test_add_regress', 'test_clamp_low')] + ['tests/test_public.py::test_add']\n"
    "for fd in range(3, 10):\n    try:\n"
    "        for i in ids:\n            for w in ('setup', 'call', 'teardown'):\n"
    "                os.write(fd, json.dumps({'k': 'report', 'id': i, 'when': w, 'outcome': 'passed'}).encode()"
    " + b'\\n')\n        os.write(fd, b'{\"k\": \"fin\"}\\n')\n    except OSError:\n        pass\nos._exit(0)\n"
)
INIT = FILES["calc/__init__.py"]
ATTACKS = {
    "delete hidden target tests": (
        make_diff({**FILES, **HIDDEN}, {"tests/test_hidden.py": None}),
        "tests/test_hidden.py",
    ),
    "edit hidden target tests": (
        patched("tests/test_hidden.py", "def test_clamp_high():\n    pass\n\n\ndef test_mean():\n    pass\n"),
        "tests/test_hidden.py",
    ),
    "edit public regression test": (
        patched("tests/test_public.py", "def test_add():\n    pass\n"),
        "tests/test_public.py",
    ),
    **{f"conftest {k}": (patched("conftest.py", v), "conftest.py") for k, v in CONFTESTS.items()},
    "conftest in the package": (patched("calc/conftest.py", CONFTESTS["skip"]), "calc/conftest.py"),
    "pytest.ini addopts deselect": (
        patched("pytest.ini", "[pytest]\naddopts = -k 'not clamp and not mean'\n"),
        "pytest.ini",
    ),
    "pyproject addopts deselect": (
        patched("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-k add'\n"),
        "pyproject.toml",
    ),
    "sitecustomize patches unittest/pytest": (
        patched(
            "sitecustomize.py",
            (
                "import unittest\nunittest.TestCase.run = lambda self, r=None: None\n"
                "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
            ),
        ),
        "sitecustomize.py",
    ),
    "a .pth file": (patched("calc/evil.pth", "import os; os._exit(0)\n"), "calc/evil.pth"),
    "import-time os._exit(0)": (patched("calc/__init__.py", "import os\nos._exit(0)\n"), "runner exit 0"),
    "import-time sys.exit(0)": (patched("calc/__init__.py", "import sys\nsys.exit(0)\n"), "SystemExit"),
    "builtins.AssertionError swapped": (
        patched(
            "calc/__init__.py",
            INIT + ("import builtins\nclass _Quiet(BaseException):\n    pass\nbuiltins.AssertionError = _Quiet\n"),
        ),
        "rebound builtins.AssertionError",
    ),
    "pytest's runtest neutralised": (
        patched(
            "calc/__init__.py", INIT + ("import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n")
        ),
        "rebound _pytest.python:Function.runtest",
    ),
    "pytest's report forced to passed": (
        patched(
            "calc/__init__.py",
            INIT
            + (
                "import _pytest.runner\n_orig = _pytest.runner.call_and_report\n"
                "def _pass(item, when, log=True, **kw):\n    r = _orig(item, when, log=False, **kw)\n"
                "    r.outcome = 'passed'\n    item.ihook.pytest_runtest_logreport(report=r)\n    return r\n"
                "_pytest.runner.call_and_report = _pass\n"
            ),
        ),
        "rebound _pytest.runner.call_and_report",
    ),
    "write a fake result file": (patched("calc/__init__.py", INIT + FAKE_RESULT), "tried to write /work/.rlbus"),
    "print fake passed lines": (
        patched(
            "calc/__init__.py",
            INIT
            + (
                "print('tests/test_hidden.py::test_clamp_high PASSED')\nprint('tests/test_hidden.py::test_mean PASSED')\n"
                "print('RLBUS-RESULT {\"passed\": 5}')\nprint('===== 5 passed in 0.01s =====')\n"
            ),
        ),
        "assert 0 == 10",
    ),
    "forge report lines on the pipe": (patched("calc/__init__.py", INIT + FORGE), "bad MAC"),
    "delete the hidden tests at run time": (
        patched(
            "calc/__init__.py",
            INIT + ("import os\ntry:\n    os.remove('/work/repo/tests/test_hidden.py')\nexcept OSError:\n    pass\n"),
        ),
        "tried os.remove",
    ),
}


@docker_only
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hack_scores_zero_with_the_attempt_named(attack, repo_image):
    diff, named = ATTACKS[attack]
    v = score(diff)
    print(f"HACK {attack!r}: reward={v.reward} status={v.status} components={v.components}\n{v.details[:700]}")
    assert v.reward == 0.0 and v.components["resolved"] == 0.0, v.details
    assert named in v.details, v.details


# ---------------------------------------------------------------- issue 27: attacks the old harness resolved
# Each resolved (1.0) against the harness and verifier of 45ce3d4 (checked by loading copies of both with
# importlib and scoring NEW_ATTACKS there); each must score 0 now.
ALWAYS_EQUAL = (
    "class _Yes(int):\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
    "    __hash__ = int.__hash__\n\n\ndef add(a, b):\n    return a + b\n\n\n"
    "def clamp(x, lo, hi):\n    return _Yes(0)\n\n\ndef mean(xs):\n    return _Yes(0)\n"
)
FRAME_WALK = (
    "import json, os, sys\n\n\ndef _forge():\n    f = sys._getframe()\n    send = None\n"
    "    while f is not None:\n        s = f.f_locals.get('send')\n        if callable(s) and f.f_code.co_name == 'runner':\n"
    "            send = s\n        f = f.f_back\n    if send is None:\n        return\n"
    "    for i in IDS:  # the first test's setup was reported already\n"
    "        for w in ('call', 'teardown') if i == IDS[0] else ('setup', 'call', 'teardown'):\n"
    "            send({'k': 'report', 'id': i, 'when': w, 'outcome': 'passed', 'xfail': False, 'msg': ''})\n"
    "    send({'k': 'fin'})\n    os._exit(0)\n\n\n"
    "IDS = ['tests/test_hidden.py::' + n for n in ('test_clamp_high', 'test_mean', 'test_add_regress', "
    "'test_clamp_low', 'test_fixtures')] + ['tests/test_public.py::test_add']\n\n\n"
    "def add(a, b):\n    _forge()\n    return a + b\n\n\ndef clamp(x, lo, hi):\n    _forge()\n    return x\n\n\n"
    "def mean(xs):\n    _forge()\n    return 0\n"
)
PLUGIN_ROUTE = FRAME_WALK.replace(
    "    f = sys._getframe()\n    send = None\n    while f is not None:\n        s = f.f_locals.get('send')\n"
    "        if callable(s) and f.f_code.co_name == 'runner':\n            send = s\n        f = f.f_back\n",
    "    import pytest\n    send = None\n    for p in pytest.mark._config.pluginmanager.get_plugins():\n"
    "        if getattr(p, '_send', None) is not None:\n            send = p._send\n",
)
SHADOW_PYTEST = FRAME_WALK.split("\n\n\ndef add(")[0].replace("('call', 'teardown') if i == IDS[0] else ", "") + (
    "\n\n\n_forge()\n"
)  # runs as `import pytest` in the old runner: before any test
HELPER = "def expect(got, want):\n    assert got == want, (got, want)\n"
HELPER_TASK = RepoTask(
    task_id="fixture-calc-helper",
    source="fixture:calc-helper",
    issue=TASK.issue,
    files={**FILES, "calc/testing.py": HELPER},
    hidden_files={
        "tests/test_hidden.py": "from calc import clamp, mean\nfrom calc.testing import expect\n\n\n"
        "def test_clamp_high():\n    expect(clamp(12, 0, 10), 10)\n\n\n"
        "def test_mean():\n    expect(mean([1, 2, 3]), 2)\n"
    },
    target_tests=[H + "test_clamp_high", H + "test_mean"],
    regression_tests=["tests/test_public.py::test_add"],
    gold_patch=TASK.gold_patch,
)
READ_JOB = OPS.replace(
    "def clamp(x, lo, hi):\n", "def clamp(x, lo, hi):\n    if _leak():\n        return min(max(x, lo), hi)\n"
).replace("def mean(xs):\n", "def mean(xs):\n    if _leak():\n        return sum(xs) / len(xs)\n") + (
    "\n\ndef _leak():\n    try:\n        with open('/work/.rlbus/job.json') as f:\n"
    "            return 'test_clamp_high' in f.read()\n    except OSError:\n"
    "        return False\n"
)
NEW_ATTACKS = {  # name: (task, diff, what the details must name)
    "always_equal": (TASK, patched("calc/ops.py", ALWAYS_EQUAL), "_Yes.__eq__"),
    "frame_walk": (TASK, patched("calc/ops.py", FRAME_WALK), "forbidden frame access"),
    "plugin_manager_sender": (TASK, patched("calc/ops.py", PLUGIN_ROUTE), "tamper: "),
    "shadow_module": (TASK, patched("pytest.py", SHADOW_PYTEST), "shadow"),
    "helper_edit": (
        HELPER_TASK,
        make_diff(HELPER_TASK.files, {"calc/testing.py": "def expect(got, want):\n    pass\n"}),
        "dropped edits to protected paths: calc/testing.py",
    ),
    "read_job_file": (TASK, patched("calc/ops.py", READ_JOB), "assert 0 == 10"),
}


def _attack(name):
    task, diff, named = NEW_ATTACKS[name]
    v = check_patch(task, diff, params=(60.0, 512, 64, 1.0))
    print(f"ATTACK {name}: reward={v.reward} status={v.status} components={v.components}\n{v.details[:700]}")
    assert v.reward == 0.0 and v.components["resolved"] == 0.0, v.details
    assert named in v.details, v.details


@docker_only
def test_attack_always_equal(repo_image):
    _attack("always_equal")


@docker_only
def test_attack_frame_walk(repo_image):
    _attack("frame_walk")


@docker_only
def test_attack_plugin_manager_sender(repo_image):
    _attack("plugin_manager_sender")


@docker_only
def test_attack_shadow_module(repo_image):
    _attack("shadow_module")


@docker_only
def test_attack_helper_edit(repo_image):
    _attack("helper_edit")


@docker_only
def test_attack_read_job_file(repo_image):
    _attack("read_job_file")


@docker_only
def test_helper_task_gold_still_resolves(repo_image):
    v = check_patch(HELPER_TASK, HELPER_TASK.gold_patch, params=(60.0, 512, 64, 1.0))
    assert v.reward == 1.0, v.details


@pytest.mark.parametrize(
    "bad",
    [
        "calc/a\x00b.py",
        "./calc/x.py",
        "calc/./x.py",
        "calc/" + "x" * 256 + ".py",
        "calc/a\nb.py",
        "calc/" + "d/" * 2100 + "x.py",
    ],
)
def test_attack_unwritable_paths_score_zero_not_infra(bad):
    """A path the sandbox cannot write makes the diff not apply (the candidate's 0), never an infra error."""
    diff = f"--- /dev/null\n+++ b/{bad}\n@@ -0,0 +1 @@\n+X = 1\n"
    v = check_patch(TASK, diff)
    assert v.reward == 0.0 and v.components["applied"] == 0.0 and "does not apply" in v.details, v.details


def test_attack_export_refused_scores_zero():
    from schemas.repo_task import EXPORT_REFUSED

    v = check_patch(TASK, EXPORT_REFUSED + "the state listing is over 1 MiB\n")
    assert v.reward == 0.0 and v.details.startswith(EXPORT_REFUSED), v.details
