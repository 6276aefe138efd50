"""The fault matrix: every fault either heals by itself or stops with a clear next step, and nothing is lost.

`python bench/faults.py` (about 25 minutes on 2 cores) runs each case on a real run
(`bench.fault_run.BASE_CONFIG`, a small variant of examples/smoke.toml), puts its fault in
at a seeded random point after the first weight versions, and records per case:
`fault`, `healed` (the run reached its limits by itself), `resume_needed`, `lost` and
`trained_twice` (from the final accounting), `dead_letters` (with their reasons),
`recovery_s` (fault -> first learner step after it; through `--resume` where needed),
`stopped_s` (fault -> the launcher's exit, for the cases that stop), and `message`
(what the console said). Writes bench/results/faults.json and prints the table.

`--case NAME` (repeatable) runs some cases; `--list` names them. Cases that need
something this machine lacks (a Docker engine, PostgreSQL, root for a tmpfs) are rows
with `skipped` and the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import fault_harbor
from bench.fault_env import (
    ANSWER_FLOOD_CONFIG,
    DOCKER_CONFIG,
    PG_URL,
    SANDBOX_CONFIG,
    SLOW_VERIFIER_CONFIG,
    LocalCluster,
    TmpfsStore,
    docker_leftovers,
    pg_rows,
    restart_docker,
    restart_postgres,
    skip_reason,
)
from bench.fault_run import BASE_CONFIG, ROOT, FaultRun

RESULTS = ROOT / "bench" / "results" / "faults.json"
SAID = ("rlbus up:", "resuming run", "embedded nats-server restarted", "reusing the run's nats-server")
"""Console lines that tell the user about a fault and its recovery."""
FIRST_VERSIONS = 3
"""The fault goes in after this many learner steps (weight versions published and hot-loaded)."""


@dataclass
class Case:
    """One scripted fault: how to cause it, what the run needs, what fixes it when it cannot heal."""

    fault: str
    inject: Callable[[FaultRun, dict], str]
    config: str = BASE_CONFIG
    overrides: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    """`docker`, `postgres`, `root` (see `fault_env.skip_reason`)."""
    prepare: Callable[[FaultRun, dict], None] | None = None
    heal: Callable[[FaultRun, dict], None] | None = None
    """Run before `--resume` when the launcher stopped (free the disk, ...)."""
    cleanup: Callable[[FaultRun, dict], None] | None = None
    check: Callable[[FaultRun, dict], dict] | None = None
    """Extra figures for the row (rows in the SQL store, containers left, ...)."""
    cheap: bool = False
    """Part of the quick set that `make test-e2e` runs (tests/test_faults.py)."""
    role: str | None = None
    """The process the fault replaces (`server` for nats-server): recovery counts from its replacement."""
    env: dict[str, str] = field(default_factory=dict)
    settle_steps: int | None = None
    """Bound the run by work: once it has recovered and the learner took this many more steps,
    the launcher is interrupted (SIGINT: drain, account, exit 0). None: it runs to `max_minutes`
    (the cases whose figures need the whole run)."""


def kill(role: str) -> Callable[[FaultRun, dict], str]:
    def inject(run: FaultRun, ctx: dict) -> str:
        pid = run.pid(role)
        os.kill(pid, signal.SIGKILL)
        return f"kill -9 {role} (pid {pid})"

    return inject


def freeze(role: str, seconds: float) -> Callable[[FaultRun, dict], str]:
    def inject(run: FaultRun, ctx: dict) -> str:
        pid = run.pid(role)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        return f"SIGSTOP {role} (pid {pid}) for {seconds:.0f}s, then SIGCONT"

    return inject


def _fill_store(run: FaultRun, ctx: dict) -> str:
    return ctx["tmpfs"].fill()


def _free_store(run: FaultRun, ctx: dict) -> None:
    ctx["tmpfs"].free()


def _prepare_tmpfs(run: FaultRun, ctx: dict) -> None:
    ctx["tmpfs"] = TmpfsStore(run.run_path / "nats").mount()


def _cleanup_tmpfs(run: FaultRun, ctx: dict) -> None:
    ctx["tmpfs"].unmount()


def _build_image(run: FaultRun, ctx: dict) -> None:
    """The docker sandbox image (built only when missing or stale; `rlbus up` refuses to start without it)."""
    from sandbox_workers.images import ensure_image

    ensure_image()


def _launcher_gone(run: FaultRun, ctx: dict) -> None:
    """The orphaned workers stop by themselves (watch_launcher); recorded, then --resume."""
    t0, workers = time.monotonic(), list(run.state().get("workers", {}).values())
    while time.monotonic() - t0 < 60 and any(_alive(p) for p in workers):
        time.sleep(0.5)
    ctx["orphans_stopped_s"] = round(time.monotonic() - t0, 1) if not any(_alive(p) for p in workers) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _prepare_cluster(run: FaultRun, ctx: dict) -> None:
    ctx["cluster"] = LocalCluster(run.tmp / "cluster").start()
    run.overrides = (*run.overrides, f"run.nats_url={ctx['cluster'].urls}")


def _kill_node(run: FaultRun, ctx: dict) -> str:
    node = ctx["cluster"].kill(0)
    time.sleep(20)
    ctx["cluster"].restart(0)
    return f"kill -9 nats node {node} (the first URL every client tried), restarted on its store 20 s later"


SETTLE_STEPS = 5
"""Learner steps after the recovery that show the run goes on; then the case stops (by work, not minutes)."""

CASES: list[Case] = [
    Case("nats-server", kill("server"), cheap=True, role="server", settle_steps=SETTLE_STEPS),
    # kill-rollout is not in the cheap set: tests/test_up.py's smoke run is that scenario
    *[
        Case(f"kill-{role}", kill(role), role=role, settle_steps=SETTLE_STEPS)
        for role in ("sampler", "rollout", "verifier", "learner", "scheduler")
    ],
    Case("kill-sandbox", kill("sandbox"), config=SANDBOX_CONFIG, role="sandbox", settle_steps=SETTLE_STEPS),
    # weight updates in flight (rollout.inflight): every turn in 1-token chunks, a new version taken between
    # them; the killed worker's partial turns are never published, its tasks are redelivered
    Case(
        "kill-rollout-inflight",
        kill("rollout"),
        overrides=("rollout.inflight.enabled=true", "rollout.inflight.chunk_tokens=1"),
        role="rollout",
        settle_steps=SETTLE_STEPS,
    ),
    Case("sigstop-rollout", freeze("rollout", 20), cheap=True, role="rollout", settle_steps=SETTLE_STEPS),
    Case("store-full", _fill_store, needs=("root",), prepare=_prepare_tmpfs, heal=_free_store, cleanup=_cleanup_tmpfs),
    Case(
        "postgres-restart",
        lambda run, ctx: restart_postgres(),
        needs=("postgres",),
        overrides=(f"scheduler.db_url={PG_URL}",),
        check=lambda run, ctx: pg_rows(run),
    ),
    Case(
        "docker-restart",
        lambda run, ctx: restart_docker(),
        config=DOCKER_CONFIG,
        needs=("docker", "root"),
        prepare=_build_image,
        check=lambda run, ctx: docker_leftovers(run),
    ),
    Case(
        "slow-verifier",
        lambda run, ctx: "every `slow` task's verifier call takes 30 s (a third of the tasks)",
        config=SLOW_VERIFIER_CONFIG,
    ),
    Case(
        "answer-limit-flood",
        lambda run, ctx: (
            "every answer is 9**9**9**9; half the tasks parse it with sympy "
            "(rg-countdown), so each of theirs hits the answer pool's limits"
        ),
        config=ANSWER_FLOOD_CONFIG,
        check=lambda run, ctx: answer_limits(run),
    ),
    Case(
        "cluster-node",
        _kill_node,
        prepare=_prepare_cluster,
        env={"RLBUS_STREAM_REPLICAS": "3"},
        cleanup=lambda run, ctx: ctx["cluster"].stop(),
    ),
    Case("kill-launcher", kill("launcher"), heal=_launcher_gone),
    # Harbor task containers (bench/fault_harbor.py): the engine restarts under episodes; a build
    # and a test.sh that never end. The restart is of a private dockerd, never the shared one.
    Case(
        "harbor-engine-restart",
        fault_harbor.restart_mid_episode,
        # short ack waits: the retries' backoff (1x, 2x, 4x ack_wait) ends within the run, so every
        # trajectory the restart hit is verified or dead-lettered before the final accounting
        overrides=("verifier.ack_wait_s=15", "rollout.ack_wait_s=30", "run.max_minutes=4"),
        needs=("docker", "root", "dockerd", "harbor"),
        prepare=fault_harbor.prepare("engine-restart"),
        cleanup=fault_harbor.cleanup,
        check=fault_harbor.engine_restart_check,
    ),
    Case(
        "harbor-build-hang",
        lambda run, ctx: (
            f"task build-hang's image build runs `sleep 600` (build_timeout_sec = {fault_harbor.BUILD_HANG_TIMEOUT_S}),"
            " among 3 good tasks"
        ),
        needs=("docker", "harbor"),
        prepare=fault_harbor.prepare("build-hang"),
        check=fault_harbor.build_hang_check,
        settle_steps=SETTLE_STEPS,
    ),
    Case(
        "harbor-test-hang",
        lambda run, ctx: (
            f"domain hang's one task runs `sleep infinity` as test.sh ([verifier] timeout_sec ="
            f" {fault_harbor.TEST_HANG_TIMEOUT_S}), half the tasks"
        ),
        needs=("docker", "harbor"),
        prepare=fault_harbor.prepare("test-hang"),
        check=fault_harbor.test_hang_check,
        settle_steps=SETTLE_STEPS,
    ),
]


def answer_limits(run: FaultRun) -> dict:
    """Rewards by status in the run store (the flood's must be `answer_limit`), and verifier restarts."""
    import sqlite3

    db = run.run_path / "run.db"
    if not db.exists():
        return {"rewards_by_status": {}}
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT domain, status, COUNT(*) FROM rewards GROUP BY domain, status").fetchall()
    return {"rewards_by_status": {f"{d}/{st}": n for d, st, n in rows}}


def follow(
    run: FaultRun,
    step0: int,
    t_fault: float,
    timeout: float,
    role: str | None = None,
    old_pid: int | None = None,
    settle_steps: int | None = None,
) -> tuple[int | None, float | None, float]:
    """Wait for the launcher's exit; (exit code, seconds from the fault to the first learner step
    after recovery, seconds to exit). Recovery is the first step past `step0`; with `role`, the
    first step after that role's replacement process appeared in run.json (buffered work lets
    the learner step on while a role is away; that is not recovery). With `settle_steps`, the
    launcher is interrupted once `settle_steps` more steps followed the recovery."""
    deadline, recovery, since, steps_then = time.monotonic() + timeout, None, None if role else t_fault, step0
    recovered_at, interrupted = 0, False
    while time.monotonic() < deadline and run.proc.poll() is None:
        if since is None and _replaced(run, role, old_pid):
            since, steps_then = time.monotonic(), run.steps()
        if recovery is None and since is not None and run.steps() > steps_then:
            recovery, recovered_at = time.monotonic() - t_fault, run.steps()
        if (
            recovery is not None
            and settle_steps is not None
            and not interrupted
            and run.steps() >= recovered_at + settle_steps
        ):
            run.proc.send_signal(signal.SIGINT)  # a clean stop: drain, account, summary, exit 0
            interrupted = True
        time.sleep(0.25)
    return run.proc.poll(), recovery, time.monotonic() - t_fault


def _replaced(run: FaultRun, role: str, old_pid: int | None) -> bool:
    try:
        return run.pid(role) != old_pid
    except RuntimeError:
        return False


def run_case(case: Case, tmp: Path, seed: int) -> dict:
    """One case on a fresh run: start, fault, recover (or resume), account; always cleans up."""
    reason = skip_reason(case.needs)
    if reason:
        return {"fault": case.fault, "skipped": reason}
    rng, ctx = random.Random(f"{seed}-{case.fault}"), {}
    run = FaultRun(tmp, case.fault, case.config, case.overrides, case.env)
    try:
        if case.prepare:
            case.prepare(run, ctx)
        run.start()
        if not run.wait_steps(FIRST_VERSIONS, 300):
            return {
                "fault": case.fault,
                "error": "the run never reached its first weight versions",
                "console": run.console()[-1500:],
            }
        time.sleep(rng.uniform(0.0, 3.0))
        old_pid = run.pid(case.role) if case.role else None
        step0, t_fault, seen = run.steps(), time.monotonic(), len(run.console())
        injector = threading.Thread(target=lambda: ctx.__setitem__("what", case.inject(run, ctx)), daemon=True)
        injector.start()
        code, recovery, stopped = follow(run, step0, t_fault, 600, case.role, old_pid, case.settle_steps)
        injector.join(60)
        row = {
            "fault": case.fault,
            "what": ctx.get("what"),
            "resume_needed": code != 0,
            "stopped_s": round(stopped, 1) if code != 0 else None,
        }
        if code != 0:
            if case.heal:
                case.heal(run, ctx)
            ctx["resumed"] = True
            run.start(resume=True)
            code, recovery, _ = follow(run, max(step0, run.steps()), t_fault, 600)  # the resumed run's first step
        return row | outcome(run, case, ctx, code, recovery, seen)
    finally:
        run.stop_everything()
        if case.cleanup:
            case.cleanup(run, ctx)


def outcome(run: FaultRun, case: Case, ctx: dict, code: int | None, recovery: float | None, seen: int) -> dict:
    """The accounting part of a row, from the final summary.json and the console after the fault."""
    s, after = run.summary(), run.console()[seen:]
    msgs = [ln.strip() for ln in after.splitlines() if ln.strip().startswith(SAID)]
    url = next((o.split("=", 1)[1] for o in run.overrides if o.startswith("scheduler.db_url=")), None)
    row = {
        "healed": code == 0 and not ctx.get("resumed") and s.get("final") is True,
        "exit_code": code,
        "lost": s.get("lost"),
        "trained_twice": s.get("trained_twice"),
        "dead_letters": s.get("dead_letters"),
        "dead_letter_reasons": run.dead_letters(url),
        "recovery_s": round(recovery, 1) if recovery else None,
        "steps": s.get("steps"),
        "restarts": s.get("worker_restarts"),
        "message": " | ".join(msgs)[:600],
        "traceback": "Traceback" in after,
    }
    if ctx.get("orphans_stopped_s") is not None:
        row["orphans_stopped_s"] = ctx["orphans_stopped_s"]
    if case.check:
        row.update(case.check(run, ctx))
    return row


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table (what docs/reliability.md shows)."""
    head = "| fault | healed | resume needed | lost | trained twice | dead letters | recovery s | stopped s | console said |"
    out = [head, "|" + "---|" * 9]
    for r in rows:
        if "skipped" in r or "error" in r:
            out.append(f"| {r['fault']} | skipped: {r.get('skipped') or r.get('error')} |  |  |  |  |  |  |  |")
            continue
        dl = f"{r['dead_letters']}" + (
            f" ({', '.join(f'{k}: {v}' for k, v in r['dead_letter_reasons'].items())})"
            if r["dead_letter_reasons"]
            else ""
        )
        msg = r["message"].replace("|", "/") or "(nothing: a restart is logged in logs/)"
        out.append(
            f"| {r['fault']} | {'yes' if r['healed'] else 'no'} | {'yes' if r['resume_needed'] else 'no'} | "
            f"{r['lost']} | {r['trained_twice']} | {dl} | {r['recovery_s']} | {r['stopped_s'] or ''} | {msg} |"
        )
    return "\n".join(out)


DOC_HEAD = """# Reliability: the fault matrix

Every fault either heals by itself or stops with a clear next step, and nothing is lost.
Each row is one real run (`bench/fault_run.py`'s base config, a small variant of
examples/smoke.toml; the sandbox, Docker, slow-verifier and cluster cases add what they
need, see `bench/fault_env.py`; the Harbor cases run their own tiny Harbor config, see
`bench/fault_harbor.py`) with one scripted fault put in at a seeded random point
after the first weight versions. `lost` and `trained_twice` come from the run's final
per-message accounting; `recovery s` is the time from the fault to the first learner
step after the replaced process (or the resumed run) came back; `stopped s` is the time
from the fault to the launcher's exit for the cases that stop. Reproduce with
`python bench/faults.py` (all cases, about 25 minutes on 2 cores) or `--case NAME`;
`python bench/faults.py --doc` rewrites this file from bench/results/faults.json.
"""


NOTES = "<!-- notes: kept by --doc -->"


def write_doc(result: dict, path: Path) -> None:
    """docs/reliability.md from a results file: the table, then each row's command and details;
    whatever follows the NOTES marker in the old file is kept (hand-written findings)."""
    notes = path.read_text().split(NOTES, 1)[1] if path.exists() and NOTES in path.read_text() else "\n"
    lines = [DOC_HEAD, table(result["rows"]), "", "## Per case", ""]
    for r in result["rows"]:
        keep = {k: v for k, v in r.items() if k not in ("fault", "command", "message")}
        lines.append(
            f"- **{r['fault']}** ({r.get('at', '')}, load {r.get('load_avg', '')}): `{r.get('command', '')}`; "
            + json.dumps(keep)
        )
    path.write_text("\n".join(lines) + "\n\n" + NOTES + notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="run only this case (repeatable); see --list")
    ap.add_argument("--cheap", action="store_true", help="only the quick cases (nats-server, sigstop-rollout)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--seed", type=int, default=0, help="where each fault goes in (seeded per case)")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="replace only these cases' rows in the existing --out file (the others stay as they were)",
    )
    ap.add_argument(
        "--keep", metavar="DIR", help="keep every run folder and console log under DIR (default: a temporary folder)"
    )
    ap.add_argument("--doc", action="store_true", help="rewrite docs/reliability.md from --out and exit")
    args = ap.parse_args(argv)
    if args.doc:
        write_doc(json.loads(Path(args.out).read_text()), ROOT / "docs" / "reliability.md")
        return 0
    if args.list:
        print("\n".join(c.fault for c in CASES))
        return 0
    unknown = set(args.case or ()) - {c.fault for c in CASES}
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; --list names them")
    cases = [c for c in CASES if (not args.case or c.fault in args.case) and (not args.cheap or c.cheap)]
    rows, t0 = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlbus-faults-") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for case in cases:
            print(f"--- {case.fault}", flush=True)
            rows.append(run_case(case, Path(tmp), args.seed))
            print(json.dumps(rows[-1]), flush=True)
    command = "python bench/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for r in rows:
        r.update(
            command=command,
            load_avg=[round(x, 1) for x in os.getloadavg()],
            at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
    if args.merge and Path(args.out).exists():
        fresh = {r["fault"] for r in rows}
        old = [r for r in json.loads(Path(args.out).read_text()).get("rows", []) if r["fault"] not in fresh]
        order = [c.fault for c in CASES]
        rows = sorted(old + rows, key=lambda r: order.index(r["fault"]) if r["fault"] in order else len(order))
    result = {
        "command": command,
        "seed": args.seed,
        "seconds": round(time.monotonic() - t0, 1),
        "host": platform.node(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(rows))
    bad = [r["fault"] for r in rows if "lost" in r and (r["lost"] != 0 or r["trained_twice"] != 0)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
