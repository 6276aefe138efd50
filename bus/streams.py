"""Reading stored messages of a stream without consuming anyone's work.

Guarantees: `iter_stream` walks the messages currently stored in a stream (optionally
from a sequence number on) using direct gets by sequence, skipping gaps left by
WorkQueue acks, and never creates or touches a consumer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from nats.js.errors import NotFoundError


async def iter_stream(js, stream: str, subject: str, start_seq: int = 0) -> AsyncIterator[tuple[int, bytes]]:
    """Yield (sequence, payload) of stored messages on `subject` with seq >= start_seq."""
    info = await js.stream_info(stream)
    seq, last = max(start_seq, info.state.first_seq, 1), info.state.last_seq
    while seq <= last:
        try:
            raw = await js.get_msg(stream, seq, subject=subject, next=True)
        except NotFoundError:
            return
        if raw.seq is None or raw.seq > last:
            return
        yield raw.seq, raw.data or b""
        seq = raw.seq + 1
