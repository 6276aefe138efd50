"""`rlbus init-model --max-positions N --rope-scaling KIND:FACTOR` (issue 33, item 6): the config
says it, the model loads back and runs a long sequence, and the scaling changes every position's
output but the first (a RoPE at position 0 is the identity), so it is really applied."""

from __future__ import annotations

import argparse
import json

import pytest

from rlbus.commands import init_model
from rlbus.model.tiny_model import build_tiny_model, parse_rope_scaling

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, seed=3, tokenizer="char")


def args(out, **kw) -> argparse.Namespace:
    base = dict(out=str(out), tokenizer="char", arch="qwen2", hidden_size=32, num_layers=1, num_heads=2, seed=3)
    return argparse.Namespace(**{**base, "max_positions": 1024, "rope_scaling": None, **kw})


def test_cli_writes_the_scaled_config_and_the_model_runs_past_the_original_context(tmp_path, capsys):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert init_model.main(args(tmp_path / "scaled", rope_scaling="linear:4")) == 0
    assert "1024 positions, rope linear x4" in capsys.readouterr().out
    cfg = AutoConfig.from_pretrained(tmp_path / "scaled")
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None)
    assert cfg.max_position_embeddings == 1024
    assert rope["rope_type"] == "linear" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 256
    meta = json.loads((tmp_path / "scaled" / "rlbus_model.json").read_text())
    assert meta["rope_scaling"]["factor"] == 4.0 and meta["max_position_embeddings"] == 1024

    build_tiny_model(tmp_path / "plain", max_position_embeddings=1024, **TINY)
    ids = torch.randint(3, 90, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scaled = AutoModelForCausalLM.from_pretrained(tmp_path / "scaled").eval()(ids).logits[0]
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()(ids).logits[0]
    assert torch.isfinite(scaled).all() and scaled.shape[0] == 600
    assert torch.allclose(scaled[0], plain[0], atol=1e-5)  # same weights: RoPE has no parameters
    assert not torch.allclose(scaled[1:], plain[1:], atol=1e-4)


@pytest.mark.parametrize("spec", ["yarn:2", "dynamic:2.5"])
def test_other_kinds_build(tmp_path, spec):
    from transformers import AutoConfig

    kind, factor = parse_rope_scaling(spec)
    build_tiny_model(tmp_path / "m", max_position_embeddings=512, rope_scaling=(kind, factor), **TINY)
    cfg = AutoConfig.from_pretrained(tmp_path / "m")
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None)
    assert rope["rope_type"] == kind and rope["factor"] == factor


@pytest.mark.parametrize("spec", ["cubic:2", "linear:1", "linear", "linear:x", ":4", "linear:-2"])
def test_bad_rope_specs_are_refused(tmp_path, spec, capsys):
    with pytest.raises(ValueError, match="KIND:FACTOR"):
        parse_rope_scaling(spec)
    assert init_model.main(args(tmp_path / "m", rope_scaling=spec)) == 2
    assert "linear:4" in capsys.readouterr().out and not (tmp_path / "m").exists()


def test_too_few_original_positions_is_refused(tmp_path):
    with pytest.raises(ValueError, match="original positions"):
        build_tiny_model(tmp_path / "m", max_position_embeddings=64, rope_scaling=("linear", 8.0), **TINY)


def test_model_section_rope_scaling_reaches_the_built_model(tmp_path):
    """`[model] rope_scaling = "KIND:FACTOR"` is pushed down to the tiny model `rlbus up` builds; a
    malformed one is refused when the config loads, naming the form."""
    from rich.console import Console
    from transformers import AutoConfig

    from rlbus.run.prepare import prepare_model
    from schemas.config import load_config

    p = tmp_path / "run.toml"
    body = (
        "[model]\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\ntokenizer = 'char'\nmax_position_embeddings = 512\n"
    )
    p.write_text(body + 'rope_scaling = "yarn:2"\n[sft]\nenabled = false\n')
    cfg = load_config(p)
    start = prepare_model(cfg, tmp_path / "run", Console(quiet=True))
    rope = AutoConfig.from_pretrained(start).to_dict()
    rope = rope.get("rope_scaling") or rope.get("rope_parameters")
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0 and rope["original_max_position_embeddings"] == 256
    p.write_text(body + 'rope_scaling = "cubic:2"\n')
    with pytest.raises(Exception, match="KIND:FACTOR"):
        load_config(p)
