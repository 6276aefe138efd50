"""The rollout worker's OpenAI-compatible endpoint, driven by the official `openai` client.

- A multi-turn tool episode with `tools=`: the reply's tool calls are parsed by the json tool
  code; the recorded trajectory is exactly what the engine was given and sampled, and the
  learner's recomputed log-probs match the engine's within the fidelity tolerance (1e-4, fp32).
- Drift: a harness that sends back an edited history is counted, the generated ids kept;
  summary.json's domain entry and `rlbus samples` show it.
- Security: a wrong key, another episode's key, an oversized body, malformed JSON, `n` over
  the limit, a request after the episode ended, too many episodes, and the limits that end
  an episode (`length`, `timeout`).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

pytest.importorskip("openai", reason="the agents extra: pip install -e '.[agents]' (make test installs it)")
import openai

from rlbus.model.tiny_model import build_tiny_model
from rollout_workers.endpoint.server import Endpoint
from rollout_workers.engines.sample import Sample
from schemas import Reward, Task, encode, glance_reward, unpack_f32, unpack_i32
from schemas.chat import encode_text, user_prompt
from schemas.config import RunConfig
from tests.test_token_fidelity import RecordingEngine, learner_logprobs, max_diff

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=1024)
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("ep") / "m", tokenizer="bpe", seed=5, **TINY)


class ForcedEngine(RecordingEngine):
    """A real HFEngine whose next calls answer `forced` id lists (log-probs teacher-forced from
    the same model), then sample; it records what it was given and returned."""

    def __init__(self, path, forced: list[list[int]] | None = None):
        super().__init__(path)
        self.forced = list(forced or [])

    def generate(self, prompts, n, max_new_tokens, temperature):
        if not self.forced:
            return super().generate(prompts, n, max_new_tokens, temperature)
        ids = np.asarray(self.forced.pop(0), dtype=np.int32)
        out = []
        for p in prompts:
            p = np.asarray(p, dtype=np.int32)
            out.append([Sample(p, ids, self.teacher_forced(p, ids), self.decode(ids), "stop")] * n)
        self.given.append([[int(x) for x in p] for p in prompts])
        self.returned.append(out)
        return out


def task(i: int = 0) -> Task:
    return Task(run_id="ep", task_id=f"t{i}", domain="agent", group_size=1, prompt=user_prompt("x"), verifier="arith")


async def served(engine, **cfg):
    section = RunConfig().rollout.endpoint.model_copy(update={"enabled": True, **cfg})
    ep = Endpoint(engine, lambda: 7, section, context_limit=900)
    await ep.serve()
    return ep


def client(ep, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=ep.base_url, api_key=key, max_retries=0)


async def test_an_openai_tool_episode_is_token_in_token_out_and_matches_the_learner(model_dir):
    probe = RecordingEngine(model_dir).tokenizer
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "417*382"}}\n</tool_call>'
    engine = ForcedEngine(model_dir, forced=[encode_text(probe, call) + [probe.eos_token_id]])
    ep = await served(engine)
    try:
        key = ep.open_episode(task())
        c = client(ep, key)
        messages = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "417*382?"}]
        r1 = await c.chat.completions.create(model="rlbus-policy", messages=messages, tools=[CALC], max_tokens=80)
        (tc,) = r1.choices[0].message.tool_calls
        assert r1.choices[0].finish_reason == "tool_calls" and tc.function.name == "calc"
        assert json.loads(tc.function.arguments) == {"expr": "417*382"} and r1.choices[0].message.content is None
        messages += [r1.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": tc.id, "content": str(417 * 382)}]
        torch.manual_seed(0)
        r2 = await c.chat.completions.create(
            model="rlbus-policy", messages=messages, tools=[CALC], max_tokens=16, temperature=1.0, logprobs=True
        )
        assert len(r2.choices[0].logprobs.content) == r2.usage.completion_tokens
        traj = ep.close_episode(key)
    finally:
        await ep.stop()
    assert [t.role for t in traj.turns] == ["prompt", "assistant", "tool", "assistant"]
    ids = [unpack_i32(t.token_ids).tolist() for t in traj.turns]
    assert ids[1] == engine.returned[0][0][0].token_ids.tolist()  # the forced call, as sampled
    assert engine.given[1][0] == ids[0] + ids[1] + ids[2]  # turn 2 was generated from the record
    assert ids[3] == engine.returned[1][0][0].token_ids.tolist()
    lp = [unpack_f32(t.logprobs).tolist() for t in traj.turns if t.role == "assistant"]
    assert lp[1] == pytest.approx([c.logprob for c in r2.choices[0].logprobs.content], abs=1e-6)
    assert [t.policy_version for t in traj.turns if t.role == "assistant"] == [7, 7]
    assert r2.usage.prompt_tokens == len(engine.given[1][0]) and traj.tokens == len(ids[1]) + len(ids[3])
    logp, batch = learner_logprobs(model_dir, [traj])
    diff = max_diff(logp, batch)
    print(
        f"endpoint (openai client) learner vs engine max |dlogp| = {diff:.2e} over {int(batch['loss_mask'].sum())} tokens"
    )
    assert diff <= 1e-4
    calls = json.loads(traj.artifacts["endpoint_calls"])
    assert [c["version"] for c in calls] == [7, 7] and calls[1]["prompt_tokens"] == len(engine.given[1][0])


async def test_drift_is_counted_the_generated_ids_kept_and_shown(model_dir, capsys):
    probe = RecordingEngine(model_dir).tokenizer
    hello = encode_text(probe, "hello there") + [probe.eos_token_id]
    engine = ForcedEngine(model_dir, forced=[hello, hello, hello])
    ep = await served(engine)
    try:
        trajs = {}
        for edit in (False, True):
            key = ep.open_episode(task(int(edit)))
            c = client(ep, key)
            messages = [{"role": "user", "content": "hi"}]
            r = await c.chat.completions.create(model="m", messages=messages, max_tokens=8)
            said = r.choices[0].message.content
            assert said == "hello there"
            messages += [{"role": "assistant", "content": "HELLO, EDITED" if edit else said}]
            messages += [{"role": "user", "content": "and?"}]
            await c.chat.completions.create(model="m", messages=messages, max_tokens=8)
            trajs[edit] = ep.close_episode(key)
    finally:
        await ep.stop()
    assert (trajs[False].drift, trajs[True].drift) == (0, 1)
    for traj in trajs.values():  # either way the model's own ids stay in the record
        assert unpack_i32(traj.turns[1].token_ids).tolist() == hello
        stored = sum((unpack_i32(t.token_ids).tolist() for t in traj.turns[:3]), [])
        assert stored == engine.given[-1][0] if traj is trajs[True] else True
    assert "HELLO" not in "".join(t.text for t in trajs[True].turns)
    from rlbus.commands.samples import compact_record
    from rlbus.run.monitor import DomainRewards

    dr = DomainRewards()
    for traj in trajs.values():
        dr.add(glance_reward(encode(Reward(run_id="ep", trajectory=traj, reward=0.0))))
    assert dr.as_dict()["drift"] == {"calls": 1, "episodes": 1}
    assert compact_record(1, Reward(run_id="ep", trajectory=trajs[True], reward=0.0))["drift"] == 1


async def _status(ep, key: str | None, body: bytes | dict, path: str = "/chat/completions") -> tuple[int, dict]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=ep.base_url) as http:
        r = await http.post(path, content=data, headers=headers | {"Content-Type": "application/json"})
    return r.status_code, r.json()


async def test_the_endpoint_refuses_what_it_must(model_dir):
    engine = ForcedEngine(model_dir)
    ep = await served(engine, max_episodes=2, max_n=2, max_body_bytes=4096)
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        mine, other = ep.open_episode(task(0)), ep.open_episode(task(1))
        with pytest.raises(Exception, match="episodes open"):
            ep.open_episode(task(2))
        with pytest.raises(openai.AuthenticationError, match="unknown key"):
            await client(ep, "rlbus-ep-not-a-key").chat.completions.create(**ok)
        assert (await _status(ep, None, ok))[0] == 401
        status, err = await _status(ep, mine, b'{"messages": [')
        assert status == 400 and "not JSON" in err["error"]["message"]
        status, err = await _status(ep, mine, ok | {"messages": [{"role": "user", "content": "x" * 5000}]})
        assert status == 413 and "max_body_bytes" in err["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="over the limit"):
            await client(ep, mine).chat.completions.create(**ok | {"n": 3})
        with pytest.raises(openai.BadRequestError, match="top_p"):
            await client(ep, mine).chat.completions.create(**ok | {"top_p": 0.9})
        r = await client(ep, mine).chat.completions.create(**ok | {"n": 2})
        assert len(r.choices) == 2
        await client(ep, other).chat.completions.create(**ok)
        a, b = ep.close_episode(mine), ep.close_episode(other)
        assert a.task_id == "t0" and b.task_id == "t1" and len(a.turns) == len(b.turns) == 2  # never mixed
        with pytest.raises(openai.APIStatusError, match="episode ended") as late:
            await client(ep, mine).chat.completions.create(**ok)
        assert late.value.status_code == 409
    finally:
        await ep.stop()


async def test_limits_end_the_episode_with_length_or_timeout(model_dir):
    probe = RecordingEngine(model_dir).tokenizer
    long = encode_text(probe, "one two three four five six seven eight nine ten")
    assert len(long) > 6
    engine = ForcedEngine(model_dir, forced=[long])
    ep = await served(engine, episode_token_budget=6, episode_timeout_s=1.0)
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "temperature": 0}
    try:
        key = ep.open_episode(task())
        r = await client(ep, key).chat.completions.create(**ok)
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"  # the budget caps it
        msgs = ok["messages"] + [{"role": "assistant", "content": r.choices[0].message.content or ""}]
        with pytest.raises(openai.BadRequestError, match="length"):  # spent: the next call ends the episode
            await client(ep, key).chat.completions.create(**ok | {"messages": msgs + [ok["messages"][0]]})
        traj = ep.close_episode(key)
        assert traj.finish_reason == "length" and traj.tokens == 6
        slow = ep.open_episode(task(1))
        await asyncio.sleep(1.1)
        with pytest.raises(openai.APIStatusError, match="timeout"):
            await client(ep, slow).chat.completions.create(**ok)
        assert ep.close_episode(slow).finish_reason == "timeout"
    finally:
        await ep.stop()


async def test_streaming_completions_and_models(model_dir):
    probe = RecordingEngine(model_dir).tokenizer
    engine = ForcedEngine(model_dir, forced=[encode_text(probe, "one two three") + [probe.eos_token_id]] * 2)
    ep = await served(engine)
    try:
        key = ep.open_episode(task())
        c = client(ep, key)
        models = await c.models.list()
        assert [m.id for m in models.data] == ["rlbus-policy"]
        stream = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count"}], stream=True, stop=[" three"]
        )
        chunks = [ch async for ch in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert text == "one two" and chunks[-1].choices[0].finish_reason == "stop"
        traj = ep.close_episode(key)
        kept = unpack_i32(traj.turns[1].token_ids).tolist()  # cut just past the stop string it generated
        assert probe.decode(kept) == "one two three" and len(unpack_f32(traj.turns[1].logprobs)) == len(kept)
        key2 = ep.open_episode(task(1))
        done = await client(ep, key2).completions.create(model="m", prompt="Count: ", max_tokens=16)
        assert (
            done.choices[0].text == "one two three"
            and done.usage.completion_tokens == len(encode_text(probe, "one two three")) + 1
        )
    finally:
        await ep.stop()


def test_a_wildcard_host_needs_consent():
    with pytest.raises(ValueError, match="allow_any_host"):
        RunConfig.model_validate({"rollout": {"endpoint": {"host": "0.0.0.0"}}})
    assert RunConfig.model_validate({"rollout": {"endpoint": {"host": "0.0.0.0", "allow_any_host": True}}})


async def test_with_n_choices_the_one_the_harness_continued_is_recorded(model_dir):
    engine = ForcedEngine(model_dir)
    ep = await served(engine)
    try:
        key = ep.open_episode(task())
        c = client(ep, key)
        messages = [{"role": "user", "content": "hi"}]
        torch.manual_seed(3)
        r = await c.chat.completions.create(model="m", messages=messages, n=2, max_tokens=8, temperature=1.0)
        texts = [ch.message.content for ch in r.choices]
        assert texts[0] != texts[1]
        messages += [{"role": "assistant", "content": texts[1]}, {"role": "user", "content": "more"}]
        await c.chat.completions.create(model="m", messages=messages, max_tokens=4)
        traj = ep.close_episode(key)
    finally:
        await ep.stop()
    assert unpack_i32(traj.turns[1].token_ids).tolist() == engine.returned[0][0][1].token_ids.tolist()[:8]


async def test_the_rollout_worker_serves_the_endpoint_on_its_current_weights(
    js, nats_url, run_id, tmp_path, drop_run, model_dir, monkeypatch
):
    """`rollout.endpoint.enabled`: the worker serves from its start to its stop, on the loaded version."""
    from transformers import AutoModelForCausalLM

    from bus.conn import ensure_topology
    from bus.session import WorkerContext
    from bus.subjects import Registry
    from learner.weights import publish_version
    from rollout_workers.worker import run as run_rollout

    started: list[Endpoint] = []
    real_serve = Endpoint.serve

    async def serve_and_note(self):  # the real serve; the test only learns which endpoint started
        url = await real_serve(self)
        started.append(self)
        return url

    monkeypatch.setattr(Endpoint, "serve", serve_and_note)
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    await publish_version(js, reg, AutoModelForCausalLM.from_pretrained(str(model_dir)), 3, 3, {})
    cfg = RunConfig.model_validate(
        {"model": {"path": str(model_dir)}, "rollout": {"engine": "hf", "endpoint": {"enabled": True}}}
    )
    ctx = WorkerContext(
        run_id=run_id, nats_url=nats_url, run_path=tmp_path / "run", until_idle=8.0, configured_model=str(model_dir)
    )
    worker = asyncio.create_task(run_rollout(cfg, ctx))
    for _ in range(300):
        if started or worker.done():
            break
        await asyncio.sleep(0.1)
    assert started, worker.exception() if worker.done() else "the endpoint never started"
    ep = started[0]
    key = ep.open_episode(task())
    models = await client(ep, key).models.list()
    assert models.data[0].model_extra["rlbus_version"] == 3
    await client(ep, key).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ep.close_episode(key).policy_version == 3
    await asyncio.wait_for(worker, 60)
    with pytest.raises(openai.APIConnectionError):  # stopped with the worker
        await client(ep, ep.open_episode(task(1))).models.list()
