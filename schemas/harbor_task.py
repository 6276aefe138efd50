"""Harbor task directories, read natively (`tomllib` only; the `harbor` package is never imported).

A task is a directory: `instruction.md`, `task.toml`, `environment/Dockerfile` (unless
`[environment].docker_image`), `tests/test.sh` plus the rest of `tests/`, and optionally
`solution/solve.sh` (the oracle).

Guarantees (`read_task(path)`, pure apart from reading the directory):
- A missing `instruction.md` or `task.toml` raises `HarborTaskError` naming the file; a TOML
  error names the file and the line; a `version` above `MAX_VERSION` (1.4) or one that is not
  a number is an error.
- Unknown keys are ignored; each unknown key is warned about once per process (`warned`).
- A task that cannot run here is still read, with `refusal` set to why (no `tests/test.sh`,
  `[[steps]]` multi-step tasks, neither a Dockerfile nor a `docker_image`); whoever runs it
  disables it with that reason, and the run goes on.
- `content_hash` is the sha256 of every file of the directory (relative path and bytes, in
  sorted order; `.git` and `__pycache__` skipped); `env_hash` the same over `environment/`
  (or of the `docker_image` name), the image cache key. `task_id` is `<dir name>-<hash[:12]>`.
- `tests` and `solution` hold the bytes of those folders' files (path relative to the folder):
  the tests go only to the hidden bucket, never into a public task.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()

MAX_VERSION = (1, 4)
SKIP_PARTS = frozenset({".git", "__pycache__", ".pytest_cache"})
MAX_TASK_BYTES = 64 << 20
KNOWN: dict[str, frozenset[str]] = {
    "": frozenset({"version", "metadata", "verifier", "agent", "environment", "steps", "source", "solution"}),
    "verifier": frozenset({"timeout_sec", "env", "user"}),
    "agent": frozenset({"timeout_sec", "user"}),
    "environment": frozenset(
        {"docker_image", "build_timeout_sec", "cpus", "memory_mb", "storage_mb", "allow_internet", "memory", "storage"}
    ),
}
"""Keys read per table ("" = top level); `metadata` is free-form."""
_warned: set[str] = set()


class HarborTaskError(ValueError):
    """A task directory that cannot be read; the message names the file (and line) and what to fix."""


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task directory, as read (see the module guarantees)."""

    name: str
    path: str
    instruction: str
    version: str
    metadata: dict[str, Any]
    verifier_timeout_s: float
    verifier_env: dict[str, str]
    verifier_user: str
    agent_timeout_s: float
    agent_user: str
    docker_image: str
    build_timeout_s: float
    cpus: float
    memory_mb: int
    storage_mb: int
    allow_internet: bool
    content_hash: str
    env_hash: str
    tests: dict[str, bytes] = field(repr=False)
    solution: dict[str, bytes] = field(repr=False)
    environment: dict[str, bytes] = field(repr=False)
    refusal: str = ""
    """Why this task cannot run ("" when it can)."""

    @property
    def task_id(self) -> str:
        return f"{self.name}-{self.content_hash[:12]}"

    @property
    def oracle(self) -> str:
        """The text of `solution/solve.sh` ("" when the task has none)."""
        return self.solution.get("solve.sh", b"").decode("utf-8", "replace")


def warned() -> set[str]:
    """The unknown keys warned about so far in this process."""
    return set(_warned)


def _files(root: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if not root.is_dir():
        return out
    total = 0
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part in SKIP_PARTS for part in rel.parts) or not p.is_file():
            continue
        data = p.read_bytes()
        total += len(data)
        if total > MAX_TASK_BYTES:
            raise HarborTaskError(f"{root}: more than {MAX_TASK_BYTES >> 20} MiB of files; a task carries small files")
        out[rel.as_posix()] = data
    return out


def tree_hash(files: dict[str, bytes]) -> str:
    """sha256 over (path, size, bytes) of `files` in sorted order."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + str(len(files[rel])).encode() + b"\0" + files[rel])
    return h.hexdigest()


def _warn_unknown(table: str, data: dict, where: Path) -> None:
    for key in sorted(set(data) - KNOWN[table]):
        dotted = f"{table}.{key}" if table else key
        if dotted not in _warned:
            _warned.add(dotted)
            log.warning("harbor task.toml: unknown key ignored", key=dotted, file=str(where))


def _version(raw: Any, where: Path) -> str:
    text = str(raw if raw is not None else "1.0")
    try:
        parts = tuple(int(x) for x in text.split("."))
    except ValueError:
        raise HarborTaskError(f'{where}: version {text!r} is not a version number (e.g. "1.0")') from None
    if parts[:2] > MAX_VERSION:
        raise HarborTaskError(
            f"{where}: task schema version {text} is newer than the {MAX_VERSION[0]}.{MAX_VERSION[1]} read here"
        )
    return text


def _table(doc: dict, name: str, where: Path) -> dict:
    got = doc.get(name) or {}
    if not isinstance(got, dict):
        raise HarborTaskError(f"{where}: [{name}] must be a table")
    _warn_unknown(name, got, where)
    return got


def _num(table: dict, key: str, default: float, where: Path) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise HarborTaskError(f"{where}: {key} = {value!r} must be a positive number")
    return float(value)


def _load_toml(where: Path) -> dict:
    try:
        return tomllib.loads(where.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{where}: TOML error: {exc}") from None  # the message carries line and column


def _refusal(doc: dict, tests: dict, env: dict, image: str) -> str:
    if doc.get("steps"):
        return "multi-step tasks ([[steps]]) are not supported by rlbus yet; split the steps into separate tasks"
    if "test.sh" not in tests:
        return "tests/test.sh is missing"
    if not image and "Dockerfile" not in env:
        return "neither environment/Dockerfile nor [environment].docker_image is given"
    return ""


def read_task(path: str | Path) -> HarborTask:
    """The Harbor task in directory `path` (see the module guarantees)."""
    root = Path(path)
    for need in ("instruction.md", "task.toml"):
        if not (root / need).is_file():
            raise HarborTaskError(f"{root / need}: missing; a Harbor task directory needs instruction.md and task.toml")
    toml_path = root / "task.toml"
    doc = _load_toml(toml_path)
    _warn_unknown("", doc, toml_path)
    version = _version(doc.get("version"), toml_path)
    ver, agent, env_t = (_table(doc, t, toml_path) for t in ("verifier", "agent", "environment"))
    metadata = doc.get("metadata") or {}
    files = _files(root)
    tests = {k[len("tests/") :]: v for k, v in files.items() if k.startswith("tests/")}
    solution = {k[len("solution/") :]: v for k, v in files.items() if k.startswith("solution/")}
    environment = {k[len("environment/") :]: v for k, v in files.items() if k.startswith("environment/")}
    image = str(env_t.get("docker_image") or "")
    env_hash = hashlib.sha256(f"image:{image}".encode()).hexdigest() if image else tree_hash(environment)
    memory = env_t.get("memory_mb", 2048)
    storage = env_t.get("storage_mb", 10240)
    return HarborTask(
        name=root.name,
        path=str(root.resolve()),
        instruction=(root / "instruction.md").read_text(encoding="utf-8"),
        version=version,
        metadata=dict(metadata) if isinstance(metadata, dict) else {"value": metadata},
        verifier_timeout_s=_num(ver, "timeout_sec", 600, toml_path),
        verifier_env={str(k): str(v) for k, v in (ver.get("env") or {}).items()},
        verifier_user=str(ver.get("user") or "root"),
        agent_timeout_s=_num(agent, "timeout_sec", 600, toml_path),
        agent_user=str(agent.get("user") or "root"),
        docker_image=image,
        build_timeout_s=_num(env_t, "build_timeout_sec", 600, toml_path),
        cpus=_num(env_t, "cpus", 1, toml_path),
        memory_mb=int(_num({"memory_mb": memory}, "memory_mb", 2048, toml_path)),
        storage_mb=int(_num({"storage_mb": storage}, "storage_mb", 10240, toml_path)),
        allow_internet=bool(env_t.get("allow_internet", False)),
        content_hash=tree_hash(files),
        env_hash=env_hash,
        tests=tests,
        solution=solution,
        environment=environment,
        refusal=_refusal(doc, tests, environment, image),
    )


def find_tasks(pattern: str, base: Path | None = None) -> list[Path]:
    """The task directories a glob names (relative to `base`, default the cwd), sorted; a
    directory counts when it holds `task.toml` or `instruction.md` (a broken one is then read
    and refused by `read_task`, never silently skipped)."""
    base = base or Path.cwd()
    p = Path(pattern)
    matches = (
        sorted(Path(p.anchor).glob(str(p.relative_to(p.anchor)))) if p.is_absolute() else sorted(base.glob(pattern))
    )
    return [m for m in matches if m.is_dir() and ((m / "task.toml").exists() or (m / "instruction.md").exists())]
