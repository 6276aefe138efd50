"""Keeps a rollout worker's engine on the newest announced weight version.

Guarantees:
- Watches `weights.<run>` (ordered consumer, starting at the last announcement) and
  remembers the newest `WeightVersion`.
- `maybe_load(engine)` is called between batches (and between agent turns). Loads are
  serialized (one at a time, whichever pool loop asks) and a new one starts only after
  the previous version's verification has settled.
- Verify-first (the default, and always for NATS-store and s3:// blobs, LoRA adapters,
  a dtype/shape mismatch, an engine without the speculative path): the blob's sha256 is
  checked and only then loaded. A mismatch is logged as `rollout.weights_rejected`,
  counted (`weights_rejected`), and that announcement is never loaded; the engine keeps
  its current weights. A `file://` version goes through the engine's zero-copy
  `load_weights_file(path, sha256)` when it has one, else `fetch_weights` +
  `load_weights`.
- Speculative (`WeightWatcher(..., speculative=True)`, what the rollout worker uses):
  a `file://` full-state version is read into staging tensors and swapped in at once
  (`engine.load_weights_file_speculative`), so the engine serves it without waiting for
  the hash; its sha256 is checked in a background thread (overlapping generation) while
  the previous weights are kept aside untouched. On a match they are released
  (`weights_verified`); on a mismatch the previous weights are restored, the watcher's
  version goes back to the previous one, and the version is rejected exactly as above
  (`rollout.weights_rejected`, `weights_rejected`, never loaded again; also counted in
  `weights_rolled_back`).
- The gate that makes speculation safe: `mark()` before a batch, then
  `await verified_since(mark)` before publishing it waits for the verification of EVERY
  version the engine held since the mark (a batch may span loads: agent turns, another
  pool's loop) and is True only if all of them passed. The rollout worker publishes a
  batch only then, so no trajectory generated with a version leaves the worker before
  that version's sha256 check passed. Callers that do not gate (the scheduler's
  evaluation) keep the default, verify-first.
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

    def __init__(self, js, reg, counters: dict[str, float], *, speculative: bool = False):
        self.js, self.reg, self.counters = js, reg, counters
        self.speculative = speculative
        self.newest: WeightVersion | None = None
        self.steps: dict[int, int] = {}  # learner step of every announced version
        self.loaded: WeightVersion | None = None
        self.rejected: set[str] = set()
        self._announced = asyncio.Event()
        self._sub = None
        self._lock = asyncio.Lock()
        # every weight state the engine held, in order (a rollback is a new entry): "ok" when
        # verified before or after it served, "pending" while a speculative check runs, "bad"
        # when that check failed. A mark is an index into it.
        self._held: list[str] = []
        self._checks: dict[int, asyncio.Task] = {}  # index in _held -> its running verification

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

    # -- the publish gate ------------------------------------------------------------------
    def mark(self) -> int:
        """A point in the engine's weight history: `verified_since` covers the weights held
        now and every version loaded after."""
        return max(0, len(self._held) - 1)

    async def verified_since(self, mark: int) -> bool:
        """Wait for the sha256 check of every version the engine held since `mark`; True if
        all passed (False: something generated since `mark` may come from bad weights)."""
        for i in range(mark, len(self._held)):
            check = self._checks.get(i)
            if check is not None:
                await asyncio.shield(check)
        return all(state == "ok" for state in self._held[mark:])

    async def settle(self) -> None:
        """Wait until no verification is running."""
        while self._checks:
            await asyncio.gather(*(asyncio.shield(t) for t in list(self._checks.values())))

    # -- loading ---------------------------------------------------------------------------
    def _wanted(self, wv: WeightVersion | None) -> bool:
        return not (wv is None or (self.loaded and wv.version <= self.loaded.version) or wv.msg_id in self.rejected)

    def _reject(self, wv: WeightVersion, reason: str, **kw) -> None:
        self.rejected.add(wv.msg_id)
        self.counters["weights_rejected"] = self.counters.get("weights_rejected", 0) + 1
        log.error("rollout.weights_rejected", version=wv.version, reason=reason, **kw)

    def _now_serving(self, wv: WeightVersion | None, state: str) -> int:
        self.loaded = wv
        self._held.append(state)
        self.counters["weight_version"] = self.version
        return len(self._held) - 1

    async def maybe_load(self, engine) -> bool:
        """Load the newest announced version if it is newer than the loaded one."""
        if not self._wanted(self.newest):
            return False
        async with self._lock:
            await self.settle()  # the previous version's check decides what "loaded" is
            wv = self.newest
            if not self._wanted(wv):
                return False
            parsed = urlparse(wv.uri)
            if self.speculative and parsed.scheme == "file" and hasattr(engine, "load_weights_file_speculative"):
                try:
                    pending = await asyncio.to_thread(engine.load_weights_file_speculative, parsed.path)
                except ChecksumMismatch as exc:
                    self._reject(wv, str(exc))
                    return False
                if pending is not None:
                    previous = self.loaded
                    index = self._now_serving(wv, "pending")
                    self._checks[index] = asyncio.create_task(self._verify(index, wv, previous, pending))
                    self._loaded_log(wv, speculative=True)
                    return True
            fast = getattr(engine, "load_weights_file", None)
            try:
                loaded = False
                if fast is not None and parsed.scheme == "file":
                    loaded = await asyncio.to_thread(fast, parsed.path, wv.sha256)
                if not loaded:
                    blob = await fetch_weights(wv.uri, wv.sha256, self.js, self.reg)
            except ChecksumMismatch as exc:
                self._reject(wv, str(exc))
                return False
            if not loaded:
                await asyncio.to_thread(engine.load_weights, blob)
            self._now_serving(wv, "ok")
            self._loaded_log(wv, speculative=False)
            return True

    def _loaded_log(self, wv: WeightVersion, speculative: bool) -> None:
        self.counters["weights_loaded"] = self.counters.get("weights_loaded", 0) + 1
        log.info("rollout.weights_loaded", version=wv.version, bytes=wv.bytes, speculative=speculative)

    async def _verify(self, index: int, wv: WeightVersion, previous: WeightVersion | None, pending) -> bool:
        """Check a speculatively served version; commit it, or roll back to `previous` and reject it."""
        try:
            try:
                actual = await asyncio.to_thread(pending.digest)
            except Exception as exc:  # noqa: BLE001 - an unhashable load is a failed check
                actual = f"unhashable ({type(exc).__name__}: {exc})"
            if actual == wv.sha256:
                pending.commit()
                self._held[index] = "ok"
                self.counters["weights_verified"] = self.counters.get("weights_verified", 0) + 1
                log.info("rollout.weights_verified", version=wv.version)
                return True
            pending.rollback()
            self._held[index] = "bad"
            self._now_serving(previous, "ok")
            self.counters["weights_rolled_back"] = self.counters.get("weights_rolled_back", 0) + 1
            self._reject(wv, f"{wv.uri}: sha256 {actual} != announced {wv.sha256}", speculative=True,
                         restored_version=self.version)
            return False
        finally:
            self._checks.pop(index, None)
