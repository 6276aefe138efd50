"""JSON values in the run's KV bucket (control plane: weights.latest, learner.progress).

Guarantees: `get_json` returns None for a missing key instead of raising; values are
plain JSON so any NATS client can read them.
"""

from __future__ import annotations

import json
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError

from bus.subjects import Registry

WEIGHTS_LATEST = "weights.latest"
LEARNER_PROGRESS = "learner.progress"
SAMPLER_PROGRESS = "sampler.progress"
STATUS = "status"
CURRICULUM = "curriculum"  # domain weights and levels, written by the scheduler, read by the sampler


async def put_json(js: JetStreamContext, reg: Registry, key: str, value: Any) -> None:
    """Store `value` as JSON under `key`."""
    kv = await js.key_value(reg.kv_bucket)
    await kv.put(key, json.dumps(value).encode())


async def get_json(js: JetStreamContext, reg: Registry, key: str) -> Any | None:
    """The JSON value under `key`, or None if absent."""
    kv = await js.key_value(reg.kv_bucket)
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, NotFoundError):
        return None
    return json.loads(entry.value) if entry and entry.value else None
