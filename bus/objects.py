"""Blobs in the NATS object store, addressed by URI and checked by sha256: weight blobs, and
the public payloads of `bus.payloads` (large repositories and diffs).

Guarantees:
- `put_blob` / `put_segments` store bytes (or the concatenation of several buffers,
  e.g. a safetensors header followed by each tensor's own memory, never joined into one
  bytes object) as an object in the bucket and return `(uri, sha256, size)`. Chunks
  (up to `CHUNK_SIZE`, capped by the server's max_payload) are published pipelined:
  each chunk is handed to the connection in order (so the stream stores them in
  order) without waiting for the previous chunk's ack; every ack is then awaited, and
  only then the object's meta message (name, nuid, size, chunk count, SHA-256 digest,
  the same layout as nats-py's `ObjectStore.put`) is published. A failed chunk purges
  the new chunks and raises; readers never see meta pointing at missing chunks. The
  sha256 is computed in a thread while the chunks are published. The caller must not
  modify the buffers until `put_segments` returns.
- `get_blob` fetches the object's chunks in order (ordered consumer), hashes them as
  they arrive, checks size and chunk count, and raises `ChecksumMismatch` unless the
  sha256 equals the expected one: a corrupt or swapped blob is never returned. The
  result is one `bytes` object (built once from the chunks, no intermediate copies).
- `file://` URIs are read from the local filesystem with the same check.
- A blob that is not in its store (never written, or deleted by weight retention)
  raises `BlobGone`, never a store-specific error.
- Objects written by nats-py's `ObjectStore.put` (or the `nats` CLI) read back here,
  and objects written here read back with nats-py's `ObjectStore.get`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import urlparse

from nats.js import JetStreamContext, api

SCHEME = "nats-object"
CHUNK_SIZE = 1024 * 1024  # bytes per chunk message (capped by the server's max_payload)
MAX_IN_FLIGHT = 256  # chunks published but not yet acked
GET_TIMEOUT_S = 30.0  # longest wait for the next chunk of an object


class ChecksumMismatch(ValueError):
    """The blob's sha256 differs from the one announced."""


class BlobGone(LookupError):
    """The blob is not (or no longer) in its store, e.g. deleted by weight retention."""


def sha256_hex(data) -> str:
    """Hex sha256 of a bytes-like object."""
    return hashlib.sha256(data).hexdigest()


def sha256_segments(segments: Iterable) -> str:
    """Hex sha256 of the concatenation of bytes-like segments (hashlib releases the GIL)."""
    h = hashlib.sha256()
    for seg in segments:
        h.update(seg)
    return h.hexdigest()


def _chunks(segments: list, size: int) -> Iterator[bytes | memoryview]:
    """Chunks of at most `size` bytes of the concatenated segments; whole-size slices of a
    segment are yielded as views (no copy), only pieces spanning segments are joined."""
    pending = bytearray()
    for seg in segments:
        mv = memoryview(seg).cast("B") if not isinstance(seg, memoryview) or seg.format != "B" else seg
        pos = 0
        if pending:
            take = min(size - len(pending), len(mv))
            pending += mv[:take]
            pos = take
            if len(pending) == size:
                yield bytes(pending)
                pending = bytearray()
        while len(mv) - pos >= size:
            yield mv[pos : pos + size]
            pos += size
        if pos < len(mv):
            pending += mv[pos:]
    if pending:
        yield bytes(pending)


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


async def put_segments(
    js: JetStreamContext, bucket: str, name: str, segments: list, purge_replaced: bool = True
) -> tuple[str, str, int]:
    """Store the concatenation of `segments` as object `name` in `bucket`; (uri, sha256, size).
    `purge_replaced=False` leaves the chunks of an object it replaces in place (for writers
    without purge rights: content-addressed names, where a replaced object is a duplicate)."""
    store = await js.object_store(bucket)  # checks the bucket exists
    nc = js._nc
    try:
        old = await store.get_info(name)
    except Exception:  # noqa: BLE001 - not found (or deleted): nothing to clean up
        old = None
    nuid = nc._nuid.next().decode()
    chunk_subj = f"$O.{bucket}.C.{nuid}"
    size = min(CHUNK_SIZE, max(1024, (nc.max_payload or CHUNK_SIZE) - 4096))
    hashing = asyncio.ensure_future(asyncio.to_thread(sha256_segments, segments))
    acks: list[asyncio.Future] = []
    sent = total = 0
    try:
        for chunk in _chunks(segments, size):
            acks.append(await js.publish_async(chunk_subj, chunk, wait_stall=GET_TIMEOUT_S))  # type: ignore[arg-type]  # a memoryview is sent without a copy
            sent += 1
            total += len(chunk)
            if len(acks) >= MAX_IN_FLIGHT:
                await asyncio.wait_for(asyncio.gather(*acks), GET_TIMEOUT_S)
                acks.clear()
        if acks:
            await asyncio.wait_for(asyncio.gather(*acks), GET_TIMEOUT_S)
        sha = await hashing
        info = api.ObjectInfo(
            name=name,
            bucket=bucket,
            nuid=nuid,
            size=total,
            chunks=sent,
            mtime=datetime.now(timezone.utc).isoformat(),
            digest="SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha)).decode(),
            options=api.ObjectMetaOptions(max_chunk_size=size),
        )
        await js.publish(
            _meta_subject(bucket, name), json.dumps(info.as_dict()).encode(), headers={api.Header.ROLLUP: "sub"}
        )
    except BaseException:
        for fut in acks:
            fut.cancel()
        hashing.cancel()
        try:
            await js.purge_stream(f"OBJ_{bucket}", subject=chunk_subj)
        except Exception:  # noqa: BLE001 - best effort; the original error matters
            pass
        raise
    if purge_replaced and old is not None and not old.deleted and old.nuid:
        await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{old.nuid}")
    return f"{SCHEME}://{bucket}/{name}", sha, total


async def put_blob(
    js: JetStreamContext, bucket: str, name: str, data, purge_replaced: bool = True
) -> tuple[str, str, int]:
    """Store `data` as object `name` in `bucket`; return (uri, sha256, size) (`purge_replaced`: see `put_segments`)."""
    return await put_segments(js, bucket, name, [memoryview(data)], purge_replaced)


async def _get_object(js: JetStreamContext, bucket: str, name: str, uri: str) -> tuple[bytes, str]:
    """(object bytes, their sha256), chunks in order, size and chunk count checked."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if info.options is not None and info.options.link is not None:
        raise ValueError(f"{uri}: object links are not supported for weight blobs")
    if not info.size:
        return b"", sha256_hex(b"")
    sub = await js.subscribe(f"$O.{bucket}.C.{info.nuid}", ordered_consumer=True)
    parts: list[bytes] = []
    h = hashlib.sha256()
    got = 0
    try:
        while got < info.size:
            msg = await sub.next_msg(timeout=GET_TIMEOUT_S)
            parts.append(msg.data)
            h.update(msg.data)
            got += len(msg.data)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    if got != info.size or (info.chunks and len(parts) != info.chunks):
        raise ChecksumMismatch(f"{uri}: {got} bytes in {len(parts)} chunks, meta says {info.size} in {info.chunks}")
    return b"".join(parts), h.hexdigest()


async def get_blob(js: JetStreamContext, uri: str, expected_sha256: str) -> bytes:
    """Fetch a blob by URI and verify its sha256."""
    from nats.js.errors import NotFoundError

    parsed = urlparse(uri)
    if parsed.scheme == SCHEME:
        try:
            data, actual = await _get_object(js, parsed.netloc, parsed.path.lstrip("/"), uri)
        except NotFoundError as exc:
            raise BlobGone(f"{uri}: not in the object store ({type(exc).__name__})") from exc
    elif parsed.scheme == "file":
        try:
            data = await asyncio.to_thread(Path(parsed.path).read_bytes)
        except FileNotFoundError as exc:
            raise BlobGone(f"{uri}: no such file") from exc
        actual = await asyncio.to_thread(sha256_hex, data)
    else:
        raise ValueError(f"unsupported weight URI scheme {parsed.scheme!r} in {uri!r}")
    if actual != expected_sha256:
        raise ChecksumMismatch(f"{uri}: sha256 {actual} != announced {expected_sha256}")
    return data
