"""Keeps a rollout worker's engine on the newest announced weight version.

Guarantees:
- Watches `weights.<run>` (ordered consumer, starting at the last announcement) and
  remembers the newest `WeightVersion`.
- `maybe_load(engine)` is called between batches: it fetches the newest blob, checks
  its sha256 and only then loads it. A mismatch is logged as
  `rollout.weights_rejected`, counted, and that announcement is never loaded; the
  engine keeps its current weights.
- A `file://` version is loaded with the engine's zero-copy `load_weights_file(path,
  sha256)` when it has one (HFEngine on CPU; same sha256 check, model untouched on a
  mismatch); otherwise, or when that path declines the blob, through `fetch_weights`
  + `load_weights`.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

import structlog
from nats.js.api import DeliverPolicy

from bus.objects import ChecksumMismatch
from learner.weights import fetch_weights
from schemas import DecodeError, WeightVersion, decode

log = structlog.get_logger()


class WeightWatcher:
    """Tracks the newest WeightVersion and loads it on request."""

    def __init__(self, js, reg, counters: dict[str, float]):
        self.js, self.reg, self.counters = js, reg, counters
        self.newest: WeightVersion | None = None
        self.steps: dict[int, int] = {}  # learner step of every announced version
        self.loaded: WeightVersion | None = None
        self.rejected: set[str] = set()
        self._announced = asyncio.Event()
        self._sub = None

    async def start(self) -> None:
        """Subscribe to weight announcements (latest first)."""
        self._sub = await self.js.subscribe(self.reg.weights, cb=self._on_msg, ordered_consumer=True,
                                            deliver_policy=DeliverPolicy.LAST)

    async def _on_msg(self, raw) -> None:
        try:
            wv = decode(raw.data, WeightVersion)
        except DecodeError as exc:
            log.warning("rollout.weights_announcement_invalid", field=exc.field, reason=exc.reason)
            return
        self.steps[wv.version] = wv.step
        if self.newest is None or wv.version > self.newest.version:
            self.newest = wv
            self._announced.set()

    async def wait_first(self, stop: asyncio.Event) -> bool:
        """Wait until some version is announced (or stop); True if one is."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._announced.wait(), 1.0)
                return True
            except asyncio.TimeoutError:
                log.info("rollout.waiting_for_weights")
        return False

    @property
    def version(self) -> int:
        """Version currently loaded in the engine (-1 before any)."""
        return self.loaded.version if self.loaded else -1

    async def maybe_load(self, engine) -> bool:
        """Load the newest announced version if it is newer than the loaded one."""
        wv = self.newest
        if wv is None or (self.loaded and wv.version <= self.loaded.version) or wv.msg_id in self.rejected:
            return False
        fast = getattr(engine, "load_weights_file", None)
        parsed = urlparse(wv.uri)
        try:
            loaded = False
            if fast is not None and parsed.scheme == "file":
                loaded = await asyncio.to_thread(fast, parsed.path, wv.sha256)
            if not loaded:
                blob = await fetch_weights(wv.uri, wv.sha256, self.js, self.reg)
        except ChecksumMismatch as exc:
            self.rejected.add(wv.msg_id)
            self.counters["weights_rejected"] = self.counters.get("weights_rejected", 0) + 1
            log.error("rollout.weights_rejected", version=wv.version, reason=str(exc))
            return False
        if not loaded:
            await asyncio.to_thread(engine.load_weights, blob)
        self.loaded = wv
        self.counters["weight_version"] = wv.version
        self.counters["weights_loaded"] = self.counters.get("weights_loaded", 0) + 1
        log.info("rollout.weights_loaded", version=wv.version, bytes=wv.bytes)
        return True
