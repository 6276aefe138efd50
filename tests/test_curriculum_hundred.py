"""The curriculum at a hundred domains: gap-to-baseline softmax water-filled into floors and a
cap (hand-computed at 100 domains), held-out domains at weight 0, baselines from the first
policy version, one KV value published at most once per `every_s`, and the live service
moving weight toward the lagging domains."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path

import pytest

from bus.conn import ensure_topology
from bus.kv import CURRICULUM, get_json
from bus.publish import publish_many
from bus.subjects import Registry
from producers.sampler import make_tasks, plan
from scheduler.curriculum import Curriculum, DomainSpec, water_fill
from scheduler.curriculum_service import build, kv_value, run_curriculum
from scheduler.store import open_store
from scheduler.store_rows import CurriculumUpdateRow
from schemas import Reward, Trajectory, Turn
from schemas.config import load_config
from tests.conftest import eventually

NAMES = [f"d{i:03d}" for i in range(100)]


def baseline_specs(names=NAMES, **kw) -> dict[str, DomainSpec]:
    return {d: DomainSpec(target_reward=None, **kw) for d in names}


def test_hundred_domains_hand_computed():
    """Baselines 0.5 everywhere (version 0); then at version 1: d000-d004 fall to 0 (gap +0.5),
    d050-d099 rise to 1 (gap -0.5), d005-d049 move a little. T = 0.1, floor 0.004, cap 0.05:
    the five laggards sit at the cap, the fifty leaders at the floor, and the 45 others share
    the rest in softmax proportion."""
    T, floor, cap = 0.1, 0.004, 0.05
    cur = Curriculum(baseline_specs(), temperature=T, ema_alpha=1.0, window=4, min_share=floor, max_share=cap)
    now = {}
    for i, d in enumerate(NAMES):
        now[d] = 0.0 if i < 5 else 1.0 if i >= 50 else 0.5 + 0.002 * (i - 27)
    for d in NAMES:
        cur.observe(d, 1, [0.5] * 4, version=0)
    assert cur.weights() == pytest.approx({d: 0.01 for d in NAMES})  # every gap 0: uniform
    for d in NAMES:
        cur.observe(d, 1, [now[d]] * 4, version=1)
    w = cur.weights()

    middle = NAMES[5:50]
    rest = 1.0 - 5 * cap - 50 * floor  # 0.55
    e = {d: math.exp((0.5 - now[d]) / T) for d in middle}
    expected = {d: cap for d in NAMES[:5]} | {d: floor for d in NAMES[50:]}
    expected |= {d: rest * e[d] / sum(e.values()) for d in middle}
    # the hand solution is consistent: the middle lies inside its bounds, and unbounded the
    # laggards would exceed the cap and the leaders fall below the floor
    assert all(floor < expected[d] < cap for d in middle)
    assert rest * math.exp(0.5 / T) / sum(e.values()) > cap and rest * math.exp(-0.5 / T) / sum(e.values()) < floor
    assert w == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert sum(w.values()) == pytest.approx(1.0, abs=1e-12)
    assert w["d005"] > w["d027"] > w["d049"]  # further below baseline -> more weight
    assert cur.baseline("d000") == 0.5 and cur.gap("d000") == pytest.approx(0.5)


def test_floors_and_cap_hold_under_random_rewards_at_150_domains():
    rng = random.Random(7)
    names = [f"x{i}" for i in range(150)]
    specs = {
        d: DomainSpec(
            target_reward=rng.choice([None, rng.uniform(0.2, 0.9)]), floor_share=rng.choice([0.0, 0.0, 0.003, 0.01])
        )
        for d in names
    }
    cur = Curriculum(specs, temperature=0.05, ema_alpha=0.3, window=4, min_share=0.001, max_share=0.03)
    for step in range(600):
        d = rng.choice(names)
        cur.observe(d, 1, [rng.random() ** 2 for _ in range(4)], version=step // 100)
        if step % 25 == 0:
            w = cur.weights()
            assert sum(w.values()) == pytest.approx(1.0, abs=1e-9)
            for name in names:
                lo = max(specs[name].floor_share, 0.001)
                assert lo - 1e-12 <= w[name] <= max(0.03, lo) + 1e-12, (name, w[name])


def test_water_fill_is_the_projection_by_bisection():
    """Against a plain bisection on the shift c of clip(exp(z + c), lo, hi)."""
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(2, 120)
        z = [rng.gauss(0, 4) for _ in range(n)]
        lo = [rng.choice([0.0, 0.2 / n]) for _ in range(n)]
        hi = [max(rng.choice([1.0, 3.0 / n, 1.5 / n]), lo[i]) for i in range(n)]
        a, b = -200.0, 200.0
        for _ in range(200):
            c = (a + b) / 2
            total = sum(min(max(math.exp(min(zi + c - max(z), 0.0)), lo[i]), hi[i]) for i, zi in enumerate(z))
            a, b = (c, b) if total < 1 else (a, c)
        want = [min(max(math.exp(min(zi + a - max(z), 0.0)), lo[i]), hi[i]) for i, zi in enumerate(z)]
        got = water_fill(z, lo, hi)
        assert got == pytest.approx(want, abs=1e-9)
        assert sum(got) == pytest.approx(1.0, abs=1e-9)


def test_cap_below_uniform_is_raised_to_it_and_floors_over_one_fail():
    cur = Curriculum(baseline_specs(["a", "b", "c", "d"]), max_share=0.1)  # 4 x 0.1 < 1: cap becomes 0.25
    assert cur.weights() == pytest.approx({d: 0.25 for d in "abcd"})
    with pytest.raises(ValueError, match="floor shares sum to 1.2"):
        Curriculum(baseline_specs(NAMES), min_share=0.012)


def test_heldout_domains_get_zero_and_are_never_observed():
    specs = baseline_specs(NAMES[:3]) | {"zs": DomainSpec(target_reward=0.9, heldout=True)}
    cur = Curriculum(specs, temperature=0.1, ema_alpha=1.0, window=2, min_share=0.05)
    assert cur.observe("zs", 1, [0.0, 0.0]) is None and cur.ema("zs") is None
    w = cur.weights()
    assert w["zs"] == 0.0 and sum(w.values()) == pytest.approx(1.0)
    assert w == pytest.approx({"d000": 1 / 3, "d001": 1 / 3, "d002": 1 / 3, "zs": 0.0})
    with pytest.raises(ValueError, match="held out"):
        Curriculum({"zs": DomainSpec(heldout=True)})
    back = Curriculum.restore(json.loads(json.dumps(cur.snapshot())))
    assert back.domains["zs"].heldout and back.weights() == pytest.approx(w)


def test_baseline_is_the_first_window_of_the_lowest_version():
    cur = Curriculum(baseline_specs(["a"]), window=4, ema_alpha=1.0)
    assert cur.baseline("a") is None and cur.gap("a") == 0.0  # no reference yet: neutral
    cur.observe("a", 1, [1.0, 1.0], version=2)
    assert cur.baseline("a") == 1.0
    cur.observe("a", 1, [0.0, 0.0], version=1)  # an earlier version arrives: it is the baseline
    assert cur.baseline("a") == 0.0
    cur.observe("a", 1, [1.0, 1.0, 1.0], version=1)  # fills the window of 4: 2 of the 3 taken
    assert cur.baseline("a") == 0.5
    cur.observe("a", 1, [1.0] * 4, version=0)  # full: final, even against an earlier version
    assert cur.baseline("a") == 0.5 and cur.gap("a") == pytest.approx(0.5 - 1.0)
    # an explicit target wins over the measured baseline
    tgt = Curriculum({"a": DomainSpec(target_reward=0.9)}, window=4, ema_alpha=1.0)
    tgt.observe("a", 1, [0.5] * 4)
    assert tgt.baseline("a") == 0.5 and tgt.gap("a") == pytest.approx(0.4)


def test_one_small_kv_value_for_a_hundred_domains_round_trips():
    cur = Curriculum({d: DomainSpec(target_reward=None, levels=(1, 6)) for d in NAMES}, window=64, min_share=0.002)
    rng = random.Random(0)
    for _ in range(2000):
        d = rng.choice(NAMES)
        cur.observe(d, cur.level(d), [float(rng.random() < 0.5) for _ in range(8)], version=0)
    value = kv_value(cur, 7)
    text = json.dumps(value)
    assert len(text) < 256 * 1024, len(text)  # one KV value, well under the server's 1 MiB payload
    back = Curriculum.restore(json.loads(text)["snapshot"])
    assert back.snapshot() == cur.snapshot() and back.weights() == pytest.approx(cur.weights())
    # an old snapshot (0/1 lists, no baseline, no shares) still restores
    old = json.loads(text)["snapshot"]
    for d in old["domains"].values():
        d["history"] = {k: [int(c) for c in h] for k, h in d["history"].items()}
        d.pop("baseline")
        d["spec"].pop("heldout")
    for k in ("min_share", "max_share"):
        old["config"].pop(k)
    assert Curriculum.restore(old).level("d000") == cur.level("d000")


def hundred_config(tmp_path: Path, *, heldout: tuple[str, ...] = (), every_s: float = 0.5) -> Path:
    lines = [
        "[sampler]",
        "group_size = 4",
        "max_inflight_tasks = 500",
        "",
        "[rollout]",
        'engine = "null"',
        "",
        "[learner]",
        'policy = "null"',
        "max_staleness = 100",
        "",
        "[scheduler.curriculum]",
        f"every_s = {every_s}",
        "window = 4",
        "ema_alpha = 1.0",
        "temperature = 0.1",
        "min_share = 0.002",
        "max_share = 0.05",
        "",
    ]
    for d in NAMES + list(heldout):
        lines += [f"[sampler.domains.{d}]", 'kind = "arith"', *(["heldout = true"] if d in heldout else []), ""]
    path = tmp_path / "hundred.toml"
    path.write_text("\n".join(lines))
    return path


def test_config_sampler_and_heldout_plan(tmp_path):
    cfg = load_config(hundred_config(tmp_path, heldout=("zs",)))
    assert cfg.sampler.domains["d000"].target_reward is None  # unset: the baseline
    cur = build(cfg)
    assert cur.min_share == 0.002 and cur.max_share == 0.05 and cur.domains["zs"].heldout
    weights, _ = plan(cfg.sampler.domains, None)  # static weights: held out = 0
    assert weights["zs"] == 0.0 and weights["d000"] == 1.0
    weights, _ = plan(cfg.sampler.domains, {"weights": {"zs": 0.9, "d001": 0.1}, "levels": {}})
    assert weights["zs"] == 0.0 and weights["d001"] == 0.1
    from producers.domains import make_source

    sources = {d: make_source("r", d, cfg) for d in cfg.sampler.domains}
    drawn = make_tasks(
        sources,
        random.Random(0),
        0,
        {"short": 2000},
        2000,
        plan(cfg.sampler.domains, None)[0],
        {d: 1 for d in sources},
        {d: "short" for d in sources},
    )
    assert (
        len(drawn) == 2000 and "zs" not in {x.task.domain for x in drawn} and len({x.task.domain for x in drawn}) == 100
    )
    with pytest.raises(ValueError, match="heldout"):
        load_config(None, ["sampler.domains.arith.heldout=true"])


def rewards_of(run_id: str, domain: str, group: str, version: int, values: list[float]) -> list[Reward]:
    out = []
    for i, v in enumerate(values):
        traj = Trajectory(
            run_id=run_id,
            task_id=f"{domain}-{group}",
            task_msg_id=f"tm-{group}",
            domain=domain,
            difficulty=1,
            group_id=group,
            group_size=len(values),
            sample_index=i,
            verifier="arith",
            policy_version=version,
            turns=[Turn(role="prompt", text="p")],
        )
        out.append(Reward(run_id=run_id, trajectory=traj, reward=v))
    return out


@pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards
async def test_live_service_moves_weight_to_lagging_domains_at_most_every_s(js, run_id, tmp_path):
    """100 domains at 0.5 under version 0; under version 1 ten of them fall to 0.25 and ninety
    rise to 0.75. The service's one KV value moves the weight to the ten (each at the 0.05 cap),
    published no more often than `every_s`."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    every_s = 0.5
    cfg = load_config(hundred_config(tmp_path, every_s=every_s))
    store = await asyncio.to_thread(open_store, None, tmp_path / "run")
    await asyncio.to_thread(store.ensure_run, run_id)
    lagging = set(NAMES[::10])
    stop = asyncio.Event()
    task = asyncio.create_task(run_curriculum(js, reg, cfg, stop, store))
    for d in NAMES:  # version 0: every domain at 0.5
        await publish_many(js, [(reg.rewards(d), r) for r in rewards_of(run_id, d, f"{d}-v0", 0, [1, 0, 1, 0])])
    for d in NAMES:  # version 1: the ten lag, the ninety improve
        values = [0, 0, 1, 0] if d in lagging else [1, 1, 1, 0]
        await publish_many(js, [(reg.rewards(d), r) for r in rewards_of(run_id, d, f"{d}-v1", 1, values)])

    async def observed():
        value = await get_json(js, reg, CURRICULUM)
        return value if value and value["updates"] == 200 else None

    value = await eventually(observed, 30, "the curriculum to observe all 200 groups", tmp_path)
    stop.set()
    await asyncio.wait_for(task, 10)

    w = value["weights"]
    assert set(w) == set(NAMES) and sum(w.values()) == pytest.approx(1.0)
    assert all(w[d] == pytest.approx(0.05) for d in lagging)  # at the cap
    rest = (1 - 10 * 0.05) / 90
    assert all(w[d] == pytest.approx(rest) for d in set(NAMES) - lagging)
    rows = await asyncio.to_thread(store.rows, CurriculumUpdateRow, run_id, "created_at")
    gaps = [b.created_at - a.created_at for a, b in zip(rows, rows[1:-1])]  # the last is the stop's publish
    assert all(g >= every_s - 0.05 for g in gaps), gaps
    kv = await js.key_value(reg.kv_bucket)
    assert CURRICULUM in await kv.keys()  # one key for all hundred domains
    assert not [k for k in await kv.keys() if k.startswith("curriculum.")]
