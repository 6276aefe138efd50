"""The tracker role (`rlbus worker tracker`): experiment tracking written from the bus alone.

One process per run reads the run's durable logs and writes TensorBoard event files
and/or a wandb run (`[tracking] backends`). No other role imports a tracking library.

What it reads, each through its own durable pull consumer (`Registry.tracker_consumer`):
- WEIGHTS (`tracker-weights`): every `WeightVersion` carries the learner's metrics of the
  step that produced it (loss, pg_loss, kl, clip_frac, ratio and IS statistics, grad_norm,
  tokens, staleness, reward_mean, ...) -> `learner/<name>` at that step, and the timeline
  of learner steps over server time. The learner publishes one every `publish_every` steps,
  so with `publish_every > 1` learner metrics are every K-th step's.
- REWARDS (`tracker-rewards`): train rewards -> per learner-step windows (`train/...`):
  reward mean in total and per domain, samples, tokens, the sampled tokens' mean negative
  log-prob (a per-token entropy estimate of the behaviour policy: the learner computes no
  entropy), and every `samples_every_n_steps` steps a table of a few samples.
- EVAL (`tracker-eval`): held-out and regression evaluation -> `eval/<domain>` at the
  evaluated version's step.
- KV `curriculum` history (`tracker-kv-curriculum` on the KV bucket's stream): domain
  weights and levels -> `curriculum/<domain>/weight|level`, the step's last value.
- Stream and consumer state, sampled once per new learner step: throughput per stage,
  queue depths, dead letters per stage (`throughput/`, `queue/`, `dead_letters/`). These
  are gauges of the moment: none is sampled while the tracker is down.

Guarantees:
- No point is lost or written twice across restarts. The tracker's position is its state
  file `<run>/tracking/state.json` (per feed: the last stream sequence written; the open
  windows; the last step per tag; the learner timeline). Each cycle writes the points,
  flushes every backend, replaces the state file atomically, and only then acks. At start
  each durable is recreated to deliver right after the state's sequence (from the start of
  the streams when there is no state: enabling tracking on a running or finished run
  backfills it), so a message is applied exactly once even if the acks were lost. TensorBoard
  event files are append-only: `Steps` keeps each tag strictly increasing, so a point at a
  step its tag already has is dropped, never appended again. (A crash between a backend
  flush and the state rename, a few microseconds, can repeat that one cycle's points.)
- A message that does not decode or belongs to another run is acked and counted, never
  dead-lettered (the stage that produced it handles that).
- It stops on SIGTERM after a final drain (bounded), on `max_messages` consumed, or after
  `until_idle` seconds with nothing to read; at a clean stop the open windows are written
  (a late reward for a written window counts in the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from pathlib import Path

import nats.errors
import structlog
from nats.js.errors import NotFoundError

from bus.conn import ensure_consumer_from
from bus.kv import CURRICULUM, LEARNER_PROGRESS, get_json
from bus.pull import fetch
from bus.session import WorkerContext, worker_session
from bus.subjects import Registry
from rlbus.tracking.backends import TrackingUnavailable, check_installed, open_backends
from rlbus.tracking.points import Point, Steps, Timeline, Windows
from schemas import DecodeError, EvalResult, Reward, WeightVersion, decode, unpack_f32
from schemas.config import RunConfig

log = structlog.get_logger()
STATE_FILE = Path("tracking") / "state.json"
FEEDS = ("weights", "rewards", "eval", "kv")
BATCH, FETCH_S, DRAIN_S = 256, 0.2, 10.0


def stored_at(raw) -> float:
    """When the server stored a JetStream message (unix seconds; one clock for every stream)."""
    return raw.metadata.timestamp.timestamp()


def load_state(path: Path) -> dict:
    """The tracker's saved state, or {} when there is none."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def save_state(path: Path, state: dict) -> None:
    """Replace the state file atomically (written, fsynced, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def bind_feed(js, spec, last_seq: int):
    """Recreate the durable `spec` to deliver right after stream sequence `last_seq`, bind it."""
    with contextlib.suppress(NotFoundError):
        await js.delete_consumer(spec.stream, spec.durable)
    await ensure_consumer_from(js, spec, last_seq + 1)
    return await js.pull_subscribe_bind(spec.durable, stream=spec.stream)


def reward_sample(r: Reward, step: int, chars: int) -> list:
    """One row of the samples table: step, domain, reward, components, prompt, completion."""
    turns = r.trajectory.turns
    prompt = "".join(t.text for t in turns if t.role == "prompt") or r.trajectory.final_text
    completion = "".join(t.text for t in turns if t.role != "prompt") or r.trajectory.final_text
    return [
        step,
        r.trajectory.domain,
        round(r.reward, 4),
        {k: round(v, 4) for k, v in r.components.items()},
        prompt[:chars],
        completion[:chars],
    ]


def neg_logprob(r: Reward) -> tuple[float, float]:
    """(sum of -logprob, tokens) over the sampled tokens of the trajectory's model turns."""
    total, n = 0.0, 0
    for t in r.trajectory.turns:
        if t.trainable and t.logprobs:
            lp = unpack_f32(t.logprobs)
            total -= float(lp.sum())
            n += len(lp)
    return total, float(n)


class Tracker:
    """Feeds in, points out: one cycle reads every feed once, writes, saves, acks."""

    def __init__(self, js, reg: Registry, cfg: RunConfig, run_path: Path, backends: list, counters: dict):
        self.js, self.reg, self.cfg, self.backends, self.c = js, reg, cfg, backends, counters
        self.state_path = run_path / STATE_FILE
        st = load_state(self.state_path)
        tc = cfg.tracking
        self.seq: dict[str, int] = {f: int(st.get("seq", {}).get(f, 0)) for f in FEEDS}
        self.steps = Steps(st.get("steps"))
        self.timeline = Timeline(st.get("timeline"))
        self.windows = Windows(tc.samples_every_n_steps, tc.samples_per_table, st.get("windows"))
        self.system: dict = st.get("system") or {"step": -1}
        self.subs: dict = {}

    def spec(self, feed: str):
        return self.reg.tracker_consumer(feed, CURRICULUM if feed == "kv" else "")

    async def bind(self) -> None:
        """Bind every feed's durable at the state's position."""
        for feed in FEEDS:
            self.subs[feed] = await bind_feed(self.js, self.spec(feed), self.seq[feed])
        log.info("tracker.bound", positions=self.seq, backends=[b.name for b in self.backends])

    def _count(self, key: str, n: float = 1) -> None:
        self.c[key] = self.c.get(key, 0) + n

    def _decode(self, raw, kind):
        try:
            msg = decode(raw.data, kind)
        except DecodeError as exc:
            self._count("undecodable")
            log.warning("tracker.undecodable", subject=raw.subject, field=exc.field, reason=exc.reason)
            return None
        if msg.run_id != self.reg.run_id:
            self._count("foreign")
            return None
        return msg

    async def drain(self, feed: str) -> list:
        """Fetch until the feed has nothing more (the weights timeline must be complete)."""
        out: list = []
        while True:
            got = await fetch(self.subs[feed], BATCH, FETCH_S if not out else 0.05)
            out += got
            if len(got) < BATCH:
                return out

    def on_weights(self, raws: list) -> list[Point]:
        points: list[Point] = []
        for raw in raws:
            wv = self._decode(raw, WeightVersion)
            if wv is None:
                continue
            t = stored_at(raw)
            self.timeline.add(t, wv.step)
            points.append(Point("learner/version", wv.step, float(wv.version), t))
            for name, value in sorted(wv.metrics.items()):
                if isinstance(value, (int, float)) and math.isfinite(value):
                    points.append(Point(f"learner/{name}", wv.step, float(value), t))
        self._count("weights", len(raws))
        return points

    def on_rewards(self, raws: list, known_step: int) -> int:
        """Count train rewards into their windows; return the step below which rewards are complete."""
        chars = self.cfg.tracking.sample_chars
        for raw in raws:
            r = self._decode(raw, Reward)
            if r is None or r.trajectory.purpose != "train":
                continue
            t = stored_at(raw)
            step = self.timeline.step_at(t)
            sample = reward_sample(r, step, chars) if self.windows.wants_sample(step) else None
            self.windows.add_reward(
                step, t, r.trajectory.domain, r.reward, float(r.trajectory.tokens), neg_logprob(r), sample
            )
        self._count("rewards", len(raws))
        return self.timeline.step_at(stored_at(raws[-1])) if raws else known_step

    def on_curriculum(self, raws: list, known_step: int) -> int:
        """Keep each window's newest curriculum value; return the step below which updates are complete."""
        for raw in raws:
            if not raw.data:  # a KV delete/purge marker
                continue
            try:
                value = json.loads(raw.data)
            except ValueError:
                self._count("undecodable")
                continue
            if isinstance(value, dict):
                t = stored_at(raw)
                self.windows.add_curriculum(self.timeline.step_at(t), t, value)
        self._count("curriculum", len(raws))
        return self.timeline.step_at(stored_at(raws[-1])) if raws else known_step

    def on_evals(self, raws: list) -> list[Point]:
        points = []
        for raw in raws:
            ev = self._decode(raw, EvalResult)
            if ev is not None:
                points.append(Point(f"eval/{ev.domain}", ev.step, ev.score, stored_at(raw)))
        self._count("evals", len(raws))
        return points

    async def cycle(self, final: bool = False) -> int:
        """Read every feed once, write what closed, save the state, ack; return messages read."""
        known = self.timeline.latest  # the steps known before the reward/curriculum fetches
        rewards = await fetch(self.subs["rewards"], BATCH, FETCH_S)
        kv = await fetch(self.subs["kv"], BATCH, FETCH_S)
        evals = await fetch(self.subs["eval"], BATCH, FETCH_S)
        weights = await self.drain("weights")  # after the fetches: every version older than them is known
        points = self.on_weights(weights) + self.on_evals(evals)
        complete = min(self.on_rewards(rewards, known), self.on_curriculum(kv, known))
        closed, tables = self.windows.close_all() if final else self.windows.close_below(complete)
        points += closed + await self.sample_system()
        raws = {"weights": weights, "rewards": rewards, "eval": evals, "kv": kv}
        n = sum(map(len, raws.values()))
        if n or closed or final:
            await self.write(points, tables, raws)
        for batch in raws.values():
            for raw in batch:
                await raw.ack()
        return n

    async def write(self, points: list, tables: list, raws: dict) -> None:
        """Points through the step guard into every backend, flushed; then the state file."""
        admitted = self.steps.admit(points)
        admitted_tables = self.steps.admit(tables)

        def to_backends() -> None:
            for b in self.backends:
                b.write(admitted, admitted_tables)
                b.flush()

        if admitted or admitted_tables:
            await asyncio.to_thread(to_backends)
        for feed, batch in raws.items():
            if batch:
                self.seq[feed] = max(self.seq[feed], batch[-1].metadata.sequence.stream)
        self.timeline.prune()
        save_state(
            self.state_path,
            {
                "seq": self.seq,
                "steps": self.steps.last,
                "timeline": self.timeline.state(),
                "windows": self.windows.state(),
                "system": self.system,
            },
        )
        self._count("points", len(admitted))
        self._count("tables", len(admitted_tables))
        self.c["points_dropped"] = self.steps.dropped

    async def sample_system(self) -> list[Point]:
        """Throughput, queue depths and dead letters, once per new learner step."""
        step = self.timeline.latest
        if step <= self.system.get("step", -1):
            return []
        try:
            counts, gauges = await self._stream_state()
        except (nats.errors.TimeoutError, asyncio.TimeoutError, NotFoundError) as exc:
            log.info("tracker.system_unavailable", error=repr(exc))
            return []
        now = time.time()
        prev, dt = self.system.get("counts") or {}, now - float(self.system.get("t", now))
        points = [Point(tag, step, value, now) for tag, value in gauges.items()]
        if prev and dt > 0:
            points += [
                Point(f"throughput/{k}_per_s", step, max(0.0, (v - prev.get(k, v)) / dt), now)
                for k, v in counts.items()
            ]
        self.system = {"step": step, "t": now, "counts": counts}
        return points

    async def _stream_state(self) -> tuple[dict[str, float], dict[str, float]]:
        """(cumulative counts per stage, gauges) from stream and consumer state."""
        js, reg = self.js, self.reg
        tasks = (await js.stream_info(reg.stream("TASKS"))).state
        traj = (await js.stream_info(reg.stream("TRAJ"))).state
        rewards = (await js.stream_info(reg.stream("REWARDS"))).state
        dlq = (await js.stream_info(reg.stream("DLQ"), subjects_filter=reg.all("dlq"))).state
        progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
        counts = {
            "sampler_tasks": float(tasks.last_seq),
            "rollout_trajectories": float(traj.last_seq),
            "verifier_rewards": float(rewards.last_seq),
            "learner_samples": float(progress.get("samples_trained") or 0),
        }
        gauges = {
            "queue/tasks": float(tasks.messages),
            "queue/trajectories": float(traj.messages),
            "dead_letters/total": float(dlq.messages),
        }
        for subject, n in sorted((dlq.subjects or {}).items()):
            gauges[f"dead_letters/{subject.rsplit('.', 1)[-1]}"] = float(n)
        with contextlib.suppress(NotFoundError):  # no learner durable yet
            ci = await js.consumer_info(reg.stream("REWARDS"), reg.learner_consumer().durable)
            gauges["queue/rewards"] = float(ci.num_pending + ci.num_ack_pending)
        return counts, gauges

    def close(self) -> None:
        for b in self.backends:
            b.close()


async def track(
    tracker: Tracker, stop: asyncio.Event, max_messages: int | None = None, until_idle: float | None = None
) -> None:
    """Cycle until `stop` (then drain, bounded), `max_messages` read, or `until_idle` seconds idle."""
    read, idle_since = 0, time.monotonic()
    while not stop.is_set():
        n = await tracker.cycle()
        read += n
        if n:
            idle_since = time.monotonic()
        if max_messages is not None and read >= max_messages:
            break
        if until_idle is not None and time.monotonic() - idle_since >= until_idle:
            break
    deadline = time.monotonic() + DRAIN_S
    while stop.is_set() and time.monotonic() < deadline and await tracker.cycle():
        pass  # SIGTERM: what is already on the bus still gets written
    await tracker.cycle(final=True)


async def run(cfg: RunConfig, ctx: WorkerContext) -> dict[str, float]:
    """Run the tracker until stopped (see the module docstring)."""
    try:
        check_installed(cfg.tracking.backends)
    except TrackingUnavailable as exc:
        raise SystemExit(f"rlbus worker tracker: {exc}") from None
    if not cfg.tracking.backends:
        log.warning("tracker.no_backends", why="tracking.backends is empty: nothing to write")
    cfg = cfg.model_copy(deep=True)
    cfg.run.run_id = ctx.run_id
    async with worker_session("tracker", cfg, ctx) as s:
        backends = await asyncio.to_thread(open_backends, cfg, ctx.run_path)
        tracker = Tracker(s.js, s.reg, cfg, ctx.run_path, backends, s.counters)
        try:
            await tracker.bind()
            await track(tracker, s.stop, ctx.max_messages, ctx.until_idle)
        finally:
            await asyncio.to_thread(tracker.close)
        return dict(s.counters)
