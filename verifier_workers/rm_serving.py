"""Reward-model serving in the verifier worker: batching across the trajectories one worker
holds, and reward normalisation kept on the controlled side.

A verifier that has a `batched` attribute (`fn.batched(items, max_padding=...) ->
[Verdict | Exception]`, today only the `model` verifier) is called through `RmBatcher`
instead of once per trajectory: trajectories wait until `verifier.rm.batch_size` of them
are queued or the first has waited `verifier.rm.batch_timeout_s`, then one call scores
them all in the worker's verify threads (one forward per model, or per length bucket
with `verifier.rm.max_padding` < 1).

Guarantees:
- Every submitted trajectory gets exactly its own item's outcome: its Verdict, or the
  exception raised for it (a group's `VerifierInfraError`, e.g. a reward-model directory
  gone mid-run, reaches every trajectory of that batch, which the worker retries and
  dead-letters like any infrastructure error: never a reward of 0). An exception of the
  whole call reaches every item.
- `normalize = "running"`: `score` becomes (logit - mean) / std over every logit this
  worker has scored with that model, the batch's own included (Welford; std floored at
  `EPS`); the statistics live in this process (the controlled side: the rollout side
  never sees or sets them) and are written atomically to `<run>/rm_norm.json` at most
  every `SAVE_EVERY_S` and at `close()`, and read back at start, so a restarted worker
  continues with them. `"group"`: the z-score among the trajectories of the same
  `group_id`. `"none"`: the verdict as the verifier gave it. Verdicts without a `logit`
  component are never changed; `correct` never is.
- Groups: with `normalize = "group"`, and for a task with `verifier_params.mode =
  "pairwise"` (`verifier_workers.rm_pairwise`: `score` becomes the sample's mean
  Bradley-Terry win rate against the rest of its group; never normalised again), a
  trajectory of a group (`group_size` > 1) is held until every `sample_index` of its
  `group_id` has arrived, possibly across fetches and batches, then the whole group joins
  one batch (a batch may exceed `batch_size` by the rest of a group; a group is never
  split). Held trajectories keep getting `in_progress` from the pull loop, so JetStream
  does not redeliver them. At `group_timeout_s` after its first member the members present
  are scored among themselves (a lone one: z-score 0, win rate 0.5) and counted in
  `partial_groups` (several verifier workers sharing the consumer split groups this way).
  A sample delivered twice while held is scored once; both deliveries get that outcome.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from verifier_workers.rm_pairwise import apply_pairwise, is_pairwise
from verifier_workers.verdict import Verdict

EPS = 1e-6
SAVE_EVERY_S = 5.0
STATE_FILE = "rm_norm.json"


@dataclass
class RunningStat:
    """Welford running mean / variance."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        d = x - self.mean
        self.mean += d / self.count
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0


def _z(x: float, mean: float, std: float) -> float:
    return (x - mean) / max(std, EPS)


def _with_score(v: Verdict, score: float, how: str) -> Verdict:
    return Verdict(
        {**v.components, "score": score},
        v.status,
        f"{v.details} normalized({how})={score:.4f}",
        dict(v.weights),
        v.sandbox_s,
    )


class Normalizer:
    """Per-model running statistics and the three modes (module guarantees)."""

    def __init__(self, mode: str, state_path: Path | None = None):
        self.mode, self.state_path = mode, state_path
        self.stats: dict[str, RunningStat] = {}
        self.last_save = 0.0
        if state_path is not None and state_path.exists():
            for key, s in json.loads(state_path.read_text()).items():
                self.stats[key] = RunningStat(int(s["count"]), float(s["mean"]), float(s["m2"]))

    def apply(self, items: list, verdicts: list) -> list:
        """The verdicts of `items` ((traj, hidden) pairs) normalised by this mode."""
        if self.mode == "none":
            return verdicts
        live = [
            (i, v)
            for i, v in enumerate(verdicts)
            if isinstance(v, Verdict) and "logit" in v.components and not is_pairwise(items[i][0].verifier_params)
        ]
        out = list(verdicts)
        if self.mode == "running":
            for i, v in live:
                self.stats.setdefault(str(items[i][0].verifier_params.get("model_path", "")), RunningStat()).add(
                    v.components["logit"]
                )
            for i, v in live:
                st = self.stats[str(items[i][0].verifier_params.get("model_path", ""))]
                out[i] = _with_score(v, _z(v.components["logit"], st.mean, st.std), "running")
            self.maybe_save()
            return out
        groups: dict[str, list[int]] = {}
        for i, _ in live:
            groups.setdefault(items[i][0].group_id, []).append(i)
        for idx in groups.values():
            xs = [verdicts[i].components["logit"] for i in idx]
            mean = sum(xs) / len(xs)
            std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) if len(xs) > 1 else 1.0
            for i, x in zip(idx, xs):
                out[i] = _with_score(verdicts[i], _z(x, mean, std) if len(xs) > 1 else 0.0, "group")
        return out

    def state(self) -> dict:
        return {k: {"count": s.count, "mean": s.mean, "m2": s.m2} for k, s in self.stats.items()}

    def save(self) -> None:
        """Write the running statistics (atomically) to `state_path`."""
        if self.state_path is None or self.mode != "running":
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state()))
        os.replace(tmp, self.state_path)
        self.last_save = time.monotonic()

    def maybe_save(self) -> None:
        if time.monotonic() - self.last_save >= SAVE_EVERY_S:
            self.save()


@dataclass
class HeldGroup:
    """A group's members waiting for the rest: sample_index -> [(traj, hidden, future)]."""

    size: int
    members: dict
    timer: asyncio.TimerHandle | None = None


def _copy_outcome(dup: asyncio.Future, first: asyncio.Future) -> None:
    """Give a duplicate delivery of a held sample the outcome of the one scored."""
    if dup.done():
        return
    if first.cancelled():
        dup.cancel()
    elif first.exception() is not None:
        dup.set_exception(first.exception())
    else:
        dup.set_result(first.result())


def pairwise(items: list, verdicts: list) -> list:
    """The verdicts with pairwise-mode items' scores replaced by their group win rates."""
    idx = [i for i, (t, _) in enumerate(items) if is_pairwise(t.verifier_params)]
    if not idx:
        return verdicts
    rated = apply_pairwise([verdicts[i] for i in idx], [items[i][0].group_id for i in idx])
    out = list(verdicts)
    for i, v in zip(idx, rated):
        out[i] = v
    return out


class RmBatcher:
    """Queues trajectories of batched verifiers and scores them together (module guarantees)."""

    def __init__(self, section, executor, run_path: Path | None = None):
        self.size, self.timeout_s = section.batch_size, section.batch_timeout_s
        self.max_padding = section.max_padding
        self.group_timeout_s = section.group_timeout_s
        self.executor = executor
        self.norm = Normalizer(section.normalize, run_path / STATE_FILE if run_path is not None else None)
        self.pending: dict[object, list] = {}  # batched fn -> [(traj, hidden, future)]
        self.timers: dict[object, asyncio.TimerHandle] = {}
        self.groups: dict[tuple, HeldGroup] = {}  # (batched fn, group_id) -> members so far
        self.tasks: set[asyncio.Task] = set()
        self.batches = 0
        self.items = 0
        self.partial_groups = 0

    @staticmethod
    def batched_fn(verifier):
        """The verifier's batching hook, or None."""
        return getattr(verifier, "batched", None)

    def needs_group(self, traj) -> bool:
        """Whether `traj` is scored with its whole group (group normalisation, pairwise mode)."""
        return self.norm.mode == "group" or is_pairwise(traj.verifier_params)

    async def verdict(self, fn, traj, hidden) -> Verdict:
        """Queue one trajectory for the batched verifier `fn`; its Verdict (or its exception)."""
        fut = asyncio.get_running_loop().create_future()
        if traj.group_size > 1 and self.needs_group(traj):
            self.hold(fn, traj, hidden, fut)
        else:
            self.enqueue(fn, [(traj, hidden, fut)])
        return await fut

    def enqueue(self, fn, entries: list) -> None:
        """Add entries (a whole group at once) to `fn`'s batch; run it when full, else at the timeout."""
        queue = self.pending.setdefault(fn, [])
        queue.extend(entries)
        if len(queue) >= self.size:
            self.flush(fn)
        elif fn not in self.timers:
            self.timers[fn] = asyncio.get_running_loop().call_later(self.timeout_s, self.flush, fn)

    def hold(self, fn, traj, hidden, fut) -> None:
        """Keep `traj` with its group's other members until all are in (or the group timeout)."""
        key = (fn, traj.group_id)
        held = self.groups.get(key)
        if held is None:
            held = self.groups[key] = HeldGroup(traj.group_size, {})
            held.timer = asyncio.get_running_loop().call_later(self.group_timeout_s, self.release, key, True)
        held.members.setdefault(traj.sample_index, []).append((traj, hidden, fut))
        if len(held.members) >= held.size:
            self.release(key, False)

    def release(self, key: tuple, timed_out: bool) -> None:
        """Send a held group to the batch queue (one entry per sample; duplicates share its outcome)."""
        held = self.groups.pop(key, None)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        if timed_out:
            self.partial_groups += 1
        entries = []
        for copies in held.members.values():
            first = copies[0][2]
            for _, _, dup in copies[1:]:
                first.add_done_callback(functools.partial(_copy_outcome, dup))
            entries.append(copies[0])
        self.enqueue(key[0], entries)

    def flush(self, fn) -> None:
        """Start scoring what is queued for `fn` now."""
        timer = self.timers.pop(fn, None)
        if timer is not None:
            timer.cancel()
        queue = self.pending.pop(fn, [])
        if queue:
            task = asyncio.get_running_loop().create_task(self.run(fn, queue))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def run(self, fn, queue: list) -> None:
        items = [(t, h) for t, h, _ in queue]
        try:
            call = functools.partial(fn, items, max_padding=self.max_padding)
            results = await asyncio.get_running_loop().run_in_executor(self.executor, call)
            if len(results) != len(items):
                raise RuntimeError(f"batched verifier returned {len(results)} results for {len(items)} items")
            results = self.norm.apply(items, results)
            results = pairwise(items, results)
        except Exception as exc:  # noqa: BLE001 (the whole call failed: every item gets the failure)
            results = [exc] * len(items)
        self.batches += 1
        self.items += len(items)
        for (_, _, fut), r in zip(queue, results):
            if fut.done():
                continue
            if isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    def close(self) -> None:
        """Write the running statistics (the worker calls it when it stops)."""
        self.norm.save()
