"""What a Harbor task runs with, and its oracle / empty checks, cached by content.

Guarantees:
- `box_spec(task, hcfg, image)` and `verify_job(task, hcfg, spec)` are the ONE place a task
  directory and the operator's `[harbor]` section become a container spec (public) and a
  verification job (hidden): the domain, the checks and `rlbus verify` all use them.
  Network: only when the task says `allow_internet` AND `harbor.allow_internet`.
- `check_task` builds the image (a failure is a failed check with the build log's tail),
  scores an empty episode (a pristine container), then runs `solution/solve.sh` as the agent
  in a fresh container (the `solution/` files under /solution, as Harbor's oracle has them)
  and scores that. The check passes iff the oracle scores `TOP` (1.0)
  with status ok and the empty episode scores strictly less. Infrastructure failures
  propagate (never a failed check).
- Results are cached per task content hash and the settings that change scoring
  (`cache_key`), in `check_dir()` (`$RLBUS_HARBOR_CHECKS`, else ~/.cache/rlbus/harbor-checks);
  `cached_check` reads one back (None when never checked under these settings).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sandbox_workers.harbor_box import BoxSpec, HarborBox
from sandbox_workers.harbor_images import TaskBuildFailed, ensure_task_image, task_image
from sandbox_workers.harbor_verify import VerifyJob, VerifyRun, verify_episode
from schemas.harbor_task import HarborTask

TOP = 1.0


@dataclass
class CheckResult:
    """One task's oracle and empty checks."""

    name: str
    task_id: str
    ok: bool
    reason: str
    oracle: float | None = None
    empty: float | None = None
    oracle_status: str = ""
    empty_status: str = ""
    seconds: float = 0.0


def network_for(task: HarborTask, hcfg) -> bool:
    """Whether the task's container gets a network (both must consent)."""
    return bool(task.allow_internet and hcfg.allow_internet)


def box_spec(task: HarborTask, hcfg, image: str | None = None) -> BoxSpec:
    """The container spec of `task` under `hcfg` (see the guarantees)."""
    return BoxSpec(
        image=image or task_image(task, dict(hcfg.image_map)),
        task_hash=task.content_hash,
        cpus=task.cpus,
        memory_mb=task.memory_mb,
        storage_mb=task.storage_mb,
        network=network_for(task, hcfg),
        user=task.agent_user,
        ttl_s=hcfg.handover_ttl_s,
    )


def verify_job(task: HarborTask, hcfg, spec: BoxSpec) -> VerifyJob:
    """The verification job of `task` (what the hidden payload carries)."""
    return VerifyJob(
        spec=spec,
        tests=dict(task.tests),
        timeout_s=task.verifier_timeout_s,
        user=task.verifier_user,
        env=dict(task.verifier_env),
        verify_in=hcfg.verify_in,
        protected=tuple(hcfg.protected),
        toolchain_image=hcfg.toolchain_image,
    )


def hidden_payload(job: VerifyJob) -> dict:
    """The `harbor` verifier's hidden payload of a job (msgpack-able)."""
    return {
        "harbor": {
            "spec": asdict(job.spec),
            "tests": dict(job.tests),
            "timeout_s": job.timeout_s,
            "user": job.user,
            "env": dict(job.env),
            "verify_in": job.verify_in,
            "protected": list(job.protected),
            "toolchain_image": job.toolchain_image,
        }
    }


def check_dir() -> Path:
    env = os.environ.get("RLBUS_HARBOR_CHECKS")
    return Path(env) if env else Path.home() / ".cache" / "rlbus" / "harbor-checks"


def cache_key(task: HarborTask, hcfg) -> str:
    settings = json.dumps(
        [
            sorted(hcfg.image_map.items()),
            hcfg.verify_in,
            list(hcfg.protected),
            hcfg.toolchain_image,
            hcfg.allow_internet,
        ]
    )
    return f"{task.name}-{task.content_hash[:16]}-{hashlib.sha256(settings.encode()).hexdigest()[:10]}"


def cached_check(task: HarborTask, hcfg) -> CheckResult | None:
    path = check_dir() / f"{cache_key(task, hcfg)}.json"
    try:
        return CheckResult(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _store(task: HarborTask, hcfg, result: CheckResult) -> None:
    d = check_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{cache_key(task, hcfg)}.tmp"
    tmp.write_text(json.dumps(asdict(result), indent=1))
    tmp.replace(d / f"{cache_key(task, hcfg)}.json")


def run_script(
    job: VerifyJob, script: str, timeout_s: float, run_id: str = "check", files: dict[str, bytes] | None = None
) -> VerifyRun:
    """Run `script` with bash as the agent in a fresh task container (after `files`, e.g. the
    task's `solution/`, are put under /solution), then verify it."""
    box = HarborBox.create(job.spec, run_id, f"script-{time.time_ns()}")
    try:
        if files:
            box.put_tree("/solution", files)
        box.write_file("/tmp/.rlbus-agent-script.sh", script.encode())
        box.exec(["bash", "/tmp/.rlbus-agent-script.sh"], timeout_s)
        return verify_episode(job, box.id)
    finally:
        box.remove()


def check_task(task: HarborTask, hcfg, *, store: bool = True) -> CheckResult:
    """The oracle and empty checks of `task` (see the guarantees)."""
    t0 = time.perf_counter()

    def done(ok: bool, reason: str, **kw) -> CheckResult:
        result = CheckResult(task.name, task.task_id, ok, reason, seconds=round(time.perf_counter() - t0, 2), **kw)
        if store:
            _store(task, hcfg, result)
        return result

    if task.refusal:
        return done(False, task.refusal)
    try:
        image = ensure_task_image(task, dict(hcfg.image_map))
    except TaskBuildFailed as exc:
        return done(False, f"image build failed: {exc}"[-1500:])
    job = verify_job(task, hcfg, box_spec(task, hcfg, image))
    empty = verify_episode(job, None)
    if not task.oracle:
        return done(False, "no solution/solve.sh", empty=empty.reward, empty_status=empty.status)
    oracle = run_script(job, task.oracle, task.agent_timeout_s, files=task.solution)
    scores = dict(oracle=oracle.reward, empty=empty.reward, oracle_status=oracle.status, empty_status=empty.status)
    if oracle.status != "ok" or oracle.reward < TOP:
        return done(False, f"the oracle scores {oracle.reward:g} ({oracle.status}), not {TOP:g}", **scores)
    if empty.reward >= oracle.reward:
        return done(False, f"the empty episode scores {empty.reward:g}, as much as the oracle", **scores)
    return done(True, "", **scores)
