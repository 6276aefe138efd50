"""One run's folder, `<run-dir>/<run_id>/`: every path and file in it, in one place.

    run.json        the launcher's record: run id, server URL (redacted), its monitoring URL, launcher, server
                    and worker pids (`Supervisor` keeps it current)
    config.json     the resolved config, URL passwords redacted (`up` and `init` write it)
    summary.json    the run's summary, current during the run, complete at the end
    model/base      the built tiny model (when `model.path` is empty)
    model/start     the warm-started model every role loads
    nats/           the embedded nats-server's JetStream store and its log
    logs/<role>.log each worker's output
    start.gate      exists once the launcher has the model and streams ready (`rlbus.run.startgate`)
    checkpoints/    the learner's checkpoints (`learner.pt`)

Guarantees:
- `rlbus.run` and `rlbus.commands` find the files and folders above here and spell none
  of their names themselves. (What other packages own keeps its own name: the roles
  below rlbus, e.g. the learner writing checkpoints/, cannot import this; the run store
  `run.db` is `scheduler.store`'s, the tool secret `secrets/` is
  `sandbox_workers.integrity`'s; `rlbus.report` and `rlbus.tracking` write their own
  outputs, report.md, plots/, tracking/, tensorboard/.)
- `state()` is run.json parsed: {} when it is missing, unreadable or not an object (it
  is replaced atomically by `write_state`, so a reader never sees half of one).
- `server_url()` is the server the run recorded (run.json's `nats_url`, else
  config.json's `run.nats_url`) with user and password stripped: the folder only keeps
  redacted URLs, the login comes from RLBUS_NATS_USER / RLBUS_NATS_PASSWORD. None when
  neither file names one.
- `alive(pid, needle)` is True only for a running, non-zombie process (one of another
  user counts); with `needle`, its command line must also contain it, so a recycled pid
  is never taken for the run's process.
- `RunFolder.find_active(run_dir)` is the single run under `run_dir` whose recorded
  launcher is alive; `RunNotFound` (saying what to pass) when there are none or several.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def alive(pid: int | None, needle: str | None = None) -> bool:
    """Whether `pid` runs (see the module guarantees)."""
    if not pid or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except OSError:
        return False
    proc = Path(f"/proc/{pid}")
    try:  # a zombie (an exited child not reaped yet) is dead too
        if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    if needle is None:
        return True
    try:
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return needle in cmdline


class RunNotFound(RuntimeError):
    """No run (or more than one) matches what was given; the message says what to pass."""


class RunFolder:
    """The folder of one run, `<run-dir>/<run_id>` (it need not exist yet)."""

    alive = staticmethod(alive)

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @classmethod
    def of(cls, run_dir: str | os.PathLike, run_id: str) -> RunFolder:
        """The folder of run `run_id` under `run_dir`."""
        return cls(Path(run_dir) / run_id)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    # -- paths --------------------------------------------------------------------------------
    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def config_json(self) -> Path:
        return self.path / "config.json"

    @property
    def summary_json(self) -> Path:
        return self.path / "summary.json"

    @property
    def reward_curve(self) -> Path:
        return self.path / "reward_curve.png"

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def base_model(self) -> Path:
        """Where a built tiny model goes before SFT (`model/base`)."""
        return self.model / "base"

    @property
    def start_model(self) -> Path:
        """The model every role starts from (`model/start`)."""
        return self.model / "start"

    @property
    def nats(self) -> Path:
        """The embedded nats-server's store directory."""
        return self.path / "nats"

    @property
    def server_log(self) -> Path:
        return self.nats / "nats-server.log"

    @property
    def start_gate(self) -> Path:
        """The start gate the workers `up` started early wait for (`rlbus.run.startgate`)."""
        return self.path / "start.gate"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def log(self, role: str) -> Path:
        """The log file of one role's worker."""
        return self.logs / f"{role}.log"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def learner_checkpoint(self) -> Path:
        """The learner's newest checkpoint (`checkpoints/learner.pt`)."""
        return self.checkpoints / "learner.pt"

    # -- contents -----------------------------------------------------------------------------
    def is_run(self) -> bool:
        """Whether this looks like a run folder (run.json, config.json or a nats/ store)."""
        return self.run_json.is_file() or self.config_json.is_file() or self.nats.is_dir()

    def state(self) -> dict:
        """run.json parsed; {} when there is none (see the module guarantees)."""
        return _json_object(self.run_json)

    def config(self) -> dict:
        """config.json parsed; {} when there is none."""
        return _json_object(self.config_json)

    def write_state(self, state: dict) -> None:
        """Replace run.json atomically."""
        tmp = self.run_json.with_name(self.run_json.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.run_json)

    def recorded_run_id(self) -> str:
        """The run id run.json or config.json records, else the folder's name."""
        return self.state().get("run_id") or (self.config().get("run") or {}).get("run_id") or self.path.name

    def server_url(self) -> str | None:
        """The recorded server URL without credentials (see the module guarantees)."""
        from schemas.redact import strip_credentials

        run = self.config().get("run")
        url = self.state().get("nats_url") or (run.get("nats_url") if isinstance(run, dict) else None)
        return strip_credentials(url) if isinstance(url, str) and url else None

    def launcher_alive(self) -> bool:
        """Whether the launcher run.json names is still running."""
        return alive(self.state().get("launcher_pid"))

    # -- finding runs -------------------------------------------------------------------------
    @classmethod
    def recorded(cls, run_dir: str | os.PathLike) -> list[RunFolder]:
        """Every folder under `run_dir` holding a run.json, by name."""
        root = Path(run_dir)
        if not root.is_dir():
            return []
        return [f for f in map(cls, sorted(root.iterdir())) if f.run_json.is_file()]

    @classmethod
    def find_active(cls, run_dir: str | os.PathLike) -> RunFolder:
        """The single run under `run_dir` whose launcher is alive; RunNotFound otherwise."""
        active = [f for f in cls.recorded(run_dir) if f.launcher_alive()]
        if len(active) != 1:
            found = ", ".join(f.recorded_run_id() for f in active) or "none"
            raise RunNotFound(f"{len(active)} active runs under {run_dir} ({found}); pass --run-id")
        return active[0]


def find_run(run_dir: Path | None, run_id: str | None, nats_url: str | None) -> tuple[str | None, str | None]:
    """(run_id, server URL) from the flags: with `run_dir`, the named run's folder (or the
    single active one) fills in what was not given; RunNotFound when it has no run.json."""
    if run_dir is None:
        return run_id, nats_url
    folder = RunFolder.of(run_dir, run_id) if run_id else RunFolder.find_active(run_dir)
    if not folder.state():
        raise RunNotFound(f"no run.json for run {run_id!r} under {run_dir}; pass --nats-url")
    return folder.recorded_run_id(), nats_url or folder.server_url()


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
