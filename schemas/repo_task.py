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
- `helper_paths(files, hidden_files)` is the test-support modules the hidden tests import
  (`is_helper_name`), computed at verify time from the hidden tests (no recorded field: tasks
  built before it need no regeneration); the verifier protects them like tests.
- `check_path` refuses any path the verifier's sandbox could not write (see its docstring).
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
PROTECTED_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
DEFAULT_TEST_DIRS = ("tests", "test", "testing")


EXPORT_REFUSED = "rlbus-export-refused: "
"""What the rollout side exports as the diff of an episode whose final state cannot be exported
for the policy's own doing (a state listing over its bound): no diff, so the verifier scores 0."""
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255


def check_path(path: str) -> str:
    """`path` if it is a relative POSIX path inside a repository that any file system here can hold:
    no `..`, `.` or empty component, no backslash, NUL or other control character, valid UTF-8,
    at most MAX_NAME_BYTES per component and MAX_PATH_BYTES in all; else ValueError (a diff with
    such a path does not apply: the candidate's 0, never an infrastructure failure)."""
    p = PurePosixPath(path)
    if not path or "\\" in path or p.is_absolute() or any(part in ("..", ".", "") for part in path.split("/")):
        raise ValueError(
            f"repo task path {path!r} must be a relative POSIX path inside the repository "
            "(no '..', '.' or empty component)"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValueError(f"repo task path {path!r} has a control character (NUL, newline, ...): rename the file")
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"repo task path {path!r} is not valid UTF-8") from None
    if len(raw) > MAX_PATH_BYTES or any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in path.split("/")):
        raise ValueError(
            f"repo task path {path[:80]!r}... is too long (at most {MAX_NAME_BYTES} bytes a name, "
            f"{MAX_PATH_BYTES} in all)"
        )
    return path


_HELPER_NAME = re.compile(
    r"^(test(s|ing|_?utils?|_?helpers?|_?support|_?tools?)?|\w+_(testing|test_?utils?|"
    r"test_?helpers?))$"
)


def is_helper_name(dotted: str) -> bool:
    """Whether a module's dotted name marks it as test support: a component that, without leading
    underscores, is `test`, `tests`, `testing`, `test_utils`/`testutils`, `test_helpers`, `test_support`,
    `test_tools`, or ends in `_testing` / `_test_utils` / `_test_helpers` (e.g. `pkg/testing.py`,
    `pkg/_test_utils.py`); never a plain source module such as `pkg/core.py` or `pkg/tester.py`."""
    return any(_HELPER_NAME.match(part.lstrip("_")) for part in dotted.split("."))


def _imports(text: str) -> set[str]:
    import ast

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return set()
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    return out


def helper_paths(files: dict[str, str], hidden_files: dict[str, str]) -> set[str]:
    """The repository files of the test-support modules the hidden tests import (see
    `is_helper_name`), and of the helpers those import, transitively among helpers only: edits to
    them are dropped like edits to tests. Computed from the hidden tests' `import` statements
    (`ast`, no code runs); a helper package protects every file under its directory. Source
    modules under test are never helpers, so the fix always has somewhere to go."""
    by_module: dict[str, list[str]] = {}
    for path in files:
        for root in ("", "src/"):
            if not path.startswith(root) or not path.endswith(".py"):
                continue
            mod = path[len(root) : -3].replace("/", ".")
            if mod.endswith(".__init__"):
                pkg = mod[:-9]
                by_module.setdefault(pkg, []).extend(f for f in files if f.startswith(path[:-11]))
            else:
                by_module.setdefault(mod, []).append(path)
    out: set[str] = set()
    todo = [t for t in hidden_files.values()]
    seen_mods: set[str] = set()
    while todo:
        for mod in _imports(todo.pop()):
            if mod in seen_mods or mod not in by_module or not is_helper_name(mod):
                continue
            seen_mods.add(mod)
            for path in by_module[mod]:
                if path not in out:
                    out.add(path)
                    todo.append(files[path])
    return out


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
        out.extend(
            difflib.unified_diff(
                a_lines,
                b_lines,
                f"a/{path}" if path in old else "/dev/null",
                f"b/{path}" if path in new else "/dev/null",
            )
        )
    return "".join(out)
