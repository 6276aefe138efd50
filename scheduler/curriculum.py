"""Curriculum across domains: domain weights and difficulty levels (pure logic, no I/O).

Domain weights. Each domain keeps an EMA of its reward. A domain's weight is
softmax(gap / temperature) over domains, gap = target_reward - EMA (a domain not yet
observed counts with `initial_reward`). Floors are then applied by water-filling: every
domain below its `floor_share` is raised to exactly its floor and the remaining mass is
shared among the others in proportion to their softmax weights (repeated until no
domain is below its floor).

Difficulty levels. Each (domain, level) keeps the success flags (reward >=
`success_threshold`) of its last `window` samples. After at least `min_samples`
samples observed at the current level since the last change, the level is promoted by
one when the recent success rate >= `promote_at` and demoted by one when it is <=
`demote_at`, always within the domain's `levels=(min, max)` bounds.

Guarantees:
- `weights()` returns every configured domain, each >= its floor share, summing to 1
  (floors must sum to <= 1; checked at construction).
- A group where every sample scored the same (all right or all wrong) is counted like
  any other group: it carries no learning signal for the policy gradient but it is
  exactly the evidence that a level is too easy or too hard.
- A group of n samples moves the EMA as n single-sample updates with the group's mean:
  alpha_eff = 1 - (1 - ema_alpha) ** n, so group size does not change the time scale.
- Levels move by at most one step per `min_samples` samples, never outside bounds;
  the new level starts with an empty success history (fresh evidence only).
- `snapshot()` is a plain JSON-able dict (to publish to the run's KV bucket under
  `curriculum` and record); `Curriculum.restore(snapshot)` rebuilds an equal state.
- Pure and deterministic: no clocks, no randomness, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class DomainSpec:
    """Curriculum settings of one domain."""

    target_reward: float = 0.8
    """Reward the domain should reach; the gap to it drives its share."""
    floor_share: float = 0.0
    """Minimum share of sampling, so no domain starves."""
    levels: tuple[int, int] = (1, 1)
    """Inclusive (min, max) difficulty levels."""
    start_level: int | None = None
    """Initial level (default: the minimum)."""

    def __post_init__(self):
        lo, hi = self.levels
        if lo > hi:
            raise ValueError(f"levels {self.levels}: min must be <= max")
        if not 0.0 <= self.floor_share <= 1.0:
            raise ValueError(f"floor_share {self.floor_share} must be in [0, 1]")
        if self.start_level is not None and not lo <= self.start_level <= hi:
            raise ValueError(f"start_level {self.start_level} outside levels {self.levels}")


@dataclass(frozen=True)
class LevelChange:
    """A promotion or demotion decided by `observe`."""

    domain: str
    old_level: int
    new_level: int
    success_rate: float
    samples: int

    @property
    def kind(self) -> str:
        """`promote` or `demote`."""
        return "promote" if self.new_level > self.old_level else "demote"


@dataclass
class _DomainState:
    ema: float | None = None
    level: int = 1
    observations: int = 0
    since_change: int = 0
    history: dict[int, deque] = field(default_factory=dict)


def softmax(values: list[float], temperature: float) -> list[float]:
    """Numerically stable softmax of values / temperature."""
    scaled = [v / temperature for v in values]
    top = max(scaled)
    exps = [math.exp(s - top) for s in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def apply_floors(shares: dict[str, float], floors: dict[str, float]) -> dict[str, float]:
    """Raise shares below their floor to the floor and rescale the rest to sum to 1
    (water-filling; ratios among unfloored domains are kept)."""
    if sum(floors.values()) > 1.0 + 1e-12:
        raise ValueError(f"floor shares sum to {sum(floors.values()):.4f} > 1")
    pinned: set[str] = set()
    out = dict(shares)
    while True:
        free = [d for d in shares if d not in pinned]
        free_mass = 1.0 - sum(floors[d] for d in pinned)
        base = sum(shares[d] for d in free)
        for d in free:
            out[d] = free_mass * shares[d] / base if base > 0 else free_mass / len(free)
        for d in pinned:
            out[d] = floors[d]
        low = [d for d in free if out[d] < floors.get(d, 0.0) - 1e-15]
        if not low:
            return out
        pinned.update(low)
        if len(pinned) == len(shares):
            total = sum(floors.values())
            return {d: floors[d] / total for d in shares}


class Curriculum:
    """Per-domain reward EMA, softmax-of-gap weights with floors, and difficulty levels."""

    def __init__(self, domains: dict[str, DomainSpec], temperature: float = 0.1, ema_alpha: float = 0.1,
                 promote_at: float = 0.8, demote_at: float = 0.2, window: int = 64,
                 min_samples: int | None = None, success_threshold: float = 0.5, initial_reward: float = 0.0):
        if not domains:
            raise ValueError("a curriculum needs at least one domain")
        if temperature <= 0:
            raise ValueError(f"temperature {temperature} must be > 0")
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha {ema_alpha} must be in (0, 1]")
        if not demote_at < promote_at:
            raise ValueError(f"demote_at {demote_at} must be < promote_at {promote_at}")
        if window < 1:
            raise ValueError(f"window {window} must be >= 1")
        self.domains = dict(domains)
        floors = sum(s.floor_share for s in self.domains.values())
        if floors > 1.0 + 1e-12:
            raise ValueError(f"floor shares sum to {floors:.4f} > 1")
        self.temperature, self.ema_alpha = temperature, ema_alpha
        self.promote_at, self.demote_at, self.window = promote_at, demote_at, window
        self.min_samples = window if min_samples is None else min_samples
        self.success_threshold, self.initial_reward = success_threshold, initial_reward
        self.updates = 0
        self._state = {name: _DomainState(level=spec.start_level if spec.start_level is not None else spec.levels[0])
                       for name, spec in self.domains.items()}

    # -- observations -----------------------------------------------------------
    def observe(self, domain: str, level: int, rewards: Iterable[float]) -> LevelChange | None:
        """Record one group's rewards at `level`; return the level change it caused, if any."""
        rewards = [float(r) for r in rewards]
        if domain not in self._state:
            raise KeyError(f"unknown domain {domain!r}; configured: {sorted(self._state)}")
        if not rewards:
            return None
        st = self._state[domain]
        mean = sum(rewards) / len(rewards)
        alpha = 1.0 - (1.0 - self.ema_alpha) ** len(rewards)
        st.ema = mean if st.ema is None else (1.0 - alpha) * st.ema + alpha * mean
        st.observations += len(rewards)
        self.updates += 1
        hist = st.history.setdefault(level, deque(maxlen=self.window))
        hist.extend(r >= self.success_threshold for r in rewards)
        if level != st.level:  # late results of a level already left: evidence, no decision
            return None
        st.since_change += len(rewards)
        return self._maybe_change(domain, st)

    def _maybe_change(self, domain: str, st: _DomainState) -> LevelChange | None:
        if st.since_change < self.min_samples:
            return None
        rate = self.success_rate(domain)
        lo, hi = self.domains[domain].levels
        new = st.level
        if rate >= self.promote_at and st.level < hi:
            new = st.level + 1
        elif rate <= self.demote_at and st.level > lo:
            new = st.level - 1
        if new == st.level:
            return None
        change = LevelChange(domain, st.level, new, rate, len(st.history[st.level]))
        st.level, st.since_change = new, 0
        st.history[new] = deque(maxlen=self.window)
        return change

    # -- read-outs --------------------------------------------------------------
    def ema(self, domain: str) -> float | None:
        """Current reward EMA of a domain (None before its first observation)."""
        return self._state[domain].ema

    def gap(self, domain: str) -> float:
        """target_reward - EMA (EMA defaults to `initial_reward`)."""
        ema = self._state[domain].ema
        return self.domains[domain].target_reward - (self.initial_reward if ema is None else ema)

    def weights(self) -> dict[str, float]:
        """Sampling share per domain: softmax(gap / temperature), then floors; sums to 1."""
        names = list(self.domains)
        raw = dict(zip(names, softmax([self.gap(d) for d in names], self.temperature)))
        return apply_floors(raw, {d: self.domains[d].floor_share for d in names})

    def level(self, domain: str) -> int:
        """Current difficulty level of a domain."""
        return self._state[domain].level

    def success_rate(self, domain: str, level: int | None = None) -> float:
        """Recent success rate at `level` (default: the current level); 0 with no samples."""
        st = self._state[domain]
        hist = st.history.get(st.level if level is None else level)
        return sum(hist) / len(hist) if hist else 0.0

    # -- persistence ------------------------------------------------------------
    def snapshot(self) -> dict:
        """The whole state as a plain JSON-able dict."""
        return {
            "version": SNAPSHOT_VERSION,
            "config": {"temperature": self.temperature, "ema_alpha": self.ema_alpha, "promote_at": self.promote_at,
                       "demote_at": self.demote_at, "window": self.window, "min_samples": self.min_samples,
                       "success_threshold": self.success_threshold, "initial_reward": self.initial_reward},
            "updates": self.updates,
            "weights": self.weights(),
            "domains": {
                name: {
                    "spec": {**asdict(self.domains[name]), "levels": list(self.domains[name].levels)},
                    "ema": st.ema, "level": st.level, "observations": st.observations,
                    "since_change": st.since_change,
                    "history": {str(lvl): [int(x) for x in h] for lvl, h in sorted(st.history.items())},
                }
                for name, st in self._state.items()
            },
        }

    @classmethod
    def restore(cls, snap: dict) -> Curriculum:
        """Rebuild a curriculum from `snapshot()` output."""
        if snap.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"curriculum snapshot version {snap.get('version')!r} != {SNAPSHOT_VERSION}")
        domains = {name: DomainSpec(**{**d["spec"], "levels": tuple(d["spec"]["levels"])})
                   for name, d in snap["domains"].items()}
        cur = cls(domains, **snap["config"])
        cur.updates = snap["updates"]
        for name, d in snap["domains"].items():
            st = cur._state[name]
            st.ema, st.level, st.observations, st.since_change = d["ema"], d["level"], d["observations"], d["since_change"]
            st.history = {int(lvl): deque((bool(x) for x in h), maxlen=cur.window) for lvl, h in d["history"].items()}
        return cur
