"""The agentic findoc variant (`params.agentic = true`): the filing is a file in the episode's
sandbox, not in the prompt; the policy greps and reads line ranges with the document tools and
answers in its final turn. A scripted episode in a real bwrap sandbox greps the file, reads the
lines it found, answers with the gold and scores 1 through the real verifier."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from producers.domains import make_source
from producers.domains.findoc import AGENTIC_TOOLS, FILE
from rollout_workers.agent import run_episodes
from rollout_workers.engines.scripted_engine import ScriptedEngine
from sandbox_workers.async_sandbox import LocalAsyncSandbox
from sandbox_workers.process import bwrap_path
from schemas.config import load_config
from tests.test_findoc import as_trajectory, config, round_trip, tokenizer_dir  # noqa: F401 (fixture)
from verifier_workers.worker import score


def agentic_config(tmp_path, tok, max_turns: int = 8, **params):
    """A findoc domain with `agentic = true` and `max_turns` (the plain kind's test config otherwise)."""
    params = {"max_prompt_tokens": 100_000, "agentic": "true", **params}
    extra = "".join(f", {k} = {v}" for k, v in params.items())
    p = tmp_path / "agentic.toml"
    p.write_text(
        f'[sampler.domains.findoc]\nmax_level = 3\nmax_turns = {max_turns}\nparams = {{ tokenizer = "{tok}"{extra} }}\n'
    )
    return load_config(p)


def test_the_document_is_a_file_and_not_in_the_prompt(tmp_path, tokenizer_dir):
    plain = make_source("r1", "findoc", config(tmp_path, tokenizer_dir))
    agentic = make_source("r1", "findoc", agentic_config(tmp_path, tokenizer_dir, max_prompt_tokens=300))
    for level in (1, 3):  # level 3 (2048 tokens) is over max_prompt_tokens: published all the same
        a, p = agentic.make_task(random.Random(0), level, 4), plain.make_task(random.Random(0), level, 4)
        body = a.task.workspace[FILE]
        assert body and body in p.task.prompt[0].content  # the same document the plain kind shows
        assert body not in a.task.prompt[0].content and len(a.task.prompt[0].content) < len(body) / 2
        assert a.task.tools == list(AGENTIC_TOOLS) and a.hidden == p.hidden
        assert a.task.verifier_params == p.task.verifier_params
        assert '<grep path="filing.md"' in a.task.prompt[0].content
        assert '<read_file offset="1" limit="40">' in a.task.prompt[0].content
    with pytest.raises(Exception, match="unknown params"):
        make_source("r1", "findoc", config(tmp_path, tokenizer_dir, agentic_mode="true"))
    with pytest.raises(Exception, match="max_turns >= 2"):
        make_source("r1", "findoc", agentic_config(tmp_path, tokenizer_dir, max_turns=1))


@pytest.mark.skipif(bwrap_path() is None, reason="bwrap not installed (apt-get install -y bubblewrap)")
def test_scripted_episode_greps_reads_and_answers(tmp_path, tokenizer_dir):
    from rlbus.model.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "m", tokenizer="bpe", hidden_size=32, num_layers=1, num_heads=2)
    src = make_source("r1", "findoc", agentic_config(tmp_path, tokenizer_dir, families='["extraction"]'))
    drawn = src.make_task(random.Random(0), 2, 3)
    doc = src.document("train", 2, 3)
    task = drawn.task.model_copy(update={"group_size": 1, "max_turns": 4, "max_tokens": 256})
    steps = [
        {"tool": "grep", "args": {"pattern": "revenue", "path": FILE, "ignore_case": True, "max_matches": 5}},
        {"tool": "read_file", "args": {"path": FILE, "offset": 1, "limit": 12}},
        {"text": doc.question.completion},
    ]
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / f"{task.task_id}.json").write_text(json.dumps({"task_id": task.task_id, "steps": steps}))
    engine = ScriptedEngine(str(model), str(tmp_path / "scripts"))

    async def open_one(repo: bool = False):
        return await LocalAsyncSandbox.open("process", timeout=10)

    (ep,) = asyncio.run(run_episodes(engine, [task], version=lambda: 0, open_sandbox=open_one, context_budget=1 << 16))
    tools = [c.tool for c in ep.tool_calls]
    assert tools == ["grep", "read_file"], ep.tool_calls
    grep, read = (t.text for t in ep.turns if t.role == "tool")
    assert "revenue" in grep.lower() and ":" in grep  # the matching lines, numbered
    first_line = doc.body.splitlines()[0]
    assert first_line.strip() and first_line in read
    reward = score(as_trajectory(task, ep.final_text), round_trip(drawn.hidden))
    assert ep.finish_reason == "stop" and reward.reward == 1.0, (ep.final_text, reward)
