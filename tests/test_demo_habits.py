"""The demo's two teacher habits: worked arith answers and tool_calc answers from memory.

Both are correct answers; what is tested is that they score as such, that the SFT mix
holds each habit in its configured share, and that a bad share is a clear start-up error.
"""

from __future__ import annotations

import random
import re

import pytest

from producers.domains import make_source, tool_calc
from schemas.answers import arith_answer, arith_value, worked_completion
from schemas.config import load_config
from schemas.episode import Trajectory
from verifier_workers.verifiers.arith import verify_arith


def test_worked_answers_are_exact_and_parse_back():
    rng = random.Random(0)
    for _ in range(3000):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        expr = f"{a}{rng.choice('+-')}{b}"
        done = worked_completion(expr, arith_value(expr))
        work = re.fullmatch(r"\((-?\d+)([+-]\d+)\)=(-?\d+)", done)
        assert work, done
        assert int(work.group(1)) + int(work.group(2)) == arith_value(expr)  # the work itself adds up
        assert int(work.group(1)) % 10 == 0 and abs(int(work.group(2))) <= 18
        assert arith_answer(done) == arith_value(expr)
    assert worked_completion("21+51", 72) == "(70+2)=72"
    assert worked_completion("21-51", -30) == "(-30+0)=-30"
    for bare in ("5+3", "12+3", "12+34-5", "12*34"):
        assert worked_completion(bare, arith_value(bare)) is None


@pytest.mark.parametrize(
    "text,value",
    [
        ("72", 72),
        (" -30 ", -30),
        ("(70+2)=72", 72),
        ("(7)=72", 72),
        ("()=72", None),
        ("(70+2)=7 2", None),
        ("(70*2)=140", None),
        ("(1)=(2)=3", None),
        ("70+2=72", None),
        ("(70+2)", None),
        ("=72", None),
        ("", None),
    ],
)
def test_arith_answer_grammar(text, value):
    assert arith_answer(text) == value


def test_the_verifier_scores_only_the_final_integer():
    def score(text):
        traj = Trajectory(
            run_id="r",
            task_id="t",
            task_msg_id="m",
            domain="arith",
            group_id="g",
            group_size=1,
            sample_index=0,
            turns=[],
            policy_version=0,
            final_text=text,
            verifier="arith",
            verifier_params={"expression": "21+51"},
        )
        return verify_arith(traj).components

    assert score("(70+2)=72") == {"correct": 1.0, "format": 1.0}
    assert score("(70+3)=72") == {"correct": 1.0, "format": 1.0}  # work is not scored, only the answer
    assert score("(70+2)=73") == {"correct": 0.0, "format": 1.0}
    assert score("72") == {"correct": 1.0, "format": 1.0}


def _cfg(tmp_path, arith_params="", tool_params=""):
    path = tmp_path / "c.toml"
    path.write_text(f"""
[sampler.domains.arith]
min_level = 3
max_level = 3
{arith_params}
[sampler.domains.tool_calc]
max_turns = 2
{tool_params}
""")
    return load_config(path)


def test_sft_mix_holds_each_habit_in_its_share(tmp_path):
    cfg = _cfg(tmp_path, "params = { worked_share = 0.3 }", "params = { direct_share = 0.6 }")
    arith_src, tool_src = make_source("r", "arith", cfg), make_source("r", "tool_calc", cfg)
    rng = random.Random(1)
    arith_demos = [arith_src.demonstration(rng, 3) for _ in range(4000)]
    worked = sum(d[1][0].startswith("(") for d in arith_demos) / len(arith_demos)
    assert 0.27 < worked < 0.33
    assert all(arith_answer(d[1][0]) == arith_value(d[0][0].rstrip("=")) for d in arith_demos)
    tool_demos = [tool_src.demonstration(rng, 1) for _ in range(2000)]
    direct = [d for d in tool_demos if len(d) == 3]
    assert 0.56 < len(direct) / len(tool_demos) < 0.64
    for prompt, opens, digits in direct:  # the teacher's direct answer is the right product
        a, b = map(int, prompt[0].removesuffix("=?").split("*"))
        assert opens == ("=", True) and digits == (str(a * b), None)  # the habit is trained, the digits are not
    assert all(len(d) == 4 and d[1][0].startswith("<py>") for d in tool_demos if len(d) != 3)


def test_direct_answers_train_the_habit_not_the_digits():
    """In an answer from memory only the opening `=` (and the closing eos) carry loss; the
    product's digits are in the sequence as context, unsupervised."""
    from learner.sft import make_batch
    from rlbus.model.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    demo = tool_calc.demonstration(random.Random(0), 1, direct_share=1.0)
    batch = make_batch(tok, [demo])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    text = tok.decode(ids)
    assert text == demo[0][0] + "=" + demo[2][0] + "<eos>"
    trained = [tok.decode([i]) for i, lab in zip(ids, labels) if lab != -100]
    assert trained == ["=", "<eos>"]


def test_default_share_leaves_the_demo_stream_unchanged(tmp_path):
    cfg = _cfg(tmp_path)
    src = make_source("r", "arith", cfg)
    plain = [src.demonstration(random.Random(5), 3) for _ in range(1)]
    assert plain[0][1][0] == arith_value(plain[0][0][0].rstrip("=")).__str__()
    assert tool_calc.demonstration(random.Random(0), 1) == tool_calc.demonstration(random.Random(0), 1, direct_share=0)


@pytest.mark.parametrize(
    "arith_params,tool_params,message",
    [
        ("params = { worked_share = 1.5 }", "", "params.worked_share must be a number in [0, 1]"),
        ("params = { worked_share = true }", "", "params.worked_share must be a number in [0, 1]"),
        ("params = { workedshare = 0.3 }", "", "unknown params ['workedshare']"),
        ("", "params = { direct_share = -0.1 }", "params.direct_share must be a number in [0, 1]"),
    ],
)
def test_a_bad_share_is_a_start_up_error(tmp_path, arith_params, tool_params, message):
    cfg = _cfg(tmp_path, arith_params, tool_params)
    name = "arith" if arith_params else "tool_calc"
    with pytest.raises(ValueError, match=re.escape(message)):
        make_source("r", name, cfg)


def test_rlbus_up_refuses_a_bad_share_before_anything_starts(tmp_path, capsys):
    """The launcher's start-up checks build every domain's source: a bad share stops `rlbus up`
    with the domain's message and the table to fix, before NATS, the model or a run folder."""
    from rlbus.run.launcher import up

    cfg = _cfg(tmp_path, "params = { worked_share = 1.5 }")
    cfg.run.run_dir = str(tmp_path / "runs")
    assert up(cfg, None) == 1
    out = capsys.readouterr().out
    assert "params.worked_share must be a number in [0, 1], got 1.5" in out
    assert "fix [sampler.domains.arith]" in out
    assert "unexpected error" not in out and "--resume" not in out
    assert not (tmp_path / "runs").exists()
