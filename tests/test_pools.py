"""Duration pools: subjects and consumers per pool, the sampler's per-pool gates and the
staleness bound, and the measured-duration pool choice."""

from __future__ import annotations

import random

from bus.subjects import Registry
from producers.domains import make_source
from producers.sampler import make_tasks, pool_caps, pool_for
from scheduler.durations import update
from schemas.config import load_config

CFG = [
    "sampler.max_inflight_tasks=100",
    "learner.groups_per_step=4",
    "learner.max_staleness=3",
    "sampler.domains.arith.pool=short",
    "sampler.domains.slow.kind=sleep",
    "sampler.domains.slow.pool=long",
    "sampler.domains.slow.params.seconds=20",
    "rollout.pools.long.max_inflight=2",
]


def test_pool_subjects_and_consumers_are_disjoint():
    reg = Registry("r1")
    assert reg.tasks("arith") == "tasks.r1.arith" and reg.tasks("arith", "long") == "tasks.r1.arith.long"
    short, long = reg.rollout_consumer(60), reg.rollout_consumer(300, pool="long")
    assert (short.durable, short.filter_subject) == ("rollout", "tasks.r1.*")
    assert (long.durable, long.filter_subject, long.ack_wait_s) == ("rollout-long", "tasks.r1.*.long", 300)


def test_caps_bound_short_by_staleness_and_long_by_its_own():
    cfg = load_config(None, CFG)
    # 4 groups/step x 1 step/version x 3 versions = 12 < 100
    assert pool_caps(cfg) == {"short": 12, "long": 2}


def test_full_long_pool_never_blocks_short_tasks():
    cfg = load_config(None, CFG)
    sources = {d: make_source("r1", d, cfg) for d in cfg.sampler.domains}
    weights, levels = {"arith": 1.0, "slow": 1.0}, {"arith": 3, "slow": 1}
    pools_of = {"arith": "short", "slow": "long"}
    drawn = make_tasks(sources, random.Random(0), 0, {"short": 10, "long": 0}, 10, weights, levels, pools_of)
    assert len(drawn) == 10 and {d.task.domain for d in drawn} == {"arith"}
    drawn = make_tasks(sources, random.Random(0), 0, {"short": 3, "long": 1}, 10, weights, levels, pools_of)
    pools = [d.task.pool for d in drawn]
    assert pools.count("short") == 3 and pools.count("long") == 1  # each pool's room is respected
    assert all(d.task.prompt[0].content == "sleep:20.0" for d in drawn if d.task.pool == "long")


def test_measured_durations_move_a_level_to_the_long_pool():
    cfg = load_config(None, CFG + ["sampler.domains.arith.long_after_s=5"])
    table: dict = {}
    for _ in range(3):
        update(table, "arith", 3, 1.0)
    dc = cfg.sampler.domains["arith"]
    assert pool_for("arith", 3, dc, table, cfg.rollout.pools) == "short"
    for _ in range(40):
        update(table, "arith", 3, 60.0)
    assert table["arith"]["3"] > 5
    assert pool_for("arith", 3, dc, table, cfg.rollout.pools) == "long"
    assert pool_for("arith", 2, dc, table, cfg.rollout.pools) == "short"  # per level
