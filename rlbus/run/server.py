"""Probing a run's NATS server: does one answer, and which run does it hold.

Guarantees:
- `server_answers(url)` is True only when a server with JetStream answers at `url` within
  about `timeout` seconds (one try, no reconnects); refused, unreachable, hung or
  JetStream-less is False, never an exception.
- `server_reachable(url)` is the same behind a TCP probe first (nats-py's own connect can
  keep retrying a refused address), bounded by about three times `timeout`.
- `only_run(js)` is the run id of the single run whose streams the server holds;
  `RunNotFound` naming the runs when there are none or several.
- Nothing here publishes, consumes or creates anything on the server.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

from rlbus.run.folder import RunNotFound


async def server_answers(url: str, timeout: float = 3.0) -> bool:
    """True when a NATS server with JetStream answers at `url`."""
    from bus.conn import connect

    try:
        nc = await asyncio.wait_for(
            connect(url, name="rlbus-probe", connect_timeout=timeout, max_reconnect_attempts=0, allow_reconnect=False),
            timeout + 2,
        )
    except Exception:  # noqa: BLE001 - refused, unreachable, or hung: no server to reuse
        return False
    try:
        await nc.jetstream().account_info()
        return True
    except Exception:  # noqa: BLE001 - a server without JetStream (or not ours to use) is none to reuse
        return False
    finally:
        await nc.close()


async def server_reachable(url: str, timeout: float = 3.0) -> bool:
    """True when a NATS server with JetStream answers at `url` within about `timeout` seconds
    (a TCP probe first)."""
    parsed = urlparse(url)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout
        )
        writer.close()
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        return await asyncio.wait_for(server_answers(url, timeout), timeout * 2)
    except asyncio.TimeoutError:
        return False


async def only_run(js) -> str:
    """The single run on the server (by its TASKS stream); RunNotFound otherwise."""
    names = [s.config.name for s in await js.streams_info()]
    runs = sorted(n[len("TASKS_") :] for n in names if n.startswith("TASKS_"))
    if len(runs) != 1:
        raise RunNotFound(f"{len(runs)} runs on this server ({', '.join(runs) or 'none'}); pass --run-id")
    return runs[0]
