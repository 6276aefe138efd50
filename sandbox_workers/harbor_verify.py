"""Run a Harbor task's tests on the container an agent left, where the agent cannot reach them.

`verify_episode(job, episode_cid)` (episode_cid None: an episode that opened no container,
scored on a pristine container of the task image). Order (guaranteed):

1. Storage: the episode container is paused (nothing of the agent runs from here until the
   snapshot is taken; one the engine cannot freeze, e.g. under a fork storm, is killed
   instead); one whose writable layer is over `storage_mb` scores 0 with status
   `storage_exceeded`; nothing is committed.
2. Snapshot: the engine commits the paused container to an image and lists its changes
   (`docker diff`). With `verify_in = "fresh"` the episode container is removed at once; with
   `same` it resumes (its services) until the caller removes it.
3. A NEW test container from the snapshot: no process of the agent runs in it; `same`
   shares the episode container's network namespace only (its services answer on localhost;
   an episode container that no longer runs, e.g. its init killed, shares none), `fresh` has
   no network. The protected paths are `job.protected` plus every path outside them that a
   symlink under them leads to, hop by hop (`/usr/lib/python3.11/sitecustomize.py` ->
   `/etc/python3.11/...`; listed once per task image by its own `find`, without network;
   `/` and top-level directories are never added: that would protect the agent's whole
   workspace). Before the container starts, through the engine's archive API (no program of
   the image runs):
   - the episode scores 0 with status `tamper` when a directory above a protected path or
     above the toolchain's mount point was replaced by something that is not a directory;
     when the agent made anything at the toolchain's mount point; or when it added a path
     under a protected one whose name the engine cannot report (not UTF-8);
   - every changed or deleted path under the protected ones is restored from the task image:
     a file or symlink as it was, a directory that is no longer one (a symlink, a file) whole,
     a deleted one whole (its parents made when the agent deleted them too);
   - `/etc/ld.so.preload` is emptied, and the trusted toolchain volume is mounted read-only
     at `/opt/rlbus-toolchain` (`harbor_images.ensure_toolchain`).
4. Preparation as root with the restored `/bin/sh`: paths the agent added under the
   protected ones are deleted (each named exactly, whatever its characters); `/tests`, `/logs`,
   pytest configuration planted at `/` (`PLANTED`: every file name pytest reads there) and
   Python's `pyvenv.cfg` beside the system interpreters are removed; a fresh `/logs/verifier`
   is made, owned by the verifier user, mode 0700; `tests/` (put, with the preparation script
   and the empty `/etc/ld.so.preload`, in one archive before the start, under a directory named
   at random: the agent cannot have planted anything there) is moved to `/tests` (the agent
   never saw it). A verifier user the agent deleted (present in the task image) scores
   0 with status `tamper`.
5. `bash /tests/test.sh` runs as `[verifier].user`, in the image's working directory, with
   the toolchain first on PATH, `PYTHONSAFEPATH`, no user site, no pytest plugin autoload,
   `--confcutdir=/tests`, `LD_PRELOAD` empty, plus `[verifier].env`; it is stopped at
   `[verifier].timeout_sec`.
6. The engine kills the test container (every process in it dies), THEN reads
   `/logs/verifier/reward.json` (preferred) or `reward.txt` from the stopped container; a
   file that is not a regular file (a symlink) or not an object of finite numbers / one
   number is `bad_reward_file` (0); neither file: `no_reward_file` (0), or `timeout` (0)
   when test.sh passed its timeout. The test container and the snapshot are removed.

The protected paths and their restoration (steps 3-4) live in `harbor_protect`.

Engine failures raise `HarborEngineError` (infrastructure: the caller retries, then
dead-letters; never a 0). A broken task (its verifier user missing from the task image, the
toolchain volume incomplete) raises `VerifyRefused`.
"""

from __future__ import annotations

import json
import math
import secrets
import shlex
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sandbox_workers.base import MIB
from sandbox_workers.harbor_box import LABEL, BoxSpec, HarborBox, HarborEngineError, client, read_tar_file, tar_of
from sandbox_workers.harbor_images import TOOLCHAIN_MOUNT, ensure_toolchain
from sandbox_workers.harbor_protect import (
    Pristine,
    Tamper,
    image_has_user,
    plan_restore,
    protected_roots,
    restore_paths,
)

REWARD_DIR = "/logs/verifier"
PREP_DIR = "/.rlbus-verify"
PLANTED = (
    "/conftest.py",
    "/pytest.toml",
    "/.pytest.toml",
    "/pytest.ini",
    "/.pytest.ini",
    "/pyproject.toml",
    "/tox.ini",
    "/setup.cfg",
    "/pyvenv.cfg",
    "/usr/pyvenv.cfg",
    "/usr/local/pyvenv.cfg",
)
"""Removed before the tests: pytest reads its configuration from `/` (the parent of `/tests`),
and Python a `pyvenv.cfg` beside its executable's directory (`home =` moves its stdlib)."""
PREP = """set -u
[ -f {tc}/.complete ] || {{ echo "rlbus: the toolchain volume is incomplete" >&2; exit 70; }}
{deletes}
rm -rf /tests /logs {planted} || exit 71
mv {prep}/tests /tests && mkdir -p {rd} || exit 71
chown {user} {rd} 2>/dev/null || {{ echo "rlbus: the verifier user {user} does not exist in the image" >&2; exit 72; }}
chmod 0700 {rd} || exit 71
"""


class VerifyRefused(ValueError):
    """The task cannot be verified as written (its fault, not the agent's nor the engine's)."""


@dataclass(frozen=True)
class VerifyJob:
    """What one verification needs (from the task's hidden payload and the operator's config)."""

    spec: BoxSpec
    tests: dict[str, bytes]
    timeout_s: float = 600.0
    user: str = "root"
    env: dict[str, str] = field(default_factory=dict)
    verify_in: str = "same"
    protected: tuple[str, ...] = ()
    toolchain_image: str = "rlbus-repo-sandbox:latest"


@dataclass
class VerifyRun:
    """The outcome: reward, named components, status, and where the time went."""

    reward: float
    components: dict[str, float]
    status: str
    details: str
    test_exit: int | None = None
    timings: dict[str, float] = field(default_factory=dict)


class _NetworkGone(Exception):
    """The episode container whose network the test container was to share no longer runs."""


def _reward_env(job: VerifyJob) -> dict[str, str]:
    env = {
        "PATH": f"{TOOLCHAIN_MOUNT}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": f"{TOOLCHAIN_MOUNT}/site",
        "PYTHONSAFEPATH": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTEST_ADDOPTS": "-p no:cacheprovider --confcutdir=/tests",
        "LD_PRELOAD": "",
        "LD_LIBRARY_PATH": "",
        "HOME": "/tmp",
        "BASH_ENV": "",
        "ENV": "",
    }
    return {**env, **{k: v for k, v in job.env.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}}


def _create_test_container(api, job: VerifyJob, image: str, network_of: str | None, toolchain: str) -> str:
    from docker.types import LogConfig  # `api` exists: docker is imported whole

    host = api.create_host_config(
        init=True,
        network_mode=f"container:{network_of}" if network_of else "none",
        mem_limit=job.spec.memory_mb * MIB,
        memswap_limit=job.spec.memory_mb * MIB,
        nano_cpus=int(job.spec.cpus * 1e9),
        pids_limit=job.spec.pids,
        binds={toolchain: {"bind": TOOLCHAIN_MOUNT, "mode": "ro"}},
        security_opt=["no-new-privileges"],
        log_config=LogConfig(type="none"),
    )
    labels = {LABEL: "1", "rlbus.harbor.expires": str(int(time.time() + 3600))}
    made = api.create_container(
        image, command=["sleep", "infinity"], entrypoint=[], user="0:0", labels=labels, host_config=host
    )
    return made["Id"]


def _read_reward(api, cid: str) -> tuple[dict[str, float] | None, str, str]:
    """(components or None, status, details) read from the stopped test container."""
    import docker

    for name in ("reward.json", "reward.txt"):
        try:
            stream, _ = api.get_archive(cid, f"{REWARD_DIR}/{name}")
        except docker.errors.NotFound:
            continue
        try:
            data = read_tar_file(stream, 1 * MIB)
        except (ValueError, tarfile.TarError) as exc:
            return None, "bad_reward_file", f"{name}: {exc}"
        if data is None:
            return None, "bad_reward_file", f"{name} is not a regular file (a symlink or a directory)"
        return parse_reward(name, data)
    return None, "no_reward_file", "test.sh wrote neither reward.json nor reward.txt"


def parse_reward(name: str, data: bytes) -> tuple[dict[str, float] | None, str, str]:
    """(components with `reward` the scalar, status, details) of one reward file's bytes."""
    text = data.decode("utf-8", "replace").strip()
    if name == "reward.txt":
        try:
            value = float(text)
        except ValueError:
            return None, "bad_reward_file", f"reward.txt is not one number: {text[:80]!r}"
        if not math.isfinite(value):
            return None, "bad_reward_file", f"reward.txt is not finite: {text[:80]!r}"
        return {"reward": value}, "ok", f"reward.txt: {value:g}"
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return None, "bad_reward_file", f"reward.json does not parse: {exc}"
    ok = (
        isinstance(obj, dict)
        and obj
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in obj.values())
    )
    if not ok:
        return None, "bad_reward_file", f"reward.json is not an object of finite numbers: {text[:120]!r}"
    comps = {str(k): float(v) for k, v in obj.items()}
    if "reward" not in comps:
        if len(comps) != 1:
            return None, "bad_reward_file", f"reward.json has no 'reward' key among {sorted(comps)[:8]}"
        comps["reward"] = next(iter(comps.values()))
    return comps, "ok", "reward.json: " + ", ".join(f"{k}={v:g}" for k, v in sorted(comps.items()))


def _zero(status: str, details: str, timings: dict) -> VerifyRun:
    return VerifyRun(0.0, {"reward": 0.0}, status, details, None, timings)


def verify_episode(job: VerifyJob, episode_cid: str | None) -> VerifyRun:
    """Score the episode's container against the task's tests (see the module docstring)."""
    api = client().api
    t0, timings = time.perf_counter(), {}
    toolchain = ensure_toolchain(job.toolchain_image)
    snapshot, rows, network_of = None, [], None
    if episode_cid is not None:
        box = HarborBox.attach(episode_cid, job.spec)
        paused = False
        try:
            box, paused = _freeze(api, box, job.spec)
            network_of = episode_cid if box.running and job.verify_in == "same" else None
            with ThreadPoolExecutor(1) as pool:  # the engine walks the layer for both: at once
                listing = pool.submit(api.diff, episode_cid)
                used = box.rw_bytes()
                rows = listing.result() or []
            if used > job.spec.storage_mb * MIB:
                return _zero(
                    "storage_exceeded", f"the container's writable layer is {used >> 20} MiB > storage_mb", timings
                )
            snapshot = api.commit(episode_cid, repository="rlbus-harbor-snap", tag=secrets.token_hex(6), pause=False)
            snapshot = snapshot["Id"]
        except HarborEngineError:
            raise
        except Exception as exc:
            raise HarborEngineError(f"snapshot of {episode_cid[:12]} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if paused:
                try:
                    api.unpause(episode_cid)
                except Exception:  # noqa: BLE001 - removed below (fresh) or by the caller
                    pass
        if job.verify_in == "fresh":
            box.remove()
    timings["snapshot_s"] = time.perf_counter() - t0
    try:
        try:
            return _run_tests(api, job, snapshot or job.spec.image, network_of, toolchain, rows, timings, t0)
        except _NetworkGone:  # the episode container stopped after its snapshot: no network to share
            return _run_tests(api, job, snapshot or job.spec.image, None, toolchain, rows, timings, t0)
    finally:
        if snapshot is not None:
            try:
                api.remove_image(snapshot, force=True)
            except Exception:  # noqa: BLE001 - a leftover snapshot costs disk, not correctness
                pass


def _freeze(api, box: HarborBox, spec: BoxSpec) -> tuple[HarborBox, bool]:
    """(the box as it is now, whether it is paused): a running episode container is paused; one
    that cannot be frozen (the cgroup freezer fails, e.g. under a fork storm) is killed, so that
    nothing of the agent writes between the diff and the commit."""
    if not box.running or box.paused:
        return box, box.running  # a paused one (a verification that died half way) is resumed after
    for _attempt in range(3):
        try:
            box.api.pause(box.id)
            return box, True
        except Exception:  # noqa: BLE001 - exited, or not freezable now
            for _ in range(10):  # an exit racing the pause: the engine notices it soon
                box = HarborBox.attach(box.id, spec)
                if not box.running:
                    return box, False
                time.sleep(0.1)
    try:
        api.kill(box.id)
        api.wait(box.id, timeout=30)
    except Exception as exc:
        raise HarborEngineError(f"{box.id[:12]} can be neither paused nor killed: {exc}") from exc
    return HarborBox.attach(box.id, spec), False


def _run_tests(api, job, image, network_of, toolchain, rows, timings, t0) -> VerifyRun:
    t1 = time.perf_counter()
    roots = tuple(job.protected)
    if rows:
        try:
            roots = protected_roots(api, job.spec.image, roots)
        except Exception as exc:
            raise HarborEngineError(f"listing the symlinks of {job.spec.image}: {type(exc).__name__}: {exc}") from exc
    try:
        cid = _create_test_container(api, job, image, network_of, toolchain)
    except Exception as exc:
        raise HarborEngineError(f"test container did not start: {type(exc).__name__}: {exc}") from exc
    pristine = Pristine(api, job.spec.image)
    try:
        user = "root" if job.user in ("", "root", "0") else job.user
        try:
            restore, added = plan_restore(api, cid, pristine, rows, roots)
            restore_paths(api, cid, pristine, restore)
            deletes = "\n".join(f"rm -rf -- {shlex.quote(p)}" for p in added)
            stage = f"{PREP_DIR}-{secrets.token_hex(8)}"  # a name the agent could not have made before
            prep = PREP.format(
                tc=TOOLCHAIN_MOUNT, prep=stage, deletes=deletes, rd=REWARD_DIR, user=user, planted=" ".join(PLANTED)
            )
            staged = {f"{stage[1:]}/prep.sh": prep.encode()}
            staged |= {f"{stage[1:]}/tests/{rel}": data for rel, data in job.tests.items()}
            if "/etc/ld.so.preload" not in added:  # an added one (any type) is deleted in step 4
                staged["etc/ld.so.preload"] = b""
            api.put_archive(cid, "/", tar_of(staged))  # one archive: the preparation, the tests, the loader's file
            api.start(cid)
        except Tamper as exc:
            return _zero("tamper", f"the protected paths cannot be restored: {exc}", timings)
        except Exception as exc:
            if network_of and not HarborBox.attach(network_of, job.spec).running:
                raise _NetworkGone from exc
            raise HarborEngineError(f"test container did not start: {type(exc).__name__}: {exc}") from exc
        box = HarborBox(cid, job.spec, (api.inspect_container(cid).get("Config") or {}).get("WorkingDir") or "/")
        timings["start_s"] = time.perf_counter() - t1
        r = box.exec(["/bin/sh", f"{stage}/prep.sh"], 60, cwd="/", user="root")
        if r.exit_code == 72 and rows and image_has_user(api, pristine, user):
            return _zero("tamper", f"the agent deleted the verifier user {user} from the container", timings)
        if r.exit_code in (70, 72):
            raise VerifyRefused(r.stderr.strip()[-300:])
        if r.exit_code != 0:
            return _zero(
                "tamper", f"the verifier could not prepare a clean /tests and /logs: {r.stderr[-300:]}", timings
            )
        t2 = time.perf_counter()
        argv = ["/bin/sh", "-c", "[ -x /bin/bash ] && exec /bin/bash /tests/test.sh; exec /bin/sh /tests/test.sh"]
        run = box.exec(argv, job.timeout_s, user=user, env=_reward_env(job), cap=64 * 1024)
        timings["test_s"] = time.perf_counter() - t2
        api.kill(cid)
        comps, status, details = _read_reward(api, cid)
        if comps is None and run.timed_out:
            status, details = "timeout", f"test.sh passed [verifier].timeout_sec = {job.timeout_s:g} ({details})"
        tail = (run.stdout[-600:] + run.stderr[-400:]).strip()
        details = f"{details}\ntest.sh exit {run.exit_code}{' (timed out)' if run.timed_out else ''}\n{tail}".strip()
        timings["total_s"] = time.perf_counter() - t0
        if comps is None:
            return VerifyRun(0.0, {"reward": 0.0}, status, details, run.exit_code, timings)
        return VerifyRun(comps["reward"], comps, "ok", details, run.exit_code, timings)
    finally:
        t3 = time.perf_counter()
        for remove in (lambda: api.remove_container(cid, force=True, v=True), pristine.close):
            try:
                remove()
            except Exception:  # noqa: BLE001 - the reaper gets it
                pass
        timings["reset_s"] = time.perf_counter() - t3
