"""The `code` verifier end to end in real process (bwrap) sandboxes: no mocks.

Right answers score 1.0, wrong and malformed ones 0.0, every tamper attempt 0.0 with
status `tamper`, an endless loop 0.0 within the deadline; the hidden tests never reach
the public Task.
"""

from __future__ import annotations

import random
import textwrap
import time

import pytest

from producers.domains import DomainContext
from producers.domains import code as he
from schemas import Trajectory, encode
from schemas.config import DomainConfig, load_config
from verifier_workers import registry
from verifier_workers.verifiers.code import SandboxInfraError, candidate_program, extract_code, verify_code

ADD = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(-1, 1) == 0
    assert candidate(10, 5) == 15
"""
HIDDEN_ADD = {"test": ADD, "entry_point": "add", "prompt": 'def add(a: int, b: int) -> int:\n    """Sum."""\n'}
GOOD_ADD = "def add(a, b):\n    return a + b\n"


def traj(final_text: str, entry_point: str = "add", **params) -> Trajectory:
    return Trajectory(
        run_id="r1",
        task_id="t1",
        task_msg_id="m1",
        domain="code",
        group_id="g1",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="code",
        hidden_ref="code.t1.x",
        verifier_params={"entry_point": entry_point, **params},
        policy_version=0,
        final_text=final_text,
    )


def score(text: str, hidden: dict = HIDDEN_ADD, **params):
    return verify_code(traj(text, hidden["entry_point"], **params), hidden, backend="process")


def problem_hidden(pid: str) -> dict:
    return he.get(pid).hidden


# ---------------------------------------------------------------- right / wrong / malformed
@pytest.mark.parametrize("pid", ["HumanEval/0", "HumanEval/38", "HumanEval/32", "HumanEval/162"])
def test_canonical_solutions_score_one(pid):
    p = he.get(pid)
    v = score(p.prompt + p.canonical_solution, p.hidden)
    assert (v.reward, v.status, v.components["correct"], v.components["compiles"]) == (1.0, "ok", 1.0, 1.0), v.details
    assert v.components["pass_rate"] == 1.0


def test_fenced_answer_and_body_only_answer_are_accepted():
    p = he.get("HumanEval/0")
    fenced = f"Here you go:\n```python\n{p.prompt}{p.canonical_solution}```\nDone."
    assert score(fenced, p.hidden).reward == 1.0
    body_only = score(p.canonical_solution, p.hidden)
    assert body_only.reward == 1.0 and "[body;" in body_only.details
    # a full definition that forgot `from typing import List`: the prompt's imports are prepended
    bare = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + p.canonical_solution
    assert score(bare, p.hidden).reward == 1.0


def test_wrong_answer_scores_zero_with_a_pass_rate():
    v = score("def add(a, b):\n    return a + b if a > 5 else 0\n")
    assert (v.reward, v.status, v.components["compiles"]) == (0.0, "ok", 1.0)
    assert 0.0 < v.components["pass_rate"] < 1.0, v.details
    p = he.get("HumanEval/2")
    assert score(p.prompt + "    return None\n", p.hidden).reward == 0.0


@pytest.mark.parametrize("text", ["def add(a, b)\n    return a + b\n", "", "   \n", "```python\n```"])
def test_malformed_scores_zero_and_does_not_compile(text):
    v = score(text)
    assert (v.reward, v.status, v.components["compiles"]) == (0.0, "ok", 0.0)


def test_missing_function_and_exception_at_import_score_zero():
    assert score("def plus(a, b):\n    return a + b\n").reward == 0.0
    v = score("raise ValueError('boom')\n" + GOOD_ADD)
    assert (v.reward, v.status) == (0.0, "ok") and "boom" in v.details


def test_infinite_loop_scores_zero_within_the_timeout():
    t0 = time.monotonic()
    v = score("def add(a, b):\n    while True:\n        pass\n", timeout_s=2)
    assert (v.reward, v.status) == (0.0, "timeout")
    assert time.monotonic() - t0 < 10


def test_always_equal_object_cannot_pass():
    v = score(
        textwrap.dedent("""
        class Eq:
            def __eq__(self, other):
                return True
        def add(a, b):
            return Eq()
    """)
    )
    assert (v.reward, v.status) == (0.0, "tamper"), v.details


# ---------------------------------------------------------------- tamper attempts
TAMPER = {
    "sys_exit_at_import": "import sys\nsys.exit(0)\n" + GOOD_ADD.replace("a + b", "0"),
    "os_exit_in_atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "fake_passed_lines": "print('PASSED')\nprint('All tests passed')\ndef add(a, b):\n    return 0\n",
    "fake_result_line": "print('RLBUS-PASS ' + '0' * 64)\ndef add(a, b):\n    return 0\n",
    "patch_builtins_import": "import builtins\n_imp = builtins.__import__\n"
    "builtins.__import__ = lambda *a, **k: _imp(*a, **k)\ndef add(a, b):\n    return 0\n",
    "patch_assertion_error": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
    "def add(a, b):\n    return 0\n",
    "patch_exit": "import sys\nsys.exit = lambda *a: None\ndef add(a, b):\n    return 0\n",
    "override_check": "def check(candidate):\n    pass\ndef add(a, b):\n    return 0\n",
    "write_test_file": "open('tests.py', 'w').write('def check(c):\\n    pass\\n')\ndef add(a, b):\n    return 0\n",
    "read_proc": "open('/proc/self/status').read()\ndef add(a, b):\n    return 0\n",
    "settrace": "import sys\nsys.settrace(lambda *a: None)\ndef add(a, b):\n    return 0\n",
    "subprocess": "import subprocess\nsubprocess.run(['true'])\ndef add(a, b):\n    return 0\n",
    "ctypes": "import ctypes\ndef add(a, b):\n    return 0\n",
    "gc_walk": "import gc\ngc.get_objects()\ndef add(a, b):\n    return 0\n",
    # sqlite writes files without an `open` audit event: importing it is refused
    "write_test_file_via_sqlite": "import sqlite3\nsqlite3.connect('tests.py').execute('create table t(x)')\n"
    + GOOD_ADD,
    # a relative path (after chdir) into /proc: the hook resolves paths before checking
    "read_proc_relative": "import os\nos.chdir('/')\nopen('proc/self/status').read()\n" + GOOD_ADD,
    # rebinding the harness's own globals (here the plain-data check the runner uses)
    "patch_harness_global": "import __main__\n__main__.plain = lambda *a: True\n" + GOOD_ADD,
}


@pytest.mark.parametrize("name", sorted(TAMPER))
def test_tamper_attempts_score_zero_with_status_tamper(name):
    v = score(TAMPER[name])
    assert (v.reward, v.status) == (0.0, "tamper"), v.details


def test_tamper_with_a_correct_answer_still_scores_zero():
    v = score("import sys\nsys.exit = lambda *a: None\n" + GOOD_ADD)
    assert (v.reward, v.status) == (0.0, "tamper")
    v = score("import atexit, os\natexit.register(lambda: os._exit(0))\n" + GOOD_ADD)
    assert (v.reward, v.status) == (0.0, "tamper")


def test_candidate_output_is_kept_off_stdout_and_does_not_count():
    v = score("def add(a, b):\n    print('computing', a, b)\n    return a + b\n")
    assert (v.reward, v.status) == (1.0, "ok") and "computing" in v.details


# ---------------------------------------------------------------- extraction rules
def test_extract_code_rules():
    assert extract_code("```python\nx = 1\n```\n```python\ndef f():\n    pass\n```", "f").startswith("def f")
    assert extract_code("```python\ndef f():\n    pass\n```\n```\nprint(1)\n```", "f").startswith("def f")
    assert extract_code("```python\ndef f(): pass", "f") == "def f(): pass"
    assert extract_code("def f(): pass") == "def f(): pass"
    prog, how = candidate_program("return a + b", "add", HIDDEN_ADD["prompt"])
    assert how == "body" and prog.endswith("    return a + b")


# ---------------------------------------------------------------- infra, inputs, registry, domain
def test_missing_hidden_is_an_input_error_and_bad_backend_is_rejected():
    from verifier_workers.verdict import VerifierInputError

    with pytest.raises(VerifierInputError):
        verify_code(traj(GOOD_ADD), None, backend="process")
    with pytest.raises(ValueError):
        verify_code(traj(GOOD_ADD), HIDDEN_ADD, backend="nope")
    assert issubclass(SandboxInfraError, RuntimeError)


def test_registry_knows_code():
    assert registry.get("code") is verify_code


def _ctx(max_turns: int = 1) -> DomainContext:
    return DomainContext(run_id="r1", name="code", cfg=load_config(None), dc=DomainConfig(max_turns=max_turns))


def test_domain_task_never_carries_the_tests():
    src = he.CodeDomain(_ctx())
    rng = random.Random(0)
    for i in range(20):
        drawn = src.make_task(rng, 1 + i % 3, i)
        task, hidden = drawn.task, drawn.hidden
        wire = encode(task)
        assert hidden["test"].strip() and hidden["test"].strip().encode() not in wire
        assert b"def check(candidate)" not in wire
        p = he.get(task.verifier_params["problem_id"])
        assert p.canonical_solution.strip().encode() not in wire
        assert task.verifier == "code" and task.verifier_params["entry_point"] == hidden["entry_point"]
        assert task.hidden_ref and task.tools == [] and p.prompt in task.prompt[0].content
    assert he.CodeDomain(_ctx(max_turns=3)).make_task(rng, 1, 0).task.tools == ["run_tests"]


def test_domain_task_verifies_with_its_hidden_payload():
    drawn = he.CodeDomain(_ctx()).make_task(random.Random(1), 1, 0)
    p = he.get(drawn.task.verifier_params["problem_id"])
    t = Trajectory(
        run_id="r1",
        task_id=drawn.task.task_id,
        task_msg_id="m",
        domain="code",
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="code",
        verifier_params=drawn.task.verifier_params,
        hidden_ref=drawn.task.hidden_ref,
        policy_version=0,
        final_text=f"```python\n{p.prompt}{p.canonical_solution}```",
    )
    assert verify_code(t, drawn.hidden, backend="process").reward == 1.0
