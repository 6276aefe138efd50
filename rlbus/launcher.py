"""`rlbus up`: prepare the model, start every role as its own OS process, watch, stop.

Guarantees:
- Each role runs as `rlbus worker ROLE` in its own process (own session, log file under
  `<run>/logs/`); a worker that dies while the run is live is restarted (up to
  `MAX_RESTARTS` per role, after which the run fails).
- Stop (limits or Ctrl-C) drains in order: the sampler stops first, the pipeline gets
  `run.drain_seconds` to finish in-flight work, then rollout and verifier, then the
  learner (which records what it still holds), then the scheduler (which
  evaluates the newest version), and last the tracker, which runs only when
  `tracking.backends` lists one (a missing tracking package stops `up` before anything
  starts, naming the extra).
- Everything of a run lives under `<run-dir>/<run_id>/`; `summary.json` is kept current
  during the run and completed (with per-message accounting) at the end, next to
  `reward_curve.png`. Its `domains` gives each domain's training rewards (count, mean,
  verifier statuses) and the tool calls its episodes made, read from the rewards stream
  by an ordered consumer (consumes nothing).
- KV `status` = "stop-requested" (written by the scheduler with `scheduler.plateau.stop`)
  stops the run like a limit (stop_reason `stop_requested`); summary.json carries the
  scheduler's `plateau` verdict and `released_version` (KV `plateau`, `release.latest`).
- Exit code 0 when the run stopped at its limits (restarts included), non-zero only
  when it failed.
- Sandboxes fail closed: before anything else (no run folder, no server, no SFT) the
  configured sandbox backend is probed; where it cannot isolate (no usable bubblewrap)
  and `sandbox.allow_degraded` is false, `up` prints the reason and the fix and exits 1.
  When degraded mode is allowed, the console says so in red at start and after the
  final summary; summary.json's `sandbox_isolation` is "bwrap", "docker" or "degraded".
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import structlog
from rich.console import Console
from rich.live import Live

from bus.conn import connect, ensure_topology
from bus.server import EmbeddedNats
from bus.subjects import Registry
from rlbus.accounting import account
from rlbus.live import Snapshot, line, render
from rlbus.monitor import Monitor, summary_dict
from rlbus.plots import reward_curve
from schemas.config import RunConfig, dump_config

log = structlog.get_logger()
MAX_RESTARTS = 5
START_ORDER = ("learner", "scheduler", "tracker", "verifier", "rollout", "sampler")
STARTS_IF = {"tracker": lambda cfg: bool(cfg.tracking.backends)}
"""Roles started only when the config asks for them (every other role always starts)."""


def roles_to_start(cfg: RunConfig) -> list[str]:
    """START_ORDER without the optional roles this config leaves out (no tracker without backends)."""
    return [role for role in START_ORDER if STARTS_IF.get(role, lambda _: True)(cfg)]


DEGRADED_WARNING = ("[bold red]sandbox isolation: DEGRADED: tool calls and tests run WITHOUT network or "
                    "filesystem isolation (rlimits only), because sandbox.allow_degraded=true. "
                    "Install bubblewrap (apt-get install -y bubblewrap) to isolate them.[/]")


def check_engine(cfg: RunConfig, console: Console) -> bool:
    """Whether the configured rollout engine can start in this Python (before SFT, before NATS)."""
    from rollout_workers.engines import VLLMMissing, require_engine

    try:
        require_engine(cfg.rollout.engine)
    except VLLMMissing as exc:
        console.print(f"[bold red]rlbus up: {exc}[/]")
        return False
    return True


def check_tokenizer(cfg: RunConfig, console: Console) -> bool:
    """Whether the run's tokenizer encodes every character its domains produce (before SFT,
    before NATS); False after printing the domains and characters it cannot encode."""
    from rlbus.tokenizer_check import run_tokenizer, template_problems, tokenizer_problems

    tok = run_tokenizer(cfg)
    problems = tokenizer_problems(cfg, tok)
    for problem in problems:
        console.print(f"rlbus up: {problem}; use a tokenizer that covers them (model.tokenizer = 'bpe' "
                      "encodes any text)", style="bold red", markup=False, highlight=False, soft_wrap=True)
    missing = template_problems(cfg, tok)
    for problem in missing:
        console.print(f"rlbus up: {problem}", style="bold red", markup=False, highlight=False, soft_wrap=True)
    return not problems and not missing


def check_sandbox(cfg: RunConfig, console: Console) -> str | None:
    """The isolation this run's sandboxes get (probed with one real sandbox), or None, after
    printing the reason and the fix, when they cannot isolate and degraded mode is not allowed."""
    from sandbox_workers.base import SandboxRefused
    from sandbox_workers.factory import probe_isolation

    sc = cfg.sandbox
    try:  # remote: tool calls go to the sandbox service; the scheduler's evaluation runs local process sandboxes
        isolation = probe_isolation("process" if sc.remote else sc.backend, sc.allow_degraded)
    except SandboxRefused as exc:
        console.print(f"[bold red]rlbus up: {exc}[/]", highlight=False)
        return None
    if isolation == "degraded":
        console.print(DEGRADED_WARNING, highlight=False)
    return isolation


def check_tracking(cfg: RunConfig, console: Console) -> bool:
    """False, after printing which extra to install, when a configured tracking backend's
    package is missing (the tracker would only crash-loop); True otherwise."""
    from rlbus.tracking_backends import TrackingUnavailable, check_installed

    try:
        check_installed(cfg.tracking.backends)
    except TrackingUnavailable as exc:
        console.print(f"rlbus up: {exc}", style="bold red", markup=False, highlight=False, soft_wrap=True)
        return False
    return True


def new_run_id(config_path: str) -> str:
    """`<config stem>-<UTC time>`."""
    return f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def prepare_model(cfg: RunConfig, run_path: Path, console: Console) -> Path:
    """Build (or take) the base model, warm-start it with SFT, leave it at <run>/model/start."""
    start = run_path / "model" / "start"
    if start.exists():
        return start
    base = Path(cfg.model.path) if cfg.model.path else run_path / "model" / "base"
    if not cfg.model.path:
        from rlbus.tiny_model import build_tiny_model

        build_tiny_model(base, arch=cfg.model.arch, hidden_size=cfg.model.hidden_size,
                         num_layers=cfg.model.num_layers, num_heads=cfg.model.num_heads, seed=cfg.run.seed,
                         tokenizer=cfg.model.tokenizer, max_position_embeddings=cfg.model.max_position_embeddings)
        console.print(f"built tiny {cfg.model.arch} model ({cfg.model.tokenizer} tokenizer) at {base}")
    if not cfg.sft.enabled:
        shutil.copytree(base, start)
        return start
    from learner.sft import run_sft
    from producers.demos import sft_batches

    batches = sft_batches(cfg, cfg.sft.batch_size)
    console.print(f"SFT warm start for up to {cfg.sft.seconds:.0f}s ...")
    stats = run_sft(base, start, batches, seconds=cfg.sft.seconds, max_steps=cfg.sft.max_steps, lr=cfg.sft.lr,
                    seed=cfg.run.seed, threads=cfg.sft.threads, progress=console.is_terminal)
    console.print(f"SFT done: {stats}")
    return start


class Supervisor:
    """Worker processes of one run: start, restart, stop by PID."""

    def __init__(self, run_path: Path, config_file: Path, nats_url: str, run_id: str, run_dir: Path):
        self.run_path, self.config_file, self.nats_url, self.run_id, self.run_dir = (
            run_path, config_file, nats_url, run_id, run_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.server_pid: int | None = None
        self.restarts: dict[str, int] = {}
        self.stopping: set[str] = set()
        (run_path / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, role: str) -> None:
        """Start `rlbus worker ROLE` for this run."""
        cmd = [sys.executable, "-m", "rlbus.cli", "worker", role, "--config", str(self.config_file),
               "--nats-url", self.nats_url, "--run-id", self.run_id, "--run-dir", str(self.run_dir)]
        logf = open(self.run_path / "logs" / f"{role}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_LAUNCHER_PID=str(os.getpid()))
        self.procs[role] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=env)
        logf.close()
        self.write_state()

    def write_state(self) -> None:
        """Record the server URL and every pid in `<run>/run.json` (for `rlbus dlq`, status, resume)."""
        state = {"run_id": self.run_id, "nats_url": self.nats_url, "launcher_pid": os.getpid(),
                 "server_pid": self.server_pid, "workers": {role: p.pid for role, p in self.procs.items()},
                 "updated_at": time.time()}
        tmp = self.run_path / "run.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.run_path / "run.json")

    def poll(self) -> str | None:
        """Restart crashed workers; return a failure reason when one crash-loops."""
        for role, proc in list(self.procs.items()):
            if proc.poll() is None or role in self.stopping:
                continue
            self.restarts[role] = self.restarts.get(role, 0) + 1
            log.warning("launcher.worker_exited", role=role, code=proc.returncode, restarts=self.restarts[role])
            if self.restarts[role] > MAX_RESTARTS:
                return f"{role} exited {self.restarts[role]} times (last code {proc.returncode}); see {self.run_path}/logs/{role}.log"
            self.start(role)
        return None

    def signal(self, role: str) -> None:
        """Ask a worker to finish (SIGTERM)."""
        self.stopping.add(role)
        proc = self.procs.get(role)
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    async def wait(self, role: str, timeout: float) -> None:
        """Wait for a signalled worker; SIGKILL after `timeout`."""
        proc = self.procs.get(role)
        if not proc:
            return
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            log.warning("launcher.worker_killed", role=role)
            proc.kill()
            proc.wait(5)

    async def stop(self, roles, timeout: float) -> None:
        """Signal several workers, then wait for all of them."""
        for r in roles:
            self.signal(r)
        for r in roles:
            await self.wait(r, timeout)

    def kill_all(self) -> None:
        """Last resort: kill every worker still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()


class RunLoop:
    """One supervised run, in phases: watch until a stop reason, drain, account, shut down."""

    def __init__(self, cfg: RunConfig, run_path: Path, t0: float, console: Console, sup: Supervisor,
                 mon: Monitor, snap: Snapshot):
        self.cfg, self.run_path, self.t0, self.console = cfg, run_path, t0, console
        self.sup, self.mon, self.snap = sup, mon, snap
        self.summary_path = run_path / "summary.json"
        self.interrupted = asyncio.Event()
        self.live = Live(render(snap), console=console, refresh_per_second=2, transient=False) \
            if console.is_terminal else None
        self._last_line = 0.0
        reserve = cfg.run.drain_seconds + 25.0
        self.deadline = t0 + cfg.run.max_minutes * 60 - reserve if cfg.run.max_minutes else None

    async def _refresh(self) -> None:
        await self.mon.refresh(time.monotonic() - self.t0)
        if self.live:
            self.live.update(render(self.snap))
        elif time.monotonic() - self._last_line > 10:
            self.console.print(line(self.snap), highlight=False)
            self._last_line = time.monotonic()

    def _stop_reason(self, failure: str | None) -> str | None:
        if failure:
            return "failed"
        if self.interrupted.is_set():
            return "interrupted"
        if self.mon.stop_requested:
            return "stop_requested"  # e.g. scheduler.plateau.stop
        if self.cfg.run.max_steps and self.snap.step >= self.cfg.run.max_steps:
            return "max_steps"
        if self.deadline and time.monotonic() >= self.deadline:
            return "max_minutes"
        return None

    async def watch(self) -> tuple[str, str | None]:
        """Restart crashed workers and keep summary.json current until a stop reason; (reason, failure)."""
        while True:
            await asyncio.sleep(0.5)
            failure = self.sup.poll()
            await self._refresh()
            self.summary_path.write_text(json.dumps(summary_dict(self.snap, self.mon), indent=2))
            reason = self._stop_reason(failure)
            if reason:
                return reason, failure

    async def drain(self, stop_reason: str) -> None:
        """Stop the sampler, let in-flight work finish (bounded), then stop the rest in pipeline order."""
        self.snap.phase = f"draining ({stop_reason})"
        await self.sup.stop(["sampler"], 30)
        drain_end = time.monotonic() + (self.cfg.run.drain_seconds if stop_reason != "failed" else 0)
        while time.monotonic() < drain_end and not (self.interrupted.is_set() and stop_reason != "interrupted"):
            await asyncio.sleep(0.5)
            await self._refresh()
            d = self.snap.depths
            if d.get("tasks", 1) == 0 and d.get("traj", 1) == 0 and d.get("rewards", 1) == 0:
                break
        await self.sup.stop(["rollout", "verifier"], 30)
        await self.sup.stop(["learner"], 60)
        await self.sup.stop(["scheduler"], 60)
        await self.sup.stop(["tracker"], 60)  # last: it writes what the others published (no-op without one)
        await asyncio.sleep(0.5)  # let the last eval result arrive

    async def finish(self, js, reg: Registry, stop_reason: str, failure: str | None, server_pid: int | None) -> dict:
        """Account for every message, write the final summary.json and reward_curve.png."""
        self.snap.phase = "stopped"
        await self.mon.refresh(time.monotonic() - self.t0)
        acc = await account(js, reg)
        summary = summary_dict(self.snap, self.mon, acc, {"stop_reason": stop_reason, "failure": failure,
                                                          "cpu_seconds": self.mon.cpu_seconds(server_pid)})
        self.summary_path.write_text(json.dumps(summary, indent=2))
        steps = sorted(self.mon.step_rewards.items())
        evals = {d: [(e.step, e.score) for e in per.values()] for d, per in self.mon.domain_evals.items()}
        reward_curve(self.run_path / "reward_curve.png", steps, evals, f"rlbus {reg.run_id}")
        if self.live:
            self.live.update(render(self.snap))
        return summary


async def run_up(cfg: RunConfig, run_path: Path, run_dir: Path, nats_url: str, t0: float, console: Console,
                 server_pid: int | None = None, sandbox_isolation: str | None = None) -> int:
    """Supervise a prepared run until its limits; return the exit code (1 only when it failed)."""
    reg = Registry(cfg.run.run_id)
    nc = await connect(nats_url, name="rlbus-launcher")
    js = nc.jetstream(timeout=30)
    await ensure_topology(js, reg)
    config_file = run_path / "config.json"
    dump_config(cfg, config_file)
    from sandbox_workers.integrity import load_or_create_secret

    load_or_create_secret(run_path)  # before any worker: the sandbox side and verifiers share it
    sup = Supervisor(run_path, config_file, nats_url, reg.run_id, run_dir)
    sup.server_pid = server_pid
    snap = Snapshot(run_id=reg.run_id, phase="running", restarts=sup.restarts)
    mon = Monitor(js, reg, snap)
    mon.sandbox_isolation = sandbox_isolation
    await mon.start(nc)
    for role in roles_to_start(cfg):
        sup.start(role)
    run = RunLoop(cfg, run_path, t0, console, sup, mon, snap)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, run.interrupted.set)
    loop.add_signal_handler(signal.SIGTERM, run.interrupted.set)
    if run.live:
        run.live.start()
    try:
        stop_reason, failure = await run.watch()
        await run.drain(stop_reason)
        summary = await run.finish(js, reg, stop_reason, failure, server_pid)
    finally:
        # shutdown phases, in order: the live view, every worker still running, the bus connection
        if run.live:
            run.live.stop()
        sup.kill_all()
        await nc.close()
    console.print(json.dumps({k: summary[k] for k in ("steps", "weight_versions", "tasks_published", "trained_samples",
                                                       "dead_letters", "lost", "trained_twice", "eval", "wall_seconds")}, indent=1))
    console.print(f"results: {run_path}/summary.json, {run_path}/reward_curve.png, logs in {run_path}/logs/")
    if sandbox_isolation == "degraded":
        console.print(DEGRADED_WARNING, highlight=False)
    return 1 if failure else 0


def up(cfg: RunConfig, config_path: str | None, resume: Path | None = None) -> int:
    """Entry point of `rlbus up` after config loading (`resume`: the run folder to continue)."""
    t0 = time.monotonic()
    console = Console(stderr=False)
    if not check_tracking(cfg, console):
        return 1
    if not check_engine(cfg, console):
        return 1
    isolation = check_sandbox(cfg, console)
    if isolation is None:
        return 1
    if not check_tokenizer(cfg, console):
        return 1
    server = None
    if resume is not None:
        from rlbus.resume import AdoptedServer, check_launcher_gone, read_state, server_answers, stop_leftover_workers

        run_path = resume.resolve()
        run_dir = run_path.parent
        cfg.run.run_id, cfg.run.run_dir = run_path.name, str(run_dir)
        state = read_state(run_path)
        check_launcher_gone(state)
        stopped = stop_leftover_workers(state)
        console.print(f"resuming run {cfg.run.run_id} → {run_path}"
                      + (f" (stopped {len(stopped)} leftover worker(s))" if stopped else ""))
        url = state.get("nats_url") or ""
        if not cfg.run.nats_url and url and asyncio.run(server_answers(url)):
            server = AdoptedServer(url, state.get("server_pid"))
            console.print(f"reusing the run's nats-server at {url}")
        elif cfg.run.nats_url:
            url = cfg.run.nats_url
        else:
            server = EmbeddedNats(run_path / "nats").start()
            url = server.url
            console.print(f"embedded nats-server restarted at {url} on the run's store {run_path / 'nats'}")
    else:
        if not cfg.run.run_id:
            cfg.run.run_id = new_run_id(config_path)
        run_dir = Path(cfg.run.run_dir).resolve()
        run_path = run_dir / cfg.run.run_id
        run_path.mkdir(parents=True, exist_ok=True)
        console.print(f"run {cfg.run.run_id} → {run_path}")
        url = cfg.run.nats_url
        if not url:
            server = EmbeddedNats(run_path / "nats").start()
            url = server.url
            console.print(f"embedded nats-server at {url} (store {run_path / 'nats'})")
    prepare_model(cfg, run_path, console)  # a resumed run already has it: returns at once
    try:
        return asyncio.run(run_up(cfg, run_path, run_dir, url, t0, console, server_pid=server.pid if server else None,
                                  sandbox_isolation=isolation))
    finally:
        if server:
            server.stop()
