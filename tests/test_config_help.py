"""`rlbus config-help`: generated from the config models, filtered by key prefix."""

from __future__ import annotations

import argparse

from rlbus.commands.config_help import fields, main
from schemas.config import RunConfig


def test_every_field_is_listed_with_its_docstring():
    rows = list(fields(RunConfig))
    keys = [k for k, *_ in rows]
    assert "learner.lora.rank" in keys and "scheduler.eval.n" in keys and "run.seed" in keys
    assert "learner.lora" not in keys  # sections are expanded, not listed as leaves
    assert [k for k, _, _, doc in rows if not doc.strip()] == []


def test_prefix_filters_and_unknown_fails(capsys):
    assert main(argparse.Namespace(key="learner.lora")) == 0
    out = capsys.readouterr().out
    assert out.startswith("learner.lora.rank (int) = 0") and "scheduler" not in out
    assert main(argparse.Namespace(key="learner.lora_rank")) == 1
    assert "sections: run, model" in capsys.readouterr().err
