"""`rlbus tail`: print decoded messages live from any subject wildcard.

Guarantees: uses a core-NATS subscription, so it sees messages as they are published
and never consumes, acks or delays anyone's work. Undecodable payloads are printed as
such, never dropped silently. A subject the NATS user may not subscribe to raises
`bus.conn.PermissionDenied` (the CLI exits with the server's reason) instead of waiting.
"""

from __future__ import annotations

import asyncio
import json
import sys

from bus.conn import check_permitted, connect
from schemas import DecodeError, decode


def _short(value, limit: int = 120):
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {k: _short(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_short(v, limit) for v in value[:8]] + ([f"... {len(value) - 8} more"] if len(value) > 8 else [])
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


async def tail(
    url: str,
    subject: str,
    as_json: bool = False,
    max_messages: int | None = None,
    out=sys.stdout,
    timeout: float | None = None,
) -> int:
    """Print messages on `subject` until `max_messages` (or `timeout` seconds); return the count."""
    nc = await connect(url, name="rlbus-tail")
    seen = 0
    done = asyncio.Event()

    async def on_msg(raw):
        nonlocal seen
        if max_messages is not None and seen >= max_messages:
            return  # messages already in flight after the last one asked for
        try:
            body = decode(raw.data).model_dump(mode="python")
            body = {"kind": decode(raw.data).KIND, **body}
        except DecodeError as exc:
            body = {"undecodable": f"{exc.field}: {exc.reason}", "bytes": len(raw.data)}
        body = _short(body)
        if as_json:
            out.write(json.dumps({"subject": raw.subject, **body}, default=str) + "\n")
        else:
            out.write(f"{raw.subject}  {body}\n")
        out.flush()
        seen += 1
        if max_messages is not None and seen >= max_messages:
            done.set()

    await nc.subscribe(subject, cb=on_msg)
    try:
        await check_permitted(nc)  # a subject the user may not read: PermissionDenied, not silence
        await asyncio.wait_for(done.wait(), timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        await nc.drain()
    return seen
