"""Config sections of the scheduler: evaluation, the curriculum, and the gates (release,
forgetting guard, plateau)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Section


class EvalSection(Section):
    """Regression evaluation on fixed held-out sets, and the release gate on its scores."""

    n: int = Field(default=200, ge=1)
    """Problems in the fixed held-out eval set."""
    seed: int = 1234
    """Seed of the eval sets, the general set included (fixed across runs)."""
    difficulty: int = 3
    """Difficulty of the arith eval set."""
    every_versions: int = Field(default=5, ge=1)
    """Evaluate every N-th version (the first and the last always)."""
    mode: Literal["local", "pipeline"] = "local"
    """`pipeline`: publish `purpose=eval` tasks through rollout and verifier workers and score
    their rewards; `local`: the scheduler generates with its own engine. The version-0
    baseline is always local (it must be exactly the start weights)."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Pipeline mode: how long a round waits for its rewards (missing ones count as wrong)."""
    floors: dict[str, float] = Field(default_factory=dict)
    """Release gate: minimum eval score per eval domain, e.g. {arith = 0.5}; a domain without one must not fall below its baseline minus `release_margin`."""
    release_margin: float = Field(default=0.02, ge=0.0)
    """Release gate: how far below its version-0 baseline an eval domain may fall (when it has no `floors` entry)."""
    general: str = ""
    """Forgetting guard: kind of the general regression set evaluated with every version (`arith` or `tool_calc`; empty = off). Published as eval domain `general_<kind>`."""
    general_level: int = Field(default=1, ge=1)
    """Forgetting guard: fixed difficulty level of the general set."""
    general_n: int = Field(default=100, ge=1)
    """Forgetting guard: problems in the general set."""


class CurriculumSection(Section):
    """Domain weights and difficulty levels from the rewards (scheduler/curriculum.py)."""

    enabled: bool = True
    """Run the curriculum (off: the static `sampler.domains.<d>.weight`s and start levels)."""
    temperature: float = Field(default=0.1, gt=0.0)
    """Softmax temperature over the domains' reward gaps (gap = target_reward, else the
    domain's version-0 baseline reward, minus its reward EMA)."""
    min_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Default floor: every trained domain gets at least max(its `floor_share`, this) of the
    sampling (e.g. 0.002 with 100 domains, so none starves); the floors must sum to <= 1."""
    max_share: float = Field(default=1.0, gt=0.0, le=1.0)
    """Cap: no domain gets more than this share (never below 1 / trained domains, nor below
    the domain's own floor), so one lagging domain cannot take the whole run."""
    every_s: float = Field(default=5.0, gt=0.0)
    """How often a changed curriculum is published to KV `curriculum` and recorded."""
    ema_alpha: float = Field(default=0.1, gt=0.0, le=1.0)
    """EMA factor of each domain's reward (per sample)."""
    promote_at: float = 0.8
    """Promote a domain's level when its recent success rate is at least this."""
    demote_at: float = 0.2
    """Demote a domain's level when its recent success rate is at most this."""
    window: int = Field(default=64, ge=1)
    """Samples per level behind the success rate (also the minimum between level changes)."""


class ForgettingSection(Section):
    """Forgetting guard: raises the learner's replay share and KL beta (KV `learner.overrides`)
    when the general set (`scheduler.eval.general`) falls below its baseline."""

    margin: float = Field(default=0.05, ge=0.0)
    """Trips when the general score is more than this below its baseline."""
    replay_step: float = Field(default=0.1, ge=0.0)
    """Added to the learner's replay share each time it trips."""
    replay_max: float = Field(default=1.0, ge=0.0)
    """The replay share it never raises above."""
    beta_step: float = Field(default=0.01, ge=0.0)
    """Added to the learner's KL beta each time it trips."""
    beta_max: float = Field(default=0.2, ge=0.0)
    """The KL beta it never raises above."""


class PlateauSection(Section):
    """Plateau detection on the capability-vs-cost curve."""

    threshold: float = Field(default=0.01, ge=0.0)
    """Eval-score gain per 1000 trained samples (least-squares slope over the window) below which the run has plateaued."""
    window: int = Field(default=4, ge=2)
    """Number of most recent evaluations the slope is fitted over."""
    z: float = Field(default=1.0, ge=0.0)
    """A window is a plateau only when gain + z x its standard error (binomial noise of the
    eval scores, `scheduler.eval.n` problems per domain) is below the threshold; 0 = the bare slope."""
    stop: bool = False
    """Ask the launcher to stop the run (KV `status` = "stop-requested") once a plateau is detected."""


_EVAL = ("n", "seed", "difficulty", "every_versions", "mode", "timeout_s", "floors")
_CURRICULUM = ("temperature", "every_s", "ema_alpha", "promote_at", "demote_at", "window")
_FORGETTING = ("margin", "replay_step", "replay_max", "beta_step", "beta_max")


class SchedulerSection(Section):
    """The scheduler: evaluation, curriculum and gates."""

    PLACE = "scheduler"
    RENAMED = {
        **{f"eval_{k}": f"eval.{k}" for k in _EVAL},
        "release_margin": "eval.release_margin",
        "general_eval": "eval.general",
        "general_eval_level": "eval.general_level",
        "general_eval_n": "eval.general_n",
        "curriculum": "curriculum.enabled",
        **{f"curriculum_{k}": f"curriculum.{k}" for k in _CURRICULUM},
        **{f"forgetting_{k}": f"forgetting.{k}" for k in _FORGETTING},
        "plateau_threshold": "plateau.threshold",
        "plateau_window": "plateau.window",
        "stop_on_plateau": "plateau.stop",
    }

    threads: int = 1
    """torch threads of this process."""
    db_url: str = ""
    """Run store URL (SQLAlchemy, e.g. postgresql://user@host/db); empty = $RLBUS_DB_URL, else SQLite <run>/run.db."""
    eval: EvalSection = Field(default_factory=EvalSection)
    """Held-out evaluation and the release gate."""
    curriculum: CurriculumSection = Field(default_factory=CurriculumSection)
    """The curriculum."""
    forgetting: ForgettingSection = Field(default_factory=ForgettingSection)
    """The forgetting guard."""
    plateau: PlateauSection = Field(default_factory=PlateauSection)
    """Plateau detection."""
