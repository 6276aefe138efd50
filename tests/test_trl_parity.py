"""Our GRPO step and TRL GRPOTrainer's training step (the bench adapters of
bench/learner_vs_trl.py) move identical models in the same direction by the same amount
on the same batch: same objective, same group-relative advantages, same token reduction.
A change to our loss, advantages or packing that departs from GRPO as TRL computes it
fails here."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="TRL is in the bench extra: pip install -e '.[bench]'")


@pytest.mark.parametrize("shape,skip", [("demo", "none"), ("long", "none"), ("demo", "keep_scale"), ("demo", "dapo")])
def test_one_step_matches_trl_grpo(tmp_path, shape, skip):
    """`none`: ours trains every group, like TRL. `keep_scale` (learner.skipped_keep_scale):
    ours skips the all-equal groups and still takes TRL's exact step. `dapo` (skip, no
    rescale): the same direction, larger by groups / groups with signal."""
    from bench.learner_vs_trl import build_model, gradient_agreement

    agreement = gradient_agreement(build_model(tmp_path / "model"), tmp_path, shape, skip=skip)
    assert 0 < agreement["groups_with_signal"] < agreement["groups"], agreement  # some groups carry nothing
    assert agreement["cosine"] == pytest.approx(1.0, abs=1e-3), agreement
    want = agreement["groups"] / agreement["groups_with_signal"] if skip == "dapo" else 1.0
    assert agreement["norm_ratio"] == pytest.approx(want, rel=1e-3), agreement
