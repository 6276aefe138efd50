"""`rlbus dlq list|show|replay`: inspect and replay a run's dead letters.

Guarantees:
- `list` and `show` read only (stream info, direct gets, the KV replay records).
- `replay SEQ...` (or `--all`: every letter not yet replayed) republishes each letter's
  original bytes to its original subject with Nats-Msg-Id `<original>.replay-<SEQ>`, so
  JetStream de-duplication does not drop it, and records the replay in the run's KV
  bucket (`dlq.replayed.<SEQ>`, `scheduler.dlq`); a letter replayed twice within the
  de-duplication window is stored once.
- The server is `--nats-url`, else the URL the run recorded (`RunFolder.server_url`, under
  `--run-dir`); without either it exits saying what to pass. stdout holds only the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

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


def register(sub) -> None:
    """Add `rlbus dlq` to the CLI's subparsers."""
    dlq = sub.add_parser(
        "dlq",
        help="list, show and replay a run's dead letters",
        description="Dead letters are messages a stage rejected or that exceeded their consumer's "
        "max_deliver; each keeps its reason, delivery count and the original bytes.",
        epilog=DLQ_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dlq.add_argument("action", choices=("list", "show", "replay"), help="list all, show one, or replay some")
    dlq.add_argument("seqs", nargs="*", type=int, metavar="SEQ", help="DLQ sequence number(s) (show: one; replay: any)")
    dlq.add_argument("--all", action="store_true", help="replay: every letter not yet replayed")
    dlq.add_argument("--run-id", required=True, help="the run whose DLQ to read")
    dlq.add_argument("--nats-url", help="NATS server URL (default: the one recorded in <run-dir>/<run_id>/run.json)")
    dlq.add_argument("--run-dir", help="parent folder of runs, as with `up` (to find the recorded server URL)")
    dlq.add_argument("--json", action="store_true", help="machine-readable output (one JSON object per line)")
    dlq.set_defaults(func=main)


def dlq_url(args) -> str:
    """--nats-url, else the URL the launcher recorded in <run-dir>/<run_id>/ (run.json or config.json)."""
    from rlbus.run.folder import RunFolder

    if args.nats_url:
        return args.nats_url
    if not args.run_dir:
        sys.exit("rlbus dlq: give --nats-url URL, or --run-dir DIR where `rlbus up` recorded the run's server")
    folder = RunFolder.of(args.run_dir, args.run_id)
    url = folder.server_url()  # stored redacted: the login comes from RLBUS_NATS_USER/PASSWORD
    if not url:
        sys.exit(f"rlbus dlq: no server URL recorded in {folder.path} (run.json / config.json); pass --nats-url URL")
    return url


def main(args) -> int:
    """Entry point of `rlbus dlq`."""
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
    url = dlq_url(args)
    reg = Registry(args.run_id)

    def row(seq, letter, replayed):
        return {
            "seq": seq,
            "stage": letter.stage,
            "error_type": letter.error_type,
            "deliveries": letter.delivery_count,
            "subject": letter.original_subject,
            "reason": letter.reason,
            "task_msg_id": letter.task_msg_id,
            "replayed": bool(replayed),
        }

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
                        print(
                            f"{seq:>5}  {r['stage']:<9} {r['error_type']:<15} {r['deliveries']:>3}  "
                            f"{'yes' if r['replayed'] else 'no':<8}  {r['subject']}  {r['reason']}"
                        )
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
                seqs += [
                    s
                    for s, _ in await dlq.list_letters(js, reg)
                    if s not in seqs and not await dlq.replayed(js, reg, s)
                ]
            try:
                stored = await dlq.replay(js, reg, seqs)
            except KeyError as exc:
                sys.exit(f"rlbus dlq: {exc.args[0]}")
            print(
                json.dumps({"replayed": seqs, "stored": stored})
                if args.json
                else f"replayed {len(seqs)} letter(s) {seqs}; {stored} stored (the rest were duplicates within the window)"
            )
            return 0
        finally:
            await nc.close()

    return asyncio.run(go())
