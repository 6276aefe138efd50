"""The rollout side of payloads by reference: large workspaces in, large artifacts out.

A repository task too large to carry its repository inline names it by `Task.workspace_ref`;
an episode's artifact (the diff of a repository episode) larger than
`rollout.artifact_inline_bytes` leaves by `Trajectory.artifact_refs` (`bus.payloads`).

Guarantees:
- `resolve_workspaces` gives each task with a `workspace_ref` as a copy whose `workspace` holds
  the referenced tree, fetched once per process per content (`PayloadCache`) and checked
  (size, sha256, a map of path -> text) before any sandbox opens. A missing, corrupt or
  unreadable object raises `PayloadMissing`, a `SandboxUnavailable`: the rollout worker naks
  the batch (retried, then dead-lettered once the consumer's deliveries run out), and nothing
  is generated or published for it.
- `offload_artifacts` moves every artifact over `inline_max` bytes of the episodes into the
  run's payload bucket (identical artifacts, e.g. G samples replaying one patch, stored once)
  and leaves its ref in `Episode.artifact_refs`; artifacts at or under it stay inline. A store
  that fails raises `PayloadMissing` before anything is published (the batch is retried).
"""

from __future__ import annotations

from bus.payloads import PayloadCache, PayloadUnavailable, put_payload, unpack_files
from rollout_workers.agent import Episode, SandboxUnavailable
from schemas import BlobRef, Task


class PayloadMissing(SandboxUnavailable):
    """A payload by reference could not be fetched or stored (infrastructure: retry the batch)."""


async def resolve_workspaces(tasks: list[Task], cache: PayloadCache) -> list[Task]:
    """`tasks`, each with a `workspace_ref` replaced by a copy whose `workspace` is the tree it names."""
    out = []
    for task in tasks:
        if task.workspace_ref is None or task.workspace:
            out.append(task)
            continue
        try:
            files = await cache.get(task.workspace_ref, unpack_files, "workspace")
        except (PayloadUnavailable, ValueError) as exc:
            raise PayloadMissing(f"workspace of task {task.task_id}: {exc}") from exc
        if not files:
            raise PayloadMissing(f"workspace of task {task.task_id}: {task.workspace_ref.uri} is an empty tree")
        out.append(task.model_copy(update={"workspace": files}))
    return out


async def offload_artifacts(js, reg, episodes: list[Episode], inline_max: int) -> int:
    """Move the episodes' artifacts over `inline_max` bytes to the artifact bucket; how many moved."""
    stored: dict[bytes, BlobRef] = {}
    moved = 0
    for ep in episodes:
        for name in [n for n, data in ep.artifacts.items() if len(data) > inline_max]:
            data = ep.artifacts[name]
            try:
                key = bytes(data)
                ref = stored.get(key)
                if ref is None:
                    ref = stored[key] = await put_payload(js, reg, key, "artifact")
            except Exception as exc:
                raise PayloadMissing(
                    f"artifact {name!r} of task {ep.task.task_id} could not be stored: {type(exc).__name__}: {exc}"
                ) from exc
            ep.artifact_refs[name] = ref
            del ep.artifacts[name]
            moved += 1
    return moved
