"""Tool-result integrity: every observation the model saw must come from a real execution.

The sandbox side records each execution as an `ExecRecord` in the run's KV bucket
`toolrec-<run>` (key = exec_id). The record's `digest` is
HMAC-SHA256(secret, exec_id + observation_text) (UTF-8, no separator; exec_id is always
32 lowercase hex chars), where `observation_text` is `render_observation(result)`, the
exact text appended to the model's context. Verifiers hold the same secret and check
every observation-looking block of a trajectory against those records.

Observation format (the canonical text; the digest covers it byte for byte):

    <obs exit=CODE[ timeout][ oom][ trunc]>
    STDOUT (at most `max_stdout` chars: head + "…[N chars cut]…" + tail; omitted if empty;
            `trunc` set when cut; callers may ask for other caps: `obs_caps`)
    <err>STDERR TAIL (last `max_stderr` chars, "…" prefixed when cut)</err>   (omitted if empty)
    </obs>

e.g. `<obs exit=0>\\n4\\n</obs>` or `<obs exit=124 timeout>\\n</obs>`. Inside the block any
text that looks like an obs tag (`<obs`, `</obs`, any case, spaces allowed) is written as
`&lt;obs` / `&lt;/obs`, so command output can never open or close a block.

Guarantees:
- `find_observations(text)` returns every block that looks like an observation
  (`<obs ...>` up to `</obs>`, or to the end of the text when unclosed), any case.
- `verify_observations` puts a block in `ok` only when the turn carrying it names an
  exec_id whose record exists and whose digest matches the block; each record vouches
  for at most one block. Everything else (edited text, a block the policy typed, a
  replayed block, a record missing) lands in `forged` with the reason.
- Without the secret no one can write a record that verifies, so write access to the
  KV bucket alone does not let a rollout process forge tool results.

Trust: the sandbox service (`sandbox_workers.service`) holds the secret; rollout
workers using it remotely never do. `LocalRecorder` is for a rollout worker that runs
its own sandbox in-process: that path trusts the rollout process with the secret (it
could forge records), so use the remote service where the policy side is untrusted.

The secret comes from env `RLBUS_TOOL_SECRET` (text) or the file named by
`RLBUS_TOOL_SECRET_FILE`; `load_or_create_secret(run_path)` falls back to
`<run_path>/secrets/tool_key` (created 0600) for the local launcher.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import secrets
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from bus.subjects import Registry, stream_replicas
from sandbox_workers.base import ExecResult

log = structlog.get_logger()

SECRET_ENV = "RLBUS_TOOL_SECRET"
SECRET_FILE_ENV = "RLBUS_TOOL_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_STDOUT = 1000
MAX_STDERR = 600
MAX_CMD_CHARS = 4096
MAX_CAP_CHARS = 256 * 1024
"""Largest observation cap a caller may ask for (`obs_caps`)."""
_EXEC_ID = re.compile(r"^[0-9a-f]{32}$")
_TAG_LIKE = re.compile(r"<(\s*/?\s*obs)", re.IGNORECASE)
_BLOCK = re.compile(r"<\s*obs\b[^>]*>.*?(?:<\s*/\s*obs\s*>|\Z)", re.IGNORECASE | re.DOTALL)


class SecretMissing(RuntimeError):
    """No tool-result secret is configured."""


class RecordFailed(RuntimeError):
    """An execution ran but its record could not be stored (an infra error: retry)."""


# -- the observation text ---------------------------------------------------------
def _escape(text: str) -> str:
    return _TAG_LIKE.sub(r"&lt;\1", text)


def _clip_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    return f"{text[:head]}…[{len(text) - head - tail} chars cut]…{text[-tail:]}"


def _clip_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-limit:]


def obs_caps(caps: tuple[int, int] | None) -> tuple[int, int]:
    """(max_stdout, max_stderr) chars of an observation: `caps` when given (each at least 64 and at
    most MAX_CAP_CHARS), else the defaults MAX_STDOUT, MAX_STDERR."""
    if caps is None:
        return MAX_STDOUT, MAX_STDERR
    return tuple(min(MAX_CAP_CHARS, max(64, int(c))) for c in caps)


def render_observation(result: ExecResult, max_stdout: int = MAX_STDOUT, max_stderr: int = MAX_STDERR) -> str:
    """The canonical observation text of `result` (format in the module docstring); `trunc` is
    set when the sandbox capped the output, or this rendering clipped stdout or stderr."""
    stdout, stderr = result.stdout.rstrip("\n"), result.stderr.rstrip("\n")
    clipped = result.truncated or len(stdout) > max_stdout or len(stderr) > max_stderr
    flags = "".join(
        f" {name}" for name, on in (("timeout", result.timed_out), ("oom", result.oom), ("trunc", clipped)) if on
    )
    lines = [f"<obs exit={int(result.exit_code)}{flags}>"]
    out = _escape(_clip_middle(stdout, max_stdout))
    if out:
        lines.append(out)
    err = _escape(_clip_head(stderr, max_stderr))
    if err:
        lines.append(f"<err>{err}</err>")
    lines.append("</obs>")
    return "\n".join(lines)


def find_observations(text: str) -> list[str]:
    """Every observation-looking block in `text`, in order, exactly as it appears."""
    return _BLOCK.findall(text or "")


# -- records ----------------------------------------------------------------------
def new_exec_id() -> str:
    """A fresh exec id (32 lowercase hex chars)."""
    return uuid.uuid4().hex


def observation_digest(secret: bytes, exec_id: str, observation: str) -> str:
    """HMAC-SHA256(secret, exec_id + observation) as hex."""
    if not _EXEC_ID.match(exec_id or ""):
        raise ValueError(f"exec_id {exec_id!r} is not 32 lowercase hex chars")
    return hmac.new(secret, (exec_id + observation).encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ExecRecord:
    """One execution as the sandbox side saw it."""

    exec_id: str
    session: str
    cmd: str
    digest: str
    exit_code: int
    timed_out: bool
    oom: bool
    worker: str
    created_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ExecRecord:
        return cls(**json.loads(data))


def _cmd_text(cmd: list[str] | str) -> str:
    text = cmd if isinstance(cmd, str) else json.dumps([str(a) for a in cmd])
    return text[:MAX_CMD_CHARS]


async def records_bucket(js, reg: Registry, create: bool = False):
    """The KV bucket of the run's exec records (created when `create` and missing)."""
    try:
        return await js.key_value(reg.toolrec_bucket)
    except (BucketNotFoundError, NotFoundError):
        if not create:
            raise
        return await js.create_key_value(bucket=reg.toolrec_bucket, history=1, replicas=stream_replicas())


class ExecRecorder:
    """Renders, signs and stores the record of each execution (the sandbox side)."""

    PUT_ATTEMPTS = 3

    def __init__(self, js, reg: Registry, secret: bytes, worker: str = "sandbox") -> None:
        check_secret(secret)
        self.js, self.reg, self._secret, self.worker = js, reg, secret, worker
        self._kv = None

    async def record(
        self, session: str, cmd: list[str] | str, result: ExecResult, caps: tuple[int, int] | None = None
    ) -> tuple[str, str]:
        """Store the record of `result` rendered with `caps` (`obs_caps`); returns (exec_id, observation text)."""
        exec_id, text = new_exec_id(), render_observation(result, *obs_caps(caps))
        rec = ExecRecord(
            exec_id,
            session,
            _cmd_text(cmd),
            observation_digest(self._secret, exec_id, text),
            result.exit_code,
            result.timed_out,
            result.oom,
            self.worker,
            time.time(),
        )
        await self._put(exec_id, rec.to_bytes())
        return exec_id, text

    async def _put(self, key: str, value: bytes) -> None:
        for attempt in range(1, self.PUT_ATTEMPTS + 1):
            try:
                if self._kv is None:
                    self._kv = await records_bucket(self.js, self.reg, create=True)
                await self._kv.put(key, value)
                return
            except Exception as exc:  # the bus edge: bounded retry, then the caller's infra error
                log.warning("sandbox.record.put_failed", attempt=attempt, error=repr(exc))
                if attempt == self.PUT_ATTEMPTS:
                    raise RecordFailed(
                        f"exec {key} ran but its record could not be stored in "
                        f"{self.reg.toolrec_bucket!r}: {exc!r}; is JetStream up?"
                    ) from exc
                await asyncio.sleep(0.2 * attempt)


class LocalRecorder(ExecRecorder):
    """Recorder for a rollout worker that runs its own sandbox in-process.

    This path trusts the rollout process with the secret (it could sign forged
    observations); the remote sandbox service keeps the secret away from it.
    """

    def __init__(self, js, reg: Registry, secret: bytes, worker: str = "local") -> None:
        super().__init__(js, reg, secret, worker)

    @classmethod
    def for_run(cls, js, reg: Registry, run_path: str | os.PathLike) -> LocalRecorder:
        """A recorder with the secret from the env, else the run folder's key file."""
        return cls(js, reg, load_or_create_secret(run_path))


# -- verification -----------------------------------------------------------------
@dataclass(frozen=True)
class ToolTurn:
    """Text appended to the context after a tool call, and the exec_id it came from
    (None for text with no execution behind it, e.g. a model turn)."""

    exec_id: str | None
    text: str


@dataclass(frozen=True)
class Finding:
    """The verdict on one observation block."""

    exec_id: str | None
    block: str
    reason: str = ""


async def _load_records(js, reg: Registry, exec_ids: set[str]) -> dict[str, ExecRecord]:
    try:
        kv = await records_bucket(js, reg)
    except (BucketNotFoundError, NotFoundError):
        return {}
    found = {}
    for exec_id in exec_ids:
        try:
            entry = await kv.get(exec_id)
        except (KeyNotFoundError, NotFoundError):
            continue
        if entry is not None and entry.value:
            try:
                found[exec_id] = ExecRecord.from_bytes(entry.value)
            except (ValueError, TypeError):  # not a record we wrote: it vouches for nothing
                log.warning("sandbox.integrity.bad_record", exec_id=exec_id)
    return found


def _as_turn(turn: ToolTurn | tuple | str) -> ToolTurn:
    if isinstance(turn, ToolTurn):
        return turn
    if isinstance(turn, str):
        return ToolTurn(None, turn)
    return ToolTurn(*turn)


def _judge(secret: bytes, turn: ToolTurn, block: str, record: ExecRecord | None, used: set[str]) -> str:
    """'' when the block verifies, else why not."""
    if turn.exec_id is None:
        return "no execution behind this text"
    if not _EXEC_ID.match(turn.exec_id):
        return "malformed exec_id"
    if record is None:
        return "no record of this exec_id"
    if turn.exec_id in used:
        return "exec record already used by another block"
    if not hmac.compare_digest(observation_digest(secret, turn.exec_id, block), record.digest):
        return "observation differs from the recorded execution"
    return ""


async def verify_observations(
    js, reg: Registry, secret: bytes, tool_turns: Iterable[ToolTurn | tuple | str]
) -> tuple[list[Finding], list[Finding]]:
    """(ok, forged) over every observation block found in `tool_turns`.

    Pass every text of a trajectory the policy could have written into: tool turns as
    `ToolTurn(exec_id, text)` (or `(exec_id, text)`), model turns as plain strings.
    """
    turns = [_as_turn(t) for t in tool_turns]
    ids = {t.exec_id for t in turns if t.exec_id and _EXEC_ID.match(t.exec_id)}
    records = await _load_records(js, reg, ids)
    ok, forged, used = [], [], set()
    for turn in turns:
        for block in find_observations(turn.text):
            why = _judge(secret, turn, block, records.get(turn.exec_id or ""), used)
            if why:
                forged.append(Finding(turn.exec_id, block, why))
            else:
                used.add(turn.exec_id)
                ok.append(Finding(turn.exec_id, block))
    if forged:
        log.warning("sandbox.integrity.forged", blocks=len(forged), reasons=sorted({f.reason for f in forged}))
    return ok, forged


# -- the secret -------------------------------------------------------------------
def check_secret(secret: bytes) -> bytes:
    """`secret` if long enough, else ValueError saying how to make one."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"tool-result secret must be at least {MIN_SECRET_BYTES} bytes; make one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return secret


def load_secret() -> bytes | None:
    """The secret from `RLBUS_TOOL_SECRET` or the file in `RLBUS_TOOL_SECRET_FILE`, else None."""
    if os.environ.get(SECRET_ENV):
        return check_secret(os.environ[SECRET_ENV].strip().encode())
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            return check_secret(Path(path).read_bytes().strip())
        except FileNotFoundError:
            raise SecretMissing(f"{SECRET_FILE_ENV}={path} does not exist; create it (0600) or unset it") from None
    return None


def load_or_create_secret(run_path: str | os.PathLike) -> bytes:
    """The env secret, else `<run_path>/secrets/tool_key` (created 0600 with 32 random bytes, hex)."""
    from_env = load_secret()
    if from_env is not None:
        return from_env
    folder = Path(run_path) / "secrets"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / "tool_key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return check_secret(path.read_bytes().strip())
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    log.info("sandbox.secret.created", path=str(path))
    return check_secret(path.read_bytes().strip())
