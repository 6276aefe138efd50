"""`rlbus worker sandbox`: sandbox sessions served over NATS core request/reply.

Protocol: see `sandbox_workers.remote` (the client). A worker joins the pool's queue
group for `open` and answers the ops of the sessions it holds on its own subjects
`sandbox.<pool>.s.<worker_id>.<op>`, so every op reaches the worker that holds the
session while opens spread over the pool.

Guarantees:
- Every request gets a reply: a result, or a structured error (`bad_request`,
  `unknown_session`, `capacity`, `not_found`, `too_large`, `sandbox_error`,
  `infra_error`, `internal`). Nothing a client sends crashes the worker.
- A worker holds at most `sandbox.max_sessions` sessions (opening ones included).
- An `open` starts the worker's default image (`sandbox.image`) or the one it names, only
  if that is in the worker's allow-list (`allowed_images`: `sandbox.image` and
  `sandbox.repo_image` of its own config); any other name, or a non-string, is refused
  with `image_not_allowed` before anything starts (fail closed: a client cannot make the
  service run an image its operator did not configure).
- Each session's blocking backend runs on its own thread (`LocalAsyncSandbox`), so a
  slow exec in one session never delays another; ops of one session are serialized.
- Every op refreshes the session's TTL (`sandbox.session_ttl_s`); a session with no op
  in flight and none for a TTL (its client died) is closed: no process and no work
  dir of it is left. Clients keep idle sessions alive with `ping`.
- Sessions belong to the worker's own run (`run.run_id` of its config): a `run_id` the
  client sends is ignored, so execs are only ever recorded in that run's bucket.
- An exec's `timeout` is at most `sandbox.max_exec_timeout_s` (default 600 s): a larger
  one (or infinity) is clamped to it, a non-positive or non-number one is `bad_request`.
- Every exec is recorded with its observation digest in the session run's
  `toolrec-<run>` bucket and answered with `exec_id` + the observation text
  (`sandbox_workers.integrity`); a record that cannot be stored is an `infra_error`.
- On stop (SIGTERM/SIGINT, or `until_idle`), the worker stops answering, lets ops in
  flight finish, and closes every session.
- Fails closed: before it connects, the worker probes its backend; where it cannot
  isolate (no usable bubblewrap) and `sandbox.allow_degraded` is false, it exits with
  the reason and the fix (`SandboxRefused`) instead of serving unisolated sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field

import structlog

from bus.session import WorkerContext, worker_session
from bus.subjects import Registry, check_token
from bus.telemetry import worker_id as make_worker_id
from sandbox_workers.async_sandbox import LocalAsyncSandbox, SandboxClosed, limits_from
from sandbox_workers.base import ExecResult, SandboxRefused, cap_output, decode_output
from sandbox_workers.factory import probe_isolation
from sandbox_workers.integrity import SECRET_FILE_ENV, ExecRecorder, RecordFailed, load_or_create_secret, load_secret
from sandbox_workers.remote import error_reply, pack, unpack
from schemas.config import RunConfig, SandboxSection

log = structlog.get_logger()

STOP_GRACE_S = 30.0
PAYLOAD_HEADROOM = 16 * 1024


class Refused(Exception):
    """A request the service answers with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Session:
    """One sandbox a client holds."""

    sandbox: LocalAsyncSandbox
    run_id: str
    last_used: float = field(default_factory=time.monotonic)
    in_flight: int = 0

    @property
    def id(self) -> str:
        return self.sandbox.session

    @contextlib.contextmanager
    def busy(self):
        """Mark an op in flight; the TTL restarts when it begins and when it ends."""
        self.in_flight += 1
        self.last_used = time.monotonic()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()

    def expired(self, ttl: float, now: float) -> bool:
        return self.in_flight == 0 and now - self.last_used > ttl


def _field(req: dict, name: str, kind: type | tuple[type, ...]):
    value = req.get(name)
    if not isinstance(value, kind):
        raise Refused("bad_request", f"field {name!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _fit_result(result: ExecResult, budget: int) -> ExecResult:
    """`result` with stdout/stderr capped so the reply fits one NATS message."""
    out, err = result.stdout.encode(), result.stderr.encode()
    if len(out) + len(err) <= budget:
        return result
    out_b, t1 = cap_output(out, budget // 2)
    err_b, t2 = cap_output(err, budget // 2)
    result.stdout, result.stderr = decode_output(out_b), decode_output(err_b)
    result.truncated = result.truncated or t1 or t2
    return result


class SandboxService:
    """The sessions of one sandbox worker and the handlers of its subjects."""

    def __init__(self, nc, js, reg: Registry, sc: SandboxSection, secret: bytes, counters: dict | None = None) -> None:
        self.nc, self.js, self.reg, self.sc = nc, js, reg, sc
        self.pool = check_token("pool", sc.pool)
        self.worker_id = f"{make_worker_id('sandbox')}-{uuid.uuid4().hex[:6]}"
        self.secret = secret
        self.sessions: dict[str, Session] = {}
        self.opening = 0
        self.counters = counters if counters is not None else {}
        self.recorders: dict[str, ExecRecorder] = {}
        self.tasks: set[asyncio.Task] = set()
        self.subs: list = []
        self.last_activity = time.monotonic()
        self.allowed = allowed_images(sc)
        self.ops = {
            "exec": self._exec,
            "read": self._read,
            "write": self._write,
            "reset": self._reset,
            "ping": self._ping,
            "close": self._close_op,
        }

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe: the pool's open queue group and this worker's session subjects."""
        self.subs.append(
            await self.nc.subscribe(
                self.reg.sandbox_open(self.pool), queue=self.reg.sandbox_queue(self.pool), cb=self._on_open
            )
        )
        self.subs.append(
            await self.nc.subscribe(self.reg.sandbox_session_ops(self.pool, self.worker_id), cb=self._on_op)
        )
        await self.nc.flush()
        log.info(
            "sandbox.service.serving",
            pool=self.pool,
            worker=self.worker_id,
            max_sessions=self.sc.max_sessions,
            ttl_s=self.sc.session_ttl_s,
            images=sorted(self.allowed),
        )

    async def stop(self) -> None:
        """Stop answering, let ops in flight finish, close every session."""
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=STOP_GRACE_S)
        closing = list(self.sessions.values())
        self.sessions.clear()
        await asyncio.gather(*(self._close_session(s, "stop") for s in closing))
        log.info("sandbox.service.stopped", worker=self.worker_id, closed=len(closing))

    async def reap_forever(self) -> None:
        """Close sessions idle for longer than their TTL, until cancelled."""
        ttl = self.sc.session_ttl_s
        while True:
            await asyncio.sleep(min(1.0, ttl / 4))
            now = time.monotonic()
            for s in [s for s in self.sessions.values() if s.expired(ttl, now)]:
                self.sessions.pop(s.id, None)
                self._count("sessions_reaped")
                log.info("sandbox.session.reaped", session=s.id, idle_s=round(now - s.last_used, 1))
                await self._close_session(s, "ttl")

    def idle_for(self) -> float:
        """Seconds since the last request, 0 while any session or request is live."""
        if self.sessions or self.tasks or self.opening:
            return 0.0
        return time.monotonic() - self.last_activity

    # -- dispatch -------------------------------------------------------------------
    async def _on_open(self, msg) -> None:
        self._spawn(msg, "open")

    async def _on_op(self, msg) -> None:
        self._spawn(msg, msg.subject.rsplit(".", 1)[-1])

    def _spawn(self, msg, op: str) -> None:
        """Handle each request in its own task (subscription callbacks run one at a time)."""
        task = asyncio.create_task(self._handle(msg, op))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handle(self, msg, op: str) -> None:
        self.last_activity = time.monotonic()
        try:
            req = _decode(msg.data)
            if not isinstance(req, dict):
                raise Refused("bad_request", "request must be a msgpack map")
            body = await (self._open(req) if op == "open" else self._session_op(op, req))
            reply = pack({"ok": True, **body})
        except Refused as exc:
            self._count(f"errors_{exc.code}")
            reply = error_reply(exc.code, str(exc))
        except Exception as exc:
            log.exception("sandbox.request.failed", op=op)
            reply = error_reply("internal", f"{op} failed in worker {self.worker_id}: {exc!r}")
        if msg.reply:
            try:
                await msg.respond(reply)
            except Exception as exc:  # noqa: BLE001 - the client or the bus is gone: it times out
                log.warning("sandbox.reply.failed", op=op, error=repr(exc))

    async def _session_op(self, op: str, req: dict) -> dict:
        handler = self.ops.get(op)
        if handler is None:
            raise Refused("bad_request", f"unknown op {op!r}; ops: {', '.join(self.ops)}")
        sid = _field(req, "session", str)
        session = self.sessions.get(sid)
        if session is None:
            raise Refused(
                "unknown_session",
                f"worker {self.worker_id} holds no session {sid!r} (closed, reaped "
                f"after {self.sc.session_ttl_s}s idle, or never opened); open a new one",
            )
        with session.busy():
            try:
                return await handler(session, req)
            except SandboxClosed as exc:  # closed (by the client or the reaper) while this op waited
                raise Refused("unknown_session", str(exc)) from exc

    def _count(self, name: str, by: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    # -- open / close ---------------------------------------------------------------
    async def _open(self, req: dict) -> dict:
        # the run whose toolrec bucket records this session's execs is the worker's own (its config),
        # never the client's choice: a client naming another run could write records a verifier of
        # that run would trust (issue 27). A different `run_id` in the request is ignored.
        run_id = self.reg.run_id
        asked = req.get("run_id")
        if asked is not None and asked != run_id:
            log.warning("sandbox.session.run_id_ignored", asked=str(asked)[:80], run=run_id)
        image = self._image(req)
        if len(self.sessions) + self.opening >= self.sc.max_sessions:
            raise Refused("capacity", f"worker {self.worker_id} holds max_sessions={self.sc.max_sessions}")
        self.opening += 1
        try:
            sandbox = await LocalAsyncSandbox.open(
                self.sc.backend,
                image=image,
                limits=limits_from(self.sc),
                timeout=self.sc.timeout_s,
                recorder=self._recorder(run_id),
                allow_degraded=self.sc.allow_degraded,
            )
        except Exception as exc:
            log.error("sandbox.session.open_failed", error=repr(exc))
            raise Refused("sandbox_error", f"could not start a {self.sc.backend} sandbox: {exc}") from exc
        finally:
            self.opening -= 1
        session = Session(sandbox, run_id)
        self.sessions[session.id] = session
        self._count("sessions_opened")
        self.counters["sessions_open"] = len(self.sessions)
        log.info("sandbox.session.opened", session=session.id, run=run_id, isolation=sandbox.isolation, image=image)
        return {
            "session": session.id,
            "worker": self.worker_id,
            "timeout_s": self.sc.timeout_s,
            "ttl_s": self.sc.session_ttl_s,
            "isolation": sandbox.isolation,
            "image": image,
        }

    def _image(self, req: dict) -> str:
        """The image an open asks for (default `sandbox.image`); Refused unless it is allowed."""
        image = req.get("image")
        if image is None:
            return self.sc.image
        if not isinstance(image, str) or image not in self.allowed:
            raise Refused(
                "image_not_allowed",
                f"worker {self.worker_id} does not start image {image!r}; it "
                f"starts {sorted(self.allowed)} (sandbox.image, sandbox.repo_image of its config)",
            )
        return image

    def _recorder(self, run_id: str) -> ExecRecorder:
        if run_id not in self.recorders:
            self.recorders[run_id] = ExecRecorder(self.js, Registry(run_id), self.secret, worker=self.worker_id)
        return self.recorders[run_id]

    async def _close_session(self, session: Session, why: str) -> None:
        try:
            await session.sandbox.close()
        except Exception as exc:  # noqa: BLE001 - keep closing the others
            log.error("sandbox.session.close_failed", session=session.id, error=repr(exc))
        self.counters["sessions_open"] = len(self.sessions)
        log.info("sandbox.session.closed", session=session.id, why=why)

    async def _close_op(self, session: Session, req: dict) -> dict:
        if self.sessions.pop(session.id, None) is not None:
            await self._close_session(session, "client")
        return {}

    # -- ops ------------------------------------------------------------------------
    async def _exec(self, session: Session, req: dict) -> dict:
        cmd = req.get("cmd")
        if not (isinstance(cmd, str) or (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd))):
            raise Refused("bad_request", "cmd must be a string or a non-empty list of strings")
        timeout = req.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):  # NaN fails `> 0` too
            raise Refused("bad_request", f"timeout must be a positive number of seconds, got {timeout!r}")
        if timeout is not None and timeout > self.sc.max_exec_timeout_s:  # inf included
            self._count("exec_timeouts_clamped")
            timeout = self.sc.max_exec_timeout_s
        caps = req.get("caps")
        if caps is not None and not (
            isinstance(caps, list) and len(caps) == 2 and all(isinstance(c, int) for c in caps)
        ):
            raise Refused("bad_request", f"caps must be two integers (stdout, stderr chars), got {caps!r}")
        try:
            obs = await session.sandbox.observe(cmd, timeout, None if caps is None else tuple(caps))
        except RecordFailed as exc:
            raise Refused("infra_error", str(exc)) from exc
        self._count("execs")
        budget = max(4096, self.nc.max_payload - PAYLOAD_HEADROOM - len(obs.text.encode()))
        result = _fit_result(obs.result, budget)
        return {"result": result.to_dict(), "exec_id": obs.exec_id, "observation": obs.text}

    async def _read(self, session: Session, req: dict) -> dict:
        path = _field(req, "path", str)
        data = await _file_op(session.sandbox.read_file(path), path)
        if len(data) > self.nc.max_payload - PAYLOAD_HEADROOM:
            raise Refused(
                "too_large",
                f"{path!r} is {len(data)} bytes, more than one NATS message holds; "
                "read it in the sandbox (e.g. exec `head -c`) or raise the server's max_payload",
            )
        return {"data": data}

    async def _write(self, session: Session, req: dict) -> dict:
        path, data = _field(req, "path", str), _field(req, "data", bytes)
        await _file_op(session.sandbox.write_file(path, data), path)
        return {}

    async def _reset(self, session: Session, req: dict) -> dict:
        await session.sandbox.reset()
        return {}

    async def _ping(self, session: Session, req: dict) -> dict:
        return {}


def allowed_images(sc: SandboxSection) -> frozenset[str]:
    """The images a sandbox worker of config `sc` starts on request: `sc.image` and `sc.repo_image`."""
    return frozenset({sc.image, sc.repo_image})


def _decode(data: bytes):
    try:
        return unpack(data)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types on garbage
        raise Refused("bad_request", f"request is not msgpack: {exc}") from None


def check_token_or_refuse(kind: str, value) -> str:
    try:
        return check_token(kind, value if isinstance(value, str) else "")
    except ValueError as exc:
        raise Refused("bad_request", str(exc)) from None


async def _file_op(coro, path: str):
    """Await a file op, turning path and file errors into error replies."""
    try:
        return await coro
    except FileNotFoundError as exc:
        raise Refused("not_found", f"no file {path!r} in the sandbox work dir") from exc
    except ValueError as exc:
        raise Refused("bad_request", str(exc)) from exc
    except OSError as exc:
        raise Refused("sandbox_error", f"{path!r}: {exc}") from exc


def service_secret(ctx: WorkerContext) -> bytes:
    """The tool-result secret: env (`RLBUS_TOOL_SECRET[_FILE]`), else the run folder's key file
    (verifiers must read the same one, or every observation they check is flagged)."""
    secret = load_secret()
    if secret is None:
        log.info(
            "sandbox.secret.from_run_folder",
            path=str(ctx.run_path / "secrets" / "tool_key"),
            hint=f"set {SECRET_FILE_ENV} on sandbox and verifier workers when they do not share a run folder",
        )
        secret = load_or_create_secret(ctx.run_path)
    return secret


async def run(cfg: RunConfig, ctx: WorkerContext) -> None:
    """The sandbox worker process: serve sessions until stopped, then close them all
    (exits at once, with the fix, when its backend cannot isolate: see the guarantees)."""
    try:
        isolation = await asyncio.to_thread(probe_isolation, cfg.sandbox.backend, cfg.sandbox.allow_degraded)
    except SandboxRefused as exc:
        log.error("sandbox.refused", reason=str(exc))
        raise SystemExit(f"rlbus worker sandbox: {exc}") from exc
    log.info("sandbox.isolation", isolation=isolation, backend=cfg.sandbox.backend)
    async with worker_session("sandbox", cfg, ctx) as ws:
        service = SandboxService(ws.nc, ws.js, ws.reg, cfg.sandbox, service_secret(ctx), ws.counters)
        await service.start()
        reaper = asyncio.create_task(service.reap_forever())
        try:
            while not ws.stop.is_set():
                if ctx.until_idle is not None and service.idle_for() > ctx.until_idle:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ws.stop.wait(), timeout=0.5)
        finally:
            reaper.cancel()
            await service.stop()
