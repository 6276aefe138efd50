"""bench/longctx_extrapolation.py: the teacher-forced needle measure scores exactly the access
code's tokens (a model that copies it scores 1, the measure moves with the model), and a one-rope
smoke run of the whole bench writes every length and decile (e2e: SFT + generation)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import longctx_extrapolation as lcx


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.model.tiny_model import build_tiny_model

    out = build_tiny_model(
        tmp_path_factory.mktemp("m") / "m", tokenizer="char", hidden_size=16, num_layers=1, num_heads=2
    )
    return AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def test_needle_scores_cover_the_code_tokens(tiny):
    import torch

    model, tok = tiny
    prompt = tok("Access code for the Brno depot: K7-4821-QX.", add_special_tokens=False)["input_ids"]
    completion = "Found: Access code for the Brno depot: K7-4821-QX."
    acc, nll = lcx.needle_scores(model, tok, prompt, completion, "K7-4821-QX")
    assert 0.0 <= acc <= 1.0 and nll > 0.0

    class Copier(torch.nn.Module):  # puts all mass on the true next token: what a perfect recall does
        def __init__(self, ids):
            super().__init__()
            self.ids = ids

        def forward(self, ids):
            logits = torch.full((1, ids.shape[1], len(tok)), -1e4)
            logits[0, torch.arange(ids.shape[1] - 1), ids[0, 1:]] = 0.0
            return type("Out", (), {"logits": logits})()

    enc = tok(completion, add_special_tokens=False)["input_ids"]
    perfect = lcx.needle_scores(Copier(None), tok, prompt, completion, "K7-4821-QX")
    assert perfect[0] == 1.0 and perfect[1] < 1e-3 and len(enc) > 10


@pytest.mark.e2e
def test_bench_smoke_writes_every_length_and_decile(tmp_path):
    out = tmp_path / "lcx.json"
    argv = ["--ropes", "linear", "--sft-steps", "2", "--per-cell", "1", "--train-length", "128", "--out", str(out)]
    assert lcx.main(argv) == 0
    res = json.loads(out.read_text())["models"]["linear:4"]["eval"]
    assert [res[f]["length"] for f in ("1x", "2x", "4x")] == [128, 256, 512]
    assert all(len(res[f]["by_position"]) == 10 and res[f]["n"] == 10 for f in res)


def test_rope_of_reads_both_config_spellings(tmp_path):
    for body, want in (
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear:2"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn:4"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "none"),
        ({}, "none"),
    ):
        (tmp_path / "config.json").write_text(json.dumps(body))
        assert lcx.rope_of(tmp_path) == want
