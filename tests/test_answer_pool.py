"""Answer-dependent scoring runs in `verifier_workers.answer_pool`, not in the verifier (issue 27).

Real attack answers through the real reasoning_gym verifier, for datasets whose scorer
`eval`s the answer or passes it to sympy's parse_expr (reasoning-gym 0.1.25). Each attack
test succeeds against the in-process scorer of the old code (credential read, rebinding,
gold read through frames, frozen worker) and must fail here."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ["NATS_PASSWORD"] = "planted"  # before any pool starts: a job must not see it

import msgpack
import pytest

from producers.domains import make_sources
from schemas import Trajectory, Turn
from schemas.config import load_config
from verifier_workers import answer_pool, registry
from verifier_workers.verifiers.math import verify_math
from verifier_workers.verifiers.reasoning_gym import verify_reasoning_gym

NINE = [
    "string_insertion",
    "spiral_matrix",
    "binary_matrix",
    "n_queens",
    "countdown",
    "puzzle24",
    "polynomial_multiplication",
    "simple_integration",
    "intermediate_integration",
]
LIMITS = answer_pool.Limits(cpu_s=2.0, memory_mb=512, wall_s=4.0)


@pytest.fixture(scope="module", autouse=True)
def pool_limits():
    answer_pool.shutdown()
    answer_pool.configure(LIMITS)
    yield
    answer_pool.configure(answer_pool.Limits())
    answer_pool.shutdown()


@pytest.fixture(scope="module")
def drawn():
    cfg = load_config(None, [f"sampler.domain_sets.reasoning_gym.include={NINE!r}".replace("'", '"')])
    sources, disabled = make_sources("ap", cfg)
    assert disabled == {}
    out = {}
    for src in sources.values():
        d = src.make_task(random.Random(0), 1, 0)
        out[d.hidden["dataset"]] = d
    assert set(out) == set(NINE)
    return out


def verify(d, text: str):
    hidden = msgpack.unpackb(msgpack.packb(d.hidden, use_bin_type=True), raw=False)
    return verify_reasoning_gym(Trajectory.from_task(d.task, 0, [Turn(role="assistant", text=text)]), hidden)


def plain_traj(text: str, verifier: str, params: dict) -> Trajectory:
    return Trajectory(
        run_id="r",
        msg_id="m",
        task_id="t",
        task_msg_id="tm",
        domain="x",
        purpose="train",
        group_id="g",
        group_size=1,
        sample_index=0,
        policy_version=0,
        turns=[Turn(role="assistant", text=text)],
        final_text=text,
        verifier=verifier,
        verifier_params=params,
    )


def test_gold_still_scores_one_for_each_of_the_nine(drawn):
    for name in NINE:
        v = verify(drawn[name], f"<answer>{drawn[name].hidden['answer']}</answer>")
        assert (name, v.reward, v.status) == (name, 1.0, "ok")


def test_a_list_answer_keeps_its_partial_credit(drawn):
    d = drawn["string_insertion"]
    v = verify(d, f"<answer>{list(d.hidden['answer'])!r}</answer>")
    assert v.reward == pytest.approx(0.1) and v.status == "ok"


@pytest.mark.parametrize("name", ["string_insertion", "spiral_matrix", "countdown", "polynomial_multiplication"])
def test_an_answer_cannot_see_the_credential_or_write_files(drawn, name, tmp_path):
    marker = tmp_path / f"{name}.txt"
    attack = f"open({str(marker)!r}, 'w').write(__import__('os').environ.get('NATS_PASSWORD', 'none'))"
    v = verify(drawn[name], f"<answer>{attack}</answer>")
    assert v.reward < 0.1 and not marker.exists()
    out = answer_pool.call("os:getenv", ("NATS_PASSWORD",))
    assert out.kind == "ok" and out.value is None  # the job's environment has no credential at all
    assert os.environ["NATS_PASSWORD"] == "planted"


@pytest.mark.parametrize("name", ["string_insertion", "binary_matrix", "countdown", "simple_integration"])
def test_rebinding_the_scorer_does_not_carry_to_the_next_answer(drawn, name):
    d = drawn[name]
    cls = "type(__import__('sys')._getframe(1).f_locals['self'])"
    for attack in (
        f"setattr({cls}, 'score_answer', lambda s, a, e: 1.0)",
        "setattr(__import__('builtins'), 'float', lambda *a: 1.0)",
    ):
        verify(d, f"<answer>{attack}</answer>")
        wrong = verify(d, "<answer>surely not it 97531</answer>")
        assert wrong.reward < 0.1, (name, attack, wrong)


@pytest.mark.parametrize("name", ["string_insertion", "spiral_matrix", "n_queens", "intermediate_integration"])
def test_reading_the_gold_through_frames_gains_nothing(drawn, name):
    d = drawn[name]
    gold = str(d.hidden["answer"])
    for attack in (
        "__import__('sys')._getframe(1).f_locals['oracle_answer']",
        "__import__('sys')._getframe(1).f_locals['entry']['answer']",
        "[g for g in __import__('gc').get_objects() if isinstance(g, dict) and 'answer' in g][0]['answer']",
    ):
        v = verify(d, f"<answer>{attack}</answer>")
        assert v.reward < 0.1 and gold not in v.details, (name, attack, v)


@pytest.mark.parametrize(
    "name,bomb",
    [
        ("countdown", "9**9**9"),
        ("polynomial_multiplication", "9**9**9"),
        ("spiral_matrix", "'x' * 10**10"),
        ("puzzle24", "[0] * 10**10"),
    ],
)
def test_limits_end_a_hostile_answer_and_the_next_one_scores(drawn, name, bomb):
    d = drawn[name]
    t0 = time.monotonic()
    v = verify(d, f"<answer>{bomb}</answer>")
    took = time.monotonic() - t0
    assert v.reward < 0.1 and took < LIMITS.wall_s + 3
    if v.status != "ok":  # a literal-only eval refuses the expression at once; sympy runs it to a limit
        assert v.status == "answer_limit"
    gold = verify(d, f"<answer>{d.hidden['answer']}</answer>")
    assert (gold.reward, gold.status) == (1.0, "ok")


def test_a_power_that_holds_the_gil_is_an_answer_limit_not_a_freeze(drawn):
    v = verify(drawn["countdown"], "<answer>9**9**9**9</answer>")
    assert v.status == "answer_limit" and v.reward == 0.0 and v.components["correct"] == 0.0


def test_math_answers_are_parsed_in_the_pool():
    def traj(text):
        return plain_traj(text, "math", {"gold": "\\frac{1}{2}"})

    assert verify_math(traj("The answer is \\boxed{0.5}")).reward == 1.0
    assert verify_math(traj("\\boxed{1/3}")).reward == 0.0
    marker = "/tmp/rlbus-answer-pool-math-marker"
    v = verify_math(traj(f"\\boxed{{open('{marker}','w').write('x')}}"))
    assert v.reward == 0.0 and not os.path.exists(marker)


def test_untrusted_plugins_run_in_the_pool():
    import answer_pool_plugin as plugin

    registry.register("ap_peek", plugin.env_peek, replace=True)
    registry.register("ap_spin", plugin.spin, replace=True)
    try:
        t = plain_traj("42", "ap_peek", {})
        v = registry.get("ap_peek")(t, {"gold": "42"})
        assert v.components == {"correct": 1.0, "saw_secret": 0.0} and v.details != f"pid={os.getpid()}"
        t0 = time.monotonic()
        spun = registry.get("ap_spin")(t)
        assert spun.status == "answer_limit" and spun.reward == 0.0 and time.monotonic() - t0 < LIMITS.wall_s + 3
    finally:
        registry.unregister("ap_peek")
        registry.unregister("ap_spin")


def test_child_env_keeps_no_secret_named_variable():
    env = answer_pool.child_env(
        {
            "PATH": "/bin",
            "RLBUS_NATS_PASSWORD": "x",
            "MY_API_KEY": "k",
            "LC_ALL": "C",
            "RLBUS_TOOL_SECRET": "s",
            "AWS_SESSION_TOKEN": "t",
            "PYTHONHASHSEED": "0",
        }
    )
    assert not any(w in k for k in env for w in answer_pool.SECRET_WORDS)
    assert env["LC_ALL"] == "C" and env["PYTHONHASHSEED"] == "0" and env["HOME"] == "/tmp"


def test_rlbus_verify_scores_a_stored_answer_through_the_pool(tmp_path):
    """`rlbus verify` (and `rlbus rescore`, through the same `worker.Scorer` -> `worker.score` ->
    registered verifier) replays answers on the operator's host: an attack answer gains nothing."""
    marker = tmp_path / "pwned"
    reply = tmp_path / "reply.txt"
    reply.write_text(f"<answer>open({str(marker)!r}, 'w').write('x')</answer>")
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("rlbus")),
            "verify",
            "--domain",
            "rg-string_insertion",
            "--seed",
            "0",
            "--index",
            "0",
            "--answer-file",
            str(reply),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["reward"] == 0.0 and not marker.exists()
