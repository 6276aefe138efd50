"""GPU check: the learner step, HF generation and the weight publish path on one CUDA GPU, one JSON line.

What it measures (`python bench/gpu_check.py`, one CUDA GPU, at most 8 minutes; `--device
cpu --tiny` runs the same code on a tiny shape in seconds):

- MODEL: a randomly initialised Qwen2-shaped causal LM of about 0.5B parameters (the
  Qwen2-0.5B shape: hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151 936,
  tied embeddings), built on the device; no checkpoint, no hub (runs offline).
- LEARNER: `--steps` timed train steps (after `--warmup` untimed ones) on a synthetic GRPO
  batch (`--batch` sequences of `--seq-len` tokens, groups of 8, rewards 0/1, the last 3/4
  of each sequence trainable): token log-probs from one forward, the project's GRPO loss
  (`learner.losses.group_advantages` + `policy_loss`, PPO-clip, on-policy ratios), backward,
  `torch.optim.AdamW` step; in bf16 autocast with fp32 master weights on CUDA, as
  `learner.dtype = "bf16"` runs it (fp32 on CPU). `learner_tok_s` = sequence tokens per
  second of wall time. `mfu` = (6 * params * tokens per step) / step time / 790 TFLOP/s
  (the H200 bf16 dense peak taken here; `--peak-tflops` to change it): 6N FLOPs per token for forward + backward, params counted once
  (the tied embedding too, since it is also the LM head), attention's sequence-length term
  ignored. null on CPU.
- GENERATE: HF `model.generate` on a bf16 copy (fp32 on CPU), as
  `rollout_workers.engines.hf_engine.HFEngine.generate` calls it: all prompts x samples in ONE batched
  call with the KV cache, sampling at temperature 1 (top-k/top-p off), logits kept and the
  sampled tokens' log-probs computed after; exactly `--new-tokens` per sequence (no EOS).
  `generate_tok_s` = generated tokens per second, the log-prob pass included, after one warm-up call.
- PUBLISH: the learner's path to a `file://` weight store: the full fp32 state
  (`bus.weight_blobs.state_tensors`, tied tensors once) as safetensors (zero-copy
  `state_segments` for CPU tensors, else `state_to_bytes`, which copies device -> host),
  written to a temp file renamed into place while a thread hashes the same buffers
  (sha256), as `bus.weight_stores.FileStore.put_segments` does. `publish_gb_s` = bytes /
  (wall time from model to file in place and hash done), in GB/s (1e9 bytes).
- LONGCTX (issue 33's prefix-reuse bench on the GPU): per history length (`--histories`, 2k/8k/32k
  tokens on the 0.5B shape), the time of one later turn of a multi-turn episode: the context is
  the history plus a `LONGCTX_OBS`-token tool observation, then `LONGCTX_GEN` greedy tokens.
  `off` prefills the whole context (no reuse); `on` continues from the KV cache of the history
  as the previous turn left it (a deep copy of a `DynamicCache`, the HF engine's
  `rollout.hf.prefix_reuse`), so only the observation is prefilled. Both sides' ids must be
  equal (greedy; a difference is reported as `ids_equal: false`). `longctx_exponent_off/on` =
  the least-squares slope of log(turn time) on log(history) (1 = linear; the goal with reuse: at most 1).
- LOOP: not run (`loop: null`): it needs nats-server.

Imports only torch, transformers, safetensors, numpy, the standard library and project
modules that need nothing else (`bench`, `bus.weight_blobs`, `learner.losses`): it runs on
a box with just torch + transformers installed. Prints ONE JSON line on stdout (progress on
stderr); without `--tiny` it also writes bench/results/gpu_check.json (or `--out`). Without
a CUDA GPU and without `--device cpu` it prints one `SKIP` line and exits 0 (`make bench`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "gpu_check.json"
PEAK_FLOPS = 790e12  # H200 bf16 dense, FLOP/s
BUDGET_S = 480.0  # the whole check, model build included
GROUP = 8

SHAPES = {
    "qwen2-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=40960,  # room for the 32k long-context history (rope, no learned table)
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
}
# per shape: learner batch, seq len, steps, warm-up; generation prompts, samples, prompt len, new tokens
WORKLOADS = {
    "qwen2-0.5b": dict(batch=8, seq_len=2048, steps=5, warmup=2, prompts=8, samples=8, prompt_len=128, new_tokens=256),
    "tiny": dict(batch=8, seq_len=64, steps=3, warmup=1, prompts=2, samples=2, prompt_len=8, new_tokens=16),
}
HISTORIES = {"qwen2-0.5b": [2048, 8192, 32768], "tiny": [64, 128, 256]}
LONGCTX_OBS, LONGCTX_GEN = 64, 32


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(torch, shape: str, device, seed: int):
    """The random-init Qwen2 causal LM of `shape`, fp32, on `device`; (model, params)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(seed)
    with device:
        model = Qwen2ForCausalLM(config)
    model.config.use_cache = False
    return model, sum(p.numel() for p in model.parameters())


def grpo_loss_fn():
    """(loss(logp, behavior, rewards, group_ids, mask) -> scalar, description): the project's
    GRPO loss where `learner.losses` imports, else a plain policy-gradient loss."""
    try:
        from learner.losses import group_advantages, policy_loss
    except ImportError as exc:  # a later learner.losses that needs more than torch: say so, still measure

        def plain(logp, behavior, rewards, group_ids, mask):
            adv = rewards - rewards.view(-1, GROUP).mean(1).repeat_interleave(GROUP)
            return -((adv[:, None] * logp * mask).sum() / mask.sum())

        return plain, f"plain token log-prob policy gradient (learner.losses not importable: {exc})"

    def grpo(logp, behavior, rewards, group_ids, mask):
        adv = group_advantages(rewards, group_ids)
        return policy_loss(logp, behavior, adv, mask, clip_low=0.2, clip_high=0.2, beta=0.0)[0]

    return grpo, "learner.losses.policy_loss (GRPO: group_advantages, PPO-clip 0.2, beta 0, on-policy ratios) + AdamW"


def token_logprobs(torch, model, ids):
    """log p(token t+1 | tokens <= t), [B, L-1], as `learner.batch.token_logprobs` computes it."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def learner_bench(torch, model, params: int, device, w: dict, deadline: float, peak: float = PEAK_FLOPS) -> dict:
    """Timed GRPO train steps on a synthetic batch (see the module docstring)."""
    import contextlib

    loss_fn, step_desc = grpo_loss_fn()
    B, L = w["batch"], w["seq_len"]
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(2, model.config.vocab_size, (B, L), generator=g).to(device)
    rewards = torch.randint(0, 2, (B,), generator=g).float().to(device)
    group_ids = (torch.arange(B) // GROUP).to(device)
    mask = torch.zeros(B, L - 1, device=device)
    mask[:, L // 4 :] = 1.0
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    model.train()
    times = []
    for i in range(w["warmup"] + w["steps"]):
        if i >= w["warmup"] and times and time.monotonic() > deadline:
            break
        sync(torch, device)
        t0 = time.perf_counter()
        with autocast:
            logp = token_logprobs(torch, model, ids)
            loss = loss_fn(logp, logp.detach(), rewards, group_ids, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(torch, device)
        if i >= w["warmup"]:
            times.append(time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)
    del opt
    step_s = sorted(times)[len(times) // 2]
    tokens = B * L
    flops = 6 * params * tokens
    return {
        "learner_tok_s": round(tokens / step_s, 1),
        "step_s": round(step_s, 4),
        "steps_timed": len(times),
        "step_s_all": [round(t, 4) for t in times],
        "mfu": round(flops / step_s / peak, 4) if cuda else None,
        "step": step_desc,
        "learner_precision": "bf16 autocast, fp32 master weights" if cuda else "fp32",
        "learner_batch": {"sequences": B, "seq_len": L, "tokens_per_step": tokens, "trainable_frac": 0.75},
        "mfu_basis": f"6 * params ({params}) * tokens per step / median step time / {peak / 1e12:g} TFLOP/s "
        "bf16 dense peak; attention's sequence-length term ignored",
    }


def generate_bench(torch, model, device, w: dict) -> dict:
    """Sampled generation with per-token log-probs in one batched `generate` call (see the docstring)."""
    import copy

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = copy.deepcopy(model).to(dtype).eval()
    gen.config.use_cache = True
    g = torch.Generator(device="cpu").manual_seed(2)

    def once(gen, prompts: int, samples: int, new_tokens: int) -> tuple[int, float]:
        ids = torch.randint(2, gen.config.vocab_size, (prompts, w["prompt_len"]), generator=g).to(device)
        sync(torch, device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = gen.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                num_return_sequences=samples,
                pad_token_id=0,
                eos_token_id=None,
                use_cache=True,
                output_logits=True,
                return_dict_in_generate=True,
            )
            seqs = out.sequences[:, ids.shape[1] :]
            logits = torch.stack(out.logits, dim=1).float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)
            logp.cpu()
        sync(torch, device)
        return seqs.numel(), time.perf_counter() - t0

    once(gen, min(2, w["prompts"]), 2, 8)  # warm-up
    tokens, dt = once(gen, w["prompts"], w["samples"], w["new_tokens"])
    del gen
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "generate_tok_s": round(tokens / dt, 1),
        "generate_s": round(dt, 3),
        "generate_dtype": str(dtype).replace("torch.", ""),
        "generate_batch": {
            "prompts": w["prompts"],
            "samples": w["samples"],
            "prompt_len": w["prompt_len"],
            "new_tokens": w["new_tokens"],
        },
        "generate": "HF model.generate, one batched call, KV cache, temperature 1, per-token log-probs "
        "(as rollout_workers.engines.hf_engine.HFEngine.generate)",
    }


def longctx_bench(torch, model, device, histories: list[int]) -> dict:
    """A later turn's time at each history, prefix reuse off vs on (see the docstring's LONGCTX)."""
    import copy
    import math

    from transformers import DynamicCache

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = copy.deepcopy(model).to(dtype).eval()
    g = torch.Generator(device="cpu").manual_seed(3)

    def turn(gen, ids, cache):
        sync(torch, device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = gen.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                do_sample=False,
                max_new_tokens=LONGCTX_GEN,
                min_new_tokens=LONGCTX_GEN,
                pad_token_id=0,
                eos_token_id=None,
                use_cache=True,
            )
        sync(torch, device)
        return out[:, ids.shape[1] :].cpu(), time.perf_counter() - t0

    rows = []
    turn(gen, torch.randint(2, gen.config.vocab_size, (1, 32), generator=g).to(device), None)  # warm-up
    for h in histories:
        history = torch.randint(2, gen.config.vocab_size, (1, h), generator=g).to(device)
        obs = torch.randint(2, gen.config.vocab_size, (1, LONGCTX_OBS), generator=g).to(device)
        with torch.no_grad():  # the previous turn's cache: the history's keys and values
            prev = gen(input_ids=history, past_key_values=DynamicCache(config=gen.config), use_cache=True)
        context = torch.cat([history, obs], dim=1)
        ids_off, t_off = turn(gen, context, None)
        ids_on, t_on = turn(gen, context, copy.deepcopy(prev.past_key_values))
        del prev
        rows.append(
            {
                "history": h,
                "turn_s_off": round(t_off, 4),
                "turn_s_on": round(t_on, 4),
                "speedup": round(t_off / t_on, 2),
                "ids_equal": bool(torch.equal(ids_off, ids_on)),
            }
        )
        log(f"longctx {h}: off {t_off:.3f}s on {t_on:.3f}s")
    del gen
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def slope(key: str):
        xs = [math.log(r["history"]) for r in rows]
        ys = [math.log(max(r[key], 1e-9)) for r in rows]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 3) if sxx > 0 else None

    return {
        "longctx": rows,
        "longctx_exponent_off": slope("turn_s_off"),
        "longctx_exponent_on": slope("turn_s_on"),
        "longctx_note": f"one later turn: history + {LONGCTX_OBS}-token observation, {LONGCTX_GEN} greedy "
        "tokens; off = full prefill, on = continue the history's DynamicCache (rollout.hf.prefix_reuse)",
    }


def publish_bench(model, directory: str) -> dict:
    """One weight version to a file, hashed while written (see the module docstring)."""
    from bus.weight_blobs import state_segments, state_tensors, state_to_bytes, write_file_atomic

    with tempfile.TemporaryDirectory(prefix="rlbus-gpu-check-", dir=directory) as d:
        path = Path(d) / "v000001.safetensors"
        t0 = time.perf_counter()
        segments = state_segments(state_tensors(model))
        zero_copy = segments is not None
        if segments is None:
            segments = [memoryview(state_to_bytes(model))]
        t_ser = time.perf_counter()
        digest: dict = {}
        hasher = threading.Thread(target=lambda: digest.update(sha256=_sha256(segments)), name="sha256")
        hasher.start()
        size = write_file_atomic(path, segments)
        t_written = time.perf_counter()
        hasher.join()
        t_done = time.perf_counter()
    total = t_done - t0
    return {
        "publish_gb_s": round(size / total / 1e9, 3),
        "publish_s": round(total, 3),
        "publish_bytes": size,
        "publish_breakdown_s": {
            "serialize": round(t_ser - t0, 3),
            "write": round(t_written - t_ser, 3),
            "hash_after_write": round(t_done - t_written, 3),
        },
        "publish": (
            "bus.weight_blobs.state_segments (zero-copy)"
            if zero_copy
            else "bus.weight_blobs.state_to_bytes (device -> host copy)"
        )
        + f", fp32 safetensors to a file in {directory}, sha256 in a thread (as FileStore.put_segments)",
    }


def _sha256(segments: list) -> str:
    h = hashlib.sha256()
    for seg in segments:
        h.update(seg)
    return h.hexdigest()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="torch device (default cuda; `cpu` with --tiny for a smoke run)")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 shape and workload (seconds on CPU)")
    ap.add_argument("--publish-dir", default=tempfile.gettempdir(), help="where the weight file is written")
    ap.add_argument(
        "--out", type=Path, help=f"also write the JSON here (default without --tiny: {RESULT.relative_to(ROOT)})"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=PEAK_FLOPS / 1e12,
        help=f"bf16 dense peak the MFU is taken against (default {PEAK_FLOPS / 1e12:g}, the H200 figure used here)",
    )
    ap.add_argument(
        "--histories", type=int, nargs="+", help="long-context history lengths in tokens (default: per shape)"
    )
    for key in WORKLOADS["qwen2-0.5b"]:
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key, help="override the shape's workload")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + BUDGET_S - 120  # leave time for generation and publish after the learner
    import torch
    import transformers

    if a.device.startswith("cuda"):
        from bench import skip_unless

        skip_unless(__file__, cuda=True, hint="a CPU smoke run: python bench/gpu_check.py --device cpu --tiny")
    device = torch.device(a.device)
    shape = "tiny" if a.tiny else "qwen2-0.5b"
    w = {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in WORKLOADS[shape].items()}
    if a.device == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    log(f"building {shape} on {device}")
    t0 = time.perf_counter()
    model, params = build_model(torch, shape, device, a.seed)
    result = {
        "name": "gpu_check",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": shape,
        "params": params,
        "build_s": round(time.perf_counter() - t0, 2),
    }
    log(f"{params / 1e6:.1f} M parameters; learner steps")
    result.update(learner_bench(torch, model, params, device, w, deadline, a.peak_tflops * 1e12))
    log(f"learner {result['learner_tok_s']} tok/s; generation")
    result.update(generate_bench(torch, model, device, w))
    log(f"generate {result['generate_tok_s']} tok/s; long context")
    result.update(longctx_bench(torch, model, device, a.histories or HISTORIES[shape]))
    log(f"long-context exponent off {result['longctx_exponent_off']} on {result['longctx_exponent_on']}; publish")
    result.update(publish_bench(model, a.publish_dir))
    if device.type == "cuda":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    result.update(
        {
            "loop": None,
            "loop_note": "whole loop not run: needs nats-server (python bench/bus.py, rlbus up)",
            "elapsed_s": round(time.monotonic() - t_start, 1),
            "budget_s": BUDGET_S,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "command": "python "
            + " ".join([str(Path(sys.argv[0]).as_posix())] + (argv if argv is not None else sys.argv[1:])),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    out = a.out or (None if a.tiny else RESULT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
