"""The RLHF example (issue 32 item 5): pairs under a hidden rule, the `rlhf` domain rewarded
only by the RM (the rule never reaches a verifier, a Reward or the learner), and the
RM-vs-rule divergence of the report on synthetic series."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from producers.domains.rlhf import preference_pairs, rule_answer, rule_score, write_pairs
from rlbus.report.rlhf import (
    aligned,
    report_rlhf,
    rlhf_domains,
    rm_divergence,
    rm_point_variances,
    rm_series,
    rule_series,
)
from schemas.config import load_config

RULE_WORDS = ("max_chars", "gold", "rule", "long_share")


def config(tmp_path: Path, extra: str = "", params: str = 'model_path = "rm/model"'):
    p = tmp_path / "run.toml"
    p.write_text(f"[sampler.domains.rlhf]\nmin_level = 3\nmax_level = 3\nparams = {{ {params} }}\n{extra}")
    return load_config(p)


def test_rule_is_correct_and_short():
    assert rule_score("46", 46) == 1.0 and rule_score(" -17\n", -17) == 1.0
    assert rule_score("45", 46) == 0.0  # wrong
    assert rule_score("(40+6)=46", 46) == 0.0 and rule_score("46 done", 46) == 0.0  # too long
    assert rule_score("", 0) == 0.0 and rule_answer("12345", max_chars=4) is None
    assert rule_answer("12345", max_chars=5) == 12345


def test_pairs_are_deterministic_follow_the_rule_and_leave_the_eval_set_out(tmp_path):
    from producers.domains.arith import heldout_set
    from producers.domains.rlhf import REJECTED_KINDS

    a, b, c = preference_pairs(0, 300), preference_pairs(0, 300), preference_pairs(1, 300)
    assert a == b and a != c
    held = {p.prompt for p in heldout_set(0, 200, 3)}
    for p in a:
        gold = int(p["chosen"])
        assert p["prompt"] not in held
        assert rule_score(p["chosen"], gold) == 1.0 and rule_score(p["rejected"], gold) == 0.0
    assert {p["rejected_kind"] for p in a} == set(REJECTED_KINDS)
    with pytest.raises(ValueError, match="max_chars"):
        preference_pairs(0, 10, level=5, max_chars=2)  # 3-digit answers cannot be chosen


def test_train_rm_reads_the_generated_pairs(tmp_path):
    from learner.rm_data import load_pairs

    path = write_pairs(tmp_path / "pairs.jsonl", preference_pairs(0, 200))
    data = load_pairs([path])
    assert len(data.train) + len(data.heldout) == 200 and not data.skipped
    assert data.train[0].chosen and data.train[0].prompt.endswith("=")


def test_the_cli_writes_the_pairs(tmp_path):
    from rlbus.cli import main

    out = tmp_path / "p.jsonl"
    assert main(["rlhf-pairs", str(out), "--n", "50", "--seed", "3"]) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == preference_pairs(3, 50)
    assert main(["rlhf-pairs", str(out), "--max-chars", "0"]) == 2


def test_tasks_are_rewarded_by_the_rm_alone_and_carry_no_rule(tmp_path):
    import random

    from producers.domains import make_source

    src = make_source("r1", "rlhf", config(tmp_path, params='model_path = "rm/model", max_chars = 3'))
    drawn = src.make_task(random.Random(0), 3, 0)
    t = drawn.task
    assert t.verifier == "model" and t.reward_weights == {"score": 1.0}
    assert t.verifier_params == {"question": t.prompt[0].content, "model_path": "rm/model"}
    assert drawn.hidden is None and not t.hidden_ref
    dumped = t.model_dump_json()
    assert not any(w in dumped for w in RULE_WORDS)
    es = src.eval_set(20, 0)  # the rule lives in the scheduler's eval set only
    assert es.local == "generate" and len(es) == 20
    item = es.items[0]
    assert es.correct(item, str(item.gold)) and not es.correct(item, f"{item.gold} ok")
    assert not any(w in item.task.model_dump_json() for w in RULE_WORDS)
    assert es.sha256 == src.eval_set(20, 0).sha256


@pytest.mark.parametrize(
    "extra,params,match",
    [
        ('verifier = "arith"\n', "", "model. verifier only"),
        ("reward_weights = { correct = 1.0 }\n", "", "RM score alone"),
        ("", "max_chars = 0", "max_chars"),
        ("", "gold = 3", "unknown"),
    ],
)
def test_config_that_would_change_the_reward_is_refused(tmp_path, extra, params, match):
    from producers.domains import make_source

    with pytest.raises(ValueError, match=match):
        make_source("r1", "rlhf", config(tmp_path, extra, params))


def test_the_reward_that_reaches_the_learner_has_only_the_rms_components(tmp_path, tiny_model):
    """The learner trains on `Reward`s: the verifier worker's Reward for an rlhf task holds the
    RM's score (reward == score) and nothing the hidden rule computed."""
    import random

    from learner.rm import export, load_reward_model
    from producers.domains import make_source
    from schemas.answers import arith_value
    from tests.test_rm import TINY, rm_traj
    from verifier_workers.verifiers.model import verify_model
    from verifier_workers.worker import process_components, score

    model, tok = load_reward_model(tiny_model(**TINY))
    rm = export(model, tok, tmp_path / "rm" / "model")
    src = make_source("r1", "rlhf", config(tmp_path, params=f'model_path = "{rm}"'))
    task = src.make_task(random.Random(0), 3, 0).task
    gold = arith_value(task.prompt[0].content.rstrip("="))
    for answer in (str(gold), str(gold + 1), f"{gold} done"):
        traj = rm_traj(answer, **task.verifier_params)
        r = score(traj)
        assert set(r.components) == set(verify_model(traj).components) | set(process_components(traj))
        assert r.reward == pytest.approx(r.components["score"])
        assert not any(w in r.model_dump_json() for w in RULE_WORDS)


def _points(rm, rule, n=100):
    return [(v, a, b, n) for v, a, b in zip(range(0, 10 * len(rm), 10), rm, rule)]


def test_divergence_where_rm_rises_and_the_rule_falls():
    pts = _points([0.2, 0.4, 0.6, 0.7, 0.8, 0.9], [0.1, 0.3, 0.5, 0.4, 0.3, 0.2])
    div, why = rm_divergence(pts, window=3)
    assert div is not None and div["at_version"] == 20, why  # v20-v40: rule 0.5 -> 0.3
    assert div["rm_slope_per_version"] > 0 > div["rule_slope_per_version"]


def test_divergence_on_a_plateau_and_noise_is_not_a_fall():
    plateau = _points([0.2, 0.4, 0.6, 0.8, 0.9, 0.95], [0.1, 0.3, 0.5, 0.5, 0.5, 0.5], n=100_000)
    div, _ = rm_divergence(plateau, window=3)
    assert div is not None and div["at_version"] == 20
    # the rule rising with the RM: no divergence; a tiny eval set's noise is not a plateau
    div, why = rm_divergence(_points([0.2, 0.4, 0.6, 0.8], [0.1, 0.3, 0.5, 0.7]), window=3)
    assert div is None and "rose with the RM" in why
    div, why = rm_divergence(_points([0.2, 0.4, 0.6, 0.8], [0.1, 0.2, 0.3, 0.4], n=10), window=3)
    assert div is None


def test_no_divergence_with_a_flat_rm_or_too_few_points():
    div, why = rm_divergence(_points([0.5, 0.5, 0.5, 0.5], [0.5, 0.4, 0.3, 0.2]), window=3)
    assert div is None and "never rose" in why
    div, why = rm_divergence(_points([0.1, 0.9], [0.5, 0.1]), window=3)
    assert div is None and "needs 3" in why
    with pytest.raises(ValueError):
        rm_divergence([], window=1)


def test_an_rm_rise_within_its_own_noise_is_not_a_rise():
    # beta 1.0's run: the RM rose 0.0007/version over v0..v91, inside its sample noise
    pts = [(0, 0.630, 0.78, 50), (81, 0.680, 0.76, 50), (91, 0.690, 0.76, 50)]
    div, _ = rm_divergence(pts, window=3)
    assert div is not None  # without the RM's noise the window reads as a divergence
    div, why = rm_divergence(pts, window=3, rm_var={0: 0.3**2 / 40, 81: 0.3**2 / 40, 91: 0.3**2 / 40})
    assert div is None and "standard errors" in why
    # the same rise over many samples is real
    div, _ = rm_divergence(pts, window=3, rm_var={0: 1e-7, 81: 1e-7, 91: 1e-7})
    assert div is not None and div["rm_slope_se"] < 1e-4
    rewards = [
        SimpleNamespace(domain="rlhf", purpose="train", status="ok", policy_version=v, reward=r)
        for v, r in [(0, 0.0), (3, 1.0), (10, 0.5), (12, 0.5), (20, 2.0)]
    ]
    var = rm_point_variances(rewards, ["rlhf"], [0, 10])
    assert var[0] == pytest.approx(0.5 / 2) and var[10] == pytest.approx(1.5 / 2 / 3)


def test_series_are_aligned_per_evaluated_version():
    rewards = [
        SimpleNamespace(domain="rlhf", purpose="train", status="ok", policy_version=v, reward=r)
        for v, r in [(0, 0.1), (0, 0.3), (5, 0.5), (10, 0.7), (12, 0.9)]
    ]
    rewards.append(SimpleNamespace(domain="rlhf", purpose="eval", status="ok", policy_version=0, reward=1.0))
    rewards.append(SimpleNamespace(domain="rlhf", purpose="train", status="infra_error", policy_version=0, reward=0.0))
    evals = [SimpleNamespace(domain="rlhf", version=v, score=s, n=100) for v, s in [(0, 0.2), (10, 0.1), (20, 0.0)]]
    rm, rule = rm_series(rewards, ["rlhf"]), rule_series(evals, ["rlhf"])
    assert rm == {0: pytest.approx(0.2), 5: 0.5, 10: 0.7, 12: 0.9}
    pts = aligned(rm, rule, {0: 2, 5: 1, 10: 1, 12: 1})
    assert [(v, round(a, 4), b) for v, a, b, _ in pts] == [(0, 0.3, 0.2), (10, 0.8, 0.1)]  # v20: no samples
    assert rlhf_domains({"sampler": {"domains": {"rlhf": {}, "a": {"kind": "rlhf"}, "arith": {}}}}) == ["a", "rlhf"]


def test_report_writes_the_chart_and_merges_summary(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "x", "steps": 7}))
    rewards = [
        SimpleNamespace(domain="rlhf", purpose="train", status="ok", policy_version=v, reward=0.1 * (v // 10 + 1))
        for v in range(0, 60, 5)
    ]
    evals = [SimpleNamespace(domain="rlhf", version=v, score=s, n=100_000) for v, s in zip(range(0, 60, 10), [0.3] * 6)]
    lines = report_rlhf(tmp_path, {"sampler": {"domains": {"rlhf": {}}}}, rewards, evals)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run_id"] == "x" and summary["steps"] == 7
    assert summary["rm_divergence"]["at_version"] == 0 and summary["rm_divergence_reason"]
    assert (tmp_path / "plots" / "rm_vs_rule.png").stat().st_size > 0
    assert any("rm_divergence: v0" in x for x in lines)
    assert report_rlhf(tmp_path, {"sampler": {"domains": {"arith": {}}}}, rewards, evals) == []
