"""The BPE tokenizer and its chat template (`rlbus.model.bpe_tokenizer`), prompt rendering for a
tokenizer (`schemas.chat`), SFT demos tokenized as rollout tokenizes episodes, the
`[model] tokenizer` / `init-model --tokenizer` switches, and the start-time alphabet check."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from transformers import AutoConfig, AutoTokenizer

from learner.sft import make_batch
from producers.domains import tool_calc
from rlbus.model.bpe_tokenizer import IM_END, IM_START, SAMPLE_TOOL, SPECIALS, TOOL_TOKENS, build_bpe_tokenizer
from rlbus.model.tiny_model import build_char_tokenizer, build_tiny_model
from schemas import ChatMessage
from schemas.chat import encode_text, prompt_ids, prompt_input, prompt_text, tool_turn, unencodable, user_prompt
from schemas.config import RunConfig, load_config
from schemas.tool_protocol import tool_turn_text

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def bpe_dir(tiny_model):
    return tiny_model(tokenizer="bpe", **TINY)


@pytest.fixture(scope="module")
def tok(bpe_dir):
    return AutoTokenizer.from_pretrained(bpe_dir)


FROZEN_CORPUS_SHA256 = "03042f53ee035c6ff7b65f8ce7dae6d19c555059d5dc8580ae2cafabe2bf0ec3"
"""sha256 of json.dumps(corpus_texts()): the 695 example strings every tiny BPE tokenizer was trained on."""


def test_bpe_corpus_ships_with_the_package_and_examples_are_never_read(monkeypatch):
    """The tokenizer's example texts are package data (rlbus/model/bpe_corpus.json, frozen): editing or
    deleting examples/ changes no new tokenizer."""
    import hashlib
    import tomllib

    from rlbus.model import bpe_tokenizer

    assert bpe_tokenizer.CORPUS.parent == Path(bpe_tokenizer.__file__).resolve().parent
    texts = bpe_tokenizer.corpus_texts()
    assert hashlib.sha256(json.dumps(texts).encode()).hexdigest() == FROZEN_CORPUS_SHA256
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert bpe_tokenizer.CORPUS.name in package_data["rlbus.model"]
    before = bpe_tokenizer.training_corpus(3, n=40)
    examples, read_text, glob = (ROOT / "examples").resolve(), Path.read_text, Path.glob

    def guard(path: Path) -> Path:
        assert not path.resolve().is_relative_to(examples), f"the tokenizer read {path}"
        return path

    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read_text(guard(self), *a, **k))
    monkeypatch.setattr(Path, "glob", lambda self, *a, **k: glob(guard(self), *a, **k))
    after = bpe_tokenizer.training_corpus(3, n=40)
    assert after == before and set(texts) <= set(after)


def test_bpe_vocab_specials_and_determinism():
    a, b = build_bpe_tokenizer(seed=0), build_bpe_tokenizer(seed=0)
    assert 1000 <= len(a) <= 4096
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()  # merges too
    assert [a.convert_tokens_to_ids(t) for t in SPECIALS + TOOL_TOKENS] == list(range(7))
    assert a.pad_token == "<|endoftext|>" and a.eos_token == IM_END and a.eos_token_id == 2
    # tool tags survive decoding (added, not special); turn markers are skipped
    ids = encode_text(a, f'{IM_START}assistant\n<tool_call>{{"name": "python"}}</tool_call>{IM_END}')
    assert a.decode(ids, skip_special_tokens=True) == 'assistant\n<tool_call>{"name": "python"}</tool_call>'
    # it learned the domains' text: numbers merge (the byte-level regex splits punctuation from words)
    assert len(encode_text(a, "417")) == 1 and len(encode_text(a, "<py>417*382</py>")) <= 9


def test_bpe_encodes_any_text_exactly(tok):
    for text in ["héllo ∑ 日本 🙂", "  two  spaces\tand\ttabs\n", "\\frac{1}{2}", ""]:
        assert tok.decode(encode_text(tok, text)) == text
    assert unencodable(tok, ["héllo ∑ 日本 🙂"]) == []


def test_checkpoint_loads_offline_with_a_chat_template(bpe_dir, tok):
    meta = json.loads((bpe_dir / "rlbus_model.json").read_text())
    assert meta["tokenizer"] == "bpe"
    assert AutoConfig.from_pretrained(bpe_dir).vocab_size == len(tok) == meta["vocab_size"]
    saved = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in saved or (bpe_dir / "chat_template.jinja").exists()
    msgs = [{"role": "user", "content": "417*382=?"}]
    text = tok.apply_chat_template(msgs, tools=[SAMPLE_TOOL], tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"{IM_START}system\n# Tools")
    assert json.dumps(SAMPLE_TOOL) in text and "<tools>" in text and "<tool_call>" in text
    assert text.endswith(f"{IM_START}user\n417*382=?{IM_END}\n{IM_START}assistant\n")
    got = tok.apply_chat_template(msgs, tools=[SAMPLE_TOOL], tokenize=True, add_generation_prompt=True)
    got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
    assert list(got) == prompt_ids(tok, [ChatMessage(role="user", content="417*382=?")], tools=[SAMPLE_TOOL])
    plain = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert plain == f"{IM_START}user\n417*382=?{IM_END}\n{IM_START}assistant\n"
    system = [{"role": "system", "content": "Be brief."}] + msgs
    assert tok.apply_chat_template(system, tokenize=False).startswith(f"{IM_START}system\nBe brief.{IM_END}\n")


def test_prompts_use_the_template_only_when_there_is_one(tok):
    prompt = user_prompt("12+34=")
    assert prompt_input(tok, prompt) == encode_text(tok, f"{IM_START}user\n12+34={IM_END}\n{IM_START}assistant\n")
    char = build_char_tokenizer()
    assert prompt_input(char, prompt) == "12+34=" == prompt_text(char, prompt)
    assert prompt_input(None, prompt) == "12+34="  # engines without a tokenizer
    assert prompt_ids(char, prompt) == encode_text(char, "12+34=")


def test_a_tool_turn_is_what_the_template_renders_for_a_tool_message(tok):
    obs = "<obs exit=0>\n159294\n</obs>"
    prompt, call = user_prompt("417*382=?"), "<py>417*382</py>"
    text, ids = tool_turn(tok, tool_turn_text(obs))
    assert ids == encode_text(tok, text)  # encoded alone
    full = tok.apply_chat_template(
        [
            {"role": "user", "content": "417*382=?"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": obs},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt_text(tok, prompt) + call + text == full
    assert text == f"{IM_END}\n{IM_START}tool\n<tool_response>\n{obs}\n</tool_response>{IM_END}\n{IM_START}assistant\n"
    char = build_char_tokenizer()
    assert tool_turn(char, tool_turn_text(obs)) == (tool_turn_text(obs), encode_text(char, tool_turn_text(obs)))


def test_sft_demos_are_tokenized_as_rollout_tokenizes_episodes(tok):
    import random

    demo = tool_calc.demonstration(random.Random(0), 1)
    (prompt, _), (call, _), (obs_turn, _), (answer, _) = demo
    batch = make_batch(tok, [demo, (prompt, "=7")])
    want = (
        prompt_ids(tok, user_prompt(prompt))
        + encode_text(tok, call)
        + tool_turn(tok, obs_turn)[1]
        + encode_text(tok, answer)
        + [tok.eos_token_id]
    )
    row = batch["input_ids"][0, : len(want)].tolist()
    assert row == want and int(batch["attention_mask"][0].sum()) == len(want)
    labels = batch["labels"][0, : len(want)].tolist()
    n_prompt = len(prompt_ids(tok, user_prompt(prompt)))
    n_call, n_obs = len(encode_text(tok, call)), len(tool_turn(tok, obs_turn)[1])
    assert all(x == -100 for x in labels[:n_prompt])
    assert labels[n_prompt : n_prompt + n_call] == want[n_prompt : n_prompt + n_call]
    assert all(x == -100 for x in labels[n_prompt + n_call : n_prompt + n_call + n_obs])
    assert labels[-1] == tok.eos_token_id
    # the pair demo: template prompt, then "=7" and <|im_end|>
    pair = prompt_ids(tok, user_prompt(prompt)) + encode_text(tok, "=7") + [tok.eos_token_id]
    assert batch["input_ids"][1, : len(pair)].tolist() == pair
    # an empty prompt (replay `text` lines) adds no turn markers
    assert make_batch(tok, [("", "hello")])["input_ids"][0].tolist() == encode_text(tok, "hello") + [tok.eos_token_id]
    # the char tokenizer keeps the plain format
    char = build_char_tokenizer()
    plain = make_batch(char, [(prompt, "=7")])["input_ids"][0].tolist()
    assert plain == encode_text(char, prompt + "=7") + [char.eos_token_id]


def test_config_default_is_bpe_and_the_examples_state_char():
    assert RunConfig().model.tokenizer == "bpe"
    for name in ("demo", "smoke", "domains", "two_domains"):
        assert load_config(ROOT / "examples" / f"{name}.toml").model.tokenizer == "char", name


def test_init_model_cli_defaults_to_bpe(tmp_path):
    for args, want in (([], "bpe"), (["--tokenizer", "char"], "char")):
        out = tmp_path / want
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rlbus.cli",
                "init-model",
                str(out),
                "--hidden-size",
                "32",
                "--num-layers",
                "1",
                "--num-heads",
                "2",
                *args,
            ],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        meta = json.loads((out / "rlbus_model.json").read_text())
        assert meta["tokenizer"] == want
        t = AutoTokenizer.from_pretrained(out)
        assert bool(t.chat_template) == (want == "bpe") and meta["vocab_size"] == len(t)


def test_a_tokenizer_missing_domain_characters_is_refused_at_start(tmp_path):
    from rlbus.model.tokenizer_check import tokenizer_problems
    from rlbus.run.checks import check_tokenizer

    data = tmp_path / "greek.jsonl"
    data.write_text(json.dumps({"id": "g0", "problem": "What is π·2? Answer in ∑ form.", "answer": "2π"}) + "\n")
    cfg = RunConfig.model_validate(
        {
            "model": {"tokenizer": "char"},
            "sft": {"enabled": False},
            "sampler": {"domains": {"greek": {"kind": "math", "data": str(data)}, "arith": {}}},
        }
    )
    problems = tokenizer_problems(cfg, build_char_tokenizer())
    assert len(problems) == 1 and "'greek'" in problems[0]
    assert all(repr(c) in problems[0] for c in "π·∑")
    out = io.StringIO()
    assert check_tokenizer(cfg, Console(file=out, width=300)) is False
    assert "'π'" in out.getvalue() and "greek" in out.getvalue()
    cfg.model.tokenizer = "bpe"
    assert check_tokenizer(cfg, Console(file=io.StringIO())) is True


REAL_CONFIG = """
[run]
max_steps = 3
max_minutes = 8
drain_seconds = 3
[model]
path = "{path}"
[sft]
enabled = false
[sampler]
group_size = 2
max_tokens = 4
max_inflight_tasks = 4
[sampler.domains.arith]
[rollout]
batch_tasks = 2
[learner]
groups_per_step = 2
step_window_s = 0.5
[scheduler.eval]
n = 4
every_versions = 100
"""


HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_SETTINGS = [
    "rollout.engine=vllm",
    "rollout.vllm.dtype=float32",
    "rollout.vllm.enforce_eager=true",
    "rollout.vllm.max_model_len=512",
    "rollout.vllm.kv_cache_memory_mb=512",
]
"""The vLLM run's only extra settings: the engine, and CPU-sized options (exact fp32, eager, a small KV cache)."""


@pytest.fixture(scope="module")
def real_100m(tmp_path_factory):
    path = build_tiny_model(
        tmp_path_factory.mktemp("real") / "qwen2-100m",
        tokenizer="bpe",
        hidden_size=768,
        num_layers=10,
        num_heads=12,
        intermediate_size=3072,
        max_position_embeddings=1024,
    )
    assert 90e6 <= json.loads((path / "rlbus_model.json").read_text())["params"] <= 110e6
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: make vllm-env; make test-vllm"),
            ],
        ),
    ],
)
def test_a_real_100m_bpe_checkpoint_runs_unchanged(real_100m, tmp_path, engine):
    """A ~100M-parameter Qwen2-shaped checkpoint with the BPE tokenizer: `model.path` alone is enough on the HF
    engine; on vLLM (`make test-vllm`) the engine and its CPU sizing are the only other settings. A few RL
    steps, weights hot-loaded into the engine, nothing lost."""
    cfg = tmp_path / "real.toml"
    cfg.write_text(REAL_CONFIG.format(path=real_100m))
    sets = [a for kv in VLLM_SETTINGS for a in ("--set", kv)] if engine == "vllm" else []
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            str(cfg),
            "--run-dir",
            str(tmp_path / "runs"),
            "--run-id",
            "real100m",
            *sets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    summary = json.loads((tmp_path / "runs" / "real100m" / "summary.json").read_text())
    assert summary["lost"] == 0 and summary["steps"] >= 3, summary
    assert summary["rollout"]["weights_loaded"] >= 1, summary["rollout"]
    assert AutoTokenizer.from_pretrained(tmp_path / "runs" / "real100m" / "model" / "start").chat_template


def test_byte_level_tokenizers_skip_the_domain_sampling(tok):
    """The byte-level BPE encodes any text, so the start check does not sample a hundred generators for it."""
    from rlbus.model.tokenizer_check import PROBE, byte_level, tokenizer_problems

    assert byte_level(tok) and not unencodable(tok, [PROBE])
    assert not byte_level(build_char_tokenizer()) and unencodable(build_char_tokenizer(), [PROBE])
    cfg = RunConfig()
    cfg.sampler.domains["arith"].params = {}
    assert tokenizer_problems(cfg, tok) == []
