"""The measured sides of `bench/learner_scale.py`, each run as its own process.

`python bench/scale_sides.py SIDE --model DIR --batch FILE ...` with SIDE one of:

- `ours`: `learner.step.train_step` (through `bench.learner_vs_trl.Ours`) on the batch's
  `Reward` messages, one process.
- `sharded`: one rank of our FSDP2 learner (`learner.distributed.shard_model`, gloo, the
  rank/world from torchrun's environment variables). Every rank packs the whole batch and
  takes its advantages over it; the batch's length-bucketed micro-batch plan
  (`learner.step.plan_micro_batches`) is dealt to the ranks, each the same number of
  micro-batches (FSDP's collectives run once per forward/backward on every rank), and
  `learner.step.accumulate` runs each rank's share-scaled losses, so the reduce-scattered
  (averaged) gradient times world_size is the one-rank gradient.
- `trl`: TRL `GRPOTrainer.training_step` (through `bench.learner_vs_trl.Peer`) on the
  padded inputs dict made from the same `Reward` messages.

Protocol (JSON lines prefixed `@@` on stdout, anything else there is library chatter): the
side loads, takes its warm-up steps and says `ready`; then each `run N` line on stdin gets
`{"times": [...], "cpu": [...], "padding": [...]}` back (wall and process CPU seconds); `quit` gets `{"peak_rss_mb": ...}` (this
process's `ru_maxrss`, so each side's peak is its own) and the process exits.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mb() -> dict:
    """Current (VmRSS) and peak (ru_maxrss) resident memory of this process, MiB."""
    cur = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            cur = int(line.split()[1]) / 1024
    return {"rss_mb": round(cur, 1), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def say(obj: dict) -> None:
    print("@@" + json.dumps(obj), flush=True)


def make_rewards(spec: dict) -> list:
    """`Reward` messages of the batch spec: a prompt turn and one trainable completion turn."""
    import numpy as np

    from schemas import Reward, Trajectory, Turn, pack_f32, pack_i32

    rewards = []
    for i, (p, c, r, g) in enumerate(zip(spec["prompts"], spec["completions"], spec["rewards"], spec["groups"])):
        turns = [
            Turn(role="prompt", text="", token_ids=pack_i32(np.asarray(p, dtype=np.int32))),
            Turn(
                role="assistant",
                text="",
                token_ids=pack_i32(np.asarray(c, dtype=np.int32)),
                logprobs=pack_f32(np.full(len(c), spec["behavior_logp"], dtype=np.float32)),
                trainable=True,
                policy_version=0,
            ),
        ]
        traj = Trajectory(
            run_id="bench",
            task_id=f"t{g}",
            task_msg_id=f"t{g}",
            domain="synthetic",
            group_id=f"g{g}",
            group_size=spec["group_size"],
            sample_index=i % spec["group_size"],
            turns=turns,
            verifier="none",
            policy_version=0,
            tokens=len(c),
        )
        rewards.append(Reward(run_id="bench", trajectory=traj, reward=float(r)))
    return rewards


def warmup_subset(rewards: list, group_size: int) -> list:
    """The group with the fewest tokens: a cheap first step that allocates optimizer state."""
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return min(groups, key=lambda g: sum(r.trajectory.tokens for r in g))


def deal(chunks: list[list[int]], lengths: list[int], world: int) -> list[list[list[int]]]:
    """Micro-batches per rank: the same count on every rank (chunks with most rows split in two
    until the count divides), heaviest first to the least-loaded rank with room."""
    chunks = [list(c) for c in chunks]
    while len(chunks) % world:
        big = max(range(len(chunks)), key=lambda k: len(chunks[k]))
        if len(chunks[big]) < 2:
            raise ValueError(f"cannot deal {len(chunks)} single-row micro-batches to {world} ranks evenly")
        c = chunks.pop(big)
        chunks += [c[: len(c) // 2], c[len(c) // 2 :]]
    cost = lambda c: len(c) * max(lengths[i] for i in c)
    per_rank, load = [[] for _ in range(world)], [0] * world
    for c in sorted(chunks, key=cost, reverse=True):
        r = min((r for r in range(world) if len(per_rank[r]) < len(chunks) // world), key=lambda r: load[r])
        per_rank[r].append(c)
        load[r] += cost(c)
    return per_rank


def renumber(chunks: list[list[int]]) -> list[list[int]]:
    """The same chunks over their own rows, numbered 0.. in order (for `padding_fraction`)."""
    out, k = [], 0
    for c in chunks:
        out.append(list(range(k, k + len(c))))
        k += len(c)
    return out


class Sharded:
    """One rank of the FSDP2 learner step (see the module docstring)."""

    def __init__(self, model_dir: Path, rewards: list, lr: float, learner_fields: dict):
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from learner.distributed import init_from_env, shard_model
        from schemas.config import LearnerSection

        self.rank, self.world = init_from_env("gloo")
        self.lc = LearnerSection(lr=lr, **learner_fields)
        policy = AutoModelForCausalLM.from_pretrained(model_dir)
        policy.train()
        self.policy = shard_model(policy)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr, weight_decay=self.lc.weight_decay)
        self.rewards, self.torch, self.dist = rewards, torch, dist

    def step(self, rewards: list | None = None) -> dict:
        from learner.batch import pack_samples
        from learner.step import (
            batch_advantages,
            compute_context,
            loss_share,
            micro_loss,
            padding_fraction,
            plan_micro_batches,
            take_rows,
        )

        torch, lc = self.torch, self.lc
        batch = pack_samples(self.rewards if rewards is None else rewards, 0)
        adv = batch_advantages(batch, lc)
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        mine = deal(plan_micro_batches(lengths, lc.micro_batch_tokens, lc.micro_batch_size), lengths, self.world)[
            self.rank
        ]
        self.opt.zero_grad(set_to_none=True)
        max_len = batch["loss_mask"].shape[1]
        for k, rows in enumerate(mine):  # as learner.sharded: gradients reduce-scattered at the last backward
            self.policy.set_requires_gradient_sync(k == len(mine) - 1)
            mb = take_rows(batch, rows)
            share = loss_share(lc.objective, mb["loss_mask"], batch["loss_mask"])
            with compute_context(lc.dtype, torch.device("cpu")):
                loss, _ = micro_loss(self.policy, None, mb, adv[mb["rows"]], lc, max_len)
            (loss * (share * self.world)).backward()  # FSDP averages over ranks; shares sum to 1 over the batch
        torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.grad is not None], lc.grad_clip)
        self.opt.step()
        self.dist.barrier()
        return {"padding_frac": padding_fraction([lengths[i] for c in mine for i in c], renumber(mine))}


def build_side(a, spec: dict, rewards: list):
    """(step(full: bool) -> padding fraction or None, params) for the side named by `a.side`."""
    fields = {"micro_batch_tokens": a.micro_batch_tokens, "micro_batch_size": a.micro_batch_size}
    small = warmup_subset(rewards, spec["group_size"])
    if a.side == "trl":
        import tempfile

        from bench.learner_vs_trl import Peer, trl_inputs

        inputs, small_inputs = trl_inputs(rewards, 0), trl_inputs(small, 0)
        peer = Peer(
            Path(a.model),
            inputs,
            spec["group_size"],
            max(map(len, spec["completions"])),
            a.lr,
            Path(tempfile.mkdtemp(prefix="rlbus-scale-trl-")),
        )
        return (lambda full: peer.step(None if full else small_inputs)), peer.model
    if a.side == "ours":
        from bench.learner_vs_trl import Ours

        ours = Ours(Path(a.model), rewards, a.lr, learner_fields=fields)
        from learner.groups import PooledSample

        small_samples = [PooledSample(r, None) for r in small]
        return (lambda full: ours.step(None if full else small_samples)["padding_frac"]), ours.policy
    sharded = Sharded(Path(a.model), rewards, a.lr, fields)
    return (lambda full: sharded.step(None if full else small)["padding_frac"]), sharded.policy


def serve(step, warmup: int) -> None:
    """Warm up, say ready, then answer `run N` / `quit` lines until quit."""
    step(False)
    for _ in range(warmup):
        step(True)
    say({"ready": True, **rss_mb()})
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "run":
            times, cpu, padding = [], [], []
            for _ in range(int(cmd[1])):
                t0, c0 = time.perf_counter(), time.process_time()
                padding.append(step(True))
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            say({"times": times, "cpu": cpu, "padding": padding})
        elif cmd and cmd[0] == "quit":
            break
    say(rss_mb())


def main() -> None:
    ap = argparse.ArgumentParser(description="one measured side of bench/learner_scale.py")
    ap.add_argument("side", choices=("ours", "sharded", "trl"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warmup", type=int, default=1, help="full-batch warm-up steps (after one small step)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0)
    ap.add_argument("--micro-batch-size", type=int, default=0)
    a = ap.parse_args()
    import torch
    import transformers  # noqa: F401 - counted in the baseline on both sides

    if a.side == "trl":
        import trl  # noqa: F401
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    base = rss_mb()
    spec = json.loads(Path(a.batch).read_text())
    step, model = build_side(a, spec, make_rewards(spec))
    torch.set_num_threads(a.threads)  # whatever the trainer set up, the same budget on both sides
    say(
        {
            "loaded": True,
            "baseline_rss_mb": base["rss_mb"],
            "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters()),
        }
    )
    serve(step, a.warmup)


if __name__ == "__main__":
    main()
