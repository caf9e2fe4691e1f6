"""A fake vLLM 0.32 OpenAI-compatible server for tracetrain's fast tests and benchmarks.

It answers like ``vllm serve MODEL --enable-lora --enable-auto-tool-choice
--tool-call-parser hermes`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, but the "model"
says scripted text (``FakeVLLM.script``) or echoes the last user message. Shapes come
from vLLM 0.32's source (``vllm/entrypoints/openai``, ``vllm/entrypoints/serve``) and
were checked against its pydantic models.

Faithful to vLLM 0.32:

- Serialization. Non-streamed bodies are a full ``model_dump()``: every field, nulls
  included. Stream chunks are ``model_dump_json(exclude_unset=True)``: the keys vLLM sets
  explicitly appear (``"logprobs": null``, ``"finish_reason": null``, ``"token_ids": null``),
  the others do not. Usage chunks also drop nulls.
- ``return_token_ids``. Chat: top-level ``prompt_token_ids`` (streaming: on each
  choice's role chunk) and ``token_ids`` on each choice or delta chunk. Completions:
  both on the choice (streaming: prompt ids on each choice's first chunk). Unasked,
  they are null where vLLM sets them and absent elsewhere.
- Streams. Chat opens with one role chunk per choice (``{"role": "assistant",
  "content": ""}``). Then one chunk per token per choice; the last carries
  ``finish_reason`` and ``stop_reason`` (vLLM sends no separate finish chunk). Then a
  usage chunk with ``choices: []`` if ``stream_options.include_usage``, then ``[DONE]``.
  ``system_fingerprint`` rides on the terminal chunk, or on the usage chunk.
- Tool calls. The model generates Hermes/Qwen text (``<tool_call>\\n{"name": ...,
  "arguments": ...}\\n</tool_call>``), so ``token_ids`` cover the markup; a port of
  vLLM's Hermes parser reads it back. Streams send the name delta (``id``, ``type``,
  ``index``, ``function.name``), then argument pieces; markup-only tokens become
  ``"delta": {}`` chunks, skipped unless ``logprobs`` or ``return_token_ids`` was asked.
  Without ``tools`` (or with ``tool_choice: "none"``) the markup comes back as content. A named
  ``tool_choice`` finishes with ``"stop"`` and content ``""``, as vLLM's structured decoding does.
- Reasoning (``reasoning_parser``, vLLM's ``--reasoning-parser``): a ``Reply.reasoning`` is generated
  between ``<think>`` and ``</think>`` and comes back as ``message.reasoning`` (content null when nothing
  follows) and ``delta.reasoning`` pieces (the tags: no delta), with
  ``usage.completion_tokens_details.reasoning_tokens`` (the sampled tokens between the tags, as vLLM
  counts them: a template whose generation prompt opens ``<think>`` itself gets 0 from vLLM).
- ``enable_prompt_tokens_details`` (``--enable-prompt-tokens-details``): ``usage.prompt_tokens_details``
  with ``cached_tokens`` (the prompt's prefix shared with an earlier prompt, in 32-token blocks, never the
  whole prompt) and ``created_cache_tokens`` 0.
- A prompt over ``max_model_len`` is vLLM's 400 (its renderer's words, before anything is generated);
  ``Reply.stream_error`` is an engine failure inside a stream, as vLLM sends it: its ``ErrorResponse``
  written by ``json.dumps`` as a ``data:`` event, then ``data: [DONE]``.
- Logprobs: chat ``{token, logprob, bytes, top_logprobs}`` and the legacy completions
  shape, sampled token first, as vLLM orders its logprob dicts.
- ``/pause``, ``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping``
  (``fake.handover``, in ``fake_vllm_rl.py``): what a GPU hand-over talks to; generation
  requests that arrive while paused or asleep are refused there (vLLM would queue them).
- ``/v1/models`` (LoRA cards: ``root`` = path, ``parent`` = base model), LoRA load and
  unload statuses, plain-text success bodies and error texts, the unknown-model 404,
  ``{"error": {message, type, param, code}}`` bodies with file paths scrubbed to
  ``<path>``, and completions' default ``max_tokens`` of 16.
- ``GET /metrics``: one ``vllm:num_requests_running`` line per engine, labelled as vLLM labels it;
  ``data_parallel_size`` engines (``--data-parallel-size``), so a proxy can tell data parallel apart.

Simplified:

- A toy tokenizer (special tokens, words, runs of blanks, newlines and punctuation marks
  are pieces; a piece's id is a hash of it) and a ChatML-like template, not a real model's.
- vLLM ends a natural stop with the EOS id in ``token_ids`` (counted in usage); the fake
  does so only with ``emit_eos=True``.
- Minimal request validation (missing ``messages``/``prompt``, bad JSON) with approximate
  messages. No ``echo``, stop strings, ``continuous_usage_stats`` or ``parallel_tool_calls``;
  one prompt per completions request; ``tool_choice`` "required" acts like "auto" (a named one
  still generates the Hermes markup); at most 20 top logprobs. Loading a LoRA never
  reads ``lora_path``: set ``fail_next_load`` to make a load fail. ``/metrics`` has no other
  metric, and its running count is always 0.
- LoRA resolvers: set ``resolve_lora`` (an async function of the name that returns a path
  or None) to play vLLM's registered resolvers; a request naming a model the fake does not
  hold asks it first (``POST /tokenize`` and generation), as vLLM's ``_check_model`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
import uvicorn
from fake_vllm_rl import HandoverEndpoints
from fake_vllm_text import (
    _ALT_PIECES,
    _VOCAB,
    EOS_TOKEN_ID,
    THINK_END,
    THINK_START,
    _assistant_text,
    _encode,
    _hermes_deltas,
    _parse_tool_calls,
    _text,
    detokenize,
    render_chat,
    sampled_logprob,
    tokenize,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["EOS_TOKEN_ID", "FakeVLLM", "Reply", "ToolCall", "serve_in_thread"]

VLLM_VERSION = "0.32.0"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs

# ---------------------------------------------------------------- scripted replies


@dataclass(frozen=True)
class ToolCall:
    """A tool call the fake model makes; ``arguments`` is the JSON text it generates.

    vLLM's Hermes parser re-serializes arguments with ``json.dumps`` in non-streamed
    responses but streams the generated text: write ``arguments`` as ``json.dumps`` does
    (``", "`` and ``": "``) and both agree. ``id`` defaults to a random ``chatcmpl-tool-...``.
    """

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class Reply:
    """What the next generation request answers.

    ``finish_reason`` defaults to vLLM's: "tool_calls" when the request had ``tools`` and
    the calls parsed (but "stop" under a named ``tool_choice``), "length" when ``max_tokens``
    cut the output, else "stop". A ``status`` other than 200 answers vLLM's error body with
    ``error_message``. ``fail_mid_stream`` drops the connection after the first token chunk
    (non-streamed: halfway through the body); ``stream_error`` is an engine failure after the
    first token chunk, as vLLM reports it inside a stream (its error event, then ``[DONE]``).
    ``reasoning`` is thought first (``<think>...</think>``): with the server's
    ``reasoning_parser`` it comes back as ``reasoning``, else as content. ``delay_s`` is slept
    before answering; with ``held`` the answer also waits until that event is set (a test acts while a call
    is in flight, however long the acting takes on a loaded machine).
    """

    content: str = ""
    tool_calls: Sequence[ToolCall] = ()
    finish_reason: str | None = None
    status: int = 200
    error_message: str = ""
    fail_mid_stream: bool = False
    stream_error: str = ""
    reasoning: str = ""
    delay_s: float = 0.0
    held: threading.Event | None = None


@dataclass(frozen=True)
class _Output:
    token_ids: list[int]
    texts: list[str]  # the text each token adds
    truncated: bool  # cut by max_tokens
    think: int = 0  # the first tokens that are the thinking, its tags included

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str:
        return "".join(t for t in self.texts[: self.think] if t not in (THINK_START, THINK_END))

    @property
    def answer(self) -> str:
        return "".join(self.texts[self.think :])


def _generate(reply: Reply, max_tokens: int | None, emit_eos: bool) -> _Output:
    text = _assistant_text(reply.content, [(c.name, c.arguments) for c in reply.tool_calls])
    think = len(_encode(f"{THINK_START}{reply.reasoning}{THINK_END}")[0]) if reply.reasoning else 0
    ids, texts = _encode(f"{THINK_START}{reply.reasoning}{THINK_END}{text}" if reply.reasoning else text)
    if emit_eos:
        ids.append(EOS_TOKEN_ID)
        texts.append("")  # skip_special_tokens keeps the EOS out of the text
    truncated = max_tokens is not None and len(ids) > max_tokens
    if truncated:
        del ids[max_tokens:], texts[max_tokens:]
    return _Output(ids, texts, truncated, min(think, len(ids)))


def _top_logprobs(token_id: int, count: int) -> list[tuple[int, str, float]]:
    """(id, text, logprob) at one position: the sampled token (rank 1), then runners-up."""
    top = [(token_id, _VOCAB.text(token_id), sampled_logprob(token_id))]
    for piece in _ALT_PIECES[: count + 1]:
        (alt_id,) = _VOCAB.ids(piece)
        if len(top) < count and alt_id != token_id:
            top.append((alt_id, piece, -(1.0 + len(top))))
    return top


@functools.lru_cache(maxsize=1 << 16)
def _chat_logprob(token_id: int, k: int, as_ids: bool) -> dict[str, Any]:
    """One ``logprobs.content`` entry; cached, so callers must not mutate it."""

    def entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
        token = f"token_id:{token_id}" if as_ids else text
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    text = _VOCAB.text(token_id)
    sampled = entry(token_id, text, sampled_logprob(token_id))
    sampled["bytes"] = list(text.encode())  # vLLM takes these from the text even with token_id names
    sampled["top_logprobs"] = [entry(*alt) for alt in _top_logprobs(token_id, k)[:k]]
    return sampled


def _chat_logprobs(ids: Sequence[int], k: int, as_ids: bool) -> dict[str, Any]:
    return {"content": [_chat_logprob(token_id, k, as_ids) for token_id in ids]}


def _completion_logprobs(ids: Sequence[int], k: int, offset: int, as_ids: bool) -> dict[str, Any]:
    def name(token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if as_ids else text

    tokens = [name(t, _VOCAB.text(t)) for t in ids]
    offsets = [offset + sum(map(len, tokens[:j])) for j in range(len(tokens))]
    tops = [{name(i, p): lp for i, p, lp in _top_logprobs(t, max(k, 1))} for t in ids]
    return {
        "text_offset": offsets,
        "token_logprobs": [sampled_logprob(t) for t in ids],
        "tokens": tokens,
        "top_logprobs": tops,
    }


# ---------------------------------------------------------------- errors and responses

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
_PATHS = (
    re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"),
    re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"),
)


class _VLLMError(Exception):
    """Answered as vLLM's ``ErrorResponse``; like vLLM's sanitize_message, paths become ``<path>``."""

    def __init__(self, message: str, err_type: str, status: int, param: str | None = None) -> None:
        super().__init__(message)
        for pattern in _PATHS:
            message = pattern.sub("<path>", message)
        self.body = {"error": {"message": message.strip(), "type": err_type, "param": param, "code": status}}
        self.status = status


class _AbortConnection(Exception):
    """Raised inside a stream to drop the connection without finishing the response."""


def _invalid(field: str, kind: str = "missing", msg: str = "Field required") -> _VLLMError:
    message = f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.{field}', 'msg': '{msg}'}}"
    return _VLLMError(message, "Bad Request", 400, param=f"body.{field}")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise _invalid("json", "json_invalid", "JSON decode error") from exc
    if not isinstance(body, dict):
        raise _invalid("json", "model_attributes_type", "Input should be a valid dictionary")
    return body


def _json(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _VLLMError)
    return _json(exc.body, exc.status)


def _event(chunk: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


_BLOCK = 32  # vLLM's KV cache block on a CPU, as tracetrain serve starts it (--block-size 32)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _random_id() -> str:
    return os.urandom(8).hex()  # vLLM's random_uuid(): 16 hex characters


class _EventStream:
    """ASGI ``text/event-stream`` response that stops early when the client leaves.

    ``_AbortConnection`` from the events leaves the response unfinished, which makes
    uvicorn close the socket (and log one error line).
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_disconnect: Callable[[], None]) -> None:
        self._events = events
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            async for event in self._events:
                if watcher.done():
                    self._on_disconnect()
                    return
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except _AbortConnection:
            return
        finally:
            watcher.cancel()
            await self._events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _CutResponse:
    """A JSON response whose connection drops halfway through the body."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(self._body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        half = self._body[: len(self._body) // 2]
        await send({"type": "http.response.body", "body": half, "more_body": True})


# ---------------------------------------------------------------- the server


@dataclass(frozen=True)
class _Job:
    """One accepted generation request."""

    head: dict[str, Any]  # id, object, created, model: the first keys of every body and chunk
    prompt_ids: list[int]
    out: _Output
    reply: Reply
    n: int
    include_usage: bool
    return_token_ids: bool
    tokens_as_ids: bool  # return_tokens_as_token_ids
    named_tool: bool = False  # tool_choice names a function: vLLM finishes it with "stop"
    parses_reasoning: bool = False  # the server runs a reasoning parser
    cached_tokens: int | None = None  # --enable-prompt-tokens-details: the prompt's tokens in the prefix cache

    def usage(self, *, nulls: bool) -> dict[str, Any]:
        """vLLM's usage; ``nulls``: a whole body's (every field), else a stream's usage chunk (nulls dropped)."""
        prompt, completion = len(self.prompt_ids), self.n * len(self.out.token_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        if self.cached_tokens is not None:
            details = {"cached_tokens": self.cached_tokens, "created_cache_tokens": 0}
            usage["prompt_tokens_details"] = details | ({"multimodal_tokens": None} if nulls else {})
        elif nulls:
            usage["prompt_tokens_details"] = None
        if self.parses_reasoning:  # the sampled tokens between <think> and </think> (vLLM's count_reasoning_tokens)
            tags = sum(t in (THINK_START, THINK_END) for t in self.out.texts[: self.out.think])
            usage["completion_tokens_details"] = {"reasoning_tokens": (self.out.think - tags) * self.n}
        elif nulls:
            usage["completion_tokens_details"] = None
        return usage


class FakeVLLM:
    """State and Starlette ``app`` of a fake vLLM server.

    Example::

        fake = FakeVLLM()
        fake.script(Reply("hello"), Reply(tool_calls=[ToolCall("f", '{"x": 1}')]))
        with serve_in_thread(fake.app) as url:
            ...  # an OpenAI client on f"{url}/v1" gets "hello", then a call to f
        assert fake.requests[0]["model"] == "fake/base-model"
    """

    tokenize = staticmethod(tokenize)
    detokenize = staticmethod(detokenize)
    render_chat = staticmethod(render_chat)
    sampled_logprob = staticmethod(sampled_logprob)
    max_model_len = 32768

    def __init__(
        self, base_model: str = "fake/base-model", *, token_delay_s: float = 0.0, emit_eos: bool = False,
        reasoning_parser: str | None = None, enable_prompt_tokens_details: bool = False,
    ) -> None:  # fmt: skip
        self.base_model = base_model
        self.token_delay_s = token_delay_s
        self.emit_eos = emit_eos
        # --reasoning-parser (any name: the fake reads <think>...</think> as deepseek_r1 and qwen3 do).
        self.reasoning_parser = reasoning_parser
        # --enable-prompt-tokens-details: usage tells the prompt's tokens found in the prefix cache.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self._prompts: list[list[int]] = []  # every prompt so far: the fake's prefix cache
        self.requests: list[dict[str, Any]] = []  # every generation body received, in order
        self.loras: dict[str, str] = {}  # loaded adapters: name -> path
        self.fail_next_load: str | None = None  # the engine error the next load fails with
        self.disconnected_streams = 0  # streams cut short because the client went away
        self.detokenized = 0  # POST /detokenize requests answered
        self.data_parallel_size = 1  # engines behind this server, as GET /metrics reports them
        self._replies: deque[Reply] = deque()
        # Asked first with each generation body: a Reply answers it, None leaves it to the script.
        # Lets a test answer one kind of request (a judge's) whatever else is queued.
        self.reply_for: Callable[[dict[str, Any]], Reply | None] | None = None
        # vLLM's LoRA resolvers: a name it does not hold -> the path of what it loads, or None (404).
        self.resolve_lora: Callable[[str], Awaitable[str | None]] | None = None
        self._fingerprint = f"vllm-{VLLM_VERSION}-{zlib.crc32(base_model.encode()):08x}"
        self.handover = HandoverEndpoints()  # pause, sleep and their order of calls
        self.app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self.handover.generation(self._chat), methods=["POST"]),
                Route("/v1/completions", self.handover.generation(self._completions), methods=["POST"]),
                Route("/v1/load_lora_adapter", self._load_lora, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._unload_lora, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/ping", self._health, methods=["GET", "POST"]),
                *self.handover.routes,
            ],
            exception_handlers={_VLLMError: _error_response},
        )

    def script(self, *replies: Reply) -> None:
        """Queue replies; each generation request takes the oldest (an echo when none is left)."""
        self._replies.extend(replies)

    @staticmethod
    def lora_not_found_message(lora_name: str, lora_path: str) -> str:
        """vLLM's LoRAAdapterNotFoundError text: as ``fail_next_load`` it makes the load a 404."""
        return f"Loading lora {lora_name} failed: No adapter found for {lora_path}"

    # ---- generation

    async def _chat(self, request: Request) -> Any:
        body = await _json_body(request)
        self.requests.append(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _invalid("messages")
        await self._resolved(body.get("model"))
        model = self._served_model(body.get("model"))
        self.handover.note(f"chat {model}")
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        try:
            prompt = render_chat(messages, body.get("tools"), add_generation_prompt=add_generation_prompt)
        except (KeyError, TypeError, AttributeError) as exc:
            raise _invalid("messages", "value_error", f"Malformed message: {exc!r}") from exc
        prompt_ids = self._within_context(tokenize(prompt))
        user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
        reply = await self._take_reply(body, f"echo: {_text(user)}")
        limit = next((body[key] for key in ("max_completion_tokens", "max_tokens") if body.get(key) is not None), None)
        job = self._job(request, body, "chat.completion", model, prompt_ids, reply, limit)
        role = "assistant" if add_generation_prompt or not messages else str(messages[-1].get("role"))
        parse_tools = bool(body.get("tools")) and body.get("tool_choice", "auto") != "none"
        k = min(int(body.get("top_logprobs") or 0), MAX_LOGPROBS) if body.get("logprobs") else None
        if body.get("stream"):
            return self._stream(
                job, [self._role_chunk(job, i, role) for i in range(job.n)], self._chat_chunk_maker(job, parse_tools, k)
            )
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s * len(job.out.token_ids))
        return self._respond(self._chat_body(job, role, parse_tools, k), reply)

    async def _completions(self, request: Request) -> Any:
        body = await _json_body(request)
        self.requests.append(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if not prompt:
            raise _VLLMError(
                "Either prompt or prompt_embeds must be provided and non-empty.", "BadRequestError", 400, "prompt"
            )
        if not isinstance(prompt, str) and not all(isinstance(t, int) for t in prompt):
            raise _VLLMError("fake_vllm serves one prompt per request.", "BadRequestError", 400, "prompt")
        prompt_ids = self._within_context(tokenize(prompt) if isinstance(prompt, str) else list(prompt))
        await self._resolved(body.get("model"))
        model = self._served_model(body.get("model"))
        self.handover.note(f"completions {model}")
        reply = await self._take_reply(body, f"echo: {detokenize(prompt_ids)}")
        job = self._job(request, body, "text_completion", model, prompt_ids, reply, body.get("max_tokens", 16))
        k = min(int(body["logprobs"]), MAX_LOGPROBS) if body.get("logprobs") is not None else None
        if body.get("stream"):
            return self._stream(job, [], self._completion_chunk_maker(job, k))
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s * len(job.out.token_ids))
        return self._respond(self._completion_body(job, k), reply)

    def _within_context(self, prompt_ids: list[int]) -> list[int]:
        """vLLM's 400 for a prompt over ``max_model_len`` (its renderer's text: it tokenizes at most one token
        more, so it says "at least"), before anything is generated."""
        if len(prompt_ids) > self.max_model_len:
            limit = self.max_model_len
            raise _VLLMError(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
                f"{limit + 1} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                f"the length of the input prompt. (parameter=input_tokens, value={limit + 1})",
                "BadRequestError", 400, param="input_tokens",
            )  # fmt: skip
        return prompt_ids

    def _cached(self, prompt_ids: list[int]) -> int | None:
        """With prompt token details: the prompt's tokens a prefix cache of 32-token blocks holds (vLLM on a CPU)."""
        if not self.enable_prompt_tokens_details:
            return None
        longest = max((_shared(prompt_ids, seen) for seen in self._prompts), default=0)
        self._prompts.append(prompt_ids)
        return min(longest, len(prompt_ids) - 1) // _BLOCK * _BLOCK

    async def _resolved(self, model: Any) -> None:
        """vLLM's _check_model: a name it does not hold goes to the resolvers, and what they find is loaded."""
        if self.resolve_lora is None or not isinstance(model, str) or model == self.base_model or model in self.loras:
            return
        path = await self.resolve_lora(model)
        if path is not None:
            self.loras[model] = path

    def _served_model(self, model: Any) -> str:
        if not model or model == self.base_model:
            return self.base_model
        if model in self.loras:
            return str(model)
        raise _VLLMError(
            f"The model `{model}` does not exist. Valid aliases: {self.base_model}.",
            "NotFoundError",
            404,
            param="model",
        )

    async def _take_reply(self, body: dict[str, Any], echo: str) -> Reply:
        reply = self.reply_for(body) if self.reply_for is not None else None
        if reply is None:
            reply = self._replies.popleft() if self._replies else Reply(content=echo)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        while reply.held is not None and not reply.held.is_set():
            await asyncio.sleep(0.01)
        if reply.status != 200:
            err_type = _ERROR_TYPES.get(reply.status) or HTTPStatus(reply.status).phrase
            raise _VLLMError(reply.error_message or err_type, err_type, reply.status)
        return reply

    def _job(
        self,
        request: Request,
        body: Mapping[str, Any],
        kind: str,
        model: str,
        prompt_ids: list[int],
        reply: Reply,
        max_tokens: int | None,
    ) -> _Job:
        stream = bool(body.get("stream"))
        prefix = "chatcmpl-" if kind == "chat.completion" else "cmpl-"
        request_id = request.headers.get("x-request-id") or str(body.get("request_id") or _random_id())
        head = {
            "id": prefix + request_id,
            "object": f"{kind}.chunk" if stream and prefix == "chatcmpl-" else kind,
            "created": int(time.time()),
            "model": model,
        }
        return _Job(
            head=head,
            prompt_ids=prompt_ids,
            reply=reply,
            n=int(body.get("n") or 1),
            out=_generate(reply, None if max_tokens is None else int(max_tokens), self.emit_eos),
            include_usage=stream and bool((body.get("stream_options") or {}).get("include_usage")),
            return_token_ids=bool(body.get("return_token_ids")),
            tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
            named_tool=isinstance(body.get("tool_choice"), dict),
            parses_reasoning=self.reasoning_parser is not None and kind == "chat.completion",
            cached_tokens=self._cached(prompt_ids),
        )

    @staticmethod
    def _respond(content: dict[str, Any], reply: Reply) -> Any:
        return _CutResponse(orjson.dumps(content)) if reply.fail_mid_stream else _json(content)

    def _chat_body(self, job: _Job, role: str, parse_tools: bool, k: int | None) -> dict[str, Any]:
        out = job.out
        text = out.answer if job.parses_reasoning else out.text
        content, calls = _parse_tool_calls(text) if parse_tools else (text, [])
        if job.parses_reasoning and not content:
            content = None  # all thinking: vLLM's reasoning parser leaves no content
        if calls and job.named_tool:
            content = ""  # a named tool choice decodes the arguments alone
        tool_finish = "stop" if job.named_tool else "tool_calls"
        finish = job.reply.finish_reason or (tool_finish if calls else "length" if out.truncated else "stop")
        logprobs = None if k is None else _chat_logprobs(out.token_ids, k, job.tokens_as_ids)
        choices = []
        for i in range(job.n):
            message: dict[str, Any] = {
                "role": role,
                "content": content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if calls:  # vLLM drops an empty tool_calls list from the message
                message["tool_calls"] = [
                    {"id": self._call_id(job, j), "type": "function", "function": {"name": name, "arguments": args}}
                    for j, (name, args) in enumerate(calls)
                ]
            message["reasoning"] = (out.reasoning or None) if job.parses_reasoning else None
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": out.token_ids if job.return_token_ids else None,
                    "routed_experts": None,
                }
            )
        return {
            **job.head,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self._fingerprint,
            "usage": job.usage(nulls=True),
            "prompt_logprobs": None,
            "prompt_token_ids": job.prompt_ids if job.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _completion_body(self, job: _Job, k: int | None) -> dict[str, Any]:
        out = job.out
        finish = job.reply.finish_reason or ("length" if out.truncated else "stop")
        logprobs = None if k is None else _completion_logprobs(out.token_ids, k, 0, job.tokens_as_ids)
        choices = [
            {
                "index": i,
                "text": out.text,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": out.token_ids if job.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": job.prompt_ids if job.return_token_ids else None,
                "routed_experts": None,
            }
            for i in range(job.n)
        ]
        return {
            **job.head,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self._fingerprint,
            "usage": job.usage(nulls=True),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    @staticmethod
    def _call_id(job: _Job, index: int) -> str:
        scripted = job.reply.tool_calls[index].id if index < len(job.reply.tool_calls) else None
        return scripted or f"chatcmpl-tool-{_random_id()}"

    @staticmethod
    def _role_chunk(job: _Job, index: int, role: str) -> dict[str, Any]:
        choice = {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        return {
            **job.head,
            "choices": [choice],
            "prompt_token_ids": job.prompt_ids if job.return_token_ids else None,
            "prompt_text": None,
        }

    def _chat_chunk_maker(
        self, job: _Job, parse_tools: bool, k: int | None
    ) -> Callable[[int, int, bool], dict[str, Any] | None]:
        out = job.out
        think = out.think if job.parses_reasoning else 0
        # The reasoning parser: the thinking's pieces as reasoning deltas, its tags as nothing.
        thought = [None if t in (THINK_START, THINK_END) else {"reasoning": t} for t in out.texts[:think]]
        answer = out.texts[think:]
        if parse_tools:
            deltas = [thought + _hermes_deltas(answer, lambda j: self._call_id(job, j)) for _ in range(job.n)]
        else:  # the parser passes text through, and has nothing to say for an empty delta (a reasoning parser has)
            deltas = [thought + [{"content": t} if t or think else None for t in answer]] * job.n
        tools_streamed = [any(d is not None and "tool_calls" in d for d in ds) for ds in deltas]
        tool_finish = "stop" if job.named_tool else "tool_calls"

        def choice(step: int, i: int, last: bool) -> dict[str, Any] | None:
            token_ids = out.token_ids[step : step + 1]
            delta = deltas[i][step] if token_ids else {"content": ""}
            if delta is None:
                if not last and k is None and not job.return_token_ids:
                    return None
                delta = {}
            logprobs = None if k is None else _chat_logprobs(token_ids, k, job.tokens_as_ids)
            body: dict[str, Any] = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            if last:
                natural = "length" if out.truncated else tool_finish if tools_streamed[i] else "stop"
                body |= {"finish_reason": job.reply.finish_reason or natural, "stop_reason": None}
            body["token_ids"] = token_ids if job.return_token_ids else None
            return body

        return choice

    @staticmethod
    def _completion_chunk_maker(job: _Job, k: int | None) -> Callable[[int, int, bool], dict[str, Any] | None]:
        out = job.out
        finish = job.reply.finish_reason or ("length" if out.truncated else "stop")
        names = (f"token_id:{t}" if job.tokens_as_ids else _VOCAB.text(t) for t in out.token_ids)
        offsets = list(itertools.accumulate(map(len, names), initial=0))  # logprobs.text_offset per token

        def choice(step: int, i: int, last: bool) -> dict[str, Any]:
            token_ids = out.token_ids[step : step + 1]
            logprobs = None if k is None else _completion_logprobs(token_ids, k, offsets[step], job.tokens_as_ids)
            return {
                "index": i,
                "text": out.texts[step] if token_ids else "",
                "logprobs": logprobs,
                "finish_reason": finish if last else None,
                "stop_reason": None,
                "prompt_token_ids": job.prompt_ids if job.return_token_ids and step == 0 else None,
                "token_ids": token_ids if job.return_token_ids else None,
            }

        return choice

    def _stream(
        self, job: _Job, opening: Sequence[dict[str, Any]], choice: Callable[[int, int, bool], dict[str, Any] | None]
    ) -> _EventStream:
        return _EventStream(self._events(job, opening, choice), self._count_disconnect)

    async def _events(
        self, job: _Job, opening: Sequence[dict[str, Any]], choice: Callable[[int, int, bool], dict[str, Any] | None]
    ) -> AsyncGenerator[bytes, None]:
        """Both APIs' streams: opening chunks, a chunk per token per choice, usage, ``[DONE]``."""
        for chunk in opening:
            yield _event(chunk)
        steps = max(len(job.out.token_ids), 1)  # an empty output still gets its finishing chunk
        for step in range(steps):
            await asyncio.sleep(self.token_delay_s)
            last = step == steps - 1
            for i in range(job.n):
                body = choice(step, i, last)
                if body is None:
                    continue
                chunk = {**job.head, "choices": [body]}
                if last and not job.include_usage:
                    chunk["system_fingerprint"] = self._fingerprint
                yield _event(chunk)
                if job.reply.fail_mid_stream:
                    raise _AbortConnection
                if job.reply.stream_error:  # vLLM's create_streaming_error_response: json.dumps of its ErrorResponse
                    error = {"message": job.reply.stream_error, "type": "InternalServerError", "param": None,
                             "code": 500}  # fmt: skip
                    yield f"data: {json.dumps({'error': error})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
        if job.include_usage:
            usage = job.usage(nulls=False)
            yield _event({**job.head, "choices": [], "usage": usage, "system_fingerprint": self._fingerprint})
        yield b"data: [DONE]\n\n"

    def _count_disconnect(self) -> None:
        self.disconnected_streams += 1

    # ---- models and adapters

    async def _models(self, request: Request) -> Response:
        now = int(time.time())

        def card(model_id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
            permission = {
                "id": f"modelperm-{_random_id()}",
                "object": "model_permission",
                "created": now,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
            return {
                "id": model_id,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_model_len,
                "permission": [permission],
            }

        cards = [card(self.base_model, self.base_model, None, self.max_model_len)]
        cards += [card(name, path, self.base_model, None) for name, path in self.loras.items()]
        return _json({"object": "list", "data": cards})

    async def _load_lora(self, request: Request) -> Response:
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise _VLLMError("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name == self.base_model:
            raise _VLLMError(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
        if not body.get("load_inplace") and name in self.loras:
            raise _VLLMError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        if self.fail_next_load is not None:
            engine_error, self.fail_next_load = self.fail_next_load, None
            not_found = self.lora_not_found_message(name, path)
            if not_found in engine_error:
                raise _VLLMError(not_found, "NotFoundError", 404)
            raise _VLLMError(engine_error, "InternalServerError", 500)
        self.loras[name] = path
        self.handover.note(f"load {name}")
        # vLLM answers a bare text body without a content-type.
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: Request) -> Response:
        name = (await _json_body(request)).get("lora_name")
        if not name:
            raise _VLLMError("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in self.loras:
            raise _VLLMError(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.loras[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _detokenize(self, request: Request) -> Response:
        body = await _json_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise _invalid("tokens")
        if body.get("model") is not None:
            self._served_model(body["model"])
        self.detokenized += 1
        return _json({"prompt": detokenize(tokens)})

    async def _metrics(self, request: Request) -> Response:
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            *(
                f'vllm:num_requests_running{{model_name="{self.base_model}",engine="{engine}"}} 0.0'
                for engine in range(self.data_parallel_size)
            ),
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _tokenize(self, request: Request) -> Response:
        body = await _json_body(request)
        prompt = body.get("prompt")
        messages = body.get("messages")
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            # vLLM's TokenizeChatRequest: the messages rendered by the chat template (generation prompt by default).
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            prompt = render_chat(messages, body.get("tools"), add_generation_prompt=add_generation_prompt)
        if not isinstance(prompt, str):
            raise _invalid("prompt")
        await self._resolved(body.get("model"))
        if body.get("model") is not None:
            self._served_model(body["model"])
        tokens = tokenize(prompt)
        return _json({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None})

    async def _health(self, request: Request) -> Response:
        return Response()


# ---------------------------------------------------------------- running it


class _QuickServer(uvicorn.Server):
    """Notices ``should_exit`` within 10 ms instead of 100 ms: test suites stop many servers."""

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            await asyncio.sleep(0.01)


@contextmanager
def serve_in_thread(
    app: ASGIApp, host: str = "127.0.0.1", *, port: int = 0, startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """Serve any ASGI ``app`` with uvicorn on ``port`` (default: an ephemeral one) in a daemon thread.

    Yields the base URL, e.g. ``http://127.0.0.1:PORT``; on exit the server stops and the
    thread is joined. Lifespan events run, so a FastAPI app's start-up happens first: on a loaded
    machine a proxy's (its store, its migrations) has taken over 10 s, hence the generous limit; a
    start-up that fails ends the wait at once.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="asyncio",
        ws="none",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = _QuickServer(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{host}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn stopped during start-up (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start within {startup_timeout_s}s")
            time.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main(argv: Sequence[str] | None = None) -> None:
    """``python tests/fake_vllm.py --port 8001``: serve the fake alone, for benchmarks."""
    parser = argparse.ArgumentParser(description="A fake vLLM 0.32 OpenAI-compatible server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default="fake/base-model", help="served base model name")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    parser.add_argument("--emit-eos", action="store_true", help="end natural stops with the EOS id")
    args = parser.parse_args(argv)
    fake = FakeVLLM(args.model, token_delay_s=args.token_delay, emit_eos=args.emit_eos)
    uvicorn.run(
        fake.app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
