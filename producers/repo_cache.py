"""The repository-task cache: content-hashed `RepoTask` files in one directory.

Layout of a cache directory:

    index.json            {"tasks": {task_id: {"content_hash", "source", "files", "file"}},
                           "packages": {"NAME==VERSION": {"licence", "sdist_sha256", ...}}}
    <task_id>.json.xz     the task's canonical JSON (`RepoTask.to_json`), xz-compressed

The default cache (`default_cache_dir()`) is `producers/repo_tasks/`, committed to the
repository so `rlbus tasks list --domain repo` works on a fresh clone; env
`RLBUS_REPO_TASKS` or a `cache_dir` argument points elsewhere. `rlbus tasks build repo
--from-sdist NAME==VERSION ... --out DIR` fills one.

Guarantees:
- `save_task` writes the task file atomically (temp file + rename), then the index entry
  with the task's `content_hash()`; saving the same task twice is a no-op.
- `load_task` returns a task whose `content_hash()` equals its index entry, else raises
  `CacheCorrupt`; an id the cache lacks raises `TaskNotCached` (a `KeyError`) whose
  message names the build command. Ids `fixture-*` not in the cache resolve to the
  hand-written fixtures (`producers.repo_fixtures`), which are code, not cache.
- `list_tasks` returns every cached task, sorted by id, each hash-checked; an empty or
  missing cache gives `[]` (callers say how to build it: `BUILD_HINT`).
- Nothing here touches the network.
"""

from __future__ import annotations

import json
import lzma
import os
import tempfile
from pathlib import Path

from schemas.repo_task import RepoTask

ENV = "RLBUS_REPO_TASKS"
INDEX = "index.json"
BUILD_HINT = (
    "rlbus tasks build repo --from-sdist inflection==0.5.1 toolz==1.0.0 "
    "[--out DIR] (the default cache is producers/repo_tasks/, or $RLBUS_REPO_TASKS)"
)


class TaskNotCached(KeyError):
    """The cache has no task with this id."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return str(self.args[0]) if self.args else ""


class CacheCorrupt(ValueError):
    """A cached task's content does not match the hash its index records."""


def default_cache_dir() -> Path:
    """`$RLBUS_REPO_TASKS` if set, else the committed `producers/repo_tasks/`."""
    env = os.environ.get(ENV)
    return Path(env) if env else Path(__file__).resolve().parent / "repo_tasks"


def _dir(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def read_index(cache_dir: str | Path | None = None) -> dict:
    """The cache's index (`{"tasks": {}, "packages": {}}` when there is none)."""
    path = _dir(cache_dir) / INDEX
    if not path.exists():
        return {"tasks": {}, "packages": {}}
    index = json.loads(path.read_text())
    index.setdefault("tasks", {})
    index.setdefault("packages", {})
    return index


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_index(index: dict, cache_dir: str | Path | None = None) -> None:
    """Replace the cache's index (sorted keys, one entry per line for readable diffs)."""
    text = json.dumps(index, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
    _write_atomic(_dir(cache_dir) / INDEX, text.encode())


def save_task(task: RepoTask, cache_dir: str | Path | None = None) -> Path:
    """Write `task` into the cache (see the module guarantees); returns its file's path."""
    root = _dir(cache_dir)
    index = read_index(root)
    digest = task.content_hash()
    name = f"{task.task_id}.json.xz"
    entry = {"content_hash": digest, "source": task.source, "files": len(task.files), "file": name}
    path = root / name
    if index["tasks"].get(task.task_id) == entry and path.exists():
        return path
    _write_atomic(path, lzma.compress(task.to_json().encode(), preset=9 | lzma.PRESET_EXTREME))
    index["tasks"][task.task_id] = entry
    write_index(index, root)
    return path


def record_package(spec: str, info: dict, cache_dir: str | Path | None = None) -> None:
    """Record a source package's facts (licence, sdist hash, build stats) in the index."""
    index = read_index(cache_dir)
    index["packages"][spec] = info
    write_index(index, cache_dir)


def _read(root: Path, task_id: str, entry: dict) -> RepoTask:
    task = RepoTask.from_json(lzma.decompress((root / entry["file"]).read_bytes()).decode())
    if task.content_hash() != entry["content_hash"] or task.task_id != task_id:
        raise CacheCorrupt(
            f"cached repo task {task_id!r} in {root} does not match its index hash; rebuild it: {BUILD_HINT}"
        )
    return task


def load_task(task_id: str, cache_dir: str | Path | None = None) -> RepoTask:
    """The cached task `task_id` (see the module guarantees)."""
    root = _dir(cache_dir)
    entry = read_index(root)["tasks"].get(task_id)
    if entry is not None:
        return _read(root, task_id, entry)
    if task_id.startswith("fixture-"):
        from producers import repo_fixtures

        fixture = repo_fixtures.fixture_tasks().get(task_id)
        if fixture is not None:
            return fixture
    raise TaskNotCached(
        f"no repo task {task_id!r} in the task cache {root}; list them with "
        f"`rlbus tasks list --domain repo`, build them with: {BUILD_HINT}"
    )


def list_tasks(cache_dir: str | Path | None = None) -> list[RepoTask]:
    """Every cached task, sorted by id (see the module guarantees)."""
    root = _dir(cache_dir)
    tasks = read_index(root)["tasks"]
    return [_read(root, tid, tasks[tid]) for tid in sorted(tasks)]


def package_licences(cache_dir: str | Path | None = None) -> dict[str, str]:
    """{"NAME==VERSION": licence} of the packages the cache's tasks were built from."""
    return {spec: info.get("licence", "unknown") for spec, info in read_index(cache_dir)["packages"].items()}
