"""`rlbus generate` (`rlbus.commands.generate`): the rollout engines from the command line.

The hf tests run the real CLI in a subprocess on a tiny random model (BPE with a chat
template, and char without one). `test_vllm_and_hf_agree_greedy` is marked `vllm`
(`make test-vllm`, .venv-vllm): the console script with `--engine vllm` and `--engine hf`,
greedy on one float32 model, gives the same token ids and log-probs within 1e-3, and no
process vLLM spawned outlives the command.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlbus.model.tiny_model import build_tiny_model
from tests.proc_scan import live_pids

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256)
KEYS = {"prompt", "prompt_ids", "samples"}
SAMPLE_KEYS = {"token_ids", "logprobs", "text", "finish_reason"}


def vllm_test(fn):
    """Marked `vllm` (only `make test-vllm` selects it), skipped with the fix where vLLM is missing."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: make vllm-env; make test-vllm")(fn))


@pytest.fixture(scope="module")
def bpe_dir(tiny_model):
    return tiny_model(tokenizer="bpe", **TINY)


@pytest.fixture(scope="module")
def char_dir(tiny_model):
    return tiny_model(tokenizer="char", **TINY)


def generate(
    model_dir, *args: str, exe: list[str] | None = None, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    cmd = (exe or [sys.executable, "-m", "rlbus.cli"]) + ["generate", str(model_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def json_records(r: subprocess.CompletedProcess) -> list[dict]:
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]  # every stdout line is a JSON object


def test_json_schema_one_logprob_per_token(bpe_dir):
    from transformers import AutoTokenizer

    prompts = ["12+34=", "hello there"]
    r = generate(
        bpe_dir,
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--n",
        "3",
        "--max-tokens",
        "6",
        "--temperature",
        "1",
        "--seed",
        "1",
        "--threads",
        "1",
        "--json",
    )
    recs = json_records(r)
    tok = AutoTokenizer.from_pretrained(bpe_dir)
    assert [rec["prompt"] for rec in recs] == prompts
    for rec, text in zip(recs, prompts, strict=True):
        assert set(rec) == KEYS and len(rec["samples"]) == 3
        assert rec["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]  # the text as is, no template
        for s in rec["samples"]:
            assert set(s) == SAMPLE_KEYS and s["finish_reason"] in ("stop", "length")
            assert 1 <= len(s["token_ids"]) <= 6 and len(s["logprobs"]) == len(s["token_ids"])
            assert all(isinstance(t, int) for t in s["token_ids"]) and all(lp <= 0 for lp in s["logprobs"])
            assert (s["finish_reason"] == "stop") == (s["token_ids"][-1] == tok.eos_token_id)


def test_greedy_is_deterministic(bpe_dir):
    args = (
        "--prompt",
        "7+5=",
        "--prompt",
        "40-13=",
        "--n",
        "2",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--threads",
        "1",
        "--json",
    )
    first, second = json_records(generate(bpe_dir, *args)), json_records(generate(bpe_dir, *args, "--seed", "9"))
    assert first == second  # greedy: the same ids and log-probs whatever the seed
    for rec in first:
        a, b = rec["samples"]
        assert a == b and len(a["token_ids"]) == len(a["logprobs"]) >= 1


def test_chat_applies_the_template(bpe_dir):
    from transformers import AutoTokenizer

    from schemas.chat import prompt_ids, user_prompt

    recs = json_records(
        generate(
            bpe_dir,
            "--prompt",
            "What is 7+5?",
            "--chat",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--threads",
            "1",
            "--json",
        )
    )
    tok = AutoTokenizer.from_pretrained(bpe_dir)
    expected = prompt_ids(tok, user_prompt("What is 7+5?"))
    assert recs[0]["prompt_ids"] == expected  # rendered as rollout renders a task's prompt
    assert expected == list(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 7+5?"}], tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    assert len(recs[0]["samples"][0]["logprobs"]) == len(recs[0]["samples"][0]["token_ids"])


def test_chat_without_template_exits_naming_the_fix(char_dir):
    r = generate(char_dir, "--prompt", "7+5=", "--chat", "--json")
    assert r.returncode == 1 and r.stdout == ""
    msg = " ".join(r.stderr.split())
    assert "--chat needs a chat template" in msg and "drop --chat" in msg and "--tokenizer bpe" in msg, r.stderr


def test_text_rendering_and_refusals(bpe_dir, tmp_path, capsys):
    from rich.console import Console

    from rlbus.cli import _parser
    from rlbus.commands.generate import GenerateError, check_args, render

    recs = [
        {
            "prompt": "1+1=",
            "prompt_ids": [1, 2],
            "samples": [
                {"token_ids": [5, 6], "logprobs": [-0.5, -0.25], "text": "[bold]2[/bold]", "finish_reason": "stop"}
            ],
        }
    ]
    buf = io.StringIO()
    render(recs, Console(file=buf, width=100), caption="--engine hf, greedy")
    out = buf.getvalue()
    assert "prompt 1/1 (2 tokens): '1+1='" in out and "[bold]2[/bold]" in out  # model text is never markup
    assert "-0.750" in out and "stop" in out and "--engine hf, greedy" in out

    def refused(*argv: str) -> str:
        with pytest.raises(GenerateError) as exc:
            check_args(_parser().parse_args(["generate", *argv]))
        return str(exc.value)

    assert "no config.json" in refused(str(tmp_path), "--prompt", "x")
    assert "--tier, --kv-cache-mb: only for --engine vllm" in refused(
        str(bpe_dir), "--prompt", "x", "--tier", "fast", "--kv-cache-mb", "8"
    )
    assert "--device: only for --engine hf" in refused(
        str(bpe_dir), "--engine", "vllm", "--prompt", "x", "--device", "cpu"
    )
    assert "prompt 2 is empty" in refused(str(bpe_dir), "--prompt", "x", "--prompt", "")
    if not HAS_VLLM:
        msg = refused(str(bpe_dir), "--engine", "vllm", "--prompt", "x")
        assert "make vllm-env" in msg and ".venv-vllm/bin/rlbus generate" in msg


@vllm_test
def test_vllm_and_hf_agree_greedy(tmp_path):
    """The console script (`rlbus` next to this Python: vLLM's spawned processes re-import
    its guarded __main__) with both engines on one float32 model."""
    model_dir = build_tiny_model(
        tmp_path / "m",
        arch="qwen2",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        max_position_embeddings=256,
        seed=0,
        tokenizer="bpe",
    )
    exe = [str(Path(sys.executable).parent / "rlbus")]
    prompts = ("--prompt", "12+34=", "--prompt", "7+5=", "--prompt", "40-13=")
    common = (*prompts, "--temperature", "0", "--max-tokens", "12", "--json")
    tag = uuid.uuid4().hex
    env = {**os.environ, "RLBUS_TEST_GENERATE_TAG": tag}
    vllm = json_records(
        generate(
            model_dir,
            *common,
            "--engine",
            "vllm",
            "--kv-cache-mb",
            "64",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "16",
            exe=exe,
            env=env,
            timeout=300,
        )
    )
    assert live_pids(lambda cmd, environ: tag.encode() in environ, environ=True) == []  # engine core ended
    hf = json_records(generate(model_dir, *common, "--engine", "hf", "--threads", "1", exe=exe))
    worst = 0.0
    for v, h in zip(vllm, hf, strict=True):
        assert v["prompt_ids"] == h["prompt_ids"]
        (sv,), (sh,) = v["samples"], h["samples"]
        assert sv["token_ids"] == sh["token_ids"], (sv["text"], sh["text"])
        assert len(sv["logprobs"]) == len(sv["token_ids"]) and sv["finish_reason"] == sh["finish_reason"]
        worst = max(worst, *(abs(a - b) for a, b in zip(sv["logprobs"], sh["logprobs"], strict=True)))
    assert worst <= 1e-3, worst
