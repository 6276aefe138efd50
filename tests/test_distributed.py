"""Multi-process learner on CPU (learner/distributed.py): two processes, gloo backend,
FSDP2 `fully_shard` on a tiny model. One sharded step equals the single-process step on
the union of both ranks' data, and a DCP sharded checkpoint round-trips model and
optimizer (the next step after loading matches the next step without the round trip)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from rlbus.model.tiny_model import build_tiny_model

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32)
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_for(rank: int) -> torch.Tensor:
    return torch.randint(4, 99, (2, 10), generator=torch.Generator().manual_seed(100 + rank))


def nll(model, ids):
    return model(input_ids=ids, labels=ids).loss


def full_params(model) -> dict[str, torch.Tensor]:
    from learner.distributed import full_state_dict

    return {k: v.detach().clone() for k, v in full_state_dict(model).items()}


def sharded(model_dir):
    from transformers import AutoModelForCausalLM

    from learner.distributed import shard_model

    model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, opt, ids) -> None:
    opt.zero_grad()
    nll(model, ids).backward()
    opt.step()


def reference_steps(model_dir, n: int) -> dict[str, torch.Tensor]:
    """Single process: n steps on the mean loss of both ranks' batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(n):
        opt.zero_grad()
        (sum(nll(model, batch_for(r)) for r in range(WORLD)) / WORLD).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank: int, port: int, model_dir: str, ckpt: str) -> None:
    import os

    import torch.distributed as dist

    from learner.distributed import init_from_env, load_sharded, save_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    try:
        assert init_from_env("gloo") == (rank, WORLD)
        model, opt = sharded(model_dir)
        step(model, opt, batch_for(rank))
        got = full_params(model)
        want = reference_steps(model_dir, 1)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=f"param {k}")

        save_sharded(ckpt, model, opt, {"step": 1})
        step(model, opt, batch_for(rank))
        after_two = full_params(model)

        fresh, fresh_opt = sharded(model_dir)
        assert load_sharded(ckpt, fresh, fresh_opt) == {"step": 1}
        for k, v in full_params(fresh).items():
            torch.testing.assert_close(v, got[k], msg=f"param {k} after load")
        step(fresh, fresh_opt, batch_for(rank))  # needs the restored Adam moments to match
        for k, v in full_params(fresh).items():
            torch.testing.assert_close(v, after_two[k], rtol=1e-5, atol=1e-6, msg=f"param {k} step after load")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.e2e  # multi-process / fault case: make test-e2e
def test_fsdp2_two_processes_gloo_step_and_sharded_checkpoint(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", **TINY)
    mp.spawn(worker, args=(free_port(), str(model_dir), str(tmp_path / "ckpt")), nprocs=WORLD, join=True)
    assert (tmp_path / "ckpt" / ".metadata").exists() and (tmp_path / "ckpt" / "state.json").exists()
