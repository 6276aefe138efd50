"""The OpenAI wire format of the endpoint: requests read strictly, replies built from samples.

Guarantees:
- `read_chat` / `read_completion` validate a request body (a dict already parsed from JSON)
  and raise `EndpointRefusal` (400) naming the field: a missing `messages`/`prompt`, `n` past
  `max_n`, or a sampling option the engines cannot honour with correct behaviour log-probs
  (`top_p` < 1, `top_logprobs`, penalties, `logit_bias`) is refused, never silently ignored.
- `render_messages` turns OpenAI messages into chat-template messages: text parts joined,
  tool-call `arguments` (a JSON string on the wire) parsed back into objects, as templates expect.
- `cut_at_stop` cuts a sample at its first stop string: ids to the shortest prefix whose
  text holds it, log-probs with them, text before it.
- `chat_message` parses tool calls from the generated text with
  `schemas.tool_protocol.parse_declared_calls` (the code of `tool_format = "json"`); valid calls
  become `tool_calls` (arguments as JSON strings), the rest stays in `content`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from rollout_workers.endpoint.episodes import EndpointRefusal
from schemas.tool_protocol import JSON_CALL_CLOSE, JSON_CALL_OPEN, parse_declared_calls

UNSUPPORTED = {
    "top_logprobs": (0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
}
"""Options the engines cannot honour with exact behaviour log-probs, and their harmless values."""


@dataclass
class Sampling:
    """What one request asks of the engine."""

    n: int
    max_tokens: int | None
    temperature: float
    stop: list[str]
    logprobs: bool
    seed: int | None
    stream: bool


def _number(body: dict, name: str, default, lo: float, hi: float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise EndpointRefusal(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    return value


def read_sampling(body: dict, max_n: int) -> Sampling:
    """The sampling options of a chat or completion request (see the module guarantees)."""
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in harmless:
            raise EndpointRefusal(f"{name} is not supported: behaviour log-probs would not match what was sampled")
    if _number(body, "top_p", 1.0, 0.0, 1.0) != 1:
        raise EndpointRefusal("top_p < 1 is not supported: log-probs are taken under the full softmax (send top_p=1)")
    n = _number(body, "n", 1, 1, 10**6)
    if int(n) != n or n > max_n:
        raise EndpointRefusal(f"n = {n} is over the limit ({max_n}, rollout.endpoint.max_n)")
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None if cap is None else int(_number({"max_tokens": cap}, "max_tokens", None, 1, 10**7))
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise EndpointRefusal("stop must be a string or a list of up to 4 non-empty strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise EndpointRefusal(f"seed must be an integer, got {seed!r}")
    return Sampling(
        int(n),
        max_tokens,
        float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        stop,
        bool(body.get("logprobs")),
        seed,
        bool(body.get("stream")),
    )


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise EndpointRefusal("message content must be a string or a list of text parts")


def render_messages(messages) -> list[dict]:
    """Chat-template messages of OpenAI `messages` (see the module guarantees)."""
    if not isinstance(messages, list) or not messages:
        raise EndpointRefusal("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise EndpointRefusal(f"messages[{i}] needs a role of system, user, assistant or tool")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"))}
        calls = []
        for c in m.get("tool_calls") or []:
            try:
                fn = c["function"]
                args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
                calls.append({"type": "function", "function": {"name": str(fn["name"]), "arguments": args}})
            except (KeyError, TypeError, json.JSONDecodeError) as exc:
                raise EndpointRefusal(f"messages[{i}].tool_calls: {type(exc).__name__}: {exc}") from None
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def read_tools(body: dict) -> tuple[list[dict] | None, dict[str, dict]]:
    """(tools for the chat template, name -> parameters schema) of a request's `tools`."""
    tools = body.get("tools")
    if not tools:
        return None, {}
    if body.get("tool_choice") not in (None, "auto", "none", "required"):
        raise EndpointRefusal("tool_choice must be auto, none or required (forcing one function is not supported)")
    declared = {}
    for i, t in enumerate(tools if isinstance(tools, list) else [None]):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EndpointRefusal(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        declared[fn["name"]] = fn.get("parameters") or {"type": "object"}
    if body.get("tool_choice") == "none":
        return tools, {}
    return tools, declared


def cut_at_stop(tokenizer, ids: list[int], logprobs: list[float], text: str, stop: list[str]):
    """(ids, logprobs, text, stopped) of a sample cut at its first stop string (module guarantees)."""
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return ids, logprobs, text, False
    at, s = min(hits)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if s in tokenizer.decode(ids[:mid], skip_special_tokens=True) else (mid + 1, hi)
    return ids[:lo], logprobs[:lo], text[:at], True


def chat_message(text: str, declared: dict[str, dict]) -> tuple[dict, bool]:
    """(the assistant message, has_tool_calls) of a generated text (module guarantees)."""
    calls = [c for c in parse_declared_calls(text, declared) if not c.error] if declared else []
    content, cut = text, 0
    for c in calls:  # the valid calls' blocks leave the content; a refused one stays as text
        start = text.rfind(JSON_CALL_OPEN, 0, c.end - len(JSON_CALL_CLOSE))
        content = content[: start - cut] + content[c.end - cut :]
        cut += c.end - start
    content = content.strip() if calls else content
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": c.tool, "arguments": json.dumps(c.args, ensure_ascii=False)},
            }
            for c in calls
        ]
    return message, bool(calls)


def token_logprobs(tokenizer, ids: list[int], logprobs: list[float]) -> dict:
    """The `logprobs` object of a choice: one entry per generated id."""
    out = []
    for i, lp in zip(ids, logprobs, strict=True):
        tok = tokenizer.decode([i])
        out.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode()), "top_logprobs": []})
    return {"content": out}
