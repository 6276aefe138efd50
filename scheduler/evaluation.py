"""Greedy regression evaluation on fixed, seeded, content-hashed held-out sets, per domain.

Guarantees:
- Each eval set is a pure function of (domain kind, seed, n, level); its sha256 travels
  with every `EvalResult`, so scores from different runs are comparable only when the
  hashes match. Training samplers exclude these problems.
- Scoring uses the same verifier logic as training, on greedy (temperature 0) output, from
  the same prompts: rendered by `schemas.chat` for the engine's tokenizer (its chat
  template when it has one), as rollout renders them.
- `arith` is single-turn; `tool_calc` runs the same multi-turn agent loop as rollout
  workers (`rollout_workers.agent`), its python calls in fresh sandboxes. These two are
  scored here (`local`) or through the pipeline.
- Any other domain whose source has `eval_problems(n, seed)` (`producers.domains`) gets
  that set as kind `drawn`, scored only through the pipeline (`scheduler.pipeline_eval`:
  its tasks' own verifiers and hidden gold); `EvalSuite.evaluate` never scores it.
- Every set carries `purpose`: `heldout` for a `heldout` (zero-shot) domain, else `train`.
- Domains without an evaluator are skipped (listed by `EvalSuite.skipped`).
- Identical local sets (same kind, content hash and budgets: e.g. many `arith` copies under
  distinct names) are generated and scored once per `evaluate` call; each domain reports
  that score (greedy decoding: the same computation).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from producers.domains import arith, tool_calc
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
            purpose = "heldout" if dc.heldout else "train"
            if kind == "arith":
                problems, digest = eval_set(ec.seed, ec.n, ec.difficulty)
                suite.sets[name] = {"kind": kind, "problems": problems, "sha256": digest, "max_tokens": max_tokens}
            elif kind == "tool_calc":
                problems = tool_calc.heldout_set(ec.seed, ec.n, dc.initial_level)
                digest = hashlib.sha256(json.dumps([p.expression for p in problems]).encode()).hexdigest()
                suite.sets[name] = {"kind": kind, "problems": problems, "sha256": digest, "max_tokens": max_tokens,
                                    "max_turns": max(2, dc.max_turns), "tool_format": dc.tool_format}
            elif (drawn := drawn_set(cfg, name, kind)) is not None:
                suite.sets[name] = drawn
            else:
                suite.skipped.append(name)
                continue
            suite.sets[name]["purpose"] = purpose
        return suite

    def local(self) -> list[str]:
        """Sets this process can score (`evaluate`): every kind but `drawn`."""
        return [d for d, s in self.sets.items() if s["kind"] != "drawn"]

    def pipeline_only(self) -> list[str]:
        """Sets only the pipeline can score (kind `drawn`)."""
        return [d for d, s in self.sets.items() if s["kind"] == "drawn"]

    def purpose(self, domain: str) -> str:
        """`heldout` or `train` (the general set and unknown names: `train`)."""
        return self.sets.get(domain, {}).get("purpose", "train")

    async def evaluate(self, engine, open_sandbox) -> dict[str, tuple[float, int, str]]:
        """domain -> (score, n, sha256) for the engine's current weights (the `local` sets)."""
        import asyncio

        out, memo = {}, {}
        for name, s in self.sets.items():
            if s["kind"] == "drawn":
                continue  # pipeline only
            key = (s["kind"], s["sha256"], s["max_tokens"], s.get("max_turns"), s.get("tool_format"))
            if key in memo:  # the same set under another domain name (e.g. a hundred arith copies)
                out[name] = (memo[key], len(s["problems"]), s["sha256"])
                continue
            if s["kind"] == "arith":
                score = await asyncio.to_thread(greedy_accuracy, engine, s["problems"], s["max_tokens"])
            else:
                score = await tool_calc_accuracy(engine, s["problems"], s["max_tokens"], s["max_turns"], open_sandbox,
                                                 tool_format=s["tool_format"])
            memo[key] = score
            out[name] = (score, len(s["problems"]), s["sha256"])
        return out


def drawn_set(cfg, name: str, kind: str) -> dict | None:
    """The eval set a domain's source gives through `eval_problems(n, seed)` (kind `drawn`:
    Drawn tasks, content-hashed over prompts, verifiers, public params and hidden gold), or
    None when its kind has none (checked on the factory, so no source is built for nothing)."""
    from producers.domains import DomainUnavailable, eval_problems, get_factory, make_source

    factory = get_factory(kind)
    if isinstance(factory, type) and not hasattr(factory, "eval_problems"):
        return None
    ec, sc = cfg.scheduler.eval, cfg.sampler
    try:
        source = make_source("eval", name, cfg)
    except DomainUnavailable:
        return None  # the sampler disables it too (and logs why)
    drawn = eval_problems(source, ec.n, ec.seed)
    if not drawn:
        return None
    rows = [[[m.model_dump() for m in d.task.prompt], d.task.verifier, d.task.verifier_params, d.hidden] for d in drawn]
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
    return {"kind": "drawn", "problems": drawn, "sha256": digest,
            "max_tokens": sc.domains[name].max_tokens or sc.max_tokens}
