"""A repository-level coding task, as the `repo` domain (producers), the repo verifier
(verifier_workers) and `rlbus tasks` share it, so none imports another.

A task is a small Python repository (a file tree), an issue text, public tests the agent
may run, hidden tests only the verifier sees, an optional dependency list (installed in
the sandbox from a local wheelhouse, never the network), and, for operators and tests,
a gold patch.

Guarantees:
- `RepoTask` round-trips through `to_json()` / `from_json()` exactly; every path is a
  relative POSIX path inside the repository (no `..`, no absolute path, no backslash),
  checked at construction (`ValueError` naming the path).
- `public_view()` is what the policy side may see: the repository files and the issue,
  never `hidden_files`, `target_tests`, `regression_tests` or `gold_patch`.
- `content_hash()` is the sha256 of the canonical JSON of the whole task (hidden parts
  included): the task cache and eval sets are keyed by it.
- `unified_diff(old, new)` is the unified diff between two trees (a/ b/ prefixes, sorted
  paths, `\\ No newline at end of file` markers): what the gold patches are and what the
  rollout side exports; the verifier's strict applier applies it back exactly.
- `is_protected(path, test_dirs)` says whether an edit to `path` must be dropped by the
  verifier: test files (`test_*.py`, `*_test.py`), `conftest.py` anywhere, pytest/tox
  configuration files (`pytest.ini`, `.pytest.ini`, `tox.ini`, `setup.cfg`, `pyproject.toml`: their
  `[tool:pytest]` / `[tool.pytest...]` sections cannot be edited apart, so the whole file
  is protected), `sitecustomize.py`, `usercustomize.py`, any `*.pth`, and anything under a
  test directory.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath

PROMPT_TASK_LINE = "Repository task: "
"""A repo task's prompt carries `PROMPT_TASK_LINE + task_id` on a line of its own (the scripted
engine finds its script by it; the id is public)."""
PROMPT_FORMAT_LINE = "Tool call format: "
"""... and `PROMPT_FORMAT_LINE + tool_format` (`tags` or `json`)."""
PROMPT_TASK_RE = re.compile(r"^" + re.escape(PROMPT_TASK_LINE) + r"(\S+)\s*$", re.MULTILINE)
PROMPT_FORMAT_RE = re.compile(r"^" + re.escape(PROMPT_FORMAT_LINE) + r"(tags|json)\s*$", re.MULTILINE)
PROTECTED_NAMES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
                             "sitecustomize.py", "usercustomize.py"})
DEFAULT_TEST_DIRS = ("tests", "test", "testing")


def check_path(path: str) -> str:
    """`path` if it is a safe relative POSIX path inside a repository; else ValueError."""
    p = PurePosixPath(path)
    if not path or "\\" in path or p.is_absolute() or any(part in ("..", "") for part in path.split("/")):
        raise ValueError(f"repo task path {path!r} must be a relative POSIX path inside the repository")
    return path


def is_protected(path: str, test_dirs: tuple[str, ...] = DEFAULT_TEST_DIRS) -> bool:
    """Whether the verifier drops an edit to `path` (see the module's guarantees)."""
    p = PurePosixPath(path)
    name = p.name
    if name in PROTECTED_NAMES or name.endswith(".pth"):
        return True
    if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
        return True
    return any(part in test_dirs for part in p.parts[:-1])


@dataclass
class RepoTask:
    """One repository task (see the module docstring)."""

    task_id: str
    source: str
    """Where it came from: `sdist:NAME==VERSION` (mutation-built) or `fixture:NAME` (hand-written)."""
    issue: str
    """What is wrong or wanted, as a user would report it: a symptom, never the patch."""
    files: dict[str, str]
    """The repository as the agent gets it (public tests included), path -> text."""
    hidden_files: dict[str, str] = field(default_factory=dict)
    """Test files only the verifier sees, copied over the repository before the suite runs."""
    target_tests: list[str] = field(default_factory=list)
    """pytest node ids that fail before the fix and must pass after it."""
    regression_tests: list[str] = field(default_factory=list)
    """pytest node ids that pass before and must still pass after (the regression guard)."""
    deps: list[str] = field(default_factory=list)
    """Requirements installed in the sandbox from the local wheelhouse (no network)."""
    gold_patch: str = ""
    """A unified diff (against `files`) that resolves the task; for operators and tests only."""
    test_dirs: list[str] = field(default_factory=lambda: list(DEFAULT_TEST_DIRS))

    def __post_init__(self) -> None:
        for path in (*self.files, *self.hidden_files):
            check_path(path)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys)."""
        return json.dumps(asdict(self), sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> RepoTask:
        """The task `to_json` wrote."""
        return cls(**json.loads(text))

    def content_hash(self) -> str:
        """sha256 of the canonical JSON."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def public_view(self) -> dict:
        """What the policy side may see: the id, the issue, the repository files."""
        return {"task_id": self.task_id, "issue": self.issue, "files": dict(self.files)}


def unified_diff(old: dict[str, str], new: dict[str, str]) -> str:
    """The unified diff old → new over every path in either (a/ b/ prefixes, sorted paths)."""
    out: list[str] = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path, ""), new.get(path, "")
        if a == b and (path in old) == (path in new):
            continue
        a_lines, b_lines = a.splitlines(keepends=True), b.splitlines(keepends=True)
        for seq in (a_lines, b_lines):
            if seq and not seq[-1].endswith("\n"):
                seq[-1] += "\n\\ No newline at end of file\n"
        out.extend(difflib.unified_diff(a_lines, b_lines, f"a/{path}" if path in old else "/dev/null",
                                        f"b/{path}" if path in new else "/dev/null"))
    return "".join(out)
