"""Typed JetStream publishing with de-duplication ids.

Guarantees:
- Every message is published with `Nats-Msg-Id = msg.msg_id`, so a retried publish of
  the same message is stored once (within the stream's duplicate window).
- `publish_many` sends all messages before waiting, then waits for every ack and raises
  if any publish failed: success means every message is stored.
- A transient failure (no stream response, no responders, a timeout: a cluster electing a
  new stream leader, a server restarting) is retried with backoff within the call's
  `timeout`; the retry resends the same msg_ids, so nothing is stored twice. Any other
  error (a full store, a permission violation) raises at once.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError

from schemas import Message, encode

log = structlog.get_logger()
TRANSIENT = (NoStreamResponseError, NoRespondersError, NatsTimeout, asyncio.TimeoutError)
"""Publish errors that pass by themselves (leader election, reconnect): retried."""


async def _retrying(attempt, timeout: float):
    """`await attempt(remaining_seconds)` until it succeeds, a non-transient error, or `timeout`."""
    deadline, delay = time.monotonic() + timeout, 0.25
    while True:
        remaining = deadline - time.monotonic()
        try:
            return await attempt(max(0.5, remaining))
        except TRANSIENT as exc:
            if time.monotonic() + delay >= deadline:
                raise
            log.warning("bus.publish_retry", error=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)


def headers_for(msg: Message) -> dict[str, str]:
    """Headers sent with a message."""
    return {"Nats-Msg-Id": msg.msg_id}


async def publish(js: JetStreamContext, subject: str, msg: Message, timeout: float = 10.0):
    """Publish one message and wait for its stream ack (transient failures retried within `timeout`)."""
    data, headers = encode(msg), headers_for(msg)
    return await _retrying(lambda left: js.publish(subject, data, headers=headers, timeout=min(left, 5.0)), timeout)


async def publish_many(js: JetStreamContext, items: list[tuple[str, Message]], timeout: float = 30.0) -> list:
    """Publish (subject, message) pairs pipelined; return their acks in order."""
    if not items:
        return []

    async def send_all(left: float):
        # asyncio.timeout, not wait_for: no extra task per call (a verifier publishes each
        # reward on its own). No wait_stall: with one, nats-py awaits the semaphore through
        # wait_for on every message, which yields to the flusher and costs one socket write
        # per message.
        async with asyncio.timeout(left):
            futures = [await js.publish_async(subject, encode(msg), headers=headers_for(msg)) for subject, msg in items]
            return [await futures[0]] if len(futures) == 1 else list(await asyncio.gather(*futures))

    return await _retrying(send_all, timeout)
