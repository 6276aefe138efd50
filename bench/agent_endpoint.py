"""Agent turns through the OpenAI-compatible endpoint vs the in-process agent loop, same episodes, one run.

Run: `python bench/agent_endpoint.py [--episodes 8] [--turns 4] [--max-tokens 64] [--reps 7]
[--batch-window-ms 5] [--threads 1] [--no-nodelay] [--quick] [--out PATH]` (about 2 minutes
on 2 cores; `--quick`: a 64-wide 2-layer model, 2 episodes x 2 turns x 8 tokens, one rep).

What it measures:

- MODEL: a random-init Qwen2-shaped tiny model with rlbus's BPE tokenizer and chat template
  (`rlbus.model.tiny_model.build_tiny_model`; default hidden 256, 4 layers, 4 heads, context
  1024), served by ONE `HFEngine` object that both sides use (`--threads` torch threads; 1 is
  `rollout.hf.threads`' default). A thin wrapper around its `generate` records every engine
  call (start, end, the contexts it was given); it is the same object on both sides.
- REPLIES: greedy (temperature 0), so both sides generate the same replies from the same
  contexts. A random model's tokens decode to text that re-tokenizes to other, more ids;
  the endpoint keeps the ids it generated while the in-process side below re-renders the
  text, so the sides' contexts would differ (1.5x the tokens on the in-process side in a
  first try). To keep them the same, `words_only` zeroes the (tied) embedding rows of every
  token but the ~150 whole-word ones (" the", " program": a space and letters, encoding back
  to itself), so the greedy reply is a run of words that round-trips through the tokenizer,
  as a trained model's text does, and never EOS: every turn is exactly `--max-tokens` tokens.
  The result checks it: both sides' token counts, the replies identical across sides, no
  drift call, the same prompt tokens per call.
- EPISODES: N episodes (`--episodes`), each T turns (`--turns`) of `--max-tokens` tokens.
  Episode i opens with its own user message; every later turn appends the reply and the same
  fixed user message (`FOLLOW_UP`), what a harness does. No tools: the model is random, so a
  tool loop would not have a fixed number of turns; the cost measured is the turn's way to
  the engine and back, which a tool would not change.
- PEER, the in-process agent loop (`rollout_workers.agent.run_episodes`): each turn is one
  `run_episodes` call over the N episodes' tasks, whose prompt is the conversation so far
  (rendered by the chat template, as the endpoint renders `messages`): one batched engine
  call of N contexts per turn, then `Episode.trajectory()` of each.
- OURS, the endpoint (`rollout_workers.endpoint.server.Endpoint`, `rollout.endpoint` defaults
  except `--batch-window-ms`): served once on 127.0.0.1; per rep, N keys are minted and N
  `openai.AsyncOpenAI` clients made (before the clock: a client costs ~20 ms to build, which a
  harness pays once, in its own process); then N asyncio harness coroutines, in this process,
  each call `chat.completions.create` T times, and every episode is closed to its Trajectory.
- DIAGNOSTIC side `endpoint_nodelay` (off with `--no-nodelay`): the same endpoint with
  TCP_NODELAY set on its listening socket, which the connections it accepts inherit on Linux.
  `Endpoint.serve` binds `socket.socket(family, SOCK_STREAM)`, whose proto is 0, so asyncio's
  `_set_nodelay` (proto IPPROTO_TCP only) skips them and each reply waits on Nagle and the
  client's delayed ACK (~40 ms). The headline is the endpoint as it is.
- TOKENS/S: generated tokens, counted from each side's trajectories (`Trajectory.tokens`),
  over the side's wall time for all N x T turns. The sides alternate (peer, ours, the
  diagnostic, peer, ours ...) after one untimed warm-up rep each; the headline is median(ours) / median(peer)
  (goal >= 0.8); `ratio_pairs` is the median of the per-rep ratios. Both sides run the same
  engine calls (same contexts, same batches), but on a shared machine the engine's own time
  swings up to 2x from rep to rep (per-rep ratios 0.88-1.20 in one run); `ratio_same_engine` takes that noise out:
  (E + in-process rest) / (E + endpoint rest), E the median engine seconds of a rep over
  every side, rest a side's median wall minus engine seconds of a rep.
- PER-CALL OVERHEAD (ours): a call's client-observed latency minus the wall time of the engine
  call its context was generated in (the batch it rode in, found by its context ids; the
  batcher runs concurrent calls as one engine call, so a call waits for the whole batch, not
  for its `generate_s` share). Split into `before_engine` (request built, sent, parsed,
  rendered, the batch window, any earlier batch still running) and `after_engine` (the reply
  built, sent, parsed by the client). `server_ms`: the server-side part (`wall_s` of the call's
  `endpoint_calls` record minus the same engine wall). `minus_share_ms`: latency minus
  `generate_s` (the engine time share the record attributes to the call: batch wall / batch
  size), which counts the batch's other calls as overhead. p50 / p99 over every timed call.

Writes bench/results/agent_endpoint.json: ours, peer (tokens/s), ratio, target, met, the
overheads, both sides' token counts, engine calls and batch sizes, reply agreement, per-rep rows,
settings, machine facts, load average and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from importlib.metadata import version as dist_version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import skip_unless

RESULT = ROOT / "bench" / "results" / "agent_endpoint.json"
TARGET_RATIO = 0.8
FOLLOW_UP = "Thanks. Now check that step once more and go on."
FULL = dict(hidden=256, layers=4, heads=4, episodes=8, turns=4, max_tokens=64, reps=7)
TEMPERATURE = 0.0  # greedy: see REPLIES in the module doc
WORD = re.compile(r" [A-Za-z]+")
SIDES = ("in_process", "endpoint", "endpoint_nodelay")
QUICK = dict(hidden=64, layers=2, heads=4, episodes=2, turns=2, max_tokens=8, reps=1)


def first_message(i: int) -> str:
    """Episode i's opening user message (a different one per episode, about the same length)."""
    return f"Task {i}: a train leaves at {i + 7}:15 and travels {40 + 3 * i} km at 60 km/h. When does it arrive?"


def pcts(xs: list[float], scale: float = 1.0) -> dict:
    """p50 / p90 / p99 (nearest rank) / mean / n of `xs` times `scale`."""
    xs = sorted(x * scale for x in xs)
    if not xs:
        return {}

    def rank(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    return {
        "p50": round(statistics.median(xs), 3),
        "p90": round(rank(0.9), 3),
        "p99": round(rank(0.99), 3),
        "mean": round(statistics.fmean(xs), 3),
        "n": len(xs),
    }


class TimedEngine:
    """The engine, with every `generate` call recorded: (start, end, the contexts' keys). The
    same object serves both sides, so the wrapper's cost (two clock reads and a tuple per
    context) is theirs alike."""

    def __init__(self, engine):
        self.engine = engine
        self.batches: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, max_new_tokens, temperature):
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, n, max_new_tokens, temperature)
        t1 = time.perf_counter()
        keys = [tuple(int(x) for x in p) for p in prompts]
        self.batches.append({"t0": t0, "t1": t1, "size": len(prompts), "keys": keys})
        return out

    def since(self, start: int) -> list[dict]:
        return self.batches[start:]


def _ids(turn) -> list[int]:
    from schemas import unpack_i32

    return unpack_i32(turn.token_ids).tolist()


def contexts_and_replies(traj) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    """(the context ids each model turn was generated from, each model turn's ids) of a trajectory."""
    ctx: list[int] = []
    contexts, replies = [], []
    for t in traj.turns:
        ids = _ids(t)
        if t.role == "assistant":
            contexts.append(tuple(ctx))
            replies.append(ids)
        ctx += ids
    return contexts, replies


def words_only(model_dir: Path) -> int:
    """Zero the embedding rows of every token but the whole-word ones (see REPLIES); their count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    keep = torch.zeros(len(tok), dtype=torch.bool)
    for i in range(len(tok)):
        text = tok.decode([i])
        keep[i] = bool(WORD.fullmatch(text)) and tok(text, add_special_tokens=False)["input_ids"] == [i]
    with torch.no_grad():
        model.get_input_embeddings().weight[~keep] = 0.0
    model.save_pretrained(model_dir)
    return int(keep.sum())


def make_task(i: int, messages: list, max_tokens: int, temperature: float):
    from schemas import Task

    return Task(
        run_id="bench-agent-endpoint",
        task_id=f"ep{i}",
        domain="bench",
        group_size=1,
        prompt=messages,
        verifier="arith",
        max_tokens=max_tokens,
        temperature=temperature,
    )


async def _no_sandbox(**_):
    raise RuntimeError("no tools in this benchmark: no sandbox is opened")


async def in_process(engine: TimedEngine, plan: dict) -> dict:
    """The peer: T turns of `run_episodes` over the N episodes (see the module doc)."""
    from rollout_workers.agent import run_episodes
    from schemas.episode import ChatMessage

    n, turns, max_tokens = plan["episodes"], plan["turns"], plan["max_tokens"]
    convs = [[ChatMessage(role="user", content=first_message(i))] for i in range(n)]
    start = len(engine.batches)
    tokens, replies, prompt_tokens, turn_rows = 0, [[] for _ in range(n)], [], []
    t0 = time.perf_counter()
    for k in range(turns):
        ts, b0 = time.perf_counter(), len(engine.batches)
        tasks = [make_task(i, convs[i], max_tokens, TEMPERATURE) for i in range(n)]
        eps = await run_episodes(engine, tasks, version=lambda: 0, open_sandbox=_no_sandbox)
        trajs = [ep.trajectory() for ep in eps]
        for i, traj in enumerate(trajs):
            tokens += traj.tokens
            replies[i].append(_ids(traj.turns[1]))
            prompt_tokens.append(len(_ids(traj.turns[0])))
            convs[i].append(ChatMessage(role="assistant", content=traj.final_text))
            if k < turns - 1:
                convs[i].append(ChatMessage(role="user", content=FOLLOW_UP))
        engine_s = sum(b["t1"] - b["t0"] for b in engine.since(b0))
        turn_rows.append({"wall_s": time.perf_counter() - ts, "engine_s": engine_s})
    wall = time.perf_counter() - t0
    batches = engine.since(start)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "engine_s": sum(b["t1"] - b["t0"] for b in batches),
        "engine_calls": len(batches),
        "batch_sizes": [b["size"] for b in batches],
        "prompt_tokens": prompt_tokens,
        "turn_overhead_s": [r["wall_s"] - r["engine_s"] for r in turn_rows],
        "replies": replies,
    }


async def through_endpoint(ep, engine: TimedEngine, plan: dict) -> dict:
    """Ours: N harness coroutines, each T `chat.completions.create` calls (see the module doc)."""
    import openai

    from schemas.chat import user_prompt

    n, turns, max_tokens = plan["episodes"], plan["turns"], plan["max_tokens"]
    keys = [ep.open_episode(make_task(i, user_prompt(first_message(i)), max_tokens, TEMPERATURE)) for i in range(n)]
    clients = [openai.AsyncOpenAI(base_url=ep.base_url, api_key=k, max_retries=0) for k in keys]

    async def harness(i: int) -> list[tuple[float, float]]:
        messages = [{"role": "user", "content": first_message(i)}]
        sent = []
        for k in range(turns):
            t_send = time.perf_counter()
            r = await clients[i].chat.completions.create(
                model="rlbus-policy", messages=messages, max_tokens=max_tokens, temperature=TEMPERATURE
            )
            sent.append((t_send, time.perf_counter()))
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            if k < turns - 1:
                messages.append({"role": "user", "content": FOLLOW_UP})
        return sent

    start = len(engine.batches)
    t0 = time.perf_counter()
    times = await asyncio.gather(*(harness(i) for i in range(n)))
    trajs = [ep.close_episode(k) for k in keys]
    wall = time.perf_counter() - t0
    await asyncio.gather(*(c.close() for c in clients))
    batches = engine.since(start)
    where = {key: b for b in batches for key in b["keys"]}
    calls, replies, prompt_tokens = [], [], []
    for traj, sent in zip(trajs, times, strict=True):
        records = json.loads(traj.artifacts["endpoint_calls"])
        contexts, ids = contexts_and_replies(traj)
        replies.append(ids)
        for rec, ctx, (t_send, t_recv) in zip(records, contexts, sent, strict=True):
            b = where[ctx]
            engine_s = b["t1"] - b["t0"]
            prompt_tokens.append(rec["prompt_tokens"])
            calls.append(
                {
                    "latency_s": t_recv - t_send,
                    "engine_s": engine_s,
                    "batch": b["size"],
                    "overhead_s": t_recv - t_send - engine_s,
                    "before_engine_s": b["t0"] - t_send,
                    "after_engine_s": t_recv - b["t1"],
                    "server_s": rec["wall_s"] - engine_s,
                    "minus_share_s": t_recv - t_send - rec["generate_s"],
                    "drift": rec["drift"],
                }
            )
    tokens = sum(t.tokens for t in trajs)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "engine_s": sum(b["t1"] - b["t0"] for b in batches),
        "engine_calls": len(batches),
        "batch_sizes": [b["size"] for b in batches],
        "prompt_tokens": prompt_tokens,
        "calls": calls,
        "replies": replies,
    }


def _row(side: dict) -> dict:
    return {
        "tok_s": round(side["tok_s"], 1),
        "tokens": side["tokens"],
        "wall_s": round(side["wall_s"], 3),
        "engine_s": round(side["engine_s"], 3),
        "engine_calls": side["engine_calls"],
        "batch_sizes": side["batch_sizes"],
    }


def _side(rows: list[dict], turns: int) -> dict:
    out = {
        "tok_s": pcts([r["tok_s"] for r in rows]),
        "tokens_per_rep": [r["tokens"] for r in rows],
        "wall_s": pcts([r["wall_s"] for r in rows]),
        "engine_s": pcts([r["engine_s"] for r in rows]),
        "engine_share": round(sum(r["engine_s"] for r in rows) / sum(r["wall_s"] for r in rows), 3),
        "not_engine_ms_per_turn": pcts([(r["wall_s"] - r["engine_s"]) / turns for r in rows], 1000),
        "engine_calls_per_rep": pcts([r["engine_calls"] for r in rows]),
        "batch_size": pcts([s for r in rows for s in r["batch_sizes"]]),
        "prompt_tokens_per_call": pcts([t for r in rows for t in r["prompt_tokens"]]),
    }
    if "calls" in rows[0]:
        calls = [c for r in rows for c in r["calls"]]
        out["overhead_ms"] = {
            "client": pcts([c["overhead_s"] for c in calls], 1000),
            "server": pcts([c["server_s"] for c in calls], 1000),
            "before_engine": pcts([c["before_engine_s"] for c in calls], 1000),
            "after_engine": pcts([c["after_engine_s"] for c in calls], 1000),
            "minus_share": pcts([c["minus_share_s"] for c in calls], 1000),
            "latency": pcts([c["latency_s"] for c in calls], 1000),
            "engine_of_batch": pcts([c["engine_s"] for c in calls], 1000),
        }
        out["calls_in_a_full_batch"] = f"{sum(c['batch'] == len(rows[0]['replies']) for c in calls)}/{len(calls)}"
        out["drift_calls"] = sum(c["drift"] for c in calls)
    else:
        out["turn_overhead_ms"] = pcts([x for r in rows for x in r["turn_overhead_s"]], 1000)
    return out


def _identical(reps: list[dict], a: str, b: str) -> str:
    pairs = [(x, y) for r in reps for ra, rb in zip(r[a]["replies"], r[b]["replies"]) for x, y in zip(ra, rb)]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def summarize(reps: list[dict], plan: dict, args, section, load0, wall_s: float) -> dict:
    import openai

    names = [n for n in SIDES if n in reps[0]]
    med = {n: statistics.median(r[n]["tok_s"] for r in reps) for n in names}
    peer, ours = med["in_process"], med["endpoint"]
    ratio = round(ours / peer, 3)
    sides = {n: _side([r[n] for r in reps], plan["turns"]) for n in names}
    engine = statistics.median(r[n]["engine_s"] for r in reps for n in names)
    rest = {n: statistics.median(r[n]["wall_s"] - r[n]["engine_s"] for r in reps) for n in names}

    def same_engine(n: str) -> float:
        return round((engine + rest["in_process"]) / (engine + rest[n]), 3)

    res = {
        "ours": round(ours, 1),
        "peer": round(peer, 1),
        "unit": "generated tokens/s (N episodes x T turns, batched across episodes)",
        "ratio": ratio,
        "ratio_pairs": round(statistics.median(r["endpoint"]["tok_s"] / r["in_process"]["tok_s"] for r in reps), 3),
        "ratio_same_engine": same_engine("endpoint"),
        "target": {"ratio": TARGET_RATIO},
        "met": ratio >= TARGET_RATIO,
        "overhead_ms": sides["endpoint"]["overhead_ms"],
        "tokens": {n: sum(r[n]["tokens"] for r in reps) for n in names}
        | {"expected_per_rep": plan["episodes"] * plan["turns"] * plan["max_tokens"]},
        "replies_identical": _identical(reps, "in_process", "endpoint"),
        "drift_calls": sides["endpoint"]["drift_calls"],
    }
    if "endpoint_nodelay" in names:
        nd = sides["endpoint_nodelay"]
        res["nodelay"] = {
            "what": "the same endpoint with TCP_NODELAY set on its listening socket (accepted connections "
            "inherit it on Linux): Endpoint.serve's socket.socket(family, SOCK_STREAM) has proto 0, so "
            "asyncio's _set_nodelay skips its connections and each reply waits on Nagle + delayed ACK",
            "ours": round(med["endpoint_nodelay"], 1),
            "ratio": round(med["endpoint_nodelay"] / peer, 3),
            "ratio_pairs": round(
                statistics.median(r["endpoint_nodelay"]["tok_s"] / r["in_process"]["tok_s"] for r in reps), 3
            ),
            "ratio_same_engine": same_engine("endpoint_nodelay"),
            "overhead_ms": nd["overhead_ms"],
            "replies_identical": _identical(reps, "in_process", "endpoint_nodelay"),
        }
    return res | {
        "sides": sides,
        "reps": [{n: _row(r[n]) for n in names} for r in reps],
        "settings": {
            **plan,
            "temperature": TEMPERATURE,
            "word_tokens": args.word_tokens,
            "threads": args.threads,
            "quick": args.quick,
            "follow_up": FOLLOW_UP,
            "endpoint": section.model_dump(),
            "harness": "N asyncio coroutines in the bench's process, one openai.AsyncOpenAI each",
            "order": names,
        },
        "command": "python bench/agent_endpoint.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "wall_s": round(wall_s, 1),
        "load_avg": [load0, [round(x, 2) for x in os.getloadavg()]],
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            **{m: dist_version(m) for m in ("torch", "transformers", "fastapi", "uvicorn", "httpx")},
            "openai": openai.__version__,
        },
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def listener_nodelay(ep, on: bool) -> None:
    """TCP_NODELAY on the endpoint's listening socket (connections accepted later inherit it on Linux)."""
    for server in ep.server.servers:
        for sock in server.sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(on))


async def run(args, plan: dict, model_dir: Path) -> dict:
    from rollout_workers.endpoint.server import Endpoint
    from rollout_workers.engines.hf_engine import HFEngine
    from schemas.config import RunConfig

    engine = TimedEngine(HFEngine(str(model_dir), threads=args.threads))
    section = RunConfig().rollout.endpoint.model_copy(update={"enabled": True, "batch_window_ms": args.batch_window_ms})
    ep = Endpoint(engine, lambda: 0, section, context_limit=engine.max_context)
    await ep.serve()
    names = [n for n in SIDES if n != "endpoint_nodelay" or args.nodelay]

    async def side(name: str) -> dict:
        if name == "in_process":
            return await in_process(engine, plan)
        listener_nodelay(ep, name == "endpoint_nodelay")
        return await through_endpoint(ep, engine, plan)

    load0 = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    try:
        for name in names:  # warm-up, untimed
            await side(name)
        reps = []
        for r in range(plan["reps"]):
            rep = {name: await side(name) for name in names}
            reps.append(rep)
            line = " | ".join(
                f"{n} {x['tok_s']:6.1f} tok/s ({x['tokens']} tokens, {x['engine_calls']} engine calls)"
                for n, x in rep.items()
            )
            print(f"rep {r + 1}/{plan['reps']}: {line}", flush=True)
    finally:
        await ep.stop()
    return summarize(reps, plan, args, section, load0, time.perf_counter() - t0)


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s, sides = res["settings"], res["sides"]
    names = s["order"]
    t = Table(
        title=f"{s['episodes']} episodes x {s['turns']} turns x {s['max_tokens']} tokens, {s['reps']} reps per side"
    )
    t.add_column("")
    for n in names:
        t.add_column(n, justify="right")
    peer = sides["in_process"]["tok_s"]["p50"]

    def row(label: str, f) -> None:
        t.add_row(label, *(f(sides[n]) for n in names))

    row("tokens/s (median)", lambda x: f"{x['tok_s']['p50']:.1f}")
    row("/ in-process", lambda x: f"[bold]{x['tok_s']['p50'] / peer:.3f}[/]")
    row("tokens per rep", lambda x: ", ".join(map(str, sorted(set(x["tokens_per_rep"])))))
    row("engine calls per rep (p50)", lambda x: f"{x['engine_calls_per_rep']['p50']:g}")
    row("engine share of wall", lambda x: f"{x['engine_share']:.3f}")
    row("not-engine ms per turn (p50)", lambda x: f"{x['not_engine_ms_per_turn']['p50']:.1f}")
    for key in ("client", "before_engine", "after_engine", "server", "minus_share"):
        row(
            f"per-call {key} ms p50 / p99",
            lambda x, k=key: (
                f"{x['overhead_ms'][k]['p50']:.1f} / {x['overhead_ms'][k]['p99']:.1f}" if "overhead_ms" in x else ""
            ),
        )
    Console(width=130).print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, help=f"episodes at once (default {FULL['episodes']})")
    ap.add_argument("--turns", type=int, help=f"turns per episode (default {FULL['turns']})")
    ap.add_argument("--max-tokens", type=int, help=f"tokens per turn (default {FULL['max_tokens']})")
    ap.add_argument("--reps", type=int, help=f"timed reps per side (default {FULL['reps']})")
    ap.add_argument("--batch-window-ms", type=float, default=None, help="rollout.endpoint.batch_window_ms")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine (rollout.hf.threads)")
    ap.add_argument(
        "--no-nodelay", dest="nodelay", action="store_false", help="skip the endpoint_nodelay side (diagnostic)"
    )
    ap.add_argument("--quick", action="store_true", help="a 64-wide model, 2 episodes x 2 turns x 8 tokens, 1 rep")
    ap.add_argument("--out", default=str(RESULT), help="result JSON path")
    args = ap.parse_args()
    skip_unless(__file__, modules=("openai", "fastapi", "uvicorn", "transformers"))
    from rlbus.model.tiny_model import build_tiny_model
    from schemas.config import RunConfig

    plan = dict(QUICK if args.quick else FULL)
    for k in ("episodes", "turns", "max_tokens", "reps"):
        if getattr(args, k) is not None:
            plan[k] = getattr(args, k)
    if args.batch_window_ms is None:
        args.batch_window_ms = RunConfig().rollout.endpoint.batch_window_ms
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "m",
            tokenizer="bpe",
            hidden_size=plan["hidden"],
            num_layers=plan["layers"],
            num_heads=plan["heads"],
            max_position_embeddings=1024,
            seed=0,
        )
        args.word_tokens = words_only(model_dir)
        res = asyncio.run(run(args, plan, model_dir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print_table(res)
    print(
        json.dumps(
            {
                k: res[k]
                for k in (
                    "ours",
                    "peer",
                    "ratio",
                    "ratio_pairs",
                    "ratio_same_engine",
                    "tokens",
                    "replies_identical",
                    "met",
                )
            }
        )
    )
    if "nodelay" in res:
        print(
            json.dumps(
                {"nodelay": {k: res["nodelay"][k] for k in ("ours", "ratio", "ratio_pairs", "ratio_same_engine")}}
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
