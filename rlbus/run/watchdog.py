"""What `rlbus up` watches besides crashed workers: its own nats-server, frozen workers,
and the JetStream store's disk.

Guarantees:
- `ServerKeeper.check()` restarts the run's embedded nats-server (owned, or adopted on
  `--resume`) when its process has died, on the same port and the same store, so every
  worker's reconnect loop finds it again; it returns what it did, for the console. It
  raises `FatalStop` (a plain message plus the command that continues the run) when the
  server will not come back after `SERVER_RESTARTS` tries or within its start timeout.
- `HeartbeatWatch.hung(...)` names the supervised roles whose process sent heartbeats
  and then none for `timeout_s` while the launcher itself was connected all that time
  (a server outage or a reconnect pauses the clock: no worker can report then). A
  process that never reported is left alone (it is still starting).
- `store_full(...)` is a `FatalStop` when the disk under the JetStream store has less
  than `MIN_FREE_BYTES` free or the server logged that it ran out of storage: the
  message names the store, the free space, what to free, and the `--resume` command.
- Nothing here consumes or publishes; it reads process states, the server log and
  `shutil.disk_usage`.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from bus.server import EmbeddedNats
from rlbus.run.folder import alive

SERVER_RESTARTS = 5
MIN_FREE_BYTES = 8 * 1024**2
"""Below this much free disk under the store, JetStream writes fail (or soon will): stop."""
OUT_OF_STORAGE = (
    "no space left on device",
    "insufficient storage",
    "resource limits exceeded",
    "out of resources",
    "will be disabled",
)
"""Phrases nats-server logs when its file store cannot write (lower case)."""


class FatalStop(Exception):
    """A fault the run cannot heal by itself: `message` says what happened and `next_step` what to run."""

    def __init__(self, fault: str, message: str, next_step: str):
        super().__init__(f"{message}; {next_step}")
        self.fault, self.message, self.next_step = fault, message, next_step


def resume_command(run_path: Path) -> str:
    """The exact command that continues this run."""
    return f"rlbus up --resume {run_path}"


class ServerKeeper:
    """The run's own nats-server (None when the run uses an external one: nothing to keep)."""

    def __init__(self, server, store_dir: Path, run_path: Path):
        self.server, self.store_dir, self.run_path = server, store_dir, run_path
        self.restarts = 0
        self.restarted_at: float | None = None

    @property
    def pid(self) -> int | None:
        """The current server's pid (None without an own server)."""
        return self.server.pid if self.server else None

    @property
    def monitor_url(self) -> str | None:
        """The own server's monitoring endpoint (None without an own server or monitor port)."""
        return getattr(self.server, "monitor_url", None) if self.server else None

    def dead(self) -> bool:
        """Whether the own server's process is gone."""
        if self.server is None:
            return False
        proc = getattr(self.server, "proc", None)
        return proc.poll() is not None if proc is not None else not alive(self.server.pid)

    def check(self) -> str | None:
        """Restart a dead server on its port and store; the console line, or None when it runs."""
        if not self.dead():
            return None
        old_pid = self.server.pid
        self.restarts += 1
        if self.restarts > SERVER_RESTARTS:
            raise FatalStop(
                "nats-server",
                f"the run's nats-server died {self.restarts} times (see {self.store_dir / 'nats-server.log'})",
                f"continue with: {resume_command(self.run_path)}",
            )
        port = urlparse(self.server.url).port
        t0 = time.monotonic()
        try:
            monitor_port = getattr(self.server, "monitor_port", None)  # the same /jsz as run.json records
            self.server = EmbeddedNats(self.store_dir, port=port, monitor_port=monitor_port).start()
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise FatalStop(
                "nats-server",
                f"the run's nats-server (pid {old_pid}) died and did not restart on "
                f"{self.store_dir}: {str(exc)[-300:]}",
                f"continue with: {resume_command(self.run_path)}",
            ) from exc
        self.restarted_at = time.monotonic()
        return (
            f"nats-server (pid {old_pid}) died: restarted on the same store at {self.server.url} in "
            f"{self.restarted_at - t0:.1f}s (pid {self.server.pid}); workers reconnect"
        )

    def stop(self) -> None:
        """Stop the own server (by pid)."""
        if self.server is not None:
            self.server.stop()


def store_full(store_dir: Path, run_path: Path, log_offset: int = 0) -> FatalStop | None:
    """A FatalStop when the store's disk is (nearly) full or the server logged running out of storage."""
    try:
        usage = shutil.disk_usage(store_dir)
    except OSError:
        return None
    logged = _storage_errors(store_dir / "nats-server.log", log_offset)
    if usage.free >= MIN_FREE_BYTES and not logged:
        return None
    js_dir = store_dir / "jetstream" if (store_dir / "jetstream").is_dir() else store_dir
    used = sum(f.stat().st_size for f in js_dir.rglob("*") if f.is_file())
    need = max(256 * 1024**2, used)
    why = f" (nats-server: {logged})" if logged else ""
    return FatalStop(
        "store-full",
        f"the JetStream store at {store_dir} is out of disk space: {usage.free / 2**20:.1f} MiB "
        f"free of {usage.total / 2**20:.0f} MiB{why}; the store holds {used / 2**20:.1f} MiB",
        f"free at least {need / 2**20:.0f} MiB on that disk, then continue with: {resume_command(run_path)}",
    )


def log_size(path: Path) -> int:
    """Current size of a log (where to start reading new lines)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _storage_errors(path: Path, offset: int) -> str | None:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for raw in text.splitlines():
        low = raw.lower()
        if "jetstream" in low and any(p in low for p in OUT_OF_STORAGE) or "no space left on device" in low:
            return raw.strip()[-200:]
    return None


@dataclass
class HeartbeatWatch:
    """Last heartbeat per worker pid (fed by the Monitor) and who has gone quiet."""

    timeout_s: float
    last: dict[int, float] = field(default_factory=dict)
    quiet_since: float = field(default_factory=time.monotonic)
    """The clock starts again here: launcher (re)connected, server restarted."""

    def seen(self, pid: int) -> None:
        """A heartbeat from `pid` arrived now."""
        self.last[pid] = time.monotonic()

    def pause(self) -> None:
        """Restart every clock (the bus was away: nobody could report)."""
        self.quiet_since = time.monotonic()

    def hung(self, procs: dict, connected: bool) -> list[tuple[str, int, float]]:
        """(role, pid, seconds quiet) of every live supervised process silent for longer than the timeout."""
        if not connected or self.timeout_s <= 0:
            self.pause()
            return []
        now, out = time.monotonic(), []
        for role, proc in procs.items():
            seen = self.last.get(proc.pid)
            if seen is None or proc.poll() is not None:
                continue
            quiet = now - max(seen, self.quiet_since)
            if quiet > self.timeout_s:
                out.append((role, proc.pid, quiet))
        return out
