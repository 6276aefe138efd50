"""One learner rank of N: its FSDP2 shard of the policy and its share of every step.

Every rank builds a `RankTrainer` the same way and calls the same methods in the same
order (each is a collective); `learner.ranks` drives them (rank 0 from the bus, ranks
1..N-1 from rank 0's broadcasts).

Guarantees:
- Data parallel over micro-batches: every rank plans the same length-bucketed
  micro-batches of the whole batch (`learner.step.plan_micro_batches`, split further
  when there are fewer than N) and takes every N-th one; advantages and every normaliser are over the whole batch, each loss is
  scaled by its share x N, and FSDP2 averages the gradients over the ranks, so the
  gradient (and, after clipping, the update) equals the one-rank step's up to float
  rounding. Ranks with fewer micro-batches run a zero-weighted one, so every rank runs
  the same forwards and backwards (FSDP2's collectives match); gradients are
  reduce-scattered once, at the step's last backward.
- Replay (`learner.replay`): every rank draws the same replay batch (the stream is
  deterministic) and the averaged gradient is the one-rank one.
- `dtype = "bf16"`: forwards under bf16 autocast with fp32 master weights (sharded fp32
  parameters, fp32 optimizer state), as with one rank.
- `full_state` gathers the full, unsharded state to rank 0's CPU (other ranks get {}),
  tied aliases dropped as `bus.weight_blobs.state_tensors` drops them.
- Metrics are returned on rank 0 only (micro-batch stats gathered from every rank).
"""

from __future__ import annotations

import math
from pathlib import Path

from learner.step import (
    batch_advantages,
    compute_context,
    loss_share,
    merge_stats,
    micro_loss,
    offpolicy_stats,
    padding_fraction,
    plan_micro_batches,
    replay_backward,
    take_rows,
)


def rank_device(backend: str, rank: int):
    """cuda:<rank> for nccl (`rank` is the local rank: the rank itself on one node), else the CPU."""
    import torch

    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def tied_aliases(model) -> set[str]:
    """State-dict names whose tensor is an earlier name's (tied embeddings): not published."""
    seen, aliases = set(), set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            aliases.add(name)
        seen.add(tensor.data_ptr())
    return aliases


class RankTrainer:
    """This rank's sharded policy (and reference), optimizer and step."""

    def __init__(self, lc, model_path: Path, rank: int, world: int, backend: str, local_rank: int | None = None):
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from learner.distributed import shard_model
        from learner.step import load_models

        self.lc, self.model_path, self.rank, self.world = lc, Path(model_path), rank, world
        self.device = rank_device(backend, rank if local_rank is None else local_rank)
        self.mesh = init_device_mesh(self.device.type, (world,))
        policy, ref, self.pad_id = load_models(self.model_path, lc)
        self.aliases = tied_aliases(policy)
        self.policy = shard_model(policy.to(self.device), mesh=self.mesh)
        self.ref = shard_model(ref.to(self.device), mesh=self.mesh) if ref is not None else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)

    def ensure_ref(self, lc) -> None:
        """Load (and shard) the frozen reference once `lc.beta` > 0 (the forgetting guard's
        override can raise beta mid-run); every rank does it at the same step."""
        if lc.beta <= 0 or self.ref is not None:
            return
        from transformers import AutoModelForCausalLM

        from learner.distributed import shard_model

        ref = AutoModelForCausalLM.from_pretrained(self.model_path).eval()
        ref.requires_grad_(False)
        self.ref = shard_model(ref.to(self.device), mesh=self.mesh)

    def plan(self, lengths: list[int], lc) -> list[list[int]]:
        """The step's micro-batches (`plan_micro_batches`), split further when there are
        fewer than ranks (at most ceil(batch / ranks) rows each), so every rank has work."""
        chunks = plan_micro_batches(lengths, lc.micro_batch_tokens, lc.micro_batch_size, lc.micro_batch_max_padding)
        if len(chunks) >= self.world or len(lengths) < self.world:
            return chunks
        rows = math.ceil(len(lengths) / self.world)
        return plan_micro_batches(
            lengths, lc.micro_batch_tokens, min(rows, lc.micro_batch_size or rows), lc.micro_batch_max_padding
        )

    def my_micro_batches(self, chunks: list[list[int]]) -> list[tuple[list[int], bool]]:
        """(rows, real) of this rank: every N-th micro-batch, padded with zero-weighted
        copies of the shortest one up to ceil(len / N) so all ranks run as many."""
        mine = [(c, True) for c in chunks[self.rank :: self.world]]
        n = math.ceil(len(chunks) / self.world)
        return mine + [(chunks[-1], False)] * (n - len(mine))

    def step(self, batch: dict, lc, loss_scale: float = 1.0) -> dict[str, float] | None:
        """This rank's share of one update on the packed `batch` (`learner.batch.pack_samples`,
        the same on every rank); the step's metrics on rank 0, None elsewhere."""
        import torch
        import torch.distributed as dist

        self.ensure_ref(lc)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        adv = batch_advantages(batch, lc)
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        chunks = self.plan(lengths, lc)
        jobs = self.my_micro_batches(chunks)
        backwards = len(jobs) + (1 if lc.replay.share > 0 else 0)
        max_len = batch["loss_mask"].shape[1]
        self.optimizer.zero_grad(set_to_none=True)
        parts, extra = [], {}
        for k, (rows, real) in enumerate(jobs):
            self.policy.set_requires_gradient_sync(k == backwards - 1)
            mb = take_rows(batch, rows)
            share = loss_share(lc.objective, mb["loss_mask"], batch["loss_mask"]) if real else 0.0
            with compute_context(lc.dtype, self.device):
                loss, stats = micro_loss(self.policy, self.ref, mb, adv[mb["rows"].to(self.device)], lc, max_len)
            (loss * (share * self.world * loss_scale)).backward()
            if real:
                parts.append((share, stats))
        if lc.replay.share > 0:
            self.policy.set_requires_gradient_sync(True)
            extra["replay_nll"] = replay_backward(self.policy, lc)
        if loss_scale != 1.0:
            extra["loss_scale"] = loss_scale
        params = [p for p in self.policy.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(parts, gathered, dst=0)
        if self.rank != 0:
            return None
        parts = [p for rank_parts in gathered for p in rank_parts]
        if lc.off_policy.mode != "none":
            extra.update(offpolicy_stats(parts))
        return {
            **merge_stats(parts),
            "grad_norm": float(grad_norm),
            "reward_mean": float(batch["rewards"].mean()),
            "adv_abs_mean": float(adv.abs().mean()),
            "samples": len(lengths),
            "micro_batches": len(chunks),
            "padding_frac": padding_fraction(lengths, chunks),
            **extra,
        }

    def full_state(self) -> dict:
        """The full model state on rank 0's CPU, tied aliases dropped ({} on other ranks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        return {k: v.detach().contiguous() for k, v in full.items() if k not in self.aliases}

    def save(self, root: Path, name: str, state: dict) -> None:
        """A DCP checkpoint `name` under `root` (`learner.checkpoint.save_dcp`)."""
        from learner import checkpoint

        checkpoint.save_dcp(root, name, model=self.policy, optimizer=self.optimizer, state=state, rank=self.rank)

    def load(self, path: Path) -> dict:
        """Restore the DCP checkpoint directory `path`; its saved state."""
        from learner import checkpoint

        return checkpoint.load_dcp(path, model=self.policy, optimizer=self.optimizer, rank=self.rank)
