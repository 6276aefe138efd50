"""The two sides of `bench/harbor.py`: ours (rlbus's verification of a Harbor task attempt, on a
snapshot of the agent's container) and the peer (what Harbor itself does: the tests run in the
agent's own container, unisolated from it).

Guarantees:
- Both sides act as the agent the same way before their clock starts: a fresh container of the
  task image, the task's `solution/` under /solution and its `solve.sh` run with bash as the
  task's agent user (the oracle attempt), or nothing at all (the empty attempt).
- `ours(...)` times `verify_episode(job, box.id)` plus the removal of the episode container
  (the agent done -> the reward known and every container gone); `peer(...)` times
  `docker cp tests/ /tests`, `mkdir -p /logs/verifier`, `docker exec bash /tests/test.sh`,
  `docker exec cat` of the reward file and `docker rm -f`. Both go through the same docker SDK
  client; neither raises for what the task does, and both always remove their containers.
- `peer` reads `reward.json`, else `reward.txt`, and parses it with the verifier's own
  `parse_reward`, so a disagreement between the sides is about where the tests ran, never about
  parsing.
"""

from __future__ import annotations

import io
import tarfile
import time

from sandbox_workers.base import MIB
from sandbox_workers.harbor_box import HarborBox
from sandbox_workers.harbor_images import TOOLCHAIN_MOUNT
from sandbox_workers.harbor_verify import REWARD_DIR, parse_reward, verify_episode

AGENT_SCRIPT = "/tmp/.rlbus-agent-script.sh"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _tar(at: str, files: dict[str, bytes]) -> bytes:
    """A tar of `files` under directory `at` (relative to the archive root), with its directories."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        names = [f"{at}/{rel}" for rel in sorted(files)]
        dirs = sorted({"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for rel in sorted(files):
            data = files[rel]
            info = tarfile.TarInfo(f"{at}/{rel}")
            info.size, info.mode = len(data), 0o755 if rel.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# ---------------------------------------------------------------- ours: rlbus's verification
def ours(task, job, oracle: bool, run_id: str = "bench-harbor") -> dict:
    """One attempt verified by rlbus: {reward, status, s, start_s, reset_s, remove_s, agent_s, timings}."""
    t0 = time.perf_counter()
    box = HarborBox.create(job.spec, run_id, f"ep-{time.time_ns()}")
    try:
        if oracle:
            box.put_tree("/solution", task.solution)
            box.write_file(AGENT_SCRIPT, task.oracle.encode())
            box.exec(["bash", AGENT_SCRIPT], task.agent_timeout_s)
        agent_s = time.perf_counter() - t0
        t1 = time.perf_counter()  # the agent is done: the verification's clock starts
        run = verify_episode(job, box.id)
    finally:
        t2 = time.perf_counter()
        box.remove()
        remove_s = time.perf_counter() - t2
    s = time.perf_counter() - t1
    tm = {k: round(v, 4) for k, v in run.timings.items()}
    return {
        "reward": run.reward,
        "status": run.status,
        "s": s,
        "start_s": tm.get("start_s"),
        "reset_s": tm.get("reset_s"),
        "episode_remove_s": remove_s,
        "agent_s": agent_s,
        "timings": tm,
    }


# ---------------------------------------------------------------- peer: Harbor's own way
def _cat(container, path: str) -> bytes | None:
    r = container.exec_run(["cat", path])
    return r.output if r.exit_code == 0 else None


def peer_env(client, task, image: str) -> dict[str, str]:
    """test.sh's environment on the peer: the toolchain first on the image's own PATH, its site
    on PYTHONPATH (the pytest rlbus mounts too), plus the task's `[verifier].env`."""
    env = dict(e.split("=", 1) for e in (client.images.get(image).attrs["Config"].get("Env") or []) if "=" in e)
    path = f"{TOOLCHAIN_MOUNT}/bin:{env.get('PATH', BASE_PATH)}"
    return {"PATH": path, "PYTHONPATH": f"{TOOLCHAIN_MOUNT}/site", **task.verifier_env}


def peer(client, task, image: str, toolchain: str, env: dict[str, str], oracle: bool) -> dict:
    """One attempt verified as Harbor does, in the agent's own container:
    {reward, status, s, start_s, reset_s, agent_s, test_exit}."""
    t0 = time.perf_counter()
    c = client.containers.run(
        image,
        ["sleep", "infinity"],
        detach=True,
        network_mode="none",
        nano_cpus=int(task.cpus * 1e9),
        mem_limit=task.memory_mb * MIB,
        memswap_limit=task.memory_mb * MIB,
        volumes={toolchain: {"bind": TOOLCHAIN_MOUNT, "mode": "ro"}},
        labels={"rlbus.bench": "harbor-peer"},
    )
    start_s = time.perf_counter() - t0
    user = task.agent_user if task.agent_user not in ("", "root") else "0:0"
    try:
        if oracle:
            c.put_archive("/", _tar("solution", task.solution))
            c.put_archive("/", _tar("tmp", {AGENT_SCRIPT.rsplit("/", 1)[1]: task.oracle.encode()}))
            c.exec_run(["bash", AGENT_SCRIPT], user=user)
        agent_s = time.perf_counter() - t0
        t1 = time.perf_counter()  # the agent is done: the verification's clock starts
        c.put_archive("/", _tar("tests", dict(task.tests)))
        c.exec_run(["mkdir", "-p", REWARD_DIR])
        test = c.exec_run(["bash", "/tests/test.sh"], environment=env)
        comps, status = None, "no_reward_file"
        for name in ("reward.json", "reward.txt"):
            data = _cat(c, f"{REWARD_DIR}/{name}")
            if data is not None:
                comps, status, _ = parse_reward(name, data)
                break
    finally:
        t2 = time.perf_counter()
        c.remove(force=True)
        reset_s = time.perf_counter() - t2
    return {
        "reward": comps["reward"] if comps else 0.0,
        "status": status,
        "s": time.perf_counter() - t1,
        "start_s": start_s,
        "reset_s": reset_s,
        "agent_s": agent_s,
        "test_exit": test.exit_code,
    }
