"""The Harbor cases of the fault matrix (`bench/faults.py`): fixtures, configs, a private engine.

Guarantees:
- `write_fixtures(root, case)` writes small Harbor task directories under `root` (copies of
  examples/harbor/hello-file, edited per case; never into examples/) and one gold script per
  task for the scripted engine (`rlbus tasks scripts`' format); `harbor_config(root, case)` is
  that case's tiny run config (scripted engine, `[sandbox] backend = "docker"`, 3 minutes).
- `PrivateEngine` is a second, private dockerd (its own socket, data root, exec root, no
  bridge, no iptables) that the engine-restart case stops and starts again exactly the way it
  started it, so the restart never touches the shared engine other people's containers run
  on. `stop()` always leaves nothing of it running, mounted or on disk.
- Each `*_check` reads only files, the run store and `docker` (the engine the run used).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path

from bench.fault_run import ROOT, FaultRun

HELLO = ROOT / "examples" / "harbor" / "hello-file"
TOOLCHAIN_IMAGE = "rlbus-repo-sandbox:latest"
PRIVATE_IMAGES = ("python:3.11-slim", "rlbus-sandbox:latest", TOOLCHAIN_IMAGE)
"""What the private engine needs (copied from the shared engine: no registry here)."""
BUILD_HANG_TIMEOUT_S = 5
TEST_HANG_TIMEOUT_S = 5

HARBOR_CONFIG = """
[run]
max_minutes = 3
drain_seconds = 20

[model]
tokenizer = "bpe"
hidden_size = 32
num_layers = 1
num_heads = 2
max_position_embeddings = 16384

[sft]
enabled = false

[sampler]
group_size = 2
max_inflight_tasks = 4
publish_batch = 2

[sampler.domains.tb]
kind = "harbor"
tasks = "{root}/tb/*"
max_turns = 6
max_tokens = 4096
tool_format = "tags"
[sampler.domains.tb.params]
eval_tasks = ["hello-c"]
{extra_domains}
[harbor]
allow_internet = false
verify_in = "same"
check_at_start = {check_at_start}

[rollout]
engine = "scripted"
scripted = {{ dir = "{root}/scripts" }}
batch_tasks = 2
max_context_tokens = 12000
observation_chars = 4000
ack_wait_s = 120

[sandbox]
backend = "docker"

[verifier]
concurrency = 2
ack_wait_s = 120

[learner]
groups_per_step = 2
step_window_s = 2.0

[scheduler.curriculum]
enabled = false

[scheduler.eval]
every_versions = 1000
timeout_s = 120
"""
"""examples/harbor.toml made small: three hello-file copies (one held out), scripted gold
oracles, a 3-minute run."""

HANG_DOMAIN = """
[sampler.domains.hang]
kind = "harbor"
tasks = "{root}/hang/*"
max_turns = 6
max_tokens = 4096
tool_format = "tags"
"""


# -- fixtures ---------------------------------------------------------------------------


def _copy_hello(dest: Path, name: str) -> Path:
    task = dest / name
    shutil.copytree(HELLO, task)
    return task


def _set_toml(task: Path, old: str, new: str) -> None:
    toml = task / "task.toml"
    text = toml.read_text()
    if old not in text:
        raise ValueError(f"{toml}: no {old!r} to replace (examples/harbor/hello-file changed?)")
    toml.write_text(text.replace(old, new))


def write_fixtures(root: Path, case: str) -> dict:
    """The case's task directories and gold scripts under `root`; what was written."""
    from rlbus.commands.tasks_harbor import gold_steps
    from rollout_workers.engines.scripted_engine import write_script
    from schemas.harbor_task import read_task

    tb = root / "tb"
    tb.mkdir(parents=True, exist_ok=True)
    tasks = [_copy_hello(tb, n) for n in ("hello-a", "hello-b", "hello-c")]
    out: dict = {"root": str(root)}
    if case == "build-hang":
        marker = f"rlbus-build-hang-{secrets.token_hex(4)}"
        hang = _copy_hello(tb, "build-hang")
        (hang / "environment" / "Dockerfile").write_text(
            f"FROM python:3.11-slim\nRUN echo {marker} && sleep 600\nWORKDIR /app\n"
        )
        _set_toml(hang, "build_timeout_sec = 300", f"build_timeout_sec = {BUILD_HANG_TIMEOUT_S}")
        tasks.append(hang)
        out["marker"] = marker
    if case == "test-hang":
        hang = _copy_hello(root / "hang", "test-hang")
        (hang / "tests" / "test.sh").write_text("#!/bin/bash\n# never exits, never writes a reward\nsleep infinity\n")
        _set_toml(hang, "[verifier]\ntimeout_sec = 60", f"[verifier]\ntimeout_sec = {TEST_HANG_TIMEOUT_S}")
        tasks.append(hang)
    for path in tasks:
        t = read_task(path)
        write_script(root / "scripts", t.task_id, gold_steps(t.solution))
    out["tasks"] = [p.name for p in tasks]
    return out


def harbor_config(root: Path, case: str) -> str:
    """The run config of harbor case `case` over its fixtures under `root`."""
    return HARBOR_CONFIG.format(
        root=root,
        extra_domains=HANG_DOMAIN.format(root=root) if case == "test-hang" else "",
        # test-hang: the oracle check would time out too and disable the task at start; off, the
        # run verifies it (the images are built by `prepare` instead)
        check_at_start="false" if case == "test-hang" else "true",
    )


def prepare(case: str):
    """`Case.prepare` of harbor case `case`: fixtures, config, check cache, images (and the engine)."""

    def run_prepare(run: FaultRun, ctx: dict) -> None:
        from sandbox_workers.images import ensure_image

        root = run.tmp / f"harbor-{case}"
        ctx["fixtures"] = write_fixtures(root, case)
        run.config_file.write_text(harbor_config(root, case))
        ctx["checks"] = root / "checks"  # checks run fresh for every case run, on its own engine
        env = {"RLBUS_HARBOR_CHECKS": str(ctx["checks"])}
        ensure_image()  # the docker backend's image (`rlbus up` refuses to start without it)
        if case == "engine-restart":
            engine = ctx["engine"] = PrivateEngine().start()
            engine.load(PRIVATE_IMAGES)
            env["DOCKER_HOST"] = engine.host
        if case == "test-hang":
            _build_task_images(root)
        run.env = {**(run.env or {}), **env}

    return run_prepare


def _build_task_images(root: Path) -> None:
    from sandbox_workers.harbor_images import ensure_task_image
    from schemas.harbor_task import find_tasks, read_task

    for path in find_tasks(f"{root}/*/*"):
        ensure_task_image(read_task(path), {})


def cleanup(run: FaultRun, ctx: dict) -> None:
    if ctx.get("engine"):
        ctx["engine"].stop()


# -- the private engine -----------------------------------------------------------------


class PrivateEngine:
    """A dockerd of our own (see the module guarantees)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rlbus-de-", dir="/tmp"))  # short: unix socket paths
        self.sock = self.root / "d.sock"
        (self.root / "daemon.json").write_text("{}")  # not /etc/docker/daemon.json
        self.argv = [
            "dockerd",
            "--config-file",
            str(self.root / "daemon.json"),
            "-H",
            f"unix://{self.sock}",
            "--data-root",
            str(self.root / "data"),
            "--exec-root",
            str(self.root / "x"),
            "--pidfile",
            str(self.root / "dockerd.pid"),
            "--bridge",
            "none",
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
            "--cgroup-parent",
            f"/rlbus-fault-docker-{self.root.name}",
        ]
        self.log = self.root / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return f"unix://{self.sock}"

    def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "-H", self.host, *args], capture_output=True, text=True, **kw)

    def answers(self) -> bool:
        return self.docker("info", timeout=20).returncode == 0

    def start(self, timeout: float = 60) -> PrivateEngine:
        """Start dockerd with `self.argv` and wait until it answers (RuntimeError with the log's tail)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.answers():
                return self
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-1500:]
        self.stop()
        raise RuntimeError(f"the private dockerd ({' '.join(self.argv)}) did not come up:\n{tail}")

    def load(self, images: tuple[str, ...]) -> None:
        """Copy `images` from the shared engine (`docker save | docker -H ... load`)."""
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        loaded = subprocess.run(["docker", "-H", self.host, "load"], stdin=save.stdout, capture_output=True, text=True)
        save.stdout.close()
        if save.wait() != 0 or loaded.returncode != 0:
            raise RuntimeError(f"copying {images} to the private engine failed: {loaded.stderr[-500:]}")

    def _down(self, timeout: float = 60) -> None:
        """SIGTERM (what a service stop sends: the engine stops its containers, then itself)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> str:
        """Stop the engine, start it again the way it was started; what happened."""
        pid, t0 = self.proc.pid, time.monotonic()
        running = len(self.docker("ps", "-q").stdout.split())
        self._down()
        down = time.monotonic() - t0
        self.start()
        return (
            f"private dockerd (pid {pid}, {running} containers running) stopped (SIGTERM, {down:.1f}s) "
            f"and started again (pid {self.proc.pid}, answering {time.monotonic() - t0:.1f}s after the stop)"
        )

    def stop(self) -> None:
        """Stop it for good and remove everything it left (mounts, data)."""
        try:
            self._down()
        finally:
            mounts = [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines() if str(self.root) in ln]
            for m in sorted(mounts, key=len, reverse=True):
                subprocess.run(["umount", "-l", m], capture_output=True)
            shutil.rmtree(self.root, ignore_errors=True)


# -- injections -------------------------------------------------------------------------


def restart_mid_episode(run: FaultRun, ctx: dict) -> str:
    """Wait until one of the run's episode containers runs (an episode in flight), then restart the engine."""
    engine: PrivateEngine = ctx["engine"]
    deadline, seen = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        seen = len(engine.docker("ps", "-q", "--filter", f"label=rlbus.harbor.run={run.run_id}").stdout.split())
        if seen:
            break
        time.sleep(0.2)
    ctx["episodes_running_at_fault"] = seen
    return engine.restart()


# -- checks -----------------------------------------------------------------------------


def rewards_by(run: FaultRun) -> dict:
    """Rewards grouped `purpose/domain/status` with their count and min/max reward (run.db)."""
    db = run.run_path / "run.db"
    if not db.exists():
        return {}
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT purpose, domain, status, COUNT(*), MIN(reward), MAX(reward) FROM rewards "
            "GROUP BY purpose, domain, status"
        ).fetchall()
    return {f"{p}/{d}/{s}": {"n": n, "min": lo, "max": hi} for p, d, s, n, lo, hi in rows}


def _containers(host: str | None, *filters: str) -> list[str]:
    cmd = ["docker", *(["-H", host] if host else []), "ps", "-aq"]
    for f in filters:
        cmd += ["--filter", f]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.split()


def _train_zeros(rewards: dict) -> int:
    return sum(v["n"] for k, v in rewards.items() if k.startswith("train/") and (v["min"] or 0.0) < 1.0)


def engine_restart_check(run: FaultRun, ctx: dict) -> dict:
    """Every training reward of the gold oracles is 1 (an engine failure is never a 0), and the
    containers the run's episodes left in the private engine."""
    rewards = rewards_by(run)
    host = ctx["engine"].host
    return {
        "episodes_running_at_fault": ctx.get("episodes_running_at_fault"),
        "rewards": rewards,
        "train_rewards_below_1": _train_zeros(rewards),
        "containers_left": len(_containers(host, f"label=rlbus.harbor.run={run.run_id}")),
    }


def build_hang_check(run: FaultRun, ctx: dict) -> dict:
    """The check cache's record of the hanging build, the console's `disabled` line, and any
    build container still running the hanging RUN step (`docker ps -a`, must be none)."""
    record = {}
    for path in Path(ctx["checks"]).glob("build-hang-*.json"):
        record = json.loads(path.read_text())
    marker = ctx["fixtures"]["marker"]
    rows = subprocess.run(
        ["docker", "ps", "-a", "--no-trunc", "--format", "{{.ID}} {{.Status}} {{.Command}}"],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    lines = run.console().splitlines()  # rich wraps the line at the console's width: take the next one too
    disabled = [
        " ".join(x.strip() for x in lines[i : i + 2])
        for i, ln in enumerate(lines)
        if ln.strip().startswith("disabled build-hang")
    ]
    rewards = rewards_by(run)
    return {
        "check_reason": (record.get("reason") or "")[:200],
        "check_seconds": record.get("seconds"),
        "passed_build_timeout": "passed build_timeout_sec" in (record.get("reason") or ""),
        "console_disabled": disabled[:1],
        "build_containers_left": [r[:160] for r in rows if marker in r],
        "sleep_600_containers": len([r for r in rows if "sleep 600" in r]),
        "rewards": rewards,
        "train_rewards_below_1": _train_zeros(rewards),
    }


def test_hang_check(run: FaultRun, ctx: dict) -> dict:
    """The hanging task's rewards (all `timeout`, 0) against the good tasks' (all `ok`, 1), how
    long each verification took, and containers left."""
    rewards = rewards_by(run)
    hang = {k: v for k, v in rewards.items() if k.startswith("train/hang/")}
    good = {k: v for k, v in rewards.items() if k.startswith("train/tb/")}
    db = run.run_path / "run.db"
    secs = []
    if db.exists():
        with sqlite3.connect(db) as conn:
            secs = [r[0] for r in conn.execute("SELECT sandbox_seconds FROM rewards WHERE domain = 'hang'")]
    return {
        "rewards": rewards,
        "hang_all_timeout_0": bool(hang)
        and set(hang) == {"train/hang/timeout"}
        and hang["train/hang/timeout"]["max"] == 0.0,
        "good_all_ok_1": bool(good) and set(good) == {"train/tb/ok"} and good["train/tb/ok"]["min"] == 1.0,
        "hang_verify_s": [round(min(secs), 1), round(max(secs), 1)] if secs else None,
        "containers_left": len(_containers(None, f"label=rlbus.harbor.run={run.run_id}")),
    }


def skip_reason_harbor() -> str | None:
    """What this machine lacks for the harbor cases beyond a Docker engine (the toolchain image)."""
    out = subprocess.run(["docker", "image", "inspect", TOOLCHAIN_IMAGE], capture_output=True)
    if out.returncode != 0:
        return f"needs the Harbor verifier's toolchain image {TOOLCHAIN_IMAGE}: rlbus sandbox build-image --repo"
    return None


def skip_reason_private_engine() -> str | None:
    """Why a private dockerd cannot run here (no binary, not root), or None."""
    if not shutil.which("dockerd"):
        return "needs the dockerd binary to run a private engine (the shared one is never restarted)"
    if os.geteuid() != 0:
        return "needs root to run a private dockerd"
    return None
