"""`rlbus rescore RUN_PATH --domain D`: stored samples scored again by the verifier worker's
code, compared with their stored rewards, on the crafted run of `tests/test_samples.py`
(real server on `<run>/nats`, hidden gold in KV, a real tool record and a forged one)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.test_samples import _topology, crafted_run, rlbus, store_servers, store_topology  # noqa: F401 - crafted_run is a fixture, used by name

SUMMARY_KEYS = {"changed", "total", "confusion", "changed_ids", "report"}


def last_json(out: str) -> dict:
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary) == SUMMARY_KEYS, summary
    return summary


def run_files(run_path: Path) -> set[str]:
    """The run folder's files outside its JetStream store."""
    return {str(p.relative_to(run_path)) for p in run_path.rglob("*") if p.is_file() and "nats" not in p.parts}


def arith_ids(run, *answers: str) -> list[str]:
    return [m for m, s in run.samples.items() if s["domain"] == "arith" and s["answer"] in answers]


def test_same_verifier_changes_nothing_and_the_run_is_untouched(crafted_run):
    run = crafted_run
    before = asyncio.run(_topology(run.server.url))
    run.stop_server()
    files = run_files(run.run_path)
    reports = []
    for domain, n in (("arith", 6), ("extract", 2), ("tool_calc", 2)):
        res = rlbus("rescore", str(run.run_path), "--domain", domain)
        summary = last_json(res.stdout)
        assert summary["changed"] == 0 and summary["changed_ids"] == [] and summary["total"] == n, res.stdout
        assert "stored JetStream" in res.stdout and f"rescored {n} sample(s): 0 changed" in res.stdout
        report = json.loads(Path(summary["report"]).read_text())
        assert report["domain"] == domain and report["source"] == "store" and len(report["samples"]) == n
        assert all(r["error"] is None and r["new"]["status"] == r["old"]["status"] for r in report["samples"])
        reports.append(summary["report"])
    calc = json.loads(Path(reports[2]).read_text())["samples"]
    assert [r["new"]["status"] for r in calc] == ["ok", "tamper"], "tool records and the secret were not used"
    extract = json.loads(Path(reports[1]).read_text())["samples"]
    assert [r["new"]["reward"] for r in extract] == [1.0, 0.0], "hidden gold was not used"
    assert run_files(run.run_path) == files | {str(Path(r).relative_to(run.run_path)) for r in reports}
    assert len(set(reports)) == 3 and all(Path(r).parent == run.run_path / "rescore" for r in reports)
    assert not store_servers(run.run_path / "nats")
    assert store_topology(run.run_path) == before, "rescore changed the run's streams, buckets or consumers"


def _strict_arith(traj, hidden=None):
    """A stricter arith: with `exact` (default true), an answer with surrounding spaces is wrong."""
    from verifier_workers.verifiers.arith import verify_arith

    verdict = verify_arith(traj, hidden)
    if traj.verifier_params.get("exact", True) and traj.final_text != traj.final_text.strip():
        verdict.components["correct"] = 0.0
    return verdict


@pytest.fixture
def strict_arith():
    from verifier_workers import registry

    registry.register("strict_arith", _strict_arith)
    yield "strict_arith"
    registry.unregister("strict_arith")


def test_a_stricter_verifier_flips_the_expected_samples_of_a_live_run(crafted_run, strict_arith, capsys):
    from rlbus.cli import _parser

    def main(argv: list[str]) -> int:  # the command in this process (where the plugin is registered), logs untouched
        args = _parser().parse_args(argv)
        return args.func(args)

    run = crafted_run
    before = asyncio.run(_topology(run.server.url))
    assert main(["rescore", str(run.run_path), "--domain", "arith", "--verifier", strict_arith]) == 0
    out = capsys.readouterr().out
    summary = last_json(out)
    flipped = arith_ids(run, " 5", "16 ")
    assert summary["changed_ids"] == flipped and summary["changed"] == 2 and summary["total"] == 6, out
    assert summary["confusion"] == {
        "pass->pass": 2,
        "pass->fail": 2,
        "pass->error": 0,
        "fail->pass": 0,
        "fail->fail": 2,
        "fail->error": 0,
    }
    assert "live nats-server" in out and "verifier arith -> strict_arith" in out
    for msg_id in flipped:
        assert f"{msg_id}  reward 1 (ok) -> 0 (ok)" in out, out
    rows = {r["msg_id"]: r for r in json.loads(Path(summary["report"]).read_text())["samples"]}
    assert all(rows[m]["old_outcome"] == "pass" and rows[m]["new_outcome"] == "fail" for m in flipped)
    assert {r["verifier"]["new"] for r in rows.values()} == {strict_arith}

    assert (
        main(
            [
                "rescore",
                str(run.run_path),
                "--domain",
                "arith",
                "--verifier",
                strict_arith,
                "--set",
                "verifier.exact=false",
            ]
        )
        == 0
    )
    assert last_json(capsys.readouterr().out)["changed"] == 0, "exact=false must score like arith"
    assert asyncio.run(_topology(run.server.url)) == before, "rescore changed the live run's records"


def test_set_a_builtin_param_limit_and_a_failing_verifier(crafted_run):
    run = crafted_run
    run.stop_server()
    res = rlbus("rescore", str(run.run_path), "--domain", "arith", "--set", "verifier.expression=2+3")
    summary = last_json(res.stdout)
    assert summary["changed_ids"] == arith_ids(run, "16", "16 "), res.stdout  # the 4*4 ones now need 5
    assert summary["confusion"]["pass->fail"] == 2 and summary["confusion"]["pass->pass"] == 2
    res = rlbus("rescore", str(run.run_path), "--domain", "arith", "--set", "verifier.expression=2+3", "--limit", "4")
    summary = last_json(res.stdout)
    assert summary["total"] == 4 and summary["changed_ids"] == arith_ids(run, "16")
    # extract needs gold the arith samples do not have: every sample is an error, never a reward
    res = rlbus("rescore", str(run.run_path), "--domain", "arith", "--verifier", "extract")
    summary = last_json(res.stdout)
    assert summary["changed"] == 6 and summary["confusion"]["pass->error"] == 4
    assert summary["confusion"]["fail->error"] == 2 and "error: verifier input" in res.stdout, res.stdout


def test_missing_run_domain_verifier_or_bad_set_are_clear_errors(crafted_run, tmp_path):
    run = crafted_run
    cases = [
        (["rescore", str(tmp_path / "runs" / "nope"), "--domain", "arith"], "is not a folder: RUN_PATH"),
        (
            ["rescore", str(run.run_path), "--domain", "nope"],
            "no stored rewards of domain 'nope'; domains with rewards: arith (6), extract (2), tool_calc (2)",
        ),
        (["rescore", str(run.run_path), "--domain", "arith", "--verifier", "nope"], "unknown verifier 'nope'"),
        (["rescore", str(run.run_path), "--domain", "arith", "--set", "expression=1"], "expected verifier.PARAM=VALUE"),
    ]
    for args, message in cases:
        res = rlbus(*args, check=False)
        assert res.returncode == 2 and message in res.stderr, (args, res.stdout, res.stderr)
    assert not (run.run_path / "rescore").exists(), "a refused rescore wrote a report"
    res = rlbus("rescore", "--help")
    assert "--pass-threshold" in res.stdout and "never changes the run's records" in res.stdout
