"""Weight-version retention: the store keeps the newest `learner.keep_versions` versions.

Every published version is a full blob (a 7B model in bf16: ~15 GB), so a run that
publishes each step would fill any disk; nothing else ever deletes them.

Guarantees:
- After version v is published, versions <= v - keep are deleted from the store
  (`vNNNNNN.safetensors`; other names are never touched), except version 0 (the
  starting weights, the baseline every evaluation compares against) and the version the
  scheduler released (KV `release.latest`, read at each prune): `rlbus export` of the
  start, the released version and the newest `keep` versions always finds its blob.
  A released version that a later release replaced is deleted at the next prune.
- The first prune of a process lists the store and deletes what an earlier process left
  (a crash between publish and prune, a smaller `keep` on resume); later prunes delete
  only versions that became old since, without listing.
- A failed delete is logged (`learner.prune_failed`) and retried at the next prune; a
  prune never fails a step.
- keep = 0 keeps every version.
- Readers: rollout workers and the scheduler load only the newest announced version, so
  a deleted version is one that `keep` newer versions superseded. A reader that still
  asks for it gets a clear "gone" and skips it (`rollout_workers.weights_watch`). A
  `file://` reader that already opened or mapped the file keeps reading it.
"""

from __future__ import annotations

import re

import structlog

from bus.kv import RELEASE_LATEST, get_json

log = structlog.get_logger()
VERSION_NAME = re.compile(r"^v(\d{6,})\.safetensors$")


def version_name(version: int) -> str:
    """The store name of a version's blob."""
    return f"v{version:06d}.safetensors"


class Retention:
    """Deletes old versions from one weight store after each publish."""

    def __init__(self, store, keep: int, js=None, reg=None) -> None:
        self.store, self.keep, self.js, self.reg = store, keep, js, reg
        self.stored: set[int] | None = None  # versions believed in the store; None: not listed yet

    async def released(self) -> int | None:
        """The scheduler's released version (KV `release.latest`), if any."""
        if self.js is None or self.reg is None:
            return None

        return int(((await get_json(self.js, self.reg, RELEASE_LATEST)) or {}).get("version", -1))

    async def after_publish(self, version: int) -> int:
        """Prune after `version` was published; the number of blobs deleted now."""
        if self.keep <= 0 or not hasattr(self.store, "delete"):
            return 0
        if self.stored is None:
            try:
                names = await self.store.names()
            except Exception as exc:  # noqa: BLE001 - listing failed: try again next time
                log.warning("learner.prune_failed", error=str(exc), during="list")
                return 0
            self.stored = {int(m.group(1)) for n in names if (m := VERSION_NAME.match(n))}
        self.stored.add(version)
        old = sorted(v for v in self.stored if 0 < v <= version - self.keep)
        if not old:
            return 0
        try:
            released = await self.released()
        except Exception as exc:  # noqa: BLE001 - the release is unknown: delete nothing this time
            log.warning("learner.prune_failed", error=str(exc), during="reading release.latest")
            return 0
        deleted = 0
        for v in old:
            if v == released:
                continue
            try:
                await self.store.delete(version_name(v))
            except Exception as exc:  # noqa: BLE001 - retried at the next prune
                log.warning("learner.prune_failed", version=v, error=str(exc))
                continue
            self.stored.discard(v)
            deleted += 1
        return deleted
