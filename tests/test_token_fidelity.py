"""Token in, token out with the BPE tokenizer: what the engine was given and sampled is
exactly what the trajectory stores and what the learner scores.

- Decoding and re-encoding BPE ids changes them (shown), so any re-tokenization between
  turns would train the learner on tokens the policy never produced.
- An agent episode on a real HFEngine (tiny BPE model, chat template) and a real bwrap
  sandbox: turn 1 is scripted as a NON-canonical tokenization of a tool call (a random
  model never writes one; its log-probs are the model's own, teacher-forced), turn 2 is
  genuinely sampled on the id context. The stored ids equal the concatenation of what
  the engine was given and sampled; the tool turn is the template's tool message encoded
  alone.
- The learner's log-probs (`learner.step.load_models`, `learner.batch.pack_samples`,
  `token_logprobs`) recomputed for the stored tokens equal the engine's within 1e-4 (fp32).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from learner.batch import pack_samples, token_logprobs
from learner.step import load_models
from rlbus.model.tiny_model import build_tiny_model
from rollout_workers.agent import run_episodes
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.engines.sample import Sample
from rollout_workers.worker import single_turn_trajectories
from sandbox_workers.async_sandbox import LocalAsyncSandbox
from sandbox_workers.process import bwrap_path
from schemas import ChatMessage, Reward, Task, unpack_f32, unpack_i32
from schemas.chat import encode_text, prompt_ids, tool_turn, user_prompt
from schemas.config import RunConfig
from schemas.tool_protocol import tool_turn_text

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256)
CALL = "<py>417*382</py>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bpe") / "m", tokenizer="bpe", seed=3, **TINY)


def char_ids(tok, text: str) -> list[int]:
    """A valid but non-canonical tokenization: one token per character."""
    return [i for ch in text for i in encode_text(tok, ch)]


def test_decode_then_encode_changes_bpe_ids(model_dir):
    tok = HFEngine(str(model_dir)).tokenizer
    ids = char_ids(tok, CALL)
    assert tok.decode(ids) == CALL
    assert encode_text(tok, tok.decode(ids)) != ids  # the counterexample: re-encoding merges
    assert len(encode_text(tok, CALL)) < len(ids)


class RecordingEngine(HFEngine):
    """A real HFEngine that records what it was given and what it returned; its first call's
    samples start with `first` (teacher-forced log-probs from the same model)."""

    def __init__(self, path, first: list[int] | None = None):
        super().__init__(str(path))
        self.first, self.given, self.returned = first, [], []

    def teacher_forced(self, prompt: np.ndarray, ids: np.ndarray) -> np.ndarray:
        seq = torch.as_tensor(np.concatenate([prompt, ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(self.model(seq).logits[0, :-1].float(), dim=-1)
        return logp[len(prompt) - 1 :].gather(-1, seq[0, len(prompt) :, None]).squeeze(-1).numpy().astype(np.float32)

    def generate(self, prompts, n, max_new_tokens, temperature):
        groups = super().generate(prompts, n, max_new_tokens, temperature)
        if self.first is not None and not self.given:
            forced = []
            for g in groups:
                row = []
                for s in g:
                    ids = np.concatenate([np.asarray(self.first, dtype=np.int32), s.token_ids]).astype(np.int32)
                    row.append(
                        Sample(
                            s.prompt_ids, ids, self.teacher_forced(s.prompt_ids, ids), self.decode(ids), s.finish_reason
                        )
                    )
                forced.append(row)
            groups = forced
        self.given.append([p if isinstance(p, str) else [int(x) for x in p] for p in prompts])
        self.returned.append(groups)
        return groups


def learner_logprobs(model_dir, trajectories) -> tuple[torch.Tensor, dict]:
    policy, _, pad = load_models(model_dir, RunConfig().learner)
    policy.eval()
    rewards = [Reward(run_id=t.run_id, trajectory=t, reward=1.0) for t in trajectories]
    batch = pack_samples(rewards, pad)
    with torch.no_grad():
        return token_logprobs(policy, batch["input_ids"], batch["attention_mask"]), batch


def max_diff(logp: torch.Tensor, batch: dict) -> float:
    mask = batch["loss_mask"].bool()
    return float((logp[mask] - batch["behavior_logp"][mask]).abs().max())


def test_single_turn_rollout_logprobs_match_the_learner(model_dir):
    engine = HFEngine(str(model_dir))
    torch.manual_seed(0)
    tasks = [
        Task(
            run_id="fid",
            task_id=f"t{i}",
            domain="arith",
            group_size=4,
            max_tokens=12,
            temperature=1.0,
            prompt=user_prompt(q),
            verifier="arith",
        )
        for i, q in enumerate(["12+34=", "What is 417*382? é∑"])
    ]
    groups = engine.generate([prompt_ids(engine.tokenizer, t.prompt) for t in tasks], 4, 12, 1.0)  # left-padded
    trajs = []
    for task, samples in zip(tasks, groups, strict=True):
        for t, s in zip(single_turn_trajectories(task, samples, 0, 0.0, engine.tokenizer), samples, strict=True):
            assert unpack_i32(t.turns[0].token_ids).tolist() == prompt_ids(engine.tokenizer, task.prompt)
            assert t.turns[0].text.startswith("<|im_start|>user\n" + task.prompt[0].content)
            assert unpack_i32(t.turns[1].token_ids).tolist() == s.token_ids.tolist()
            trajs.append(t)
    logp, batch = learner_logprobs(model_dir, trajs)
    diff = max_diff(logp, batch)
    print(f"single-turn learner vs engine max |dlogp| = {diff:.2e} over {int(batch['loss_mask'].sum())} tokens")
    assert diff <= 1e-4


@pytest.mark.skipif(bwrap_path() is None, reason="bwrap not installed (apt-get install -y bubblewrap)")
def test_agent_episode_is_token_in_token_out(model_dir):
    probe = HFEngine(str(model_dir)).tokenizer
    first = char_ids(probe, CALL)
    engine = RecordingEngine(model_dir, first=first)
    tok = engine.tokenizer
    task = Task(
        run_id="fid",
        task_id="t",
        domain="tool_calc",
        group_size=2,
        max_turns=2,
        max_tokens=16,
        temperature=1.0,
        prompt=[ChatMessage(role="user", content="417*382=?")],
        tools=["python"],
        verifier="tool_calc",
        verifier_params={"expression": "417*382"},
    )
    sandboxes = []

    async def open_one():
        sb = await LocalAsyncSandbox.open("process", timeout=10)
        sandboxes.append(sb)
        return sb

    torch.manual_seed(1)
    eps = asyncio.run(run_episodes(engine, [task], version=lambda: 7, open_sandbox=open_one))
    assert len(eps) == 2 and all(sb.closed for sb in sandboxes)
    assert len(engine.given) == 2  # turn 1 (the prompt), turn 2 (both episodes' contexts)
    assert engine.given[0] == [prompt_ids(tok, task.prompt)]  # the chat template's ids, not text
    for k, ep in enumerate(eps):
        roles = [t.role for t in ep.turns]
        assert roles == ["prompt", "assistant", "tool", "assistant"], roles
        ids = [unpack_i32(t.token_ids).tolist() for t in ep.turns]
        assert ids[0] == prompt_ids(tok, task.prompt)
        # the model turn is exactly the sampled ids (cut after the call), not their re-encoding
        assert ids[1] == first and ids[1] != encode_text(tok, ep.turns[1].text)
        # the tool turn is the template's tool message, encoded alone
        obs = ep.turns[2].text.split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0]
        assert "159294" in obs
        assert (ep.turns[2].text, ids[2]) == tool_turn(tok, tool_turn_text(obs))
        # what the engine was given for turn 2 is the stored context; turn 2 is what it sampled
        assert engine.given[1][k] == ids[0] + ids[1] + ids[2]
        assert ids[3] == engine.returned[1][k][0].token_ids.tolist()
        stored = sum(ids, [])
        assert stored == engine.given[1][k] + engine.returned[1][k][0].token_ids.tolist()
        # re-encoding the episode's text would not give the same tokens
        text = tok.decode(stored, skip_special_tokens=False)
        assert encode_text(tok, text) != stored
        assert [t.policy_version for t in ep.turns if t.role == "assistant"] == [7, 7]
        assert len(unpack_f32(ep.turns[3].logprobs)) == len(ids[3])
    logp, batch = learner_logprobs(model_dir, [ep.trajectory() for ep in eps])
    diff = max_diff(logp, batch)
    print(f"agent learner vs engine max |dlogp| = {diff:.2e} over {int(batch['loss_mask'].sum())} tokens")
    assert diff <= 1e-4
