"""The run's KV bucket: every key name of the control plane, and JSON values under them.

Guarantees: every key any role reads or writes in KV `run-<run>` is named here and only
here (a test greps the rest of the tree for their literals); `get_json` returns None for
a missing key instead of raising; values are plain JSON so any NATS client can read them.
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
DURATIONS = "durations"  # per-domain episode durations, written by the scheduler, read by the sampler (pools)
RELEASE_LATEST = "release.latest"  # the newest version that passed the release gates (scheduler)
LEARNER_OVERRIDES = "learner.overrides"  # written by the scheduler's forgetting guard, read by the learner
PLATEAU = "plateau"  # the scheduler's plateau detector state
GATES_BASELINE = "gates.baseline"  # per-domain baseline scores of the release gates
EVAL_BASELINE = "eval.baseline"  # version 0's held-out score (scheduler)
LEARNER_LEASE = "learner.lease"  # the single-learner lease (learner/lease.py)
DLQ_REPLAYED = "dlq.replayed.{seq}"  # one record per replayed dead letter (`rlbus dlq replay`)

STOP_REQUESTED = "stop-requested"  # the value of STATUS when the scheduler asks the run to stop


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
