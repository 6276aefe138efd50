"""Sandbox sessions over NATS request/reply: the wire protocol and the client.

Protocol (msgpack both ways; subjects from `bus.subjects.Registry`):
- `sandbox.<pool>.open` (queue group `sandbox-<pool>`): {"run_id", "image"?} ->
  {"ok": true, "session", "worker", "timeout_s", "ttl_s", "isolation", "image"}. Without
  "image" the worker starts its default (`sandbox.image`); with one, only an image of its
  allow-list (`sandbox_workers.service.allowed_images`), else `image_not_allowed`.
- `sandbox.<pool>.s.<worker>.<op>`, op in exec/read/write/reset/ping/close, body
  {"session", ...}: exec {"cmd", "timeout"} -> {"result", "exec_id", "observation"};
  read {"path"} -> {"data"}; write {"path", "data"}; reset, ping, close -> {}.
- Every failure is a reply {"ok": false, "error": {"code", "message"}}, codes in
  `ERROR_CODES`; the client raises the matching exception (never hangs: every
  request has a timeout, an exec's is its own timeout plus `EXEC_MARGIN_S`).

Guarantees of `RemoteSandbox`:
- No worker answering is `SandboxUnavailable` telling how to start one; a worker that
  died with the session is `SandboxLost`; full workers are retried, then
  `CapacityExceeded`.
- While open it pings its session every ttl/3 so an idle but live client keeps it;
  a client that dies stops pinging and the service reaps the session after its TTL.
- `close` is idempotent and never raises because the worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import msgpack
import nats.errors
import structlog

from bus.subjects import Registry
from sandbox_workers.async_sandbox import AsyncSandbox, Observation, SandboxClosed
from sandbox_workers.base import ExecResult

log = structlog.get_logger()

EXEC_MARGIN_S = 10.0
OP_TIMEOUT_S = 30.0
OPEN_TIMEOUT_S = 30.0
ERROR_CODES = (
    "bad_request",
    "unknown_session",
    "capacity",
    "not_found",
    "too_large",
    "sandbox_error",
    "infra_error",
    "internal",
    "image_not_allowed",
)
START_HINT = "start one: rlbus worker sandbox --config CONFIG --run-id RUN (sandbox.pool={pool})"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def error_reply(code: str, message: str) -> bytes:
    """The wire form of a failure."""
    assert code in ERROR_CODES, code
    return pack({"ok": False, "error": {"code": code, "message": message}})


class SandboxError(RuntimeError):
    """A sandbox-service failure; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SandboxUnavailable(SandboxError):
    """No sandbox worker answers on the pool."""


class SandboxLost(SandboxError):
    """The worker holding the session is gone (its sandbox with it); open a new session."""


class UnknownSession(SandboxError):
    """The worker does not hold this session (closed, reaped after its TTL, or never opened)."""


class CapacityExceeded(SandboxError):
    """Every worker asked holds its max_sessions."""


class BadRequest(SandboxError, ValueError):
    """The request was malformed (or a path outside the work dir)."""


class ImageNotAllowed(SandboxError):
    """The worker was not configured to start the image asked for (nothing was started)."""


def raise_for(reply: dict) -> dict:
    """`reply` if ok, else the exception its error code maps to."""
    if reply.get("ok"):
        return reply
    err = reply.get("error") or {}
    code, message = err.get("code", "internal"), err.get("message", "sandbox service error")
    if code == "not_found":
        raise FileNotFoundError(message)
    cls = {
        "unknown_session": UnknownSession,
        "capacity": CapacityExceeded,
        "bad_request": BadRequest,
        "image_not_allowed": ImageNotAllowed,
    }.get(code, SandboxError)
    raise cls(code, message)


class RemoteSandbox(AsyncSandbox):
    """A session of the sandbox service."""

    def __init__(self, nc, reg: Registry, pool: str, opened: dict) -> None:
        self._nc, self._reg, self.pool = nc, reg, pool
        self.session: str = opened["session"]
        self.worker: str = opened["worker"]
        self.default_timeout = float(opened["timeout_s"])
        self.ttl_s = float(opened["ttl_s"])
        self.isolation = opened.get("isolation", "degraded")
        self.image: str | None = opened.get("image")
        self._closed = False
        self._keepalive = asyncio.create_task(self._ping_forever())

    @classmethod
    async def open(
        cls,
        nc,
        reg: Registry,
        pool: str = "default",
        *,
        timeout: float = OPEN_TIMEOUT_S,
        attempts: int = 3,
        image: str | None = None,
    ) -> RemoteSandbox:
        """Open a session on any worker of `pool` (full workers are retried `attempts` times);
        `image`: the docker image to start (None: the worker's default)."""
        subject = reg.sandbox_open(pool)
        body = {"run_id": reg.run_id} if image is None else {"run_id": reg.run_id, "image": image}
        for attempt in range(1, attempts + 1):
            try:
                msg = await nc.request(subject, pack(body), timeout=timeout)
                return cls(nc, reg, pool, raise_for(unpack(msg.data)))
            except nats.errors.NoRespondersError:
                raise SandboxUnavailable(
                    "infra_error", f"no sandbox worker serves pool {pool!r}: " + START_HINT.format(pool=pool)
                ) from None
            except nats.errors.TimeoutError:
                raise SandboxUnavailable(
                    "infra_error",
                    f"no sandbox worker of pool {pool!r} answered within "
                    f"{timeout}s; is one running? " + START_HINT.format(pool=pool),
                ) from None
            except CapacityExceeded as exc:
                if attempt == attempts:
                    raise CapacityExceeded(
                        "capacity",
                        f"{exc} (after {attempts} attempts): raise "
                        "sandbox.max_sessions or start more workers: " + START_HINT.format(pool=pool),
                    ) from None
                await asyncio.sleep(0.05 * attempt + random.random() * 0.05)
        raise AssertionError("unreachable")

    async def _request(self, op: str, body: dict, timeout: float = OP_TIMEOUT_S) -> dict:
        if self._closed:
            raise SandboxClosed(f"sandbox session {self.session} is closed; open a new one")
        subject = self._reg.sandbox_session_op(self.pool, self.worker, op)
        try:
            msg = await self._nc.request(subject, pack({"session": self.session, **body}), timeout=timeout)
        except nats.errors.NoRespondersError:
            raise SandboxLost(
                "infra_error",
                f"sandbox worker {self.worker} holding session {self.session} is gone; open a new session",
            ) from None
        except nats.errors.TimeoutError:
            raise SandboxLost(
                "infra_error",
                f"sandbox worker {self.worker} did not answer {op} within {timeout:.1f}s; open a new session",
            ) from None
        return raise_for(unpack(msg.data))

    async def observe(
        self, cmd: list[str] | str, timeout: float | None = None, caps: tuple[int, int] | None = None
    ) -> Observation:
        limit = self.default_timeout if timeout is None else float(timeout)
        if not isinstance(cmd, str):
            cmd = [str(a) for a in cmd]
        body: dict = {"cmd": cmd, "timeout": limit}
        if caps is not None:
            body["caps"] = [int(c) for c in caps]
        reply = await self._request("exec", body, timeout=limit + EXEC_MARGIN_S)
        return Observation(ExecResult(**reply["result"]), reply["observation"], reply.get("exec_id"))

    async def read_file(self, path: str) -> bytes:
        return (await self._request("read", {"path": path}))["data"]

    async def write_file(self, path: str, data: bytes) -> None:
        limit = getattr(self._nc, "max_payload", 1 << 20) - 4096
        if len(data) > limit:
            raise BadRequest(
                "too_large",
                f"{len(data)} bytes do not fit one NATS message (max_payload "
                f"{limit + 4096}); write smaller files or raise max_payload on the server",
            )
        await self._request("write", {"path": path, "data": bytes(data)})

    async def reset(self) -> None:
        await self._request("reset", {})

    async def ping(self) -> None:
        """Refresh the session's TTL."""
        await self._request("ping", {})

    async def _ping_forever(self) -> None:
        every = max(0.2, self.ttl_s / 3)
        while not self._closed:
            await asyncio.sleep(every)
            try:
                await self.ping()
            except (SandboxError, SandboxClosed, nats.errors.Error) as exc:  # incl. the connection closing
                log.warning("sandbox.session.keepalive_failed", session=self.session, error=str(exc))
                return

    async def close(self) -> None:
        if self._closed:
            return
        self._keepalive.cancel()
        with contextlib.suppress(SandboxError, nats.errors.Error):  # the worker or the bus is gone
            await self._request("close", {})
        self._closed = True
