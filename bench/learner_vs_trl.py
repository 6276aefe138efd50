"""Learner benchmark: tokens/s per optimizer step, ours vs TRL GRPOTrainer, one run.

What it measures (`python bench/learner_vs_trl.py`, about 2 minutes):

- Both sides train an IDENTICAL tiny model (`rlbus.model.tiny_model`, same seed, loaded from
  the same directory into two separate copies) on the SAME precomputed completions:
  arith prompts (difficulty 3), G samples each, drawn once with `HFEngine` at
  temperature 1 and scored by the real `arith` verifier. Generation is excluded on both
  sides; what is timed is one optimizer step: forward, backward, grad clipping (1.0),
  AdamW step, zero_grad.
- OURS: `learner.step.train_step` (or `learner.worker.train_step` before the move) on
  the real `Reward` messages, i.e. `pack_samples` + `grpo_loss` + backward + AdamW,
  with the learner's default config (GRPO, beta=0, clip 0.2/0.28).
- PEER: TRL `GRPOTrainer` with beta=0, loss_type="grpo", num_iterations=1. Its
  `_prepare_inputs` (which generates and scores) is overridden to return the prepared
  inputs dict unchanged, exactly the dict `_generate_and_score_completions` would
  return (left-padded prompt ids/mask, right-padded completion ids/mask, group-relative
  advantages, num_items_in_batch); then the trainer's own `training_step` (its
  `compute_loss` + accelerator backward), then clip + optimizer step + scheduler step +
  zero_grad as `Trainer` does in its loop.
- tokens = real (unpadded) prompt + completion tokens of the batch, the same number on
  both sides; tokens/s = tokens / median step time. Steps alternate in rounds (ours k
  steps, TRL k steps, ...) so load from other processes hits both sides alike.
- Both run with the same torch thread budget (`--threads`, default 1, the learner's
  default).

Writes bench/results/learner_vs_trl.json: per shape, ours/peer tokens/s and `ratio`;
the top-level `ratio` is the geometric mean over shapes (target >= 1.0). Also
`gradient_agreement` (see `gradient_agreement`): the cosine and norm ratio of one
unclipped SGD step of each side on the same batch, which shows both sides train the same
objective, so the speed ratio compares like with like.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "learner_vs_trl.json"
# name -> (prompts per step, group size G, max new tokens)
SHAPES = {"demo": (16, 8, 8), "long": (8, 8, 48)}


def build_model(out: Path) -> Path:
    """The demo's tiny qwen2 (hidden 128, 4 layers), with room for the long shape."""
    from rlbus.model.tiny_model import build_tiny_model

    return build_tiny_model(
        out, arch="qwen2", hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=64, seed=0
    )


def make_rewards(model_dir: Path, n_prompts: int, group: int, max_new: int, seed: int):
    """Real Reward messages: HFEngine samples scored by the arith verifier."""
    from producers.domains import arith
    from rollout_workers.engines.hf_engine import HFEngine
    from rollout_workers.worker import single_turn_trajectories
    from schemas import ChatMessage, Task
    from verifier_workers.worker import score

    rng = random.Random(seed)
    engine = HFEngine(str(model_dir), "cpu", 1)
    problems = [arith.generate(rng, 3) for _ in range(n_prompts)]
    groups = engine.generate([p.prompt for p in problems], group, max_new, 1.0)
    rewards = []
    for i, (p, samples) in enumerate(zip(problems, groups)):
        task = Task(
            run_id="bench",
            task_id=f"t{i}",
            domain="arith",
            difficulty=3,
            group_size=group,
            prompt=[ChatMessage(role="user", content=p.prompt)],
            verifier="arith",
            verifier_params={"expression": p.expression},
            max_tokens=max_new,
        )
        rewards += [score(t) for t in single_turn_trajectories(task, samples, 0, 0.0)]
    # the untrained model earns no reward: give each group a spread of rewards so the
    # advantages are non-zero (the math is identical whatever the values are)
    for j, r in enumerate(rewards):
        r.reward = float(j % 2)
    return rewards


def trl_inputs(rewards, pad_id: int):
    """The dict GRPOTrainer._generate_and_score_completions returns, for the same samples."""
    import torch

    from learner.losses import group_advantages
    from schemas import unpack_i32

    prompts = [unpack_i32(r.trajectory.turns[0].token_ids) for r in rewards]
    comps = [unpack_i32(r.trajectory.turns[1].token_ids) for r in rewards]
    B, P, C = len(rewards), max(map(len, prompts)), max(map(len, comps))
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    completion_ids = torch.full((B, C), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        prompt_ids[i, P - len(p) :] = torch.from_numpy(p.astype("int64"))
        prompt_mask[i, P - len(p) :] = 1
        completion_ids[i, : len(c)] = torch.from_numpy(c.astype("int64"))
        completion_mask[i, : len(c)] = 1
    groups = {g: k for k, g in enumerate(dict.fromkeys(r.trajectory.group_id for r in rewards))}
    adv = group_advantages(
        torch.tensor([r.reward for r in rewards]),
        torch.tensor([groups[r.trajectory.group_id] for r in rewards]),
        normalize_std=True,
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": adv,
        "num_items_in_batch": completion_mask.sum(),
    }


class Ours:
    """Our learner step on Reward messages."""

    def __init__(self, model_dir: Path, rewards, lr: float, learner_fields: dict | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from learner.groups import PooledSample
        from schemas.config import LearnerSection

        try:
            from learner.step import train_step
        except ImportError:  # before train_step moved out of worker.py
            from learner.worker import train_step
        self.train_step = train_step
        self.lc = LearnerSection(lr=lr, **(learner_fields or {}))
        self.policy = AutoModelForCausalLM.from_pretrained(model_dir)
        self.policy.train()
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr, weight_decay=self.lc.weight_decay)
        self.samples = [PooledSample(r, None) for r in rewards]

    def step(self, samples=None, loss_scale: float = 1.0) -> dict:
        return self.train_step(
            self.policy, None, self.opt, self.samples if samples is None else samples, 0, self.lc, loss_scale=loss_scale
        )


class Peer:
    """TRL GRPOTrainer's training step on the prepared inputs dict (no generation)."""

    def __init__(self, model_dir: Path, inputs: dict, group: int, max_new: int, lr: float, tmp: Path):
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        class NoGenerationGRPO(GRPOTrainer):
            """GRPOTrainer whose input preparation returns the precomputed completions."""

            def _prepare_inputs(self, generation_batch):
                return generation_batch

        B = inputs["completion_ids"].shape[0]
        args = GRPOConfig(
            output_dir=str(tmp / "trl"),
            per_device_train_batch_size=B,
            num_generations=group,
            max_completion_length=max_new,
            beta=0.0,
            loss_type="grpo",
            learning_rate=lr,
            num_iterations=1,
            use_cpu=True,
            bf16=False,
            report_to="none",
            logging_steps=10**9,
            save_strategy="no",
            max_grad_norm=1.0,
            gradient_accumulation_steps=1,
            lr_scheduler_type="constant",
            optim="adamw_torch",
            weight_decay=0.0,
            epsilon=0.2,
            epsilon_high=0.28,
            disable_tqdm=True,
        )
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = NoGenerationGRPO(
                model=model,
                reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                args=args,
                train_dataset=Dataset.from_dict({"prompt": ["1+1="] * B}),
                processing_class=tok,
            )
        self.trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
        self.trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop per update
        self.model, self.inputs, self.torch = self.trainer.model, inputs, torch

    def step(self, inputs: dict | None = None) -> None:
        t, inputs = self.trainer, self.inputs if inputs is None else inputs
        t.training_step(self.model, dict(inputs), inputs["num_items_in_batch"])
        t.accelerator.clip_grad_norm_(self.model.parameters(), t.args.max_grad_norm)
        t.optimizer.step()
        t.lr_scheduler.step()
        self.model.zero_grad(set_to_none=True)


def gradient_agreement(model_dir: Path, tmp: Path, shape: str = "demo", seed: int = 0, skip: str = "none") -> dict:
    """Do both sides compute the SAME update direction on the same batch? One plain SGD step
    (lr 1, no clipping) from identical models on identical completions, where half the
    groups have rewards that differ and half are all zero (they must contribute nothing on
    either side): the cosine and norm ratio of the two parameter deltas. Same objective,
    same advantages, same token reduction: cosine 1 and norm ratio 1 up to float error.

    `skip`: what ours does with the all-equal groups (TRL always trains them): `none`
    trains them too; `keep_scale` skips them as `learner.skipped_keep_scale` does (the
    same gradient: cosine 1, norm ratio 1); `dapo` skips them and normalises over the
    rest (the same direction, a larger norm)."""
    import torch

    from learner.step import skipped_loss_scale

    n_prompts, group, max_new = SHAPES[shape]
    rewards = make_rewards(model_dir, n_prompts, group, max_new, seed)
    for j, r in enumerate(rewards):
        g = j // group
        r.reward = float((j * 7 + g) % 3 == 0) if g % 2 == 0 else 0.0
    inputs = trl_inputs(rewards, pad_id=0)
    ours, peer = Ours(model_dir, rewards, 1.0), Peer(model_dir, inputs, group, max_new, 1.0, tmp)
    ours.opt = torch.optim.SGD(ours.policy.parameters(), lr=1.0)
    ours.lc.grad_clip = 1e12
    t = peer.trainer
    t.optimizer = torch.optim.SGD(peer.model.parameters(), lr=1.0)
    t.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda _: 1.0)
    t.args.max_grad_norm = 1e12
    trained = [
        p
        for i, p in enumerate(ours.samples)
        if skip == "none" or len({r.reward for r in rewards[i - i % group : i - i % group + group]}) > 1
    ]
    skipped = [p.reward for p in ours.samples if p not in trained]
    scale = skipped_loss_scale(ours.lc.objective, [p.reward for p in trained], skipped) if skip == "keep_scale" else 1.0
    deltas = []
    for model, step in ((ours.policy, lambda: ours.step(trained, scale)), (peer.model, peer.step)):
        before = [p.detach().clone() for p in model.parameters()]
        step()
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    d_ours, d_peer = deltas
    return {
        "shape": shape,
        "skip": skip,
        "cosine": round(float(torch.nn.functional.cosine_similarity(d_ours, d_peer, dim=0)), 6),
        "norm_ratio": round(float(d_ours.norm() / d_peer.norm()), 6),
        "groups_with_signal": sum(
            len({r.reward for r in rewards[i : i + group]}) > 1 for i in range(0, len(rewards), group)
        ),
        "groups": n_prompts,
    }


def measure_shape(name: str, model_dir: Path, tmp: Path, rounds: int, per_round: int, lr: float, seed: int) -> dict:
    n_prompts, group, max_new = SHAPES[name]
    rewards = make_rewards(model_dir, n_prompts, group, max_new, seed)
    inputs = trl_inputs(rewards, pad_id=0)
    tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    ours, peer = Ours(model_dir, rewards, lr), Peer(model_dir, inputs, group, max_new, lr, tmp)
    for _ in range(2):  # warm-up (allocator, first-call overheads)
        ours.step()
        peer.step()
    times = {"ours": [], "peer": []}
    for _ in range(rounds):
        for side, obj in (("ours", ours), ("peer", peer)):
            for _ in range(per_round):
                t0 = time.perf_counter()
                obj.step()
                times[side].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "prompts_per_step": n_prompts,
        "group_size": group,
        "max_new_tokens": max_new,
        "samples_per_step": len(rewards),
        "tokens_per_step": tokens,
        "completion_tokens_per_step": int(inputs["completion_mask"].sum()),
        "ours_tokens_per_s": round(tokens / med["ours"], 1),
        "peer_tokens_per_s": round(tokens / med["peer"], 1),
        "ratio": round(med["peer"] / med["ours"], 3),
        "ours_step_s": {"median": round(med["ours"], 4), "min": round(min(times["ours"]), 4)},
        "peer_step_s": {"median": round(med["peer"], 4), "min": round(min(times["peer"]), 4)},
        "steps_timed_per_side": rounds * per_round,
    }


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=4)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    from importlib.metadata import version

    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-learner-") as d:
        tmp = Path(d)
        model_dir = build_model(tmp / "model")
        for name in a.shapes.split(","):
            shapes[name] = measure_shape(name, model_dir, tmp, a.rounds, a.per_round, 1e-6, 0)
            print(name, json.dumps(shapes[name]))
        agreement = gradient_agreement(model_dir, tmp)
        print("gradient agreement", json.dumps(agreement))
    ratio = math.exp(sum(math.log(s["ratio"]) for s in shapes.values()) / len(shapes))
    result = {
        "name": "learner_vs_trl",
        "ours": {k: s["ours_tokens_per_s"] for k, s in shapes.items()},
        "peer": {k: s["peer_tokens_per_s"] for k, s in shapes.items()},
        "unit": "tokens/s per optimizer step (prompt+completion tokens, generation excluded)",
        "ratio": round(ratio, 3),
        "ratio_note": "geometric mean over shapes of ours/peer tokens/s",
        "target_ratio": 1.0,
        "peer_name": f"TRL {version('trl')} GRPOTrainer.training_step (+clip, AdamW step) on prepared inputs",
        "command": "python bench/learner_vs_trl.py" + (f" --threads {a.threads}" if a.threads != 1 else ""),
        "shapes": shapes,
        "gradient_agreement": agreement,
        "model": {"arch": "qwen2", "hidden_size": 128, "num_layers": 4, "num_heads": 4, "vocab": 99},
        "settings": {
            "threads": a.threads,
            "rounds": a.rounds,
            "per_round": a.per_round,
            "beta": 0.0,
            "loss": "grpo (token-level clipped ratio, eps 0.2/0.28)",
            "optimizer": "AdamW, clip 1.0",
        },
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "trl": version("trl"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratio ours/TRL = {result['ratio']} (target >= 1.0); wrote {RESULT.relative_to(ROOT)}")
    return result


if __name__ == "__main__":
    main()
