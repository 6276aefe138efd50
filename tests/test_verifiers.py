"""Verifiers: built-ins on right, wrong and malformed answers; the registry; plugins; weights."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from schemas import Trajectory
from verifier_workers import registry, verdict
from verifier_workers.verdict import Verdict, VerifierInputError
from verifier_workers.verifiers.extract import find_json_object, values_match
from verifier_workers.verifiers.math import extract_answer, last_boxed

ROOT = Path(__file__).resolve().parents[1]


def traj(verifier: str, final_text: str, **params) -> Trajectory:
    return Trajectory(
        run_id="r1",
        task_id="t1",
        task_msg_id="m1",
        domain=verifier,
        group_id="g1",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier=verifier,
        verifier_params=params,
        policy_version=0,
        final_text=final_text,
    )


def run(verifier: str, final_text: str, **params) -> Verdict:
    return registry.get(verifier)(traj(verifier, final_text, **params))


# ---------------------------------------------------------------- arith / constant


def test_arith_right_wrong_malformed():
    assert run("arith", "5", expression="2+3").reward == 1.0
    wrong = run("arith", "7", expression="2+3")
    assert wrong.reward == 0.0 and wrong.components["format"] == 1.0 and wrong.status == "ok"
    assert run("arith", "five", expression="2+3").components == {"correct": 0.0, "format": 0.0}
    with pytest.raises(VerifierInputError):
        run("arith", "5")
    with pytest.raises(VerifierInputError):
        run("arith", "5", expression=7)


def test_constant_scores_anything():
    v = run("constant", "")
    assert v.reward == 1.0 and v.status == "ok"


# ---------------------------------------------------------------- math

GOLD = "\\frac{1}{2}"


@pytest.mark.parametrize(
    "text",
    [
        "So the result is \\boxed{\\frac{1}{2}}.",
        "\\boxed{0.5}",
        "\\boxed{\\frac{2}{4}}",
        "\\boxed{1/2}",
        "First \\boxed{3}, on reflection \\boxed{\\dfrac{1}{2}}",
        "The answer is $\\frac{1}{2}$.",
        "Final answer: 0.5",
    ],
)
def test_math_equivalent_forms_score_one(text):
    v = run("math", text, gold=GOLD)
    assert v.reward == 1.0 and v.components == {"correct": 1.0, "format": 1.0} and v.status == "ok"


def test_math_radicals_and_integers():
    assert run("math", "\\boxed{\\sqrt{18}}", gold="3\\sqrt{2}").reward == 1.0
    assert run("math", "\\boxed{3\\sqrt{2}}", gold="3\\sqrt{2}").reward == 1.0
    assert run("math", "\\boxed{12}", gold="12").reward == 1.0
    assert run("math", "\\boxed{12}", gold=12).reward == 1.0
    assert run("math", "\\boxed{13}", gold="12").reward == 0.0


def test_math_wrong_answer_scores_exactly_zero():
    v = run("math", "\\boxed{\\frac{1}{3}}", gold=GOLD)
    assert v.reward == 0.0 and v.components == {"correct": 0.0, "format": 1.0} and v.status == "ok"


def test_math_last_boxed_wins():
    assert run("math", "\\boxed{\\frac{1}{2}} no wait \\boxed{2}", gold=GOLD).reward == 0.0
    assert last_boxed("a \\boxed{x^{2}} b \\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{unclosed") is None


def test_math_last_number_fallback_is_not_format():
    v = run("math", "I computed 3 then 0.5", gold=GOLD)
    assert v.components == {"correct": 1.0, "format": 0.0} and v.reward == 1.0
    assert extract_answer("1,234 apples") == ("1234", False)


def test_math_no_answer():
    v = run("math", "I do not know.", gold=GOLD)
    assert v.reward == 0.0 and v.components == {"correct": 0.0, "format": 0.0} and v.status == "ok"
    assert run("math", "", gold=GOLD).reward == 0.0


def test_math_malformed_answer_scores_zero():
    v = run("math", "\\boxed{\\frac{1}{}", gold=GOLD)
    assert v.reward == 0.0 and v.status == "ok"
    assert run("math", "\\boxed{}}}{{", gold=GOLD).reward == 0.0


@pytest.mark.parametrize("gold", [None, "", "\\frac{1}{", ["1"], True])
def test_math_malformed_gold_is_input_error(gold):
    params = {} if gold is None else {"gold": gold}
    with pytest.raises(VerifierInputError):
        run("math", "\\boxed{1}", **params)


def test_math_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(run("math", "\\boxed{0.5}", gold=GOLD).reward))
    t.start()
    t.join(60)
    assert out == [1.0]


@pytest.mark.e2e
def test_math_example_data_golds_parse_and_match_themselves():
    rows = [json.loads(line) for line in (ROOT / "examples/data/math.jsonl").read_text().splitlines() if line]
    assert len(rows) >= 25 and len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["problem"] and r["answer"]
        assert run("math", f"\\boxed{{{r['answer']}}}", gold=r["answer"]).reward == 1.0, r


# ---------------------------------------------------------------- extract

EGOLD = {"name": "Ada Lovelace", "born": 1815, "country": "UK"}


def test_extract_exact():
    v = run("extract", json.dumps({"name": " ada lovelace ", "born": 1815.0, "country": "uk"}), gold=EGOLD)
    assert v.reward == 1.0 and v.status == "ok"
    assert v.components == {
        "field_name": 1.0,
        "field_born": 1.0,
        "field_country": 1.0,
        "fields": 1.0,
        "json_valid": 1.0,
        "extra_fields": 0.0,
        "correct": 1.0,
    }


def test_extract_numbers_compare_numerically():
    assert run("extract", '{"name": "Ada Lovelace", "born": "1815", "country": "UK"}', gold=EGOLD).reward == 1.0
    assert values_match(True, True) and not values_match(1, True) and not values_match(True, "true")
    assert values_match([1, "A"], [1.0, "a"]) and not values_match([1, 2], [2, 1])
    assert values_match({"a": {"b": "X"}}, {"a": {"b": "x "}})


def test_extract_partially_right():
    v = run("extract", '{"name": "Ada Lovelace", "born": 1816, "country": "UK"}', gold=EGOLD)
    assert v.reward == 0.0 and v.components["field_born"] == 0.0 and v.components["field_name"] == 1.0
    assert v.components["fields"] == pytest.approx(2 / 3) and v.components["correct"] == 0.0


def test_extract_missing_field():
    v = run("extract", '{"name": "Ada Lovelace", "born": 1815}', gold=EGOLD)
    assert v.reward == 0.0 and v.components["field_country"] == 0.0
    assert v.components["fields"] == pytest.approx(2 / 3) and "country" in v.details


def test_extract_extra_field_is_a_component_not_in_the_default_scalar():
    v = run("extract", '{"name": "Ada Lovelace", "born": 1815, "country": "UK", "died": 1852, "x": 1}', gold=EGOLD)
    assert v.reward == 1.0 and v.components["extra_fields"] == 2.0
    penalised = Verdict(v.components, weights={"correct": 1.0, "extra_fields": -0.1})
    assert penalised.reward == pytest.approx(0.8)


@pytest.mark.parametrize(
    "text", ['{"name": "Ada Lovelace", "born": 1815,', "no json here", "", "[1, 2]", '```json\n{"name": \n```']
)
def test_extract_malformed_json_is_policy_fault(text):
    v = run("extract", text, gold=EGOLD)
    assert v.status == "ok" and v.reward == 0.0
    assert v.components["json_valid"] == 0.0 and v.components["fields"] == 0.0


def test_extract_fenced_json_and_surrounding_prose():
    text = 'Here you go:\n```json\n{"name": "Ada Lovelace", "born": 1815, "country": "UK"}\n```\nDone {not json}.'
    assert run("extract", text, gold=EGOLD).reward == 1.0
    prose = 'Draft {"name": "x"} then final {"name": "Ada Lovelace", "born": 1815, "country": "UK"} ok'
    assert run("extract", prose, gold=EGOLD).reward == 1.0
    assert find_json_object('```\n{"a": {"b": 1}}\n```') == {"a": {"b": 1}}


@pytest.mark.parametrize("gold", [None, {}, "name", [1]])
def test_extract_malformed_gold_is_input_error(gold):
    params = {} if gold is None else {"gold": gold}
    with pytest.raises(VerifierInputError):
        run("extract", "{}", **params)


# ---------------------------------------------------------------- registry


def test_unknown_verifier_lists_known_ones():
    with pytest.raises(VerifierInputError) as err:
        registry.get("nope")
    for name in ("arith", "constant", "math", "extract"):
        assert name in str(err.value)
    with pytest.raises(VerifierInputError, match="unknown verifier 'nope'"):
        registry.get("nope")


def test_register_and_refuse_duplicates():
    def fn(t):
        return Verdict({"correct": 0.25})

    registry.register("test_custom", fn)
    try:
        assert "test_custom" in registry.names() and run("test_custom", "").reward == 0.25
        with pytest.raises(ValueError):
            registry.register("test_custom", fn)
        with pytest.raises(ValueError):
            registry.register("arith", fn)
        registry.register("test_custom", lambda t: Verdict({"correct": 0.5}), replace=True)
        assert run("test_custom", "").reward == 0.5
    finally:
        registry.unregister("test_custom")
    assert "test_custom" not in registry.names()


def _install_plugin(tmp_path: Path, monkeypatch, module: str, body: str, entries: str) -> None:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    dist = tmp_path / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlbus.verifiers]\n" + textwrap.dedent(entries))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reset_entry_points()


def test_entry_point_plugin_is_loaded_lazily(tmp_path, monkeypatch):
    _install_plugin(
        tmp_path,
        monkeypatch,
        "rlbus_test_plugin",
        """
        from verifier_workers.verdict import Verdict

        def verify(traj):
            ok = traj.final_text.strip() == traj.verifier_params["want"]
            return Verdict({"correct": float(ok), "length": float(len(traj.final_text))})
    """,
        """
        myplugin = rlbus_test_plugin:verify
        arith = rlbus_test_plugin:verify
        broken = rlbus_test_plugin:does_not_exist
    """,
    )
    try:
        assert "myplugin" in registry.names() and "broken" in registry.names()
        assert "rlbus_test_plugin" not in sys.modules  # discovered, not imported
        fn = registry.get("myplugin")
        assert fn.__module__ == "rlbus_test_plugin" and registry.get("myplugin") is fn
        v = fn(traj("myplugin", "yes", want="yes"))
        assert v.reward == 1.0 and v.components["length"] == 3.0
        # a plugin cannot shadow a built-in
        assert registry.get("arith").__module__ == "verifier_workers.verifiers.arith"
        with pytest.raises(VerifierInputError, match="broken"):
            registry.get("broken")
    finally:
        monkeypatch.undo()
        registry.reset_entry_points()
        sys.modules.pop("rlbus_test_plugin", None)
    with pytest.raises(VerifierInputError):
        registry.get("myplugin")


# ---------------------------------------------------------------- compose


def test_compose_weights():
    comps = {"correct": 1.0, "format": 1.0, "fields": 0.5, "extra_fields": 2.0}
    assert verdict.compose(comps, None) == 1.0
    assert verdict.compose(comps, None, default="fields") == 0.5
    assert verdict.compose({"format": 1.0}, None) == 0.0
    assert verdict.compose(comps, {"correct": 0.8, "format": 0.2}) == pytest.approx(1.0)
    assert verdict.compose(comps, {"fields": 1.0, "extra_fields": -0.1}) == pytest.approx(0.3)
    assert verdict.compose(comps, {"missing": 1.0}) == 0.0
    assert verdict.compose(comps, {}) == 0.0
    with pytest.raises(ValueError):
        verdict.compose({"correct": float("nan")}, None)
    assert Verdict({"correct": 0.0, "format": 1.0}, weights={"format": 0.5}).reward == 0.5
