"""The programs the code and repo verifiers ship into a sandbox, as the texts they ship.

Guarantees:
- `code_harness()` is the `code` verifier's harness (`verifier_workers.harness`): the parts
  `CODE_HARNESS_PARTS`, in order, joined into ONE program by
  `sandbox_workers.program_parts.join_parts` (their imports of each other dropped), as UTF-8
  bytes; uploaded as `harness.py` and run with `python3 -I -S harness.py`.
- `repo_harness()` is the `repo` verifier's supervisor/runner program
  (`verifier_workers.repo_harness`), one file, as it is.
- `repo_guard()` is the repo harness's guard (`verifier_workers.repo_harness_guard`): the
  parts `REPO_GUARD_PARTS` joined the same way into the ONE module the harness installs as
  `_rlbus_guard`.
- Each is read once per process; a part that imports project code other than an earlier
  part's names raises ValueError (nothing is shipped).
"""

from __future__ import annotations

import functools
from pathlib import Path

from sandbox_workers.program_parts import join_files

HERE = Path(__file__).resolve().parent
CODE_HARNESS_PARTS = tuple(
    str(HERE / name) for name in ("harness_protocol.py", "harness_runner.py", "harness_supervisor.py", "harness.py")
)
"""The code harness's files, in the order they are joined (each imports only earlier ones)."""
REPO_HARNESS = HERE / "repo_harness.py"
REPO_GUARD_PARTS = tuple(
    str(HERE / name)
    for name in (
        "repo_harness_guard_data.py",
        "repo_harness_guard_audit.py",
        "repo_harness_guard_report.py",
        "repo_harness_guard.py",
    )
)
"""The repo guard's files, in the order they are joined (each imports only earlier ones)."""


@functools.lru_cache(maxsize=1)
def code_harness() -> bytes:
    """The code harness program (see the module guarantees)."""
    return join_files(CODE_HARNESS_PARTS, "verifier_workers").encode("utf-8")


@functools.lru_cache(maxsize=1)
def repo_harness() -> str:
    """The repo harness program (see the module guarantees)."""
    return REPO_HARNESS.read_text()


@functools.lru_cache(maxsize=1)
def repo_guard() -> str:
    """The repo harness's guard module `_rlbus_guard` (see the module guarantees)."""
    return join_files(REPO_GUARD_PARTS, "verifier_workers")
