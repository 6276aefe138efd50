"""The views of a hundred-domain run: `rlbus report` (held-out vs trained plot, the domain
heatmap, stacked curriculum weights, per-domain table), `rlbus top`'s top-N domain panel,
and summary.json's per-domain counts and eval purposes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from rlbus.commands.top import domain_rows, render
from rlbus.report.build import build_report, curriculum_series, heldout_and_train_mean, reward_grid
from rlbus.run.live import Snapshot
from rlbus.run.monitor import DomainRewards, Monitor, summary_dict
from scheduler.store import open_store
from scheduler.store_rows import EvalResultRow, RewardRow
from schemas import EvalResult, RewardGlance

T0 = 1_700_000_000.0
PNG = b"\x89PNG\r\n\x1a\n"
NAMES = [f"d{i:03d}" for i in range(100)]


def _reward(i: int, domain: str, reward: float, version: int, task: str):
    return {
        "msg_id": f"r{i}",
        "run_id": "big",
        "domain": domain,
        "difficulty": 1,
        "purpose": "train",
        "reward": reward,
        "status": "ok",
        "policy_version": version,
        "task_msg_id": task,
        "created_at": T0 + i,
    }


def _eval(domain: str, version: int, score: float, purpose: str = "train") -> EvalResult:
    return EvalResult(
        run_id="big",
        version=version,
        step=version,
        domain=domain,
        score=score,
        n=10,
        eval_set_sha256="h",
        purpose=purpose,
        created_at=T0 + version,
    )


@pytest.fixture
def big_run(tmp_path) -> Path:
    path = tmp_path / "runs" / "big"
    store = open_store(None, path)
    store.ensure_run("big", {"sampler": {"domains": {d: {} for d in NAMES + ["zs"]}}})
    rows, i = [], 0
    for v in range(3):
        for k, d in enumerate(NAMES):
            for _ in range(2):
                rows.append(_reward(i, d, (k % 10) / 10 + 0.01 * v, v, f"t{v}-{d}"))
                i += 1
    store.insert_ignore(RewardRow, rows)
    store.record_evals(
        [_eval(d, v, 0.1 * v + (0.02 if d == "d001" else 0.0)) for d in ("d000", "d001") for v in (0, 2)]
        + [_eval("zs", v, 0.3 + 0.05 * v, "heldout") for v in (0, 1, 2)]
        + [_eval("general_arith", 2, 0.9)]
    )
    for n in range(3):
        w = {d: (0.5 if d == "d007" and n else 0.5 / 99 if n else 0.01) for d in NAMES} | {"zs": 0.0}
        store.record_curriculum_update("big", f"c{n}", w, {d: 1 + n for d in NAMES}, created_at=T0 + 10 * n)
    store.close()
    return path


def test_report_series_and_files_at_a_hundred_domains(big_run):
    store = open_store(None, big_run)
    try:
        evals, rewards = store.rows(EvalResultRow, "big"), store.rows(RewardRow, "big")
    finally:
        store.close()
    held, train_mean, n_train = heldout_and_train_mean(evals, set(NAMES) | {"zs"})
    assert held == {"zs": [(0, 0.3), (1, 0.35), (2, pytest.approx(0.4))]}
    assert n_train == 2 and train_mean == [(0, 0.01), (2, pytest.approx((0.2 + 0.22) / 2))]  # general set left out
    domains, columns, grid = reward_grid(rewards)
    assert len(domains) == 100 and columns == ["0", "1", "2"]
    assert domains[:10] == ["d009", "d019", "d029", "d039", "d049", "d059", "d069", "d079", "d089", "d099"]
    assert grid[0] == [pytest.approx(0.9), pytest.approx(0.91), pytest.approx(0.92)]
    wide, cols, _ = reward_grid(
        [type("R", (), {**_reward(0, "a", 1.0, v, "t"), "policy_version": v})() for v in range(500)], max_columns=60
    )
    assert len(cols) <= 60 and cols[0] == "0-8" and wide == ["a"]

    out = build_report(big_run)
    text = out.read_text()
    for name in ("heldout_vs_train", "domain_heatmap", "curriculum_weights"):
        png = big_run / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG and f"plots/{name}.png" in text
    assert "| zs | heldout | 10 |" in text and "| d000 | train | 10 |" in text
    assert "| d007 | 3 | 6 | 0.710 | 3 | 0.5000 |" in text  # tasks, rewards, mean, level, weight
    assert text.index("| d007 | 3 |") < text.index("| d000 | 3 |")  # largest weight first


def test_curriculum_series_fills_absent_domains_with_zero():
    ups = [
        type("U", (), {"created_at": T0 + t, "weights": w})() for t, w in ((1, {"a": 1.0}), (2, {"a": 0.4, "b": 0.6}))
    ]
    assert curriculum_series(ups, T0) == ([1.0, 2.0], {"a": [1.0, 0.4], "b": [0.0, 0.6]})


def _frame(n: int) -> dict:
    weights = {d: (0.3 if d == "d050" else 0.7 / (n - 1)) for d in NAMES[:n]}
    return {
        "run_id": "big",
        "time": T0,
        "step": 3,
        "version": 2,
        "stages": {},
        "streams": {},
        "consumers": [],
        "dead_letters": 0,
        "rewards": {d: {"n": 2, "mean": 0.5} for d in NAMES[:n]},
        "evals": {"zs": {"version": 2, "score": 0.4, "n": 10, "purpose": "heldout"}},
        "curriculum": {"version": 5, "weights": weights, "levels": {d: 2 for d in NAMES[:n]}},
        "staleness": {"0": 1},
        "workers": [],
    }


def test_top_shows_the_top_n_domains_and_counts_the_rest():
    frame = _frame(100)
    shown, rest = domain_rows(frame, top=10)
    assert shown[0] == "d050" and len(shown) == 10
    assert rest == {"domains": 91, "rewards": 2 * 90, "weight": pytest.approx(0.7 / 99 * 90)}
    assert domain_rows(frame, top=0)[1] is None and len(domain_rows(frame, top=0)[0]) == 101
    buf = io.StringIO()
    Console(file=buf, width=120, no_color=True, force_terminal=False).print(render(frame, top=10))
    out = buf.getvalue()
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    domain_rows_out = [r for r in rows if len(r) == 8]
    assert len(domain_rows_out) == 11, out  # ten domains and the rest
    assert domain_rows_out[0][0] == "d050" and domain_rows_out[0][6] == "0.300" and domain_rows_out[0][7] == "2"
    assert domain_rows_out[-1][0] == "(+91 more)" and domain_rows_out[-1][1] == "180"
    assert "top 10 of 101 by weight" in out
    small = io.StringIO()
    Console(file=small, width=120, no_color=True, force_terminal=False).print(render(_frame(3), top=10))
    assert "more)" not in small.getvalue() and "zs" in small.getvalue()


def test_summary_counts_per_domain_and_eval_purpose():
    mon = Monitor(None, None, Snapshot(run_id="big"))
    for d in NAMES[:3]:
        dr = mon.domain_rewards.setdefault(d, DomainRewards())
        dr.add(RewardGlance("big", 1.0, "ok", d, 1, "train", 0.1, ()))
        dr.add(RewardGlance("big", 0.0, "ok", d, 1, "train", 0.1, ()))
    mon.tasks_by_domain = {"d000": 4, "d001": 3, "d002": 1, "d099": 2}
    mon.curriculum = {
        "weights": {d: 0.25 for d in ("d000", "d001", "d002", "d099")} | {"zs": 0.0},
        "levels": {"d000": 2, "d001": 1, "d002": 1, "d099": 3, "zs": 1},
    }
    for ev in (
        _eval("zs", 2, 0.3, "heldout"),
        _eval("zs", 5, 0.4, "heldout"),
        _eval("d000", 0, 0.1),
        _eval("d000", 5, 0.6),
    ):
        mon.domain_evals.setdefault(ev.domain, {})[ev.version] = ev
    s = summary_dict(Snapshot(run_id="big"), mon)
    d0 = s["domains"]["d000"]
    assert (d0["tasks"], d0["rewards"], d0["reward_mean"], d0["level"], d0["weight"]) == (4, 2, 0.5, 2, 0.25)
    assert s["domains"]["d099"]["tasks"] == 2 and s["domains"]["d099"]["rewards"] == 0
    assert s["domains"]["zs"]["weight"] == 0.0 and s["domains"]["zs"]["tasks"] == 0
    assert s["eval"]["zs"] == {
        "purpose": "heldout",
        "baseline": 0.3,
        "final": 0.4,
        "n": 10,
        "baseline_version": 2,
        "final_version": 5,
        "curve": {"2": 0.3, "5": 0.4},
    }
    assert s["eval"]["d000"]["purpose"] == "train" and s["eval"]["d000"]["baseline"] == 0.1
