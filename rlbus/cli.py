"""The `rlbus` command line: one entry point per process.

    rlbus up CONFIG            run every role of a config on this machine
    rlbus worker ROLE ...      run one role as one process (what `up` and compose start)
    rlbus init-model OUT       build a tiny HF-format causal LM locally
    rlbus sft MODEL OUT        supervised warm start on a domain's demonstrations
    rlbus generate MODEL ...   sample from a model folder with the rollout engines (hf or vllm)
    rlbus tail SUBJECT         print decoded messages live from a subject wildcard
    rlbus dlq list|show|replay inspect and replay a run's dead letters
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bus.session import ROLE_LIMIT
from bus.subjects import ROLES

EPILOG = """examples:
  rlbus up examples/demo.toml                      # the demo: tiny model, SFT, then RL on arith
  rlbus up examples/demo.toml --max-minutes 5 --set learner.lr=5e-4
  rlbus worker rollout --config runs/<id>/config.json --nats-url nats://host:4222 --run-id <id>
  rlbus tail 'rewards.>' --max 5                   # watch rewards of every run, consuming nothing
  rlbus dlq list --run-dir runs --run-id <id>      # dead letters of a run
  set -a; . compose/.env; set +a; rlbus status --nats-url nats://127.0.0.1:4222   # as the compose stack's monitor user
"""

DLQ_EPILOG = """examples:
  rlbus dlq list --run-id <id> --nats-url nats://127.0.0.1:4222
  rlbus dlq list --run-id <id> --run-dir runs       # server URL read from runs/<id>/run.json
  rlbus dlq show 3 --run-id <id> --run-dir runs     # one letter, original payload decoded
  rlbus dlq replay 3 7 --run-id <id> --run-dir runs # after a fix: republish letters 3 and 7
  rlbus dlq replay --all --run-id <id> --run-dir runs

SEQ is the letter's sequence number in the run's DLQ stream (first column of `list`).
Replay republishes the original bytes to the original subject with Nats-Msg-Id
<original>.replay-<SEQ>, so JetStream de-duplication does not drop it, and records the
replay in the run's KV bucket (dlq.replayed.<SEQ>); `list` shows it in the REPLAYED column.
"""


# Commands that live with their subsystem: each module defines `register(sub)`, which adds
# its parser and sets `func=callable(args) -> int` as the parser default.
COMMAND_MODULES = ("sandbox_workers.cli", "rlbus.verify", "rlbus.top", "rlbus.export", "rlbus.report",
                   "rlbus.init_cmd", "rlbus.config_help", "rlbus.samples", "rlbus.rescore", "rlbus.generate",
                   "rlbus.tasks_cmd")


def _register_command_modules(sub) -> None:
    import importlib
    import importlib.util

    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbus", description="RLVR post-training where every role is a process on NATS JetStream.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats-creds", metavar="FILE",
                   help="log in to NATS with this .creds file (user JWT + nkey seed, as `nsc` writes it; needs the "
                        "nkeys package); sets RLBUS_NATS_CREDS for every connection of the command. Without it, "
                        "RLBUS_NATS_USER and RLBUS_NATS_PASSWORD (or RLBUS_NATS_PASSWORD_FILE) are used, if set")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run a whole config locally (embedded NATS unless --nats-url)",
                        description="Prepare the model (build + SFT), start NATS and every role as its own process, "
                                    "show a live view, stop at the limits, and write <run-dir>/<run_id>/summary.json.")
    up.add_argument("config", nargs="?", help="run config TOML, e.g. examples/demo.toml (optional with --resume)")
    up.add_argument("--resume", metavar="RUN_PATH", help="continue the run in <run-dir>/<run_id> whose launcher died: "
                    "its config, model, checkpoints and streams are reused; a CONFIG given too must match")
    up.add_argument("--run-dir", help="parent folder of runs (default: run.run_dir, 'runs')")
    up.add_argument("--run-id", help="run id (default: <config>-<time>)")
    up.add_argument("--max-steps", type=int, help="stop after N learner steps")
    up.add_argument("--max-minutes", type=float, help="stop after M minutes of wall time, set-up included")
    up.add_argument("--nats-url", help="use this NATS server instead of starting an embedded one")
    up.add_argument("--allow-degraded-sandbox", action="store_true",
                    help="run tool calls and tests WITHOUT sandbox isolation where bubblewrap is missing "
                         "(sets sandbox.allow_degraded=true; the console and summary.json say so)")
    up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. learner.lr=1e-4")
    up.add_argument("--debug", action="store_true",
                    help="show the Python traceback when the run stops on an unexpected error (by default one "
                         "plain line names the error and the command that continues the run)")

    w = sub.add_parser("worker", help="run one role as one process",
                       description="Run exactly one role. Workers talk only over NATS; the run folder holds the prepared model.")
    w.add_argument("role", choices=ROLES, help="which role")
    w.add_argument("--config", required=True, help="run config (TOML, or the config.json `up` writes)")
    w.add_argument("--nats-url", help="NATS server URL (default: run.nats_url, else nats://127.0.0.1:4222)")
    w.add_argument("--run-id", help="run id (default: run.run_id)")
    w.add_argument("--run-dir", help="parent folder of runs (default: run.run_dir)")
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    w.add_argument("--max-messages", type=int, metavar="N",
                   help="stop after N units of the role's work (tests): "
                        + "; ".join(f"{role}: {unit}" for role, unit in ROLE_LIMIT.items()))
    w.add_argument("--until-idle", type=float, help="stop after S seconds without work (tests)")

    im = sub.add_parser("init-model", help="build a tiny HF-format causal LM (BPE or char tokenizer) locally")
    im.add_argument("out", help="output folder")
    im.add_argument("--tokenizer", choices=("bpe", "char"), default="bpe",
                    help="bpe: byte-level BPE with a ChatML chat template (default); char: one id per character")
    im.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    for flag, default in (("--hidden-size", 128), ("--num-layers", 4), ("--num-heads", 4), ("--seed", 0)):
        im.add_argument(flag, type=int, default=default)

    sft = sub.add_parser("sft", help="supervised warm start on arith demonstrations (progress bar)")
    sft.add_argument("model", help="HF model folder to start from")
    sft.add_argument("out", help="output folder")
    sft.add_argument("--seconds", type=float, default=75.0)
    sft.add_argument("--max-steps", type=int, default=100_000)
    sft.add_argument("--difficulty", type=int, default=3)
    sft.add_argument("--batch-size", type=int, default=64)
    sft.add_argument("--lr", type=float, default=3e-3)
    sft.add_argument("--threads", type=int, default=2)
    sft.add_argument("--seed", type=int, default=0)

    st = sub.add_parser("status", help="where a run stands: step, version, stage rates and depths, workers",
                        description="Read a run's state from the bus (consumes nothing). Without --run-id: the single "
                                    "active run under --run-dir, or the single run on the server.")
    st.add_argument("--run-dir", help="parent folder of runs, as with `up` (finds the server URL in run.json)")
    st.add_argument("--nats-url", help="NATS server URL")
    st.add_argument("--run-id", help="run id")
    st.add_argument("--json", action="store_true", help="print exactly one JSON line")
    st.add_argument("--listen", type=float, default=2.5, help="seconds to listen for heartbeats and rates")

    t = sub.add_parser("tail", help="print decoded messages live from a subject wildcard (consumes nothing)")
    t.add_argument("subject", help="subject or wildcard, e.g. 'rewards.>' or 'traj.<run>.arith'")
    t.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    t.add_argument("--json", action="store_true", help="one JSON object per line")
    t.add_argument("--max", type=int, help="stop after N messages")
    t.add_argument("--timeout", type=float, help="stop after S seconds")

    dlq = sub.add_parser("dlq", help="list, show and replay a run's dead letters",
                         description="Dead letters are messages a stage rejected or that exceeded their consumer's "
                                     "max_deliver; each keeps its reason, delivery count and the original bytes.",
                         epilog=DLQ_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    dlq.add_argument("action", choices=("list", "show", "replay"), help="list all, show one, or replay some")
    dlq.add_argument("seqs", nargs="*", type=int, metavar="SEQ", help="DLQ sequence number(s) (show: one; replay: any)")
    dlq.add_argument("--all", action="store_true", help="replay: every letter not yet replayed")
    dlq.add_argument("--run-id", required=True, help="the run whose DLQ to read")
    dlq.add_argument("--nats-url", help="NATS server URL (default: the one recorded in <run-dir>/<run_id>/run.json)")
    dlq.add_argument("--run-dir", help="parent folder of runs, as with `up` (to find the recorded server URL)")
    dlq.add_argument("--json", action="store_true", help="machine-readable output (one JSON object per line)")
    _register_command_modules(sub)
    return p


def _dlq_url(args) -> str:
    """--nats-url, else the URL the launcher recorded in <run-dir>/<run_id>/ (run.json or config.json)."""
    import json

    if args.nats_url:
        return args.nats_url
    if not args.run_dir:
        sys.exit("rlbus dlq: give --nats-url URL, or --run-dir DIR where `rlbus up` recorded the run's server")
    run_path = Path(args.run_dir) / args.run_id
    for name, keys in (("run.json", ("nats_url",)), ("config.json", ("run", "nats_url"))):
        try:
            value = json.loads((run_path / name).read_text())
            for key in keys:
                value = value[key]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if value:
            from schemas.redact import strip_credentials

            return strip_credentials(value)  # stored redacted: the login comes from RLBUS_NATS_USER/PASSWORD
    sys.exit(f"rlbus dlq: no server URL recorded in {run_path} (run.json / config.json); pass --nats-url URL")


def _dlq(args) -> int:
    import json

    from bus.conn import connect
    from bus.subjects import Registry
    from rlbus.log import configure_logging
    from scheduler import dlq
    from schemas import DecodeError, decode

    configure_logging("dlq", args.run_id, level="WARNING")  # logs go to stderr; stdout is the answer
    if args.action == "list" and args.seqs:
        sys.exit("rlbus dlq list takes no SEQ (use show SEQ)")
    if args.action == "show" and len(args.seqs) != 1:
        sys.exit("rlbus dlq show takes exactly one SEQ")
    if args.action == "replay" and not args.seqs and not args.all:
        sys.exit("rlbus dlq replay needs SEQ... or --all")
    if args.action != "replay" and args.all:
        sys.exit("--all only applies to replay")
    url = _dlq_url(args)
    reg = Registry(args.run_id)

    def row(seq, letter, replayed):
        return {"seq": seq, "stage": letter.stage, "error_type": letter.error_type, "deliveries": letter.delivery_count,
                "subject": letter.original_subject, "reason": letter.reason, "task_msg_id": letter.task_msg_id,
                "replayed": bool(replayed)}

    async def go() -> int:
        nc = await connect(url, name="rlbus-dlq")
        js = nc.jetstream(timeout=10)
        try:
            if args.action == "list":
                letters = await dlq.list_letters(js, reg)
                if not args.json:
                    print(f"{len(letters)} dead letter(s) in {reg.stream('DLQ')}")
                    if letters:
                        print(f"{'SEQ':>5}  {'STAGE':<9} {'TYPE':<15} {'DLV':>3}  {'REPLAYED':<8}  SUBJECT  REASON")
                for seq, letter in letters:
                    r = row(seq, letter, await dlq.replayed(js, reg, seq))
                    if args.json:
                        print(json.dumps(r))
                    else:
                        print(f"{seq:>5}  {r['stage']:<9} {r['error_type']:<15} {r['deliveries']:>3}  "
                              f"{'yes' if r['replayed'] else 'no':<8}  {r['subject']}  {r['reason']}")
                return 0
            if args.action == "show":
                try:
                    letter = await dlq.show(js, reg, args.seqs[0])
                except KeyError as exc:
                    sys.exit(f"rlbus dlq: {exc.args[0]}")
                body = letter.model_dump(mode="python", exclude={"original_data"})
                try:
                    original = decode(letter.original_data)
                    body["original"] = {"kind": original.KIND, **original.model_dump(mode="json", exclude_none=True)}
                except DecodeError as exc:
                    body["original"] = {"undecodable": str(exc), "bytes": len(letter.original_data)}
                body["replayed"] = await dlq.replayed(js, reg, args.seqs[0])
                print(json.dumps(body, indent=None if args.json else 2, default=str))
                return 0
            seqs = list(args.seqs)
            if args.all:
                seqs += [s for s, _ in await dlq.list_letters(js, reg)
                         if s not in seqs and not await dlq.replayed(js, reg, s)]
            try:
                stored = await dlq.replay(js, reg, seqs)
            except KeyError as exc:
                sys.exit(f"rlbus dlq: {exc.args[0]}")
            print(json.dumps({"replayed": seqs, "stored": stored}) if args.json
                  else f"replayed {len(seqs)} letter(s) {seqs}; {stored} stored (the rest were duplicates within the window)")
            return 0
        finally:
            await nc.close()

    return asyncio.run(go())


def _worker(args) -> int:
    from bus.session import WorkerContext
    from rlbus.log import configure_logging
    from schemas.config import load_config

    cfg = load_config(args.config, args.set)
    run_id = args.run_id or cfg.run.run_id
    if not run_id:
        sys.exit("worker needs a run id: --run-id ID or run.run_id in the config")
    configure_logging(args.role, run_id)
    if cfg.sandbox.allow_degraded:  # code verifiers open sandboxes without the config: they read the env
        from sandbox_workers.process import ALLOW_DEGRADED_ENV

        os.environ[ALLOW_DEGRADED_ENV] = "1"
    run_dir = Path(args.run_dir or cfg.run.run_dir)
    ctx = WorkerContext(run_id=run_id, nats_url=_worker_url(args, cfg),
                        run_path=run_dir / run_id, max_messages=args.max_messages, until_idle=args.until_idle,
                        configured_model=cfg.model.path)
    module = {"sampler": "producers.sampler", "rollout": "rollout_workers.worker", "verifier": "verifier_workers.worker",
              "learner": "learner.worker", "scheduler": "scheduler.worker", "sandbox": "sandbox_workers.service",
              "tracker": "rlbus.tracker"}[args.role]
    import importlib

    asyncio.run(importlib.import_module(module).run(cfg, ctx))
    return 0


def _worker_url(args, cfg) -> str:
    """--nats-url, else env RLBUS_NATS_URL (how `rlbus up` hands over credentials), else the config's."""
    from schemas.redact import NATS_URL_ENV, is_redacted

    url = args.nats_url or os.environ.get(NATS_URL_ENV) or cfg.run.nats_url or "nats://127.0.0.1:4222"
    if is_redacted(url):
        sys.exit(f"rlbus worker: the NATS URL's password is redacted ('***', as the run folder keeps it); pass the "
                 f"real URL in env {NATS_URL_ENV} or --nats-url, or a URL without credentials and the login in "
                 "RLBUS_NATS_USER / RLBUS_NATS_PASSWORD")
    return url


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the command; a refused NATS login or permission exits with its reason."""
    from bus.conn import NatsAuthError, PermissionDenied

    args = _parser().parse_args(argv)
    if args.nats_creds:
        from bus.auth import ENV_CREDS

        os.environ[ENV_CREDS] = str(Path(args.nats_creds).resolve())  # every connection, child processes too
    try:
        return _main(args)
    except (NatsAuthError, PermissionDenied) as exc:
        sys.exit(f"rlbus {args.command}: {exc}")
    except BrokenPipeError:  # `rlbus ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _up(args: argparse.Namespace) -> int:
    from rlbus.launcher import up
    from rlbus.log import configure_logging
    from schemas.config import ConfigError, load_config

    overrides = list(args.set)
    for flag, key in (("run_dir", "run.run_dir"), ("run_id", "run.run_id"), ("max_steps", "run.max_steps"),
                      ("max_minutes", "run.max_minutes"), ("nats_url", "run.nats_url")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if args.allow_degraded_sandbox:
        overrides.append("sandbox.allow_degraded=true")
    if args.resume:
        return _resume(args, overrides)
    if not args.config:
        sys.exit("rlbus up: give a CONFIG (e.g. examples/demo.toml), or --resume <run-dir>/<run_id>")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        sys.exit(str(exc))
    configure_logging("launcher", cfg.run.run_id or None, level="WARNING")
    return up(cfg, args.config, debug=args.debug)


def _resume(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlbus.launcher import up
    from rlbus.log import configure_logging
    from rlbus.resume import ResumeError, resumed_config
    from schemas.config import ConfigError

    if args.run_id or args.run_dir:
        sys.exit("rlbus up --resume: the run folder names the run; drop --run-id/--run-dir")
    try:
        cfg = resumed_config(Path(args.resume), args.config, [o for o in overrides if not o.startswith("run.nats_url")])
    except (ResumeError, ConfigError) as exc:
        sys.exit(f"rlbus up --resume: {exc}")
    if args.nats_url:
        cfg.run.nats_url = args.nats_url
    configure_logging("launcher", cfg.run.run_id or None, level="WARNING")
    try:
        return up(cfg, args.config, resume=Path(args.resume), debug=args.debug)
    except ResumeError as exc:
        sys.exit(f"rlbus up --resume: {exc}")


def _init_model(args: argparse.Namespace) -> int:
    from rlbus.tiny_model import build_tiny_model

    path = build_tiny_model(Path(args.out), arch=args.arch, hidden_size=args.hidden_size,
                            num_layers=args.num_layers, num_heads=args.num_heads, seed=args.seed,
                            tokenizer=args.tokenizer)
    print(f"tiny model ({args.tokenizer} tokenizer) written to {path}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from learner.sft import run_sft
    from producers import arith
    from producers.demos import batches_of

    def demo(rng):
        p = arith.generate(rng, args.difficulty)
        return p.prompt, p.completion

    stats = run_sft(Path(args.model), Path(args.out), batches_of(demo, args.seed, args.batch_size),
                    seconds=args.seconds, max_steps=args.max_steps, lr=args.lr, seed=args.seed,
                    threads=args.threads, progress=True)
    print(stats)
    return 0


def _status(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from rlbus.status import StatusError, collect, find_run, render

    try:
        run_id, url = find_run(Path(args.run_dir) if args.run_dir else None, args.run_id, args.nats_url)
        if not url:
            raise StatusError("pass --nats-url, or --run-dir to read it from the run's run.json")
        status = asyncio.run(collect(url, run_id, args.listen))
    except StatusError as exc:
        sys.exit(f"rlbus status: {exc}")
    if args.json:
        print(json.dumps(status))
    else:
        for table in render(status):
            Console().print(table)
    return 0


def _tail(args: argparse.Namespace) -> int:
    from bus.tail import tail

    asyncio.run(tail(args.nats_url, args.subject, args.json, args.max, timeout=args.timeout))
    return 0


COMMANDS = {"worker": _worker, "dlq": _dlq, "up": _up, "init-model": _init_model, "sft": _sft, "status": _status,
            "tail": _tail}


def _main(args: argparse.Namespace) -> int:
    # models load from local paths only; transformers' own progress bars are noise here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.command not in ("worker", "up"):
        from rlbus.log import configure_logging

        # one-shot commands: stdout holds only their answer, warnings go to stderr
        configure_logging(args.command, level="WARNING")
    if getattr(args, "func", None) is not None:
        return int(args.func(args) or 0)
    command = COMMANDS.get(args.command)
    return command(args) if command else 2


if __name__ == "__main__":
    sys.exit(main())
