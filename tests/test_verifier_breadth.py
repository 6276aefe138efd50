"""Verifier breadth: `files` and `model` verifiers on right, wrong and malformed answers;
reward composition (weights, process components); the `jsonl`/`extract`/`files`/`judge`
domains, including the hidden-data guarantee (encoded tasks never hold hidden content)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import msgpack
import pytest
from pydantic import ValidationError

from producers.domains import make_source
from schemas import ToolCall, Trajectory, Turn, encode
from schemas.config import RunConfig
from verifier_workers import registry
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import VerifierInputError
from verifier_workers.worker import compose_reward, process_components, score, tool_success_rate

ROOT = Path(__file__).resolve().parents[1]


def traj(
    verifier: str, final_text: str = "", *, turns=None, artifacts=None, hidden_ref=None, reward_weights=None, **params
) -> Trajectory:
    return Trajectory(
        run_id="r1",
        task_id="t1",
        task_msg_id="m1",
        domain=verifier,
        group_id="g1",
        group_size=1,
        sample_index=0,
        turns=turns or [],
        verifier=verifier,
        verifier_params=params,
        policy_version=0,
        final_text=final_text,
        artifacts=artifacts or {},
        hidden_ref=hidden_ref,
        reward_weights={} if reward_weights is None else reward_weights,
    )


def files(final_text: str = "", hidden=None, **kw):
    params = {k: kw.pop(k) for k in ("path", "format") if k in kw}
    return registry.get("files")(traj("files", final_text, **kw, **params), hidden)


def fenced(body: str, info: str = "") -> str:
    return f"Here it is:\n```{info}\n{body}\n```\n"


# ---------------------------------------------------------------- files: json

PERSON = {
    "schema": {
        "type": "object",
        "required": ["name", "age", "tags"],
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        },
    },
    "expected": {"name": "Ada", "age": 36},
}
JSON_TASK = dict(path="out.json", format="json")


def test_files_json_right_from_artifact():
    v = files(hidden=PERSON, artifacts={"out.json": b'{"name": "ada", "age": 36, "tags": ["x"]}'}, **JSON_TASK)
    assert v.components == {"exists": 1.0, "parses": 1.0, "schema": 1.0, "correct": 1.0} and v.reward == 1.0


def test_files_json_wrong_scores_fraction():
    v = files(hidden=PERSON, artifacts={"./out.json": b'{"name": "Bob", "age": -1, "tags": []}'}, **JSON_TASK)
    assert v.components["parses"] == 1.0 and v.components["correct"] == 0.0 and v.reward == 0.0
    assert 0.0 < v.components["schema"] < 1.0 and "age minimum 0" in v.details and "name == 'Ada'" in v.details


@pytest.mark.parametrize("content", [b'{"name": "Ada", ', b"", b"   ", b"\xff\xfe not json"])
def test_files_json_malformed_or_empty(content):
    v = files(hidden=PERSON, artifacts={"out.json": content}, **JSON_TASK)
    assert v.reward == 0.0 and v.status == "ok" and v.components["parses"] == 0.0 and v.components["schema"] == 0.0


def test_files_missing_artifact_and_multi_turn_without_export():
    v = files(hidden=PERSON, artifacts={"other.json": b"{}"}, **JSON_TASK)
    assert v.components["exists"] == 0.0 and v.reward == 0.0
    turns = [
        Turn(role="assistant", text="a"),
        Turn(role="tool", text="<obs exit=0>\n</obs>"),
        Turn(role="assistant", text="b"),
    ]
    v = files(fenced('{"name": "Ada", "age": 36, "tags": ["x"]}'), PERSON, turns=turns, **JSON_TASK)
    assert v.components["exists"] == 0.0, "multi-turn episodes must export the file"


def test_files_single_turn_fenced_fallback():
    body = '{"name": "Ada", "age": 36, "tags": ["a", "b"]}'
    assert files(fenced(body, "json"), PERSON, **JSON_TASK).reward == 1.0
    assert files(body, PERSON, **JSON_TASK).reward == 1.0  # no fence: the whole text
    assert files(fenced("draft") + fenced(body), PERSON, **JSON_TASK).reward == 1.0  # last block wins


@pytest.mark.parametrize(
    "params,hidden",
    [
        ({"format": "json"}, PERSON),
        ({"path": "x.json", "format": "yaml"}, PERSON),
        ({"path": "x.json", "format": "json"}, {}),
        ({"path": "x.json", "format": "json"}, None),
        ({"path": "x.json", "format": "json"}, {"schema": {"type": "tuple"}}),
    ],
)
def test_files_unusable_task_is_input_error(params, hidden):
    with pytest.raises(VerifierInputError):
        registry.get("files")(traj("files", '{"a": 1}', **params), hidden)


# ---------------------------------------------------------------- files: csv / svg

SQUARES = {
    "columns": ["n", "square"],
    "types": {"n": "int", "square": "int"},
    "min_rows": 3,
    "max_rows": 3,
    "rows": [{"n": 1, "square": 1}, {"n": 2, "square": 4}, {"n": 3, "square": 9}],
}
CSV_TASK = dict(path="sq.csv", format="csv")


def test_files_csv_right_wrong_malformed():
    right = files(artifacts={"sq.csv": b"n,square\n1,1\n2,4\n3,9\n"}, hidden=SQUARES, **CSV_TASK)
    assert right.reward == 1.0 and right.components["schema"] == 1.0
    wrong = files(artifacts={"sq.csv": b"n,square\n1,1\n2,5\n3,9\n4,16\n"}, hidden=SQUARES, **CSV_TASK)
    assert wrong.reward == 0.0 and 0 < wrong.components["schema"] < 1 and "at most 3 rows" in wrong.details
    ragged = files(fenced("n,square\n1,1,1\n2,four\n3,9"), SQUARES, **CSV_TASK)
    assert ragged.components["parses"] == 1.0 and ragged.reward == 0.0 and "every row has 2 fields" in ragged.details
    for bad in (b"", b'"unterminated\n', b"\n\n"):
        v = files(artifacts={"sq.csv": bad}, hidden=SQUARES, **CSV_TASK)
        assert v.components["parses"] == 0.0 and v.reward == 0.0


CIRCLE = {
    "root_attrs": {"width": "100"},
    "elements": [
        {"tag": "circle", "min": 1, "max": 1, "attrs": {"fill": "red", "r": None}},
        {"tag": "text", "text": "hi"},
    ],
}
SVG_TASK = dict(path="c.svg", format="svg")
SVG_OK = '<svg xmlns="http://www.w3.org/2000/svg" width="100"><circle r="5" fill="RED"/><text>Hi there</text></svg>'


def test_files_svg_right_wrong_malformed():
    assert files(artifacts={"c.svg": SVG_OK.encode()}, hidden=CIRCLE, **SVG_TASK).reward == 1.0
    assert files(fenced(SVG_OK, "svg"), CIRCLE, **SVG_TASK).reward == 1.0
    blue = files(fenced(SVG_OK.replace("RED", "blue")), CIRCLE, **SVG_TASK)
    assert blue.reward == 0.0 and blue.components["schema"] == 0.75
    not_svg = files(fenced("<html><circle r='1' fill='red'/></html>"), CIRCLE, **SVG_TASK)
    assert not_svg.components["parses"] == 1.0 and "root element is <svg>" in not_svg.details
    for bad in (
        "<svg><circle></svg>",
        "not xml at all",
        '<!DOCTYPE svg [<!ENTITY a "aaaa">]><svg width="100">&a;</svg>',
    ):
        v = files(fenced(bad), CIRCLE, **SVG_TASK)
        assert v.components["parses"] == 0.0 and v.reward == 0.0 and v.status == "ok"


# ---------------------------------------------------------------- model verifier


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny sequence classifier and a tiny causal judge, built locally from configs."""
    import os

    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlbus.model.tiny_model import build_char_tokenizer, build_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("models")
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    Qwen2ForSequenceClassification(cfg).save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    build_tiny_model(root / "judge", hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256)
    return root / "rm", root / "judge"


def judge_traj(answer: str, **params) -> Trajectory:
    return traj("model", answer, hidden_ref="judge.q1", question="What is the capital of France?", **params)


def test_model_classifier_scores_in_unit_interval_deterministically(tiny_models):
    rm, _ = tiny_models
    fn = registry.get("model")
    right, wrong = fn(judge_traj("Paris", model_path=str(rm)), None), fn(judge_traj("Berlin", model_path=str(rm)), None)
    for v in (right, wrong):
        assert 0.0 < v.components["score"] < 1.0 and v.status == "ok" and v.reward == v.components["score"]
        assert v.components["correct"] == float(v.components["score"] >= 0.5)
    assert right.components["score"] != wrong.components["score"]
    assert fn(judge_traj("Paris", model_path=str(rm)), None).components == right.components
    assert fn(judge_traj("Paris", model_path=str(rm), threshold=0.0), None).components["correct"] == 1.0
    assert fn(judge_traj("Paris", model_path=str(rm), threshold=1.01), None).components["correct"] == 0.0


def test_model_classifier_is_cached_and_reads_env(tiny_models, monkeypatch):
    from verifier_workers.verifiers import model as model_verifier

    rm, _ = tiny_models
    monkeypatch.setenv(model_verifier.ENV, str(rm))
    a = model_verifier.load(str(rm))
    v = registry.get("model")(judge_traj("Paris"), None)
    assert model_verifier.load(str(rm)) is a and a.kind == "classifier" and 0 < v.reward < 1


def test_model_causal_judge_uses_yes_no_tokens(tiny_models):
    from verifier_workers.verifiers import model as model_verifier

    _, judge = tiny_models
    fn = registry.get("model")
    hidden = {"reference": "Paris", "rubric": "Exact city."}
    a = fn(judge_traj("Paris", model_path=str(judge)), hidden)
    b = fn(judge_traj("x" * 2000, model_path=str(judge)), hidden)  # longer than the model: truncated from the left
    m = model_verifier.load(str(judge))
    assert m.kind == "causal" and m.yes_ids and m.no_ids and not set(m.yes_ids) & set(m.no_ids)
    for v in (a, b):
        assert 0.0 < v.components["score"] < 1.0 and v.status == "ok"
    assert fn(judge_traj("", model_path=str(judge)), hidden).status == "ok"  # empty answer is scored


def test_model_unconfigured_is_input_error_and_absent_is_infra(tiny_models, monkeypatch, tmp_path):
    from verifier_workers.verifiers import model as model_verifier

    monkeypatch.delenv(model_verifier.ENV, raising=False)
    fn = registry.get("model")
    with pytest.raises(VerifierInputError, match="model_path"):
        fn(judge_traj("Paris"), None)
    with pytest.raises(VerifierInfraError, match="not found"):
        fn(judge_traj("Paris", model_path=str(tmp_path / "nope")), None)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(VerifierInfraError):
        fn(judge_traj("Paris", model_path=str(tmp_path / "broken")), None)
    with pytest.raises(VerifierInputError):
        fn(judge_traj("Paris", model_path=str(tiny_models[0]), judge="oracle"), None)


# ---------------------------------------------------------------- composition


def test_process_components_from_tool_turns_and_calls():
    turns = [
        Turn(role="prompt", text="q"),
        Turn(role="assistant", text="<py>1/0</py>"),
        Turn(role="tool", text="\n<obs exit=1>\n<err>ZeroDivisionError</err>\n</obs>\n"),
        Turn(role="assistant", text="<py>print(1)</py>"),
        Turn(role="tool", text="<OBS exit = 0 trunc>\n1\n</obs>"),
        Turn(role="assistant", text="<py>x</py>"),
        Turn(role="tool", text="unknown tool"),
        Turn(role="assistant", text="=1"),
    ]
    assert process_components(traj("arith", turns=turns)) == {
        "turns_used": 4.0,
        "tool_success_rate": pytest.approx(1 / 3),
    }
    calls = [ToolCall(turn=1, tool="python", code="1/0", exit_code=1), ToolCall(turn=3, tool="python", code="1")]
    t = Trajectory(**{**traj("arith", turns=turns).model_dump(), "tool_calls": calls})
    assert tool_success_rate(t) == 0.5
    assert process_components(traj("arith", turns=[Turn(role="assistant", text="5")])) == {"turns_used": 1.0}


EGOLD = {"gold": {"name": "Ada", "born": 1815}}


def test_score_applies_domain_weights_and_reports_process_components():
    t = traj(
        "extract", '{"name": "Ada", "born": 1816}', hidden_ref="x.y", reward_weights={"correct": 0.5, "fields": 0.5}
    )
    r = score(t, EGOLD)
    assert r.reward == pytest.approx(0.25) and r.components["fields"] == 0.5 and r.components["turns_used"] == 0.0
    default = score(traj("extract", '{"name": "Ada", "born": 1815}', hidden_ref="x.y"), EGOLD)
    assert default.reward == 1.0 and "turns_used" in default.components  # reported, not weighted in
    turns = [Turn(role="assistant", text="a"), Turn(role="assistant", text="b")]
    penalised = score(
        traj("arith", "5", turns=turns, expression="2+3", reward_weights={"correct": 1.0, "turns_used": -0.1})
    )
    assert penalised.reward == pytest.approx(0.8)


@pytest.mark.parametrize(
    "weights", [{"correct": float("nan")}, {"correct": float("inf")}, {"correct": "1"}, {"correct": True}, [1.0]]
)
def test_bad_weights_are_refused_by_the_schema(weights):
    with pytest.raises(ValidationError, match="reward_weights"):
        traj("arith", "5", expression="2+3", reward_weights=weights)


def test_unknown_or_misplaced_weights_are_input_errors():
    with pytest.raises(VerifierInputError, match="nosuch"):
        score(traj("arith", "5", expression="2+3", reward_weights={"nosuch": 1.0}))
    # weights where they travelled before `reward_weights` was a field are refused, not ignored
    old = traj("arith", "5", expression="2+3", reward_weights={"correct": 0.5})
    old = old.model_copy(update={"verifier_params": {"expression": "2+3", "reward_weights": {"correct": 0.5}}})
    with pytest.raises(VerifierInputError, match="verifier_params.reward_weights"):
        score(old)


def test_non_finite_component_is_a_verifier_crash():
    from verifier_workers.errors import VerifierCrash
    from verifier_workers.verdict import Verdict

    with pytest.raises(VerifierCrash):
        compose_reward(traj("arith"), Verdict({"correct": math.nan}))


# ---------------------------------------------------------------- domains


def ctx_for(tmp_path: Path, toml: str) -> RunConfig:
    p = tmp_path / "run.toml"
    p.write_text(toml)
    from schemas.config import load_config

    return load_config(p)


def draw(cfg: RunConfig, name: str, n: int = 20):
    src = make_source("r1", name, cfg)
    dc = cfg.sampler.domains[name]
    rng = random.Random(0)
    return [src.make_task(rng, rng.randint(dc.min_level, dc.max_level), i) for i in range(n)]


def _leaves(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _leaves(v)]
    if isinstance(value, list):
        return [s for v in value for s in _leaves(v)]
    return [json.dumps(value)] if not isinstance(value, str) else [value]


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def assert_hidden_stays_hidden(drawn) -> None:
    for d in drawn:
        assert d.hidden and d.task.hidden_ref, d.task
        wire = encode(d.task)
        assert not {"gold", "reference", "schema", "rows"} & _keys(msgpack.unpackb(wire)), d.task
        for leaf in _leaves(d.hidden):
            if isinstance(leaf, str) and len(leaf) >= 5 and leaf not in d.task.prompt[0].content:
                assert leaf.encode() not in wire, (leaf, d.task.task_id)


def test_extract_domain_hides_gold_and_its_gold_scores_one(tmp_path):
    cfg = ctx_for(tmp_path, "[sampler.domains.extract]\nmax_level = 2\nreward_weights = { correct = 1.0 }\n")
    drawn = draw(cfg, "extract", 40)
    assert_hidden_stays_hidden(drawn)
    assert {d.task.difficulty for d in drawn} == {1, 2} and all(d.task.verifier == "extract" for d in drawn)
    for d in drawn[:10]:
        t = traj("extract", json.dumps(d.hidden["gold"]), hidden_ref=d.task.hidden_ref, **d.task.verifier_params)
        assert score(t, d.hidden).reward == 1.0
    rows = [json.loads(x) for x in (ROOT / "examples/data/extract.jsonl").read_text().splitlines() if x]
    assert len(rows) >= 20


FILE_SOLUTIONS = {
    "person-json": '{"name": "Ada", "age": 36, "languages": ["en", "fr"]}',
    "point-json": '{"x": 3, "y": -4, "norm": 5.0}',
    "config-json": '{"debug": false, "port": 8080, "mode": "prod"}',
    "squares-csv": "n,square\n1,1\n2,4\n3,9\n4,16\n",
    "scores-csv": "name,score\nAnn,90\nBob,75\n",
    "circle-svg": '<svg xmlns="http://www.w3.org/2000/svg"><circle cx="5" cy="5" r="4" fill="red"/></svg>',
    "flag-svg": '<svg width="300" height="200"><rect/><rect/><rect/><text>FLAG</text></svg>',
}


def test_files_domain_example_tasks_are_satisfiable_and_hidden(tmp_path):
    cfg = ctx_for(tmp_path, '[sampler.domains.files]\nmax_level = 2\nparams = { tools = ["python"] }\n')
    drawn = draw(cfg, "files", 40)
    assert_hidden_stays_hidden(drawn)
    assert all(d.task.tools == ["python"] for d in drawn)
    seen = set()
    for fields, hidden, _ in make_source("r1", "files", cfg).items:  # every task of the file
        params, ref = fields["verifier_params"], fields["hidden_ref"]
        pid = params["problem_id"]
        seen.add(pid)
        as_file = traj(
            "files",
            turns=[Turn(role="assistant", text="a")] * 2,
            hidden_ref=ref,
            artifacts={params["path"]: FILE_SOLUTIONS[pid].encode()},
            **params,
        )
        assert score(as_file, hidden).reward == 1.0, pid
        assert score(traj("files", fenced(FILE_SOLUTIONS[pid]), hidden_ref=ref, **params), hidden).reward == 1.0
        assert score(traj("files", "no file", hidden_ref=ref, **params), hidden).reward == 0.0
    assert seen == set(FILE_SOLUTIONS)


def test_jsonl_domain_pairs_any_file_with_any_verifier(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"id": "a", "prompt": "2+3=", "params": {"expression": "2+3"}, "level": 1},
                {
                    "id": "b",
                    "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Half?"}],
                    "hidden": {"gold": "\\frac{1}{2}"},
                    "level": 2,
                },
            ]
        )
        + "\n"
    )
    cfg = ctx_for(
        tmp_path,
        f'[sampler.domains.mine]\nkind = "jsonl"\nverifier = "math"\ndata = "{data}"\n'
        'max_level = 2\nparams = { verifier_params = { note = "x" } }\n',
    )
    drawn = {d.task.verifier_params["problem_id"]: d for d in draw(cfg, "mine", 30)}
    a, b = drawn["a"], drawn["b"]
    assert a.hidden is None and a.task.hidden_ref is None and a.task.verifier == "math"
    assert a.task.verifier_params == {"note": "x", "problem_id": "a", "expression": "2+3"}
    assert [m.role for m in b.task.prompt] == ["system", "user"] and b.task.difficulty == 2
    assert_hidden_stays_hidden([b])
    assert score(traj("math", "\\boxed{0.5}", hidden_ref=b.task.hidden_ref), b.hidden).reward == 1.0


@pytest.mark.parametrize(
    "toml,match",
    [
        (
            '[sampler.domains.j]\nkind = "jsonl"\ndata = "examples/data/extract.jsonl"\n',
            "needs sampler.domains.j.verifier",
        ),
        ('[sampler.domains.j]\nkind = "jsonl"\nverifier = "extract"\n', "needs sampler.domains.j.data"),
        ('[sampler.domains.j]\nkind = "jsonl"\nverifier = "extract"\ndata = "/nonexistent.jsonl"\n', "not found"),
    ],
)
def test_jsonl_domain_config_errors(tmp_path, toml, match):
    with pytest.raises(ValueError, match=match):
        make_source("r1", "j", ctx_for(tmp_path, toml))


@pytest.mark.parametrize(
    "line,reason",
    [
        ('{"prompt": "x"}', "missing id"),
        ('{"id": 1, "prompt": ""}', "missing prompt"),
        ('{"id": 1, "prompt": 7}', "bad prompt"),
        ('{"id": 1, "prompt": "x", "level": "hard"}', "bad level"),
        ('{"id": 1, "prompt": "x", "params": {"gold": 3}}', "gold in public params"),
        ('{"id": 1, "prompt": "x", "hidden": [1]}', "hidden not an object"),
        ("not json", "invalid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"id": 0, "prompt": "again"}', "duplicate id"),
    ],
)
def test_jsonl_malformed_lines_are_skipped_counted_and_logged(tmp_path, line, reason):
    from structlog.testing import capture_logs

    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": 0, "prompt": "ok"}\n' + line + "\n")
    cfg = ctx_for(tmp_path, f'[sampler.domains.j]\nkind = "jsonl"\nverifier = "extract"\ndata = "{data}"\n')
    with capture_logs() as logs:
        src = make_source("r1", "j", cfg)
    assert src.data.skipped == {reason: 1}
    assert [t.verifier_params["problem_id"] for t in (d.task for d in draw(cfg, "j", 5))] == ["0"] * 5
    skip = [e for e in logs if e["event"] == "sampler.data_row_skipped"]
    assert len(skip) == 1 and skip[0]["where"] == f"{data}:2" and skip[0]["reason"].startswith(reason), logs


def test_judge_domain_points_at_the_model_verifier(tmp_path, tiny_models):
    rm, _ = tiny_models
    cfg = ctx_for(tmp_path, f'[sampler.domains.judge]\nparams = {{ model_path = "{rm}" }}\n')
    drawn = draw(cfg, "judge", 10)
    assert_hidden_stays_hidden(drawn)
    d = drawn[0]
    assert d.task.verifier == "model" and d.task.verifier_params["model_path"] == str(rm)
    r = score(traj("model", "Paris", hidden_ref=d.task.hidden_ref, **d.task.verifier_params), d.hidden)
    assert 0 < r.reward < 1 and r.components["score"] == r.reward


def test_domains_example_config_loads_every_builtin_kind():
    from producers.domains import BUILTINS, kind_of
    from schemas.config import load_config

    cfg = load_config(ROOT / "examples/domains.toml")
    bench_only = {"sleep"}  # the scheduling benchmark's kind, not a task domain
    # docker episodes and verifiers (examples/repo.toml, examples/harbor.toml); a live environment server (examples/openenv.toml)
    # long documents: examples/long_context.toml; a harness per episode: examples/agent.toml;
    # a trained reward model as the only reward: examples/rlhf.toml
    own_example = {"repo", "harbor", "openenv", "findoc", "recall", "agent", "rlhf"}
    assert {kind_of(n, dc) for n, dc in cfg.sampler.domains.items()} == set(BUILTINS) - bench_only - own_example
    elsewhere = set()
    for path in sorted((ROOT / "examples").glob("*.toml")):
        other = load_config(path)
        elsewhere |= {kind_of(n, dc) for n, dc in other.sampler.domains.items()}
    assert own_example <= elsewhere, f"kinds without an example config: {sorted(own_example - elsewhere)}"
