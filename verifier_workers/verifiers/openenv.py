"""The `openenv` verifier: an episode scored by the rewards its OpenEnv environment gave.

The environment server is the controlled side here: it computed each step's
`observation.reward`. The rollout worker recorded them, in order, as the trajectory's
`openenv` artifact (`schemas.openenv_env.EpisodeRecord`), written by the worker from the
environment's answers, never from the policy's text. This verifier reads that record and
nothing the policy wrote: not `final_text`, not the turns, so text that imitates a record
(or a reward) never counts.

Components: `reward` (the episode's return: the sum of its step rewards, a step without one
counting 0), `reward_last` (the last step's), `done` (1.0 when the environment ended the
episode), `steps` (actions the environment answered). Default weights `{"reward": 1}`; a
domain's `reward_weights` pick others (e.g. `{"reward_last": 1}`).

Guarantees:
- Status `ok` whenever a record is there; an episode that took no step scores 0 with `ok`
  (it is the policy's doing).
- No record, or one that is not valid JSON of an `EpisodeRecord` (rewards finite), is an
  infrastructure error (`VerifierInfraError`: retried, then dead-lettered; never a 0).
- A task that is not an OpenEnv task (no `verifier_params["openenv"]`, as bound from the
  task's check), one that exports a sandbox file under the record's name, or a record of
  another episode (task id, sample index) is unusable input (`VerifierInputError`).
"""

from __future__ import annotations

from pydantic import ValidationError

from schemas import Trajectory
from schemas.openenv_env import RECORD_ARTIFACT, SPEC_KEY, EpisodeRecord
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import Verdict, VerifierInputError


def episode_record(traj: Trajectory) -> EpisodeRecord:
    """The trajectory's `EpisodeRecord` (module guarantees for what is refused, and how)."""
    if not isinstance(traj.verifier_params.get(SPEC_KEY), dict):
        raise VerifierInputError(f"task {traj.task_id} is not an OpenEnv task (no verifier_params[{SPEC_KEY!r}])")
    if RECORD_ARTIFACT in (traj.verifier_params.get("export") or []):
        raise VerifierInputError(
            f"verifier_params.export names {RECORD_ARTIFACT!r}: a sandbox file cannot be the record"
        )
    raw = traj.artifacts.get(RECORD_ARTIFACT)
    if raw is None:
        raise VerifierInfraError(
            f"trajectory {traj.msg_id} has no {RECORD_ARTIFACT!r} record: the rollout worker writes the "
            "environment's rewards there at the end of every OpenEnv episode"
        )
    try:
        rec = EpisodeRecord.from_bytes(bytes(raw))
    except (ValidationError, ValueError, TypeError) as exc:
        raise VerifierInfraError(
            f"trajectory {traj.msg_id}: unreadable {RECORD_ARTIFACT!r} record: {exc}"[:500]
        ) from exc
    if (rec.task_id, rec.sample_index) != (traj.task_id, traj.sample_index):
        raise VerifierInputError(
            f"the {RECORD_ARTIFACT!r} record is episode {rec.task_id}/{rec.sample_index}, "
            f"not this trajectory's {traj.task_id}/{traj.sample_index}"
        )
    return rec


def verify_openenv(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the episode by its environment's rewards (see the module docstring)."""
    rec = episode_record(traj)
    rewards = [s.reward or 0.0 for s in rec.steps]
    components = {
        "reward": float(sum(rewards)),
        "reward_last": float(rewards[-1]) if rewards else 0.0,
        "done": 1.0 if rec.done else 0.0,
        "steps": float(len(rec.steps)),
    }
    details = f"episode {rec.episode_id}: {len(rec.steps)} steps, rewards {rewards[:50]}, done {rec.done}"
    return Verdict(components, status="ok", details=details[:2000], weights={"reward": 1.0})
