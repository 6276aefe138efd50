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
  continues with them. `"group"`: the z-score among the batch's trajectories of the same
  `group_id` (a group alone in its batch scores 0). `"none"`: the verdict as the verifier
  gave it. Verdicts without a `logit` component are never changed; `correct` never is.
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
        live = [(i, v) for i, v in enumerate(verdicts) if isinstance(v, Verdict) and "logit" in v.components]
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


class RmBatcher:
    """Queues trajectories of batched verifiers and scores them together (module guarantees)."""

    def __init__(self, section, executor, run_path: Path | None = None):
        self.size, self.timeout_s = section.batch_size, section.batch_timeout_s
        self.max_padding = section.max_padding
        self.executor = executor
        self.norm = Normalizer(section.normalize, run_path / STATE_FILE if run_path is not None else None)
        self.pending: dict[object, list] = {}  # batched fn -> [(traj, hidden, future)]
        self.timers: dict[object, asyncio.TimerHandle] = {}
        self.tasks: set[asyncio.Task] = set()
        self.batches = 0
        self.items = 0

    @staticmethod
    def batched_fn(verifier):
        """The verifier's batching hook, or None."""
        return getattr(verifier, "batched", None)

    async def verdict(self, fn, traj, hidden) -> Verdict:
        """Queue one trajectory for the batched verifier `fn`; its Verdict (or its exception)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self.pending.setdefault(fn, [])
        queue.append((traj, hidden, fut))
        if len(queue) >= self.size:
            self.flush(fn)
        elif fn not in self.timers:
            self.timers[fn] = loop.call_later(self.timeout_s, self.flush, fn)
        return await fut

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
