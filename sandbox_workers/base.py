"""The Sandbox interface every backend implements, its result and limit types.

Guarantees every backend gives (tests hold each backend to them):

- `execute` always returns an `ExecResult`; a command that hangs, floods output, forks
  without end or allocates too much is a *result* (`timed_out`, `truncated`, `oom`, a
  nonzero `exit_code`), never an exception and never a hung caller.
- `execute` never returns later than about `timeout` plus a short kill grace, and when
  it returns no process started by that call is still alive.
- stdout and stderr are each capped at `Limits.output_cap_bytes`: the head and the tail
  are kept, the middle is replaced by one marker line, and `truncated` is set. The host
  never buffers more than the cap per stream, whatever the command writes.
- `exit_code` follows the shell convention: 128+N when the command died of signal N.
- `isolation` says what actually contained the command: "bwrap", "docker", or
  "degraded" (rlimits only: the backend ran it only because degraded mode was allowed
  on purpose, and logs a warning when it degrades).
- A backend that cannot isolate raises `SandboxRefused` from `start` (fail closed):
  an infrastructure error for whoever asked (the task is retried or dead-lettered),
  never a command result and never a reward of 0.
- File paths given to `read_file`/`write_file` are relative to the work dir (or
  absolute under `/work`); they never resolve outside it, symlinks included.
- `reset` leaves an empty work dir and no process; `close` is idempotent.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from typing import Literal, Self

Isolation = Literal["bwrap", "degraded", "docker"]

MIB = 1024 * 1024
WORK_DIR = "/work"


class SandboxRefused(RuntimeError):
    """The backend cannot isolate here and degraded mode was not allowed; the message names the fix."""


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandbox (applied to every `execute`)."""

    memory_mb: int = 256
    """Address space / memory limit of the command."""
    pids: int = 64
    """Most processes (and threads) the sandbox may hold at once."""
    cpu_seconds: int = 10
    """CPU time per `execute` (RLIMIT_CPU)."""
    file_size_mb: int = 16
    """Largest file the command may write (RLIMIT_FSIZE)."""
    nofile: int = 256
    """Most open file descriptors per process."""
    output_cap_bytes: int = 1 * MIB
    """Cap on stdout and on stderr each (head + tail kept)."""
    tmp_mb: int = 64
    """Size of the tmpfs mounted at /tmp (where the backend can size it)."""


@dataclass
class ExecResult:
    """What one `execute` did."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    oom: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
    isolation: Isolation = "degraded"

    def to_dict(self) -> dict:
        """A plain dict (for JSON / msgpack)."""
        return asdict(self)


class Sandbox(abc.ABC):
    """One isolated place to run commands, with a persistent work dir at `/work`."""

    @abc.abstractmethod
    def start(self, image: str | None = None, limits: Limits | None = None, timeout: float = 30.0) -> None:
        """Prepare the sandbox (image: backend-specific; timeout: default per exec)."""

    @abc.abstractmethod
    def execute(self, cmd: list[str] | str, timeout: float | None = None) -> ExecResult:
        """Run `cmd` (argv list, or a string run by `/bin/sh -c`) in the work dir."""

    @abc.abstractmethod
    def read_file(self, path: str) -> bytes:
        """Bytes of a regular file in the work dir."""

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file in the work dir (parents created)."""

    def write_files(self, files: list[tuple[str, bytes]]) -> None:
        """Write several files in order (same rules as `write_file`); backends may do it in one
        round trip (docker: one exec)."""
        for path, data in files:
            self.write_file(path, data)

    @abc.abstractmethod
    def reset(self) -> None:
        """Kill everything and give back an empty work dir (a fresh sandbox)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sandbox_path_parts(path: str) -> list[str]:
    """The components of a work-dir path, lexically normalized (never empty, never "..").

    `path` is relative to the work dir or absolute under `/work`; "" and "." components
    are dropped. Raises ValueError for an absolute path outside `/work`, for a path with
    no name left, and for any ".." component (so the result never climbs out of `/work`;
    symlinks are the backend's business).
    """
    if path.startswith(WORK_DIR + "/"):
        path = path[len(WORK_DIR) + 1 :]
    elif path.startswith("/"):
        raise ValueError(f"path outside {WORK_DIR}: {path!r}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"bad sandbox path: {path!r}")
    return parts


def truncation_marker(dropped: int) -> bytes:
    """The line that replaces the dropped middle of a capped stream."""
    return f"\n...[truncated {dropped} bytes]...\n".encode()


class HeadTailBuffer:
    """Streaming cap: keeps the first cap//2 and the last cap - cap//2 bytes.

    Memory stays O(cap) whatever is fed; `truncated` is set once bytes were dropped.
    """

    def __init__(self, cap: int) -> None:
        self.cap = max(0, int(cap))
        self.head_cap = self.cap // 2
        self.tail_cap = self.cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk or self.tail_cap == 0:
            return
        if len(chunk) >= self.tail_cap:
            self.tail = bytearray(chunk[-self.tail_cap :])
        else:
            self.tail += chunk
            extra = len(self.tail) - self.tail_cap
            if extra > 0:
                del self.tail[:extra]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def getvalue(self) -> bytes:
        if not self.truncated:
            return bytes(self.head + self.tail)
        dropped = self.total - len(self.head) - len(self.tail)
        return bytes(self.head) + truncation_marker(dropped) + bytes(self.tail)


def cap_output(data: bytes, cap: int) -> tuple[bytes, bool]:
    """Cap `data` to `cap` bytes keeping head and tail; returns (bytes, truncated)."""
    buf = HeadTailBuffer(cap)
    buf.feed(data)
    return buf.getvalue(), buf.truncated


def decode_output(data: bytes) -> str:
    """Bytes from a command as text (invalid UTF-8 replaced, never raises)."""
    return data.decode("utf-8", errors="replace")
