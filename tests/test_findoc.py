"""The `findoc` domain and verifier: a deterministic generator, every family's gold scoring 1
through the real verifier after a msgpack round trip, unit normalisation, bad answers and
bad gold, and the length refusals (`max_prompt_tokens`, `DomainUnavailable`)."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest

from producers.domains import DomainUnavailable, TaskSkipped, make_source, make_sources
from schemas import Task, Trajectory, decode, encode
from schemas.config import load_config
from verifier_workers import registry
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import VerifierInputError
from verifier_workers.verifiers.findoc import parse_amount
from verifier_workers.worker import score


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny model's byte-level BPE tokenizer, saved as a local tokenizer folder."""
    from rlbus.model.bpe_tokenizer import build_bpe_tokenizer  # the tiny model's `bpe` tokenizer, without torch

    where = tmp_path_factory.mktemp("tok")
    build_bpe_tokenizer(0).save_pretrained(where)
    return where


def config(tmp_path: Path, tok: Path, kind: str = "findoc", max_level: int = 3, **params):
    params.setdefault("max_prompt_tokens", 100_000)
    extra = "".join(f", {k} = {v}" for k, v in params.items())
    p = tmp_path / "run.toml"
    p.write_text(f'[sampler.domains.{kind}]\nmax_level = {max_level}\nparams = {{ tokenizer = "{tok}"{extra} }}\n')
    return load_config(p)


def as_trajectory(task: Task, final_text: str) -> Trajectory:
    """The task after a trip over the wire, answered with `final_text`."""
    task = decode(encode(task), Task)
    return Trajectory(
        run_id=task.run_id,
        task_id=task.task_id,
        task_msg_id=task.msg_id,
        domain=task.domain,
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier=task.verifier,
        verifier_params=task.verifier_params,
        policy_version=0,
        final_text=final_text,
        hidden_ref=task.hidden_ref,
    )


def bare_task() -> Task:
    """A findoc task whose hidden payload each test gives."""
    return Task(run_id="r", task_id="t", domain="findoc", verifier="findoc", hidden_ref="x.y", group_size=1, prompt=[])


def round_trip(hidden: dict) -> dict:
    """The hidden payload as the hidden bucket stores and returns it."""
    return msgpack.unpackb(msgpack.packb(hidden))


def test_generator_is_deterministic(tmp_path, tokenizer_dir):
    cfg = config(tmp_path, tokenizer_dir)
    a, b = make_source("r1", "findoc", cfg), make_source("r1", "findoc", cfg)
    for level, index in ((1, 0), (2, 5), (3, 7)):
        x, y = a.make_task(random.Random(1), level, index), b.make_task(random.Random(99), level, index)
        assert (
            x.task.prompt == y.task.prompt and x.hidden == y.hidden and x.task.verifier_params == y.task.verifier_params
        )
    assert a.make_task(random.Random(0), 2, 1).task.prompt != a.make_task(random.Random(0), 2, 2).task.prompt


@pytest.mark.parametrize("family", ["extraction", "calculation", "conclusion"])
def test_every_family_gold_scores_one_through_the_verifier(tmp_path, tokenizer_dir, family):
    cfg = config(tmp_path, tokenizer_dir, families=f'["{family}"]')
    src = make_source("r1", "findoc", cfg)
    from tests.test_verifier_breadth import assert_hidden_stays_hidden

    for index in range(8):
        level = 1 + index % 3
        drawn = src.make_task(random.Random(0), level, index)
        doc = src.document("train", level, index)
        assert drawn.task.verifier == "findoc" and drawn.task.verifier_params["family"] == family
        assert drawn.task.verifier_params["length"] == (512, 1024, 2048)[level - 1]
        public = {k: v for k, v in drawn.hidden.items() if k != "family"}  # the family is public too
        assert_hidden_stays_hidden([type(drawn)(drawn.task, public)])
        hidden = round_trip(drawn.hidden)
        right = score(as_trajectory(drawn.task, doc.question.completion), hidden)
        assert right.reward == 1.0 and right.components[family] == 1.0, (doc.question.completion, hidden)
        assert right.components["answer_rejected"] == 0.0 and right.components["format"] == 1.0
        wrong = score(as_trajectory(drawn.task, "<answer>label=sideways; driver=Nobody</answer>"), hidden)
        assert wrong.reward == 0.0 and wrong.status == "ok"


def test_calculation_tolerance_and_conclusion_fields():
    fn = registry.get("findoc")
    hidden = {"family": "calculation", "gold": 12.3456, "unit": "percent", "rel_tol": 0.01, "abs_tol": 0.05}
    t = as_trajectory(bare_task(), "")

    def with_answer(text: str):
        return fn(t.model_copy(update={"final_text": f"<answer>{text}</answer>"}), hidden)

    assert with_answer("12.35%").components["correct"] == 1.0
    assert with_answer("12.4").components["correct"] == 1.0  # within 1 %
    assert with_answer("13.0%").components["correct"] == 0.0
    assert with_answer("0.123").components["correct"] == 0.0  # a fraction is not a percent
    assert with_answer("12.3bn").components["answer_rejected"] == 1.0
    hidden = {
        "family": "conclusion",
        "gold": {"label": "improved", "driver": "Energy"},
        "choices": {"label": ["improved", "declined"], "driver": ["Energy", "Software", "Consumer"]},
    }
    assert with_answer("label=improved; driver=Energy").components["correct"] == 1.0
    assert with_answer("Improved, driven by energy").components["correct"] == 1.0
    half = with_answer("label=improved; driver=Software")
    assert half.components["conclusion"] == 0.5 and half.components["correct"] == 0.0 and half.reward == 0.0


@pytest.mark.parametrize(
    "text,value,how",
    [
        ("$1.2bn", 1200.0, "scaled"),
        ("1,200 million", 1200.0, "scaled"),
        ("(1,200)", -1200.0, "plain"),
        ("($1,200.5)", -1200.5, "plain"),
        ("-1,200", -1200.0, "plain"),
        ("\u22123.5", -3.5, "plain"),
        ("1,234,500 thousand", 1234.5, "scaled"),
        ("US$ 3.5 billion", 3500.0, "scaled"),
        ("USD 250k", 0.25, "scaled"),
        ("$2tn", 2_000_000.0, "scaled"),
        ("1234.5 dollars", 1234.5, "plain"),
        ("12.3%", 12.3, "percent"),
        ("12.3 percent", 12.3, "percent"),
        ("0.85x", 0.85, "plain"),
        (".5", 0.5, "plain"),
    ],
)
def test_unit_normalisation(text, value, how):
    got = parse_amount(text)
    assert got is not None and got[0] == pytest.approx(value) and got[1] == how


@pytest.mark.parametrize(
    "text", ["", "about twelve", "1.2.3", "((1))", "(1,200", "1,2000", "12%bn", "--5", "1" * 300, "$", "n/a"]
)
def test_unparseable_amounts_are_none(text):
    assert parse_amount(text) is None


def test_unparseable_answer_is_zero_with_answer_rejected_never_an_error():
    hidden = {"family": "extraction", "gold": 1234.5, "unit": "million"}
    t = as_trajectory(bare_task(), "")
    for text in ("<answer>roughly a lot</answer>", "", "<answer></answer>", "no tags, just words"):
        v = registry.get("findoc")(t.model_copy(update={"final_text": text}), hidden)
        assert v.reward == 0.0 and v.status == "ok" and v.components["answer_rejected"] == 1.0
    v = registry.get("findoc")(t.model_copy(update={"final_text": "<answer>$1.2345bn</answer>"}), hidden)
    assert v.reward == 1.0


def test_bad_gold_is_infra_and_missing_gold_is_input_error():
    t = as_trajectory(bare_task(), "<answer>1</answer>")
    fn = registry.get("findoc")
    with pytest.raises(VerifierInfraError):
        fn(t, {"family": "extraction", "gold": "not a number", "unit": "million"})
    with pytest.raises(VerifierInfraError):
        fn(t, {"family": "calculation", "gold": 1.0, "unit": "percent"})  # no tolerance: the scorer fails
    with pytest.raises(VerifierInputError):
        fn(t, None)
    with pytest.raises(VerifierInputError):
        fn(t, {"family": "poetry", "gold": 1})


def test_over_max_prompt_tokens_is_skipped_and_counted(tmp_path, tokenizer_dir):
    src = make_source("r1", "findoc", config(tmp_path, tokenizer_dir, max_prompt_tokens=1500))
    assert src.too_long == [3] and src.budget == 1500
    with pytest.raises(TaskSkipped, match="prompt_too_long"):
        src.make_task(random.Random(0), 3, 0)
    assert src.skipped["prompt_too_long"] == 1
    assert src.make_task(random.Random(0), 2, 0).task.verifier_params["tokens"] <= 1500


def test_every_level_too_long_disables_the_domain(tmp_path, tokenizer_dir):
    cfg = config(tmp_path, tokenizer_dir, max_prompt_tokens=200)
    with pytest.raises(DomainUnavailable, match="every level's document is longer than max_prompt_tokens 200"):
        make_source("r1", "findoc", cfg)
    sources, disabled = make_sources("r1", cfg)
    assert not sources and "max_prompt_tokens" in disabled["findoc"]


def test_default_budget_is_the_engine_context(tmp_path, tokenizer_dir):
    p = tmp_path / "run.toml"
    p.write_text(
        f"[model]\nmax_position_embeddings = 1024\n[sampler]\nmax_tokens = 64\n"
        f'[sampler.domains.findoc]\nmax_level = 2\nparams = {{ tokenizer = "{tokenizer_dir}" }}\n'
    )
    src = make_source("r1", "findoc", load_config(p))
    assert src.budget == 1024 - 64 and src.too_long == [2]


def test_no_tokenizer_and_bad_lengths(tmp_path, tokenizer_dir):
    p = tmp_path / "run.toml"
    p.write_text("[sampler.domains.findoc]\nmax_level = 2\n")
    with pytest.raises(DomainUnavailable, match="params.tokenizer"):
        make_source("r1", "findoc", load_config(p))
    with pytest.raises(ValueError, match="max_level 3 > the 2 lengths"):
        make_source("r1", "findoc", config(tmp_path, tokenizer_dir, lengths="[512, 1024]"))
    with pytest.raises(ValueError, match="increase strictly"):
        make_source("r1", "findoc", config(tmp_path, tokenizer_dir, max_level=2, lengths="[1024, 512]"))
    with pytest.raises(ValueError, match="unknown params"):
        make_source("r1", "findoc", config(tmp_path, tokenizer_dir, colour='"red"'))


def test_demonstration_shows_lookup_then_arithmetic_then_answer(tmp_path, tokenizer_dir):
    src = make_source("r1", "findoc", config(tmp_path, tokenizer_dir, families='["calculation"]'))
    (prompt, trained_p), (completion, trained_c) = src.demonstration(random.Random(3), 2)
    assert not trained_p and trained_c and "Question:" in prompt
    lookup, arithmetic, answer = (
        completion.index("Lookup:"),
        completion.index("Arithmetic:"),
        completion.index("<answer>"),
    )
    assert lookup < arithmetic < answer and completion.endswith("</answer>")
