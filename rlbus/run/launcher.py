"""`rlbus up`: prepare the model, start every role as its own OS process, watch, stop.

Guarantees:
- Each role runs as `rlbus worker ROLE` in its own process (own session, log file under
  `<run>/logs/`); a worker that dies while the run is live is restarted (up to
  `MAX_RESTARTS` per role, after which the run fails).
- Roles start in `bus.roles.start_order(cfg)`: the learner first, the sampler last; the
  sandbox service only with `sandbox.remote`, the tracker only when `tracking.backends`
  lists one (a missing tracking package stops `up` before anything starts, naming the extra).
  They start as soon as the server is up and config.json written, behind the start gate
  (`rlbus.run.startgate`): their imports overlap the model's build and SFT, and the gate opens
  once the model is ready and the streams exist. `DEFERRED_ROLES` (scheduler, tracker) start
  once the learner has stepped (or `DEFER_CAP_S` after the start, or at a stop); a drain waits
  for their first heartbeat before it stops them, so the baseline and final evaluation still run.
- Stop (limits or Ctrl-C) drains by `bus.roles.stop_phases()`: the sampler stops first, the
  pipeline gets `run.drain_seconds` to finish in-flight work, then rollout, verifier and the
  sandbox service, then the learner (which records what it still holds), then the scheduler
  (which evaluates the newest version), and last the tracker.
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
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from bus.conn import connect, ensure_topology
from bus.roles import start_order, stop_phases
from bus.server import EmbeddedNats, free_port
from bus.subjects import Registry
from rlbus.run.accounting import account
from rlbus.run.checks import DEGRADED_WARNING, preflight
from rlbus.run.folder import RunFolder
from rlbus.run.forked import can_fork
from rlbus.run.harbor_start import reap_harbor_run
from rlbus.run.live import Snapshot, line, render
from rlbus.run.monitor import Monitor, summary_dict
from rlbus.run.prepare import new_run_id, prepare_model, secret_env, write_redacted_config
from rlbus.run.startgate import START_GATE_ENV, close_gate, loads_model, open_gate, prewarm
from rlbus.run.supervisor import Supervisor
from rlbus.run.watchdog import FatalStop, HeartbeatWatch, ServerKeeper, log_size, resume_command, store_full
from schemas.config import RunConfig

DEFERRED_ROLES = ("scheduler", "tracker")
"""Roles started after the others: once the learner has taken its first step, `DEFER_CAP_S` after
the run started, or at a stop, whichever comes first. Neither feeds the first step (the scheduler's
version-0 baseline scores the start checkpoint's own files, so it can overlap the first steps; the
recorder and the tracker read durable consumers, so they miss nothing), and their imports and the
baseline's generation would take the cores the first step needs."""
DEFER_CAP_S = 30.0


def roles_to_start(cfg: RunConfig) -> list[str]:
    """The roles this config starts, in start order (`bus.roles.start_order`: no tracker without backends)."""
    return list(start_order(cfg))


class RunLoop:
    """One supervised run, in phases: watch until a stop reason, drain, account, shut down."""

    def __init__(
        self,
        cfg: RunConfig,
        run_path: Path,
        t0: float,
        console: Console,
        sup: Supervisor,
        mon: Monitor,
        snap: Snapshot,
        keeper: ServerKeeper,
        nc,
    ):
        self.cfg, self.run_path, self.t0, self.console = cfg, run_path, t0, console
        self.sup, self.mon, self.snap, self.keeper, self.nc = sup, mon, snap, keeper, nc
        self.folder = RunFolder(run_path)
        self.summary_path = self.folder.summary_json
        self.interrupted = asyncio.Event()
        self.fatal: FatalStop | None = None
        self.heartbeats = HeartbeatWatch(cfg.run.heartbeat_timeout_s, mon.last_heartbeat)
        self._log_offset = log_size(self.folder.server_log)
        self.live = (
            Live(render(snap), console=console, refresh_per_second=2, transient=False) if console.is_terminal else None
        )
        self._last_line = 0.0
        reserve = cfg.run.drain_seconds + 25.0
        self.deadline = t0 + cfg.run.max_minutes * 60 - reserve if cfg.run.max_minutes else None
        self.deferred = [r for r in roles_to_start(cfg) if r in DEFERRED_ROLES and r not in sup.procs]
        self.started_at = time.monotonic()

    def start_deferred(self, now: bool = False) -> None:
        """Start the deferred roles once the learner has stepped or `DEFER_CAP_S` passed (`now`: at once)."""
        if self.deferred and (now or self.snap.step >= 1 or time.monotonic() - self.started_at >= DEFER_CAP_S):
            for role in self.deferred:
                self.sup.start(role)
            self.deferred = []

    async def await_heartbeats(self, roles, timeout: float) -> None:
        """Wait (at most `timeout`) until each of `roles` that runs has sent a heartbeat: a deferred
        role started just before a stop handles SIGTERM (its baseline and final evaluation) only
        once its session is open."""
        end = time.monotonic() + timeout
        for role in roles:
            proc = self.sup.procs.get(role)
            while proc and proc.poll() is None and proc.pid not in self.mon.last_heartbeat and time.monotonic() < end:
                await asyncio.sleep(0.2)

    def say(self, text: str, style: str = "bold yellow") -> None:
        """One plain console line about a fault and what was done (above the live view)."""
        self.console.print(f"rlbus up: {text}", style=style, markup=False, highlight=False, soft_wrap=True)

    async def _refresh(self) -> None:
        try:
            await asyncio.wait_for(self.mon.refresh(time.monotonic() - self.t0), 10)
        except Exception:  # noqa: BLE001 - the bus is away (restarting, reconnecting): keep the last view
            self.snap.phase = "waiting for NATS"
        else:
            self.snap.phase = "running" if self.snap.phase == "waiting for NATS" else self.snap.phase
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

    def _faults(self) -> str | None:
        """Heal what heals (a dead server, a frozen worker, a crashed one); the failure otherwise."""
        try:
            restarted = self.keeper.check()
            if restarted:
                self.say(restarted)
                self.heartbeats.pause()
                self.sup.server_pid = self.keeper.pid
                self.sup.write_state()
            full = store_full(self.keeper.store_dir, self.run_path, self._log_offset) if self.keeper.server else None
            if full:
                raise full
        except FatalStop as exc:
            self.fatal = exc
            return exc.message
        for role, pid, quiet in self.heartbeats.hung(self.sup.procs, self.nc.is_connected):
            self.say(
                f"{role} (pid {pid}) sent no heartbeat for {quiet:.0f}s (frozen?): killed and restarted; "
                "its unacked work is redelivered"
            )
            self.sup.kill_hung(role)
        failure = self.sup.poll()
        for note in self.sup.notes:
            self.say(note)
        self.sup.notes.clear()
        if failure:
            self.fatal = FatalStop(
                "crash-loop", failure, f"fix it, then continue with: {resume_command(self.run_path)}"
            )
        return failure

    async def watch(self) -> tuple[str, str | None]:
        """Heal faults and keep summary.json current until a stop reason; (reason, failure)."""
        while True:
            await asyncio.sleep(0.5)
            failure = self._faults()
            if not failure:
                await self._refresh()
                self.summary_path.write_text(json.dumps(summary_dict(self.snap, self.mon), indent=2))
                self.start_deferred()
            reason = self._stop_reason(failure)
            if reason:
                if not failure:
                    self.start_deferred(now=True)  # the baseline and final evaluation still happen
                return reason, failure

    async def drain(self, stop_reason: str) -> None:
        """Stop the sampler, let in-flight work finish (bounded), then stop the rest in pipeline order.
        After a failure nothing drains: every role gets 5 s at once (what is in flight stays on
        the bus for `--resume`), so a fatal fault ends the run within seconds."""
        self.snap.phase = f"draining ({stop_reason})"
        if stop_reason == "failed":
            await self.sup.stop(list(self.sup.procs), 5)
            return
        (producers, producers_timeout), *rest = stop_phases()
        await self.sup.stop(list(producers), producers_timeout)  # the sampler: no new work
        drain_end = time.monotonic() + self.cfg.run.drain_seconds
        while time.monotonic() < drain_end and not (self.interrupted.is_set() and stop_reason != "interrupted"):
            await asyncio.sleep(0.5)
            await self._refresh()
            d = self.snap.depths
            if d.get("tasks", 1) == 0 and d.get("traj", 1) == 0 and d.get("rewards", 1) == 0:
                break
        for roles, timeout in rest:  # rollout/verifier/sandbox, learner, scheduler, tracker (no-op when not running)
            await self.await_heartbeats([r for r in roles if r in DEFERRED_ROLES], timeout)
            await self.sup.stop(list(roles), timeout)
        await asyncio.sleep(0.5)  # let the last eval result arrive

    async def finish(self, js, reg: Registry, stop_reason: str, failure: str | None) -> dict:
        """Account for every message, write the final summary.json and reward_curve.png (after a
        fatal fault the accounting is skipped when the bus cannot answer; summary.json says so)."""
        self.snap.phase = "stopped"
        extra = {"stop_reason": stop_reason, "failure": failure, "cpu_seconds": self.mon.cpu_seconds(self.keeper.pid)}
        if self.fatal:
            extra.update(fault=self.fatal.fault, next_step=self.fatal.next_step)
        acc = None
        try:
            await asyncio.wait_for(self.mon.refresh(time.monotonic() - self.t0), 3 if self.fatal else 10)
            acc = await asyncio.wait_for(account(js, reg), 10) if self.fatal else await account(js, reg)
        except Exception as exc:
            if not self.fatal:
                raise
            extra["accounting"] = f"skipped: the bus did not answer ({type(exc).__name__})"
        from rlbus.report.plots import reward_curve  # matplotlib: at the end, not on the way to the first step

        summary = summary_dict(self.snap, self.mon, acc, extra)
        self.summary_path.write_text(json.dumps(summary, indent=2))
        steps = sorted(self.mon.step_rewards.items())
        evals = {d: [(e.step, e.score) for e in per.values()] for d, per in self.mon.domain_evals.items()}
        reward_curve(self.folder.reward_curve, steps, evals, f"rlbus {reg.run_id}")
        if self.live:
            self.live.update(render(self.snap))
        return summary


SUMMARY_KEYS = (
    "steps",
    "weight_versions",
    "tasks_published",
    "trained_samples",
    "dead_letters",
    "lost",
    "trained_twice",
    "eval",
    "wall_seconds",
)


async def run_up(
    cfg: RunConfig,
    run_path: Path,
    run_dir: Path,
    nats_url: str,
    t0: float,
    console: Console,
    keeper: ServerKeeper,
    sup: Supervisor,
    sandbox_isolation: str | None = None,
) -> int:
    """Supervise a prepared run until its limits; return the exit code (1 only when it failed).
    The early roles (`sup`) already run, waiting at the start gate: it opens once the streams exist."""
    reg = Registry(cfg.run.run_id)
    nc = await connect(nats_url, name="rlbus-launcher")
    js = nc.jetstream(timeout=30)
    await ensure_topology(js, reg)
    folder = RunFolder(run_path)
    open_gate(folder.start_gate)
    snap = Snapshot(run_id=reg.run_id, phase="running", restarts=sup.restarts)
    mon = Monitor(js, reg, snap)
    mon.sandbox_isolation = sandbox_isolation
    await mon.start(nc)
    run = RunLoop(cfg, run_path, t0, console, sup, mon, snap, keeper, nc)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, run.interrupted.set)
    loop.add_signal_handler(signal.SIGTERM, run.interrupted.set)
    if run.live:
        run.live.start()
    try:
        stop_reason, failure = await run.watch()
        await run.drain(stop_reason)
        summary = await run.finish(js, reg, stop_reason, failure)
    finally:
        # shutdown phases, in order: the live view, every worker still running, the Harbor
        # containers still waiting for a verifier, the bus connection
        if run.live:
            run.live.stop()
        sup.kill_all()  # `up` kills them again on its way out (early roles stopped before this point)
        reap_harbor_run(cfg, reg.run_id, console)
        await _close(nc)
    console.print(json.dumps({k: summary[k] for k in SUMMARY_KEYS if k in summary}, indent=1))
    console.print(f"results: {folder.summary_json}, {folder.reward_curve}, logs in {folder.logs}/")
    if run.fatal:
        run.say(f"stopped: {run.fatal.message}", style="bold red")
        run.say(run.fatal.next_step, style="bold red")
    if sandbox_isolation == "degraded":
        console.print(DEGRADED_WARNING, highlight=False)
    return 1 if failure else 0


async def _close(nc) -> None:
    try:
        await asyncio.wait_for(nc.close(), 5)
    except Exception:  # noqa: BLE001 - closing a connection to a dead server
        pass


def start_early(cfg: RunConfig, run_path: Path, run_dir: Path, nats_url: str, keeper: ServerKeeper) -> Supervisor:
    """Write config.json and the tool secret, then start every role but the deferred ones
    (`DEFERRED_ROLES`) behind a closed start gate: they import while the model is prepared.
    They are forked from this process after it imported torch and transformers' model code
    (when a role loads a model), so no role pays for those imports again."""
    folder = RunFolder(run_path)
    close_gate(folder.start_gate)
    write_redacted_config(cfg, folder.config_json)
    from sandbox_workers.integrity import load_or_create_secret

    load_or_create_secret(run_path)  # before any worker: the sandbox side and verifiers share it
    sup = Supervisor(
        run_path,
        folder.config_json,
        nats_url,
        cfg.run.run_id,
        run_dir,
        secret_env=secret_env(cfg) | {START_GATE_ENV: str(folder.start_gate)},
    )
    sup.server_pid, sup.monitor_url = keeper.pid, keeper.monitor_url
    early = [r for r in roles_to_start(cfg) if r not in DEFERRED_ROLES]
    if any(loads_model(r, cfg) for r in early):
        prewarm("rlbus.commands.worker", model=True)  # once here (the tiny model and SFT need it too), not per role
    fork = can_fork()  # no threads here yet, and the child can carry a worker's command line
    for role in early:
        sup.start(role, fork=fork)  # no torch op has run in this process yet
    return sup


def _start_server(cfg: RunConfig, run_path: Path, resume: bool, console: Console):
    """The run's NATS: (url, server or None). Fresh: an embedded server; resumed: the run's
    server when it still answers, else a new one on the run's store; none with run.nats_url."""
    folder = RunFolder(run_path)
    if cfg.run.nats_url:
        from schemas.redact import NATS_URL_ENV, is_redacted

        if is_redacted(cfg.run.nats_url):  # a resumed run's config.json: `up` checked the variable is set
            return os.environ[NATS_URL_ENV], None
        return cfg.run.nats_url, None
    if resume:
        from rlbus.run.resume import AdoptedServer
        from rlbus.run.server import server_answers

        url = folder.server_url()
        if url and asyncio.run(server_answers(url)):
            console.print(f"reusing the run's nats-server at {url}")
            state = folder.state()
            return url, AdoptedServer(url, state.get("server_pid"), state.get("monitor_url"))
    server = EmbeddedNats(folder.nats, monitor_port=free_port()).start()  # /jsz: run.json monitor_url
    console.print(
        f"embedded nats-server {'restarted ' if resume else ''}at {server.url} "
        f"({'on the run' + chr(39) + 's store' if resume else 'store'} {folder.nats})"
    )
    return server.url, server


def _redacted_url_without_env(cfg: RunConfig, console: Console) -> bool:
    """True (after saying what to do) when run.nats_url's password is redacted (a resumed run's
    config.json never keeps it) and env RLBUS_NATS_URL does not hold the real URL."""
    from schemas.redact import NATS_URL_ENV, is_redacted

    if not (cfg.run.nats_url and is_redacted(cfg.run.nats_url)) or os.environ.get(NATS_URL_ENV):
        return False
    console.print(
        f"rlbus up: the run's NATS URL {cfg.run.nats_url} has its password redacted (the run folder never "
        f"keeps it); pass --nats-url with the real URL, or set {NATS_URL_ENV}",
        style="bold red",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return True


def up(cfg: RunConfig, config_path: str | None, resume: Path | None = None, debug: bool = False) -> int:
    """Entry point of `rlbus up` after config loading (`resume`: the run folder to continue).
    An unexpected error ends in one plain line and the command that continues the run (the
    traceback only with `debug`)."""
    t0 = time.monotonic()
    console = Console(stderr=False)
    isolation = preflight(cfg, console)
    if isolation is None:
        return 1
    if resume is not None:
        from rlbus.run.resume import check_launcher_gone, read_state, stop_leftover_workers

        run_path = resume.resolve()
        run_dir = run_path.parent
        cfg.run.run_id, cfg.run.run_dir = run_path.name, str(run_dir)
        state = read_state(run_path)
        check_launcher_gone(state)
        stopped = stop_leftover_workers(state)
        console.print(
            f"resuming run {cfg.run.run_id} → {run_path}"
            + (f" (stopped {len(stopped)} leftover worker(s))" if stopped else "")
        )
    else:
        if not cfg.run.run_id:
            cfg.run.run_id = new_run_id(config_path)
        run_dir = Path(cfg.run.run_dir).resolve()
        run_path = RunFolder.of(run_dir, cfg.run.run_id).path
        run_path.mkdir(parents=True, exist_ok=True)
        console.print(f"run {cfg.run.run_id} → {run_path}")
    if _redacted_url_without_env(cfg, console):
        return 1
    url, server = _start_server(cfg, run_path, resume is not None, console)
    keeper = ServerKeeper(server, RunFolder(run_path).nats, run_path)
    sup: Supervisor | None = None
    try:
        sup = start_early(cfg, run_path, run_dir, url, keeper)  # imports overlap the model's preparation
        prepare_model(cfg, run_path, console)  # a resumed run already has it: returns at once
        return asyncio.run(run_up(cfg, run_path, run_dir, url, t0, console, keeper, sup, sandbox_isolation=isolation))
    except Exception as exc:
        if debug:
            raise
        console.print(
            f"rlbus up: stopped by an unexpected error: {type(exc).__name__}: {str(exc)[:300]}; "
            f"continue with: {resume_command(run_path)} (add --debug to see the traceback)",
            style="bold red",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return 1
    finally:
        if sup is not None:
            sup.kill_all()  # a failed SFT or start: the early roles waiting at the gate go too
        keeper.stop()
