"""The sharded learner (learner/ranks.py, learner/sharded.py) on CPU with gloo and 2 ranks:
the pytest process is rank 0 and starts rank 1 as `rlbus worker learner` would.

- The same batches give the same parameters as one rank after K steps (fp32, max abs
  diff <= 1e-5), with an odd number of micro-batches (one rank runs a zero-weighted one).
- A DCP checkpoint round trip: save, step, load, the same step again gives the same weights.
- bf16 autocast steps (fp32 master weights) track fp32 steps over 20 steps.
- Bad input fails at start with one line that says what to do.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.distributed import world_problem
from learner.groups import PooledSample
from learner.step import train_step
from schemas.config import LearnerSection
from tests.test_learner_efficiency import needs_bf16, samples

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64)
K = 4  # steps compared
EQUIV_ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(**TINY)


def batches(n: int) -> list[list[PooledSample]]:
    """n different batches of 5 groups x 3 (15 samples: 3 micro-batches of <= 5)."""
    return [samples(n_groups=5, size=3, seed=100 + k) for k in range(n)]


def one_rank(model_dir, lc, steps, lcs=None) -> tuple[dict, list[dict]]:
    """The one-process learner step on the same batches (step k with `lcs[k]`, default
    `lc`): final weights and metrics."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)
    lcs = lcs or [lc] * len(steps)
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval() if any(x.beta > 0 for x in lcs) else None
    metrics = [train_step(model, ref, opt, batch, 0, step_lc) for batch, step_lc in zip(steps, lcs)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


def max_diff(a: dict, b: dict) -> float:
    assert set(a) <= set(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank_and_dcp_round_trips(model_dir, tmp_path):
    from learner.ranks import RankGroup

    lc = LearnerSection(
        world_size=2, backend="gloo", lr=1e-3, micro_batch_size=5, dist_timeout_s=60, micro_batch_max_padding=0.0
    )  # the micro-batch counts below are the test's design
    # the first half with micro-batches of <= 5 (3: one rank runs a zero-weighted one), the
    # rest without a cap (1 micro-batch on one rank, split in 2 for 2 ranks) and with a KL
    # term (beta raised mid-run, as the forgetting guard does: the ranks load the reference then)
    lcs = [lc] * (K // 2) + [lc.model_copy(update={"micro_batch_size": 0, "beta": 0.04})] * (K - K // 2)
    steps = batches(K + 1)
    want, want_metrics = one_rank(model_dir, lc, steps[:K], lcs)

    async def sharded():
        group = RankGroup(lc, model_dir, tmp_path / "run", exit_on_rank_death=False)
        await group.start()
        try:
            pids = json.loads((tmp_path / "run" / "learner_ranks.json").read_text())["pids"]
            assert set(pids) == {"0", "1"} and int(pids["0"]) == os.getpid()
            metrics = [await group.train(batch, step_lc) for batch, step_lc in zip(steps[:K], lcs)]
            got = await group.full_state()
            await group.save(tmp_path / "ckpt", {"step": K, "trained": ["a"]})
            await group.train(steps[K], lc)
            after = await group.full_state()
            state = await group.load(tmp_path / "ckpt")
            restored = await group.full_state()
            await group.train(steps[K], lc)  # needs the restored Adam moments to match
            again = await group.full_state()
        finally:
            await group.close()
        return metrics, got, state, after, restored, again

    metrics, got, state, after, restored, again = asyncio.run(sharded())
    diff = max_diff(got, want)
    print(f"2 ranks vs 1 rank after {K} steps: max abs param diff {diff:.3g}")
    assert diff <= EQUIV_ATOL, diff
    assert "lm_head.weight" not in got  # tied to the embeddings: published once, as one rank does
    assert [(m["micro_batches"], w["micro_batches"]) for m, w in zip(metrics, want_metrics)] == [(3, 3)] * (K // 2) + [
        (2, 1)
    ] * (K - K // 2)
    for m, w in zip(metrics, want_metrics):
        assert m["samples"] == w["samples"] == 15
        assert m["loss"] == pytest.approx(w["loss"], abs=1e-5) and m["grad_norm"] == pytest.approx(
            w["grad_norm"], rel=1e-4
        )
        assert m["tokens"] == w["tokens"] and m["kl"] == pytest.approx(w["kl"], abs=1e-6)
    assert metrics[-1]["kl"] > 0
    assert state == {"step": K, "trained": ["a"]}
    assert max_diff(restored, got) == 0.0
    assert max_diff(again, after) <= 1e-7
    root = tmp_path / "ckpt"
    latest = (root / "LATEST").read_text()
    assert [p.name for p in root.iterdir() if p.is_dir()] == [latest]
    assert {"rng-0.pt", "rng-1.pt", "state.json", ".metadata"} <= {p.name for p in (root / latest).iterdir()}
    assert not (tmp_path / "run" / "learner_ranks.json").exists()


BF16_STEPS = 20
BF16_UPDATE_RTOL = 0.10  # ||update_bf16 - update_fp32|| / ||update_fp32|| after 20 AdamW steps at lr 1e-4
BF16_LOSS_ATOL = 1e-3  # per-step loss difference (the GRPO losses here are of order 1e-2)
BF16_GRAD_NORM_RTOL = 0.02  # per-step gradient-norm difference, relative


@needs_bf16
@pytest.mark.timeout(120)
def test_bf16_steps_track_fp32_steps(model_dir):
    lc32 = LearnerSection(lr=1e-4)
    steps = batches(BF16_STEPS)
    w32, m32 = one_rank(model_dir, lc32, steps)
    w16, m16 = one_rank(model_dir, lc32.model_copy(update={"dtype": "bf16"}), steps)
    w0 = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    d32 = torch.cat([(w32[k] - w0[k]).flatten() for k in w32])
    d16 = torch.cat([(w16[k] - w0[k]).flatten() for k in w32])
    update_dev = float((d16 - d32).norm() / d32.norm())
    loss_dev = max(abs(a["loss"] - b["loss"]) for a, b in zip(m16, m32))
    norm_dev = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(m16, m32))
    print(
        f"bf16 vs fp32 over {BF16_STEPS} steps: relative update deviation {update_dev:.3g}, "
        f"max per-step loss diff {loss_dev:.3g}, max grad-norm deviation {norm_dev:.3g}"
    )
    assert all(p.dtype == torch.float32 for p in w16.values())  # fp32 master weights
    assert update_dev <= BF16_UPDATE_RTOL, update_dev
    assert loss_dev <= BF16_LOSS_ATOL, loss_dev
    assert norm_dev <= BF16_GRAD_NORM_RTOL, norm_dev


@pytest.mark.parametrize(
    "update, words",
    [
        ({"world_size": 3}, "this machine has"),  # more gloo ranks than cores (this machine: 2)
        ({"world_size": 2, "backend": "nccl"}, "needs CUDA"),
        ({"world_size": 2, "lora": {"rank": 4}}, "LoRA"),
        ({"world_size": 2, "pcgrad": True}, "PCGrad"),
        ({"world_size": 2, "policy": "null"}, "null"),
    ],
)
def test_bad_world_is_a_start_up_error(update, words):
    cores = os.cpu_count() or 1
    if "world_size" in update and update["world_size"] == 3:
        update = {"world_size": cores + 1}
    if update.get("backend") == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    problem = world_problem(LearnerSection(**update))
    assert problem and words in problem and "set learner." in problem and "\n" not in problem, problem
    assert world_problem(LearnerSection(world_size=min(2, cores))) is None  # 2 ranks fit on this 2-core machine


def test_worker_refuses_too_many_ranks_before_starting_any(tmp_path):
    cores = os.cpu_count() or 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "worker",
            "learner",
            "--config",
            "examples/smoke.toml",
            "--run-id",
            "bad",
            "--run-dir",
            str(tmp_path),
            "--nats-url",
            "nats://127.0.0.1:1",
            "--set",
            f"learner.world_size={cores + 1}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert f"learner.world_size = {cores + 1}" in last and f"set learner.world_size <= {cores}" in last, out.stderr
    assert not (tmp_path / "bad" / "learner_ranks.json").exists()


def test_up_refuses_too_many_ranks_before_anything_starts(tmp_path):
    cores = os.cpu_count() or 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            "examples/smoke.toml",
            "--run-dir",
            str(tmp_path),
            "--set",
            f"learner.world_size={cores + 1}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"rlbus up: learner.world_size = {cores + 1}" in out.stdout and "set learner.world_size" in out.stdout
    assert not list(tmp_path.iterdir())  # no run folder, no server, no SFT


def test_bad_backend_name_is_a_config_error():
    with pytest.raises(ValueError, match="backend"):
        LearnerSection(backend="mpi")


RANK0 = """
import asyncio, sys, time
from learner.ranks import RankGroup
from schemas.config import LearnerSection

async def main():
    group = RankGroup(LearnerSection(world_size=2, backend="gloo"), sys.argv[1], sys.argv[2])
    await group.start()
    print("up", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.timeout(120)
@pytest.mark.e2e  # multi-process / fault case: make test-e2e
def test_a_rank_dies_with_rank_0(model_dir, tmp_path):
    """kill -9 of rank 0 (the learner worker) leaves no rank behind (no orphan)."""
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model_dir), str(run)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        while proc.stdout.readline().strip() != "up":  # skip the log lines
            assert proc.poll() is None
        pids = {r: int(p) for r, p in json.loads((run / "learner_ranks.json").read_text())["pids"].items()}
        assert pids["0"] == proc.pid
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pids['1']}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pids['1']}").exists(), "rank 1 outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
