"""What `rlbus up` shows while a run goes: a rich live table, or log lines off a TTY.

Guarantees: rendering never touches the bus; it only formats a `Snapshot`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table


@dataclass
class Snapshot:
    """The launcher's current view of the run."""

    run_id: str
    elapsed: float = 0.0
    step: int = 0
    version: int = 0
    reward: float | None = None
    eval_baseline: float | None = None
    eval_latest: float | None = None
    eval_version: int | None = None
    rates: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    depths: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    phase: str = "starting"


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def render(s: Snapshot) -> Table:
    """A table of the run's state."""
    t = Table(title=f"rlbus run {s.run_id} — {s.phase} — {s.elapsed:,.0f}s", title_justify="left", expand=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("learner step", str(s.step))
    t.add_row("weight version", str(s.version))
    t.add_row("train reward (last step)", _f(s.reward))
    t.add_row(
        "eval baseline → latest",
        f"{_f(s.eval_baseline)} → {_f(s.eval_latest)} (v{s.eval_version if s.eval_version is not None else '-'})",
    )
    for stage, unit in (("sampler", "tasks"), ("rollout", "traj"), ("verifier", "rewards"), ("learner", "samples")):
        t.add_row(
            f"{stage} throughput", f"{s.rates.get(stage, 0.0):,.1f} {unit}/s  (total {s.totals.get(stage, 0):,.0f})"
        )
    t.add_row(
        "queue depth tasks / traj / rewards→learner",
        f"{s.depths.get('tasks', 0)} / {s.depths.get('traj', 0)} / {s.depths.get('rewards', 0)}",
    )
    t.add_row("dead letters", str(s.dead_letters))
    if any(s.restarts.values()):
        t.add_row("worker restarts", ", ".join(f"{k}={v}" for k, v in s.restarts.items() if v))
    return t


def line(s: Snapshot) -> str:
    """One log line with the same facts (for non-TTY output)."""
    return (
        f"[{s.elapsed:5.0f}s] {s.phase} step={s.step} v={s.version} reward={_f(s.reward)} "
        f"eval={_f(s.eval_baseline)}->{_f(s.eval_latest)} "
        f"rates(task/traj/rew/sample)={s.rates.get('sampler', 0):.0f}/{s.rates.get('rollout', 0):.0f}/"
        f"{s.rates.get('verifier', 0):.0f}/{s.rates.get('learner', 0):.0f} "
        f"depth={s.depths.get('tasks', 0)}/{s.depths.get('traj', 0)}/{s.depths.get('rewards', 0)} "
        f"dlq={s.dead_letters}"
    )
