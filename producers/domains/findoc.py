"""The `findoc` domain kind: questions about a long generated financial filing.

Params (`[sampler.domains.<name>.params]`): `lengths` (token length per level, default
`longctx.DEFAULT_LENGTHS`), `families` (any of extraction, calculation, conclusion; default
all three, in turn by index), `tokenizer` (a local tokenizer folder; default the run's, see
`longctx.TokenCounter`), `max_prompt_tokens` (default: the engine's context minus the
generation budget), `eval_n` (16), `agentic` (false; see below). Anything else is refused at start-up.

Agentic variant (`agentic = true`, issue 33 item 4): the same document is not in the prompt but
the file `FILE` in the episode's sandbox (`Task.workspace`); the prompt holds the question, the
document's size and how to read it with the tools `grep` (a regex: the matching lines with their
numbers, capped) and `read_file` (`offset`/`limit` lines), in the domain's `tool_format`
(`schemas.tool_protocol`); the tools are `AGENTIC_TOOLS` (also `run`, a shell command in the
sandbox). The answer is the final turn's `<answer>`, as in the plain kind. A document
longer than the prompt budget is published (it is never in the context at once); the episode's
context budget and `max_turns` (at least 2, else refused at start-up) bound what the policy reads. The prompt names the task as
repository tasks do (`schemas.repo_task.PROMPT_TASK_LINE`), so `scripted` replays work.

Guarantees:
- A task is a pure function of (`run.seed`, domain, level, index) and the params: the
  same filing, question and document every time (`rng` is not used). Level L's document
  (filing, question and answer instruction, as the chat template renders it) is at most
  `lengths[L-1]` tokens of the run's tokenizer: the tables the question needs, the header
  and the section titles always; then the other tables, the footnote, the peer company's
  figures and narrative paragraphs while they fit. Blocks keep the filing's order.
- A document over `max_prompt_tokens` is not published: the task is skipped and counted
  (`skipped["prompt_too_long"]`); when every configured level's is, the domain is
  unavailable (`DomainUnavailable`, the reason logged; the run goes on without it).
- The public task holds the prompt and `verifier_params` {family, level, length, tokens};
  `Drawn.hidden` holds the gold, its unit and tolerance or fields, and its derivation.
  Verifier `findoc`.
- `demonstration(rng, level)` shows the lookup, then the arithmetic, then the answer in
  `<answer>...</answer>`, on a training document of that level.
- `eval_set(n, seed, level)`: a pipeline-only set drawn from its own stream (`eval`), never
  from the training stream, the families in turn.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from bus.hidden import hidden_ref_for
from producers.domains import DomainContext, Drawn, TaskSkipped, finish_task, longctx
from producers.domains import findoc_gen as gen
from producers.domains.findoc_questions import FAMILIES, Question, ask
from producers.eval_set import EvalSet, drawn_set
from schemas import ChatMessage
from schemas.answers import ANSWER_CLOSE, ANSWER_OPEN
from schemas.repo_task import PROMPT_FORMAT_LINE, PROMPT_TASK_LINE
from schemas.tool_protocol import repo_call_text

PARAMS = ("lengths", "families", "tokenizer", "max_prompt_tokens", "eval_n", "agentic")
FILE = "filing.md"
"""The agentic variant's document, in the sandbox's work dir."""
AGENTIC_TOOLS = ("read_file", "grep", "run")
INSTRUCTION = (
    f"Read the filing above and answer the question. Figures in the notes supersede the tables. "
    f"Give your final answer inside {ANSWER_OPEN}{ANSWER_CLOSE} tags."
)
ESSENTIAL_KINDS = ("header", "section")


@dataclass(frozen=True)
class Document:
    """A rendered task: prompt, question, token count."""

    prompt: list[ChatMessage]
    question: Question
    tokens: int
    blocks: tuple[str, ...]
    body: str = ""
    """The filing's kept blocks as text (the agentic variant's file)."""


def render(blocks: list[gen.Block], question: str) -> list[ChatMessage]:
    """The prompt of a document: its blocks in the filing's order, the question, the instruction."""
    body = "\n\n".join(b.text for b in sorted(blocks, key=lambda b: b.order))
    return [ChatMessage(role="user", content=f"{body}\n\nQuestion: {question}\n\n{INSTRUCTION}")]


def build(rng: random.Random, counter: longctx.TokenCounter, length: int, family: str) -> Document:
    """A document of at most `length` tokens (more only when the needed tables alone exceed it)."""
    for _ in range(16):
        f = gen.make_filing(rng)
        q = ask(rng, f, family)
        if q is not None:
            break
    else:  # pragma: no cover - the generator ties 16 times in a row
        raise TaskSkipped("no_clean_question", family)
    tables = gen.blocks(f)
    paragraphs = gen.filler(rng, f, max(4, length // 50))
    essential = [gen.header(f)] + [tables[n] for n in q.needs] + [b for b in paragraphs if b.kind == "section"]
    optional = [tables[n] for n in ("income", "segments", "note", "balance", "cash", "peer") if n not in q.needs]
    optional += [b for b in paragraphs if b.kind != "section"]
    prompt, kept, tokens = longctx.fit(counter, lambda bs: render(bs, q.text), essential, optional, length)
    body = "\n\n".join(b.text for b in sorted(kept, key=lambda b: b.order))
    return Document(prompt, q, tokens, tuple(b.kind for b in kept if b.kind not in ("filler", "section")), body)


def agentic_prompt(doc: Document, task_id: str, tool_format: str) -> list[ChatMessage]:
    """The agentic variant's prompt: the question, the file and how to read it (no document)."""
    lines = doc.body.count("\n") + 1
    examples = [
        repo_call_text("grep", {"pattern": "revenue", "path": FILE, "ignore_case": True}, tool_format),
        repo_call_text("read_file", {"path": FILE, "offset": 1, "limit": 40}, tool_format),
    ]
    return [
        ChatMessage(
            role="user",
            content=(
                f"{PROMPT_TASK_LINE}{task_id}\n{PROMPT_FORMAT_LINE}{tool_format}\n\n"
                f"A company's filing is the file {FILE} in your working directory ({lines} lines, "
                f"about {doc.tokens} tokens: read the parts you need). Search it and read line ranges "
                "with one tool call per turn, for example:\n"
                + "\n".join(examples)
                + f"\n\nQuestion: {doc.question.text}\n\nFigures in the notes supersede the tables. "
                f"When you know the answer, reply without a tool call and give it inside "
                f"{ANSWER_OPEN}{ANSWER_CLOSE} tags."
            ),
        )
    ]


@dataclass
class FindocDomain:
    """Task source of one `findoc` config domain."""

    ctx: DomainContext
    skipped: Counter = field(default_factory=Counter, init=False)

    def __post_init__(self) -> None:
        name, params = self.ctx.name, self.ctx.dc.params
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise ValueError(f"domain {name!r}: unknown params {unknown}; this kind takes {list(PARAMS)}")
        fams = params.get("families", list(FAMILIES))
        if not isinstance(fams, list) or not fams or any(x not in FAMILIES for x in fams):
            raise ValueError(
                f"sampler.domains.{name}.params.families must be a non-empty list of {list(FAMILIES)}, got {fams!r}"
            )
        self.families = tuple(fams)
        self.eval_n = int(params.get("eval_n", 16))
        self.levels = longctx.lengths(self.ctx)
        self.counter = longctx.TokenCounter.of(self.ctx)
        self.budget = longctx.prompt_budget(self.ctx, self.counter)
        self.agentic = bool(params.get("agentic", False))
        if self.agentic and self.ctx.dc.max_turns < 2:
            raise ValueError(
                f"sampler.domains.{name}: params.agentic reads the filing with tool calls, one per turn; "
                f"set max_turns >= 2 (e.g. 8), not {self.ctx.dc.max_turns}"
            )
        self.too_long = [] if self.agentic else longctx.check_levels(self.ctx, self.levels, self.budget, self._probe)

    def _probe(self, level: int) -> int:
        return self.document("probe", level, 0).tokens

    def document(self, stream: str, level: int, index: int, seed: int | None = None) -> Document:
        """The document `index` of `stream` at `level` (pure: see the module guarantees)."""
        seed = self.ctx.cfg.run.seed if seed is None else seed
        rng = random.Random(f"findoc-{stream}-{seed}-{self.ctx.name}-{level}-{index}")
        family = self.families[index % len(self.families)]
        return build(rng, self.counter, longctx.length_of(self.levels, level), family)

    def _drawn(self, doc: Document, level: int, task_id: str, key: str) -> Drawn:
        extra: dict = {"prompt": doc.prompt}
        if self.agentic:
            fmt = self.ctx.dc.tool_format
            extra = dict(
                prompt=agentic_prompt(doc, task_id, fmt), workspace={FILE: doc.body}, tools=list(AGENTIC_TOOLS)
            )
        elif level in self.too_long or doc.tokens > self.budget:
            self.skipped["prompt_too_long"] += 1
            raise TaskSkipped(
                "prompt_too_long",
                f"{task_id}: {doc.tokens} tokens (level length {longctx.length_of(self.levels, level)}) > max_prompt_tokens {self.budget}",
            )
        task = finish_task(
            self.ctx,
            task_id=task_id,
            difficulty=level,
            verifier="findoc",
            verifier_params={
                "family": doc.question.family,
                "level": level,
                "length": longctx.length_of(self.levels, level),
                "tokens": doc.tokens,
            },
            hidden_ref=hidden_ref_for(self.ctx.name, key),
            **extra,
        )
        return Drawn(task, dict(doc.question.hidden))

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        doc = self.document("train", level, index)
        return self._drawn(doc, level, f"{self.ctx.name}-{level}-{index}", f"{level}-{index}")

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool]]:
        """SFT segments of a training document at `level`: the prompt, then lookup, arithmetic, answer."""
        doc = self.document("train", level, rng.randrange(1 << 20))
        return [(doc.prompt[0].content, False), (doc.question.completion, True)]

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """`min(n, eval_n)` documents of the `eval` stream at `level` (default: the start level)."""
        level = self.ctx.dc.initial_level if level is None else level
        out = []
        for i in range(min(n, self.eval_n)):
            doc = self.document("eval", level, i, seed)
            if level not in self.too_long and doc.tokens <= self.budget:
                out.append(self._drawn(doc, level, f"{self.ctx.name}-eval-{level}-{i}", f"eval-{seed}-{level}-{i}"))
        return drawn_set(self.ctx.name, seed, level, out)
