"""Typed JetStream publishing with de-duplication ids.

Guarantees:
- Every message is published with `Nats-Msg-Id = msg.msg_id`, so a retried publish of
  the same message is stored once (within the stream's duplicate window).
- `publish_many` sends all messages before waiting, then waits for every ack and raises
  if any publish failed: success means every message is stored.
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from schemas import Message, encode


def headers_for(msg: Message) -> dict[str, str]:
    """Headers sent with a message."""
    return {"Nats-Msg-Id": msg.msg_id}


async def publish(js: JetStreamContext, subject: str, msg: Message, timeout: float = 10.0):
    """Publish one message and wait for its stream ack."""
    return await js.publish(subject, encode(msg), headers=headers_for(msg), timeout=timeout)


async def publish_many(js: JetStreamContext, items: list[tuple[str, Message]], timeout: float = 30.0) -> list:
    """Publish (subject, message) pairs pipelined; return their acks in order."""
    if not items:
        return []

    async def send_all():
        # No wait_stall: with one, nats-py awaits the semaphore through wait_for on every
        # message, which yields to the flusher and costs one socket write per message.
        futures = [await js.publish_async(subject, encode(msg), headers=headers_for(msg)) for subject, msg in items]
        return list(await asyncio.gather(*futures))

    return await asyncio.wait_for(send_all(), timeout)
