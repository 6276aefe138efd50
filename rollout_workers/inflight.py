"""Weight updates in flight: one model turn generated in chunks, a newer policy version loaded
between chunks (AReaL-style: reload, then resubmit the prompt plus the tokens so far).

`generate_turn(engine, prompts, n, max_tokens, temperature, inflight)` is the one way the agent
loop and the rollout worker ask an engine for a turn. With `inflight` None it is exactly one
`engine.generate` call (today's behaviour, `rollout.inflight.enabled = false`). With an
`Inflight`, it is engine-agnostic (any engine of the `rollout_workers.engines` contract: hf,
vllm, ...; nothing in an engine changes) and guarantees:

- Chunks: the first call generates `min(chunk_tokens, max_tokens)` tokens for every prompt's
  `n` samples; each sample that has not stopped is resubmitted as its token ids (prompt +
  tokens so far, never re-tokenized text) with `n = 1` and the next chunk's budget, until it
  stops or has `max_tokens` tokens. Every live row has generated the same number of tokens,
  so one call per chunk serves them all.
- Stop conditions are the unchunked ones: end-of-sequence (the engine's `stop`) ends the
  turn in the chunk it occurs; the turn's token budget is `max_tokens` in all (`length`);
  an engine's stop strings (`engine.stop`, vLLM's) that a chunk boundary splits are found
  in the decoded turn and the turn is cut after the token that completed the first one
  (`stop`), as vLLM does unchunked. The text of a multi-chunk turn is the decode of its ids
  (cut after its stop string); a one-chunk turn keeps the engine's text.
- Under fixed weights the ids equal the unchunked call's and the log-probs agree within
  float tolerance (greedy; seeded sampling too while every row of the call runs every chunk:
  the hf engine draws from one torch generator per batch step, so a row that stops early
  shifts the draws of the others), tests/test_inflight.py.
- Between chunks `refresh()` (the weight watcher's `maybe_load(engine)`) loads at most one
  newer version (logged as `rollout.inflight_reload` with the tokens generated so far); it never waits for a version to appear, so versions published faster than
  they load cannot stall the turn: each boundary takes the newest one there is, and the turn
  always advances by a chunk.
- Each chunk's engine call holds `lock` (the watcher's load lock) when given, so a load
  from another pool's loop cannot land mid-chunk: the version read under the lock made
  every token of the chunk. Each Sample's `runs` is `[(version, n_tokens), ...]`, adjacent
  chunks of one version merged, covering exactly its token ids.
- Nothing is published from here: a worker killed mid-chunk leaves its task unacked (the
  rollout worker acks only after publishing), so the task is redelivered and the partial
  turn is simply gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import structlog

from rollout_workers.engines.sample import Sample

log = structlog.get_logger()


@dataclass
class Inflight:
    """How a turn takes new weights mid-generation (`rollout.inflight`, wired by the rollout worker)."""

    chunk_tokens: int
    """Tokens per chunk (>= 1)."""
    version: Callable[[], int]
    """The version the engine holds now."""
    refresh: Callable[[], Awaitable] | None = None
    """Load a newer version if one is announced (None: chunks only, never a reload)."""
    lock: asyncio.Lock | None = None
    """Held for each chunk's engine call (the watcher's load lock), so its version is exact."""

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"rollout.inflight.chunk_tokens must be >= 1, got {self.chunk_tokens}")


@dataclass
class _Row:
    """One sample being generated: its prompt, chunks so far and version runs."""

    prompt_ids: np.ndarray
    ids: list[np.ndarray]
    logprobs: list[np.ndarray]
    runs: list[tuple[int, int]]
    first: Sample
    chunks: int = 0
    done: bool = False
    finish: str = "length"
    text: str | None = None

    @property
    def n(self) -> int:
        return sum(len(x) for x in self.ids)

    def context(self) -> np.ndarray:
        """The prompt and the tokens so far, as ids (one array: no per-token Python loop)."""
        return np.concatenate([self.prompt_ids, *self.ids]).astype(np.int32)

    def add(self, s: Sample, version: int) -> None:
        self.ids.append(np.asarray(s.token_ids, dtype=np.int32))
        self.logprobs.append(np.asarray(s.logprobs, dtype=np.float32))
        self.chunks += 1
        k = len(s.token_ids)
        if k:
            if self.runs and self.runs[-1][0] == version:
                self.runs[-1] = (version, self.runs[-1][1] + k)
            else:
                self.runs.append((version, k))
        if s.finish_reason == "stop" or k == 0:  # an empty chunk cannot advance: the turn ends as it stands
            self.done, self.finish = True, s.finish_reason


def cut_runs(runs: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The runs of the first `n` tokens (a turn cut after its tool call keeps its head)."""
    out, left = [], n
    for v, k in runs:
        if left <= 0:
            break
        out.append((v, min(k, left)))
        left -= k
    return out


def _stop_cut(engine, row: _Row, stops: list[str]) -> None:
    """End `row` at a stop string the last chunk boundary split (see the module guarantees)."""
    ids = np.concatenate(row.ids)
    text = engine.decode(ids)
    hits = [text.find(s) + len(s) for s in stops if s and s in text]
    if not hits:
        return
    end = min(hits)
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        t = engine.decode(ids[:mid])
        lo, hi = (lo, mid) if any(s and s in t for s in stops) else (mid + 1, hi)
    lp = np.concatenate(row.logprobs)
    row.ids, row.logprobs, row.runs = [ids[:lo]], [lp[:lo]], cut_runs(row.runs, lo)
    row.done, row.finish, row.text = True, "stop", text[:end]


def _result(engine, row: _Row, stops: list[str]) -> Sample:
    if row.chunks == 1 and row.text is None:
        s = row.first
        return Sample(s.prompt_ids, s.token_ids, s.logprobs, s.text, s.finish_reason, list(row.runs))
    ids = np.concatenate(row.ids) if row.ids else np.zeros(0, np.int32)
    text = row.text
    if text is None:
        text = engine.decode(ids)
        hits = [text.find(s) + len(s) for s in stops if s and s in text]
        if hits and row.finish == "stop":
            text = text[: min(hits)]
    return Sample(
        np.asarray(row.prompt_ids, dtype=np.int32),
        ids.astype(np.int32),
        np.concatenate(row.logprobs).astype(np.float32),
        text,
        row.finish,
        list(row.runs),
    )


async def _call(engine, inflight: Inflight, prompts, n: int, budget: int, temperature: float):
    """One chunk's engine call and the version that made it (under the load lock, when given)."""
    if inflight.lock is None:
        v = inflight.version()
        return v, await asyncio.to_thread(engine.generate, prompts, n, budget, temperature)
    async with inflight.lock:
        v = inflight.version()
        return v, await asyncio.to_thread(engine.generate, prompts, n, budget, temperature)


async def generate_turn(
    engine, prompts: list, n: int, max_tokens: int, temperature: float, inflight: Inflight | None = None
) -> list[list[Sample]]:
    """Per prompt, its `n` Samples of one turn: one engine call without `inflight`, else in
    chunks with new weights taken between them (see the module guarantees)."""
    if inflight is None:
        return await asyncio.to_thread(engine.generate, prompts, n, max_tokens, temperature)
    stops = [s for s in (getattr(engine, "stop", None) or []) if s]
    chunk = inflight.chunk_tokens
    v, groups = await _call(engine, inflight, prompts, n, min(chunk, max_tokens), temperature)
    rows: list[list[_Row]] = []
    for g in groups:
        rows.append([])
        for s in g:
            row = _Row(np.asarray(s.prompt_ids, dtype=np.int32), [], [], [], first=s)
            row.add(s, v)
            rows[-1].append(row)
    flat = [r for g in rows for r in g]
    live = [r for r in flat if not r.done and r.n < max_tokens]
    while live:
        if inflight.refresh is not None:
            before = inflight.version()
            await inflight.refresh()
            if inflight.version() != before:
                log.info("rollout.inflight_reload", version=inflight.version(), previous=before, tokens=live[0].n)
        budget = min(chunk, max_tokens - live[0].n)
        v, out = await _call(engine, inflight, [r.context() for r in live], 1, budget, temperature)
        for r, (s,) in zip(live, out, strict=True):
            r.add(s, v)
            if not r.done and stops:
                _stop_cut(engine, r, stops)
        live = [r for r in live if not r.done and r.n < max_tokens]
    return [[_result(engine, r, stops) for r in g] for g in rows]


def for_tasks(inflight: Inflight | None, tasks) -> Inflight | None:
    """`inflight` for an engine call over `tasks`, or None when one of them is an eval task: an
    evaluation scores one version, so its turns never take new weights mid-generation."""
    if inflight is None or any(t.purpose == "eval" for t in tasks):
        return None
    return inflight


def turn_versions(sample: Sample, version: int, n_tokens: int | None = None) -> dict:
    """`policy_version` and `version_runs` of a Turn made from `sample` (its first `n_tokens`
    ids when cut): without runs, all of it is `version` and no runs are recorded (the wire as
    before in-flight updates); with runs, the turn's version is its last run's."""
    if not sample.runs:
        return {"policy_version": version}
    runs = cut_runs(sample.runs, len(sample.token_ids) if n_tokens is None else n_tokens)
    return {"policy_version": runs[-1][0] if runs else version, "version_runs": runs}
