"""`rlbus rescore RUN_PATH --domain D`: score a run's stored samples again, and compare.

A reward looks wrong, the verifier is fixed (or made stricter): re-score the samples the
run already trained on, without running the policy again.

Guarantees:
- The trajectories are the ones stored in the run's REWARDS log (each Reward embeds
  its Trajectory), read from a live run's server or a finished run's stored JetStream
  (`rlbus.run.reader`), in stream order, the first `--limit` of domain D.
- They are scored on the controlled side by the verifier worker's own code
  (`verifier_workers.worker.Scorer`: the tool-result integrity check against the run's
  `toolrec-<run>` records, the task's check and hidden payload from KV `hidden-<run>`, then `score`,
  i.e. the registered verifier and the reward composition with the domain's weights).
  `--verifier NAME` scores with another registered verifier (built-in, plugin, or
  `register()`ed); `--set verifier.PARAM=VALUE` overrides one of the trajectory's
  public `verifier_params` (VALUE is read as JSON, else taken as a string).
- A sample that cannot be scored (unusable input, infrastructure failure, a crash) is
  `error`, with the reason in the report; it is never a reward, and counts as changed.
- Pass: a sample passes when its `correct` component is >= `--pass-threshold` (default
  0.5), or, when it has no `correct` component, its scalar reward is. Changed: the new
  scalar reward differs from the stored one (by more than 1e-9), or the status differs,
  or scoring failed.
- It never changes the run's records: nothing is published, acked, put into a KV bucket
  or written to the run store (run.db). It writes one new file, the JSON report
  `<run>/rescore/<UTC time>.json` (never overwriting one).
- Its last stdout line is one JSON object: `{"changed", "total", "confusion",
  "changed_ids", "report"}`; confusion keys are `old->new` of pass/fail/error
  (`pass->fail`, ...), changed_ids are trajectory msg_ids (for `rlbus samples --id`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlbus.run.reader import RunReadError, check_domain, iter_rewards, jetstream, reach_run
from schemas import Reward, Trajectory

CHANGE_EPS = 1e-9
OUTCOMES = ("pass", "fail", "error")
SHOW_CHANGED = 20

EPILOG = """examples:
  rlbus rescore runs/demo-20250101-120000 --domain arith                       # same verifier: expect 0 changed
  rlbus rescore runs/demo-20250101-120000 --domain math --verifier my_math     # a fixed verifier (plugin)
  rlbus rescore runs/demo-20250101-120000 --domain judge --set verifier.threshold=0.8 --limit 500
  rlbus rescore RUN --domain arith | tail -1 | jq .changed_ids                 # the machine-readable line
  rlbus samples RUN --id <changed id> --full                                   # then read a changed sample

Pass means: the `correct` component >= --pass-threshold (the scalar reward where there is
no `correct`). The report (every sample, old and new reward, status, components and
details) is written to RUN_PATH/rescore/<UTC time>.json; the run's own records are never
changed. Needs the tool-result secret the run's verifier used when samples carry tool
observations: RLBUS_TOOL_SECRET(_FILE), else RUN_PATH/secrets/tool_key.
"""


class RescoreError(RuntimeError):
    """A re-score that cannot be done as asked; the message says why and what to do."""


@dataclass
class _Stored:
    """A stored trajectory handed to the worker's Scorer as if it were its first delivery."""

    msg: Trajectory
    delivered: int = 1


def parse_sets(items: list[str]) -> dict:
    """`verifier.PARAM=VALUE` items as {PARAM: value} (VALUE as JSON, else the string)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        param = key.strip().removeprefix("verifier.")
        if not sep or not key.strip().startswith("verifier.") or not param:
            raise RescoreError(
                f"--set {item!r}: expected verifier.PARAM=VALUE (a public verifier parameter of "
                "the trajectories, e.g. --set verifier.threshold=0.8)"
            )
        try:
            out[param] = json.loads(raw)
        except ValueError:
            out[param] = raw
    return out


def retarget(traj: Trajectory, verifier: str | None, params: dict) -> Trajectory:
    """The trajectory as the new verifier should see it (unchanged without overrides)."""
    if not verifier and not params:
        return traj
    new = traj.model_copy(
        update={"verifier": verifier or traj.verifier, "verifier_params": {**traj.verifier_params, **params}}
    )
    new._wire = None  # the stored wire map no longer describes it
    return new


def outcome(reward: Reward | None, threshold: float) -> str:
    """pass / fail (see the module's pass rule), or error when there is no reward."""
    if reward is None:
        return "error"
    value = reward.components.get("correct", reward.reward)
    return "pass" if value >= threshold else "fail"


def _summary(rw: Reward) -> dict:
    return {"reward": rw.reward, "status": rw.status, "components": dict(rw.components), "details": rw.details}


def compare(seq: int, old: Reward, new: Reward | None, error: str | None, threshold: float) -> dict:
    """One sample's row of the report."""
    traj = old.trajectory
    changed = new is None or abs(new.reward - old.reward) > CHANGE_EPS or new.status != old.status
    return {
        "seq": seq,
        "msg_id": traj.msg_id,
        "task_id": traj.task_id,
        "sample_index": traj.sample_index,
        "verifier": {"old": traj.verifier, "new": new.trajectory.verifier if new else None},
        "old": _summary(old),
        "new": _summary(new) if new else None,
        "error": error,
        "old_outcome": outcome(old, threshold),
        "new_outcome": outcome(new, threshold),
        "changed": changed,
    }


def tool_secret(run_path: Path) -> bytes | None:
    """The verifier's tool-result secret: env, else the run's key file; never created here."""
    from sandbox_workers.integrity import SecretMissing, check_secret, load_secret

    try:
        secret = load_secret()
        key = run_path / "secrets" / "tool_key"
        if secret is None and key.exists():
            secret = check_secret(key.read_bytes().strip())
    except (SecretMissing, ValueError, OSError) as exc:
        raise RescoreError(f"tool-result secret: {exc}") from None
    return secret


async def rescore_rows(
    access, domain: str, verifier: str | None, params: dict, limit: int | None, threshold: float
) -> list[dict]:
    """Re-score the stored samples of `domain`; one comparison row each."""
    from bus.hidden import HiddenCache
    from bus.pull import Reject, Retry
    from verifier_workers.worker import RetryPolicy, Scorer

    rows: list[dict] = []
    async with jetstream(access, "rlbus-rescore") as js:
        await check_domain(js, access.reg, domain)
        # max_deliver=1: an infrastructure failure is final at once (Reject), never retried here
        # the check comes from the run's hidden bucket (bus.checks), as in the verifier worker; the
        # operator's --verifier/--set apply after it, never the stored trajectory's own copies
        scorer = Scorer(
            HiddenCache(js, access.reg),
            RetryPolicy(max_deliver=1),
            0,
            js,
            access.reg,
            tool_secret(access.run_path),
            retarget=lambda t: retarget(t, verifier, params),
        )
        async for seq, old in iter_rewards(js, access.reg, domain):
            if limit is not None and len(rows) >= limit:
                break
            new, error = None, None
            try:
                new = await scorer.one(_Stored(old.trajectory))
            except (Reject, Retry) as exc:
                error = exc.reason
            except Exception as exc:  # noqa: BLE001 - one sample's failure is reported, the others still score
                error = f"{type(exc).__name__}: {exc}"
            rows.append(compare(seq, old, new, error, threshold))
    return rows


def confusion(rows: list[dict]) -> dict[str, int]:
    """Counts of `old->new` outcomes (every pair with an old pass/fail, zeros included)."""
    out = {f"{a}->{b}": 0 for a in OUTCOMES[:2] for b in OUTCOMES}
    for r in rows:
        key = f"{r['old_outcome']}->{r['new_outcome']}"
        out[key] = out.get(key, 0) + 1
    return out


def write_report(run_path: Path, report: dict) -> Path:
    """Write `report` to a new file `<run>/rescore/<UTC time>[-N].json`; its path."""
    folder = run_path / "rescore"
    folder.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):
        path = folder / (f"{stamp}.json" if n == 0 else f"{stamp}-{n}.json")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
        return path
    raise RescoreError(f"could not find a free report name under {folder}")


def check_verifier(name: str | None) -> None:
    """RescoreError when `--verifier NAME` is not registered (the message lists the known ones)."""
    if name is None:
        return
    from verifier_workers.registry import get
    from verifier_workers.verdict import VerifierInputError

    try:
        get(name)
    except VerifierInputError as exc:
        raise RescoreError(f"--verifier: {exc}") from None


def rescore(
    run_path: str | os.PathLike,
    domain: str,
    verifier: str | None = None,
    sets: list[str] = (),
    limit: int | None = None,
    threshold: float = 0.5,
    nats_url: str | None = None,
    say=print,
) -> dict:
    """Re-score, write the report, and return the summary `{changed, total, confusion, changed_ids, report}`."""
    params = parse_sets(list(sets))
    check_verifier(verifier)
    with reach_run(run_path, nats_url) as access:
        say(f"rescoring domain {domain} of {access.describe()}")
        rows = asyncio.run(rescore_rows(access, domain, verifier, params, limit, threshold))
    changed_ids = [r["msg_id"] for r in rows if r["changed"]]
    summary = {
        "changed": len(changed_ids),
        "total": len(rows),
        "confusion": confusion(rows),
        "changed_ids": changed_ids,
    }
    report = {
        "run_id": access.run_id,
        "domain": domain,
        "created_at": time.time(),
        "source": access.source,
        "verifier": verifier,
        "set": params,
        "limit": limit,
        "pass_rule": f"correct component >= {threshold} (scalar reward when there is no correct component)",
        **summary,
        "errors": sum(r["error"] is not None for r in rows),
        "samples": rows,
    }
    summary["report"] = str(write_report(access.run_path, report))
    return {**summary, "rows": rows}


def print_comparison(result: dict, verifier: str | None, params: dict, threshold: float) -> None:
    """The human part of the output (everything before the last, JSON, line)."""
    rows = result["rows"]
    olds = sorted({r["verifier"]["old"] for r in rows})
    print(
        f"verifier {', '.join(olds) or '-'} -> {verifier or 'same'}"
        + (f"; params set: {json.dumps(params)}" if params else "")
    )
    print(
        f"pass = `correct` component >= {threshold:g} (the scalar reward where a sample has no `correct`); "
        "error = could not be scored"
    )
    print(f"rescored {result['total']} sample(s): {result['changed']} changed")
    c = result["confusion"]
    print(f"{'':>10}{'new pass':>10}{'new fail':>10}{'new error':>11}")
    for old in OUTCOMES[:2]:
        print(
            f"{'old ' + old:>10}" + "".join(f"{c[f'{old}->{new}']:>{10 if new != 'error' else 11}}" for new in OUTCOMES)
        )
    changed = [r for r in rows if r["changed"]]
    if changed:
        print("changed samples (read one with `rlbus samples RUN_PATH --id MSG_ID --full`):")
    for r in changed[:SHOW_CHANGED]:
        new = f"{r['new']['reward']:.4g} ({r['new']['status']})" if r["new"] else f"error: {r['error'][:120]}"
        print(f"  seq {r['seq']}  {r['msg_id']}  reward {r['old']['reward']:.4g} ({r['old']['status']}) -> {new}")
    if len(changed) > SHOW_CHANGED:
        print(f"  … {len(changed) - SHOW_CHANGED} more in the report")
    print(f"report: {result['report']}")


def _main(args) -> int:
    try:
        result = rescore(
            args.run_path, args.domain, args.verifier, args.set, args.limit, args.pass_threshold, args.nats_url
        )
    except (RescoreError, RunReadError) as exc:
        print(f"rlbus rescore: {exc}", file=sys.stderr)
        return 2
    print_comparison(result, args.verifier, parse_sets(args.set), args.pass_threshold)
    print(json.dumps({k: result[k] for k in ("changed", "total", "confusion", "changed_ids", "report")}))
    return 0


def register(sub) -> None:
    """Add `rlbus rescore` to the `rlbus` parser."""
    p = sub.add_parser(
        "rescore",
        help="re-score a run's stored samples with a (changed) verifier and compare",
        description="Score the stored trajectories of one domain again, on the controlled side, with "
        "the run's hidden data and tool records, through the verifier worker's code; print "
        "how many rewards changed, the pass/fail confusion and the changed samples' ids. "
        "Works on a live or a finished run; never changes the run's records.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_path", metavar="RUN_PATH", help="the run folder, <run-dir>/<run_id>")
    p.add_argument("--domain", required=True, metavar="D", help="the domain whose samples to re-score")
    p.add_argument("--verifier", metavar="NAME", help="score with this registered verifier instead of the samples' own")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="verifier.PARAM=VALUE",
        help="override a public verifier parameter of every sample (VALUE as JSON, else a string); repeatable",
    )
    p.add_argument("--limit", type=int, metavar="N", help="re-score only the first N stored samples of the domain")
    p.add_argument(
        "--pass-threshold",
        type=float,
        default=0.5,
        metavar="T",
        help="pass = `correct` component >= T (the scalar reward where there is none); default 0.5",
    )
    p.add_argument(
        "--nats-url",
        help="the run's NATS server (default: nats_url in RUN_PATH/run.json; without an "
        "answering server, the run's stored JetStream is read)",
    )
    p.set_defaults(func=_main)
