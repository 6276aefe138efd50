"""The `recall` domain and verifier: determinism, the needle's position under control, every
variant's gold scoring 1 through the real verifier after a msgpack round trip, the eval set's
(position bucket, length) cells, and the curriculum walking the lengths level by level."""

from __future__ import annotations

import random

import pytest

from producers.domains import make_source
from producers.domains.longctx import length_of
from producers.domains.recall import bucket_of
from producers.domains.recall_gen import VARIANTS, answer_text
from scheduler.curriculum import Curriculum, DomainSpec
from tests.test_findoc import as_trajectory, bare_task, config, round_trip, tokenizer_dir  # noqa: F401 - a fixture
from verifier_workers import registry
from verifier_workers.worker import score


def test_generator_is_deterministic(tmp_path, tokenizer_dir):
    cfg = config(tmp_path, tokenizer_dir, kind="recall")
    a, b = make_source("r1", "recall", cfg), make_source("r1", "recall", cfg)
    for level, index in ((1, 0), (2, 3), (3, 6)):
        x, y = a.make_task(random.Random(1), level, index), b.make_task(random.Random(2), level, index)
        assert (
            x.task.prompt == y.task.prompt and x.hidden == y.hidden and x.task.verifier_params == y.task.verifier_params
        )
    assert a.make_task(random.Random(0), 2, 1).hidden != a.make_task(random.Random(0), 2, 2).hidden


@pytest.mark.parametrize("position", [0.02, 0.15, 0.37, 0.5, 0.73, 0.98])
def test_needle_position_is_controlled(tmp_path, tokenizer_dir, position):
    src = make_source("r1", "recall", config(tmp_path, tokenizer_dir, kind="recall", variants='["single", "kv"]'))
    for index in range(2):
        lay = src.layout("train", 3, index, position)
        content = lay.prompt[0].content
        body = content.split("\n\n")[1]  # the haystack between the head and the question
        at = body.index(lay.case.needles[0])
        assert abs(at / len(body) - position) < 0.03, (at / len(body), position)
        assert abs(lay.position - position) < 0.03
        drawn = src._drawn(lay, 3, position, "t", f"k{index}")
        assert drawn.task.verifier_params["position_bucket"] == bucket_of(position)
        assert drawn.task.verifier_params["length"] == 2048 and 1800 < drawn.task.verifier_params["tokens"] <= 2048


def test_buckets():
    assert [bucket_of(x) for x in (0.0, 0.099, 0.1, 0.55, 0.999, 1.0)] == [
        "0-10",
        "0-10",
        "10-20",
        "50-60",
        "90-100",
        "90-100",
    ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_gold_scores_one_through_the_verifier(tmp_path, tokenizer_dir, variant):
    src = make_source("r1", "recall", config(tmp_path, tokenizer_dir, kind="recall", variants=f'["{variant}"]'))
    for index in range(4):
        level = 1 + index % 3
        drawn = src.make_task(random.Random(0), level, index)
        lay = src.layout("train", level, index, random.Random(f"recall-position-0-recall-{level}-{index}").random())
        assert lay.prompt == drawn.task.prompt
        for needle in drawn.hidden["needles"]:
            assert needle in drawn.task.prompt[0].content
        hidden = round_trip(drawn.hidden)
        right = score(as_trajectory(drawn.task, f"Found it.\n<answer>{answer_text(lay.case)}</answer>"), hidden)
        assert right.reward == 1.0 and right.components["fields"] == 1.0 and right.components["answer_rejected"] == 0.0
        wrong = score(as_trajectory(drawn.task, "<answer>Z9-0000-ZZ</answer>"), hidden)
        assert wrong.reward == 0.0 and wrong.components["answer_rejected"] == 0.0


def test_demonstration_scores_one(tmp_path, tokenizer_dir):
    src = make_source("r1", "recall", config(tmp_path, tokenizer_dir, kind="recall", variants='["combine"]'))
    (prompt, _), (completion, trained) = src.demonstration(random.Random(5), 1)
    assert trained and "Found:" in completion and "Arithmetic:" in completion and "Question:" in prompt


def test_multi_fields_and_rejected_answers():
    fn = registry.get("recall")
    hidden = {"variant": "multi", "gold": {"Brno": "K7-4821-QX", "Lund": "A1-1111-BB", "Most": "C2-2222-DD"}}
    t = as_trajectory(bare_task(), "")

    def answered(text: str):
        return fn(t.model_copy(update={"final_text": text}), hidden)

    assert answered("<answer>brno = k7-4821-qx; Lund: A1-1111-BB\nMost=C2-2222-DD</answer>").reward == 1.0
    assert answered("<answer>K7-4821-QX, A1-1111-BB, C2-2222-DD</answer>").reward == 1.0  # in order
    partial = answered("<answer>Brno=K7-4821-QX; Lund=A1-1111-BC; Most=C2-2222-DD</answer>")
    assert partial.components["fields"] == pytest.approx(2 / 3) and partial.reward == 0.0
    rejected = answered("")
    assert rejected.reward == 0.0 and rejected.components["answer_rejected"] == 1.0 and rejected.status == "ok"
    total = {"variant": "combine", "gold": {"value": "1234"}}
    assert fn(t.model_copy(update={"final_text": "<answer>1,234</answer>"}), total).reward == 1.0


def test_eval_set_covers_buckets_and_lengths(tmp_path, tokenizer_dir):
    src = make_source("r1", "recall", config(tmp_path, tokenizer_dir, kind="recall", max_level=2, eval_n=40))
    es = src.eval_set(40, seed=7)
    cells = {(t.verifier_params["position_bucket"], t.verifier_params["length"]) for t in es.tasks()}
    assert cells == {(bucket_of((i + 0.5) / 10), n) for i in range(10) for n in (512, 1024)}
    assert es.level is None and es.local is None and es.sha256 == src.eval_set(40, seed=7).sha256
    assert all(it.hidden and it.task.verifier == "recall" for it in es.items)


def test_curriculum_walks_the_lengths(tmp_path, tokenizer_dir):
    """The curriculum's levels index `params.lengths`: promotions walk 512 -> 1024 -> 2048, a
    failing streak walks back, and each level's tasks are that long."""
    src = make_source("r1", "recall", config(tmp_path, tokenizer_dir, kind="recall", max_level=3))
    cur = Curriculum({"recall": DomainSpec(levels=(1, 3))}, window=8, min_samples=8)
    walked = [length_of(src.levels, cur.level("recall"))]
    for reward in (1.0, 1.0, 1.0, 0.0):  # each group of 8 decides: up, up, stay at the top, down
        change = cur.observe("recall", cur.level("recall"), [reward] * 8)
        if change is not None:
            walked.append(length_of(src.levels, change.new_level))
    assert walked == [512, 1024, 2048, 1024]
    for level in (1, 2, 3):
        params = src.make_task(random.Random(0), level, 0).task.verifier_params
        assert params["length"] == (512, 1024, 2048)[level - 1] and params["tokens"] <= params["length"]


def test_pipeline_eval_scores_by_position_bucket_and_length(tmp_path, tokenizer_dir):
    """`scheduler.pipeline_eval.group_scores` over a recall eval set: the items answered right
    are the first bucket's, so that bucket scores 1, the others 0, and each length 1/10."""
    from scheduler.pipeline_eval import group_scores

    src = make_source("r1", "recall", config(tmp_path, tokenizer_dir, kind="recall", max_level=2, eval_n=20))
    items = src.eval_set(20, seed=3).items
    tasks = [it.task.model_copy(update={"msg_id": f"ev1.recall.{i}"}) for i, it in enumerate(items)]
    got = {}
    for task, it in zip(tasks, items):
        bucket = task.verifier_params["position_bucket"]
        lay_answer = "; ".join(f"{k}={v}" for k, v in it.hidden["gold"].items())
        answer = it.hidden["gold"]["value"] if list(it.hidden["gold"]) == ["value"] else lay_answer
        text = f"<answer>{answer}</answer>" if bucket == "0-10" else "<answer>nothing</answer>"
        if task.verifier_params["length"] == 1024 and bucket == "50-60":
            continue  # a reward that never came: counted wrong
        got[task.msg_id] = score(as_trajectory(task, text), round_trip(it.hidden))
    groups = group_scores(tasks, got)["recall"]
    assert groups["position_bucket"]["0-10"] == 1.0 and groups["position_bucket"]["50-60"] == 0.0
    assert set(groups["position_bucket"]) == {bucket_of((i + 0.5) / 10) for i in range(10)}
    assert groups["length"] == {"512": 0.1, "1024": 0.1}
