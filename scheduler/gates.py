"""Gates on evaluated versions: the release gate, the forgetting guard and plateau detection.

Pure logic (`regression_floors`, `release_gate`, `forgetting_guard`, `least_squares_slope`,
`first_plateau`) plus `Gates`, the scheduler's glue that runs them after every evaluation.

Guarantees:
- Release gate: a version is *released* only when every eval set with a floor was
  evaluated for it and none scored below its floor. A domain's floor is
  `scheduler.eval.floors[domain]` when set, else its baseline minus
  `scheduler.eval.release_margin`. The baseline of a domain is its first evaluation (version 0,
  the starting checkpoint, in a normal run). Released versions only move forward: KV
  `release.latest` = {"version", "step", "scores", "released_at"} holds the newest one, and
  the SQL table `gate_checks` has one row per checked version (`released` column), so
  `Store.latest_released(run_id)` gives the same answer from SQL.
- Forgetting guard (`scheduler.eval.general` = a domain kind, at the fixed level
  `scheduler.eval.general_level`): a general regression set evaluated with every version, published
  as eval domain `general_<kind>`. When its score is MORE than `scheduler.forgetting.margin` below
  its baseline, the guard raises the learner's replay share and KL beta by their steps
  (capped) and writes KV `learner.overrides` =
  {"replay_share", "beta", "reason", "version", "updated_at"}. The raise starts from the
  current overrides (else the config's `learner.replay.share` / `learner.beta`), so repeated
  trips escalate; a recovery never lowers them again (no oscillation). Every trip is logged
  (`scheduler.forgetting`) and recorded (`gate_checks.forgetting`, `.overrides`).
  Contract for the learner: read `learner.overrides` between steps and, when present, use
  its `replay_share` and `beta` instead of the config's.
- Plateau: the capability-cost curve has one point per evaluated version: capability =
  mean eval score over the run's own eval domains (the general set excluded), cost =
  learner samples trained by that version (exact when the version's metrics carry
  `samples_trained`, else step x the learner's mean samples per step from KV
  `learner.progress`). The gain per unit is the least-squares slope of capability over
  cost across the last `scheduler.plateau.window` points, per 1000 samples. The first version where
  it falls below `scheduler.plateau.threshold` is the plateau; once detected it stays detected.
  Eval noise is accounted for: with `scheduler.plateau.z` > 0 a window counts only when
  gain + z x its standard error is below the threshold, the standard error coming from the
  binomial noise of each point (capability c over `scheduler.eval.n` problems per domain:
  variance c(1-c)/(n x domains), an upper bound for a mean of per-domain proportions). So a
  curve that rises under ±4-point noise (n = 200) does not read as flat from one unlucky
  window; a flat one still does once the window's cost span makes the error small.
  KV `plateau` = {"detected", "at_version", "gain_per_unit", "gain_se", "window", "unit"}; with
  `scheduler.plateau.stop`, KV `status` = "stop-requested" as well (the launcher
  watches it).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import structlog

from bus.kv import (
    GATES_BASELINE,
    LEARNER_OVERRIDES,
    LEARNER_PROGRESS,
    PLATEAU,
    RELEASE_LATEST,
    STATUS,
    STOP_REQUESTED,
    get_json,
    put_json,
)

log = structlog.get_logger()

PLATEAU_UNIT = "eval score per 1000 trained samples"
PER_SAMPLES = 1000.0
_EPS = 1e-9


# -- release gate -----------------------------------------------------------------------------
@dataclass(frozen=True)
class GateDecision:
    """The release gate's verdict on one version: `failures` maps domain -> why."""

    version: int
    passed: bool
    floors: dict[str, float]
    failures: dict[str, str] = field(default_factory=dict)


def regression_floors(baseline: dict[str, float], floors: dict[str, float], margin: float) -> dict[str, float]:
    """Floor per eval domain: the configured floor, else baseline - margin (every domain
    with a baseline or a configured floor gets one)."""
    return {d: float(floors[d]) if d in floors else baseline[d] - margin for d in sorted(set(baseline) | set(floors))}


def release_gate(
    version: int, scores: dict[str, float], baseline: dict[str, float], floors: dict[str, float], margin: float
) -> GateDecision:
    """Pass only when every floored domain was evaluated and none is below its floor."""
    limits = regression_floors(baseline, floors, margin)
    failures = {}
    for domain, floor in limits.items():
        if domain not in scores:
            failures[domain] = "not evaluated"
        elif scores[domain] < floor - _EPS:
            failures[domain] = f"{scores[domain]:.4f} < floor {floor:.4f}"
    return GateDecision(version, not failures, limits, failures)


# -- forgetting guard -------------------------------------------------------------------------
@dataclass(frozen=True)
class Overrides:
    """What the scheduler asks the learner to use instead of its config (KV `learner.overrides`)."""

    replay_share: float
    beta: float
    reason: str = ""


def forgetting_guard(
    score: float,
    baseline: float,
    margin: float,
    current: Overrides,
    *,
    replay_step: float,
    replay_max: float,
    beta_step: float,
    beta_max: float,
) -> Overrides | None:
    """None while `score >= baseline - margin`; else `current` raised by one step each
    (never above the caps, never below `current`), with the reason."""
    drop = baseline - score
    if drop <= margin + _EPS:
        return None
    replay = max(current.replay_share, min(replay_max, current.replay_share + replay_step))
    beta = max(current.beta, min(beta_max, current.beta + beta_step))
    why = (
        f"general eval {score:.4f} is {drop:.4f} below its baseline {baseline:.4f} (margin {margin:.4f}): "
        f"replay_share {current.replay_share:g}->{replay:g}, beta {current.beta:g}->{beta:g}"
    )
    return Overrides(round(replay, 12), round(beta, 12), why)


# -- plateau ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plateau:
    """Whether (and where) eval gain per unit of cost fell below the threshold."""

    detected: bool
    at_version: int | None
    gain_per_unit: float | None
    window: int
    unit: str = PLATEAU_UNIT
    gain_se: float | None = None
    """Standard error of `gain_per_unit` from the eval sets' binomial noise (None: not computed)."""


def least_squares_slope(xs: list[float], ys: list[float]) -> float | None:
    """Slope of the least-squares line of ys on xs; None when xs do not vary."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def slope_se(xs: list[float], variances: list[float]) -> float | None:
    """Standard error of the least-squares slope of independent points with these noise
    variances (the slope is sum w_i y_i with w_i = (x_i - mean x) / Sxx); None when xs do not vary."""
    n = len(xs)
    if n < 2:
        return None
    mx = sum(xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    return math.sqrt(sum(((x - mx) / sxx) ** 2 * v for x, v in zip(xs, variances, strict=True)))


def first_plateau(
    points: list[tuple[int, float, float]], window: int, threshold: float, *, problems: int = 0, z: float = 0.0
) -> Plateau:
    """`points` = (version, cost in samples, capability) in version order. Scans each
    window of `window` consecutive points; the first whose slope x 1000 is below
    `threshold` is the plateau (at its last version). With `problems` > 0 (eval problems
    behind each capability point) and `z` > 0, a window is a plateau only when
    gain + z x SE < threshold, SE = the gain's standard error under binomial noise
    (variance c(1-c)/problems per point): noise alone rarely makes a rising curve look flat.
    Not detected: `gain_per_unit` (and `gain_se`) are the newest window's (None with fewer
    than `window` points or constant cost)."""
    gain = se = None
    for end in range(window, len(points) + 1):
        chunk = points[end - window : end]
        xs, ys = [c for _, c, _ in chunk], [s for _, _, s in chunk]
        slope = least_squares_slope(xs, ys)
        if slope is None:
            continue
        gain = slope * PER_SAMPLES
        se = None
        if problems > 0:
            raw = slope_se(xs, [min(max(y, 0.0), 1.0) * (1 - min(max(y, 0.0), 1.0)) / problems for y in ys])
            se = None if raw is None else raw * PER_SAMPLES
        if gain + z * (se or 0.0) < threshold:
            return Plateau(True, chunk[-1][0], gain, window, gain_se=se)
    return Plateau(False, None, gain, window, gain_se=se)


def capability(scores: dict[str, float], domains: list[str]) -> float | None:
    """Mean score over `domains` that were evaluated (None when none was)."""
    vals = [scores[d] for d in domains if d in scores]
    return sum(vals) / len(vals) if vals else None


def estimated_samples(step: int, metrics: dict | None, progress: dict | None) -> float | None:
    """Samples trained by the version of learner step `step`: `metrics['samples_trained']`
    when the version carries it, else step x mean samples per step from `learner.progress`."""
    if metrics and "samples_trained" in metrics:
        return float(metrics["samples_trained"])
    if step == 0:
        return 0.0
    if progress and progress.get("step") and progress.get("samples_trained") is not None:
        return step * float(progress["samples_trained"]) / float(progress["step"])
    return None


# -- glue -------------------------------------------------------------------------------------
def general_domain(cfg) -> str | None:
    """Eval domain name of the general set (`general_<kind>`), None when off."""
    kind = cfg.scheduler.eval.general
    return f"general_{kind}" if kind else None


def add_general_set(suite, cfg) -> str | None:
    """Add the general regression set to an `EvalSuite`: the eval set of kind
    `scheduler.eval.general` (same seed as the eval sets, `general_n` items at level
    `general_level`), built with the config domain of that name when there is one (its
    budgets), else the kind's defaults. Returns its domain name, None when off; a kind whose
    set cannot be scored locally (the guard needs it with every version) is a ValueError."""
    from producers.domains import eval_set_for
    from schemas.config import DomainConfig

    ec = cfg.scheduler.eval
    name = general_domain(cfg)
    if name is None:
        return None
    dc = cfg.sampler.domains.get(ec.general) or DomainConfig(kind=ec.general)
    es = eval_set_for(cfg, name, ec.general_n, ec.seed, ec.general_level, kind=ec.general, dc=dc)
    if es is None or es.local is None:
        raise ValueError(
            f"scheduler.eval.general={ec.general!r}: that kind has no locally scored eval set "
            "(e.g. 'arith', 'tool_calc'; '' turns the guard off)"
        )
    suite.sets[name] = es
    return name


class Gates:
    """Runs the three gates after each evaluation; state lives in KV and SQL (restart-safe)."""

    def __init__(self, js, reg, store, cfg):
        self.js, self.reg, self.store, self.cfg = js, reg, store, cfg
        self.general = general_domain(cfg)
        self.baseline: dict[str, float] = {}
        self.points: list[tuple[int, float, float]] = []
        self.plateau: Plateau | None = None

    async def load(self) -> None:
        """Restore the baselines and the capability-cost curve after a restart."""
        import asyncio

        from scheduler.store_rows import GateCheckRow

        self.baseline = dict((await get_json(self.js, self.reg, GATES_BASELINE)) or {})
        rows = await asyncio.to_thread(self.store.rows, GateCheckRow, self.reg.run_id, "version")
        self.points = [
            (r.version, r.cost_samples, r.capability)
            for r in rows
            if r.cost_samples is not None and r.capability is not None
        ]

    async def after_eval(self, version: int, step: int, scores: dict[str, float], metrics: dict | None = None) -> dict:
        """Run the gates on one version's scores; returns the `gate_checks` row written."""
        import asyncio

        ec = self.cfg.scheduler.eval
        new_base = {d: s for d, s in scores.items() if d not in self.baseline}
        if new_base:
            self.baseline.update(new_base)
            await put_json(self.js, self.reg, GATES_BASELINE, self.baseline)
        decision = release_gate(version, scores, self.baseline, dict(ec.floors), ec.release_margin)
        released = decision.passed and await self._release(version, step, scores)
        log.info(
            "scheduler.release_gate",
            version=version,
            passed=decision.passed,
            released=released,
            failures=decision.failures or None,
        )
        trip = await self._guard(version, scores)
        progress = await get_json(self.js, self.reg, LEARNER_PROGRESS)
        cost = estimated_samples(step, metrics, progress)
        own = [d for d in scores if d != self.general]
        cap = capability(scores, own)
        if cost is not None and cap is not None:
            self.points = [p for p in self.points if p[0] < version] + [(version, cost, cap)]
        await self._plateau(len(own))
        row = {
            "run_id": self.reg.run_id,
            "version": version,
            "step": step,
            "scores": dict(scores),
            "floors": decision.floors,
            "passed": decision.passed,
            "failures": decision.failures,
            "released": released,
            "cost_samples": cost,
            "capability": cap,
            "forgetting": trip is not None,
            "overrides": asdict(trip) if trip else {},
            "plateau": bool(self.plateau and self.plateau.detected and self.plateau.at_version == version),
            "gain_per_unit": self.plateau.gain_per_unit if self.plateau else None,
        }
        await asyncio.to_thread(self.store.record_gate_check, row)
        return row

    async def _release(self, version: int, step: int, scores: dict[str, float]) -> bool:
        current = await get_json(self.js, self.reg, RELEASE_LATEST)
        if current and current.get("version", -1) >= version:
            return current.get("version") == version
        await put_json(
            self.js,
            self.reg,
            RELEASE_LATEST,
            {"version": version, "step": step, "scores": scores, "released_at": time.time()},
        )
        log.info("scheduler.released", version=version, step=step)
        return True

    async def _guard(self, version: int, scores: dict[str, float]) -> Overrides | None:
        fc, lc = self.cfg.scheduler.forgetting, self.cfg.learner
        if self.general is None or self.general not in scores:
            return None
        now = await get_json(self.js, self.reg, LEARNER_OVERRIDES)
        current = (
            Overrides(float(now["replay_share"]), float(now["beta"])) if now else Overrides(lc.replay.share, lc.beta)
        )
        trip = forgetting_guard(
            scores[self.general],
            self.baseline[self.general],
            fc.margin,
            current,
            replay_step=fc.replay_step,
            replay_max=fc.replay_max,
            beta_step=fc.beta_step,
            beta_max=fc.beta_max,
        )
        if trip is not None:
            await put_json(
                self.js, self.reg, LEARNER_OVERRIDES, {**asdict(trip), "version": version, "updated_at": time.time()}
            )
            log.warning(
                "scheduler.forgetting",
                version=version,
                replay_share=trip.replay_share,
                beta=trip.beta,
                reason=trip.reason,
            )
        return trip

    async def _plateau(self, domains: int = 1) -> None:
        pc = self.cfg.scheduler.plateau
        found = first_plateau(
            self.points, pc.window, pc.threshold, z=pc.z, problems=self.cfg.scheduler.eval.n * max(1, domains)
        )
        if self.plateau and self.plateau.detected:
            return  # latched at the first detection
        self.plateau = found
        value = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(found).items()}
        await put_json(self.js, self.reg, PLATEAU, value)
        if found.detected:
            log.warning(
                "scheduler.plateau",
                at_version=found.at_version,
                gain_per_unit=found.gain_per_unit,
                window=found.window,
                threshold=pc.threshold,
                stop=pc.stop,
            )
            if pc.stop:
                await put_json(self.js, self.reg, STATUS, STOP_REQUESTED)
