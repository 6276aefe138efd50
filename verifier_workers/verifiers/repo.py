"""The `repo` verifier: a candidate diff against a repository's hidden tests, in a fresh container.

`verify_repo(traj, hidden)` scores the trajectory's diff (`traj.artifacts["diff"]`, UTF-8,
as the rollout side exports the final repository state; else `traj.final_text`) against
the task in the hidden payload: `hidden["task"]`, a `schemas.repo_task.RepoTask` as a
dict (`dataclasses.asdict`) or its `to_json()` text. A large task is chunked in the hidden
bucket (`bus.hidden`); a large diff travels by reference (`traj.artifact_refs["diff"]`), and
the verifier worker puts it into `artifacts` (sha256-checked, `bus.payloads`) before this
runs. A diff still by reference here (nobody resolved it) is an infrastructure error, never
scored as the final text.

Order of verification (guaranteed):
1. On the host, in memory (`verifier_workers.repo_diff`): the original files, the diff
   applied strictly and atomically with every file patch that touches a protected path
   dropped (`RepoTask.is_protected` with the task's test dirs, `.pytest.ini`, and every
   hidden file's path, and the test helpers the hidden tests import,
   `schemas.repo_task.helper_paths`), then the hidden files copied over. The drops are listed
   in the details. The test files that run, the hidden files and the helpers are rewritten to
   compare plain data only (`repo_harness_rewrite.rewrite_tests`). A diff that does not apply
   scores 0 on every component without a run (an export the rollout side refused,
   `schemas.repo_task.EXPORT_REFUSED`, is such a diff, and its reason is the details); a diff
   adding a top-level module that shadows the stdlib, pytest, pluggy or the harness is
   refused (unresolved, `applied` 1.0, the names in the details) without a run; the
   supervisor refuses one shadowing an installed distribution of the image the same way.
2. A FRESH container (`sandbox_workers.docker_fresh`: never used before, removed after)
   gets that tree, a random per-call nonce and the expected ids (targets + regression) on
   the stdin of its uid-0 supervisor (`verifier_workers.repo_harness`, whose docstring
   gives the trust boundary), which installs the deps from the image's wheelhouse and
   runs pytest as uid 65534 over exactly those ids.
3. The verdict comes only from the supervisor's result file, accepted iff its HMAC
   under this call's nonce matches and it names this call; never from exit codes or
   output.

Scoring:
- `applied` 1.0 iff the kept part of the diff applied cleanly (drops are not failures).
- `target_pass_rate`, `regression_pass_rate`: passed / expected (an expected test that
  vanished, was skipped, xfailed or errored counts as failed; no regression tests: 1.0).
- `resolved` 1.0 iff every target and every regression test passed, the run finished
  (pytest's session ended) and nothing was flagged. The scalar follows the trajectory's
  `reward_weights`, default `resolved`.
- The verdict's `sandbox_s` is the wall time of steps 2-3 (the run's sandbox cost; 0 when
  the diff did not apply and no container ran).
- Status `tamper` (every component 0) when the harness flags tampering or the result
  file's MAC is wrong; `timeout` when the run passed `timeout_s` (tests without a result
  count as failed); else `ok`.
- Infrastructure (`RepoSandboxInfraError`, retried then dead-lettered, never a reward):
  no docker engine or image, a container that cannot start or exec, a supervisor that
  wrote no result or reported an infra failure (a dependency missing from the wheelhouse).
- Unusable input (`VerifierInputError`, dead-lettered): no task in the payload, a task that
  does not parse, no target tests, bad `timeout_s` / `memory_mb`.

Parameters (`traj.verifier_params`): `timeout_s` (default 120, at most 600), `memory_mb`
(default 1024), `pids` (default 128), `cpus` (default 1.0). Env `RLBUS_REPO_SANDBOX_IMAGE`
names the image (default `rlbus-repo-sandbox:latest`, built by `rlbus sandbox build-image --repo`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

from schemas import Trajectory
from schemas.repo_task import EXPORT_REFUSED, RepoTask, helper_paths, is_protected
from verifier_workers.errors import VerifierInfraError
from verifier_workers.harness_programs import repo_guard, repo_harness
from verifier_workers.repo_diff import PatchResult, apply_diff
from verifier_workers.repo_harness_rewrite import changed_functions, new_top_levels, rewrite_tests, shadowing
from verifier_workers.verdict import Verdict, VerifierInputError

DIFF_ARTIFACT = "diff"
DEFAULT_IMAGE = "rlbus-repo-sandbox:latest"
RESULT_FILE = "/work/.rlbus/result.json"
DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S = 120.0, 600.0
INSTALL_TIMEOUT_S = 120.0
EXTRA_PROTECTED_NAMES = frozenset({".pytest.ini"})
COMPONENTS = ("resolved", "target_pass_rate", "regression_pass_rate", "applied")


class RepoSandboxInfraError(VerifierInfraError):
    """The sandbox or the harness (not the candidate) failed: retried, then dead-lettered; never a 0."""


@dataclass
class Prepared:
    """The tree the container gets, and what the host found while building it."""

    files: dict[str, str]
    patch: PatchResult
    expected: list[str]
    paths: list[str]
    pythonpath: list[str]
    new_top: list[str]


def load_task(hidden: dict | None) -> RepoTask:
    """The RepoTask of a hidden payload (`{"task": dict or JSON text}`); VerifierInputError if none."""
    raw = (hidden or {}).get("task")
    try:
        if isinstance(raw, str):
            return RepoTask.from_json(raw)
        if isinstance(raw, dict):
            return RepoTask(**raw)
    except (TypeError, ValueError) as exc:
        raise VerifierInputError(f"repo task does not parse: {exc}") from None
    raise VerifierInputError("repo task without its task (hidden payload needs 'task': a RepoTask)")


def candidate_diff(traj: Trajectory) -> str:
    """The diff to verify: the `diff` artifact (UTF-8), else the final text; a diff left by
    reference (`artifact_refs`, unresolved) raises RepoSandboxInfraError."""
    if DIFF_ARTIFACT in traj.artifact_refs and DIFF_ARTIFACT not in traj.artifacts:
        raise RepoSandboxInfraError(
            f"the diff is by reference ({traj.artifact_refs[DIFF_ARTIFACT].uri}) and was not "
            "resolved: score through the verifier worker (bus.payloads.resolve_artifacts)"
        )
    raw = traj.artifacts.get(DIFF_ARTIFACT)
    if raw is not None:
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return traj.final_text or ""


def protected_predicate(task: RepoTask):
    """path -> whether an edit to it is dropped (the task's rule, `.pytest.ini`, the hidden paths and
    the test-support modules the hidden tests import, `schemas.repo_task.helper_paths`)."""
    dirs = tuple(task.test_dirs)
    hidden = frozenset(task.hidden_files) | helper_paths(task.files, task.hidden_files)

    def protected(path: str) -> bool:
        return is_protected(path, dirs) or path in hidden or PurePosixPath(path).name in EXTRA_PROTECTED_NAMES

    return protected


def _tree_conflict(files: dict[str, str]) -> str:
    dirs = {str(p) for path in files for p in PurePosixPath(path).parents if str(p) != "."}
    clash = sorted(dirs & set(files))
    return f"{clash[0]} is both a file and a directory" if clash else ""


def prepare(task: RepoTask, diff: str) -> Prepared:
    """Step 1 of the module docstring: the tree to test (its test files rewritten to compare plain
    data, `repo_harness_rewrite`), with the patch result and the diff's new top-level modules."""
    patch = apply_diff(task.files, diff, protected_predicate(task))
    if patch.applied and (clash := _tree_conflict({**patch.files, **task.hidden_files})):
        patch.errors.append(clash)
        patch.files = dict(task.files)
    files = {**(patch.files if patch.applied else task.files), **task.hidden_files}
    expected = list(dict.fromkeys([*task.target_tests, *task.regression_tests]))
    paths = sorted({tid.split("::", 1)[0] for tid in expected} & set(files))
    helpers = {p for p in helper_paths(task.files, task.hidden_files) if p.endswith(".py")}
    changed = changed_functions(task.files, patch.files, patch.changed) if patch.applied else ()
    for path in sorted(set(paths) | helpers | {p for p in task.hidden_files if p.endswith(".py")}):
        files[path] = rewrite_tests(files[path], changed)
    pythonpath = ["."] + (["src"] if any(p.startswith("src/") for p in files) else [])
    new_top = new_top_levels(task.files, patch.files, pythonpath) if patch.applied else []
    return Prepared(files, patch, expected, paths, pythonpath, new_top)


def _params(traj: Trajectory) -> tuple[float, int, int, float]:
    vp = traj.verifier_params
    try:
        timeout = min(float(vp.get("timeout_s", DEFAULT_TIMEOUT_S)), MAX_TIMEOUT_S)
        memory, pids, cpus = int(vp.get("memory_mb", 1024)), int(vp.get("pids", 128)), float(vp.get("cpus", 1.0))
    except (TypeError, ValueError) as exc:
        raise VerifierInputError(f"bad repo verifier_params: {exc}") from None
    if timeout <= 0 or memory < 128 or pids < 8 or cpus <= 0:
        raise VerifierInputError(f"repo verifier_params out of range: {vp}")
    return timeout, memory, pids, cpus


def verify_repo(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Score the trajectory's diff against the task's hidden tests (see the module docstring)."""
    task = load_task(hidden)
    if not task.target_tests:
        raise VerifierInputError(f"repo task {task.task_id} has no target tests")
    weights = dict(traj.reward_weights) or {"resolved": 1.0}
    return check_patch(task, candidate_diff(traj), params=_params(traj), weights=weights)


def check_patch(
    task: RepoTask,
    diff: str,
    *,
    params: tuple[float, int, int, float] = (DEFAULT_TIMEOUT_S, 1024, 128, 1.0),
    weights: dict[str, float] | None = None,
    image: str | None = None,
) -> Verdict:
    """Verify `diff` against `task` in a fresh container; raises RepoSandboxInfraError on infrastructure failure."""
    weights = weights or {"resolved": 1.0}
    prep = prepare(task, diff)
    drops = f"dropped edits to protected paths: {', '.join(prep.patch.dropped)}\n" if prep.patch.dropped else ""
    if not prep.patch.applied:
        why = (
            diff.strip()[:800]
            if diff.startswith(EXPORT_REFUSED)
            else f"the diff does not apply: {'; '.join(prep.patch.errors)[:800]}"
        )
        return Verdict(dict.fromkeys(COMPONENTS, 0.0), weights=weights, details=f"{drops}{why}")
    if shadow := shadowing(prep.new_top):
        return Verdict(
            dict.fromkeys(COMPONENTS, 0.0) | {"applied": 1.0},
            weights=weights,
            details=f"{drops}refused: the diff adds top-level module(s) {', '.join(shadow)} that shadow "
            "the standard library, pytest or the harness; rename them",
        )
    t0 = time.perf_counter()
    body = _run(task, prep, params, image)
    took = time.perf_counter() - t0
    verdict = _judge(task, prep, body)
    verdict.weights, verdict.sandbox_s = weights, took
    verdict.details = f"{drops}{verdict.details}\n[{took * 1000:.0f} ms]"
    return verdict


def _run(task: RepoTask, prep: Prepared, params: tuple[float, int, int, float], image: str | None) -> dict:
    """Steps 2-3: run the harness in a fresh container; the MAC-checked result body."""
    from sandbox_workers.base import Limits

    timeout, memory, pids, cpus = params
    protected = protected_predicate(task)
    nonce, call = secrets.token_hex(32), secrets.token_hex(8)
    job = {
        "nonce": nonce,
        "call": call,
        "files": prep.files,
        "harness": repo_harness(),
        "guard": repo_guard(),
        "expected": prep.expected,
        "paths": prep.paths,
        "pythonpath": prep.pythonpath,
        "new_top": prep.new_top,
        "deps": list(task.deps),
        "timeout_s": timeout,
        "install_timeout_s": INSTALL_TIMEOUT_S,
        "protect_hash": sorted(task.hidden_files),
        "trusted_files": sorted(p for p in prep.files if protected(p)),
    }
    limits = Limits(
        memory_mb=memory,
        pids=pids,
        cpu_seconds=int(timeout + INSTALL_TIMEOUT_S) + 10,
        tmp_mb=256,
        file_size_mb=64,
        nofile=1024,
    )
    image = image or os.environ.get("RLBUS_REPO_SANDBOX_IMAGE") or DEFAULT_IMAGE
    try:
        from sandbox_workers.docker_fresh import run_fresh

        run = run_fresh(
            ["python3", "-I", "-S", "-c", repo_harness(), "supervise"],
            json.dumps(job).encode(),
            RESULT_FILE,
            image=image,
            limits=limits,
            cpus=cpus,
            timeout=timeout + INSTALL_TIMEOUT_S + 30,
        )
    except Exception as exc:
        raise RepoSandboxInfraError(f"repo sandbox failed: {type(exc).__name__}: {exc}") from exc
    if run.file is None:
        raise RepoSandboxInfraError(f"the repo harness wrote no result (exit {run.exit_code}): {run.stderr[-600:]}")
    return _open_result(run.file, nonce, call)


def _open_result(data: bytes, nonce: str, call: str) -> dict:
    """The result body if its MAC and call id match, else `{"tamper": ...}`."""
    try:
        outer = json.loads(data)
        body_text, mac = outer["body"], outer["mac"]
        want = hmac.new(nonce.encode(), body_text.encode(), hashlib.sha256).hexdigest()
        if not (isinstance(mac, str) and hmac.compare_digest(mac, want)):
            return {"tamper": "the result file's MAC does not match this call's nonce"}
        body = json.loads(body_text)
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"tamper": "the result file is not the harness's"}
    if body.get("call") != call:
        return {"tamper": "the result file belongs to another call"}
    if body.get("infra"):
        raise RepoSandboxInfraError(str(body["infra"])[:1500])
    return body


def _judge(task: RepoTask, prep: Prepared, body: dict) -> Verdict:
    if body.get("refused"):
        return Verdict(dict.fromkeys(COMPONENTS, 0.0) | {"applied": 1.0}, details=f"refused: {body['refused']}")
    if body.get("tamper") and "passed" not in body:
        return Verdict(dict.fromkeys(COMPONENTS, 0.0), status="tamper", details=f"tamper: {body['tamper']}")
    passed = body.get("passed") or {}
    targets = list(dict.fromkeys(task.target_tests))
    regress = [t for t in dict.fromkeys(task.regression_tests) if t not in set(targets)]
    t_ok = sum(passed.get(t) is True for t in targets)
    r_ok = sum(passed.get(t) is True for t in regress)
    comps = {
        "applied": 1.0,
        "target_pass_rate": t_ok / len(targets),
        "regression_pass_rate": r_ok / len(regress) if regress else 1.0,
    }
    lines = [
        f"targets {t_ok}/{len(targets)}, regression {r_ok}/{len(regress)}"
        f" (setup {body.get('setup_s')} s, run {body.get('run_s')} s)"
    ]
    missing = body.get("missing") or []
    if missing:
        lines.append(f"no result for {len(missing)} expected test(s): {', '.join(missing[:8])}")
    if not body.get("fin"):
        lines.append(f"the test run ended before pytest finished (runner exit {body.get('runner_exit')})")
    lines += list(body.get("notes") or [])[:10]
    log = str(body.get("log") or "").strip()
    if log:
        lines.append(f"runner output (never parsed): {log[-800:]}")
    if body.get("tamper"):
        return Verdict(
            dict.fromkeys(COMPONENTS, 0.0), status="tamper", details="\n".join([f"tamper: {body['tamper']}", *lines])
        )
    resolved = t_ok == len(targets) and r_ok == len(regress) and bool(body.get("fin")) and not body.get("timed_out")
    status = "timeout" if body.get("timed_out") else "ok"
    return Verdict({"resolved": float(resolved), **comps}, status=status, details="\n".join(lines))
