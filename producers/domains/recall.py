"""The `recall` domain kind: needles in a long haystack, the needle's position controlled.

Params (`[sampler.domains.<name>.params]`): `lengths` (token length per level, default
`longctx.DEFAULT_LENGTHS`), `variants` (any of single, multi, combine, kv; default all, in
turn by index), `tokenizer`, `max_prompt_tokens` (as for `findoc`: `longctx`), `eval_n` (40).

Guarantees:
- A task is a pure function of (`run.seed`, domain, level, index, position) and the params.
  Training draws the position uniformly from [0, 1) by the task's own seed. Level L's
  prompt is at most `lengths[L-1]` tokens of the run's tokenizer (`longctx.fit`): the
  needles, the question and as many haystack records as fit.
- Position control: the first needle sits at the record boundary nearest to `position`
  (a fraction of the haystack's records); further needles of a variant at `position + k/n`
  (mod 1). `verifier_params` record `position` (the fraction of the haystack's characters
  before the first needle, as laid out), `position_bucket` (`"0-10"` ... `"90-100"`, of
  the requested position), `length` (the level's token length), `tokens` (the prompt's),
  `level` and `variant`: eval results group by them.
- A prompt over `max_prompt_tokens` is skipped and counted (`prompt_too_long`); when every
  configured level's is, the domain is unavailable (`DomainUnavailable`).
- `Drawn.hidden` holds the gold (one exact text per field) and the needles; verifier `recall`.
- `eval_set(n, seed, level)`: `min(n, eval_n)` items from the `eval` stream, the position
  buckets in turn (each at its bucket's middle) and, with level None, the levels that fit
  in turn too (the set's level is then None), so every (bucket, length) cell is covered.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from bus.hidden import hidden_ref_for
from producers.domains import DomainContext, Drawn, TaskSkipped, finish_task, longctx
from producers.domains import recall_gen as gen
from producers.domains.findoc_gen import Block
from producers.eval_set import EvalSet, drawn_set
from schemas import ChatMessage
from schemas.answers import ANSWER_CLOSE, ANSWER_OPEN

PARAMS = ("lengths", "variants", "tokenizer", "max_prompt_tokens", "eval_n")
HEAD = "Below is a ledger of depot records and dock keys."
INSTRUCTION = f"Give your final answer inside {ANSWER_OPEN}{ANSWER_CLOSE} tags."


def bucket_of(position: float) -> str:
    """The decile a position falls in: `"0-10"` ... `"90-100"`."""
    d = min(9, max(0, int(position * 10)))
    return f"{d * 10}-{d * 10 + 10}"


@dataclass(frozen=True)
class Layout:
    """A laid-out recall prompt."""

    prompt: list[ChatMessage]
    case: gen.Case
    tokens: int
    position: float
    """Fraction of the haystack's characters before the first needle."""


def render(lines: list[Block], question: str) -> list[ChatMessage]:
    """The prompt: the head, the records in order, the question and the instruction."""
    body = "\n".join(b.text for b in sorted(lines, key=lambda b: b.order))
    return [ChatMessage(role="user", content=f"{HEAD}\n\n{body}\n\nQuestion: {question}\n\n{INSTRUCTION}")]


def place(kept: list[Block], needles: tuple[str, ...], position: float) -> tuple[list[Block], float]:
    """The filler records `kept` (in order) with the needles put at `position` (+ k/n), and the
    first needle's character fraction."""
    filler = [b for b in kept if b.kind == "filler"]
    n = len(filler)
    out = [Block(float(i), b.text) for i, b in enumerate(filler)]
    for k, text in enumerate(needles):
        at = ((position + k / len(needles)) % 1.0) * n
        out.append(Block(round(at) - 0.5 + k * 1e-3, text, "needle"))
    out.sort(key=lambda b: b.order)
    first = next(i for i, b in enumerate(out) if b.kind == "needle" and b.text == needles[0])
    before = sum(len(b.text) + 1 for b in out[:first])
    total = sum(len(b.text) + 1 for b in out)
    return out, before / max(1, total)


def layout(rng: random.Random, counter: longctx.TokenCounter, length: int, variant: str, position: float) -> Layout:
    """A prompt of at most `length` tokens with the case's needles at `position`."""
    case = gen.make_case(rng, variant)
    pool = [Block(float(i), t) for i, t in enumerate(gen.filler_lines(rng, case, max(8, length // 8)))]
    essential = [Block(-1.0, t, "needle") for t in case.needles]
    question = case.question + (" Answer as city=code; city=code; city=code." if variant == "multi" else "")
    _, kept, _ = longctx.fit(counter, lambda bs: render(bs, question), essential, pool, length)
    blocks, at = place(kept, case.needles, position)
    prompt = render(blocks, question)
    return Layout(prompt, case, counter.prompt(prompt), at)


@dataclass
class RecallDomain:
    """Task source of one `recall` config domain."""

    ctx: DomainContext
    skipped: Counter = field(default_factory=Counter, init=False)

    def __post_init__(self) -> None:
        name, params = self.ctx.name, self.ctx.dc.params
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise ValueError(f"domain {name!r}: unknown params {unknown}; this kind takes {list(PARAMS)}")
        variants = params.get("variants", list(gen.VARIANTS))
        if not isinstance(variants, list) or not variants or any(v not in gen.VARIANTS for v in variants):
            raise ValueError(
                f"sampler.domains.{name}.params.variants must be a non-empty list of {list(gen.VARIANTS)}, got {variants!r}"
            )
        self.variants = tuple(variants)
        self.eval_n = int(params.get("eval_n", 40))
        self.levels = longctx.lengths(self.ctx)
        self.counter = longctx.TokenCounter.of(self.ctx)
        self.budget = longctx.prompt_budget(self.ctx, self.counter)
        self.too_long = longctx.check_levels(
            self.ctx, self.levels, self.budget, lambda lvl: self.layout("probe", lvl, 0, 0.5).tokens
        )

    def layout(
        self, stream: str, level: int, index: int, position: float | None = None, seed: int | None = None
    ) -> Layout:
        """Problem `index` of `stream` at `level`, its first needle at `position` (None: drawn)."""
        seed = self.ctx.cfg.run.seed if seed is None else seed
        rng = random.Random(f"recall-{stream}-{seed}-{self.ctx.name}-{level}-{index}")
        position = rng.random() if position is None else position
        variant = self.variants[index % len(self.variants)]
        return layout(rng, self.counter, longctx.length_of(self.levels, level), variant, position)

    def _drawn(self, lay: Layout, level: int, position: float, task_id: str, key: str) -> Drawn:
        if level in self.too_long or lay.tokens > self.budget:
            self.skipped["prompt_too_long"] += 1
            raise TaskSkipped(
                "prompt_too_long",
                f"{task_id}: {lay.tokens} tokens (level length {longctx.length_of(self.levels, level)}) > max_prompt_tokens {self.budget}",
            )
        task = finish_task(
            self.ctx,
            task_id=task_id,
            difficulty=level,
            verifier="recall",
            prompt=lay.prompt,
            verifier_params={
                "variant": lay.case.variant,
                "level": level,
                "length": longctx.length_of(self.levels, level),
                "tokens": lay.tokens,
                "position": round(lay.position, 4),
                "position_bucket": bucket_of(position),
            },
            hidden_ref=hidden_ref_for(self.ctx.name, key),
        )
        return Drawn(
            task, {"variant": lay.case.variant, "gold": dict(lay.case.gold), "needles": list(lay.case.needles)}
        )

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        position = random.Random(f"recall-position-{self.ctx.cfg.run.seed}-{self.ctx.name}-{level}-{index}").random()
        lay = self.layout("train", level, index, position)
        return self._drawn(lay, level, position, f"{self.ctx.name}-{level}-{index}", f"{level}-{index}")

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool]]:
        """SFT segments: the prompt, then the needle quoted (the lookup), then the answer."""
        lay = self.layout("train", level, rng.randrange(1 << 20))
        quoted = "".join(f"Found: {n}\n" for n in lay.case.needles)
        if lay.case.variant == "combine":
            a, b = (int(n.split(" crates")[0].split()[-1]) for n in lay.case.needles)
            quoted += f"Arithmetic: {a} + {b} = {a + b}\n"
        return [
            (lay.prompt[0].content, False),
            (f"{quoted}{ANSWER_OPEN}{gen.answer_text(lay.case)}{ANSWER_CLOSE}", True),
        ]

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """Items over the position buckets (and, with level None, the levels that fit): see the module guarantees."""
        dc = self.ctx.dc
        levels = (
            [level]
            if level is not None
            else [x for x in range(dc.min_level, dc.max_level + 1) if x not in self.too_long]
        )
        out = []
        for i in range(min(n, self.eval_n)):
            lvl, position = levels[(i // 10) % len(levels)], (i % 10 + 0.5) / 10
            lay = self.layout("eval", lvl, i, position, seed)
            if lvl not in self.too_long and lay.tokens <= self.budget:
                out.append(self._drawn(lay, lvl, position, f"{self.ctx.name}-eval-{lvl}-{i}", f"eval-{seed}-{lvl}-{i}"))
        return drawn_set(self.ctx.name, seed, level, out)
