"""The launcher's view of a run: live facts from telemetry, KV and streams, and summary.json.

Guarantees:
- `Monitor` consumes nothing: telemetry and weight announcements through core
  subscriptions, eval results and every reward through ordered consumers (the rewards
  stream is read with `glance_reward`, the light decode); a message that fails to
  decode is skipped, never an error.
- `DomainRewards` gives each domain's training rewards (count, mean, verifier statuses),
  the tool calls its episodes made, and the refused calls by kind (`tool_errors`:
  malformed JSON, unknown tool, bad arguments); every status other than `ok` is also
  counted per task (`task_statuses`: status -> task_id -> count), so a Harbor task whose
  tests leave no reward file is named, not only its domain; `drift` counts the harness calls
  (and episodes with one) whose re-rendered history did not start with the recorded ids.
- `summary_dict` is the run's summary.json; its accounting fields are null until the
  run stopped and `rlbus.run.accounting` counted every message. Its `domains` has one entry
  per domain sampled, scored or in the curriculum: `tasks` (published by the sampler,
  KV `sampler.progress`), `rewards`, `reward_mean`, and the curriculum's `level` and
  `weight` (KV `curriculum`; null before its first update). Its `eval.<domain>` carries
  `purpose` (`train`, or `heldout` for a zero-shot domain) next to `baseline` (version 0;
  for a held-out domain its earliest evaluated version), `final` and `curve`. `sandbox_isolation` is
  what the run's sandboxes get ("bwrap", "docker", or "degraded": unisolated on purpose).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bus.kv import (
    CURRICULUM,
    LEARNER_PROGRESS,
    PLATEAU,
    RELEASE_LATEST,
    SAMPLER_PROGRESS,
    STATUS,
    STOP_REQUESTED,
    get_json,
)
from bus.subjects import Registry
from bus.telemetry import BUSY_S, CPU_SECONDS, TOKENS, WEIGHTS_LOADED, Heartbeats
from rlbus.run.live import Snapshot
from schemas import DecodeError, EvalResult, RewardGlance, WeightVersion, decode, glance_reward


class DomainRewards:
    """Training rewards of one domain as the run saw them: count, mean, verifier statuses,
    and the tool calls its episodes made (by tool name, and episodes with at least one), and
    the refused ones by error kind (`tool_errors`)."""

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.statuses: dict[str, int] = {}
        self.tool_calls: dict[str, int] = {}
        self.episodes_with_tool_calls = 0
        self.tool_errors: dict[str, int] = {}
        self.task_statuses: dict[str, dict[str, int]] = {}  # non-ok status -> task_id -> count
        self.drift_calls = self.drift_episodes = 0  # harness-owned episodes (rollout_workers.endpoint)

    def add(self, r: RewardGlance) -> None:
        self.n += 1
        self.total += r.reward
        self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
        self.drift_calls += r.drift
        self.drift_episodes += bool(r.drift)
        if r.status != "ok":
            by_task = self.task_statuses.setdefault(r.status, {})
            by_task[r.task_id] = by_task.get(r.task_id, 0) + 1
        for tool, _ in r.tool_calls:
            self.tool_calls[tool] = self.tool_calls.get(tool, 0) + 1
        self.episodes_with_tool_calls += bool(r.tool_calls)
        for kind in r.tool_errors:
            self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    def as_dict(self) -> dict:
        return {
            "rewards": self.n,
            "reward_mean": round(self.total / self.n, 4) if self.n else None,
            "statuses": self.statuses,
            "tool_calls": self.tool_calls,
            "episodes_with_tool_calls": self.episodes_with_tool_calls,
            "tool_errors": self.tool_errors,
            "task_statuses": self.task_statuses,
            "drift": {"calls": self.drift_calls, "episodes": self.drift_episodes},
        }


class Monitor:
    """Live facts of the run, fed by core-NATS subscriptions (consumes nothing)."""

    def __init__(self, js, reg: Registry, snap: Snapshot):
        self.js, self.reg, self.snap = js, reg, snap
        self.beats = Heartbeats()  # every worker's newest heartbeat (bus.telemetry's one reader)
        self.step_rewards: dict[int, float] = {}
        self.evals: dict[int, EvalResult] = {}  # first trained domain's curve (the live view's headline)
        self.headline: str | None = None
        self.domain_evals: dict[str, dict[int, EvalResult]] = {}
        self._last_totals: dict[str, float] = {}
        self._last_t = time.monotonic()
        self.plateau: dict | None = None  # KV `plateau` (scheduler.gates)
        self.released_version: int | None = None  # KV `release.latest`
        self.stop_requested = False  # KV `status` == "stop-requested"
        self.domain_rewards: dict[str, DomainRewards] = {}  # training rewards per domain
        self.sandbox_isolation: str | None = None  # "bwrap" | "docker" | "degraded", probed by the launcher
        self.tasks_by_domain: dict[str, int] = {}  # KV `sampler.progress` by_domain
        self.curriculum: dict = {}  # KV `curriculum`: weights and levels
        self.last_heartbeat: dict[int, float] = self.beats.last_seen  # worker pid -> monotonic time of its last beat

    async def start(self, nc) -> None:
        """Subscribe to telemetry, weight announcements and eval results."""
        await self.beats.subscribe(nc, self.reg)
        await nc.subscribe(self.reg.weights, cb=self._on_weights)
        await self.js.subscribe(self.reg.all("eval"), cb=self._on_eval, ordered_consumer=True)
        await self.js.subscribe(self.reg.all("rewards"), cb=self._on_reward, ordered_consumer=True)

    async def _on_weights(self, raw) -> None:
        try:
            wv = decode(raw.data, WeightVersion)
        except DecodeError:
            return
        if "reward_mean" in wv.metrics:
            self.step_rewards[wv.step] = wv.metrics["reward_mean"]

    async def _on_reward(self, raw) -> None:
        try:
            r = glance_reward(raw.data)  # every reward of the run passes here: the light view
        except DecodeError:
            return
        if r.purpose == "train":
            self.domain_rewards.setdefault(r.domain, DomainRewards()).add(r)

    async def _on_eval(self, raw) -> None:
        try:
            ev = decode(raw.data, EvalResult)
        except DecodeError:
            return
        per = self.domain_evals.setdefault(ev.domain, {})
        per[ev.version] = ev
        if self.headline is None and ev.purpose == "train":
            self.headline = ev.domain  # the live view's curve: the first trained domain evaluated
        if ev.domain == self.headline:
            self.evals[ev.version] = ev

    def totals(self) -> dict[str, float]:
        """Sum of each pipeline stage's main counter over its workers (`bus.telemetry.STAGE_COUNTER`)."""
        return self.beats.stage_totals()

    def role_total(self, role: str, counter: str) -> float:
        """A counter summed over a role's workers, as a float (seconds and the like)."""
        return self.beats.role_sum(role, counter)

    def role_sum(self, role: str, counter: str) -> int:
        """A counter summed over a role's workers (the last heartbeat of each, restarted ones included)."""
        return int(self.beats.role_sum(role, counter))

    def cpu_seconds(self, server_pid: int | None = None) -> dict[str, float]:
        """CPU seconds per role (the last heartbeat of each worker, summed over a role's
        workers, restarted ones included), the launcher's own, and nats-server's (when this
        launcher started it and /proc is readable): where a run's cores went."""
        out = {role: round(v, 1) for role, v in self.beats.role_sums(CPU_SECONDS).items()}
        t = os.times()
        out["launcher"] = round(t.user + t.system, 1)
        if server_pid:
            try:
                fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
                out["nats-server"] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)
            except (OSError, ValueError, IndexError):
                pass
        return out

    async def refresh(self, elapsed: float) -> Snapshot:
        """Update the snapshot from telemetry, KV and stream states."""
        s = self.snap
        s.elapsed = elapsed
        progress = await get_json(self.js, self.reg, LEARNER_PROGRESS) or {}
        s.step, s.version = int(progress.get("step", 0)), int(progress.get("version", 0))
        s.reward = progress.get("reward_mean")
        totals, now = self.totals(), time.monotonic()
        dt = max(1e-6, now - self._last_t)
        for k, v in totals.items():
            rate = max(0.0, (v - self._last_totals.get(k, v)) / dt)
            s.rates[k] = 0.5 * s.rates.get(k, rate) + 0.5 * rate
        self._last_totals, self._last_t, s.totals = totals, now, totals
        try:
            s.depths["tasks"] = (await self.js.stream_info(self.reg.stream("TASKS"))).state.messages
            s.depths["traj"] = (await self.js.stream_info(self.reg.stream("TRAJ"))).state.messages
            ci = await self.js.consumer_info(self.reg.stream("REWARDS"), "learner")
            s.depths["rewards"] = ci.num_pending + ci.num_ack_pending
            s.dead_letters = (await self.js.stream_info(self.reg.stream("DLQ"))).state.messages
        except Exception:  # noqa: BLE001 - the live view keeps its last depths when the server is busy
            pass
        self.plateau = await get_json(self.js, self.reg, PLATEAU)
        self.released_version = ((await get_json(self.js, self.reg, RELEASE_LATEST)) or {}).get("version")
        self.stop_requested = await get_json(self.js, self.reg, STATUS) == STOP_REQUESTED
        self.tasks_by_domain = dict(
            ((await get_json(self.js, self.reg, SAMPLER_PROGRESS)) or {}).get("by_domain") or {}
        )
        cur = await get_json(self.js, self.reg, CURRICULUM) or {}
        self.curriculum = {"weights": cur.get("weights") or {}, "levels": cur.get("levels") or {}}
        if self.evals:
            s.eval_baseline = self.evals[min(self.evals)].score if 0 in self.evals else None
            s.eval_version = max(self.evals)
            s.eval_latest = self.evals[s.eval_version].score
        return s


def rollout_figures(mon) -> dict:
    """summary.json's `rollout`: weight versions hot-loaded (summed over rollout workers), generated
    tokens, the seconds spent rolling out, and their ratio (rollout tokens/s per worker-second)."""
    tokens, busy = mon.role_sum("rollout", TOKENS), mon.role_total("rollout", BUSY_S)
    return {
        "weights_loaded": mon.role_sum("rollout", WEIGHTS_LOADED),
        "tokens": tokens,
        "busy_s": round(busy, 2),
        "tokens_per_s": round(tokens / busy, 1) if busy > 0 else None,
    }


def domain_counts(mon) -> dict[str, dict]:
    """summary.json's `domains`: per domain sampled, scored or weighted, its tasks published,
    training rewards (count, mean, statuses, tool calls) and curriculum level and weight."""
    weights, levels = mon.curriculum.get("weights") or {}, mon.curriculum.get("levels") or {}
    names = set(mon.domain_rewards) | set(mon.tasks_by_domain) | set(weights)
    return {
        d: {
            "tasks": int(mon.tasks_by_domain.get(d, 0)),
            **(mon.domain_rewards.get(d) or DomainRewards()).as_dict(),
            "level": levels.get(d),
            "weight": weights.get(d),
        }
        for d in sorted(names)
    }


def summary_dict(snap: Snapshot, mon: Monitor, acc=None, extra: dict | None = None) -> dict:
    """The run's summary.json (accounting fields are null until the run stops)."""
    counts = acc.counts() if acc else {}
    evals = {}
    for domain, per in mon.domain_evals.items():
        last = per[max(per)]
        first = per.get(0) or (per[min(per)] if last.purpose == "heldout" else None)
        evals[domain] = {
            "purpose": last.purpose,
            "baseline": first.score if first else None,
            "final": last.score,
            "n": last.n,
            "baseline_version": first.version if first else None,
            "final_version": last.version,
            "curve": {str(v): e.score for v, e in sorted(per.items())},
            **({"groups": last.groups} if last.groups else {}),
        }
    out = {
        "run_id": snap.run_id,
        "steps": snap.step,
        "weight_versions": snap.version + 1,
        "tasks_published": len(acc.published) if acc else int(snap.totals.get("sampler", 0)),
        "trajectories": int(snap.totals.get("rollout", 0)),
        "rewards": int(snap.totals.get("verifier", 0)),
        "trained_samples": int(snap.totals.get("learner", 0)),
        "dead_letters": acc.dead_letters if acc else snap.dead_letters,
        "lost": counts.get("lost") if acc else None,
        "trained_twice": acc.trained_twice if acc else None,
        "learner_rollbacks": acc.rollbacks if acc else None,
        "task_fates": counts or None,
        "filtered_reasons": dict(acc.filtered_reasons) if acc else None,
        "eval": evals,
        "domains": domain_counts(mon),
        "wall_seconds": round(snap.elapsed, 1),
        "final": acc is not None,
        "worker_restarts": snap.restarts,
        "depths": dict(snap.depths),
        "rollout": rollout_figures(mon),
        "plateau": mon.plateau,
        "released_version": mon.released_version,
        "sandbox_isolation": mon.sandbox_isolation,
    }
    out.update(extra or {})
    return out
