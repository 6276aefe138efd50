"""Weight blobs in the NATS object store, addressed by URI and checked by sha256.

Guarantees:
- `put_blob` stores bytes in chunks and returns `(uri, sha256, size)`.
- `get_blob` streams the object with `writeinto` into a buffer and raises
  `ChecksumMismatch` unless its sha256 equals the expected one: a corrupt or swapped
  blob is never loaded.
- `file://` URIs are read from the local filesystem with the same check.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from pathlib import Path
from urllib.parse import urlparse

from nats.js import JetStreamContext

SCHEME = "nats-object"


class ChecksumMismatch(ValueError):
    """The blob's sha256 differs from the one announced."""


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


async def put_blob(js: JetStreamContext, bucket: str, name: str, data: bytes) -> tuple[str, str, int]:
    """Store `data` as object `name` in `bucket`; return (uri, sha256, size)."""
    store = await js.object_store(bucket)
    await store.put(name, data)
    return f"{SCHEME}://{bucket}/{name}", sha256_hex(data), len(data)


async def get_blob(js: JetStreamContext, uri: str, expected_sha256: str) -> bytes:
    """Fetch a blob by URI and verify its sha256."""
    parsed = urlparse(uri)
    if parsed.scheme == SCHEME:
        store = await js.object_store(parsed.netloc)
        buf = io.BytesIO()
        await store.get(parsed.path.lstrip("/"), writeinto=buf)
        data = buf.getvalue()
    elif parsed.scheme == "file":
        data = await asyncio.to_thread(Path(parsed.path).read_bytes)
    else:
        raise ValueError(f"unsupported weight URI scheme {parsed.scheme!r} in {uri!r}")
    actual = sha256_hex(data)
    if actual != expected_sha256:
        raise ChecksumMismatch(f"{uri}: sha256 {actual} != announced {expected_sha256}")
    return data
