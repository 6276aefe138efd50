"""The repository tools of an agent episode, run in the episode's own sandbox.

A repo task (`Task.workspace` set, tools from `schemas.tool_protocol.REPO_TOOLS`) gets its
repository written into the sandbox's work dir (`/work`) when the sandbox opens; each call of
`list_files`, `read_file`, `grep`, `write_file`, `apply_patch` or `run` is ONE recorded execution
(`AsyncSandbox.observe`), so its observation is signed and checked by the verifier like any
other; `submit` runs nothing and ends the episode (`rollout_workers.agent`).

Guarantees:
- `write_file` content and `apply_patch` diffs are staged in the work dir as
  `repo_tool_runner.INPUT` (one `write_file` of the sandbox, any size the sandbox takes) and
  consumed by the runner program (`rollout_workers/repo_tool_runner.py`, sent as
  `python3 -c`), never passed on a command line; `run` is `/bin/sh -c COMMAND` in `/work`.
- `read_file` shows lines `offset`..`offset + limit - 1` (or `start`..`end`; all by default);
  `grep` (a Python regex, an argv item, never a shell word) shows at most `max_matches`
  (default `GREP_MAX_MATCHES`) matching lines with their numbers and counts the rest.
- Observations are clipped head + tail to the caller's `caps` (stdout, stderr chars) and
  say so with the `trunc` flag (`sandbox_workers.integrity.render_observation`).
- `export_diff` is the unified diff (`schemas.repo_task.unified_diff`) of the sandbox's
  repository now against the original files: changed and new UTF-8 files read back
  exactly, deleted files as deletions, files that are not UTF-8 left out (named in the
  returned `skipped`, as are files over 8 MiB or unreadable). A state listing over its bound
  (the runner's `{"": reason}`, or a truncated one: the policy made the repository that big) is
  the episode's own failure: the exported "diff" is `schemas.repo_task.EXPORT_REFUSED` + reason,
  which never applies, so the verifier scores that trajectory 0 and names the reason; the batch
  goes on. A listing that fails, times out or does not parse raises `ExportFailed` (an
  infrastructure error for the caller: never an empty diff by accident).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path, PurePosixPath

from schemas.repo_task import EXPORT_REFUSED, unified_diff
from schemas.tool_protocol import Call

RUNNER_PATH = Path(__file__).with_name("repo_tool_runner.py")
INPUT = ".rlbus-tool-input"
_SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
EXPORT_TIMEOUT_S = 60.0
GREP_MAX_MATCHES = 50
"""`grep`'s matching lines shown when the call sets no `max_matches` (the rest are counted)."""


class ExportFailed(RuntimeError):
    """The final repository state could not be read back from the sandbox."""


@functools.lru_cache(maxsize=1)
def runner_source() -> str:
    """The text of the in-sandbox runner program."""
    return RUNNER_PATH.read_text()


def runner_argv(op: str, *args: str) -> list[str]:
    """argv running the in-sandbox runner's `op`."""
    return ["python3", "-c", runner_source(), op, *[str(a) for a in args]]


async def setup_workspace(sandbox, files: dict[str, str]) -> None:
    """Write the task's repository into the sandbox's work dir (one batched write)."""
    if files:
        await sandbox.write_files([(path, text.encode()) for path, text in sorted(files.items())])


def read_range(args: dict) -> tuple[str, str]:
    """`read_file`'s (first, last) line as the runner takes them (last 0 = to the end): `offset`
    (1-based first line) and `limit` (how many lines) when given, overriding `start` / `end`."""
    first = int(args.get("offset", args.get("start", 1)))
    last = first + int(args["limit"]) - 1 if "limit" in args else int(args.get("end", 0))
    return str(first), str(last)


async def run_repo_tool(sandbox, call: Call, timeout: float | None, caps: tuple[int, int] | None):
    """Run one repository tool call (not `submit`); the sandbox's `Observation`."""
    args = call.args
    if call.tool == "list_files":
        argv = runner_argv("list", args.get("path", "."))
    elif call.tool == "read_file":
        argv = runner_argv("read", args["path"], *read_range(args))
    elif call.tool == "grep":
        flag = "1" if args.get("ignore_case") else "0"
        limit = str(args.get("max_matches", GREP_MAX_MATCHES))
        argv = runner_argv("grep", args["pattern"], args.get("path", "."), flag, limit)
    elif call.tool == "write_file":
        await sandbox.write_file(INPUT, args["content"].encode())
        argv = runner_argv("write", args["path"])
    elif call.tool == "apply_patch":
        await sandbox.write_file(INPUT, args["unified_diff"].encode())
        argv = runner_argv("patch")
    elif call.tool == "run":
        argv = ["/bin/sh", "-c", args["command"]]
    else:
        raise ValueError(f"{call.tool!r} is not a repository tool that runs")
    return await sandbox.observe(argv, timeout, caps)


def _listed(path: str) -> bool:
    """Whether the runner's `state` op lists `path` (the same skip rules)."""
    p = PurePosixPath(path)
    if path == INPUT or p.name.endswith(".pyc"):
        return False
    return not any(part in _SKIP_DIRS or part.endswith(".egg-info") for part in p.parts[:-1])


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def export_diff(sandbox, original: dict[str, str]) -> tuple[str, list[str]]:
    """(the diff of the sandbox's repository against `original`, paths left out as not UTF-8)."""
    res = await sandbox.execute(runner_argv("state"), EXPORT_TIMEOUT_S)
    if res.truncated and res.exit_code == 0 and not res.timed_out:
        return EXPORT_REFUSED + "the repository's state listing outgrew the sandbox's output cap\n", []
    if res.exit_code != 0 or res.truncated or res.timed_out:
        raise ExportFailed(
            f"repository state listing failed (exit {res.exit_code}, truncated={res.truncated}, "
            f"timed_out={res.timed_out}): {res.stderr[-300:]}"
        )
    try:
        state = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise ExportFailed(f"repository state listing does not parse: {exc}") from exc
    if not isinstance(state, dict):
        raise ExportFailed(f"repository state listing is not an object: {type(state).__name__}")
    if "" in state:
        return EXPORT_REFUSED + f"{state['']}\n", []
    new = {p: t for p, t in original.items() if p in state or not _listed(p)}
    skipped: list[str] = []
    for path, digest in sorted(state.items()):
        if path in original and _sha(original[path]) == digest:
            continue
        if digest in ("toolarge", "unreadable"):
            skipped.append(path)
            continue
        data = await sandbox.read_file(path)
        try:
            new[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(path)  # an original file keeps its original text; a new one stays out
    return unified_diff(original, new), skipped
