"""Greedy regression evaluation on fixed, seeded, content-hashed held-out sets, per domain.

Guarantees:
- Each eval set is a pure function of (domain kind, seed, n, level); its sha256 travels
  with every `EvalResult`, so scores from different runs are comparable only when the
  hashes match. Training samplers exclude these problems.
- Scoring uses the same verifier logic as training, on greedy (temperature 0) output, from
  the same prompts: rendered by `schemas.chat` for the engine's tokenizer (its chat
  template when it has one), as rollout renders them.
- `arith` is single-turn; `tool_calc` runs the same multi-turn agent loop as rollout
  workers (`rollout_workers.agent`), its python calls in fresh sandboxes.
- Domains without an evaluator are skipped (listed by `EvalSuite.skipped`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from producers import arith, tool_calc
from schemas import ChatMessage, Task
from schemas.answers import arith_answer, calc_answer
from schemas.chat import prompt_input, tokenizer_of, user_prompt


def eval_set(seed: int, n: int, difficulty: int) -> tuple[list[arith.ArithProblem], str]:
    """The arith held-out problems and their content hash."""
    problems = arith.heldout_set(seed, n, difficulty)
    digest = hashlib.sha256(json.dumps([(p.expression, p.answer) for p in problems]).encode()).hexdigest()
    return problems, digest


def greedy_accuracy(engine, problems: list[arith.ArithProblem], max_tokens: int, batch: int = 256) -> float:
    """Fraction of arith problems whose greedy completion is exactly the answer."""
    correct = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        tok = tokenizer_of(engine)
        groups = engine.generate([prompt_input(tok, user_prompt(p.prompt)) for p in chunk], 1, max_tokens, 0.0)
        correct += sum(arith_answer(g[0].text) == p.answer for p, g in zip(chunk, groups, strict=True))
    return correct / max(1, len(problems))


async def tool_calc_accuracy(engine, problems: list[tool_calc.Problem], max_tokens: int, max_turns: int,
                             open_sandbox, batch: int = 64, tool_format: str = "tags") -> float:
    """Fraction of tool_calc problems answered exactly by greedy agent episodes."""
    from rollout_workers.agent import run_episodes

    correct = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        tasks = [Task(run_id="eval", task_id=p.expression, domain="tool_calc", group_size=1, max_turns=max_turns,
                      max_tokens=max_tokens, temperature=0.0, prompt=[ChatMessage(role="user", content=p.prompt)],
                      tools=[tool_calc.TOOL], tool_format=tool_format, verifier="tool_calc",
                      verifier_params={"expression": p.expression})
                 for p in chunk]
        episodes = await run_episodes(engine, tasks, version=lambda: 0, open_sandbox=open_sandbox)
        correct += sum(calc_answer(ep.final_text) == p.answer for ep, p in zip(episodes, chunk, strict=True))
    return correct / max(1, len(problems))


@dataclass
class EvalSuite:
    """The run's pinned eval sets: domain -> (problems, sha256, settings)."""

    sets: dict[str, dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg) -> EvalSuite:
        from producers.domains import kind_of

        ec, sc = cfg.scheduler.eval, cfg.sampler
        suite = cls()
        for name, dc in sc.domains.items():
            kind = kind_of(name, dc)
            max_tokens = dc.max_tokens or sc.max_tokens
            if kind == "arith":
                problems, digest = eval_set(ec.seed, ec.n, ec.difficulty)
                suite.sets[name] = {"kind": kind, "problems": problems, "sha256": digest, "max_tokens": max_tokens}
            elif kind == "tool_calc":
                problems = tool_calc.heldout_set(ec.seed, ec.n, dc.initial_level)
                digest = hashlib.sha256(json.dumps([p.expression for p in problems]).encode()).hexdigest()
                suite.sets[name] = {"kind": kind, "problems": problems, "sha256": digest, "max_tokens": max_tokens,
                                    "max_turns": max(2, dc.max_turns), "tool_format": dc.tool_format}
            else:
                suite.skipped.append(name)
        return suite

    async def evaluate(self, engine, open_sandbox) -> dict[str, tuple[float, int, str]]:
        """domain -> (score, n, sha256) for the engine's current weights."""
        import asyncio

        out = {}
        for name, s in self.sets.items():
            if s["kind"] == "arith":
                score = await asyncio.to_thread(greedy_accuracy, engine, s["problems"], s["max_tokens"])
            else:
                score = await tool_calc_accuracy(engine, s["problems"], s["max_tokens"], s["max_turns"], open_sandbox,
                                                 tool_format=s["tool_format"])
            out[name] = (score, len(s["problems"]), s["sha256"])
        return out
