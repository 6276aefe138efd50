"""`rlbus up`: prepare the model, start every role as its own OS process, watch, stop.

Guarantees:
- Each role runs as `rlbus worker ROLE` in its own process (own session, log file under
  `<run>/logs/`); a worker that dies while the run is live is restarted (up to
  `MAX_RESTARTS` per role, after which the run fails).
- Stop (limits or Ctrl-C) drains in order: the sampler stops first, the pipeline gets
  `run.drain_seconds` to finish in-flight work, then rollout and verifier, then the
  learner (which records what it still holds), and last the scheduler (which
  evaluates the newest version).
- Everything of a run lives under `<run-dir>/<run_id>/`; `summary.json` is kept current
  during the run and completed (with per-message accounting) at the end, next to
  `reward_curve.png`. Its `domains` gives each domain's training rewards (count, mean,
  verifier statuses) and the tool calls its episodes made, read from the rewards stream
  by an ordered consumer (consumes nothing).
- KV `status` = "stop-requested" (written by the scheduler with `scheduler.stop_on_plateau`)
  stops the run like a limit (stop_reason `stop_requested`); summary.json carries the
  scheduler's `plateau` verdict and `released_version` (KV `plateau`, `release.latest`).
- Exit code 0 when the run stopped at its limits (restarts included), non-zero only
  when it failed.
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
from bus.kv import LEARNER_PROGRESS, STATUS, get_json
from bus.server import EmbeddedNats
from bus.subjects import Registry
from rlbus.accounting import account
from rlbus.live import Snapshot, line, render
from rlbus.plots import reward_curve
from schemas import DecodeError, EvalResult, Metric, RewardGlance, WeightVersion, decode, glance_reward
from schemas.config import RunConfig, dump_config

log = structlog.get_logger()
MAX_RESTARTS = 5
START_ORDER = ("learner", "scheduler", "verifier", "rollout", "sampler")
STAGE_COUNTER = {"sampler": "published", "rollout": "trajectories", "verifier": "rewards", "learner": "samples_trained"}


def new_run_id(config_path: str) -> str:
    """`<config stem>-<UTC time>`."""
    return f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


class DomainDemos:
    """SFT demonstrations mixing domains by weight, one domain per batch (short arith and long
    tool episodes are never padded together, which keeps each step's cost that of its domain)."""

    def __init__(self, sources: list, weights: list[float], levels: list[int]) -> None:
        self.sources, self.weights, self.levels = sources, weights, levels

    def _pick(self, rng) -> int:
        return rng.choices(range(len(self.sources)), weights=self.weights)[0]

    def __call__(self, rng):
        k = self._pick(rng)
        return self.sources[k].demonstration(rng, self.levels[k])

    def batch(self, rng, n: int) -> list:
        k = self._pick(rng)
        return [self.sources[k].demonstration(rng, self.levels[k]) for _ in range(n)]


def sft_demos(cfg: RunConfig) -> DomainDemos:
    """Demonstrations of every configured domain that can demonstrate itself, by static weight;
    arith at `sft.difficulty`, the others at their starting level. Held-out eval problems
    are never demonstrated."""
    from producers.domains import make_source

    sources, weights, levels = [], [], []
    for name, dc in cfg.sampler.domains.items():
        src = make_source("sft", name, cfg)
        share = dc.weight if dc.sft_weight is None else dc.sft_weight
        if hasattr(src, "demonstration") and share > 0:
            sources.append(src)
            weights.append(share)
            levels.append(cfg.sft.difficulty if name == "arith" else dc.initial_level)
    if not sources:
        raise ValueError("sft.enabled but no configured domain has demonstrations; set sft.enabled=false")
    return DomainDemos(sources, weights, levels)


def prepare_model(cfg: RunConfig, run_path: Path, console: Console) -> Path:
    """Build (or take) the base model, warm-start it with SFT, leave it at <run>/model/start."""
    start = run_path / "model" / "start"
    if start.exists():
        return start
    base = Path(cfg.model.path) if cfg.model.path else run_path / "model" / "base"
    if not cfg.model.path:
        from rlbus.tiny_model import build_tiny_model

        build_tiny_model(base, arch=cfg.model.arch, hidden_size=cfg.model.hidden_size,
                         num_layers=cfg.model.num_layers, num_heads=cfg.model.num_heads, seed=cfg.run.seed)
        console.print(f"built tiny {cfg.model.arch} model at {base}")
    if not cfg.sft.enabled:
        shutil.copytree(base, start)
        return start
    from learner.sft import run_sft

    demo = sft_demos(cfg)
    console.print(f"SFT warm start for up to {cfg.sft.seconds:.0f}s ...")
    stats = run_sft(base, start, demo, seconds=cfg.sft.seconds, max_steps=cfg.sft.max_steps,
                    batch_size=cfg.sft.batch_size, lr=cfg.sft.lr, seed=cfg.run.seed, threads=cfg.sft.threads,
                    progress=console.is_terminal)
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


class DomainRewards:
    """Training rewards of one domain as the run saw them: count, mean, verifier statuses,
    and the tool calls its episodes made (by tool name, and episodes with at least one)."""

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.statuses: dict[str, int] = {}
        self.tool_calls: dict[str, int] = {}
        self.episodes_with_tool_calls = 0

    def add(self, r: RewardGlance) -> None:
        self.n += 1
        self.total += r.reward
        self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
        for tool, _ in r.tool_calls:
            self.tool_calls[tool] = self.tool_calls.get(tool, 0) + 1
        self.episodes_with_tool_calls += bool(r.tool_calls)

    def as_dict(self) -> dict:
        return {"rewards": self.n, "reward_mean": round(self.total / self.n, 4) if self.n else None,
                "statuses": self.statuses, "tool_calls": self.tool_calls,
                "episodes_with_tool_calls": self.episodes_with_tool_calls}


class Monitor:
    """Live facts of the run, fed by core-NATS subscriptions (consumes nothing)."""

    def __init__(self, js, reg: Registry, snap: Snapshot):
        self.js, self.reg, self.snap = js, reg, snap
        self.workers: dict[str, dict[str, float]] = {}  # worker_id -> counters
        self.roles: dict[str, str] = {}
        self.step_rewards: dict[int, float] = {}
        self.evals: dict[int, EvalResult] = {}  # first domain's curve (the live view's headline)
        self.domain_evals: dict[str, dict[int, EvalResult]] = {}
        self._last_totals: dict[str, float] = {}
        self._last_t = time.monotonic()
        self.plateau: dict | None = None  # KV `plateau` (scheduler.gates)
        self.released_version: int | None = None  # KV `release.latest`
        self.stop_requested = False  # KV `status` == "stop-requested"
        self.domain_rewards: dict[str, DomainRewards] = {}  # training rewards per domain

    async def start(self, nc) -> None:
        """Subscribe to telemetry, weight announcements and eval results."""
        await nc.subscribe(self.reg.metrics(), cb=self._on_metric)
        await nc.subscribe(self.reg.weights, cb=self._on_weights)
        await self.js.subscribe(self.reg.all("eval"), cb=self._on_eval, ordered_consumer=True)
        await self.js.subscribe(self.reg.all("rewards"), cb=self._on_reward, ordered_consumer=True)

    async def _on_metric(self, raw) -> None:
        try:
            m = decode(raw.data, Metric)
        except DecodeError:
            return
        self.workers[m.worker_id], self.roles[m.worker_id] = m.values, m.role

    async def _on_weights(self, raw) -> None:
        try:
            wv = decode(raw.data, WeightVersion)
        except DecodeError:
            return
        if "reward_mean" in wv.metrics:
            self.step_rewards[wv.step] = wv.metrics["reward_mean"]

    async def _on_reward(self, raw) -> None:
        try:
            r = glance_reward(raw.data)  # every reward of the run passes here: the light view
        except DecodeError:
            return
        if r.purpose == "train":
            self.domain_rewards.setdefault(r.domain, DomainRewards()).add(r)

    async def _on_eval(self, raw) -> None:
        try:
            ev = decode(raw.data, EvalResult)
        except DecodeError:
            return
        per = self.domain_evals.setdefault(ev.domain, {})
        per[ev.version] = ev
        if ev.domain == next(iter(self.domain_evals)):
            self.evals[ev.version] = ev

    def totals(self) -> dict[str, float]:
        """Sum of each stage's main counter over its workers."""
        out: dict[str, float] = {}
        for wid, values in self.workers.items():
            role = self.roles[wid]
            if role in STAGE_COUNTER:
                out[role] = out.get(role, 0.0) + values.get(STAGE_COUNTER[role], 0.0)
        return out

    def cpu_seconds(self, server_pid: int | None = None) -> dict[str, float]:
        """CPU seconds per role (the last heartbeat of each worker, summed over a role's
        workers, restarted ones included), the launcher's own, and nats-server's (when this
        launcher started it and /proc is readable): where a run's cores went."""
        out: dict[str, float] = {}
        for wid, values in self.workers.items():
            if "cpu_seconds" in values:
                out[self.roles[wid]] = round(out.get(self.roles[wid], 0.0) + values["cpu_seconds"], 1)
        t = os.times()
        out["launcher"] = round(t.user + t.system, 1)
        if server_pid:
            try:
                fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
                out["nats-server"] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)
            except (OSError, ValueError, IndexError):
                pass
        return out

    async def refresh(self, elapsed: float) -> Snapshot:
        """Update the snapshot from telemetry, KV and stream states."""
        s = self.snap
        s.elapsed = elapsed
        progress = await get_json(self.js, self.reg, LEARNER_PROGRESS) or {}
        s.step, s.version = int(progress.get("step", 0)), int(progress.get("version", 0))
        s.reward = progress.get("reward_mean")
        totals, now = self.totals(), time.monotonic()
        dt = max(1e-6, now - self._last_t)
        for k, v in totals.items():
            rate = max(0.0, (v - self._last_totals.get(k, v)) / dt)
            s.rates[k] = 0.5 * s.rates.get(k, rate) + 0.5 * rate
        self._last_totals, self._last_t, s.totals = totals, now, totals
        try:
            s.depths["tasks"] = (await self.js.stream_info(self.reg.stream("TASKS"))).state.messages
            s.depths["traj"] = (await self.js.stream_info(self.reg.stream("TRAJ"))).state.messages
            ci = await self.js.consumer_info(self.reg.stream("REWARDS"), "learner")
            s.depths["rewards"] = ci.num_pending + ci.num_ack_pending
            s.dead_letters = (await self.js.stream_info(self.reg.stream("DLQ"))).state.messages
        except Exception:
            pass
        from bus.kv import PLATEAU, RELEASE_LATEST, STOP_REQUESTED

        self.plateau = await get_json(self.js, self.reg, PLATEAU)
        self.released_version = ((await get_json(self.js, self.reg, RELEASE_LATEST)) or {}).get("version")
        self.stop_requested = await get_json(self.js, self.reg, STATUS) == STOP_REQUESTED
        if self.evals:
            s.eval_baseline = self.evals[min(self.evals)].score if 0 in self.evals else None
            s.eval_version = max(self.evals)
            s.eval_latest = self.evals[s.eval_version].score
        return s


def summary_dict(snap: Snapshot, mon: Monitor, acc=None, extra: dict | None = None) -> dict:
    """The run's summary.json (accounting fields are null until the run stops)."""
    counts = acc.counts() if acc else {}
    evals = {}
    for domain, per in mon.domain_evals.items():
        first, last = per.get(0), per[max(per)]
        evals[domain] = {"baseline": first.score if first else None, "final": last.score, "n": last.n,
                         "baseline_version": 0 if first else None, "final_version": last.version,
                         "curve": {str(v): e.score for v, e in sorted(per.items())}}
    out = {
        "run_id": snap.run_id, "steps": snap.step, "weight_versions": snap.version + 1,
        "tasks_published": len(acc.published) if acc else int(snap.totals.get("sampler", 0)),
        "trajectories": int(snap.totals.get("rollout", 0)), "rewards": int(snap.totals.get("verifier", 0)),
        "trained_samples": int(snap.totals.get("learner", 0)), "dead_letters": acc.dead_letters if acc else snap.dead_letters,
        "lost": counts.get("lost") if acc else None, "trained_twice": acc.trained_twice if acc else None,
        "learner_rollbacks": acc.rollbacks if acc else None,
        "task_fates": counts or None, "filtered_reasons": dict(acc.filtered_reasons) if acc else None,
        "eval": evals, "domains": {d: dr.as_dict() for d, dr in sorted(mon.domain_rewards.items())},
        "wall_seconds": round(snap.elapsed, 1), "final": acc is not None,
        "worker_restarts": snap.restarts,
        "plateau": mon.plateau, "released_version": mon.released_version,
    }
    out.update(extra or {})
    return out


async def run_up(cfg: RunConfig, run_path: Path, run_dir: Path, nats_url: str, t0: float, console: Console,
                 server_pid: int | None = None) -> int:
    """Supervise a prepared run until its limits; return the exit code."""
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
    await mon.start(nc)
    for role in START_ORDER:
        sup.start(role)
    stop_reason, failure = None, None
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    loop.add_signal_handler(signal.SIGTERM, interrupted.set)
    reserve = cfg.run.drain_seconds + 25.0
    deadline = t0 + cfg.run.max_minutes * 60 - reserve if cfg.run.max_minutes else None
    summary_path = run_path / "summary.json"
    tty = console.is_terminal
    last_line = 0.0
    live = Live(render(snap), console=console, refresh_per_second=2, transient=False) if tty else None
    if live:
        live.start()
    try:
        while stop_reason is None:
            await asyncio.sleep(0.5)
            failure = sup.poll()
            await mon.refresh(time.monotonic() - t0)
            if live:
                live.update(render(snap))
            elif time.monotonic() - last_line > 10:
                console.print(line(snap), highlight=False)
                last_line = time.monotonic()
            summary_path.write_text(json.dumps(summary_dict(snap, mon), indent=2))
            if failure:
                stop_reason = "failed"
            elif interrupted.is_set():
                stop_reason = "interrupted"
            elif mon.stop_requested:
                stop_reason = "stop_requested"  # e.g. scheduler.stop_on_plateau
            elif cfg.run.max_steps and snap.step >= cfg.run.max_steps:
                stop_reason = "max_steps"
            elif deadline and time.monotonic() >= deadline:
                stop_reason = "max_minutes"
        snap.phase = f"draining ({stop_reason})"
        await sup.stop(["sampler"], 30)
        drain_end = time.monotonic() + (cfg.run.drain_seconds if stop_reason != "failed" else 0)
        while time.monotonic() < drain_end and not (interrupted.is_set() and stop_reason != "interrupted"):
            await asyncio.sleep(0.5)
            await mon.refresh(time.monotonic() - t0)
            if live:
                live.update(render(snap))
            if snap.depths.get("tasks", 1) == 0 and snap.depths.get("traj", 1) == 0 and snap.depths.get("rewards", 1) == 0:
                break
        await sup.stop(["rollout", "verifier"], 30)
        await sup.stop(["learner"], 60)
        await sup.stop(["scheduler"], 60)
        await asyncio.sleep(0.5)  # let the last eval result arrive
        snap.phase = "stopped"
        await mon.refresh(time.monotonic() - t0)
        acc = await account(js, reg)
        summary = summary_dict(snap, mon, acc, {"stop_reason": stop_reason, "failure": failure,
                                                "cpu_seconds": mon.cpu_seconds(server_pid)})
        summary_path.write_text(json.dumps(summary, indent=2))
        steps = sorted(mon.step_rewards.items())
        evals = {d: [(e.step, e.score) for e in per.values()] for d, per in mon.domain_evals.items()}
        reward_curve(run_path / "reward_curve.png", steps, evals, f"rlbus {reg.run_id}")
        if live:
            live.update(render(snap))
    finally:
        if live:
            live.stop()
        sup.kill_all()
        await nc.close()
    console.print(json.dumps({k: summary[k] for k in ("steps", "weight_versions", "tasks_published", "trained_samples",
                                                       "dead_letters", "lost", "trained_twice", "eval", "wall_seconds")}, indent=1))
    console.print(f"results: {run_path}/summary.json, {run_path}/reward_curve.png, logs in {run_path}/logs/")
    return 1 if failure else 0


def up(cfg: RunConfig, config_path: str | None, resume: Path | None = None) -> int:
    """Entry point of `rlbus up` after config loading (`resume`: the run folder to continue)."""
    t0 = time.monotonic()
    console = Console(stderr=False)
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
    pid = getattr(server, "pid", None) or (server.proc.pid if getattr(server, "proc", None) else None)
    try:
        return asyncio.run(run_up(cfg, run_path, run_dir, url, t0, console, server_pid=pid))
    finally:
        if server:
            server.stop()
