"""`learner.groups.partition`: which popped samples train, which tasks are filtered (and
why), and which messages are acked, decided from plain data (no bus, no model)."""

from __future__ import annotations

from learner.groups import Group, GroupPool, PooledSample, partition
from schemas import Reward, Trajectory, Turn, pack_f32, pack_i32

RUN = "r1"


class Raw:
    """Stands in for a nats Msg: `partition` only collects it, never calls it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Raw({self.name})"


def sample(group: str, index: int, *, size: int = 2, value: float = 1.0, version: int = 0) -> PooledSample:
    traj = Trajectory(
        run_id=RUN,
        task_id=f"task-{group}",
        task_msg_id=f"tm-{group}",
        domain="arith",
        group_id=group,
        group_size=size,
        sample_index=index,
        verifier="arith",
        policy_version=version,
        turns=[
            Turn(role="prompt", text="p", token_ids=pack_i32([5, 6])),
            Turn(
                role="assistant",
                text="c",
                token_ids=pack_i32([7]),
                logprobs=pack_f32([-0.1]),
                trainable=True,
                policy_version=version,
            ),
        ],
    )
    return PooledSample(
        Reward(run_id=RUN, trajectory=traj, reward=value, msg_id=f"rw-{group}-{index}"), raw=Raw(f"{group}-{index}")
    )


def group(name: str, values: list[float], *, size: int | None = None, versions: list[int] | None = None) -> Group:
    versions = versions or [0] * len(values)
    size = len(values) if size is None else size
    g = Group(name, f"tm-{name}", size, first_seen=0.0)
    for i, (v, ver) in enumerate(zip(values, versions, strict=True)):
        g.samples[i] = sample(name, i, size=size, value=v, version=ver)
    return g


def split(ready, expired=(), version=0, max_staleness=4, skip_zero_variance=False):
    return partition(
        list(ready), list(expired), version, max_staleness=max_staleness, skip_zero_variance=skip_zero_variance
    )


def fate_of(part, task_msg_id):
    (fate,) = [f for f in part.fates if f.task_msg_id == task_msg_id]
    return fate


def names(raws):
    return [r.name for r in raws]


def test_group_whose_rewards_differ_trains_and_all_its_messages_are_acked():
    part = split([group("a", [0.0, 1.0, 0.5])])
    assert [g.group_id for g in part.train] == ["a"]
    assert sorted(part.train[0].samples) == [0, 1, 2]
    fate = fate_of(part, "tm-a")
    assert fate.fate == "trained" and fate.reason == ""
    assert fate.reward_msg_ids == ["rw-a-0", "rw-a-1", "rw-a-2"]
    assert names(part.to_ack) == ["a-0", "a-1", "a-2"]
    assert part.skipped == [] and part.stale_samples == 0


def test_expired_partial_group_is_filtered_with_its_reason_and_acked():
    lonely = group("late", [1.0], size=4)
    part = split([], expired=[lonely])
    assert part.train == []
    fate = fate_of(part, "tm-late")
    assert fate.fate == "filtered" and fate.reason == "partial group with < 2 samples after deadline"
    assert fate.reward_msg_ids == []
    assert names(part.to_ack) == ["late-0"]


def test_group_left_with_one_fresh_sample_is_filtered_as_stale():
    # version 10, max_staleness 4: policy version 5 is 5 behind (stale), 6 is 4 behind (fresh)
    part = split([group("s", [0.0, 1.0], versions=[5, 6])], version=10, max_staleness=4)
    assert part.train == []
    fate = fate_of(part, "tm-s")
    assert fate.fate == "filtered" and fate.reason == "stale"
    assert part.stale_samples == 1
    assert sorted(names(part.to_ack)) == ["s-0", "s-1"]


def test_staleness_bound_is_inclusive():
    part = split([group("edge", [0.0, 1.0], versions=[6, 6])], version=10, max_staleness=4)
    assert [g.group_id for g in part.train] == ["edge"] and part.stale_samples == 0


def test_stale_samples_are_dropped_from_a_group_that_still_trains():
    part = split([group("m", [0.0, 1.0, 0.5], versions=[1, 9, 9])], version=10, max_staleness=4)
    assert [g.group_id for g in part.train] == ["m"]
    assert sorted(part.train[0].samples) == [1, 2]
    assert fate_of(part, "tm-m").reward_msg_ids == ["rw-m-1", "rw-m-2"]
    assert part.stale_samples == 1
    assert names(part.to_ack) == ["m-0", "m-1", "m-2"]  # the stale one acked too, never trained


def test_zero_variance_group_is_filtered_only_with_skip_zero_variance():
    same = [1.0, 1.0, 1.0]
    part = split([group("z", same)], skip_zero_variance=True)
    assert part.train == []
    fate = fate_of(part, "tm-z")
    assert fate.fate == "filtered" and fate.reason == "zero reward variance"
    assert [r.msg_id for r in part.skipped] == ["rw-z-0", "rw-z-1", "rw-z-2"]
    assert names(part.to_ack) == ["z-0", "z-1", "z-2"]

    kept = split([group("z", same)], skip_zero_variance=False)
    assert [g.group_id for g in kept.train] == ["z"] and fate_of(kept, "tm-z").fate == "trained"
    assert kept.skipped == []


def test_mixed_window_gives_each_task_one_fate_and_acks_each_message_once():
    ready = [
        group("ok", [0.0, 1.0], versions=[9, 8]),
        group("zero", [0.0, 0.0], versions=[9, 9]),
        group("stale", [0.0, 1.0], versions=[0, 0]),
        group("part", [1.0, 0.5, 0.0], versions=[9, 0, 9]),
    ]
    expired = [group("late", [1.0], size=3)]
    part = split(ready, expired, version=9, max_staleness=4, skip_zero_variance=True)
    assert {f.task_msg_id: (f.fate, f.reason) for f in part.fates} == {
        "tm-late": ("filtered", "partial group with < 2 samples after deadline"),
        "tm-zero": ("filtered", "zero reward variance"),
        "tm-stale": ("filtered", "stale"),
        "tm-ok": ("trained", ""),
        "tm-part": ("trained", ""),
    }
    assert len(part.fates) == 5
    popped = [s.raw for g in ready + expired for s in g.samples.values()]
    assert sorted(names(part.to_ack)) == sorted(names(popped))
    assert len({id(r) for r in part.to_ack}) == len(part.to_ack) == 10
    assert [g.group_id for g in part.train] == ["ok", "part"]
    assert part.stale_samples == 3  # both of "stale", one of "part"
    # what trains is acked last (after the step that used it)
    trained = {id(s.raw) for g in part.train for s in g.samples.values()}
    assert {id(r) for r in part.to_ack[-len(trained) :]} == trained


def test_partition_leaves_the_popped_groups_unchanged():
    ready = [group("p", [0.0, 1.0, 1.0], versions=[0, 8, 8])]
    first = split(ready, version=8, max_staleness=2)
    assert sorted(ready[0].samples) == [0, 1, 2]  # the stale sample is not popped from the input
    again = split(ready, version=8, max_staleness=2)
    assert again == first


def test_window_popped_from_a_real_pool():
    pool = GroupPool(deadline_s=10.0)
    for s in (sample("full", 0, value=0.0), sample("full", 1, value=1.0), sample("one", 0, size=3)):
        assert pool.add(s, now=0.0)
    ready, expired = pool.pop_ready(now=20.0, limit=8)
    part = split(ready, expired)
    assert [(f.task_msg_id, f.fate) for f in part.fates] == [("tm-one", "filtered"), ("tm-full", "trained")]
    assert names(part.to_ack) == ["one-0", "full-0", "full-1"]
    assert pool.pending() == []


def test_empty_window():
    part = split([])
    assert (part.train, part.fates, part.to_ack, part.skipped, part.stale_samples) == ([], [], [], [], 0)
