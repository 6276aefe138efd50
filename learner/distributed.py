"""Multi-process learner pieces: process group from torchrun's environment, FSDP2 sharding,
DDP, and sharded checkpoints with torch.distributed.checkpoint (DCP).

Sources: FSDP2 (`torch.distributed.fsdp.fully_shard`, per-parameter DTensor sharding;
Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
arXiv:2304.11277) and DCP (each rank writes its own shards plus shared metadata, and
loading reshards to the current world). See docs/multi_gpu.md for the torchrun launch.

Guarantees:
- `shard_model` wraps every decoder block, then the root, with `fully_shard` (the
  recommended FSDP2 layout: one all-gather per block in forward and backward).
- `save_sharded` / `load_sharded` round-trip model and optimizer state exactly through
  DCP; every rank calls them (they are collectives). The directory is complete only
  after `save_sharded` returns on every rank.
- `full_state_dict` gathers an unsharded CPU copy of the model state on every rank (for
  weight publishing from rank 0).
- Nothing here runs at import; torch.distributed is imported by the functions.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "decoder_layers",
    "full_state_dict",
    "init_from_env",
    "load_sharded",
    "resolve_backend",
    "save_sharded",
    "shard_model",
    "world_problem",
    "wrap_ddp",
]


def resolve_backend(backend: str) -> str:
    """`auto` -> nccl where CUDA is available, else gloo; other names unchanged."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def world_problem(lc) -> str | None:
    """Why the learner section `lc` cannot start its ranks on this machine (one line that
    says what to do), or None. Checked before any rank starts: nccl needs CUDA and at most
    one rank per visible GPU; gloo at most one rank per CPU core (`os.cpu_count`); a
    sharded learner trains a full model (no LoRA, no PCGrad, not the null policy). With
    `learner.launch = "external"` this process is one rank (the others run elsewhere): nccl
    needs CUDA here, and the device counts of the other machines are theirs to check."""
    n = lc.world_size
    if n == 1:
        return None
    if lc.policy == "null":
        return f"learner.world_size = {n} with learner.policy = 'null' (no model to shard); set learner.world_size = 1"
    if lc.lora.rank > 0:
        return (
            f"learner.world_size = {n} does not support LoRA yet; set learner.lora.rank = 0 or learner.world_size = 1"
        )
    if lc.pcgrad:
        return f"learner.world_size = {n} does not support PCGrad yet; set learner.pcgrad = false or learner.world_size = 1"
    import torch

    backend = resolve_backend(lc.backend)
    if backend == "nccl":
        if not torch.cuda.is_available():
            return "learner.backend = 'nccl' needs CUDA, which this machine lacks; set learner.backend = 'gloo' (or 'auto')"
        if lc.launch == "external":
            return None
        gpus = torch.cuda.device_count()
        if n > gpus:
            return (
                f"learner.world_size = {n} but only {gpus} CUDA device(s) are visible; set learner.world_size <= {gpus}"
            )
        return None
    cores = os.cpu_count() or 1
    if n > cores and lc.launch != "external":
        return f"learner.world_size = {n} but this machine has {cores} CPU core(s) for gloo; set learner.world_size <= {cores}"
    return None


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT);
    returns (rank, world_size). Backend: nccl with CUDA, else gloo."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def decoder_layers(model):
    """The transformer blocks of a HF causal LM (also under a peft wrapper)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers in {type(inner).__name__} (expected .model.layers)")
    return list(layers)


def shard_model(model, *, mesh=None, reshard_after_forward: bool = True, mp_policy=None):
    """FSDP2: `fully_shard` each decoder block, then the whole model; returns the model.
    `mp_policy`: an optional `MixedPrecisionPolicy` for every unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def wrap_ddp(model):
    """DistributedDataParallel over the default process group (gradients all-reduced in backward)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def save_sharded(path: str | Path, model, optimizer, state: dict | None = None) -> None:
    """Write a DCP checkpoint of model + optimizer from every rank; rank 0 adds the small
    JSON-able `state` (counters, log position) as `state.json` next to it."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        tmp = Path(path) / "state.json.tmp"
        tmp.write_text(json.dumps(state or {}))
        os.replace(tmp, Path(path) / "state.json")
    dist.barrier()


def load_sharded(path: str | Path, model, optimizer) -> dict:
    """Restore model + optimizer in place from a DCP checkpoint (resharding to this world);
    returns the saved `state`."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    payload = {"model": model_sd, "optim": optim_sd}
    dcp.load(payload, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
    return json.loads((Path(path) / "state.json").read_text())


def full_state_dict(model) -> dict:
    """Unsharded CPU state dict (a collective: call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().to("cpu") for k, v in full.items()}
