"""The OpenAI-compatible endpoint of a rollout worker: FastAPI routes, one batcher, uvicorn.

Guarantees:
- `Endpoint(engine, version, cfg, context_limit)` serves `POST /v1/chat/completions`,
  `POST /v1/completions` and `GET /v1/models` on the worker's engine; every route needs an
  episode's bearer key (`open_episode`), and a call reaches only that key's episode. Nothing
  here loads weights, reads other episodes or touches the bus.
- Errors are OpenAI error objects with the reason: 400 (bad field, malformed JSON), 401 (no
  or unknown key), 409 (the episode ended), 413 (body over `max_body_bytes`), 429 (too many
  episodes). A limit that ends an episode mid-call (timeout, context, budget) ends it with
  `timeout`/`length`; the episode is still closed and verified by its owner.
- Concurrent calls wait at most `batch_window_ms` and run as one engine call per (n,
  temperature, seed) group; a shorter `max_tokens` is the same sample cut (sampling is
  autoregressive, so its ids and log-probs are exactly those of a shorter run). Engine calls
  hold `engine_lock`, which the worker also holds to swap weights: a call's version is the
  version it was generated with.
- `stream = true` sends the finished reply as server-sent events (a role chunk, the content
  and tool-call chunks, the finish chunk, `[DONE]`): the engines generate whole turns.
- `serve()` listens on `cfg.host` only (never a wildcard without consent: the config refuses
  it) and `port` (0: a free one; `base_url` says which once started); `stop()` ends it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout_workers.endpoint.episodes import ContextExhausted, EndpointRefusal, EpisodeTable, Pending
from rollout_workers.endpoint.wire import (
    Sampling,
    chat_message,
    cut_at_stop,
    read_sampling,
    read_tools,
    render_messages,
    token_logprobs,
)
from schemas.chat import after_assistant_text, encode_text, has_template, tokenizer_of

MODEL_ID = "rlbus-policy"


class TooLarge(EndpointRefusal):
    status, code = 413, "request_too_large"


def _error(exc: EndpointRefusal) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc), "type": exc.code, "code": exc.code}}, status_code=exc.status)


class Endpoint:
    """One worker's endpoint (see the module guarantees)."""

    def __init__(self, engine, version: Callable[[], int], cfg, context_limit: int, engine_lock=None):
        self.engine, self.version, self.cfg = engine, version, cfg
        self.tokenizer = tokenizer_of(engine)
        if self.tokenizer is None or not has_template(self.tokenizer):
            raise ValueError(
                "rollout.endpoint needs an engine whose tokenizer has a chat template (hf, vllm, scripted)"
            )
        self.episodes = EpisodeTable(cfg.max_episodes, cfg.episode_timeout_s, cfg.episode_token_budget, context_limit)
        self.engine_lock = engine_lock or asyncio.Lock()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.app = self._routes()
        self.server = self.uds_server = None
        self.base_url = self.uds = ""
        self._tasks: list[asyncio.Task] = []

    # episodes ---------------------------------------------------------------------------
    def open_episode(self, task, sample_index: int = 0, call_tokens: int | None = None) -> str:
        """A fresh key for one episode of `task` (TooManyEpisodes past `max_episodes`);
        `call_tokens`: most tokens one call may generate, whatever the request asks."""
        key, ep = self.episodes.open(task, sample_index)
        ep.call_tokens = call_tokens
        return key

    def close_episode(self, key: str, reason: str = "stop"):
        """End the episode of `key`: its Trajectory (the reason kept if a limit ended it first)."""
        return self.episodes.close(key, self.tokenizer, reason)

    # routes -----------------------------------------------------------------------------
    def _routes(self) -> FastAPI:
        app = FastAPI(title="rlbus rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(EndpointRefusal)
        async def refused(_request: Request, exc: EndpointRefusal):
            return _error(exc)

        @app.get("/v1/models")
        async def models(request: Request):
            self.episodes.get(_key(request))
            model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "rlbus"}
            return {"object": "list", "data": [model | {"rlbus_version": self.version()}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            ep, body = self.episodes.get(_key(request)), await self._body(request)
            sampling = read_sampling(body, self.cfg.max_n)
            tools, declared = read_tools(body)
            messages = render_messages(body.get("messages"))
            rendered = encode_text(
                self.tokenizer,
                self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True),
            )
            ep.settle(messages, self.tokenizer)
            delta = self._delta(ep, messages)
            ep.sent = messages
            return await self._complete(ep, rendered, delta, sampling, declared, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            ep, body = self.episodes.get(_key(request)), await self._body(request)
            sampling = read_sampling(body, self.cfg.max_n)
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise EndpointRefusal("prompt must be a non-empty string")
            ep.settle(None, self.tokenizer)
            seen = self.tokenizer.decode(ep.context)
            tail = prompt[len(seen) :] if prompt.startswith(seen) else prompt
            return await self._complete(
                ep, encode_text(self.tokenizer, prompt), encode_text(self.tokenizer, tail), sampling, {}, chat=False
            )

        return app

    async def _body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            raise TooLarge(
                f"body of {declared} bytes is over rollout.endpoint.max_body_bytes ({self.cfg.max_body_bytes})"
            )
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.cfg.max_body_bytes:
                raise TooLarge(f"body is over rollout.endpoint.max_body_bytes ({self.cfg.max_body_bytes})")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EndpointRefusal(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise EndpointRefusal("the body must be a JSON object")
        return body

    def _delta(self, ep, messages: list[dict]) -> list[int]:
        """Ids of the messages after the last assistant one, framed to follow a model turn. When
        that assistant message was already sent before (the harness dropped the last reply, as
        mini-swe-agent does on a format error), the messages after the previous call's are new."""
        if not ep.turns:
            return []
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        known = 0  # how many leading messages the previous call already sent
        while known < min(len(ep.sent), len(messages)) and ep.sent[known] == messages[known]:
            known += 1
        new = messages[last + 1 :] if last >= known else messages[known:]
        if not new:
            return []
        text = after_assistant_text(self.tokenizer, new)
        eos = self.tokenizer.eos_token or ""
        if eos and ep.context and ep.context[-1] == self.tokenizer.eos_token_id and text.startswith(eos):
            text = text[len(eos) :]
        return encode_text(self.tokenizer, text)

    # generation -------------------------------------------------------------------------
    async def _complete(self, ep, rendered, delta, sampling: Sampling, declared, chat: bool):
        t0 = time.monotonic()
        drifted = ep.extend(rendered, delta, self.tokenizer)
        asked = sampling.max_tokens or self.cfg.episode_token_budget
        room = ep.room(min(asked, ep.call_tokens or asked))
        if room <= 0:
            ep.finish_reason = "length"
            raise ContextExhausted("the episode's context limit or token budget is reached; it ended with `length`")
        if time.monotonic() > ep.deadline:
            ep.finish_reason = "timeout"
            raise ContextExhausted("the episode ran past rollout.endpoint.episode_timeout_s; it ended with `timeout`")
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((list(ep.context), sampling, room, future))
        try:
            samples, version, gen_s = await future
        except Exception as exc:  # the engine failed: the episode's owner treats it as infrastructure
            ep.infra_error = ep.infra_error or f"{type(exc).__name__}: {exc}"
            raise
        prompt_len = len(ep.context)
        choices, kept = [], []
        for i, s in enumerate(samples):
            ids, lps = [int(x) for x in s.token_ids[:room]], [float(x) for x in s.logprobs[:room]]
            finish = s.finish_reason if len(ids) == len(s.token_ids) else "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            ids, lps, text, stopped = cut_at_stop(self.tokenizer, ids, lps, text, sampling.stop)
            finish = "stop" if stopped else finish
            kept.append(_Cut(ids, lps))
            choice = {"index": i, "finish_reason": finish}
            if chat:
                message, has_calls = chat_message(text, declared)
                choice |= {"message": message, "finish_reason": "tool_calls" if has_calls else finish}
            else:
                choice |= {"text": text}
            choice["logprobs"] = token_logprobs(self.tokenizer, ids, lps) if sampling.logprobs else None
            choices.append(choice)
        ep.pending = Pending(kept, [c.get("message", {}) for c in choices], version)
        ep.generate_seconds += gen_s
        completion = sum(len(k.token_ids) for k in kept)
        ep.calls.append(
            {"prompt_tokens": prompt_len, "completion_tokens": completion, "version": version, "drift": drifted,
             "generate_s": round(gen_s, 4), "wall_s": round(time.monotonic() - t0, 4)}
        )  # fmt: skip
        reply = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": MODEL_ID,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": completion,
                "total_tokens": prompt_len + completion,
            },
            "system_fingerprint": f"rlbus-v{version}",
        }
        return _stream(reply) if sampling.stream and chat else reply

    async def _batcher(self) -> None:
        """Gather calls for `batch_window_ms`, then one engine call per (n, temperature, seed) group."""
        while True:
            items = [await self.queue.get()]
            await asyncio.sleep(self.cfg.batch_window_ms / 1000)
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            groups: dict[tuple, list] = {}
            for item in items:
                s = item[1]
                groups.setdefault((s.n, s.temperature, s.seed), []).append(item)
            for (n, temperature, seed), group in groups.items():
                await self._run_group(n, temperature, seed, group)

    async def _run_group(self, n: int, temperature: float, seed, group: list) -> None:
        longest = max(room for _, _, room, _ in group)
        try:
            async with self.engine_lock:
                version, t0 = self.version(), time.monotonic()
                out = await asyncio.to_thread(self._generate, [c for c, *_ in group], n, longest, temperature, seed)
                dt = time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 - every waiter learns the engine's failure
            for *_, future in group:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, _, _, future), samples in zip(group, out, strict=True):
            if not future.done():
                future.set_result((samples, version, dt / len(group)))

    def _generate(self, contexts, n, max_tokens, temperature, seed):
        if seed is not None:
            import torch

            torch.manual_seed(seed)
        return self.engine.generate(contexts, n, max_tokens, temperature)

    # serving ----------------------------------------------------------------------------
    async def serve(self, uds: str | None = None) -> str:
        """Start listening (see the guarantees); the base URL (`http://host:port/v1`). With
        `uds`, the same app is also served on that Unix socket (mode 0666: the key is the
        credential), which sandboxes without a network reach through a bound relay
        (`rollout_workers.agent_harness`)."""
        import uvicorn

        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say TCP; without it each
        # reply waits on Nagle and the client's delayed ACK (~40 ms a call, bench/agent_endpoint.py)
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self._tasks = [asyncio.create_task(self._batcher()), asyncio.create_task(self.server.serve(sockets=[sock]))]
        await _started(self.server, self._tasks[1])
        if uds:
            self.uds_server = uvicorn.Server(
                uvicorn.Config(self.app, uds=uds, log_level="warning", lifespan="off", access_log=False)
            )
            self._tasks.append(asyncio.create_task(self.uds_server.serve()))
            await _started(self.uds_server, self._tasks[2])
            self.uds = uds
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.base_url = f"http://{host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        """Stop serving: the server first (no new calls), then the batcher."""
        try:
            for server, task in zip((self.server, self.uds_server), self._tasks[1:], strict=False):
                if server is not None:
                    server.should_exit = True
                    await asyncio.wait_for(task, timeout=10)
        finally:
            if self._tasks:  # none when serve() failed before starting anything
                self._tasks[0].cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def _started(server, task: asyncio.Task) -> None:
    """Wait until uvicorn `server` listens (raising why, when its task ended first)."""
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the endpoint's server ended before it started listening")
        await asyncio.sleep(0.01)


class _Cut:
    """A choice as kept: its ids and log-probs after the stop and `max_tokens` cuts."""

    def __init__(self, token_ids: list[int], logprobs: list[float]):
        self.token_ids, self.logprobs = token_ids, logprobs


def _key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def _stream(reply: dict) -> StreamingResponse:
    def chunk(choice_delta: dict, finish=None, index=0) -> str:
        body = {k: reply[k] for k in ("id", "created", "model", "system_fingerprint")}
        body |= {
            "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": choice_delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(body)}\n\n"

    def events():
        for c in reply["choices"]:
            m, i = c["message"], c["index"]
            yield chunk({"role": "assistant", "content": ""}, index=i)
            if m.get("content"):
                yield chunk({"content": m["content"]}, index=i)
            for j, call in enumerate(m.get("tool_calls") or []):
                yield chunk({"tool_calls": [{"index": j, **call}]}, index=i)
            yield chunk({}, c["finish_reason"], index=i)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
