"""`rlbus train-rm`'s training loop: one process, or N FSDP2 ranks, on preference pairs.

Every rank runs this same loop on the same data (loaded and encoded identically): rank 0
is the CLI's process, ranks 1..N-1 its children (`python -m learner.rm_train --rank R`),
joined through `learner.ranks`' TCPStore rendezvous and sharded with
`learner.distributed.shard_model`, as the learner's ranks are.

Guarantees:
- Step k trains on pairs [k*B, (k+1)*B) of a stream that concatenates seeded
  permutations of the training pairs, one per epoch: the data order depends only on
  (seed, step), which makes resume exact.
- Each step: length-sorted micro-batches of whole pairs (`learner.rm.plan_pairs`); with N
  ranks each takes every N-th one (zero-weighted padding jobs so every rank runs as many),
  losses scaled by N so FSDP2's gradient average is the one-rank gradient. AdamW (fused
  on one rank), linear warmup then cosine to 10% (`learner.sft.lr_factor`), gradient clipping.
  On one rank, a model `learner.rm_shared.supports` runs one row per pair with the prompt
  computed once (`shared_prefix`, on by default; the same rewards, so the same loss).
- `dtype = "auto"` trains under bf16 autocast (fp32 master weights) where the device has
  native bf16 (`learner.step.bf16_problem`), else fp32; "bf16" where it has none is an error.
- Checkpoints every `save_every` steps and at the end of training: `checkpoints/rm.pt`
  (one rank, `learner.checkpoint.save`, atomic) or `checkpoints/rm.dcp/` (N ranks,
  `save_dcp`). A run whose `out` holds one resumes from it: N/2 steps, a stop, and N/2
  more give the weights of N straight steps (test_rm.py checks it).
- A rank that exits unasked takes the others down (rank 0 watches its children).
- The end: held-out evaluation, `export` (rank 0), `rm_report.json` and the score plot
  (`learner.rm_report`); the summary dict is returned on rank 0 (`pairs_per_s`: over
  the optimizer steps' time; `wall_pairs_per_s`: with checkpoints and evaluations).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENV = "RLBUS_RM_CONFIG"


@dataclass
class RmConfig:
    """Everything one `rlbus train-rm` run needs (sent to every rank as JSON)."""

    data: list[str]
    model: str
    out: str
    world_size: int = 1
    backend: str = "auto"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    dtype: str = "auto"
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 32
    epochs: float = 1.0
    max_steps: int = 0
    max_length: int = 1024
    micro_batch_tokens: int = 8192
    center_coef: float = 0.0
    heldout_frac: float = 0.05
    heldout_split: str | None = None
    field_map: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    threads: int = 2
    eval_every: int = 50
    save_every: int = 50
    progress: bool = True
    shared_prefix: bool = True
    """One row per pair with the prompt computed once where the model allows (`learner.rm_shared`); False: two rows."""
    stop_after: int = 0
    """Stop (checkpointed, no export) after this many steps of this invocation: tests, preemption drills."""
    pad_id: int = 0
    """Set from the tokenizer at load."""


def check_config(cfg: RmConfig) -> None:
    """Refuse what cannot run here, with what to change (before any rank starts)."""
    if cfg.world_size < 1 or cfg.batch_size < 1 or cfg.max_length < 2:
        raise ValueError("world_size, batch_size must be >= 1 and max_length >= 2")
    if cfg.world_size > 1 and cfg.lora_rank > 0:
        raise ValueError(
            f"--world-size {cfg.world_size} does not support LoRA yet; use --lora-rank 0 or --world-size 1"
        )
    if cfg.world_size > 1:
        from learner.distributed import resolve_backend

        backend = resolve_backend(cfg.backend)
        if backend == "gloo" and cfg.world_size > (os.cpu_count() or 1):
            raise ValueError(f"--world-size {cfg.world_size} exceeds this machine's {os.cpu_count()} CPU cores (gloo)")
        if backend == "nccl":
            import torch

            if cfg.world_size > torch.cuda.device_count():
                raise ValueError(
                    f"--world-size {cfg.world_size} but {torch.cuda.device_count()} CUDA device(s) visible"
                )


def resolve_dtype(asked: str, device) -> str:
    """'bf16' or 'fp32' for `asked` ('auto' | 'bf16' | 'fp32') on `device`."""
    import torch

    from learner.step import bf16_problem

    if asked != "auto":
        return asked
    ok = torch.amp.is_autocast_available(device.type) and bf16_problem(device.type) is None
    return "bf16" if ok else "fp32"


@functools.lru_cache(maxsize=8)
def _perm(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    return tuple(random.Random(f"rm:{seed}:{epoch}").sample(range(n), n))


def step_rows(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The training pairs of `step` (module guarantees: a function of seed and step only)."""
    return [_perm(seed, p // n, n)[p % n] for p in range(step * batch_size, (step + 1) * batch_size)]


class Trainer:
    """One rank's model, optimizer, data and step."""

    def __init__(self, cfg: RmConfig, rank: int = 0, world: int = 1):
        import torch

        from learner.rm import encode_pairs, load_reward_model
        from learner.rm_data import load_pairs
        from learner.step import compute_context

        self.cfg, self.rank, self.world = cfg, rank, world
        torch.set_num_threads(cfg.threads)
        self.data = load_pairs(
            cfg.data, field_map=cfg.field_map, heldout_split=cfg.heldout_split, heldout_frac=cfg.heldout_frac
        )
        model, self.tokenizer = load_reward_model(
            cfg.model, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, seed=cfg.seed
        )
        cfg.pad_id = self.tokenizer.pad_token_id
        self.train_enc = encode_pairs(self.tokenizer, self.data.train, cfg.max_length)
        self.held_enc = encode_pairs(self.tokenizer, self.data.heldout, cfg.max_length)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from learner.distributed import resolve_backend, shard_model
            from learner.sharded import rank_device

            self.device = rank_device(resolve_backend(cfg.backend), rank)
            model = shard_model(model.to(self.device), mesh=init_device_mesh(self.device.type, (world,)))
        else:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = model.to(self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        compute_context(self.dtype, self.device)  # a clear error now where bf16 cannot run
        self.ctx = lambda: compute_context(self.dtype, self.device)
        self.model = model.train()
        from learner.rm_shared import supports

        self.shared = cfg.shared_prefix and world == 1 and supports(model)
        params = [p for p in model.parameters() if p.requires_grad]
        fused = world == 1 and self.device.type in ("cpu", "cuda")  # one kernel for all params; TRL's default too
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
        n = len(self.data.train)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * n / cfg.batch_size))
        self.warmup = max(1, min(50, self.total_steps // 10))

    # ------------------------------------------------------------------ checkpoints

    @property
    def ckpt_root(self) -> Path:
        return Path(self.cfg.out) / "checkpoints"

    def save(self, state: dict) -> None:
        from learner import checkpoint

        if self.world == 1:
            checkpoint.save(self.ckpt_root / "rm.pt", model=self.model, optimizer=self.optimizer, state=state)
        else:
            name = f"step{state['step']:08d}"
            checkpoint.save_dcp(
                self.ckpt_root / "rm.dcp", name, model=self.model, optimizer=self.optimizer, state=state, rank=self.rank
            )

    def load(self) -> dict | None:
        """Restore the latest checkpoint (either layout, resharded to this world); its state or None."""
        from learner import checkpoint

        single, dcp = self.ckpt_root / "rm.pt", checkpoint.latest_dcp(self.ckpt_root / "rm.dcp")
        if self.world == 1 and dcp is not None or self.world > 1 and single.exists():
            raise ValueError(
                f"{self.ckpt_root} holds a checkpoint of another world size layout; "
                "resume with the same --world-size as one rank vs several, or use a new --out"
            )
        if self.world == 1:
            return checkpoint.load(single, model=self.model, optimizer=self.optimizer)
        return (
            None
            if dcp is None
            else checkpoint.load_dcp(dcp, model=self.model, optimizer=self.optimizer, rank=self.rank)
        )

    # ------------------------------------------------------------------ the step

    def step(self, step: int) -> tuple[float, float]:
        """One update on `step`'s pairs; (loss, train accuracy) over the whole batch."""
        import torch

        from learner.rm import accumulate, plan_pairs
        from learner.sft import lr_factor

        cfg = self.cfg
        rows = step_rows(step, len(self.data.train), cfg.batch_size, cfg.seed)
        chunks = plan_pairs(self.train_enc, rows, cfg.micro_batch_tokens)
        if len(chunks) < self.world:  # every rank needs real work: one pair per micro-batch at least
            chunks = [[r] for c in chunks for r in c]
        mine = [(c, True) for c in chunks[self.rank :: self.world]]
        jobs = mine + [(chunks[-1], False)] * (math.ceil(len(chunks) / self.world) - len(mine))
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr * lr_factor(step / self.total_steps, step, self.warmup)
        self.optimizer.zero_grad(set_to_none=True)
        loss, correct = accumulate(
            self.model, self.train_enc, jobs, len(rows), cfg, self.ctx, self.device, self.world, self.shared
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.optimizer.step()
        if self.world > 1:
            import torch.distributed as dist

            t = torch.tensor([loss, float(correct)], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            loss, correct = float(t[0]), int(t[1])
        return loss, correct / len(rows)

    def evaluate(self) -> tuple[list[float], list[float]]:
        """Held-out rewards (chosen, rejected); every rank runs the same forwards."""
        from learner.rm import score_all

        if not self.held_enc.chosen:
            return [], []
        self.model.eval()
        try:
            return score_all(
                self.model,
                self.held_enc,
                self.cfg.pad_id,
                self.device,
                self.ctx,
                self.cfg.micro_batch_tokens,
                self.shared,
            )
        finally:
            self.model.train()

    def export(self, path: Path) -> None:
        """The plain HF classifier under `path` (rank 0; a collective gather with N ranks)."""
        from learner.rm import export, load_reward_model

        if self.world == 1:
            export(self.model, self.tokenizer, path)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            fresh, _ = load_reward_model(self.cfg.model, seed=self.cfg.seed)
            fresh.load_state_dict(full)
            export(fresh, self.tokenizer, path)


def _bar(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]train-rm"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[pps]:.1f} pairs/s"),
        TextColumn("held-out acc {task.fields[acc]}"),
        TimeElapsedColumn(),
        disable=not enabled,
    )


def train(cfg: RmConfig, rank: int = 0, world: int = 1) -> dict | None:
    """The whole run on this rank (module guarantees); the summary on rank 0."""
    import torch

    from learner.rm_report import accuracy, write_report

    torch.manual_seed(cfg.seed)
    t = Trainer(cfg, rank, world)
    state = t.load() or {"step": 0, "losses": []}
    start, losses = int(state["step"]), list(state["losses"])
    stop_at = min(t.total_steps, start + cfg.stop_after) if cfg.stop_after else t.total_steps
    acc = "-"
    bar = _bar(cfg.progress and rank == 0)
    task = bar.add_task("rm", total=t.total_steps, completed=start, loss=float("nan"), pps=0.0, acc=acc)
    t0, pairs, step_s, scores = time.monotonic(), 0, 0.0, None
    with bar:
        for step in range(start, stop_at):
            ts = time.monotonic()
            loss, _ = t.step(step)
            step_s += time.monotonic() - ts
            losses.append(loss)
            pairs += cfg.batch_size
            done = step + 1
            if cfg.save_every and done % cfg.save_every == 0 or done == stop_at:
                t.save({"step": done, "losses": losses})
            scores = None
            if t.held_enc.chosen and (cfg.eval_every and done % cfg.eval_every == 0 or done == t.total_steps):
                scores = t.evaluate()  # the last step's is the report's
                acc = f"{accuracy(*scores):.3f}"
            bar.update(task, completed=done, loss=loss, pps=pairs / max(1e-9, time.monotonic() - t0), acc=acc)
    seconds = time.monotonic() - t0
    if stop_at < t.total_steps:
        return {"stopped_at": stop_at, "total_steps": t.total_steps} if rank == 0 else None
    rc, rr = scores if start < stop_at and scores is not None else t.evaluate()
    out = Path(cfg.out) / "model"
    t.export(out)
    if rank != 0:
        return None
    summary = {
        "steps": t.total_steps,
        "resumed_from": start,
        "pairs_per_s": round(pairs / max(1e-9, step_s), 2),
        "wall_pairs_per_s": round(pairs / max(1e-9, seconds), 2),
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "dtype": t.dtype,
        "shared_prefix": t.shared,
        "world_size": world,
        "lora_rank": cfg.lora_rank,
        "train_pairs": len(t.data.train),
        "heldout_pairs": len(t.data.heldout),
        "heldout_from": t.data.heldout_from,
        "rows": t.data.rows,
        "skipped": t.data.skipped,
        "truncated_pairs": t.train_enc.truncated + t.held_enc.truncated,
        "both_sides_truncated": t.train_enc.both_truncated + t.held_enc.both_truncated,
        "model_dir": str(out),
    }
    return write_report(Path(cfg.out), summary, rc, rr)


# ------------------------------------------------------------------ ranks


def _watch(children: list[subprocess.Popen], done: threading.Event) -> None:
    """Stop this process (exit 70) when a rank dies mid-run; never once `done` is set (the run
    returned or raised: its caller handles that, and may be a process that lives on)."""
    while not done.is_set():
        for p in children:
            if p.poll() not in (None, 0) and not done.is_set():
                for q in children:
                    if q.poll() is None:
                        q.kill()
                print(f"train-rm: rank pid {p.pid} exited with {p.returncode}; stopping", file=sys.stderr)
                os._exit(70)
        if all(p.poll() == 0 for p in children):
            return
        time.sleep(0.2)


def run(cfg: RmConfig) -> dict:
    """`rlbus train-rm`: train on one rank, or start ranks 1..N-1 and be rank 0."""
    check_config(cfg)
    if cfg.world_size == 1:
        return train(cfg)
    import torch.distributed as dist

    from learner.distributed import resolve_backend
    from learner.ranks import _store, join_group

    if dist.is_initialized():
        raise RuntimeError(
            "train-rm --world-size > 1 needs a process outside any torch.distributed group "
            "(this one is already in one): run `rlbus train-rm` in its own process"
        )
    backend, timeout = resolve_backend(cfg.backend), 600.0
    store = _store("127.0.0.1", 0, cfg.world_size, True, timeout)
    env = dict(os.environ, **{ENV: json.dumps(asdict(cfg))})
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "learner.rm_train",
                "--rank",
                str(r),
                "--port",
                str(store.port),
                "--parent",
                str(os.getpid()),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        for r in range(1, cfg.world_size)
    ]
    done = threading.Event()
    threading.Thread(target=_watch, args=(children, done), daemon=True).start()
    try:
        join_group(store, 0, cfg.world_size, backend, timeout)
        summary = train(cfg, 0, cfg.world_size)
        dist.destroy_process_group()
    except BaseException:
        done.set()
        for p in children:
            p.kill()
        raise
    for p in children:
        p.wait(60)
    done.set()
    return summary


def follower_main(argv: list[str] | None = None) -> int:
    """Ranks 1..N-1 (`python -m learner.rm_train`)."""
    import argparse

    import torch.distributed as dist

    from learner.distributed import resolve_backend
    from learner.ranks import _store, die_with_parent, join_group

    p = argparse.ArgumentParser(prog="learner.rm_train")
    for flag in ("--rank", "--port", "--parent"):
        p.add_argument(flag, type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    cfg = RmConfig(**json.loads(os.environ[ENV]))
    cfg.progress = False
    store = _store("127.0.0.1", args.port, cfg.world_size, False, 600.0)
    join_group(store, args.rank, cfg.world_size, resolve_backend(cfg.backend), 600.0)
    train(cfg, args.rank, cfg.world_size)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(follower_main())
