"""The surroundings a fault case breaks: a tmpfs under the store, a local 3-node NATS
cluster, PostgreSQL, the Docker engine; and the configs of the cases that need more than
the base run.

Guarantees:
- `skip_reason(needs)` names what this machine lacks for a case (root, PostgreSQL at
  127.0.0.1:5432, a Docker engine), or None; cases skip with it rather than fail.
- `TmpfsStore` mounts a small tmpfs where the run's JetStream store will live, fills it
  (leaving under 1 MiB) and frees it; `unmount()` always leaves nothing mounted.
- `LocalCluster` is three real nats-server processes routed as one JetStream cluster
  (each its own store); `kill(i)` is `kill -9` of one node, `restart(i)` brings it back on
  its store, `stop()` stops all by pid.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from bench.fault_run import BASE_CONFIG, FaultRun
from bus.server import EmbeddedNats, free_port

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"

SANDBOX_CONFIG = (
    BASE_CONFIG.replace("max_minutes = 1.5", "max_minutes = 3")
    .replace("hidden_size = 32\nnum_layers = 1", "hidden_size = 64\nnum_layers = 2")
    .replace("max_steps = 30\nseconds = 30", "max_steps = 300\nseconds = 90")
    + """
[sampler.domains.tool_calc]
weight = 1.0
sft_weight = 1.0
max_tokens = 24
max_turns = 2
[sandbox]
remote = true
timeout_s = 5.0
"""
)
"""Tool episodes through the sandbox service (`rlbus worker sandbox`, started by `up` when remote)."""

DOCKER_CONFIG = SANDBOX_CONFIG.replace("remote = true", 'backend = "docker"\nwarm_pool = 1')
"""Tool episodes in Docker sandboxes (the engine restarts under them)."""

SLOW_VERIFIER_CONFIG = (
    BASE_CONFIG.replace("max_minutes = 1.5", "max_minutes = 3")
    + """
[sampler.domains.arith]
weight = 0.67
[sampler.domains.slow]
kind = "sleep"
weight = 0.33
sft_weight = 0.0
params = { seconds = 0.0, verify_seconds = 30.0 }
"""
)
"""Arithmetic plus a domain whose verifier takes 30 s a call (longer than the verifier's ack_wait)."""

FLOOD_ANSWER = "<answer>9**9**9**9</answer>"
"""An answer that holds the scorer's interpreter (sympy's eval of a tower of powers): on 45ce3d4 it
froze the verifier worker until the watchdog killed it, and its redelivery froze the next one."""
ANSWER_FLOOD_CONFIG = (
    BASE_CONFIG.replace("max_minutes = 1.5", "max_minutes = 3")
    .replace('tokenizer = "char"', 'tokenizer = "bpe"')
    .replace("[rollout]\n", f'[rollout]\nengine = "null"\nnull_answer = "{FLOOD_ANSWER}"\n')
    + """
[verifier]
answer_cpu_s = 1.0
answer_wall_s = 3.0
[sampler.domains.arith]
weight = 0.5
[sampler.domains.rg-countdown]
kind = "reasoning_gym"
weight = 0.5
sft_weight = 0.0
max_tokens = 16
params = { dataset = "countdown" }
"""
)
"""Every sample of every task is `FLOOD_ANSWER` (the null engine's fixed answer): half the tasks
are reasoning-gym countdown, whose scorer parses the answer with sympy, so each of their answers
runs into the answer pool's limits (`answer_limit`, reward 0); the other half are arithmetic. A BPE
tiny model: the null engine's byte-valued prompt ids need a vocabulary of at least 256 (the char one
has ~100)."""


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def skip_reason(needs: tuple[str, ...]) -> str | None:
    """What this machine lacks for a case, or None."""
    if "root" in needs and os.geteuid() != 0:
        return "needs root (mount a tmpfs / restart a system service)"
    if "postgres" in needs and not (_port_open(5432) and shutil.which("pg_ctlcluster")):
        return "needs PostgreSQL at 127.0.0.1:5432 and pg_ctlcluster to restart it"
    if "docker" in needs:
        from sandbox_workers.factory import docker_available

        if not docker_available():
            return "needs a Docker engine (none answers: `docker info`)"
    if "harbor" in needs or "dockerd" in needs:
        from bench import fault_harbor

        checks = {"harbor": fault_harbor.skip_reason_harbor, "dockerd": fault_harbor.skip_reason_private_engine}
        for need, why in checks.items():
            reason = why() if need in needs else None
            if reason:
                return reason
    return None


class TmpfsStore:
    """A small tmpfs mounted at the run's store folder, to be filled by another writer."""

    def __init__(self, path: Path, size_mb: int = 1024):
        self.path, self.size_mb, self.mounted = path, size_mb, False
        self.filler = path / "filler.bin"

    def mount(self) -> TmpfsStore:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)], check=True)
        self.mounted = True
        return self

    def fill(self) -> str:
        """Take all but 512 KiB of the free space (another process filling the disk)."""
        free = shutil.disk_usage(self.path).free - 512 * 1024
        with self.filler.open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(0, free))
        return f"filled the store's disk ({self.size_mb} MiB tmpfs) with {free / 2**20:.0f} MiB, leaving 0.5 MiB"

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False


class LocalCluster:
    """Three nats-server processes routed into one JetStream cluster on loopback."""

    def __init__(self, root: Path, n: int = 3):
        self.root = root
        self.ports = [free_port() for _ in range(n)]
        self.routes = [free_port() for _ in range(n)]
        self.nodes: list[EmbeddedNats | None] = [None] * n

    @property
    def urls(self) -> str:
        """The client URLs, comma-separated (what run.nats_url takes)."""
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def _config(self, i: int) -> str:
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != i)
        return (
            f"server_name: n{i}\n"
            f"cluster {{ name: rlbus-faults, listen: 127.0.0.1:{self.routes[i]}, routes: [{routes}] }}\n"
        )

    def _start(self, i: int, wait: bool) -> None:
        node = EmbeddedNats(self.root / f"n{i}", port=self.ports[i], config=self._config(i))
        if wait:
            node.start(timeout=30)
        else:  # the first nodes cannot report JetStream ready before a quorum exists
            node.store_dir.mkdir(parents=True, exist_ok=True)
            try:
                node.start(timeout=3)
            except TimeoutError:
                pass
        self.nodes[i] = node

    def start(self) -> LocalCluster:
        for i in range(len(self.ports)):
            self._start(i, wait=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(n and n._jetstream_ready() for n in self.nodes):
            time.sleep(0.5)
        asyncio.run(self._meta_leader(deadline))
        return self

    async def _meta_leader(self, deadline: float) -> None:
        """Until the cluster's JetStream answers (a meta leader is elected)."""
        import nats

        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(self.urls.split(","), connect_timeout=2, max_reconnect_attempts=0)
                try:
                    await nc.jetstream(timeout=2).account_info()
                    return
                finally:
                    await nc.close()
            except Exception:  # noqa: BLE001 - not ready yet
                await asyncio.sleep(0.5)
        raise TimeoutError(f"the local NATS cluster {self.urls} has no JetStream leader after 60 s")

    def kill(self, i: int) -> int:
        node = self.nodes[i]
        os.kill(node.pid, signal.SIGKILL)
        node.proc.wait(10)
        return node.port

    def restart(self, i: int) -> None:
        self._start(i, wait=True)

    def stop(self) -> None:
        for node in self.nodes:
            if node is not None:
                node.stop()


def restart_postgres() -> str:
    """`pg_ctlcluster <version> main restart` of the local server (fast shutdown: sessions are cut)."""
    ver = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True, check=True).stdout.split()[0]
    t0 = time.monotonic()
    subprocess.run(["pg_ctlcluster", ver, "main", "restart", "-m", "fast"], check=True, capture_output=True)
    return f"pg_ctlcluster {ver} main restart (down and up in {time.monotonic() - t0:.1f}s)"


def pg_rows(run: FaultRun) -> dict:
    """The run's reward rows in PostgreSQL against the training rewards the launcher saw."""
    import sqlalchemy as sa

    engine = sa.create_engine(PG_URL)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT count(*), count(DISTINCT msg_id) FROM rewards WHERE run_id = :r AND purpose = 'train'"),
            {"r": run.run_id},
        ).one()
    engine.dispose()
    seen = sum(int(d.get("rewards", 0)) for d in (run.summary().get("domains") or {}).values())
    return {"sql_reward_rows": rows[0], "sql_distinct": rows[1], "rewards_seen": seen, "sql_missing": seen - rows[1]}


def restart_docker() -> str:
    """Stop dockerd (SIGTERM, as a service restart does) and start it again."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline and subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True).returncode == 0
    ):
        time.sleep(0.5)
    with open("/tmp/dockerd.log", "ab") as log:  # the engine keeps its own copy of the descriptor
        subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while time.monotonic() < deadline + 60:
        if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            break
        time.sleep(1)
    return f"dockerd (pid {pids}) stopped and started again"


def docker_leftovers(run: FaultRun) -> dict:
    """Containers of this run still present after it stopped (must be none)."""
    out = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=rlbus.run_id={run.run_id}"], capture_output=True, text=True
    )
    return {"containers_left": len(out.stdout.split())}
