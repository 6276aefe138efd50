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
  a `file://` full-state version is mapped (or read) and swapped in at once
  (`engine.load_weights_file_speculative`), so the engine serves it without waiting for
  the hash; its sha256 is checked in a background thread (overlapping generation) while
  the previous weights are kept aside untouched. On a match they are released
  (`weights_verified`); on a mismatch the previous weights are restored, the watcher's
  version goes back to the previous one, and the version is rejected exactly as above
  (`rollout.weights_rejected`, `weights_rejected`, never loaded again; also counted in
  `weights_rolled_back`).
- Prefetch (speculative watchers given a core connection `nc`): a learner with a
  `file://` store sends a `WeightPrefetch` on `weights.<run>.prefetch` as soon as the
  file is complete, before its sha256 is computed. The watcher loads it speculatively
  at once, as above, and its check waits for the `WeightVersion` of the same version:
  it passes only if that message arrives (within 30 s + 1 s per 50 MB), names the same
  uri, and the bytes loaded hash to its sha256. Otherwise the previous weights are
  restored (`weights_rolled_back`), the hint is dropped (`rollout.weights_prefetch_failed`)
  and the `WeightVersion`, when it comes, is loaded and checked on its own. A hint is
  never authoritative: losing one costs only latency.
- The gate that makes speculation safe: `mark()` before a batch, then
  `await verified_since(mark)` before publishing it waits for the verification of EVERY
  version the engine held since the mark (a batch may span loads: agent turns, another
  pool's loop) and is True only if all of them passed. The rollout worker publishes a
  batch only then, so no trajectory generated with a version leaves the worker before
  that version's sha256 check passed. Callers that do not gate (the scheduler's
  evaluation) keep the default, verify-first.
- A version whose blob is gone from its store (deleted by the learner's retention once
  `learner.keep_versions` newer versions exist) is skipped: when a newer version is
  announced it is logged as `rollout.weights_gone` and counted (`weights_gone`), the
  engine keeps its current weights and loads the newer one next; when it is the newest
  announced version, that is a fault and it is rejected as above.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

import structlog
from nats.js.api import DeliverPolicy

from bus.objects import BlobGone, ChecksumMismatch
from bus.weight_stores import fetch_weights, in_background_thread
from schemas import DecodeError, WeightPrefetch, WeightVersion, decode

log = structlog.get_logger()
GONE = (BlobGone, FileNotFoundError)  # a deleted file:// blob surfaces as FileNotFoundError from the loaders
PREFETCH_WAIT_S = 30.0  # how long a prefetched version waits for its WeightVersion ...
PREFETCH_WAIT_BYTES_PER_S = 50e6  # ... plus its size at this rate (the learner hashes it meanwhile)
RECENT_VERSIONS = 32  # WeightVersions remembered by number, for prefetch checks


class WeightWatcher:
    """Tracks the newest WeightVersion and loads it on request."""

    def __init__(self, js, reg, counters: dict[str, float], *, speculative: bool = False, nc=None):
        self.js, self.reg, self.counters, self.nc = js, reg, counters, nc
        self.speculative = speculative
        self.newest: WeightVersion | None = None
        self.prefetch: WeightPrefetch | None = None  # newest hint newer than `newest` (speculative + nc)
        self._recent: dict[int, WeightVersion] = {}  # the last RECENT_VERSIONS announcements by version
        self._version_seen = asyncio.Event()  # set (and replaced) on each announcement
        self.steps: dict[int, int] = {}  # learner step of every announced version
        self.loaded: WeightVersion | None = None
        self.rejected: set[str] = set()
        self._announced = asyncio.Event()
        self._sub = self._prefetch_sub = None
        self._lock = asyncio.Lock()
        # every weight state the engine held, in order (a rollback is a new entry): "ok" when
        # verified before or after it served, "pending" while a speculative check runs, "bad"
        # when that check failed. A mark is an index into it.
        self._held: list[str] = []
        self._checks: dict[int, asyncio.Task] = {}  # index in _held -> its running verification

    async def start(self) -> None:
        """Subscribe to weight announcements (latest first)."""
        self._sub = await self.js.subscribe(
            self.reg.weights, cb=self._on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST
        )
        if self.speculative and self.nc is not None:
            self._prefetch_sub = await self.nc.subscribe(self.reg.weights_prefetch, cb=self._on_prefetch)

    async def close(self) -> None:
        """Unsubscribe (the connection stays open)."""
        for sub in (self._sub, self._prefetch_sub):
            if sub is not None:
                await sub.unsubscribe()
        self._sub = self._prefetch_sub = None

    @staticmethod
    def _decoded(raw, kind, event: str):
        """The message, or None after a warning naming the bad field (the watch goes on)."""
        try:
            return decode(raw.data, kind)
        except DecodeError as exc:
            log.warning(event, field=exc.field, reason=exc.reason)
            return None

    async def _on_msg(self, raw) -> None:
        wv = self._decoded(raw, WeightVersion, "rollout.weights_announcement_invalid")
        if wv is None:
            return
        self.steps[wv.version] = wv.step
        if self.newest is None or wv.version > self.newest.version:
            self.newest = wv
            self._announced.set()
        if self.prefetch is not None and self.prefetch.version <= wv.version:
            self.prefetch = None  # announced: the hint has nothing left to say
        self._recent[wv.version] = wv
        while len(self._recent) > RECENT_VERSIONS:
            del self._recent[min(self._recent)]
        seen, self._version_seen = self._version_seen, asyncio.Event()
        seen.set()

    async def _on_prefetch(self, raw) -> None:
        hint = self._decoded(raw, WeightPrefetch, "rollout.weights_prefetch_invalid")
        if hint is not None and urlparse(hint.uri).scheme == "file" and hint.version > self.newest_version:
            self.steps[hint.version] = hint.step
            self.prefetch = hint
            self._announced.set()

    @property
    def newest_version(self) -> int:
        """The newest version announced, or prefetched (-1 before any)."""
        newest = self.newest.version if self.newest else -1
        return max(newest, self.prefetch.version) if self.prefetch else newest

    async def wait_first(self, stop: asyncio.Event) -> bool:
        """Wait until some version is announced (or stop); True if one is."""
        while not stop.is_set():
            if self.newest_version >= 0:
                return True
            try:
                await asyncio.wait_for(self._announced.wait(), 1.0)
            except asyncio.TimeoutError:
                log.info("rollout.waiting_for_weights")
            self._announced.clear()
        return False

    async def wait_for_newer(self, timeout: float) -> bool:
        """Wait until a version newer than the loaded one is announced or hinted (True), or
        `timeout` seconds pass (False): how an idle worker reacts to new weights at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.newest_version <= self.version:
            self._announced.clear()
            if self.newest_version > self.version:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._announced.wait(), remaining)
            except asyncio.TimeoutError:
                return self.newest_version > self.version
        return True

    @property
    def load_lock(self) -> asyncio.Lock:
        """Held while weights are swapped into the engine: a generator that holds it for its engine
        call (the OpenAI endpoint) knows the version it generated with."""
        return self._lock

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
    def _wanted(self, wv: WeightVersion | WeightPrefetch | None) -> bool:
        return not (wv is None or (self.loaded and wv.version <= self.loaded.version) or wv.msg_id in self.rejected)

    def _candidate(self, engine) -> WeightVersion | WeightPrefetch | None:
        """What to load next: a prefetch hint newer than every announcement (for an engine
        that can load it speculatively), else the newest announcement."""
        hint = self.prefetch if hasattr(engine, "load_weights_file_speculative") else None
        if hint is not None and hint.version > (self.newest.version if self.newest else -1) and self._wanted(hint):
            return hint
        return self.newest if self._wanted(self.newest) else None

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
        if self._candidate(engine) is None:
            return False
        async with self._lock:
            await self.settle()  # the previous version's check decides what "loaded" is
            wv = self._candidate(engine)
            if wv is None:
                return False
            parsed = urlparse(wv.uri)
            if self.speculative and parsed.scheme == "file" and hasattr(engine, "load_weights_file_speculative"):
                try:
                    pending = await asyncio.to_thread(engine.load_weights_file_speculative, parsed.path)
                except ChecksumMismatch as exc:
                    pending = exc
                except GONE as exc:
                    self._gone(wv, exc)
                    return False
                if isinstance(pending, ChecksumMismatch) or pending is None:
                    if isinstance(wv, WeightPrefetch):  # the WeightVersion will decide, on its own path
                        self._drop_prefetch(
                            wv, str(pending or "no speculative path for this file"), failed=pending is not None
                        )
                        return False
                    if pending is not None:
                        self._reject(wv, str(pending))
                        return False
                else:
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
                    blob = await fetch_weights(wv.uri, wv.sha256, self.js)
            except ChecksumMismatch as exc:
                self._reject(wv, str(exc))
                return False
            except GONE as exc:
                self._gone(wv, exc)
                return False
            if not loaded:
                await asyncio.to_thread(engine.load_weights, blob)
            self._now_serving(wv, "ok")
            self._loaded_log(wv, speculative=False)
            return True

    def _gone(self, wv: WeightVersion | WeightPrefetch, exc: Exception) -> None:
        """The blob of `wv` is not in its store: skip it if superseded, else reject it."""
        if isinstance(wv, WeightPrefetch):
            self._drop_prefetch(wv, f"blob gone: {exc}")
        elif self.newest is not None and self.newest.version > wv.version:
            self.rejected.add(wv.msg_id)
            self.counters["weights_gone"] = self.counters.get("weights_gone", 0) + 1
            log.info("rollout.weights_gone", version=wv.version, newest=self.newest.version, reason=str(exc))
        else:
            self._reject(wv, f"blob gone from the store: {exc}")

    def _loaded_log(self, wv: WeightVersion, speculative: bool) -> None:
        self.counters["weights_loaded"] = self.counters.get("weights_loaded", 0) + 1
        log.info("rollout.weights_loaded", version=wv.version, bytes=wv.bytes, speculative=speculative)

    def _drop_prefetch(self, hint: WeightPrefetch, reason: str, failed: bool = True) -> None:
        """Never try this hint again (its WeightVersion is not affected); `failed`: count and warn."""
        self.rejected.add(hint.msg_id)
        if self.prefetch is hint:
            self.prefetch = None
        if failed:
            self.counters["weights_prefetch_failed"] = self.counters.get("weights_prefetch_failed", 0) + 1
            log.warning("rollout.weights_prefetch_failed", version=hint.version, uri=hint.uri, reason=reason)
        else:
            log.debug("rollout.weights_prefetch_skipped", version=hint.version, reason=reason)

    async def _announcement_of(self, hint: WeightPrefetch) -> WeightVersion | None:
        """The WeightVersion of a prefetched version, waited for (None: not within the timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PREFETCH_WAIT_S + hint.bytes / PREFETCH_WAIT_BYTES_PER_S
        while (wv := self._recent.get(hint.version)) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._version_seen.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return wv

    async def _verify(
        self, index: int, wv: WeightVersion | WeightPrefetch, previous: WeightVersion | None, pending
    ) -> bool:
        """Check a speculatively served version (or prefetch hint, against its WeightVersion);
        commit it, or roll back to `previous` and reject it (drop the hint)."""
        try:
            digest = asyncio.wrap_future(in_background_thread(pending.digest))  # low priority: generation first
            announced = await self._announcement_of(wv) if isinstance(wv, WeightPrefetch) else wv
            try:
                actual = await digest
            except Exception as exc:  # noqa: BLE001 - an unhashable load is a failed check
                actual = f"unhashable ({type(exc).__name__}: {exc})"
            if announced is not None and announced.uri == wv.uri and actual == announced.sha256:
                pending.commit()
                self._held[index] = "ok"
                if self.loaded is wv:
                    self.loaded = announced  # a hint is replaced by the authoritative announcement
                self.counters["weights_verified"] = self.counters.get("weights_verified", 0) + 1
                log.info("rollout.weights_verified", version=wv.version, prefetched=announced is not wv)
                return True
            pending.rollback()
            self._held[index] = "bad"
            self._now_serving(previous, "ok")
            self.counters["weights_rolled_back"] = self.counters.get("weights_rolled_back", 0) + 1
            if isinstance(wv, WeightPrefetch):
                reason = (
                    "no WeightVersion within the wait"
                    if announced is None
                    else f"announced at {announced.uri}"
                    if announced.uri != wv.uri
                    else f"sha256 {actual} != announced {announced.sha256}"
                )
                self._drop_prefetch(wv, reason)
            else:
                self._reject(
                    wv,
                    f"{wv.uri}: sha256 {actual} != announced {wv.sha256}",
                    speculative=True,
                    restored_version=self.version,
                )
            return False
        finally:
            self._checks.pop(index, None)
