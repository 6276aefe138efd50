"""Greedy regression evaluation on fixed, seeded, content-hashed held-out sets, per domain.

The sets are data (`producers.eval_set.EvalSet`): each domain's source gives its own through
the hook `eval_set(n, seed, level)`, and this module only reads what a set says (its tasks,
how it is scored locally, its content hash). No domain kind is named here.

Guarantees:
- Each eval set is a pure function of (domain config, seed, n, level); its sha256 travels
  with every `EvalResult`, so scores from different runs are comparable only when the
  hashes match. Training samplers exclude these problems.
- Local scoring (`EvalSuite.evaluate`) uses greedy (temperature 0) output from the sets'
  own task prompts, rendered by `schemas.chat` for the engine's tokenizer (its chat template
  when it has one), as rollout renders them: one completion per prompt for a `generate`
  set; for an `episodes` set the same multi-turn agent loop as rollout workers
  (`rollout_workers.agent`), tool calls in fresh sandboxes. An item is correct iff the set's
  `answer` of the final text equals its gold.
- Sets without local scoring (`local` None: e.g. a repository or reasoning-gym domain's
  drawn tasks) are scored only through the pipeline (`scheduler.pipeline_eval`: their
  tasks' own verifiers and hidden gold); `EvalSuite.evaluate` never scores them.
- Every set carries `purpose`: `heldout` for a `heldout` (zero-shot) domain, else `train`.
- Domains whose source has no eval set are skipped (listed by `EvalSuite.skipped`).
- Identical local sets (same content hash, scoring and budgets: e.g. many `arith` copies
  under distinct names) are generated and scored once per `evaluate` call; each domain
  reports that score (greedy decoding: the same computation).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import groupby

from producers.eval_set import EvalItem, EvalSet
from schemas.chat import prompt_input, tokenizer_of


def _chunks(items: tuple[EvalItem, ...], batch: int):
    """Consecutive runs of items sharing a token budget, at most `batch` each."""
    for _, same in groupby(items, key=lambda it: it.task.max_tokens):
        run = list(same)
        for i in range(0, len(run), batch):
            yield run[i : i + batch]


def greedy_accuracy(engine, es: EvalSet, batch: int = 256) -> float:
    """Fraction of the set's items whose one greedy completion answers them."""
    correct, tok = 0, tokenizer_of(engine)
    for chunk in _chunks(es.items, batch):
        prompts = [prompt_input(tok, it.task.prompt) for it in chunk]
        groups = engine.generate(prompts, 1, chunk[0].task.max_tokens, 0.0)
        correct += sum(es.correct(it, g[0].text) for it, g in zip(chunk, groups, strict=True))
    return correct / max(1, len(es))


async def episode_accuracy(engine, es: EvalSet, open_sandbox, batch: int = 64) -> float:
    """Fraction of the set's items answered by greedy agent episodes (tools in `open_sandbox`'s sandboxes)."""
    from rollout_workers.agent import run_episodes

    correct = 0
    for chunk in _chunks(es.items, batch):
        episodes = await run_episodes(engine, [it.task for it in chunk], version=lambda: 0, open_sandbox=open_sandbox)
        correct += sum(es.correct(it, ep.final_text) for it, ep in zip(chunk, episodes, strict=True))
    return correct / max(1, len(es))


async def score_locally(engine, es: EvalSet, open_sandbox) -> float:
    """The engine's score on a locally scored set, by the set's `local` mode."""
    if es.local == "generate":
        return await asyncio.to_thread(greedy_accuracy, engine, es)
    if es.local == "episodes":
        return await episode_accuracy(engine, es, open_sandbox)
    raise ValueError(f"eval set {es.domain!r} is scored only through the pipeline")


@dataclass
class EvalSuite:
    """The run's pinned eval sets: domain -> EvalSet."""

    sets: dict[str, EvalSet] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg) -> EvalSuite:
        """Every config domain's eval set (`producers.domains.eval_set_for`), at `scheduler.eval`'s
        n and seed and the domain's own level."""
        from producers.domains import eval_set_for

        ec = cfg.scheduler.eval
        suite = cls()
        for name, dc in cfg.sampler.domains.items():
            es = eval_set_for(cfg, name, ec.n, ec.seed)
            if es is None:
                suite.skipped.append(name)
            else:
                suite.sets[name] = es.with_purpose("heldout" if dc.heldout else "train")
        return suite

    def local(self) -> list[str]:
        """Sets this process can score (`evaluate`)."""
        return [d for d, s in self.sets.items() if s.local is not None]

    def pipeline_only(self) -> list[str]:
        """Sets only the pipeline can score."""
        return [d for d, s in self.sets.items() if s.local is None]

    def purpose(self, domain: str) -> str:
        """`heldout` or `train` (the general set and unknown names: `train`)."""
        s = self.sets.get(domain)
        return "train" if s is None else s.purpose

    async def evaluate(self, engine, open_sandbox) -> dict[str, tuple[float, int, str]]:
        """domain -> (score, n, sha256) for the engine's current weights (the `local` sets)."""
        out, memo = {}, {}
        for name, s in self.sets.items():
            if s.local is None:
                continue  # pipeline only
            key = s.score_key
            if key not in memo:  # else: the same set under another domain name (e.g. a hundred arith copies)
                memo[key] = await score_locally(engine, s, open_sandbox)
            out[name] = (memo[key], len(s), s.sha256)
        return out
