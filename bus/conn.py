"""Connecting to NATS and creating a run's topology idempotently.

Guarantees:
- `connect` is the one way rlbus connects; it reconnects forever (max_reconnect_attempts=-1)
  and logs each disconnect. Credentials and TLS come from its arguments, else the
  environment (`RLBUS_NATS_CREDS`, `RLBUS_NATS_USER`/`RLBUS_NATS_PASSWORD[_FILE]`,
  `RLBUS_NATS_TLS_CA/_CERT/_KEY`, see `bus.auth`); with a user, replies use the inbox
  prefix `_INBOX_<user>` its permissions allow. A refused login raises `NatsAuthError`
  at once; a refused publish/subscribe is logged (`bus.permission_denied`) and raised
  by `check_permitted` / `publish_checked` as `PermissionDenied`.
- `ensure_topology` creates or updates every stream, the KV buckets and the object
  stores (weights, payloads) of a run; calling it again with the same registry changes nothing. With
  `role=`, it only creates what that role uses and is missing (`bus.auth.ROLE_TOPOLOGY`)
  and never updates, so it needs no more than the role's NATS permissions.
- `ensure_consumer` creates or updates a durable with the registry's explicit config.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats
import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.subjects import ConsumerSpec, Registry, stream_replicas
from schemas.redact import redact_url

log = structlog.get_logger()


class PermissionDenied(Exception):
    """The NATS server refused a publish or subscription of this connection's user."""


class NatsAuthError(ConnectionError):
    """The NATS server refused the login (wrong, missing or unknown credentials)."""


_PERMISSION = "permissions violation"
_AUTH_VIOLATION = "authorization violation"


def _denied_text(user: str | None, error: str) -> str:
    # the server says: Permissions Violation for Publish to "rewards.R.x"
    return f"NATS user {user or '(none)'!r} is not allowed: {error.removeprefix('nats: ').strip()}"


async def connect(
    url: str,
    name: str = "rlbus",
    *,
    user: str | None = None,
    password: str | None = None,
    creds: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    **options,
) -> nats.NATS:
    """Connect with unlimited reconnects, as `user` (default: env) over TLS when a CA is set.
    `url` may list several servers separated by commas (a cluster's nodes).

    Every rlbus process connects here (workers, `up`, init, health, status, tail, top,
    export, dlq), so one place reads the credentials:
    - `creds` (default `RLBUS_NATS_CREDS`, set by `rlbus --nats-creds FILE`): a NATS
      `.creds` file (user JWT + nkey seed) for operator/JWT deployments; needs `nkeys`.
    - else `user`/`password` (default `RLBUS_NATS_USER` and `RLBUS_NATS_PASSWORD`, or
      the file named by `RLBUS_NATS_PASSWORD_FILE`).
    TLS: `tls_ca` verifies the server (also used for `tls://` URLs); `tls_cert`+`tls_key`
    add a client certificate (mutual TLS). Each falls back to its `RLBUS_NATS_TLS_*` env var.

    A refused login raises `NatsAuthError` at once (no endless retry on bad credentials).
    Every permission violation the server reports later (a denied publish or subscribe)
    is logged as `bus.permission_denied` with the user and the server's words, and kept:
    `await check_permitted(nc)` raises `PermissionDenied` for it. `options` go to
    `nats.connect` as they are (e.g. `max_reconnect_attempts=0` for a one-shot probe).
    """
    extra, who, user, creds = _login_options(user, password, creds, tls_ca, tls_cert, tls_key)
    events = _ConnectionEvents(redact_url(url), name, who)  # logged: never with a password
    servers = [u.strip() for u in url.split(",") if u.strip()]  # a cluster: every node's URL, comma-separated
    settings = dict(
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        disconnected_cb=events.on_disconnect,
        reconnected_cb=events.on_reconnect,
        error_cb=events.on_error,
        pending_size=64 * 1024 * 1024,
    )
    settings.update(extra)
    settings.update(options)
    attempt = asyncio.ensure_future(nats.connect(servers, **settings))
    refused = asyncio.ensure_future(events.login_refused.wait())
    try:
        await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (e.g. a caller's wait_for): stop trying to connect as well
        attempt.cancel()
        raise
    finally:
        refused.cancel()
    if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
        pass  # connected (to another server of the list, if one refused)
    elif events.login_refused.is_set():
        attempt.cancel()
        with contextlib.suppress(BaseException):
            await attempt
        how = f"with .creds file {creds}" if creds else (f"as user {user!r}" if user else "without credentials")
        log.error("bus.login_refused", url=redact_url(url), user=who)
        raise NatsAuthError(
            f"NATS server {redact_url(url)} refused the login {how} (authorization violation); set "
            f"RLBUS_NATS_USER and RLBUS_NATS_PASSWORD (e.g. `set -a; . compose/.env; set +a`), "
            f"or pass --nats-creds FILE"
        )
    nc = attempt.result()
    events.connected = True
    nc._rlbus_denied = events.denied  # type: ignore[attr-defined]  # read by check_permitted
    nc._rlbus_user = who  # type: ignore[attr-defined]
    return nc


def _login_options(user, password, creds, tls_ca, tls_cert, tls_key) -> tuple[dict, str | None, str | None, str | None]:
    """(nats.connect options, who for logs, user, creds file) from arguments or the environment."""
    from bus.auth import client_credentials, client_creds_file, inbox_prefix, tls_context

    try:
        creds = client_creds_file(creds)
        user, password = client_credentials(user, password)
    except (ValueError, OSError) as exc:  # a missing creds/password file, a password without a user
        raise NatsAuthError(f"NATS login settings: {exc}") from exc
    tls = tls_context(tls_ca, tls_cert, tls_key)
    extra: dict = {}
    if creds:
        try:
            import nkeys  # noqa: F401 - nats-py signs the server's nonce with it
        except ImportError as exc:
            raise NatsAuthError("a NATS .creds file needs the `nkeys` package (pip install nkeys)") from exc
        extra["user_credentials"] = creds
        if user:  # the JWT's permissions should allow _INBOX_<user>.> then, as with passwords
            extra["inbox_prefix"] = inbox_prefix(user)
    elif user:
        extra.update(user=user, password=password or "", inbox_prefix=inbox_prefix(user))
    if tls is not None:
        extra["tls"] = tls
    return extra, user or ("creds:" + creds if creds else None), user, creds


class _ConnectionEvents:
    """nats-py callbacks of one connection: permission violations kept, a refused login signalled."""

    def __init__(self, url: str, name: str, who: str | None):
        self.url, self.name, self.who = url, name, who
        self.denied: list[str] = []
        self.login_refused = asyncio.Event()
        self.connected = False

    async def on_disconnect(self):
        log.info("bus.disconnected", url=self.url)  # also fires on a deliberate close

    async def on_reconnect(self):
        log.info("bus.reconnected", url=self.url)

    async def on_error(self, exc):
        text = str(exc)
        if _PERMISSION in text.lower():
            self.denied.append(text)
            log.error("bus.permission_denied", user=self.who, connection=self.name, error=text.removeprefix("nats: "))
        elif _AUTH_VIOLATION in text.lower() and not self.connected:
            self.login_refused.set()
        elif not self.connected:  # no server yet (starting, unreachable): connect keeps trying unless told not to
            log.info("bus.connect_failed", url=self.url, error=text)
        else:
            log.warning("bus.error", error=text)


async def check_permitted(nc: nats.NATS, since: int = 0) -> int:
    """Flush (the server answers a refusal before the PONG), then raise `PermissionDenied`
    for any permission violation reported on `nc` after the first `since` ones. Returns
    the count so far, to pass as `since` next time."""
    # nats-py writes a flush's PING straight to the socket, ahead of commands still queued
    # for its flusher task; that task runs during the first round trip, so after a second
    # PONG every earlier command has reached the server and any refusal is in
    await nc.flush()
    await nc.flush()
    denied = getattr(nc, "_rlbus_denied", [])
    if len(denied) > since:
        raise PermissionDenied(_denied_text(getattr(nc, "_rlbus_user", None), denied[-1]))
    return len(denied)


async def publish_checked(nc: nats.NATS, subject: str, data: bytes) -> None:
    """Core-NATS publish that raises `PermissionDenied` when the server refuses it."""
    mark = len(getattr(nc, "_rlbus_denied", []))
    await nc.publish(subject, data)
    await check_permitted(nc, mark)


async def ensure_topology(js: JetStreamContext, reg: Registry, role: str | None = None) -> None:
    """Create or update every stream, the run's KV buckets and its object stores (weights, payloads).

    With `role`: create only the streams/buckets `role` uses that are missing, update
    nothing (what a worker with per-role permissions may do; an admin updates)."""
    if role is not None:
        await _ensure_role_topology(js, reg, role)
        return
    for cfg in reg.streams():
        try:
            await js.stream_info(str(cfg.name))
            await js.update_stream(cfg)
        except NotFoundError:
            await js.add_stream(cfg)
    try:
        await js.key_value(reg.kv_bucket)
    except NotFoundError:  # BucketNotFoundError: create it; other errors propagate
        await js.create_key_value(bucket=reg.kv_bucket, history=16, replicas=stream_replicas())
    try:
        await js.key_value(reg.hidden_bucket)
    except NotFoundError:  # BucketNotFoundError: create it; other errors propagate
        await js.create_key_value(bucket=reg.hidden_bucket, history=1, replicas=stream_replicas())
    for bucket, max_bytes in [(reg.object_bucket, None), *reg.payload_buckets().values()]:
        await _ensure_object_store(js, bucket, max_bytes)


async def _ensure_object_store(js: JetStreamContext, bucket: str, max_bytes: int | None) -> None:
    """Create object store `bucket` when missing (a byte cap when `max_bytes`); other errors propagate."""
    try:
        await js.object_store(bucket)
    except NotFoundError:  # BucketNotFoundError: create it
        await js.create_object_store(bucket=bucket, replicas=stream_replicas(), max_bytes=max_bytes or -1)


async def _ensure_role_topology(js: JetStreamContext, reg: Registry, role: str) -> None:
    from bus.auth import ROLE_TOPOLOGY

    families = ROLE_TOPOLOGY.get(role, ())
    by_name = {c.name: c for c in reg.streams()}
    for family in families:
        if family.startswith(("KV_", "OBJ_")):
            continue
        cfg = by_name[reg.stream(family)]
        try:
            await js.stream_info(str(cfg.name))
        except NotFoundError:
            await js.add_stream(cfg)
    buckets = {"KV_run": (reg.kv_bucket, 16), "KV_hidden": (reg.hidden_bucket, 1)}
    for family, (bucket, history) in buckets.items():
        if family in families:
            try:
                await js.key_value(bucket)
            except NotFoundError:  # BucketNotFoundError: create it; other errors propagate
                await js.create_key_value(bucket=bucket, history=history, replicas=stream_replicas())
    payloads = reg.payload_buckets()
    for family, (bucket, max_bytes) in (
        ("OBJ_weights", (reg.object_bucket, None)),
        ("OBJ_workspaces", payloads["workspace"]),
        ("OBJ_artifacts", payloads["artifact"]),
    ):
        if family in families:
            await _ensure_object_store(js, bucket, max_bytes)


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> None:
    """Create the durable, or update it in place to the spec's settings if it exists
    (the server applies a changed config to an existing durable of the same name)."""
    await js.add_consumer(spec.stream, config=spec.config())


async def ensure_consumer_from(js: JetStreamContext, spec: ConsumerSpec, start_seq: int) -> None:
    """Create the durable so that it delivers from stream sequence `start_seq` (a replay)."""
    from nats.js.api import DeliverPolicy

    config = spec.config()
    if start_seq > 1:
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
    await js.add_consumer(spec.stream, config=config)


async def pull_subscription(js: JetStreamContext, spec: ConsumerSpec):
    """Ensure the durable exists, then bind a pull subscription to it."""
    await ensure_consumer(js, spec)
    return await js.pull_subscribe_bind(spec.durable, stream=spec.stream)


async def delete_run(js: JetStreamContext, reg: Registry) -> None:
    """Delete every stream and bucket of a run (missing ones are skipped)."""
    names = [str(c.name) for c in reg.streams()] + [
        f"KV_{reg.kv_bucket}",
        f"KV_{reg.hidden_bucket}",
        f"KV_{reg.toolrec_bucket}",
        f"OBJ_{reg.object_bucket}",
        f"OBJ_{reg.workspace_bucket}",
        f"OBJ_{reg.artifact_bucket}",
    ]
    for name in names:
        try:
            await js.delete_stream(name)
        except NotFoundError:
            pass
