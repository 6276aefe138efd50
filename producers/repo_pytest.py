"""Run a repository's pytest suite in a bubblewrap process sandbox, at task-build time.

`SandboxedSuite` owns one `sandbox_workers.process.ProcessSandbox` (bwrap: no network, a
read-only system root, the work dir the only writable place besides a tmpfs /tmp):

    /work/repo     the repository under test (cwd of the run; rootdir of the node ids)
    /work/_rlbus   the harness: a copy of pytest and its pure-Python dependencies from
                   this interpreter's environment, a result plugin and a pytest.ini

Why the process sandbox with a writable work dir: test suites write (tmp files, caches,
`__pycache__` is off), so the repository is a private writable copy; the sandbox's
system `python3` runs it with the copied pytest on PYTHONPATH and `-c` the harness's own
ini, so the package's pytest configuration (addopts such as `--cov`) is not used.

Guarantees:
- Results come from the result file the harness plugin writes, never from stdout or the
  exit code: `{nodeid: Outcome}` with `outcome` in passed / failed / error / skipped, and
  for a failure the crash message, the failing line of the test (`call`) and the test's
  source up to that line (`context`, at most 12 lines); a
  collection error appears under the collected path's node id with outcome `error`.
- Every run is capped: the wall `timeout` (process tree killed) and rlimits (CPU, memory,
  pids); a run that times out returns `SuiteRun.timed_out=True` (its results are then incomplete or empty).
- Runs use `-q -p no:cacheprovider`, `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`, `-x` on demand, and
  `PYTHONHASHSEED=0` (set and dict-of-str orders, hence failure messages, are reproducible).
- Fails closed: no bubblewrap means `SandboxRefused` (from the sandbox), unless the
  caller passes `allow_degraded=True` on purpose (then it runs with rlimits only and
  `isolation == "degraded"` says so).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

PYTEST_DISTS = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py")
HARNESS = "_rlbus"
REPO = "repo"
REPORT = f"{HARNESS}/report.json"

PLUGIN = r"""
import json, os
_results = {}


def _detail(report):
    lr = report.longrepr
    crash = getattr(lr, "reprcrash", None)
    message = crash.message if crash is not None else str(lr)[-800:]
    call, context = "", []
    entries = getattr(getattr(lr, "reprtraceback", None), "reprentries", None) or []
    if entries:
        lines = getattr(entries[0], "lines", None) or []
        for ln in lines:
            if ln.startswith("E"):
                break
            context.append(ln[4:] if ln[:1] in (" ", ">") else ln)
            if ln.startswith(">"):
                call = ln[1:].strip()
    return message[:2000], call[:500], "\n".join(context[-12:])[:2000]


def _record(nodeid, outcome, report):
    prev = _results.get(nodeid)
    if prev and prev["outcome"] in ("failed", "error"):
        return
    entry = {"outcome": outcome}
    if outcome in ("failed", "error"):
        entry["message"], entry["call"], entry["context"] = _detail(report)
    _results[nodeid] = entry


def pytest_runtest_logreport(report):
    if report.when == "call":
        _record(report.nodeid, report.outcome, report)
    elif report.outcome == "failed":
        _record(report.nodeid, "error", report)
    elif report.outcome == "skipped" and report.when == "setup":
        _record(report.nodeid, "skipped", report)


def pytest_collectreport(report):
    if report.outcome == "failed":
        _record(report.nodeid, "error", report)


def pytest_sessionfinish(session):
    with open(os.environ["RLBUS_REPORT"], "w") as f:
        json.dump(_results, f)
"""

INI = "[pytest]\npython_files = test_*.py *_test.py\n"


@dataclass
class SuiteRun:
    """One pytest run: per-node results, whether it timed out, its wall time, a log tail."""

    results: dict[str, dict] = field(default_factory=dict)
    timed_out: bool = False
    seconds: float = 0.0
    log_tail: str = ""

    def failing(self) -> list[str]:
        """Node ids that failed or errored, sorted."""
        return sorted(n for n, r in self.results.items() if r["outcome"] in ("failed", "error"))

    def passing(self) -> list[str]:
        """Node ids that passed, sorted."""
        return sorted(n for n, r in self.results.items() if r["outcome"] == "passed")


def _pytest_files() -> list[tuple[str, bytes]]:
    """(relative path, bytes) of pytest and its pure-Python dependencies, from this environment."""
    import _pytest

    site = Path(_pytest.__file__).resolve().parent.parent
    out: list[tuple[str, bytes]] = []
    for name in PYTEST_DISTS:
        root = site / name
        paths = [root] if root.is_file() else sorted(root.rglob("*.py")) + sorted(root.rglob("py.typed"))
        for path in paths:
            if path.exists():
                out.append((f"{HARNESS}/lib/{path.relative_to(site).as_posix()}", path.read_bytes()))
    return out


class SandboxedSuite:
    """A repository in a process sandbox, ready to run its tests (see the module guarantees)."""

    def __init__(
        self, files: dict[str, str], *, timeout: float = 120.0, memory_mb: int = 1024, allow_degraded: bool = False
    ) -> None:
        from sandbox_workers.base import Limits
        from sandbox_workers.process import ProcessSandbox

        self.timeout = timeout
        self.sandbox = ProcessSandbox(allow_degraded=allow_degraded)
        self.sandbox.start(
            limits=Limits(memory_mb=memory_mb, pids=64, cpu_seconds=int(timeout) + 5, file_size_mb=16, tmp_mb=64),
            timeout=timeout,
        )
        self.isolation = self.sandbox.isolation
        self.sandbox.write_files(
            [*_pytest_files(), (f"{HARNESS}/rlbus_report.py", PLUGIN.encode()), (f"{HARNESS}/pytest.ini", INI.encode())]
        )
        self.files: dict[str, str] = {}
        self.write(files)

    def write(self, files: dict[str, str]) -> None:
        """Create or replace repository files (paths relative to the repository root)."""
        self.sandbox.write_files([(f"{REPO}/{p}", t.encode()) for p, t in files.items()])
        self.files.update(files)

    def run(self, targets: list[str], *, exitfirst: bool = False, timeout: float | None = None) -> SuiteRun:
        """Run pytest on `targets` (paths or node ids relative to the repository root)."""
        work = "/work"
        env = (
            f"RLBUS_REPORT={work}/{REPORT} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONHASHSEED=0 "
            f"PYTHONPATH={work}/{HARNESS}/lib:{work}/{HARNESS}:{work}/{REPO}"
        )
        args = [
            "python3",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "rlbus_report",
            "-c",
            f"{work}/{HARNESS}/pytest.ini",
            "--rootdir",
            f"{work}/{REPO}",
            "-o",
            "console_output_style=classic",
            *(["-x"] if exitfirst else []),
            "--",
            *targets,
        ]
        self.sandbox.write_file(REPORT, b"{}")
        cmd = f"cd {work}/{REPO} && {env} {shlex.join(args)}"
        res = self.sandbox.execute(cmd, timeout=timeout or self.timeout)
        try:
            results = json.loads(self.sandbox.read_file(REPORT))
        except (OSError, ValueError):
            results = {}
        tail = (res.stdout + res.stderr)[-3000:]
        return SuiteRun(results=results, timed_out=res.timed_out, seconds=res.duration_ms / 1000, log_tail=tail)

    def close(self) -> None:
        """Remove the sandbox and its work dir."""
        self.sandbox.close()

    def __enter__(self) -> SandboxedSuite:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_patch(
    task, patch: str, suite: SandboxedSuite | None = None, *, regression: bool = False, allow_degraded: bool = False
) -> tuple[SuiteRun, SuiteRun]:
    """(unpatched, patched) runs of `task`'s target tests (and, with `regression`, its regression
    tests) on its files plus hidden files; `patch` is applied with `apply_unified_diff`.

    A given `suite` is reused (every file of the task is written over it, so one sandbox
    serves the tasks of one package); else a fresh sandbox is made and closed."""
    from producers.repo_mutate import apply_unified_diff

    tree = {**task.files, **task.hidden_files}
    patched = {**apply_unified_diff(task.files, patch), **task.hidden_files}
    ids = list(task.target_tests) + (list(task.regression_tests) if regression else [])
    own = suite is None
    suite = suite or SandboxedSuite(tree, allow_degraded=allow_degraded)
    try:
        suite.write(tree)
        before = suite.run(ids)
        suite.write(patched)
        after = suite.run(ids)
    finally:
        if own:
            suite.close()
    return before, after
