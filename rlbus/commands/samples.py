"""`rlbus samples RUN_PATH`: every scored sample of a run, read back from its REWARDS log.

Each stored `Reward` embeds its `Trajectory`, so the log holds every sample the verifier
scored: turns (role, text, token ids, behaviour log-probs, loss mask, policy version),
tool calls with their results, reward components and verifier status.

Guarantees:
- Works on a live run (its server) and on a finished one (its stored JetStream, under a
  server started and stopped by the command): see `rlbus.run.reader`. Reads only:
  nothing is consumed, acked, published or written.
- Samples come in stream order. Filters: `--domain`, `--version-min` (the trajectory's
  `policy_version`), `--reward-min`, `--id` (trajectory or reward msg_id, repeatable),
  then `--limit` on what is left.
- `--json`: one JSON object per line on stdout, nothing else there (the summary goes to
  stderr).
  - With `--full`: `{msg_id, domain, task_id, group_id, sample_index, turns: [{role,
    text, token_ids, logprobs, trainable, policy_version}], tool_calls, reward,
    components, status}`, plus `seq`, `reward_msg_id`, `purpose`, `policy_version`,
    `verifier`, `finish_reason`, `drift`, `details`. Token ids and log-probs are lists, unpacked
    from the wire's arrays: assistant turns carry one log-prob per token id. Each tool
    call is its `ToolCall` fields plus `result`, the text of the tool turn after it.
  - Without: `{seq, msg_id, domain, task_id, sample_index, purpose, policy_version,
    reward, status, components, prompt, answer, turns, tool_calls, tokens,
    finish_reason, drift}`, where `prompt` is the first prompt turn's text (cut at
    COMPACT_TEXT characters), `answer` the trajectory's `final_text`, and `turns`,
    `tool_calls` are counts.
- Text output shows every turn with the same fields; without `--full`, long texts and
  token lists are cut (the cut is marked), with `--full` nothing is.
- `drift` is the trajectory's count of harness calls whose re-rendered history did not
  start with the recorded ids (`rollout_workers.endpoint`; 0 for rlbus-owned loops).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field

from rlbus.run.reader import RewardCounts, RunReadError, check_domain, iter_rewards, jetstream, reach_run
from schemas import Reward, Trajectory, Turn, unpack_f32, unpack_i32

COMPACT_TEXT = 300
TEXT_CUT = 160
LIST_CUT = 16

EPILOG = """examples:
  rlbus samples runs/demo-20250101-120000 --limit 5                 # the first 5 scored samples
  rlbus samples runs/demo-20250101-120000 --domain arith --reward-min 1 --version-min 10
  rlbus samples runs/demo-20250101-120000 --json | jq .reward        # one compact object per line
  rlbus samples runs/demo-20250101-120000 --json --full --limit 1    # every turn, token id and log-prob
  rlbus samples runs/demo-20250101-120000 --id 3f2a...-0 --full      # one sample (ids from `rlbus rescore`)

RUN_PATH is one run's folder. A live run is read from its server (run.json's nats_url);
a finished one from its stored JetStream (RUN_PATH/nats), under a nats-server started on
a free loopback port for the command and stopped when it exits.
"""


@dataclass
class Filters:
    """Which stored samples to show."""

    domain: str | None = None
    version_min: int | None = None
    reward_min: float | None = None
    ids: set[str] = field(default_factory=set)
    limit: int | None = None

    def keep(self, rw: Reward) -> bool:
        traj = rw.trajectory
        if self.version_min is not None and traj.policy_version < self.version_min:
            return False
        if self.reward_min is not None and rw.reward < self.reward_min:
            return False
        return not self.ids or traj.msg_id in self.ids or rw.msg_id in self.ids


# -- records ---------------------------------------------------------------------------


def turn_record(t: Turn) -> dict:
    """One turn as plain JSON values (packed arrays unpacked to lists)."""
    return {
        "role": t.role,
        "text": t.text,
        "token_ids": unpack_i32(t.token_ids).tolist(),
        "logprobs": unpack_f32(t.logprobs).tolist(),
        "trainable": t.trainable,
        "policy_version": t.policy_version,
    }


def tool_call_records(traj: Trajectory) -> list[dict]:
    """Each tool call's fields plus `result`: the tool turn after its assistant turn (None if absent)."""
    out = []
    for call in traj.tool_calls:
        after = call.turn + 1
        result = traj.turns[after].text if after < len(traj.turns) and traj.turns[after].role == "tool" else None
        out.append({**call.model_dump(mode="json"), "result": result})
    return out


def full_record(seq: int, rw: Reward) -> dict:
    """The `--json --full` object of a stored reward."""
    traj = rw.trajectory
    return {
        "msg_id": traj.msg_id,
        "domain": traj.domain,
        "task_id": traj.task_id,
        "group_id": traj.group_id,
        "sample_index": traj.sample_index,
        "turns": [turn_record(t) for t in traj.turns],
        "tool_calls": tool_call_records(traj),
        "reward": rw.reward,
        "components": dict(rw.components),
        "status": rw.status,
        "seq": seq,
        "reward_msg_id": rw.msg_id,
        "purpose": traj.purpose,
        "policy_version": traj.policy_version,
        "verifier": traj.verifier,
        "finish_reason": traj.finish_reason,
        "drift": traj.drift,
        "details": rw.details,
    }


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + f"…[+{len(text) - n} chars]"


def compact_record(seq: int, rw: Reward) -> dict:
    """The `--json` object (without --full) of a stored reward."""
    traj = rw.trajectory
    prompt = next((t.text for t in traj.turns if t.role == "prompt"), "")
    return {
        "seq": seq,
        "msg_id": traj.msg_id,
        "domain": traj.domain,
        "task_id": traj.task_id,
        "sample_index": traj.sample_index,
        "purpose": traj.purpose,
        "policy_version": traj.policy_version,
        "reward": rw.reward,
        "status": rw.status,
        "components": dict(rw.components),
        "prompt": _cut(prompt, COMPACT_TEXT),
        "answer": traj.final_text,
        "turns": len(traj.turns),
        "tool_calls": len(traj.tool_calls),
        "tokens": traj.tokens,
        "finish_reason": traj.finish_reason,
        "drift": traj.drift,
    }


# -- text ------------------------------------------------------------------------------


def _list(values: list, full: bool, fmt=str) -> str:
    shown = values if full or len(values) <= LIST_CUT else values[:LIST_CUT]
    more = "" if len(shown) == len(values) else f", … (+{len(values) - len(shown)} more)"
    return "[" + ", ".join(fmt(v) for v in shown) + more + "]"


def _text(text: str, full: bool) -> str:
    return repr(text if full else _cut(text, TEXT_CUT))


def render(seq: int, rw: Reward, full: bool) -> list[str]:
    """The text lines of one sample."""
    traj = rw.trajectory
    comps = "  ".join(f"{k}={v:g}" for k, v in rw.components.items()) or "-"
    lines = [
        f"── seq {seq}  {traj.domain}  task {traj.task_id}  sample {traj.sample_index}/{traj.group_size}  "
        f"msg_id {traj.msg_id}",
        f"   reward {rw.reward:.4g}  status {rw.status}  verifier {traj.verifier}  policy v{traj.policy_version}  "
        f"{traj.purpose}  finish {traj.finish_reason}" + (f"  drift {traj.drift}" if traj.drift else ""),
        f"   components  {comps}",
    ]
    if rw.details:
        lines.append(f"   details     {_text(rw.details, full)}")
    for i, t in enumerate(traj.turns):
        rec = turn_record(t)
        version = f"v{t.policy_version}" if t.policy_version >= 0 else "v-"
        lines.append(
            f"   turn {i} {t.role:<9} {version:<4} trainable {int(t.trainable)}  "
            f"{len(rec['token_ids'])} tokens  {_text(t.text, full)}"
        )
        if rec["token_ids"]:
            lines.append(f"          ids  {_list(rec['token_ids'], full)}")
        if rec["logprobs"]:
            lines.append(f"          logp {_list(rec['logprobs'], full, lambda v: f'{v:.4f}')}")
    for j, call in enumerate(tool_call_records(traj)):
        flags = "".join(f" {k}" for k in ("timed_out", "oom", "truncated") if call[k])
        lines.append(
            f"   tool call {j} (turn {call['turn']}) {call['tool']} exit {call['exit_code']}{flags} "
            f"{call['duration_ms']:.1f} ms exec {call['exec_id'] or '-'}: {_text(call['code'], full)}"
        )
        lines.append(f"          result {_text(call['result'] or '', full) if call['result'] is not None else '-'}")
    return lines


# -- command ---------------------------------------------------------------------------


async def _show(access, filters: Filters, as_json: bool, full: bool) -> tuple[int, RewardCounts]:
    counts, shown = RewardCounts(), 0
    async with jetstream(access, "rlbus-samples") as js:
        await check_domain(js, access.reg, filters.domain)
        async for seq, rw in iter_rewards(js, access.reg, filters.domain, counts):
            if not filters.keep(rw):
                continue
            if as_json:
                print(json.dumps(full_record(seq, rw) if full else compact_record(seq, rw)))
            else:
                print("\n".join(render(seq, rw, full)))
            shown += 1
            if filters.limit is not None and shown >= filters.limit:
                break
    return shown, counts


def _main(args) -> int:
    filters = Filters(args.domain, args.version_min, args.reward_min, set(args.id or ()), args.limit)
    note = sys.stderr if args.json else sys.stdout
    try:
        with reach_run(args.run_path, args.nats_url) as access:
            print(access.describe(), file=note)
            shown, counts = asyncio.run(_show(access, filters, args.json, args.full))
    except RunReadError as exc:
        print(f"rlbus samples: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rlbus samples ... | head`: the reader left, the server is stopped
        sys.stderr.close()
        return 0
    skipped = (
        f"; {counts.skipped} undecodable message(s) skipped (seqs {counts.skipped_seqs[:5]})" if counts.skipped else ""
    )
    print(f"{shown} sample(s) shown of {counts.read} stored reward(s) read{skipped}", file=note)
    return 0


def register(sub) -> None:
    """Add `rlbus samples` to the `rlbus` parser."""
    p = sub.add_parser(
        "samples",
        help="print a run's scored samples (turns, token ids, logprobs, rewards) from its log",
        description="Print every scored sample of a run from its REWARDS stream: each turn with role, "
        "text, token ids, behaviour log-probs, loss mask (trainable) and policy version; "
        "tool calls with their results; reward components and verifier status. Works on "
        "a live run and on a finished one; consumes and changes nothing.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_path", metavar="RUN_PATH", help="the run folder, <run-dir>/<run_id>")
    p.add_argument("--domain", metavar="D", help="only this domain's samples")
    p.add_argument("--version-min", type=int, metavar="N", help="only samples generated by policy version >= N")
    p.add_argument("--reward-min", type=float, metavar="X", help="only samples with reward >= X")
    p.add_argument(
        "--id",
        action="append",
        metavar="MSG_ID",
        help="only this sample (trajectory msg_id, or its reward's rw-... id); repeatable",
    )
    p.add_argument("--limit", type=int, metavar="N", help="stop after N samples shown")
    p.add_argument("--json", action="store_true", help="one JSON object per line (compact; see --full)")
    p.add_argument(
        "--full",
        action="store_true",
        help="everything: with --json the full object (every turn's token_ids and logprobs); as text, nothing cut",
    )
    p.add_argument(
        "--nats-url",
        help="the run's NATS server (default: nats_url in RUN_PATH/run.json; without an "
        "answering server, the run's stored JetStream is read)",
    )
    p.set_defaults(func=_main)
