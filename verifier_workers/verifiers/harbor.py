"""The `harbor` verifier: a Harbor task's `tests/test.sh` on the container its agent left.

`verify_harbor(traj, hidden)` reads the task's tests and verifier settings ONLY from the hidden
payload (`hidden["harbor"]`, written by the sampler from the task directory and the
operator's `[harbor]` config), the container from the trajectory's `harbor_container`
artifact (the rollout side's handover), and runs `sandbox_workers.harbor_verify`, whose
docstring gives the order of verification and what the agent cannot reach.

Guarantees:
- The container must carry this run's, this episode's and this task's labels; one that does
  not is unusable input (dead-lettered), never scored. One that still ran at the handover
  (`harbor_state`) and has stopped since was stopped by the engine: infrastructure, not scored. A trajectory without the artifact
  opened no container: a pristine container of the task image is scored (the empty episode).
- Every key of `reward.json` is a named component; `reward` is the scalar (the weights are
  `{"reward": 1}` unless the domain sets `reward_weights`); `reward.txt` gives `reward` only.
- Status (counted per task by the run's reward records): `ok`; `no_reward_file`,
  `bad_reward_file`, `timeout`, `storage_exceeded`, `tamper` all score every component 0.
- Infrastructure (`HarborInfraError`, retried, then dead-lettered; never a 0): no engine,
  a container gone or that cannot start, a snapshot that fails. A task that cannot be
  verified as written (`VerifyRefused`) is unusable input.
- The episode's container is removed once a verdict exists (not after an infrastructure
  error: the retry needs it).
"""

from __future__ import annotations

from schemas import Trajectory
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import Verdict, VerifierInputError

CONTAINER_ARTIFACT = "harbor_container"


class HarborInfraError(VerifierInfraError):
    """The engine or a container failed, not the agent: retried, then dead-lettered."""


def _job(traj: Trajectory, hidden: dict | None):
    from sandbox_workers.harbor_box import BoxSpec
    from sandbox_workers.harbor_verify import VerifyJob

    h = (hidden or {}).get("harbor")
    if not isinstance(h, dict) or not isinstance(h.get("tests"), dict) or "spec" not in h:
        raise VerifierInputError("harbor task without its tests (hidden payload needs 'harbor': tests, spec)")
    return VerifyJob(
        spec=BoxSpec.from_params(h["spec"]),
        tests={str(k): bytes(v) for k, v in h["tests"].items()},
        timeout_s=float(h.get("timeout_s", 600)),
        user=str(h.get("user") or "root"),
        env={str(k): str(v) for k, v in (h.get("env") or {}).items()},
        verify_in=str(h.get("verify_in") or "same"),
        protected=tuple(h.get("protected") or ()),
        toolchain_image=str(h.get("toolchain_image") or "rlbus-repo-sandbox:latest"),
    )


def _container(traj: Trajectory, job) -> str | None:
    raw = traj.artifacts.get(CONTAINER_ARTIFACT)
    if raw is None:
        return None
    cid = raw.decode() if isinstance(raw, bytes) else str(raw)
    from sandbox_workers.harbor_box import EPISODE_LABEL, RUN_LABEL, TASK_LABEL, HarborBox, HarborEngineError

    try:
        box = HarborBox.attach(cid, job.spec)
    except HarborEngineError as exc:
        raise HarborInfraError(str(exc)) from exc
    labels = box.labels
    if traj.artifacts.get("harbor_state") == b"running" and not (box.running or box.paused):
        raise HarborInfraError(
            f"container {cid[:12]} ran at the handover and has stopped since (an engine restart?): not scored"
        )
    want = {
        RUN_LABEL: traj.run_id,
        EPISODE_LABEL: f"{traj.task_id}/{traj.sample_index}",
        TASK_LABEL: job.spec.task_hash,
    }
    wrong = {k: labels.get(k) for k, v in want.items() if labels.get(k) != v}
    if wrong:
        raise VerifierInputError(f"container {cid[:12]} is not this episode's (labels {wrong} != {want})")
    return cid


def _engine_error(exc: Exception) -> bool:
    """Whether `exc` comes from talking to the docker engine (its SDK or its HTTP client)."""
    import docker
    import requests

    return isinstance(exc, (docker.errors.DockerException, requests.exceptions.RequestException, ConnectionError))


def verify_harbor(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the episode's container against the task's hidden tests (see the module docstring)."""
    from sandbox_workers.harbor_box import HarborEngineError, remove_container
    from sandbox_workers.harbor_images import TaskBuildFailed
    from sandbox_workers.harbor_verify import VerifyRefused, verify_episode

    job = _job(traj, hidden)
    cid = _container(traj, job)
    try:
        run = verify_episode(job, cid)
    except (HarborEngineError, TaskBuildFailed) as exc:
        raise HarborInfraError(f"harbor verification failed: {exc}") from exc
    except Exception as exc:
        if _engine_error(exc):  # an engine call outside the wrapped ones (connection refused, 5xx)
            raise HarborInfraError(f"harbor verification failed: {type(exc).__name__}: {exc}") from exc
        raise
    except VerifyRefused as exc:
        raise VerifierInputError(f"harbor task cannot be verified as written: {exc}") from exc
    if cid is not None:
        remove_container(cid)
    weights = dict(traj.reward_weights) or {"reward": 1.0}
    comps = run.components if run.status == "ok" else dict.fromkeys(run.components, 0.0) | {"reward": 0.0}
    return Verdict(
        comps,
        status=run.status,
        details=run.details[-2000:],
        weights=weights,
        sandbox_s=run.timings.get("total_s", 0.0),
    )


def release(traj: Trajectory) -> None:
    """Remove the episode's container (its outcome is final without a verdict: tamper, dead letter)."""
    raw = traj.artifacts.get(CONTAINER_ARTIFACT)
    if raw is not None:
        from sandbox_workers.harbor_box import remove_container

        remove_container(raw.decode() if isinstance(raw, bytes) else str(raw))
