"""The one table of rlbus roles: every fact about a role that more than one module needs.

Each role is declared once, as one `Role` in `ROLES`; everything that lists roles reads it
(no second list): `bus.subjects.ROLES` (the names), `bus.session.ROLE_LIMIT` (what
`rlbus worker ROLE --max-messages N` counts), `bus.auth` (one NATS user per role, and the
streams/buckets it may create, `ROLE_TOPOLOGY`), `rlbus worker` (its ROLE choices and the
module each runs), the container entry point's role checks, and `rlbus up`'s launcher
(which roles start, in which order, and how a run drains). `tests/test_roles.py` checks
that each of them reads this table.

Guarantees:
- Names are unique and so are start ranks; the table's order is the pipeline order
  (sampler, rollout, sandbox, verifier, learner, scheduler, tracker), which is the order
  of `bus.subjects.ROLES` and of the NATS users.
- `start_order(cfg)` is the launcher's start order: ascending `start` rank (the learner
  first: it publishes weight version 0 before anyone asks for it; the sampler last), without
  the roles whose `starts_if` config field is falsy in `cfg` (None: the role always starts).
- `stop_phases()` is the launcher's drain: phases by ascending `stop_phase`, each a tuple of
  roles (in reverse start order) with one timeout (the largest `stop_timeout_s` of its
  roles), after which a worker still running is killed. Phase 0 is what makes new work
  (the sampler); the launcher lets the pipeline drain after it, then stops the rest.
- This module imports nothing of rlbus (the lowest layer may read it); a role's `module` is
  a dotted name, imported only by `rlbus worker` when the role runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Role:
    """One role: a process kind of the run (see the module guarantees for how each field is read)."""

    name: str
    """The role's name: the `rlbus worker ROLE` argument and its subject token (`metrics.<run>.<role>.*`)."""
    module: str
    """The module whose `async def run(cfg, ctx)` is the role's whole process."""
    limit_unit: str
    """What `WorkerContext.max_messages` (`--max-messages N`) counts in this role."""
    start: int
    """Rank in the launcher's start order (lower starts earlier)."""
    stop_phase: int
    """The drain phase the launcher stops this role in (lower stops earlier)."""
    stop_timeout_s: float
    """Seconds the launcher waits for the role to exit after SIGTERM at a drain, before SIGKILL."""
    starts_if: str | None = None
    """A dotted config field that must be truthy for `rlbus up` to start the role; None: always."""
    creates: tuple[str, ...] = ()
    """Streams/buckets (`bus.auth` families) the role creates when missing (`ensure_topology(role=...)`)."""

    @property
    def nats_user(self) -> str:
        """The NATS user the role's processes log in as: one user per role, of the role's name
        (its rights are `bus.auth.role_permissions(nats_user, runs)`)."""
        return self.name

    def starts(self, cfg: Any) -> bool:
        """True when `rlbus up` starts this role under `cfg` (its `starts_if` field is truthy)."""
        if self.starts_if is None:
            return True
        value = cfg
        for part in self.starts_if.split("."):
            value = getattr(value, part)
        return bool(value)


ROLES: tuple[Role, ...] = (
    Role(
        "sampler",
        "producers.sampler",
        "tasks published",
        start=7,
        stop_phase=0,
        stop_timeout_s=30,
        creates=("TASKS", "DLQ", "LEDGER", "KV_run", "KV_hidden", "OBJ_workspaces"),
    ),
    Role(
        "rollout",
        "rollout_workers.worker",
        "tasks taken, per duration pool",
        start=6,
        stop_phase=1,
        stop_timeout_s=30,
        creates=("TASKS", "TRAJ", "WEIGHTS", "DLQ", "KV_run", "OBJ_weights", "OBJ_artifacts"),
    ),
    Role(
        "sandbox",
        "sandbox_workers.service",
        "(no limit; stops on until_idle)",
        start=4,
        stop_phase=1,
        stop_timeout_s=30,
        starts_if="sandbox.remote",
    ),
    Role(
        "verifier",
        "verifier_workers.worker",
        "trajectories fetched",
        start=5,
        stop_phase=1,
        stop_timeout_s=30,
        creates=("TRAJ", "REWARDS", "DLQ", "KV_hidden"),
    ),
    Role(
        "learner",
        "learner.worker",
        "optimizer steps",
        start=1,
        stop_phase=2,
        stop_timeout_s=60,
        creates=("REWARDS", "WEIGHTS", "DLQ", "LEDGER", "KV_run", "OBJ_weights"),
    ),
    Role(
        "scheduler",
        "scheduler.worker",
        "evaluations (the baseline included)",
        start=2,
        stop_phase=3,
        stop_timeout_s=60,
        creates=(
            "TASKS",
            "TRAJ",
            "REWARDS",
            "WEIGHTS",
            "EVAL",
            "DLQ",
            "LEDGER",
            "KV_run",
            "KV_hidden",
            "OBJ_weights",
            "OBJ_workspaces",
        ),
    ),
    # last to stop: it writes what the others published; reads only (the run's streams exist before it starts)
    Role(
        "tracker",
        "rlbus.tracking.tracker",
        "messages consumed (weight versions, rewards, evals, curriculum updates)",
        start=3,
        stop_phase=4,
        stop_timeout_s=60,
        starts_if="tracking.backends",
    ),
)
NAMES: tuple[str, ...] = tuple(r.name for r in ROLES)
BY_NAME: dict[str, Role] = {r.name: r for r in ROLES}


def role(name: str) -> Role:
    """The role called `name`; ValueError naming the known roles otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; one of {', '.join(NAMES)}") from None


def in_start_order(names) -> tuple[str, ...]:
    """`names` (role names) sorted by start rank: the order in which a launcher or bench starts them."""
    return tuple(sorted(names, key=lambda n: role(n).start))


def start_order(cfg: Any) -> tuple[str, ...]:
    """The roles `rlbus up` starts under `cfg`, in start order (optional roles left out when off)."""
    return in_start_order(r.name for r in ROLES if r.starts(cfg))


def stop_phases() -> tuple[tuple[tuple[str, ...], float], ...]:
    """The drain: ((roles, timeout_s), ...) by phase; roles of a phase in reverse start order."""
    phases = sorted({r.stop_phase for r in ROLES})
    out = []
    for phase in phases:
        members = [r for r in ROLES if r.stop_phase == phase]
        out.append((tuple(reversed(in_start_order(r.name for r in members))), max(r.stop_timeout_s for r in members)))
    return tuple(out)
