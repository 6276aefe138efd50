"""Hand-written repository tasks with known gold patches, for tests (source `fixture:NAME`).

Four tiny repositories, each a package, a public test file and a hidden test file:
- `fixture-clamp`: `clamp(x, lo, hi)` returns `lo` for values above `hi` (swapped branch).
- `fixture-wordcount`: `count_words` splits on single spaces, so runs of spaces count
  empty words.
- `fixture-stack`: `Stack.peek` on an empty stack raises IndexError instead of the
  documented `EmptyStack`.
- `fixture-partial`: two independent bugs (`add` and `mul`), one hidden target test
  each; `partial_patch("fixture-partial")` fixes only `add`, so a verifier scores
  `target_pass_rate` = 0.5 on it.

Guarantees:
- `fixture_tasks()` builds the same tasks every call (pure code, no I/O); each task's
  `gold_patch` applies to its `files` (`producers.repo_mutate.apply_unified_diff`) and
  makes every target test pass, while without it every target test fails; regression
  tests pass either way.
- `partial_patch(task_id)` is a unified diff that fixes a strict, non-empty subset of
  the targets (only `fixture-partial` has one; others raise KeyError).
- `write_fixture_cache(dir)` saves them into a task cache directory (`producers.repo_cache`).
"""

from __future__ import annotations

from pathlib import Path

from producers.repo_mutate import unified_diff
from schemas.repo_task import RepoTask

SETUP = 'from setuptools import setup\n\nsetup(name="{name}", version="0.1", packages=["{name}"])\n'


def _task(
    name: str,
    issue: str,
    broken: dict[str, str],
    fixed: dict[str, str],
    public_tests: str,
    hidden_tests: str,
    targets: list[str],
    regressions: list[str],
) -> RepoTask:
    package = next(iter(broken)).split("/")[0]
    files = {"setup.py": SETUP.format(name=package), "tests/test_public.py": public_tests, **broken}
    return RepoTask(
        task_id=f"fixture-{name}",
        source=f"fixture:{name}",
        issue=issue,
        files=files,
        hidden_files={"tests/test_hidden.py": hidden_tests},
        target_tests=[f"tests/test_hidden.py::{t}" for t in targets],
        regression_tests=[f"tests/test_public.py::{t}" for t in regressions],
        gold_patch=unified_diff(broken, fixed),
    )


CLAMP_BROKEN = '''def clamp(x, lo, hi):
    """x limited to the range [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return lo
    return x
'''
CLAMP_FIXED = CLAMP_BROKEN.replace("    if x > hi:\n        return lo", "    if x > hi:\n        return hi")

WORDS_BROKEN = '''def count_words(text):
    """The number of whitespace-separated words in text."""
    return len(text.split(" ")) if text else 0
'''
WORDS_FIXED = WORDS_BROKEN.replace('len(text.split(" ")) if text else 0', "len(text.split())")

STACK_BROKEN = '''class EmptyStack(Exception):
    """Raised by peek and pop on an empty stack."""


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise EmptyStack("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]
'''
STACK_FIXED = STACK_BROKEN.replace(
    "    def peek(self):\n        return self.items[-1]",
    "    def peek(self):\n        if not self.items:\n"
    '            raise EmptyStack("peek at an empty stack")\n'
    "        return self.items[-1]",
)

CALC_BROKEN = """def add(a, b):
    return a - b


def mul(a, b):
    return a + b


def neg(a):
    return -a
"""
CALC_ADD_FIXED = CALC_BROKEN.replace("return a - b", "return a + b")
CALC_FIXED = CALC_ADD_FIXED.replace("    return a + b\n\n\ndef neg", "    return a * b\n\n\ndef neg")


def fixture_tasks() -> dict[str, RepoTask]:
    """{task_id: task} of every fixture (see the module guarantees)."""
    tasks = [
        _task(
            "clamp",
            "`clamp(15, 0, 10)` returns 0; it should return 10 (values above the range should be limited to `hi`).\n",
            {"clamp/__init__.py": CLAMP_BROKEN},
            {"clamp/__init__.py": CLAMP_FIXED},
            "from clamp import clamp\n\n\ndef test_inside():\n    assert clamp(5, 0, 10) == 5\n\n\n"
            "def test_below():\n    assert clamp(-3, 0, 10) == 0\n",
            "from clamp import clamp\n\n\ndef test_above():\n    assert clamp(15, 0, 10) == 10\n",
            ["test_above"],
            ["test_inside", "test_below"],
        ),
        _task(
            "wordcount",
            "`count_words('a  b')` (two spaces) returns 3; it should return 2. "
            "Leading or repeated whitespace must not count as words.\n",
            {"wordcount/__init__.py": WORDS_BROKEN},
            {"wordcount/__init__.py": WORDS_FIXED},
            "from wordcount import count_words\n\n\ndef test_simple():\n    assert count_words('a b c') == 3\n\n\n"
            "def test_empty():\n    assert count_words('') == 0\n",
            "from wordcount import count_words\n\n\ndef test_spaces():\n    assert count_words('a  b') == 2\n\n\n"
            "def test_newlines():\n    assert count_words(' a\\nb ') == 2\n",
            ["test_spaces", "test_newlines"],
            ["test_simple", "test_empty"],
        ),
        _task(
            "stack",
            "`Stack().peek()` raises `IndexError: list index out of range`; the docs say "
            "peek and pop on an empty stack raise `EmptyStack`.\n",
            {"stack/__init__.py": STACK_BROKEN},
            {"stack/__init__.py": STACK_FIXED},
            "from stack import Stack\n\n\ndef test_push_pop():\n    s = Stack()\n    s.push(1)\n"
            "    assert s.pop() == 1\n",
            "import pytest\n\nfrom stack import EmptyStack, Stack\n\n\ndef test_peek_empty():\n"
            "    with pytest.raises(EmptyStack):\n        Stack().peek()\n",
            ["test_peek_empty"],
            ["test_push_pop"],
        ),
        _task(
            "partial",
            "`calc.add(2, 3)` returns -1 (expected 5) and `calc.mul(2, 3)` returns 5 (expected 6).\n",
            {"calc/__init__.py": CALC_BROKEN},
            {"calc/__init__.py": CALC_FIXED},
            "from calc import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n",
            "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
            "def test_mul():\n    assert mul(2, 3) == 6\n",
            ["test_add", "test_mul"],
            ["test_neg"],
        ),
    ]
    return {t.task_id: t for t in tasks}


PARTIAL = {
    "fixture-partial": (
        {"calc/__init__.py": CALC_BROKEN},
        {"calc/__init__.py": CALC_ADD_FIXED},
        ["tests/test_hidden.py::test_add"],
    )
}


def partial_patch(task_id: str) -> str:
    """A diff fixing only part of `task_id`'s targets (see the module guarantees)."""
    broken, fixed, _ = PARTIAL[task_id]
    return unified_diff(broken, fixed)


def partial_fixes(task_id: str) -> list[str]:
    """The target tests `partial_patch(task_id)` makes pass (the others still fail)."""
    return list(PARTIAL[task_id][2])


def write_fixture_cache(cache_dir: str | Path) -> list[str]:
    """Save every fixture into the task cache `cache_dir`; returns their ids."""
    from producers import repo_cache

    tasks = fixture_tasks()
    for task in tasks.values():
        repo_cache.save_task(task, cache_dir)
    return sorted(tasks)
