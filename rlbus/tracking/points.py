"""What the tracker writes, as plain data: scalar points, sample tables, and the per-step
windows that turn the reward log and curriculum updates into one point per learner step.

Guarantees:
- Every point carries a learner step and a wall time (the JetStream timestamp of the
  message it comes from, one server clock), so backends plot it against either.
- A reward or curriculum update belongs to the window of the learner step in force when
  the server stored it: the newest WeightVersion stored before it (`Timeline.step_at`).
  A window is written once, when it is closed (`Windows.close_below`, or `close_all` at
  a clean stop); a reward that arrives for a window already written is carried into the
  next window written, so every reward counts exactly once.
- `Steps` keeps each tag strictly increasing in step: a point at a step its tag already
  has is dropped (and counted), so a backend never receives the same point twice.
- Everything here round-trips through `state()` / `from_state()` (plain JSON), which is
  how the tracker survives a restart without losing or repeating a point.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

SAMPLE_COLUMNS = ("step", "domain", "reward", "components", "prompt", "completion")


@dataclass(frozen=True)
class Point:
    """One scalar: `tag` at learner `step`, stored at `wall_time` (unix seconds)."""

    tag: str
    step: int
    value: float
    wall_time: float


@dataclass(frozen=True)
class Table:
    """A few scored samples at learner `step` (columns: SAMPLE_COLUMNS)."""

    tag: str
    step: int
    rows: tuple[tuple, ...]
    wall_time: float


class Steps:
    """The last step written per tag: the guard that keeps every tag strictly increasing."""

    def __init__(self, last: dict[str, int] | None = None):
        self.last: dict[str, int] = dict(last or {})
        self.dropped = 0

    def admit(self, items: list) -> list:
        """The points/tables whose step is past their tag's last one (the rest are counted
        in `dropped`); the last step of each admitted tag moves forward."""
        out = []
        for item in sorted(items, key=lambda p: p.step):
            if item.step <= self.last.get(item.tag, -1):
                self.dropped += 1
                continue
            self.last[item.tag] = item.step
            out.append(item)
        return out


class Timeline:
    """Learner steps over server time, from the WeightVersions seen: (stored at, step)."""

    def __init__(self, entries: list[list[float]] | None = None):
        self.times: list[float] = [float(t) for t, _ in entries or []]
        self.steps: list[int] = [int(s) for _, s in entries or []]

    def add(self, stored_at: float, step: int) -> None:
        """Record that `step`'s weights were stored at `stored_at` (kept in time order)."""
        i = bisect.bisect_right(self.times, stored_at)
        self.times.insert(i, stored_at)
        self.steps.insert(i, step)

    def step_at(self, stored_at: float) -> int:
        """The learner step in force at `stored_at` (0 before the first version)."""
        i = bisect.bisect_right(self.times, stored_at)
        return self.steps[i - 1] if i else 0

    @property
    def latest(self) -> int:
        """The step of the newest version seen (0 if none)."""
        return self.steps[-1] if self.steps else 0

    def prune(self, keep: int = 4096) -> None:
        """Forget all but the newest `keep` entries (old windows are long closed)."""
        del self.times[:-keep], self.steps[:-keep]

    def state(self) -> list[list[float]]:
        return [[t, s] for t, s in zip(self.times, self.steps)]


@dataclass
class Window:
    """What one learner step's window collected: train rewards per domain, token and
    log-prob sums, a few samples, and the newest curriculum value."""

    domains: dict[str, list[float]] = field(default_factory=dict)  # domain -> [count, reward sum]
    tokens: float = 0.0
    neg_logprob: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [sum of -logprob, tokens]
    samples: list[list] = field(default_factory=list)
    curriculum: dict | None = None
    curriculum_at: float = 0.0
    last_at: float = 0.0

    def merge(self, other: Window) -> None:
        """Add `other` into this window (a carried late window)."""
        for d, (n, s) in other.domains.items():
            mine = self.domains.setdefault(d, [0.0, 0.0])
            mine[0] += n
            mine[1] += s
        self.tokens += other.tokens
        self.neg_logprob = [a + b for a, b in zip(self.neg_logprob, other.neg_logprob)]
        if other.curriculum is not None and other.curriculum_at >= self.curriculum_at:
            self.curriculum, self.curriculum_at = other.curriculum, other.curriculum_at
        self.last_at = max(self.last_at, other.last_at)

    def points(self, step: int) -> list[Point]:
        """The scalars of this window at `step`."""
        t = self.last_at
        out: list[Point] = []
        n = sum(c for c, _ in self.domains.values())
        if n:
            out.append(Point("train/reward_mean", step, sum(s for _, s in self.domains.values()) / n, t))
            out.append(Point("train/samples", step, n, t))
            out.append(Point("train/tokens", step, self.tokens, t))
            for d, (c, s) in sorted(self.domains.items()):
                out.append(Point(f"train/{d}/reward_mean", step, s / c, t))
                out.append(Point(f"train/{d}/samples", step, c, t))
        if self.neg_logprob[1]:
            out.append(Point("train/neg_logprob_mean", step, self.neg_logprob[0] / self.neg_logprob[1], t))
        if self.curriculum is not None:
            t = self.curriculum_at
            for d, w in sorted((self.curriculum.get("weights") or {}).items()):
                out.append(Point(f"curriculum/{d}/weight", step, float(w), t))
            for d, level in sorted((self.curriculum.get("levels") or {}).items()):
                out.append(Point(f"curriculum/{d}/level", step, float(level), t))
        return out

    def state(self) -> dict:
        return {
            "domains": self.domains,
            "tokens": self.tokens,
            "neg_logprob": self.neg_logprob,
            "samples": self.samples,
            "curriculum": self.curriculum,
            "curriculum_at": self.curriculum_at,
            "last_at": self.last_at,
        }

    @classmethod
    def from_state(cls, d: dict) -> Window:
        return cls(**d)


class Windows:
    """Open windows by learner step, the carry of late arrivals, and the last step closed."""

    def __init__(self, samples_every: int, samples_per_table: int, state: dict | None = None):
        self.samples_every, self.samples_per_table = samples_every, samples_per_table
        state = state or {}
        self.open: dict[int, Window] = {int(k): Window.from_state(v) for k, v in state.get("open", {}).items()}
        self.carry = Window.from_state(state["carry"]) if state.get("carry") else None
        self.closed_through: int = int(state.get("closed_through", -1))

    def _window(self, step: int) -> Window:
        if step <= self.closed_through:  # that step is written already: count it with the next one
            self.carry = self.carry or Window()
            return self.carry
        return self.open.setdefault(step, Window())

    def add_reward(
        self,
        step: int,
        stored_at: float,
        domain: str,
        reward: float,
        tokens: float,
        neg_logprob: tuple[float, float],
        sample: list | None,
    ) -> None:
        """Count one train reward in the window of `step`."""
        w = self._window(step)
        late = w is self.carry
        per = w.domains.setdefault(domain, [0.0, 0.0])
        per[0] += 1
        per[1] += reward
        w.tokens += tokens
        w.neg_logprob[0] += neg_logprob[0]
        w.neg_logprob[1] += neg_logprob[1]
        if sample is not None and not late and self.wants_sample(step):
            w.samples.append(sample)
        w.last_at = max(w.last_at, stored_at)

    def wants_sample(self, step: int) -> bool:
        """Whether a reward in `step`'s window would go into its samples table."""
        if step <= self.closed_through or step % self.samples_every:
            return False  # a late reward's window is written already; its samples table too
        w = self.open.get(step)
        return w is None or len(w.samples) < self.samples_per_table

    def add_curriculum(self, step: int, stored_at: float, value: dict) -> None:
        """Keep the newest curriculum value of `step`'s window."""
        w = self._window(step)
        if stored_at >= w.curriculum_at:
            w.curriculum, w.curriculum_at = value, stored_at
        w.last_at = max(w.last_at, stored_at)

    def close_below(self, step: int) -> tuple[list[Point], list[Table]]:
        """Close every open window of a step below `step`: their points and tables."""
        return self._close([s for s in sorted(self.open) if s < step])

    def close_all(self) -> tuple[list[Point], list[Table]]:
        """Close every open window (a clean stop)."""
        return self._close(sorted(self.open))

    def _close(self, steps: list[int]) -> tuple[list[Point], list[Table]]:
        points: list[Point] = []
        tables: list[Table] = []
        for s in steps:
            w = self.open.pop(s)
            if self.carry is not None:
                w.merge(self.carry)
                self.carry = None
            points += w.points(s)
            if w.samples:
                tables.append(Table("samples", s, tuple(tuple(r) for r in w.samples), w.last_at))
            self.closed_through = max(self.closed_through, s)
        return points, tables

    def state(self) -> dict:
        return {
            "open": {str(k): w.state() for k, w in self.open.items()},
            "carry": self.carry.state() if self.carry else None,
            "closed_through": self.closed_through,
        }
