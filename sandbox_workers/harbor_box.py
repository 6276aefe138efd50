"""A Harbor task's own container: the agent acts in it, then it is handed to the verifier.

Guarantees:
- `HarborBox.create(spec, run_id, episode)` starts a container of `spec.image` (a task image
  built by `harbor_images`) with the task's limits: `cpus`, `memory_mb` (no swap), a pids
  limit, a per-file size limit of `storage_mb`, and no network unless `spec.network` (the
  task's `allow_internet` AND the operator's `harbor.allow_internet`). Its main process is
  the engine's init plus `sleep infinity`; it is labelled with the run, the episode and an
  expiry (`handover_ttl_s`), so `reap_expired` removes one nobody verified.
- `exec(argv, timeout, cwd)` runs one command as the task's agent user and always returns
  an `ExecResult` (head+tail capped output, `timed_out`): the command runs under the
  image's `timeout` when it has one, and the host stops waiting at the deadline plus a grace
  whatever the container does (a replaced `timeout` binary only hurts the agent's own episode).
- `read_file` / `write_file` go through the engine's archive API (no program of the image
  runs): any absolute path, or one relative to the working directory.
- `rw_bytes()` is the engine's size of the container's writable layer (the storage check).
- Engine failures raise `HarborEngineError` (infrastructure: retried, never a reward).
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
from dataclasses import dataclass

from sandbox_workers.base import MIB, ExecResult, HeadTailBuffer

LABEL = "rlbus.harbor"
RUN_LABEL = "rlbus.harbor.run"
EPISODE_LABEL = "rlbus.harbor.episode"
TASK_LABEL = "rlbus.harbor.task"
EXPIRES_LABEL = "rlbus.harbor.expires"
KILL_GRACE_S = 5.0
MAX_READ_BYTES = 16 * MIB


class HarborEngineError(RuntimeError):
    """The docker engine or the container failed (not the agent): infrastructure."""


@dataclass(frozen=True)
class BoxSpec:
    """What one episode's container is made from (the public `verifier_params["harbor"]`)."""

    image: str
    task_hash: str
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    network: bool = False
    user: str = "root"
    workdir: str = ""
    pids: int = 256
    ttl_s: float = 3600.0

    @classmethod
    def from_params(cls, p: dict) -> BoxSpec:
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in p.items() if k in keys})


def client():
    """The process's docker client (`docker_engine.get_client`), or HarborEngineError."""
    try:
        from sandbox_workers.docker_engine import get_client

        return get_client()
    except Exception as exc:
        raise HarborEngineError(f"no docker engine answers: {type(exc).__name__}: {exc}") from exc


def _user(name: str) -> str:
    return "0:0" if name in ("", "root") else name


class HarborBox:
    """One running task container (see the module guarantees)."""

    def __init__(self, cid: str, spec: BoxSpec, workdir: str) -> None:
        self.id, self.spec, self.workdir = cid, spec, workdir or "/"
        self.labels: dict[str, str] = {}
        self.running, self.paused = True, False
        self.api = client().api

    @classmethod
    def create(cls, spec: BoxSpec, run_id: str, episode: str) -> HarborBox:
        """Start the episode's container (HarborEngineError when the engine or image fails)."""
        api = client().api  # first: `get_client` imports docker whole (a bare `docker.types` import races it)
        from docker.types import LogConfig, Ulimit

        labels = {
            LABEL: "1",
            RUN_LABEL: run_id,
            EPISODE_LABEL: episode,
            TASK_LABEL: spec.task_hash,
            EXPIRES_LABEL: str(int(time.time() + spec.ttl_s)),
        }
        fsize = spec.storage_mb * MIB
        host = api.create_host_config(
            init=True,
            network_mode="bridge" if spec.network else "none",
            mem_limit=spec.memory_mb * MIB,
            memswap_limit=spec.memory_mb * MIB,
            nano_cpus=int(spec.cpus * 1e9),
            pids_limit=spec.pids,
            ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize), Ulimit(name="core", soft=0, hard=0)],
            security_opt=["no-new-privileges"],
            log_config=LogConfig(type="none"),
        )
        try:
            info = api.inspect_image(spec.image)
            workdir = spec.workdir or (info.get("Config") or {}).get("WorkingDir") or "/"
            made = api.create_container(
                spec.image,
                command=["sleep", "infinity"],
                entrypoint=[],
                user="0:0",
                labels=labels,
                host_config=host,
                network_disabled=not spec.network,
                working_dir=workdir,
            )
            api.start(made["Id"])
        except Exception as exc:
            raise HarborEngineError(f"container of {spec.image} did not start: {type(exc).__name__}: {exc}") from exc
        return cls(made["Id"], spec, workdir)

    @classmethod
    def attach(cls, cid: str, spec: BoxSpec) -> HarborBox:
        """The existing container `cid` (HarborEngineError when it is gone); `running` says
        whether it still runs (the agent may have stopped its init), `paused` whether it is paused."""
        api = client().api
        try:
            info = api.inspect_container(cid)
        except Exception as exc:
            raise HarborEngineError(f"the episode's container {cid[:12]} is gone: {exc}") from exc
        box = cls(cid, spec, (info.get("Config") or {}).get("WorkingDir") or "/")
        box.labels = (info.get("Config") or {}).get("Labels") or {}
        state = info.get("State") or {}
        box.running, box.paused = bool(state.get("Running")), bool(state.get("Paused"))
        return box

    def path(self, path: str) -> str:
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))

    def exec(
        self,
        argv: list[str],
        timeout: float,
        cwd: str = "",
        cap: int = 1 * MIB,
        user: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `argv` (see the module guarantees); never raises for what the command does."""
        wrapped = ["timeout", "-k", "2", f"{max(1, int(timeout))}", *argv]
        t0 = time.monotonic()
        code, out, err, finished = self._run(wrapped, t0 + timeout + KILL_GRACE_S, cwd, cap, user, env)
        if code in (126, 127) and b"executable file not found" in bytes(out.head) + bytes(err.head):
            code, out, err, finished = self._run(
                list(argv), t0 + timeout, cwd, cap, user, env
            )  # no `timeout` in the image
        timed_out = not finished or (code in (124, 137) and time.monotonic() - t0 >= timeout)
        return ExecResult(
            exit_code=124 if code is None else code,
            stdout=_text(out),
            stderr=_text(err),
            timed_out=timed_out,
            truncated=out.truncated or err.truncated,
            duration_ms=(time.monotonic() - t0) * 1000,
            isolation="docker",
        )

    def _run(self, argv, deadline, cwd, cap, user, env):
        from sandbox_workers.docker_pool import Exec

        out, err = HeadTailBuffer(cap), HeadTailBuffer(cap)
        try:
            ex = Exec(
                self.api,
                self.id,
                argv,
                user=_user(user or self.spec.user),
                workdir=self.path(cwd or "."),
                environment=env,
            )
        except Exception as exc:
            raise HarborEngineError(f"exec in {self.id[:12]} failed: {type(exc).__name__}: {exc}") from exc
        try:
            finished = ex.pump({1: out, 2: err}, deadline)
            code = ex.exit_code() if finished else None
        except OSError as exc:
            raise HarborEngineError(f"exec in {self.id[:12]} broke: {exc}") from exc
        finally:
            ex.close()
        return code, out, err, finished

    def read_file(self, path: str) -> bytes:
        """A regular file's bytes (FileNotFoundError / IsADirectoryError / ValueError for the rest)."""
        import docker

        full = self.path(path)
        try:
            stream, stat = self.api.get_archive(self.id, full)
        except docker.errors.NotFound:
            raise FileNotFoundError(full) from None
        except Exception as exc:
            raise HarborEngineError(f"reading {full}: {exc}") from exc
        data = read_tar_file(stream, MAX_READ_BYTES)
        if data is None:
            raise IsADirectoryError(f"{full} is not a regular file")
        return data

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace `path` (parents created)."""
        full = self.path(path)
        parent, name = posixpath.split(full)
        self.put_tree(parent, {name: data}, mode)

    def put_tree(self, at: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        """Write `files` (relative paths) under directory `at`, creating parents, through the engine."""
        try:
            self.mkdirs(at)
            self.api.put_archive(self.id, at, tar_of(files, mode))
        except Exception as exc:
            raise HarborEngineError(f"writing under {at}: {type(exc).__name__}: {exc}") from exc

    def mkdirs(self, at: str) -> None:
        """Make directory `at` and its parents through the engine (an archive of directories at /)."""
        parts = [p for p in at.strip("/").split("/") if p]
        if parts:
            self.api.put_archive(self.id, "/", tar_of({}, dirs=["/".join(parts)]))

    def rw_bytes(self) -> int:
        """Bytes in the container's writable layer (the engine's `SizeRw`)."""
        try:
            rows = self.api.containers(all=True, size=True, filters={"id": self.id})
        except Exception as exc:
            raise HarborEngineError(f"size of {self.id[:12]}: {exc}") from exc
        return int(rows[0].get("SizeRw") or 0) if rows else 0

    def remove(self) -> None:
        """Remove the container (idempotent; engine errors ignored)."""
        try:
            self.api.remove_container(self.id, force=True, v=True)
        except Exception:  # noqa: BLE001 - already gone, or the reaper gets it
            pass


def tar_of(files: dict[str, bytes], mode: int = 0o644, dirs: list[str] | tuple[str, ...] = ()) -> bytes:
    """A tar of `files` (relative paths; `.sh` files 0755, others `mode`) and of `dirs`, with every
    parent directory of both as a 0755 entry (what `put_archive` extracts)."""
    wanted = [*dirs, *(posixpath.dirname(p) for p in files)]
    parents = {"/".join(d.split("/")[:i]) for d in wanted if d for i in range(1, d.count("/") + 2)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in sorted(parents):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for rel, data in sorted(files.items()):
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), (0o755 if rel.endswith(".sh") else mode)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _text(buf: HeadTailBuffer) -> str:
    data = bytes(buf.head) + (b"\n[... output truncated ...]\n" if buf.truncated else b"") + bytes(buf.tail)
    return data.decode("utf-8", "replace")


def read_tar_file(stream, limit: int) -> bytes | None:
    """The bytes of the single regular file an archive stream holds (None: it is not a regular
    file: a directory, a symlink, a device); more than `limit` bytes raises ValueError."""
    raw = b"".join(stream)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        first = tar.next()
        if first is None or not first.isreg():
            return None
        if first.size > limit:
            raise ValueError(f"{first.name}: {first.size} bytes is over the {limit}-byte read limit")
        f = tar.extractfile(first)
        return f.read() if f else None


def remove_container(cid: str) -> None:
    """Remove container `cid` (idempotent; engine errors ignored: the reaper gets it)."""
    try:
        client().api.remove_container(cid, force=True, v=True)
    except Exception:  # noqa: BLE001
        pass


def reap_expired(now: float | None = None) -> list[str]:
    """Remove every Harbor container past its expiry label; the ids removed."""
    api = client().api
    now = time.time() if now is None else now
    gone = []
    for row in api.containers(all=True, filters={"label": LABEL}):
        expires = float((row.get("Labels") or {}).get(EXPIRES_LABEL) or 0)
        if expires and expires < now:
            try:
                api.remove_container(row["Id"], force=True, v=True)
                gone.append(row["Id"])
            except Exception:  # noqa: BLE001 - raced with its verifier
                pass
    return gone
