"""The reasoning-gym family with the real `reasoning_gym` package: config expansion, the
`reasoning_gym` domain kind and verifier, the eval slice, the CLI, and every dataset."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from producers.demos import domain_demos
from producers.domains import DomainUnavailable, TaskSkipped, make_source, make_sources
from producers.domains.reasoning_gym import ATTEMPTS, INSTRUCTION
from producers.eval_set import in_eval_slice
from producers.sampler import make_tasks, skip_counts
from schemas import Trajectory, Turn
from schemas import rg_family as rg
from schemas.answers import tagged_answer
from schemas.config import ConfigError, dump_config, load_config
from verifier_workers import registry
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verdict import VerifierInputError
from verifier_workers.verifiers.reasoning_gym import verify_reasoning_gym

RLBUS = Path(sys.executable).with_name("rlbus")
ROOT = Path(__file__).resolve().parents[1]
SET = "sampler.domain_sets.reasoning_gym"
EASY = ["basic_arithmetic", "leg_counting", "chain_sum", "gcd", "count_bits", "spell_backward"]


def rg_config(*overrides: str, include=None):
    items = [f"{SET}.include={json.dumps(include or EASY)}", *overrides]
    return load_config(None, items)


def traj_for(drawn, text: str) -> Trajectory:
    return Trajectory.from_task(drawn.task, 0, [Turn(role="assistant", text=text)])


def wire(hidden: dict) -> dict:
    """The hidden payload as a verifier gets it back from the KV bucket (msgpack)."""
    return msgpack.unpackb(msgpack.packb(hidden, use_bin_type=True), raw=False)


@pytest.fixture(scope="module")
def easy():
    cfg = rg_config(f"{SET}.heldout=['lcm']")
    sources, disabled = make_sources("r1", cfg)
    assert disabled == {}
    return cfg, sources


# --- config expansion -------------------------------------------------------------------


def test_include_exclude_heldout_overrides_expand_into_domains():
    cfg = rg_config(
        f"{SET}.exclude=['gc*']",
        f"{SET}.heldout=['lcm']",
        f"{SET}.weight=0.5",
        f"{SET}.max_tokens=48",
        f"{SET}.overrides={{leg_counting={{weight=2.0, min_level=2, max_level=4, start_level=3, "
        f"params={{range_mode='upper_bound'}}}}}}",
    )
    doms = cfg.sampler.domains
    assert set(doms) == {rg.domain_name(n) for n in EASY if n != "gcd"} | {"rg-lcm"}  # no default arith either
    for name, dc in doms.items():
        assert dc.kind == "reasoning_gym" and dc.params["dataset"] == rg.dataset_of(name)
        assert dc.max_tokens == 48 and dc.heldout == (name == "rg-lcm")
    leg = doms["rg-leg_counting"]
    assert (leg.weight, leg.min_level, leg.max_level, leg.initial_level) == (2.0, 2, 4, 3)
    assert leg.params["range_mode"] == "upper_bound"
    assert doms["rg-chain_sum"].weight == 0.5 and doms["rg-chain_sum"].min_level == 1
    assert doms["rg-chain_sum"].max_level == len(rg.levels("chain_sum")) > 1


def test_star_takes_every_dataset_but_the_explicit_only_and_unusable_ones():
    doms = load_config(None, [f"{SET}.include=['*']"]).sampler.domains
    expected = {n for n in rg.dataset_names() if n not in rg.EXPLICIT_ONLY and rg.levels(n)}
    assert {rg.dataset_of(d) for d in doms} == expected
    assert "rg-composite" not in doms and "rg-sokoban" not in doms and "rg-knight_swap" not in doms
    assert len(doms) > 95
    assert "rg-sokoban" in rg_config(include=["sokoban"]).sampler.domains  # named, it is included


def test_domain_set_with_explicit_domains_keeps_them_and_reloads_unchanged(tmp_path):
    cfg = rg_config("sampler.domains.arith={}")
    assert "arith" in cfg.sampler.domains and "rg-gcd" in cfg.sampler.domains
    dump_config(cfg, tmp_path / "c.json")
    again = load_config(tmp_path / "c.json")
    assert again.model_dump() == cfg.model_dump()
    with pytest.raises(ConfigError, match="overrides instead"):
        rg_config("sampler.domains.rg-gcd={kind='reasoning_gym', weight=3.0, params={dataset='gcd'}}")


@pytest.mark.parametrize(
    "field, value, wanted",
    [
        ("include", "['leg_countin']", "leg_counting"),
        ("exclude", "['basic_arithmatic']", "basic_arithmetic"),
        ("heldout", "['chainsum']", "chain_sum"),
        ("overrides", "{spel_backward={weight=2.0}}", "spell_backward"),
    ],
)
def test_unknown_dataset_names_the_closest(field, value, wanted):
    with pytest.raises(ConfigError, match=rf"{field}: unknown dataset .*closest: .*{wanted}"):
        rg_config(f"{SET}.{field}={value}")


def test_bad_sets_are_config_errors():
    with pytest.raises(ConfigError, match="selects no dataset"):
        rg_config(f"{SET}.exclude=['*']")
    with pytest.raises(ConfigError, match="matches no dataset"):
        rg_config(include=["nothing_like_it*"])
    with pytest.raises(ConfigError, match="not selected by include"):
        rg_config(f"{SET}.overrides={{lcm={{weight=2.0}}}}")
    with pytest.raises(ConfigError, match=r"max_level 99 > the dataset's \d+ levels"):
        rg_config(f"{SET}.overrides={{gcd={{max_level=99}}}}")
    with pytest.raises(ConfigError, match=r"\['kind'\] are set by the domain set"):
        rg_config(f"{SET}.overrides={{gcd={{kind='math'}}}}")
    with pytest.raises(ConfigError, match="knight_swap.*no level whose config validates.*range_mode"):
        rg_config(include=["knight_swap"])


def test_domain_names_are_single_subject_tokens_and_invert():
    names = [rg.domain_name(n) for n in rg.dataset_names()]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"rg-[A-Za-z0-9_-]+", d) for d in names)
    assert all(rg.dataset_of(rg.domain_name(n)) == n for n in rg.dataset_names())
    assert rg.domain_name("a.b c/d*") == "rg-a_b_c_d_" and rg.dataset_of("rg-no_such") is None


# --- tasks --------------------------------------------------------------------------------


def test_tasks_are_a_function_of_seed_level_index(easy):
    cfg, _ = easy
    a, b = make_source("r1", "rg-leg_counting", cfg), make_source("r2", "rg-leg_counting", cfg)
    q = lambda src, lvl, i: src.make_task(random.Random(i * 7), lvl, i).task.prompt[0].content
    assert q(a, 2, 5) == q(b, 2, 5) == q(a, 2, 5)
    assert len({q(a, 2, i) for i in range(8)}) == 8
    other = make_source("r1", "rg-leg_counting", rg_config("run.seed=9"))
    assert q(other, 2, 5) != q(a, 2, 5)


def test_levels_follow_the_dataset_curriculum(easy):
    cfg, sources = easy
    low, high = rg.dataset_config("leg_counting", 1), rg.dataset_config("leg_counting", 8)
    assert (low.max_animals, low.max_instances) < (high.max_animals, high.max_instances)
    assert rg.levels("acre") == (None,)  # no curriculum: one level
    src = sources["rg-leg_counting"]
    hi = [src.make_task(random.Random(0), 8, i).hidden["metadata"]["num_animals"] for i in range(20)]
    lo = [src.make_task(random.Random(0), 1, i).hidden["metadata"]["num_animals"] for i in range(20)]
    assert max(lo) < max(hi)
    assert src.make_task(random.Random(0), 3, 0).task.difficulty == 3


def test_hidden_holds_answer_and_metadata_and_the_task_only_the_prompt(easy):
    _, sources = easy
    d = sources["rg-basic_arithmetic"].make_task(random.Random(0), 2, 11)
    assert set(d.hidden) >= {"dataset", "question", "answer", "metadata"} and d.hidden["answer"]
    assert d.hidden["metadata"]["source_dataset"] == "basic_arithmetic"
    t = d.task
    assert t.verifier == "reasoning_gym" and t.verifier_params == {} and t.hidden_ref
    assert [m.role for m in t.prompt] == ["user"]
    assert t.prompt[0].content == f"{d.hidden['question'].rstrip()}\n\n{INSTRUCTION}"
    dumped = t.model_dump(mode="json")
    assert "answer" not in dumped and "metadata" not in json.dumps(dumped)
    assert wire(d.hidden) == json.loads(json.dumps(d.hidden))  # JSON- and msgpack-safe


def test_metadata_packing_restores_what_scorers_compare():
    meta = {"grid": ((1, 2), (3, 4)), "seen": {3, 1}, "by_int": {1: "a"}, "plain": [1, {"x": (5,)}]}
    packed = wire(rg.pack(meta))
    json.dumps(packed)
    assert rg.unpack(packed) == meta and isinstance(rg.unpack(packed)["grid"][0], tuple)
    assert rg.jsonable(meta) == {
        "grid": [[1, 2], [3, 4]],
        "seen": [1, 3],
        "by_int": {"1": "a"},
        "plain": [1, {"x": [5]}],
    }


def test_a_dataset_that_fails_at_start_is_disabled_and_the_rest_go_on():
    cfg = rg_config(f"{SET}.overrides={{leg_counting={{params={{config={{max_instances=2.5}}}}}}}}")
    with pytest.raises(DomainUnavailable, match="leg_counting"):
        make_source("r1", "rg-leg_counting", cfg)
    sources, disabled = make_sources("r1", cfg)
    assert list(disabled) == ["rg-leg_counting"] and "non-integer" in disabled["rg-leg_counting"]
    assert set(sources) == set(cfg.sampler.domains) - {"rg-leg_counting"}
    assert sources["rg-gcd"].make_task(random.Random(0), 1, 0).task.domain == "rg-gcd"
    names = [s.ctx.name for s in domain_demos(cfg).sources]
    assert "rg-leg_counting" not in names and "rg-gcd" in names


def test_too_long_prompts_are_skipped_and_counted_never_truncated(easy):
    cfg = rg_config(f"{SET}.overrides={{leg_counting={{params={{max_prompt_chars=10}}}}}}")
    src = make_source("r1", "rg-leg_counting", cfg)
    with pytest.raises(TaskSkipped, match="no_usable_draw"):
        src.make_task(random.Random(0), 1, 0)
    assert src.skipped["prompt_too_long"] + src.skipped["eval_slice"] == ATTEMPTS
    sources = {"rg-leg_counting": src, "rg-gcd": make_source("r1", "rg-gcd", cfg)}
    weights = {"rg-leg_counting": 1.0, "rg-gcd": 4.0}
    drawn = make_tasks(
        sources, random.Random(0), 0, {"short": 6}, 6, weights, {d: 1 for d in weights}, {d: "short" for d in weights}
    )
    assert len(drawn) == 6 and {d.task.domain for d in drawn} == {"rg-gcd"}
    assert skip_counts(sources)["skipped_prompt_too_long"] == src.skipped["prompt_too_long"] >= 1


# --- the verifier ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["rg-basic_arithmetic", "rg-leg_counting", "rg-chain_sum", "rg-gcd", "rg-count_bits", "rg-spell_backward"]
)
def test_gold_scores_one_and_wrong_less(easy, name):
    _, sources = easy
    d = sources[name].make_task(random.Random(0), 2 if name != "rg-spell_backward" else 1, 3)
    gold = d.hidden["answer"]
    verify = registry.get("reasoning_gym")
    ok = verify(traj_for(d, f"Let me think.\n<answer>{gold}</answer>"), wire(d.hidden))
    assert (ok.components, ok.status, ok.reward) == ({"correct": 1.0, "answer_found": 1.0}, "ok", 1.0)
    assert verify(traj_for(d, f"<answer>wrong</answer> then <answer>{gold}</answer>"), wire(d.hidden)).reward == 1.0
    assert verify(traj_for(d, f"reasoning...\n{gold}\n"), wire(d.hidden)).reward == 1.0  # the final line
    bad = verify(traj_for(d, "<answer>not it, surely 123456789</answer>"), wire(d.hidden))
    assert bad.reward < 1.0 and bad.components["answer_found"] == 1.0


def test_partial_credit_and_no_answer(easy):
    _, sources = easy
    d = sources["rg-leg_counting"].make_task(random.Random(0), 1, 0)
    partial = verify_reasoning_gym(traj_for(d, f"<answer>{d.hidden['answer']} legs</answer>"), wire(d.hidden))
    assert 0.0 < partial.reward < 1.0
    for text in ("", "   \n\n", "<answer></answer>"):
        v = verify_reasoning_gym(traj_for(d, text), wire(d.hidden))
        assert (v.reward, v.status, v.components["answer_found"]) == (0.0, "ok", 0.0)


def test_a_scorer_that_raises_is_infra_never_a_zero(easy):
    _, sources = easy
    d = sources["rg-leg_counting"].make_task(random.Random(0), 1, 0)
    broken = {**wire(d.hidden), "answer": None}  # the dataset's scorer raises TypeError on it
    with pytest.raises(VerifierInfraError, match="leg_counting.*raised"):
        verify_reasoning_gym(traj_for(d, "<answer>3</answer>"), broken)
    with pytest.raises(VerifierInfraError, match="unknown to this node"):
        verify_reasoning_gym(traj_for(d, "<answer>3</answer>"), {**wire(d.hidden), "dataset": "no_such_dataset"})
    with pytest.raises(VerifierInputError):
        verify_reasoning_gym(traj_for(d, "<answer>3</answer>"), None)


def test_an_answer_the_scorer_chokes_on_is_the_policys_zero_not_infra():
    """prime_factorization's scorer raises on "7 91 4U" (int()), yet takes the gold answer: a malformed answer."""
    cfg = rg_config(include=["prime_factorization"])
    d = make_source("r", "rg-prime_factorization", cfg).make_task(random.Random(0), 1, 0)
    v = verify_reasoning_gym(traj_for(d, "<answer>7 91 4U, 0</answer>"), wire(d.hidden))
    assert v.components == {"correct": 0.0, "answer_found": 1.0, "answer_rejected": 1.0}
    assert (
        verify_reasoning_gym(traj_for(d, f"<answer>{d.hidden['answer']}</answer>"), wire(d.hidden)).components[
            "correct"
        ]
        == 1.0
    )


def test_tagged_answer_rule():
    assert tagged_answer("a <answer>1</answer> b <answer> 2 </answer> c") == "2"
    assert tagged_answer("work\n\n  7  \n") == "7"
    assert tagged_answer("so <answer>41") == "41"  # cut by the token budget
    assert tagged_answer("") is None and tagged_answer("<answer> </answer>") is None


# --- eval slice, demonstrations -----------------------------------------------------------------


def test_eval_problems_are_fixed_and_disjoint_from_training(easy):
    cfg, sources = easy
    src = sources["rg-chain_sum"]
    ev = src.eval_problems(30, seed=1234)
    assert 0 < len(ev) <= 30 and len(ev) <= cfg.sampler.domains["rg-chain_sum"].params["eval_n"]
    assert [d.task.prompt for d in ev] == [
        d.task.prompt for d in make_source("x", "rg-chain_sum", cfg).eval_problems(30, 1234)
    ]
    hashes = {rg.content_hash(d.hidden["question"]) for d in ev}
    assert len(hashes) == len(ev) and all(in_eval_slice(h) for h in hashes)
    assert len({d.task.hidden_ref for d in ev}) == len(ev)
    train = {rg.content_hash(src.make_task(random.Random(0), 1, i).hidden["question"]) for i in range(400)}
    assert not train & hashes and not any(in_eval_slice(h) for h in train)
    assert src.skipped["eval_slice"] > 0  # the slice was met and skipped, not just missed
    assert {d.task.verifier for d in ev} == {"reasoning_gym"} and all(d.hidden["answer"] for d in ev)


def test_demonstrations_are_gold_answers_and_no_gold_datasets_opt_out(easy):
    cfg, sources = easy
    demo = sources["rg-leg_counting"].demonstration(random.Random(3), 2)
    (prompt, p_train), (completion, c_train) = demo
    assert not p_train and c_train and prompt.endswith(INSTRUCTION)
    assert re.fullmatch(r"<answer>\d+</answer>", completion)
    mixed = rg_config(include=["gcd", "rush_hour"])
    assert not make_source("r1", "rg-rush_hour", mixed).demonstrable
    assert [s.ctx.name for s in domain_demos(mixed).sources] == ["rg-gcd"]
    assert "rg-lcm" not in [s.ctx.name for s in domain_demos(cfg).sources]  # heldout: never demonstrated


def test_a_domain_with_no_demonstrable_prompt_is_dropped_from_sft_and_the_others_go_on():
    """Every prompt of rg-leg_counting over max_prompt_chars: its demonstrations fail, SFT goes on with gcd."""
    cfg = rg_config(f"{SET}.max_prompt_chars=140", include=["gcd", "leg_counting"])  # gcd: ~105 chars, legs 167+
    demos = domain_demos(cfg)
    assert sorted(s.ctx.name for s in demos.sources) == ["rg-gcd", "rg-leg_counting"]
    stream = demos.batches(0, 2)
    batches = [next(stream) for _ in range(6)]
    assert all(len(b) == 2 and b[0][1][1] for b in batches)  # gold-answer completions, all from rg-gcd


# --- CLI ------------------------------------------------------------------------------------------


def rlbus(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(RLBUS), *args], capture_output=True, text=True, timeout=180, input=stdin, cwd=ROOT)


def test_tasks_show_prints_the_sampler_task(easy):
    cfg, _ = easy
    p = rlbus(
        "tasks",
        "show",
        "--domain",
        "rg-leg_counting",
        "--seed",
        "0",
        "--index",
        "5",
        "--level",
        "2",
        "--hidden",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"task", "hidden"} and {"answer", "metadata"} <= set(out["hidden"])
    mine = make_source("r", "rg-leg_counting", cfg).make_task(random.Random(0), 2, 5)
    assert out["task"]["prompt"][0]["content"] == mine.task.prompt[0].content
    assert out["task"]["task_id"] == mine.task.task_id and out["hidden"]["answer"] == mine.hidden["answer"]
    assert "msg_id" not in out["task"] and "answer" not in out["task"]
    p = rlbus("tasks", "show", "--domain", "rg-leg_counting", "--index", "5", "--json")
    start = json.loads(p.stdout)["task"]
    assert set(json.loads(p.stdout)) == {"task"} and start["difficulty"] == 1  # the start level
    p = rlbus("tasks", "show", "--domain", "rg-leg_countin")
    assert p.returncode == 2 and "rg-leg_counting" in p.stderr
    p = rlbus("tasks", "show", "--domain", "rg-gcd", "--level", "99")
    assert p.returncode == 2 and "outside" in p.stderr


def test_verify_domain_scores_a_reply_to_that_task(tmp_path):
    show = json.loads(
        rlbus("tasks", "show", "--domain", "rg-chain_sum", "--seed", "4", "--index", "2", "--hidden", "--json").stdout
    )
    gold = show["hidden"]["answer"]
    f = tmp_path / "reply.txt"
    for reply, reward, found in (
        (f"sum it\n<answer>{gold}</answer>", 1.0, 1.0),
        ("<answer>x</answer>", 0.0, 1.0),
        ("", 0.0, 0.0),
    ):
        f.write_text(reply)
        p = rlbus("verify", "--domain", "rg-chain_sum", "--seed", "4", "--index", "2", "--answer-file", str(f))
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert {"reward", "components", "status"} <= set(out) and out["status"] == "ok"
        assert out["reward"] == reward and out["components"]["answer_found"] == found
    p = rlbus("verify", "--domain", "arith", "--task-id", "2+3", "--answer-file", "-", stdin="5")
    assert p.returncode == 0 and json.loads(p.stdout)["reward"] == 1.0  # verify's other uses unchanged


# --- every dataset -------------------------------------------------------------------------------


def test_every_dataset_scores_its_own_gold_or_is_documented():
    """Each dataset builds through the family and scores its own gold 1.0 after the hidden
    payload's msgpack round trip, or is listed (with why) in `rg_family.NEEDS_CARE`."""
    names = rg.dataset_names()
    assert set(rg.NEEDS_CARE) <= set(names) and len(names) > 100
    usable = [n for n in names if n not in rg.EXPLICIT_ONLY and rg.levels(n)]
    cfg = rg_config(include=usable)
    sources, disabled = make_sources("all", cfg)
    assert disabled == {}
    failures = {}
    for name, src in sources.items():
        for i in range(2):
            d = src.make_task(random.Random(0), 1, i)
            if not isinstance(d.hidden["answer"], str):
                failures[name] = "no gold"
                continue
            v = verify_reasoning_gym(traj_for(d, f"<answer>{d.hidden['answer']}</answer>"), wire(d.hidden))
            if v.reward != 1.0:
                failures[name] = f"gold scored {v.reward}"
    undocumented = {d: why for d, why in failures.items() if rg.dataset_of(d) not in rg.NEEDS_CARE}
    assert undocumented == {}
    no_gold = {rg.dataset_of(d) for d, why in failures.items() if why == "no gold"}
    assert all("no single gold" in rg.NEEDS_CARE[n] for n in no_gold)
    assert {n for n in names if not rg.levels(n)} <= set(rg.NEEDS_CARE)


HASH_PROBE = """
import hashlib, json, random, sys
from schemas import rg_family as rg
from producers.domains import make_sources
from schemas.config import load_config
names = json.loads(sys.argv[1])
cfg = load_config(None, ["sampler.domain_sets.reasoning_gym.include=" + json.dumps(names)])
import contextlib
with contextlib.redirect_stdout(sys.stderr):
    sources, _ = make_sources("p", cfg)
    out = {d: hashlib.sha256(src.make_task(random.Random(0), 1, 0).hidden["question"].encode()).hexdigest()
           for d, src in sources.items()}
print(json.dumps(out))
"""


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
def test_generation_is_reproducible_across_processes_except_the_documented():
    """Two processes with different str hash seeds make the same tasks, except for the
    datasets NEEDS_CARE says depend on hash order."""
    order_bound = {n for n, why in rg.NEEDS_CARE.items() if "PYTHONHASHSEED" in why}
    names = [n for n in rg.dataset_names() if n not in rg.EXPLICIT_ONLY and rg.levels(n) and n not in order_bound]
    runs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        p = subprocess.run(
            [sys.executable, "-c", HASH_PROBE, json.dumps(names)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert len(runs[0]) == len(names)
    assert {d for d in runs[0] if runs[0][d] != runs[1][d]} == set()


# --- the sampler process on a real bus ----------------------------------------------------------


@pytest.mark.usefixtures("drop_run")
async def test_sampler_publishes_rg_tasks_whose_hidden_gold_the_verifier_scores(js, nats_url, run_id, tmp_path):
    """The sampler process disables a domain that fails at start, publishes the others' tasks
    (never a held-out domain's), stores their hidden payloads, and a verifier worker's scoring
    of each gold reply from the bucket is 1.0."""
    import asyncio

    from bus.conn import ensure_topology
    from bus.hidden import get_hidden
    from bus.session import WorkerContext
    from bus.streams import iter_stream
    from bus.subjects import Registry
    from producers.sampler import run
    from schemas import Task, decode
    from verifier_workers.worker import score

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    cfg = rg_config(
        f"{SET}.heldout=['lcm']",
        "sampler.publish_batch=4",
        f"{SET}.overrides={{leg_counting={{params={{config={{max_instances=2.5}}}}}}}}",
    )
    counters = await asyncio.wait_for(
        run(cfg, WorkerContext(run_id=run_id, nats_url=nats_url, run_path=tmp_path, max_messages=8)), 120
    )
    assert counters["published"] == 8 and counters["domains_disabled"] == 1
    tasks = [decode(d, Task) async for _, d in iter_stream(js, reg.stream("TASKS"), reg.all("tasks"))]
    assert len(tasks) == 8 and not {t.domain for t in tasks} & {"rg-leg_counting", "rg-lcm"}
    for t in tasks:
        hidden = await get_hidden(js, reg, t.hidden_ref)
        reward = score(
            Trajectory.from_task(t, 0, [Turn(role="assistant", text=f"<answer>{hidden['answer']}</answer>")]), hidden
        )
        assert (reward.reward, reward.status, reward.components["correct"]) == (1.0, "ok", 1.0), t.domain
