"""`rlbus samples RUN_PATH`: a run's scored samples read back from its REWARDS log.

Two kinds of runs, both real: a crafted run folder (its own nats-server on `<run>/nats`,
rewards scored by the verifier worker's Scorer from hidden data and real tool records,
published as the verifier publishes them), read live and after its server stopped; and
the session's smoke `rlbus up` run (tests/smoke_run.py), read after it finished.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from bus.server import EmbeddedNats
from tests.conftest import ROOT
from tests.messages import store_checks

FULL_KEYS = {
    "msg_id",
    "domain",
    "task_id",
    "group_id",
    "sample_index",
    "turns",
    "tool_calls",
    "reward",
    "components",
    "status",
}
TURN_KEYS = {"role", "text", "token_ids", "logprobs", "trainable", "policy_version"}
# (domain, verifier, params, hidden, policy_version, [answers]); arith: group of 3 answers per task
ARITH = [("2+3", 1, ["5", " 5", "6"]), ("4*4", 3, ["16", "16 ", "x"])]
EXTRACT_GOLD = {"name": "Ada", "year": 1815}


@dataclass
class CraftedRun:
    """A run folder whose server holds the crafted rewards (see `crafted_run`)."""

    run_path: Path
    run_id: str
    server: EmbeddedNats
    samples: dict[str, dict]  # trajectory msg_id -> what was published (domain, answer, reward, turns...)

    def stop_server(self) -> None:
        self.server.stop()


@dataclass
class _Stored:
    msg: object
    delivered: int = 1


def _turns(prompt: str, answers: list[str], version: int, tool_texts: list[str] = ()) -> list:
    """prompt, then assistant turns (one logprob per token id), with tool turns between them."""
    from schemas import Turn, pack_f32, pack_i32

    turns = [Turn(role="prompt", text=prompt, token_ids=pack_i32(list(prompt.encode())))]
    for i, answer in enumerate(answers):
        ids = list(answer.encode()) + [1]
        turns.append(
            Turn(
                role="assistant",
                text=answer,
                token_ids=pack_i32(ids),
                logprobs=pack_f32([-0.5 - 0.25 * k for k in range(len(ids))]),
                trainable=True,
                policy_version=version,
            )
        )
        if i < len(tool_texts):
            turns.append(Turn(role="tool", text=tool_texts[i], token_ids=pack_i32(list(tool_texts[i].encode()))))
    return turns


def _task(run_id: str, domain: str, task_id: str, verifier: str, params: dict, group: int, hidden_ref=None):
    from schemas import ChatMessage, Task

    return Task(
        run_id=run_id,
        task_id=task_id,
        domain=domain,
        group_size=group,
        prompt=[ChatMessage(role="user", content=f"{task_id}?")],
        verifier=verifier,
        verifier_params=params,
        hidden_ref=hidden_ref,
    )


async def _trajectories(js, reg, run_path: Path) -> list:
    """Every crafted trajectory (arith, extract with hidden gold, tool_calc with a real and a forged observation)."""
    from bus.hidden import hidden_ref_for, put_hidden
    from sandbox_workers.base import ExecResult
    from sandbox_workers.integrity import LocalRecorder
    from schemas import ToolCall, Trajectory

    out = []
    for expr, version, answers in ARITH:
        task = _task(reg.run_id, "arith", f"arith-{expr}", "arith", {"expression": expr}, len(answers))
        out += [Trajectory.from_task(task, i, _turns(f"{expr}=", [a], version)) for i, a in enumerate(answers)]
    ref = hidden_ref_for("extract", "p1")
    await put_hidden(js, reg, ref, {"gold": EXTRACT_GOLD})
    task = _task(reg.run_id, "extract", "extract-p1", "extract", {}, 2, hidden_ref=ref)
    for i, answer in enumerate(['{"name": "Ada", "year": 1815}', '{"name": "Ada", "year": 1816}']):
        out.append(Trajectory.from_task(task, i, _turns("Who? ", [answer], 2)))
    exec_id, obs = await LocalRecorder.for_run(js, reg, run_path).record(
        "s1", "python3 -c 'print(6*7)'", ExecResult(0, "42\n", "", duration_ms=3.5)
    )
    task = _task(reg.run_id, "tool_calc", "calc-6*7", "tool_calc", {"expression": "6*7"}, 2)
    call = ToolCall(turn=1, tool="python", code="print(6*7)", exec_id=exec_id, exit_code=0, duration_ms=3.5)
    out.append(
        Trajectory.from_task(task, 0, _turns("6*7 ", ["<py>print(6*7)</py>", "=42"], 4, [obs]), tool_calls=[call])
    )
    forged = ToolCall(turn=1, tool="python", code="print(6*7)", exit_code=0)
    out.append(
        Trajectory.from_task(
            task,
            1,
            _turns("6*7 ", ["<py>print(6*7)</py>", "=42"], 4, ["<obs exit=0>\n42\n</obs>"]),
            tool_calls=[forged],
        )
    )
    return out


async def _publish_rewards(url: str, run_id: str, run_path: Path) -> dict[str, dict]:
    """Score the crafted trajectories as the verifier worker does and publish their Rewards."""
    from bus.conn import connect, ensure_consumer, ensure_topology
    from bus.hidden import HiddenCache
    from bus.publish import publish_many
    from bus.subjects import Registry
    from sandbox_workers.integrity import load_or_create_secret
    from verifier_workers.worker import RetryPolicy, Scorer

    reg = Registry(run_id)
    nc = await connect(url, name="test-samples")
    js = nc.jetstream(timeout=10)
    await ensure_topology(js, reg)
    await ensure_consumer(js, reg.learner_consumer())
    trajs = await _trajectories(js, reg, run_path)
    scorer = Scorer(HiddenCache(js, reg), RetryPolicy(1), 0, js, reg, load_or_create_secret(run_path))
    await store_checks(js, reg, trajs)
    samples = {}
    for traj in trajs:
        rw = await scorer.one(_Stored(traj))
        await publish_many(js, [(reg.rewards(traj.domain), rw)])
        samples[traj.msg_id] = {
            "domain": traj.domain,
            "answer": traj.final_text,
            "reward": rw.reward,
            "status": rw.status,
            "version": traj.policy_version,
            "traj": traj,
        }
    await nc.close()
    return samples


@pytest.fixture
def crafted_run(tmp_path, monkeypatch):
    """A run folder `runs/<id>` with run.json and its own server on `<run>/nats` holding the rewards."""
    monkeypatch.delenv("RLBUS_TOOL_SECRET", raising=False)
    monkeypatch.delenv("RLBUS_TOOL_SECRET_FILE", raising=False)
    run_id = f"smp{uuid.uuid4().hex[:8]}"
    run_path = tmp_path / "runs" / run_id
    server = EmbeddedNats(run_path / "nats").start()
    try:
        (run_path / "run.json").write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "nats_url": server.url,
                    "launcher_pid": None,
                    "server_pid": server.pid,
                    "workers": {},
                }
            )
        )
        samples = asyncio.run(_publish_rewards(server.url, run_id, run_path))
        yield CraftedRun(run_path, run_id, server, samples)
    finally:
        server.stop()


def rlbus(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if check:
        assert res.returncode == 0, f"rlbus {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def _topology(url: str) -> dict:
    """Every stream's (messages, last_seq) and consumer names on the server (to prove nothing changed)."""
    from bus.conn import connect

    nc = await connect(url, name="test-samples-state")
    js = nc.jetstream(timeout=10)
    out = {}
    for s in await js.streams_info():
        consumers = sorted(c.name for c in await js.consumers_info(s.config.name))
        out[s.config.name] = (s.state.messages, s.state.last_seq, consumers)
    await nc.close()
    return out


def store_topology(run_path: Path) -> dict:
    """`_topology` of a finished run's store, under a server started for the check."""
    with EmbeddedNats(run_path / "nats") as server:
        return asyncio.run(_topology(server.url))


def store_servers(store: Path) -> list[str]:
    """nats-server processes running on `store` (none may be left by a command)."""
    out = subprocess.run(["pgrep", "-af", f"nats-server.*{store}"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_full_json_of_a_finished_run_has_every_turn_token_and_logprob(crafted_run):
    run = crafted_run
    before = asyncio.run(_topology(run.server.url))
    run.stop_server()
    log = run.run_path / "nats" / "nats-server.log"
    log_hash = hashlib.sha256(log.read_bytes()).hexdigest()
    res = rlbus("samples", str(run.run_path), "--json", "--full")
    assert "stored JetStream" in res.stderr, res.stderr
    objs = json_lines(res.stdout)
    assert [o["msg_id"] for o in objs] == list(run.samples), "every stored sample, in stream order"
    for o in objs:
        want = run.samples[o["msg_id"]]
        traj = want["traj"]
        assert FULL_KEYS <= set(o), set(o)
        assert (o["domain"], o["task_id"], o["group_id"], o["sample_index"]) == (
            traj.domain,
            traj.task_id,
            traj.group_id,
            traj.sample_index,
        )
        assert (o["reward"], o["status"]) == (want["reward"], want["status"])
        assert o["components"]["turns_used"] >= 1
        assert [t["role"] for t in o["turns"]] == [t.role for t in traj.turns]
        for t, orig in zip(o["turns"], traj.turns):
            assert set(t) == TURN_KEYS
            assert t["text"] == orig.text and t["trainable"] == orig.trainable
            assert t["policy_version"] == orig.policy_version
            assert all(isinstance(i, int) for i in t["token_ids"]) and t["token_ids"]
            if t["role"] == "assistant":
                assert len(t["logprobs"]) == len(t["token_ids"]), t
                assert t["logprobs"][:2] == [-0.5, -0.75] and t["trainable"]
                assert t["policy_version"] == want["version"]
            else:
                assert t["logprobs"] == [] and not t["trainable"] and t["policy_version"] == -1
    calc = [o for o in objs if o["domain"] == "tool_calc"]
    assert [o["status"] for o in calc] == ["ok", "tamper"] and calc[0]["reward"] == 1.0
    call = calc[0]["tool_calls"][0]
    assert call["tool"] == "python" and call["exit_code"] == 0 and len(call["exec_id"]) == 32
    assert call["result"].startswith("<obs exit=0>") and "42" in call["result"]
    assert [o["reward"] for o in objs if o["domain"] == "extract"] == [1.0, 0.0]  # hidden gold was used
    assert not store_servers(run.run_path / "nats"), "the server started for the store was left running"
    assert hashlib.sha256(log.read_bytes()).hexdigest() == log_hash, "the run's own server log was written to"
    assert store_topology(run.run_path) == before, "reading changed the stored streams or consumers"


def test_text_and_compact_json_of_a_live_run_and_filters(crafted_run):
    run = crafted_run
    before = asyncio.run(_topology(run.server.url))
    text = rlbus("samples", str(run.run_path)).stdout
    assert "live nats-server" in text.splitlines()[0], text[:300]
    for msg_id in run.samples:
        assert f"msg_id {msg_id}" in text
    assert "turn 1 assistant v1   trainable 1  2 tokens  '5'" in text, text[:2000]
    assert "logp [-0.5000, -0.7500]" in text and "ids  [50, 43, 51, 61]" in text
    assert "tool call 0 (turn 1) python exit 0 3.5 ms exec" in text and "result '<obs exit=0>" in text
    assert "status tamper" in text and "components  turns_used=1" in text
    assert text.rstrip().endswith(f"{len(run.samples)} sample(s) shown of {len(run.samples)} stored reward(s) read")

    compact = json_lines(rlbus("samples", str(run.run_path), "--json").stdout)
    assert len(compact) == len(run.samples)
    assert set(compact[0]) == {
        "seq",
        "msg_id",
        "domain",
        "task_id",
        "sample_index",
        "purpose",
        "policy_version",
        "reward",
        "status",
        "components",
        "prompt",
        "answer",
        "turns",
        "tool_calls",
        "tokens",
        "finish_reason",
        "drift",
    }
    assert [c["seq"] for c in compact] == list(range(1, len(run.samples) + 1))
    assert compact[0]["prompt"] == "2+3=" and compact[0]["answer"] == "5" and compact[0]["turns"] == 2

    def ids(*flags: str) -> list[str]:
        return [o["msg_id"] for o in json_lines(rlbus("samples", str(run.run_path), "--json", *flags).stdout)]

    s = run.samples
    assert ids("--domain", "arith") == [m for m in s if s[m]["domain"] == "arith"]
    assert ids("--version-min", "3") == [m for m in s if s[m]["version"] >= 3]
    assert ids("--reward-min", "1") == [m for m in s if s[m]["reward"] >= 1]
    assert ids("--domain", "arith", "--reward-min", "1", "--version-min", "2") == [
        m for m in s if s[m]["domain"] == "arith" and s[m]["reward"] >= 1 and s[m]["version"] >= 2
    ]
    assert ids("--limit", "2") == list(s)[:2]
    some = list(s)[4]
    assert ids("--id", some) == [some] and ids("--id", f"rw-{some}", "--limit", "5") == [some]
    assert asyncio.run(_topology(run.server.url)) == before, "a live read consumed or changed something"


def test_missing_run_folder_unknown_domain_and_gone_server_are_clear_errors(crafted_run, tmp_path):
    res = rlbus("samples", str(tmp_path / "runs" / "no-such-run"), check=False)
    assert res.returncode == 2 and "is not a folder: RUN_PATH is one run's folder" in res.stderr, res.stderr
    (tmp_path / "empty").mkdir()
    res = rlbus("samples", str(tmp_path / "empty"), check=False)
    assert res.returncode == 2 and "is it a run folder" in res.stderr, res.stderr
    res = rlbus("samples", str(crafted_run.run_path), "--domain", "nope", check=False)
    assert res.returncode == 2 and "no stored rewards of domain 'nope'" in res.stderr and "arith (6)" in res.stderr
    state = json.loads((crafted_run.run_path / "run.json").read_text())  # the server runs, but not where recorded
    (crafted_run.run_path / "run.json").write_text(json.dumps({**state, "nats_url": "nats://127.0.0.1:9"}))
    res = rlbus("samples", str(crafted_run.run_path), check=False)
    assert res.returncode == 2 and "never opened twice" in res.stderr, res.stderr
    assert f"nats-server pid {crafted_run.server.pid} runs on its store" in res.stderr, res.stderr
    other = tmp_path / "runs" / "elsewhere"  # a run that used an outside server, now gone: no store to read
    other.mkdir(parents=True)
    (other / "run.json").write_text(json.dumps({"run_id": "elsewhere", "nats_url": "nats://127.0.0.1:9"}))
    res = rlbus("samples", str(other), check=False)
    assert res.returncode == 2 and "has no stored JetStream" in res.stderr and "--nats-url" in res.stderr, res.stderr


def test_samples_of_a_real_finished_run(smoke_run):
    """The shared smoke `rlbus up` (tiny HF model, real tokens and logprobs), then `samples --json --full`
    on its stored log; the store is read, never changed."""
    assert not smoke_run.problem(), smoke_run.problem()
    run_id, run_path = smoke_run.run_id, smoke_run.run_path
    before = store_topology(run_path)
    stored = before[f"REWARDS_{run_id}"][0]
    objs = json_lines(rlbus("samples", str(run_path), "--json", "--full").stdout)
    assert len(objs) == stored > 0
    for o in objs:
        assert FULL_KEYS <= set(o) and o["domain"] == "arith" and o["turns"][0]["role"] == "prompt"
        model = [t for t in o["turns"] if t["role"] == "assistant"]
        assert model and all(len(t["logprobs"]) == len(t["token_ids"]) > 0 for t in model), o
        assert all(t["trainable"] and t["policy_version"] >= 0 for t in model)
        assert all(lp <= 0 for t in model for lp in t["logprobs"])
    assert len({o["group_id"] for o in objs}) * 4 >= len(objs)
    assert max(o["policy_version"] for o in objs) >= 1, "no sample of a trained version"
    newer = json_lines(rlbus("samples", str(run_path), "--json", "--version-min", "1").stdout)
    assert 0 < len(newer) < len(objs) and all(o["policy_version"] >= 1 for o in newer)
    assert not store_servers(run_path / "nats")
    assert store_topology(run_path) == before
