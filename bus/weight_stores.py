"""Weight stores: where version blobs live (NATS object store, `file://`, `s3://`), and `fetch_weights`.

Guarantees:
- Every store's `put` / `put_segments` returns (uri, sha256, size) of exactly the bytes
  stored; `names()` lists finished objects only; `delete` of a missing name is no error.
- `file://` writes go to a unique temp file, renamed into place (atomic on one
  filesystem; no fsync: a machine crash can lose the newest version, never expose a
  torn one under its final name). The sha256 is computed over the same buffers that
  are written, in a low-priority thread (`in_background_thread`) while they are written.
- `fetch_weights` reads any of the three stores and raises `ChecksumMismatch` unless the
  bytes hash to the announced sha256.
- `s3://` needs boto3; without it `make_store`/`fetch_weights` raise a clear error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from pathlib import Path
from urllib.parse import urlparse

import structlog

from bus.objects import ChecksumMismatch, get_blob, put_blob, put_segments, sha256_hex, sha256_segments
from bus.subjects import Registry
from bus.weight_blobs import write_file_atomic

log = structlog.get_logger()

BACKGROUND_NICE = 10  # nice increment of integrity-hash threads (see in_background_thread)


def in_background_thread(fn, *args) -> concurrent.futures.Future:
    """Run `fn(*args)` in a new thread at lowered CPU priority (Linux per-thread nice +10);
    its Future. For integrity work off the critical path (hashing a weight file): the
    process's own training or generation, and a loader's read, take the CPU first. A new
    thread, not a pool's: a thread's nice cannot be lowered back without privileges."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: same work, normal priority
            pass
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=f"bg-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return fut


class NatsStore:
    """The run's JetStream object store."""

    def __init__(self, js, bucket: str):
        self.js, self.bucket = js, bucket

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Store `data`; (uri, sha256, size)."""
        return await put_blob(self.js, self.bucket, name, data)

    async def put_segments(self, name: str, segments: list) -> tuple[str, str, int]:
        """Store the concatenated buffers (chunked straight from them); (uri, sha256, size)."""
        return await put_segments(self.js, self.bucket, name, segments)

    async def names(self) -> list[str]:
        """Names of the objects stored (deleted ones excluded)."""
        from nats.js.errors import NotFoundError

        try:
            infos = await (await self.js.object_store(self.bucket)).list(ignore_deletes=True)
        except NotFoundError:  # nats-py's answer for an empty bucket
            return []
        return [i.name for i in infos if not i.deleted]

    async def delete(self, name: str) -> None:
        """Delete object `name` (its chunks are purged; a missing one is no error)."""
        from nats.js.errors import NotFoundError

        try:
            await (await self.js.object_store(self.bucket)).delete(name)
        except NotFoundError:
            pass


class FileStore:
    """A directory on a filesystem every reader mounts (local disk, NFS, a shared volume)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Write `data` atomically as `root/name`; (file:// uri, sha256, size)."""
        return await self.put_segments(name, [memoryview(data)])

    async def put_segments(self, name: str, segments: list, on_written=None) -> tuple[str, str, int]:
        """Write the concatenated buffers atomically as `root/name` (no joined copy) while a
        low-priority thread hashes them; (uri, sha256, size). `on_written(uri, size)` (async)
        is awaited as soon as the file is complete under its final name, before the hash
        is done (the prefetch hint); its failure is logged, not raised. Returns only after
        the hash is done (the buffers may then change)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = (self.root / name).resolve()
        digest = in_background_thread(sha256_segments, segments)
        try:
            size = await asyncio.to_thread(write_file_atomic, path, segments)
            if on_written is not None:
                try:
                    await on_written(path.as_uri(), size)
                except Exception as exc:  # noqa: BLE001 - a lost hint costs latency only
                    log.warning("learner.weights_prefetch_failed", uri=path.as_uri(), error=str(exc))
        finally:
            await asyncio.wait([asyncio.wrap_future(digest)])
        return path.as_uri(), digest.result(), size

    async def names(self) -> list[str]:
        """Names of the files in the directory (temp files of unfinished writes excluded)."""
        if not self.root.is_dir():
            return []
        return [
            p.name for p in await asyncio.to_thread(lambda: list(self.root.iterdir())) if not p.name.startswith(".")
        ]

    async def delete(self, name: str) -> None:
        """Unlink `root/name` (a missing file is no error). A reader that already opened or
        mapped it keeps reading it: the file lives on until it is closed."""
        await asyncio.to_thread((self.root / name).unlink, True)


def _boto3_client():
    try:
        import boto3
    except ImportError as exc:
        raise RuntimeError("s3:// weight stores need boto3: pip install boto3") from exc
    return boto3.client("s3")


class S3Store:
    """An S3 (or S3-compatible, via the usual AWS_* environment) bucket and key prefix."""

    def __init__(self, bucket: str, prefix: str = ""):
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), _boto3_client()

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Upload `data`; (s3:// uri, sha256, size)."""
        key = self._key(name)
        await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}", sha256_hex(data), len(data)

    async def put_segments(self, name: str, segments: list) -> tuple[str, str, int]:
        """Upload the concatenated buffers (joined: boto3 wants one body); (s3:// uri, sha256, size)."""
        return await self.put(name, b"".join(segments))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    async def names(self) -> list[str]:
        """Names (keys without the prefix) under the prefix."""

        def list_all() -> list[str]:
            out, start = [], (self.prefix + "/") if self.prefix else ""
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                out += [o["Key"][len(start) :] for o in page.get("Contents", [])]
            return out

        return await asyncio.to_thread(list_all)

    async def delete(self, name: str) -> None:
        """Delete the object (S3 answers a missing key with success)."""
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=self._key(name))


def make_store(spec: str, js=None, reg: Registry | None = None):
    """The store of `learner.weight_store`: `nats`, `file:///dir` or `s3://bucket/prefix`."""
    if spec == "nats":
        if js is None or reg is None:
            raise ValueError("the nats weight store needs a JetStream context and the run registry")
        return NatsStore(js, reg.object_bucket)
    parsed = urlparse(spec)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"weight_store {spec!r}: file URIs need an absolute path, e.g. file:///data/weights")
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, parsed.path)
    raise ValueError(f"unknown weight_store {spec!r}: expected 'nats', 'file:///dir' or 's3://bucket/prefix'")


async def fetch_weights(uri: str, sha256: str, js=None) -> bytes:
    """The blob at `uri` (nats-object://, file://, s3://; a nats URI names its bucket),
    checked against `sha256`. Raises `bus.objects.ChecksumMismatch` when the bytes do not
    hash to `sha256`."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        return await get_blob(js, uri, sha256)
    obj = await asyncio.to_thread(_boto3_client().get_object, Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
    data = await asyncio.to_thread(obj["Body"].read)
    if sha256_hex(data) != sha256:
        raise ChecksumMismatch(f"{uri}: sha256 {sha256_hex(data)} != announced {sha256}")
    return data
