"""A streamed chat completion as Anthropic's Messages events, translated chunk by chunk as it arrives.

Anthropic's grammar (https://docs.anthropic.com/en/docs/build-with-claude/streaming): ``message_start``
(the message with empty content), then per content block ``content_block_start``, its
``content_block_delta``s (``thinking_delta`` and a closing ``signature_delta`` for thinking;
``text_delta``; ``input_json_delta`` for a tool's arguments) and ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``; ``ping`` may come at any time; a failure
is ``event: error``. Each goes out as ``event: <type>`` plus its JSON as ``data``.

vLLM's chunks map onto it so: its first chunk carries the prompt's ids, so ``message_start`` reports
the prompt's length (the cached share and the output arrive with usage, in ``message_delta``);
reasoning deltas are a ``thinking`` block (signed once it ends: ``_shape``), or, for a client that did
not ask for thinking, ``ping``s at most every ``PING_EVERY_S`` while the model thinks, so no stream sits
silent; content deltas are text (blanks held until text follows: a parser's ``"\\n\\n"`` before a tool
call is no block); a tool call's first delta opens a ``tool_use`` block (deltas that repeat its ``id``
do not open another) and its argument pieces are the block's JSON deltas; the chunks that carry only
markup (``"delta": {}``) send nothing. ``message_delta`` and ``message_stop`` are held until the record
is committed (``finish``), so the record is durable before the stream's end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from proxy.errors import UpstreamError
from proxy.gateway._served import Signer
from proxy.gateway.dialects.messages import _shape as out

PING_EVERY_S = 5.0  # a client's idle timeout is tens of seconds or more (Claude Code: 60 s and up)


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


_PING = event("ping", {"type": "ping"})


class MessagesStream:
    """One streamed Messages call: ``feed`` each chat chunk, ``finish`` once, ``response`` for the record."""

    def __init__(self, model: str, stop_sequences: Sequence[str] | None, signer: Signer, *, thinking: bool) -> None:
        self._model = model
        self._stop_sequences = stop_sequences
        self._signer = signer
        self._thinking = thinking  # the client asked for thinking blocks
        self._chat_id: Any = None
        self._started = False
        self._prompt_tokens: int | None = None
        self._blocks: list[dict[str, Any]] = []  # the content so far; tool_use inputs as their JSON text
        self._open: int | None = None  # the block being streamed
        self._tools: dict[int, int] = {}  # a chat tool call's index -> its block
        self._blank = ""  # blanks not sent yet: a text block opens only if text follows
        self._pinged = 0.0  # when the last ping went out (hidden thinking)
        self._finish_reason: Any = None
        self._matched: Any = None  # vLLM's stop_reason: the stop string that ended the text
        self._usage: Any = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if not self._started:
            self._started, self._chat_id = True, chunk.get("id")
            prompt_ids = chunk.get("prompt_token_ids")
            self._prompt_tokens = len(prompt_ids) if isinstance(prompt_ids, list) else None
            opening = out.message(self._chat_id, self._model, [], (None, None), self._tokens())
            events.append(event("message_start", {"type": "message_start", "message": opening}))
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # Messages has one answer; the proxy never asks for more
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason, self._matched = choice["finish_reason"], choice.get("stop_reason")
        return events

    def _tokens(self) -> dict[str, Any]:
        return out.usage(self._usage, self._prompt_tokens)

    def _reasoning(self, text: str) -> list[bytes]:
        if not self._thinking:
            now = time.monotonic()
            if now - self._pinged < PING_EVERY_S:
                return []
            self._pinged = now
            return [_PING]
        events = []
        if self._open is None or self._blocks[self._open]["type"] != "thinking":
            events = self._start({"type": "thinking", "thinking": "", "signature": ""})
        assert self._open is not None
        self._blocks[self._open]["thinking"] += text
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[bytes]:
        events = []
        if self._open is None or self._blocks[self._open]["type"] != "text":
            if text.isspace():
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
            events = self._start({"type": "text", "text": ""})
        assert self._open is not None
        self._blocks[self._open]["text"] += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        index = int(call.get("index") or 0)
        function = call.get("function") or {}
        events = []
        known = self._tools.get(index)
        if known is None or (call.get("id") and out.tool_use_id(call["id"]) != self._blocks[known]["id"]):
            self._blank = ""  # blanks before a tool call are no block
            name = function.get("name") or ""
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": out.tool_use_id(call.get("id")),
                "name": name,
                "input": {},
            }
            events = self._start(block)
            self._tools[index] = len(self._blocks) - 1
            self._blocks[-1]["input"] = ""
        arguments = function.get("arguments")
        if arguments:
            at = self._tools[index]
            self._blocks[at]["input"] += arguments
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append(event("content_block_delta", {"type": "content_block_delta", "index": at, "delta": delta}))
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self._open, "delta": delta})

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop()
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        start = {"type": "content_block_start", "index": self._open, "content_block": block}
        events.append(event("content_block_start", start))
        return events

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        events = []
        block = self._blocks[self._open]
        if block["type"] == "thinking":  # signed once whole, as Anthropic sends the signature last
            block["signature"] = self._signer.sign(out.THINKING, block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        index, self._open = self._open, None
        return [*events, event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _stopped(self) -> tuple[str, str | None]:
        used_tools = any(block["type"] == "tool_use" for block in self._blocks)
        return out.stop(self._finish_reason, self._matched, self._stop_sequences, used_tools)

    def finish(self) -> list[bytes]:
        events = self._stop()
        reason, sequence = self._stopped()
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": self._tokens()}  # fmt: skip
        return [*events, event("message_delta", delta), event("message_stop", {"type": "message_stop"})]

    def failed(self, error: UpstreamError) -> list[bytes]:
        # Anthropic's SDKs raise an API error on this event, whatever came before it.
        return [event("error", out.error_body(error.status_code, error.message))]

    def response(self) -> dict[str, Any]:
        content = [
            {**b, "input": out.tool_input(b["input"])} if b["type"] == "tool_use" else dict(b) for b in self._blocks
        ]
        # A stream that broke before vLLM said why it stopped did not stop: no stop reason in its record.
        stopped = self._stopped() if self._finish_reason is not None else (None, None)
        return out.message(self._chat_id, self._model, content, stopped, self._tokens())
