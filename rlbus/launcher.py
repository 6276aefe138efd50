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
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from bus.conn import connect, ensure_topology
from bus.server import EmbeddedNats
from bus.subjects import Registry
from rlbus.accounting import account
from rlbus.live import Snapshot, line, render
from rlbus.monitor import Monitor, summary_dict
from rlbus.plots import reward_curve
from rlbus.supervisor import Supervisor
from rlbus.watchdog import FatalStop, HeartbeatWatch, ServerKeeper, log_size, resume_command, store_full
from schemas.config import RunConfig, dump_config

START_ORDER = ("learner", "scheduler", "tracker", "sandbox", "verifier", "rollout", "sampler")
STARTS_IF = {"tracker": lambda cfg: bool(cfg.tracking.backends), "sandbox": lambda cfg: cfg.sandbox.remote}
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


def check_learner(cfg: RunConfig, console: Console) -> bool:
    """Whether the learner's ranks fit this machine (`learner.world_size`, `learner.backend`;
    before SFT, before NATS); False after printing what to set."""
    from learner.distributed import world_problem

    problem = world_problem(cfg.learner)
    if problem:
        console.print(f"rlbus up: {problem}", style="bold red", markup=False, highlight=False, soft_wrap=True)
    return problem is None


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
        isolation = probe_isolation("process" if sc.remote else sc.backend, sc.allow_degraded, image=sc.image)
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


class RunLoop:
    """One supervised run, in phases: watch until a stop reason, drain, account, shut down."""

    def __init__(self, cfg: RunConfig, run_path: Path, t0: float, console: Console, sup: Supervisor,
                 mon: Monitor, snap: Snapshot, keeper: ServerKeeper, nc):
        self.cfg, self.run_path, self.t0, self.console = cfg, run_path, t0, console
        self.sup, self.mon, self.snap, self.keeper, self.nc = sup, mon, snap, keeper, nc
        self.summary_path = run_path / "summary.json"
        self.interrupted = asyncio.Event()
        self.fatal: FatalStop | None = None
        self.heartbeats = HeartbeatWatch(cfg.run.heartbeat_timeout_s, mon.last_heartbeat)
        self._log_offset = log_size(keeper.store_dir / "nats-server.log")
        self.live = Live(render(snap), console=console, refresh_per_second=2, transient=False) \
            if console.is_terminal else None
        self._last_line = 0.0
        reserve = cfg.run.drain_seconds + 25.0
        self.deadline = t0 + cfg.run.max_minutes * 60 - reserve if cfg.run.max_minutes else None

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
            self.say(f"{role} (pid {pid}) sent no heartbeat for {quiet:.0f}s (frozen?): killed and restarted; "
                     "its unacked work is redelivered")
            self.sup.kill_hung(role)
        failure = self.sup.poll()
        for note in self.sup.notes:
            self.say(note)
        self.sup.notes.clear()
        if failure:
            self.fatal = FatalStop("crash-loop", failure, f"fix it, then continue with: {resume_command(self.run_path)}")
        return failure

    async def watch(self) -> tuple[str, str | None]:
        """Heal faults and keep summary.json current until a stop reason; (reason, failure)."""
        while True:
            await asyncio.sleep(0.5)
            failure = self._faults()
            if not failure:
                await self._refresh()
                self.summary_path.write_text(json.dumps(summary_dict(self.snap, self.mon), indent=2))
            reason = self._stop_reason(failure)
            if reason:
                return reason, failure

    async def drain(self, stop_reason: str) -> None:
        """Stop the sampler, let in-flight work finish (bounded), then stop the rest in pipeline order.
        After a failure nothing drains: every role gets 5 s at once (what is in flight stays on
        the bus for `--resume`), so a fatal fault ends the run within seconds."""
        self.snap.phase = f"draining ({stop_reason})"
        if stop_reason == "failed":
            await self.sup.stop(list(self.sup.procs), 5)
            return
        await self.sup.stop(["sampler"], 30)
        drain_end = time.monotonic() + self.cfg.run.drain_seconds
        while time.monotonic() < drain_end and not (self.interrupted.is_set() and stop_reason != "interrupted"):
            await asyncio.sleep(0.5)
            await self._refresh()
            d = self.snap.depths
            if d.get("tasks", 1) == 0 and d.get("traj", 1) == 0 and d.get("rewards", 1) == 0:
                break
        await self.sup.stop(["rollout", "verifier", "sandbox"], 30)
        await self.sup.stop(["learner"], 60)
        await self.sup.stop(["scheduler"], 60)
        await self.sup.stop(["tracker"], 60)  # last: it writes what the others published (no-op without one)
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
        summary = summary_dict(self.snap, self.mon, acc, extra)
        self.summary_path.write_text(json.dumps(summary, indent=2))
        steps = sorted(self.mon.step_rewards.items())
        evals = {d: [(e.step, e.score) for e in per.values()] for d, per in self.mon.domain_evals.items()}
        reward_curve(self.run_path / "reward_curve.png", steps, evals, f"rlbus {reg.run_id}")
        if self.live:
            self.live.update(render(self.snap))
        return summary


SUMMARY_KEYS = ("steps", "weight_versions", "tasks_published", "trained_samples", "dead_letters", "lost",
                "trained_twice", "eval", "wall_seconds")


async def run_up(cfg: RunConfig, run_path: Path, run_dir: Path, nats_url: str, t0: float, console: Console,
                 keeper: ServerKeeper, sandbox_isolation: str | None = None) -> int:
    """Supervise a prepared run until its limits; return the exit code (1 only when it failed)."""
    reg = Registry(cfg.run.run_id)
    nc = await connect(nats_url, name="rlbus-launcher")
    js = nc.jetstream(timeout=30)
    await ensure_topology(js, reg)
    config_file = run_path / "config.json"
    write_redacted_config(cfg, config_file)
    from sandbox_workers.integrity import load_or_create_secret

    load_or_create_secret(run_path)  # before any worker: the sandbox side and verifiers share it
    sup = Supervisor(run_path, config_file, nats_url, reg.run_id, run_dir, secret_env=secret_env(cfg))
    sup.server_pid = keeper.pid
    snap = Snapshot(run_id=reg.run_id, phase="running", restarts=sup.restarts)
    mon = Monitor(js, reg, snap)
    mon.sandbox_isolation = sandbox_isolation
    await mon.start(nc)
    for role in roles_to_start(cfg):
        sup.start(role)
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
        # shutdown phases, in order: the live view, every worker still running, the bus connection
        if run.live:
            run.live.stop()
        sup.kill_all()
        await _close(nc)
    console.print(json.dumps({k: summary[k] for k in SUMMARY_KEYS if k in summary}, indent=1))
    console.print(f"results: {run_path}/summary.json, {run_path}/reward_curve.png, logs in {run_path}/logs/")
    if run.fatal:
        run.say(f"stopped: {run.fatal.message}", style="bold red")
        run.say(run.fatal.next_step, style="bold red")
    if sandbox_isolation == "degraded":
        console.print(DEGRADED_WARNING, highlight=False)
    return 1 if failure else 0


def write_redacted_config(cfg: RunConfig, path: Path) -> None:
    """`dump_config` with every URL's password replaced by `***` (schemas.redact): the run
    folder never holds a credential; workers get the real URLs by environment (`secret_env`)."""
    from schemas.redact import redact_tree

    dump_config(cfg, path)
    path.write_text(json.dumps(redact_tree(json.loads(path.read_text())), indent=2))


def secret_env(cfg: RunConfig) -> dict[str, str]:
    """Environment for the workers holding what config.json has redacted: the run store's URL."""
    from scheduler.store import DB_URL_ENV
    from schemas.redact import is_redacted, redact_url

    url = cfg.scheduler.db_url
    return {DB_URL_ENV: url} if url and redact_url(url) != url and not is_redacted(url) else {}


async def _close(nc) -> None:
    try:
        await asyncio.wait_for(nc.close(), 5)
    except Exception:  # noqa: BLE001 - closing a connection to a dead server
        pass


def _start_server(cfg: RunConfig, run_path: Path, resume: bool, console: Console):
    """The run's NATS: (url, server or None). Fresh: an embedded server; resumed: the run's
    server when it still answers, else a new one on the run's store; none with run.nats_url."""
    if cfg.run.nats_url:
        from schemas.redact import NATS_URL_ENV, is_redacted

        if is_redacted(cfg.run.nats_url):  # a resumed run's config.json: `up` checked the variable is set
            return os.environ[NATS_URL_ENV], None
        return cfg.run.nats_url, None
    if resume:
        from rlbus.resume import AdoptedServer, read_state, server_answers

        state = read_state(run_path)
        url = state.get("nats_url") or ""
        if url and asyncio.run(server_answers(url)):
            console.print(f"reusing the run's nats-server at {url}")
            return url, AdoptedServer(url, state.get("server_pid"))
    server = EmbeddedNats(run_path / "nats").start()
    console.print(f"embedded nats-server {'restarted ' if resume else ''}at {server.url} "
                  f"({'on the run' + chr(39) + 's store' if resume else 'store'} {run_path / 'nats'})")
    return server.url, server


def _redacted_url_without_env(cfg: RunConfig, console: Console) -> bool:
    """True (after saying what to do) when run.nats_url's password is redacted (a resumed run's
    config.json never keeps it) and env RLBUS_NATS_URL does not hold the real URL."""
    from schemas.redact import NATS_URL_ENV, is_redacted

    if not (cfg.run.nats_url and is_redacted(cfg.run.nats_url)) or os.environ.get(NATS_URL_ENV):
        return False
    console.print(f"rlbus up: the run's NATS URL {cfg.run.nats_url} has its password redacted (the run folder never "
                  f"keeps it); pass --nats-url with the real URL, or set {NATS_URL_ENV}", style="bold red",
                  markup=False, highlight=False, soft_wrap=True)
    return True


def check_model(cfg: RunConfig, console: Console) -> bool:
    """Whether `model.path` (when set) is a local HF model folder; False after saying what to do."""
    if not cfg.model.path or (Path(cfg.model.path) / "config.json").is_file():
        return True
    console.print(f"rlbus up: model.path {cfg.model.path!r} is not a local Hugging Face model folder (no config.json "
                  "there); point it at a checkpoint folder, build a small one with `rlbus init-model DIR`, or leave "
                  "model.path empty to build the tiny model", style="bold red", markup=False, highlight=False,
                  soft_wrap=True)
    return False


def check_domains(cfg: RunConfig, console: Console) -> bool:
    """Whether every configured domain's task source builds (its kind, `params` and data;
    before SFT, before NATS): False after printing each domain's problem and the table to fix.
    A domain that is unavailable here (`DomainUnavailable`) is not a problem: the sampler
    leaves it out and reports it."""
    from producers.domains import DomainUnavailable, make_source

    ok = True
    for name in cfg.sampler.domains:
        try:
            make_source("check", name, cfg)
        except DomainUnavailable:
            continue
        except (ValueError, OSError) as exc:
            console.print(f"rlbus up: {exc}; fix [sampler.domains.{name}] in the config (or the --set that "
                          "changed it), then run it again", style="bold red", markup=False, highlight=False,
                          soft_wrap=True)
            ok = False
    return ok


def _checks(cfg: RunConfig, console: Console) -> str | None:
    """Every check before anything starts; the sandbox isolation, or None after printing why not."""
    if not (check_model(cfg, console) and check_tracking(cfg, console) and check_engine(cfg, console)
            and check_learner(cfg, console) and check_domains(cfg, console)):
        return None
    isolation = check_sandbox(cfg, console)
    if isolation is None or not check_tokenizer(cfg, console):
        return None
    return isolation


def up(cfg: RunConfig, config_path: str | None, resume: Path | None = None, debug: bool = False) -> int:
    """Entry point of `rlbus up` after config loading (`resume`: the run folder to continue).
    An unexpected error ends in one plain line and the command that continues the run (the
    traceback only with `debug`)."""
    t0 = time.monotonic()
    console = Console(stderr=False)
    isolation = _checks(cfg, console)
    if isolation is None:
        return 1
    if resume is not None:
        from rlbus.resume import check_launcher_gone, read_state, stop_leftover_workers

        run_path = resume.resolve()
        run_dir = run_path.parent
        cfg.run.run_id, cfg.run.run_dir = run_path.name, str(run_dir)
        state = read_state(run_path)
        check_launcher_gone(state)
        stopped = stop_leftover_workers(state)
        console.print(f"resuming run {cfg.run.run_id} → {run_path}"
                      + (f" (stopped {len(stopped)} leftover worker(s))" if stopped else ""))
    else:
        if not cfg.run.run_id:
            cfg.run.run_id = new_run_id(config_path)
        run_dir = Path(cfg.run.run_dir).resolve()
        run_path = run_dir / cfg.run.run_id
        run_path.mkdir(parents=True, exist_ok=True)
        console.print(f"run {cfg.run.run_id} → {run_path}")
    if _redacted_url_without_env(cfg, console):
        return 1
    url, server = _start_server(cfg, run_path, resume is not None, console)
    keeper = ServerKeeper(server, run_path / "nats", run_path)
    try:
        prepare_model(cfg, run_path, console)  # a resumed run already has it: returns at once
        return asyncio.run(run_up(cfg, run_path, run_dir, url, t0, console, keeper, sandbox_isolation=isolation))
    except Exception as exc:
        if debug:
            raise
        console.print(f"rlbus up: stopped by an unexpected error: {type(exc).__name__}: {str(exc)[:300]}; "
                      f"continue with: {resume_command(run_path)} (add --debug to see the traceback)",
                      style="bold red", markup=False, highlight=False, soft_wrap=True)
        return 1
    finally:
        keeper.stop()
