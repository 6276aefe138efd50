"""Learner units: group pooling (complete first, deadlines, duplicates, staleness), batch
packing (masks, behaviour log-probs, padding), and on-policy log-prob alignment between the
rollout engine and the learner (ratio == 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batch import pack_samples, token_logprobs
from learner.groups import GroupPool, PooledSample, split_stale
from schemas import Reward, Trajectory, Turn, pack_f32, pack_i32

RUN = "r1"
PAD = 0


def reward(
    group: str,
    index: int,
    *,
    size: int = 2,
    prompt=(5, 6, 7),
    comp=(8, 9),
    logp=None,
    version: int = 0,
    value: float = 1.0,
    task_msg_id: str | None = None,
) -> Reward:
    logp = [-0.1 * (k + 1) for k in range(len(comp))] if logp is None else logp
    traj = Trajectory(
        run_id=RUN,
        task_id=f"task-{group}",
        task_msg_id=task_msg_id or f"tm-{group}",
        domain="arith",
        group_id=group,
        group_size=size,
        sample_index=index,
        verifier="arith",
        policy_version=version,
        turns=[
            Turn(role="prompt", text="p", token_ids=pack_i32(prompt)),
            Turn(
                role="assistant",
                text="c",
                token_ids=pack_i32(comp),
                logprobs=pack_f32(logp),
                trainable=True,
                policy_version=version,
            ),
        ],
    )
    return Reward(run_id=RUN, trajectory=traj, reward=value)


def ps(*args, **kw) -> PooledSample:
    return PooledSample(reward(*args, **kw), raw=object())


# -- GroupPool ------------------------------------------------------------------------


def test_complete_groups_pop_first():
    pool = GroupPool(deadline_s=10.0)
    # an old partial group (past its deadline, 2 samples) and a newer complete one
    assert pool.add(ps("late", 0, size=4), now=0.0)
    assert pool.add(ps("late", 1, size=4), now=0.0)
    assert pool.add(ps("full", 0, size=2), now=5.0)
    assert pool.add(ps("full", 1, size=2), now=5.0)
    assert pool.count_ready(now=20.0) == 2
    ready, expired = pool.pop_ready(now=20.0, limit=1)
    assert [g.group_id for g in ready] == ["full"] and expired == []
    assert ready[0].complete and sorted(ready[0].samples) == [0, 1]
    assert ready[0].task_msg_id == "tm-full" and ready[0].size == 2
    ready, expired = pool.pop_ready(now=20.0, limit=5)
    assert [g.group_id for g in ready] == ["late"] and expired == []
    assert pool.pending() == []


def test_informative_only_fills_the_limit_with_groups_whose_rewards_differ():
    """DAPO dynamic sampling: the limit counts informative groups; all-equal ones come along to be filtered."""
    pool = GroupPool(deadline_s=10.0)
    for name, values in (
        ("same1", (1.0, 1.0)),
        ("mixed1", (0.0, 1.0)),
        ("same0", (0.0, 0.0)),
        ("mixed2", (1.0, 0.0)),
        ("mixed3", (0.0, 0.5)),
    ):
        for i, v in enumerate(values):
            pool.add(ps(name, i, size=2, value=v), now=0.0)
    assert pool.count_ready(now=1.0) == 5
    assert pool.count_ready(now=1.0, informative_only=True) == 3
    ready, expired = pool.pop_ready(now=1.0, limit=2, informative_only=True)
    assert [g.group_id for g in ready] == ["mixed1", "mixed2", "same1", "same0"] and expired == []
    assert [g.informative for g in ready] == [True, True, False, False]
    assert [g.group_id for g in pool.pending()] == ["mixed3"]
    assert pool.count_ready(now=1.0, informative_only=True) == 1


def test_complete_group_ready_before_deadline_partial_not():
    pool = GroupPool(deadline_s=10.0)
    pool.add(ps("a", 0, size=3), now=0.0)
    pool.add(ps("a", 1, size=3), now=0.0)
    assert pool.count_ready(now=9.9) == 0
    assert pool.pop_ready(now=9.9, limit=8) == ([], [])
    assert [g.group_id for g in pool.pending()] == ["a"]
    pool.add(ps("a", 2, size=3), now=1.0)
    ready, expired = pool.pop_ready(now=2.0, limit=8)
    assert [g.group_id for g in ready] == ["a"] and expired == []


def test_partial_group_with_two_samples_pops_after_deadline():
    pool = GroupPool(deadline_s=10.0)
    pool.add(ps("p", 0, size=8), now=100.0)
    pool.add(ps("p", 3, size=8), now=104.0)  # deadline counts from the first sample
    assert pool.pop_ready(now=109.9, limit=8) == ([], [])
    assert pool.count_ready(now=110.0) == 1
    ready, expired = pool.pop_ready(now=110.0, limit=8)
    assert [g.group_id for g in ready] == ["p"] and not ready[0].complete and expired == []
    assert sorted(ready[0].samples) == [0, 3]


def test_partial_group_with_one_sample_expires():
    pool = GroupPool(deadline_s=10.0)
    pool.add(ps("lonely", 0, size=4), now=0.0)
    pool.add(ps("young", 0, size=4), now=5.0)
    assert pool.count_ready(now=12.0) == 0
    ready, expired = pool.pop_ready(now=12.0, limit=8)
    assert ready == [] and [g.group_id for g in expired] == ["lonely"]
    assert [g.group_id for g in pool.pending()] == ["young"]  # not yet past its own deadline


def test_expired_groups_are_returned_even_when_limit_reached():
    pool = GroupPool(deadline_s=1.0)
    for g in ("c1", "c2"):
        pool.add(ps(g, 0, size=2), now=0.0)
        pool.add(ps(g, 1, size=2), now=0.0)
    pool.add(ps("e", 0, size=2), now=0.0)
    ready, expired = pool.pop_ready(now=5.0, limit=1)
    assert len(ready) == 1 and [g.group_id for g in expired] == ["e"]
    assert len(pool.pending()) == 1  # the other complete group waits for the next step


def test_duplicate_sample_rejected():
    pool = GroupPool(deadline_s=10.0)
    first = ps("d", 0, size=2, value=1.0)
    assert pool.add(first, now=0.0)
    assert not pool.add(ps("d", 0, size=2, value=0.0), now=1.0)  # redelivery / re-verification
    assert len(pool.pending()[0].samples) == 1
    assert pool.pending()[0].samples[0] is first
    assert pool.add(ps("d", 1, size=2), now=1.0)
    ready, _ = pool.pop_ready(now=1.0, limit=8)
    assert len(ready) == 1 and len(ready[0].samples) == 2
    assert ready[0].samples[0].reward.reward == 1.0


def test_split_stale():
    pool = GroupPool(deadline_s=10.0)
    for i, v in enumerate([10, 6, 5, 4]):
        pool.add(ps("s", i, size=4, version=v), now=0.0)
    (group,), _ = pool.pop_ready(now=0.0, limit=1)
    stale = split_stale(group, current_version=10, max_staleness=4)
    # 10-6=4 is allowed, 10-5=5 and 10-4=6 are stale
    assert sorted(s.key for s in stale) == [("s", 2), ("s", 3)]
    assert sorted(group.samples) == [0, 1]
    assert split_stale(group, current_version=10, max_staleness=4) == []
    assert len(split_stale(group, current_version=10, max_staleness=0)) == 1
    assert sorted(group.samples) == [0]


# -- pack_samples ---------------------------------------------------------------------


def test_pack_samples_masks_and_alignment():
    rs = [
        reward("g1", 0, prompt=[10, 11, 12], comp=[20, 21], logp=[-1.0, -2.0], value=1.0),
        reward("g1", 1, prompt=[10, 11, 12], comp=[22, 23, 24, 25], logp=[-3.0, -4.0, -5.0, -6.0], value=0.0),
        reward("g2", 0, prompt=[30], comp=[31], logp=[-7.0], value=0.5),
    ]
    b = pack_samples(rs, pad_id=PAD)
    ids, attn, mask, behav = b["input_ids"], b["attention_mask"], b["loss_mask"], b["behavior_logp"]
    assert ids.shape == (3, 7) and attn.shape == (3, 7)
    assert mask.shape == (3, 6) and behav.shape == (3, 6)
    assert ids.dtype == torch.long and mask.dtype == torch.float32 and behav.dtype == torch.float32
    assert ids.tolist() == [
        [10, 11, 12, 20, 21, PAD, PAD],
        [10, 11, 12, 22, 23, 24, 25],
        [30, 31, PAD, PAD, PAD, PAD, PAD],
    ]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7, [1, 1, 0, 0, 0, 0, 0]]
    # position t scores token t+1: completion of prompt length p and c tokens -> positions p-1..p+c-2
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]
    assert behav.tolist() == [[0, 0, -1.0, -2.0, 0, 0], [0, 0, -3.0, -4.0, -5.0, -6.0], [-7.0, 0, 0, 0, 0, 0]]
    # the masked targets are exactly the completion tokens
    targets = ids[:, 1:]
    assert targets[mask.bool()].tolist() == [20, 21, 22, 23, 24, 25, 31]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert b["group_ids"].tolist() == [0, 0, 1]


def test_pack_samples_group_ids_follow_first_appearance():
    rs = [reward("zz", 0), reward("aa", 0), reward("zz", 1), reward("mm", 0)]
    assert pack_samples(rs, pad_id=PAD)["group_ids"].tolist() == [0, 1, 0, 2]


# -- on-policy alignment: engine logprobs == learner logprobs ---------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rlbus.model.tiny_model import build_tiny_model
    from rollout_workers.engines.hf_engine import HFEngine

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1, num_heads=2)
    return HFEngine(str(path), threads=1)


def test_learner_logprobs_equal_engine_behaviour_logprobs(engine):
    torch.manual_seed(0)
    # prompts of different lengths: the engine left-pads them, the learner right-pads
    prompts = ["1+2=", "12+34=", "7*8-9="]
    groups = engine.generate(prompts, n=3, max_new_tokens=6, temperature=1.0)
    rs, samples = [], []
    for g, group in enumerate(groups):
        for j, s in enumerate(group):
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert s.prompt_ids.tolist() == engine.tokenizer.encode(prompts[g], add_special_tokens=False)
            rs.append(reward(f"g{g}", j, size=3, prompt=s.prompt_ids, comp=s.token_ids, logp=s.logprobs))
            samples.append(s)
    batch = pack_samples(rs, pad_id=engine.pad_id)
    with torch.no_grad():
        new = token_logprobs(engine.model, batch["input_ids"], batch["attention_mask"])
    mask = batch["loss_mask"].bool()
    assert new.shape == mask.shape
    assert int(mask.sum()) == sum(len(s.token_ids) for s in samples)
    torch.testing.assert_close(new[mask], batch["behavior_logp"][mask], atol=1e-4, rtol=0)
    assert torch.all(new[mask] < 0)
    ratio = torch.exp(new[mask] - batch["behavior_logp"][mask])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
    # the check has teeth: shifting the behaviour log-probs by one position breaks it
    shifted = torch.roll(batch["behavior_logp"], 1, dims=1)
    assert not torch.allclose(new[mask], shifted[mask], atol=1e-4)


def test_pack_samples_keeps_multi_turn_order():
    """prompt [1,2] -> assistant [3] -> tool [4,5] -> assistant [6]: tokens stay in episode
    order and only the two assistant turns are in the loss, with their own log-probs."""
    turns = [
        Turn(role="prompt", text="p", token_ids=pack_i32([1, 2])),
        Turn(
            role="assistant",
            text="a",
            token_ids=pack_i32([3]),
            logprobs=pack_f32([-0.5]),
            trainable=True,
            policy_version=0,
        ),
        Turn(role="tool", text="t", token_ids=pack_i32([4, 5])),
        Turn(
            role="assistant",
            text="b",
            token_ids=pack_i32([6]),
            logprobs=pack_f32([-0.25]),
            trainable=True,
            policy_version=0,
        ),
    ]
    traj = Trajectory(
        run_id="r",
        task_id="t",
        task_msg_id="m",
        domain="arith",
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=turns,
        verifier="arith",
        policy_version=0,
    )
    b = pack_samples([Reward(run_id="r", trajectory=traj, reward=1.0)], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    # position t scores token t+1: token 3 is scored at 1, token 6 at 4
    assert b["loss_mask"].tolist() == [[0.0, 1.0, 0.0, 0.0, 1.0]]
    assert b["behavior_logp"].tolist() == [[0.0, -0.5, 0.0, 0.0, -0.25]]


@pytest.mark.parametrize("objective", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_every_objective_runs_a_step_on_a_tiny_model(engine, objective):
    """Each configured objective yields a finite loss whose gradient reaches the model."""
    from learner.batch import grpo_loss

    prompt = engine.tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    rewards = [reward("g", i, size=4, prompt=prompt, comp=(5 + i, 1), value=float(i % 2)) for i in range(4)]
    batch = pack_samples(rewards, PAD)
    engine.model.zero_grad()
    loss, stats, adv = grpo_loss(
        engine.model,
        engine.model,
        batch,
        beta=0.1,
        clip_low=0.2,
        clip_high=0.28,
        normalize_std=True,
        objective=objective,
        kl="k1",
    )
    loss.backward()
    assert torch.isfinite(loss) and stats.tokens == 8
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in engine.model.parameters())
    if objective == "dr_grpo":
        assert adv.abs().max().item() == pytest.approx(0.5)  # no std normalisation


# -- learner.skipped_keep_scale ---------------------------------------------------------


def test_skipped_loss_scale_by_objective():
    """Hand-computed: 2 trained samples of 2 and 3 tokens, 2 skipped of 4 and 1 tokens."""
    from learner.step import skipped_loss_scale

    trained = [reward("a", 0, comp=(8, 9)), reward("a", 1, comp=(8, 9, 10))]
    skipped = [reward("b", 0, comp=(8, 9, 10, 11), value=0.0), reward("b", 1, comp=(8,), value=0.0)]
    assert skipped_loss_scale("dapo", trained, skipped) == pytest.approx(5 / 10)  # tokens
    for kind in ("grpo", "gspo", "dr_grpo"):
        assert skipped_loss_scale(kind, trained, skipped) == pytest.approx(2 / 4)  # sequences
    assert skipped_loss_scale("dapo", trained, []) == 1.0


def test_hf_engine_greedy_with_several_samples_gives_identical_samples(tmp_path):
    """HF `generate` refuses num_return_sequences > 1 without sampling; the engine runs each prompt n times."""
    from rlbus.model.tiny_model import build_tiny_model
    from rollout_workers.engines.hf_engine import HFEngine

    engine = HFEngine(str(build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)))
    groups = engine.generate(["12+3=", "7+5="], 3, 5, 0.0)
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(["12+3=", "7+5="], groups, strict=True):
        assert group[0].prompt_ids.tolist() == engine.encode(prompt).tolist()
        assert all(s.token_ids.tolist() == group[0].token_ids.tolist() for s in group)
        assert all(np.allclose(s.logprobs, group[0].logprobs) for s in group)
