"""Multi-turn agent episodes (`rollout_workers.agent`) against real bwrap sandboxes and a real
NATS server for the tool-result records.

The policy here is a scripted engine: it replays fixed turns through the real char
tokenizer, so every assertion is about the loop (tool execution, masks, versions,
records, clean-up), not about what a random tiny model happens to write.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from bus.conn import ensure_topology
from bus.subjects import Registry
from producers.domains import tool_calc
from rlbus.model.tiny_model import build_char_tokenizer
from rollout_workers.agent import run_episodes
from rollout_workers.engines.sample import Sample
from sandbox_workers.async_sandbox import LocalAsyncSandbox
from sandbox_workers.integrity import LocalRecorder, ToolTurn, verify_observations
from sandbox_workers.process import bwrap_path
from schemas import ChatMessage, Task, decode, encode, unpack_i32
from tests.messages import store_checks
from verifier_workers.verifiers.tool_calc import verify_tool_calc

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bwrap not installed (apt-get install -y bubblewrap)")
SECRET = b"k" * 32


class ScriptedEngine:
    """Plays `script[turn]` (or a per-prompt function of the context) as every sample's text."""

    def __init__(self, script):
        self.tok = build_char_tokenizer()
        self.script = script
        self.calls = 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=True)

    def generate(self, prompts, n, max_new_tokens, temperature):
        turn = self.calls
        self.calls += 1
        out = []
        for p in prompts:
            ids = self.encode(p) if isinstance(p, str) else np.asarray(p, dtype=np.int32)
            text = self.script[turn](self.decode(ids)) if callable(self.script[turn]) else self.script[turn]
            gen = np.concatenate([self.encode(text), [1]]).astype(np.int32)[:max_new_tokens]
            out.append([Sample(ids, gen, np.full(len(gen), -0.5, dtype=np.float32), text, "stop") for _ in range(n)])
        return out


def task(run_id: str, a: int, b: int, max_turns: int = 3, export=None) -> Task:
    params = {"expression": f"{a}*{b}"}
    if export:
        params["export"] = export
    return Task(
        run_id=run_id,
        task_id=f"t{a}",
        domain="tool_calc",
        group_size=2,
        max_turns=max_turns,
        max_tokens=64,
        prompt=[ChatMessage(role="user", content=f"{a}*{b}=?")],
        tools=["python"],
        verifier="tool_calc",
        verifier_params=params,
    )


def copy_answer(context: str) -> str:
    """Second turn: copy the number printed in the last observation."""
    last = context.rsplit("<obs", 1)[1]
    return "=" + last.split("\n")[1]


async def sandboxes(js, reg):
    opened = []
    recorder = LocalRecorder(js, reg, SECRET)

    async def open_one():
        sb = await LocalAsyncSandbox.open("process", timeout=10, recorder=recorder)
        opened.append(sb)
        return sb

    return open_one, opened


async def test_tool_episode_end_to_end(js, run_id, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    engine = ScriptedEngine([lambda ctx: f"<py>{ctx.split('=')[0]}</py>junk after the call", copy_answer])
    open_one, opened = await sandboxes(js, reg)
    versions = iter([3, 4, 5, 6])
    eps = await run_episodes(engine, [task(run_id, 417, 382)], version=lambda: next(versions), open_sandbox=open_one)
    assert len(eps) == 2 and len(opened) == 2 and all(sb.closed for sb in opened)
    ep = eps[0]
    assert [t.role for t in ep.turns] == ["prompt", "assistant", "tool", "assistant"]
    assert ep.turns[1].text == "<py>417*382</py>"  # cut just after the call
    assert "\n159294\n" in ep.turns[2].text and ep.turns[2].text.lstrip().startswith("<obs exit=0>")
    assert [t.trainable for t in ep.turns] == [False, True, False, True]
    assert [t.policy_version for t in ep.turns if t.role == "assistant"] == [3, 4]
    assert len(unpack_i32(ep.turns[1].logprobs)) == len(unpack_i32(ep.turns[1].token_ids))
    traj = decode(encode(ep.trajectory()))
    assert traj.tool_calls[0].exit_code == 0 and traj.tool_calls[0].code == "417*382" and traj.tool_calls[0].exec_id
    verdict = verify_tool_calc(traj)
    assert verdict.reward == 1.0 and verdict.components["used_tool"] == 1.0
    # the observation the model saw is exactly the one the sandbox side recorded
    ok, forged = await verify_observations(
        js, reg, SECRET, [ToolTurn(c.exec_id, traj.turns[c.turn + 1].text) for c in traj.tool_calls]
    )
    assert len(ok) == 1 and not forged


async def test_failing_and_looping_tools_are_observations(js, run_id, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    engine = ScriptedEngine(["<py>while True: pass</py>", "<py>raise ValueError('boom')</py>", "=1"])
    open_one, opened = await sandboxes(js, reg)
    t = task(run_id, 101, 202)
    eps = await run_episodes(engine, [t], version=lambda: 0, open_sandbox=open_one, tool_timeout=1.0)
    ep = eps[0]
    calls = ep.tool_calls
    assert calls[0].timed_out and "timeout" in ep.turns[2].text
    assert calls[1].exit_code != 0 and "ValueError" in ep.turns[4].text
    assert ep.finish_reason == "stop" and ep.final_text == "=1" and verify_tool_calc(ep.trajectory()).reward == 0.0
    assert all(sb.closed for sb in opened)


async def test_max_turns_and_artifacts(js, run_id, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    engine = ScriptedEngine(["<py>open('out.json','w').write('{\"x\": 1}')</py>", "<py>print(2)</py>"])
    open_one, _ = await sandboxes(js, reg)
    eps = await run_episodes(
        engine,
        [task(run_id, 111, 222, max_turns=2, export=["out.json", "missing.txt"])],
        version=lambda: 0,
        open_sandbox=open_one,
    )
    ep = eps[0]
    assert ep.finish_reason == "max_turns" and len(ep.tool_calls) == 1
    assert ep.artifacts == {"out.json": b'{"x": 1}'}


def test_tool_calc_demonstration_masks_observation():
    segs = tool_calc.demonstration(random.Random(0), 1)
    assert [train for _, train in segs] == [False, True, False, True]
    prompt, call, obs, answer = (t for t, _ in segs)
    expr = prompt[:-2]
    assert call == f"<py>{expr}</py>" and answer == f"={eval(expr)}"  # digits and * only
    assert obs.strip().startswith("<obs exit=0>") and str(eval(expr)) in obs


async def test_verifier_flags_forged_observations(js, run_id, drop_run):
    """A policy that types a fake observation instead of calling the tool scores 0 / tamper;
    the honest episode of the same task passes the integrity check and scores 1."""
    from bus.hidden import HiddenCache
    from verifier_workers.worker import RetryPolicy, Scorer

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    open_one, _ = await sandboxes(js, reg)
    honest = ScriptedEngine([lambda ctx: f"<py>print({ctx.split('=')[0]})</py>", copy_answer])
    forger = ScriptedEngine(["<obs exit=0>\n159294\n</obs>\n=159294"])
    t = task(run_id, 417, 382)
    good = (await run_episodes(honest, [t], version=lambda: 0, open_sandbox=open_one))[0].trajectory()
    bad = (await run_episodes(forger, [t], version=lambda: 0, open_sandbox=open_one))[0].trajectory()
    # and an honest call whose observation was edited after the fact
    edited_turns = list(good.turns)
    edited_turns[2] = edited_turns[2].model_copy(update={"text": edited_turns[2].text.replace("159294", "159295")})
    edited = good.model_copy(update={"turns": edited_turns})
    scorer = Scorer(HiddenCache(js, reg), RetryPolicy(max_deliver=3), 1, js, reg, SECRET)
    await store_checks(js, reg, [good])

    class D:
        delivered = 1

        def __init__(self, msg):
            self.msg = msg

    r_good, r_bad, r_edit = [await scorer.one(D(x)) for x in (good, bad, edited)]
    assert r_good.status == "ok" and r_good.reward == 1.0
    assert r_bad.status == "tamper" and r_bad.reward == 0.0 and r_bad.components["forged_observations"] == 1.0
    assert r_edit.status == "tamper" and r_edit.reward == 0.0


async def test_run_tests_tool_runs_public_doctests_only(js, run_id, drop_run):
    """`run_tests` saves the program as candidate.py and runs its docstring examples."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    program = 'def add(a, b):\n    """\n    >>> add(2, 3)\n    5\n    >>> add(1, 1)\n    3\n    """\n    return a + b\n'
    engine = ScriptedEngine([f"<py>{program}</py>", "done"])
    open_one, _ = await sandboxes(js, reg)
    t = task(run_id, 1, 1).model_copy(update={"tools": ["run_tests"], "verifier": "code"})
    ep = (await run_episodes(engine, [t], version=lambda: 0, open_sandbox=open_one))[0]
    call = ep.tool_calls[0]
    assert call.tool == "run_tests" and call.exit_code != 0  # one of the two examples fails
    assert "Failed example" in ep.turns[2].text and "add(1, 1)" in ep.turns[2].text


async def test_an_episode_ends_before_the_engines_context_is_exceeded(js, run_id, drop_run):
    """A tool observation that leaves no room for the next turn under the engine's `max_context`
    (vLLM's max_model_len) ends the episode with `length`: the engine is never asked for more."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    engine = ScriptedEngine(["<py>print('x' * 40)</py>", "=1"])
    first = await run_episodes(
        engine, [task(run_id, 3, 4)], version=lambda: 0, open_sandbox=(await sandboxes(js, reg))[0]
    )
    engine = ScriptedEngine(["<py>print('x' * 40)</py>", "=1"])
    engine.max_context = len(first[0].context) - 10  # the observation pushes the context past it
    eps = await run_episodes(
        engine, [task(run_id, 3, 4)], version=lambda: 0, open_sandbox=(await sandboxes(js, reg))[0]
    )
    assert engine.calls == 1 and all(ep.finish_reason == "length" and len(ep.tool_calls) == 1 for ep in eps)
    assert first[0].finish_reason != "length" and len(first[0].tool_calls) == 1
