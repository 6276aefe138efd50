"""The learner lease: at most one learner of a run trains at a time.

A lease is the KV key `learner.lease` in the run's bucket, holding who owns it and
until when. It is taken with compare-and-set (create, or update at the revision read),
renewed every third of its TTL the same way, and released on a clean stop.

Guarantees:
- Two learners never both hold the lease: every write is conditional on the revision
  the writer last saw, so of two racing writers exactly one succeeds.
- A learner that cannot renew (another one took an expired lease) sets `lost` and its
  stop event, so it stops training and records nothing more ("fencing").
- A crashed holder's lease expires after `ttl_s`; a waiting learner then takes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid

import structlog
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus.kv import LEARNER_LEASE

log = structlog.get_logger()


def lost_race(exc: Exception) -> bool:
    """True when a conditional KV write failed because someone else wrote first."""
    return isinstance(exc, KeyWrongLastSequenceError) or "wrong last sequence" in str(exc).lower()


class LearnerLease:
    """Acquire, keep and release the run's learner lease."""

    def __init__(self, js, reg, ttl_s: float = 15.0) -> None:
        self.js, self.reg, self.ttl_s = js, reg, ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.revision: int | None = None
        self.lost = False

    def _value(self) -> bytes:
        return json.dumps({"owner": self.owner, "pid": os.getpid(), "expires": time.time() + self.ttl_s}).encode()

    async def _try(self, kv) -> bool:
        try:
            entry = await kv.get(LEARNER_LEASE)
        except (KeyNotFoundError, NotFoundError):
            entry = None
        try:
            if entry is None or not entry.value:
                self.revision = (
                    await kv.create(LEARNER_LEASE, self._value())
                    if entry is None
                    else await kv.update(LEARNER_LEASE, self._value(), last=entry.revision)
                )
                return True
            held = json.loads(entry.value)
            if held.get("owner") == self.owner or held.get("expires", 0) < time.time():
                self.revision = await kv.update(LEARNER_LEASE, self._value(), last=entry.revision)
                return True
            log.info("learner.lease_busy", holder=held.get("owner"), expires_in=round(held["expires"] - time.time(), 1))
            return False
        except Exception as exc:
            if lost_race(exc):  # another writer got there first: read again next round
                return False
            raise

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until the lease is ours (True), or `stop` is set (False)."""
        kv = await self.js.key_value(self.reg.kv_bucket)
        while not stop.is_set():
            if await self._try(kv):
                log.info("learner.lease_acquired", owner=self.owner)
                return True
            try:
                await asyncio.wait_for(stop.wait(), min(2.0, self.ttl_s / 3))
            except asyncio.TimeoutError:
                pass
        return False

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew every ttl/3 until cancelled; on failure mark `lost` and set `stop`."""
        kv = await self.js.key_value(self.reg.kv_bucket)
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                self.revision = await kv.update(LEARNER_LEASE, self._value(), last=self.revision)
            except Exception as exc:  # noqa: BLE001 - a network blip is retried, a lost race fences us
                if lost_race(exc):
                    self.lost = True
                    log.error("learner.lease_lost", owner=self.owner)
                    stop.set()
                    return
                log.warning("learner.lease_renew_failed", error=repr(exc))

    async def release(self) -> None:
        """Give the lease up (only if still ours)."""
        try:
            kv = await self.js.key_value(self.reg.kv_bucket)
            await kv.update(LEARNER_LEASE, b"", last=self.revision)
        except Exception as exc:  # noqa: BLE001 - best effort; it expires anyway
            log.info("learner.lease_release_skipped", error=repr(exc))
