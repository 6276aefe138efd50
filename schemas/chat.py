"""Rendering a task's chat prompt, and a tool observation, for one tokenizer: the only copy.

Every user imports it from here (rollout's single-turn and agent paths, SFT demos,
evaluation), so what the model is trained on, sampled from and evaluated on is the same
text. It is duck-typed on a HF tokenizer (`chat_template`, `apply_chat_template`,
`__call__`, `decode`) and imports nothing heavy.

Guarantees:
- A tokenizer with a chat template (`has_template`) renders prompts through it, with the
  generation prompt added and the tools' JSON schemas when `tools` is given; one without
  (the char tokenizer; engines without a tokenizer) gets the plain format,
  `schemas.episode.render_prompt`.
- `prompt_input` is what to hand an engine: token ids when templated (never re-tokenized
  by the engine), the plain text otherwise. `prompt_ids` is always ids; both tokenize the
  same text with `add_special_tokens=False`, so for a templated tokenizer they equal
  `apply_chat_template(..., tokenize=True, add_generation_prompt=True)`.
- `tool_turn(tok, text)` is the context appended after a tool call: with a template, the
  text the template renders after an assistant turn for a tool message (the assistant
  turn's close, the tool message, the next generation prompt), encoded ALONE; without
  one, `text` itself encoded alone. `text` is `schemas.tool_protocol.tool_turn_text(obs)`;
  the template's tool message holds it without its framing newlines.
- `unencodable(tok, texts)` lists the characters of `texts` the tokenizer cannot round-trip.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.episode import ChatMessage, render_prompt

_MARK = "\u2063rlbus-assistant-turn\u2063"  # stands for an assistant turn's content when rendering a tool message


def tokenizer_of(engine):
    """The HF tokenizer an engine samples with, or None (NullEngine, SleepEngine)."""
    return getattr(engine, "tokenizer", None)


def has_template(tokenizer) -> bool:
    """True if `tokenizer` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _messages(prompt: Iterable[ChatMessage | dict]) -> list[dict]:
    return [m.model_dump() if isinstance(m, ChatMessage) else dict(m) for m in prompt]


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` alone, no special tokens added (special-token strings in it are parsed)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_text(tokenizer, prompt: list[ChatMessage], tools: list[dict] | None = None) -> str:
    """The text a prompt is generated from: the chat template's rendering (with the generation
    prompt) when `tokenizer` has one, else `render_prompt`."""
    if not has_template(tokenizer):
        return render_prompt(prompt)
    return tokenizer.apply_chat_template(
        _messages(prompt), tools=tools or None, tokenize=False, add_generation_prompt=True
    )


def prompt_ids(tokenizer, prompt: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `prompt_text` (templated or plain)."""
    return encode_text(tokenizer, prompt_text(tokenizer, prompt, tools))


def prompt_input(tokenizer, prompt: list[ChatMessage], tools: list[dict] | None = None) -> str | list[int]:
    """What an engine is given for `prompt`: ids when templated, the plain text otherwise."""
    if has_template(tokenizer):
        return prompt_ids(tokenizer, prompt, tools)
    return render_prompt(prompt)


def user_prompt(content: str) -> list[ChatMessage]:
    """A one-message prompt (the domains' and evaluation's format)."""
    return [ChatMessage(role="user", content=content)]


def tool_turn_text_for(tokenizer, text: str) -> str:
    """The context text after a tool call (see the module guarantees)."""
    if not has_template(tokenizer):
        return text
    content = text[1:] if text.startswith("\n") else text
    content = content[:-1] if content.endswith("\n") else content
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": _MARK},
        {"role": "tool", "content": content},
    ]
    full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return full[full.index(_MARK) + len(_MARK) :]


def after_assistant_text(tokenizer, messages: list[dict]) -> str:
    """The text a chat template renders after an assistant turn for `messages` (tool results,
    a user turn), through the next generation prompt: what follows a model turn in context.
    The assistant turn's own close is left out when it is the tokenizer's eos (a sampled
    turn that stopped already ends with it)."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}, *messages]
    full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return full[full.index(_MARK) + len(_MARK) :]


def tool_turn(tokenizer, text: str) -> tuple[str, list[int]]:
    """(text, ids) of the context appended after a tool call, encoded alone."""
    rendered = tool_turn_text_for(tokenizer, text)
    return rendered, encode_text(tokenizer, rendered)


def unencodable(tokenizer, texts: Iterable[str]) -> list[str]:
    """Sorted characters of `texts` that `tokenizer` maps to unknown or does not decode back."""
    unk = getattr(tokenizer, "unk_token_id", None)
    bad = []
    for ch in sorted(set("".join(texts))):
        ids = encode_text(tokenizer, ch)
        if not ids or (unk is not None and unk in ids) or tokenizer.decode(ids) != ch:
            bad.append(ch)
    return bad
