"""Connecting to NATS and creating a run's topology idempotently.

Guarantees:
- `connect` reconnects forever (max_reconnect_attempts=-1) and logs each disconnect.
  Credentials and TLS come from its arguments, else the environment
  (`RLBUS_NATS_USER`/`RLBUS_NATS_PASSWORD[_FILE]`, `RLBUS_NATS_TLS_CA/_CERT/_KEY`, see
  `bus.auth`); with a user, replies use the inbox prefix `_INBOX_<user>` its permissions allow.
- `ensure_topology` creates or updates every stream, the KV bucket and the object
  store of a run; calling it again with the same registry changes nothing. With
  `role=`, it only creates what that role uses and is missing (`bus.auth.ROLE_TOPOLOGY`)
  and never updates, so it needs no more than the role's NATS permissions.
- `ensure_consumer` creates or updates a durable with the registry's explicit config.
"""

from __future__ import annotations

import nats
import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.subjects import ConsumerSpec, Registry, stream_replicas

log = structlog.get_logger()


async def connect(url: str, name: str = "rlbus", *, user: str | None = None, password: str | None = None,
                  tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> nats.NATS:
    """Connect with unlimited reconnects, as `user` (default: env) over TLS when a CA is set.
    `url` may list several servers separated by commas (a cluster's nodes).

    TLS: `tls_ca` verifies the server (also used for `tls://` URLs); `tls_cert`+`tls_key`
    add a client certificate (mutual TLS). Each falls back to its `RLBUS_NATS_TLS_*` env var.
    """
    from bus.auth import client_credentials, inbox_prefix, tls_context

    user, password = client_credentials(user, password)
    tls = tls_context(tls_ca, tls_cert, tls_key)
    extra: dict = {}
    if user:
        extra.update(user=user, password=password or "", inbox_prefix=inbox_prefix(user))
    if tls is not None:
        extra["tls"] = tls

    async def on_disconnect():
        log.info("bus.disconnected", url=url)  # also fires on a deliberate close

    async def on_reconnect():
        log.info("bus.reconnected", url=url)

    async def on_error(exc):
        log.warning("bus.error", error=str(exc))

    servers = [u.strip() for u in url.split(",") if u.strip()]  # a cluster: every node's URL, comma-separated
    return await nats.connect(
        servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, error_cb=on_error,
        pending_size=64 * 1024 * 1024, **extra,
    )


async def ensure_topology(js: JetStreamContext, reg: Registry, role: str | None = None) -> None:
    """Create or update every stream, the run's KV bucket and its object store.

    With `role`: create only the streams/buckets `role` uses that are missing, update
    nothing (what a worker with per-role permissions may do; an admin updates)."""
    if role is not None:
        await _ensure_role_topology(js, reg, role)
        return
    for cfg in reg.streams():
        try:
            await js.stream_info(cfg.name)
            await js.update_stream(cfg)
        except NotFoundError:
            await js.add_stream(cfg)
    try:
        await js.key_value(reg.kv_bucket)
    except Exception:
        await js.create_key_value(bucket=reg.kv_bucket, history=16, replicas=stream_replicas())
    try:
        await js.key_value(reg.hidden_bucket)
    except Exception:
        await js.create_key_value(bucket=reg.hidden_bucket, history=1, replicas=stream_replicas())
    try:
        await js.object_store(reg.object_bucket)
    except Exception:
        await js.create_object_store(bucket=reg.object_bucket, replicas=stream_replicas())


async def _ensure_role_topology(js: JetStreamContext, reg: Registry, role: str) -> None:
    from bus.auth import ROLE_TOPOLOGY

    families = ROLE_TOPOLOGY.get(role, ())
    by_name = {c.name: c for c in reg.streams()}
    for family in families:
        if family.startswith(("KV_", "OBJ_")):
            continue
        cfg = by_name[reg.stream(family)]
        try:
            await js.stream_info(cfg.name)
        except NotFoundError:
            await js.add_stream(cfg)
    buckets = {"KV_run": (reg.kv_bucket, 16), "KV_hidden": (reg.hidden_bucket, 1)}
    for family, (bucket, history) in buckets.items():
        if family in families:
            try:
                await js.key_value(bucket)
            except Exception:
                await js.create_key_value(bucket=bucket, history=history, replicas=stream_replicas())
    if "OBJ_weights" in families:
        try:
            await js.object_store(reg.object_bucket)
        except Exception:
            await js.create_object_store(bucket=reg.object_bucket, replicas=stream_replicas())


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
    names = [c.name for c in reg.streams()] + [f"KV_{reg.kv_bucket}", f"KV_{reg.hidden_bucket}", f"KV_{reg.toolrec_bucket}",
                                       f"OBJ_{reg.object_bucket}"]
    for name in names:
        try:
            await js.delete_stream(name)
        except NotFoundError:
            pass
