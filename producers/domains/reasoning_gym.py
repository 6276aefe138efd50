"""The `reasoning_gym` domain kind: one reasoning-gym dataset as a domain `rg-<dataset>`.

`sampler.domain_sets.reasoning_gym` expands into one such domain per dataset (see
`schemas.config.sampler`); a hand-written `[sampler.domains.<d>]` with `kind =
"reasoning_gym"` works too. Params: `dataset` (required), `range_mode` (`inclusive`),
`config` (extra fields of the dataset's own config), `max_prompt_chars`, `eval_n` (32).

Guarantees:
- A training task is a pure function of (`run.seed`, domain, level, index) and the params;
  `rng` is not used. Draw `attempt` of index i is entry `v % CHUNK` of the dataset built
  at that level with size CHUNK and seed `derive_seed("train", run.seed, domain, level,
  v // CHUNK)`, where v = i * ATTEMPTS + attempt (dataset objects are cached, a few per
  source). Domain level L is the dataset's L-th valid curriculum level (`schemas.rg_family`).
- Training never draws a question of the eval slice (`eval_set.in_eval_slice` of its
  content hash) nor one longer than `max_prompt_chars`: that draw is skipped, counted in
  `skipped` (`eval_slice`, `prompt_too_long`) and the next attempt is taken; after
  ATTEMPTS the task is skipped (`TaskSkipped`). A generator that raises skips its task
  (`generator_error`, logged), never the domain.
- The public task holds only the prompt: the question plus the instruction to answer in
  `<answer>...</answer>`; verifier `reasoning_gym`, no verifier_params. `Drawn.hidden`
  holds the dataset, question, gold answer, metadata (JSON-safe, restorable: `rg_family.pack`)
  and the recipe (level, range_mode, config) the verifier rebuilds the scorer from.
- At start: an unknown dataset or a level range the dataset lacks is a config error
  (ValueError); a dataset that fails to build, or to generate one entry, at its start
  level raises `DomainUnavailable` (the sampler disables the domain and goes on).
- `demonstration(rng, level)`: the prompt (context) and `<answer>{gold}</answer>`
  (trained) of a training problem (never an eval one); `demonstrable` is False for a
  dataset whose entries have no single gold answer (the SFT mix leaves it out).
- `eval_problems(n, seed, level=None)`: at most min(n, `eval_n`) distinct problems at `level`
  (default: the domain's start level), drawn (stream `eval`, seeded by `seed`) only from the eval slice, so they
  are disjoint from every training draw by content, whatever process draws either. It
  looks at most `want * EVAL_BUCKETS * 2 + EVAL_PATIENCE` draws and stops after
  EVAL_PATIENCE draws without a new problem, so a small question space at that level
  gives fewer problems (possibly none: the evaluator then has no set for the domain).
  `eval_set(n, seed, level)` is that list as the domain's pipeline-only `EvalSet`.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import structlog

from bus.hidden import hidden_ref_for
from producers.domains import DomainContext, DomainUnavailable, Drawn, TaskSkipped, finish_task
from producers.eval_set import EVAL_BUCKETS, EvalSet, drawn_set, in_eval_slice
from schemas import ChatMessage
from schemas import rg_family as rg
from schemas.answers import ANSWER_CLOSE, ANSWER_OPEN

log = structlog.get_logger()

CHUNK = 1024
"""Entries per dataset object (the dataset's `size`)."""
ATTEMPTS = 8
"""Draws a training task may take before it is skipped."""
CACHED = 8
"""Dataset objects kept per source."""
EVAL_PATIENCE = 256
"""An eval set stops growing after this many draws without a new problem (a small question space)."""
DEMO_INDICES = 4 * CHUNK // ATTEMPTS
"""Demonstrations come from training indices below this (their datasets stay cached)."""
INSTRUCTION = f"Give your final answer inside {ANSWER_OPEN}{ANSWER_CLOSE} tags."
"""The line every prompt ends with."""


def render_prompt(question: str) -> str:
    """The prompt text of a question: the question, a blank line, the answer instruction."""
    return f"{question.rstrip()}\n\n{INSTRUCTION}"


def demo_completion(answer: str) -> str:
    """The demonstrated completion of a gold answer."""
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


@dataclass
class ReasoningGymDomain:
    """Task source of one `reasoning_gym` config domain."""

    ctx: DomainContext
    skipped: Counter = field(default_factory=Counter, init=False)
    demonstrable: bool = field(default=True, init=False)
    _cache: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        params, dc = self.ctx.dc.params, self.ctx.dc
        self.dataset = str(params.get("dataset") or "")
        if not rg.is_known(self.dataset):
            raise ValueError(
                f"domain {self.ctx.name!r}: sampler.domains.{self.ctx.name}.params.dataset "
                f"{self.dataset!r} is not a reasoning-gym dataset"
            )
        self.range_mode = str(params.get("range_mode", "inclusive"))
        self.extra: dict[str, Any] = dict(params.get("config") or {})
        self.max_prompt_chars = params.get("max_prompt_chars")
        self.eval_n = int(params.get("eval_n", 32))
        n_levels = len(rg.levels(self.dataset, self.range_mode, self.extra))
        if not 1 <= dc.min_level <= dc.max_level <= n_levels:
            raise ValueError(
                f"domain {self.ctx.name!r}: levels {dc.min_level}..{dc.max_level} outside the dataset "
                f"{self.dataset!r}'s 1..{n_levels} (range_mode {self.range_mode!r})"
            )
        try:
            probe = self._dataset("train", dc.initial_level, 0, self.ctx.cfg.run.seed)[0]
        except Exception as exc:  # any failure of the third-party generator disables the domain
            raise DomainUnavailable(
                f"reasoning-gym dataset {self.dataset!r} fails at level {dc.initial_level}: {type(exc).__name__}: {exc}"
            ) from exc
        self.demonstrable = isinstance(probe.get("answer"), str) and bool(probe["answer"])

    def _dataset(self, stream: str, level: int, chunk: int, seed: int):
        key = (stream, level, chunk, seed)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ds = rg.build(
            self.dataset,
            level,
            self.range_mode,
            self.extra,
            seed=rg.derive_seed(stream, seed, self.ctx.name, level, chunk),
            size=CHUNK,
        )
        self._cache[key] = ds
        while len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return ds

    def entry(self, stream: str, level: int, position: int, seed: int) -> dict[str, Any]:
        """Entry `position` of `stream` (`train`, `eval`) at `level` (raises what the generator raises)."""
        return self._dataset(stream, level, position // CHUNK, seed)[position % CHUNK]

    def _train_entry(self, level: int, index: int) -> dict[str, Any]:
        seed = self.ctx.cfg.run.seed
        for attempt in range(ATTEMPTS):
            try:
                e = self.entry("train", level, index * ATTEMPTS + attempt, seed)
            except Exception as exc:  # a third-party generator's failure skips this one task
                self.skipped["generator_error"] += 1
                log.warning(
                    "reasoning_gym generator failed",
                    domain=self.ctx.name,
                    level=level,
                    index=index,
                    error=f"{type(exc).__name__}: {exc}",
                )
                raise TaskSkipped("generator_error", f"{self.dataset} level {level} index {index}: {exc}") from exc
            question = str(e["question"])
            if in_eval_slice(rg.content_hash(question)):
                self.skipped["eval_slice"] += 1
            elif self.max_prompt_chars is not None and len(question) > self.max_prompt_chars:
                self.skipped["prompt_too_long"] += 1
            else:
                return e
        raise TaskSkipped("no_usable_draw", f"{self.dataset} level {level} index {index}: {ATTEMPTS} draws skipped")

    def hidden_of(self, e: dict[str, Any], level: int) -> dict[str, Any]:
        """The verifier-only payload of entry `e` drawn at `level`."""
        return {
            "dataset": self.dataset,
            "question": str(e["question"]),
            "answer": rg.pack(e.get("answer")),
            "metadata": rg.pack(e.get("metadata") or {}),
            "level": level,
            "range_mode": self.range_mode,
            "config": rg.jsonable(self.extra),
        }

    def _drawn(self, e: dict[str, Any], level: int, task_id: str, key: str) -> Drawn:
        task = finish_task(
            self.ctx,
            task_id=task_id,
            difficulty=level,
            verifier="reasoning_gym",
            prompt=[ChatMessage(role="user", content=render_prompt(str(e["question"])))],
            hidden_ref=hidden_ref_for(self.ctx.name, key),
        )
        return Drawn(task, self.hidden_of(e, level))

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        e = self._train_entry(level, index)
        return self._drawn(e, level, f"{self.ctx.name}-{level}-{index}", f"{level}-{index}")

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool]]:
        """SFT segments of one training problem with a gold answer at `level`."""
        for _ in range(64):
            try:
                e = self._train_entry(level, rng.randrange(DEMO_INDICES))
            except TaskSkipped:
                continue
            if isinstance(e.get("answer"), str) and e["answer"]:
                return [(render_prompt(str(e["question"])), False), (demo_completion(e["answer"]), True)]
        raise ValueError(f"domain {self.ctx.name!r}: no demonstrable problem at level {level} (no gold answers)")

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """The fixed held-out problems as a pipeline-only eval set (see the module guarantees)."""
        level = self.ctx.dc.initial_level if level is None else level
        return drawn_set(self.ctx.name, seed, level, self.eval_problems(n, seed, level))

    def eval_problems(self, n: int, seed: int, level: int | None = None) -> list[Drawn]:
        """The fixed held-out problems (see the module guarantees)."""
        level = self.ctx.dc.initial_level if level is None else level
        want = min(n, self.eval_n)
        seen: set[str] = set()
        out: list[Drawn] = []
        limit, last_new = want * EVAL_BUCKETS * 2 + EVAL_PATIENCE, 0
        for position in range(limit):
            if len(out) >= want or position - last_new > EVAL_PATIENCE:
                break
            try:
                e = self.entry("eval", level, position, seed)
            except Exception:  # noqa: BLE001 - a third-party generator's failure skips that position
                self.skipped["eval_generator_error"] += 1
                continue
            digest = rg.content_hash(str(e["question"]))
            if in_eval_slice(digest) and digest not in seen:
                seen.add(digest)
                last_new = position
                i = len(out)
                out.append(self._drawn(e, level, f"{self.ctx.name}-eval-{level}-{i}", f"eval-{seed}-{level}-{i}"))
        return out
