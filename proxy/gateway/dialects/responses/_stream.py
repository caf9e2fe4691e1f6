"""A streamed Responses API call: vLLM's chat chunks in, the Responses API's events out, as they arrive.

The events, as OpenAI sends them (each with its ``sequence_number``): ``response.created``,
``response.in_progress``; per reasoning item (the model's thinking, with vLLM's ``--reasoning-parser``)
``response.output_item.added``, ``response.content_part.added`` (a ``reasoning_text`` part),
``response.reasoning_text.delta`` ..., ``response.reasoning_text.done``, ``response.content_part.done``,
``response.output_item.done``, as OpenAI streams an open-weight model's thinking; per text item
``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per function call
``response.output_item.added``, ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it), sent once the
call is recorded. A broken upstream ends the stream with ``response.failed``: the response's status
``failed`` and its ``error`` (``server_error``, what vLLM said).

Text that is only blanks is held until something else arrives: a tool parser's ``"\n\n"`` before a
tool call opens no message item (the non-streamed answer has none either).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from proxy.errors import UpstreamError
from proxy.gateway.dialects.responses._shape import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    status_of,
    usage_of,
)


class ResponsesStream:
    """One streamed call's translation (``proxy.gateway.dialects._dialect.StreamTranslator``)."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self._body = body
        self._model = model
        self._id = new_id("resp")
        self._created = int(time.time())
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # the items so far, the last one maybe in progress
        self._open: dict[str, Any] | None = None  # the item in progress
        self._text = ""  # the open message's (or reasoning item's) text so far
        self._blank = ""  # blanks not sent yet: they open a message only if text follows
        self._calls: dict[int, dict[str, Any]] = {}  # chat's tool call index -> its item
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._error: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        events = []
        if self._sequence == 0:
            opening = self._snapshot("in_progress")
            events += [self._event("response.created", response=opening),
                       self._event("response.in_progress", response=opening)]  # fmt: skip
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # the Responses API samples one output
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._reasoning_delta(delta["reasoning"])
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for part in delta.get("tool_calls") or ():
                events += self._call_delta(part)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
                events += self._close()
        return events

    def finish(self) -> list[bytes]:
        events = self._close()
        response = self.response()
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def failed(self, error: UpstreamError) -> list[bytes]:
        self._error = error.message
        return [self._event("response.failed", response=self.response())]

    def response(self) -> dict[str, Any]:
        if self._error is not None:
            status, incomplete = "failed", None
        else:
            status, incomplete = status_of(self._finish_reason)
        response = self._snapshot(status, incomplete)
        if self._error is not None:
            response["error"] = {"code": "server_error", "message": self._error}
        return response

    def _snapshot(self, status: str, incomplete: dict[str, str] | None = None) -> dict[str, Any]:
        output = [dict(item) for item in self._output]
        usage = usage_of(self._usage) if status != "in_progress" else None
        return response_object(self._body, self._model, self._id, self._created, output, status, incomplete, usage)

    def _begin(self, item: dict[str, Any]) -> bytes:
        self._open = item
        self._output.append(item)
        return self._event("response.output_item.added", output_index=len(self._output) - 1, item=item)

    def _reasoning_delta(self, text: str) -> list[bytes]:
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close()
            item = reasoning_item(new_id("rs"), "", status="in_progress")
            events.append(self._begin(item))
            part = {"type": "reasoning_text", "text": ""}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self._output) - 1, content_index=0, part=part))  # fmt: skip
        self._text += text
        events.append(self._event("response.reasoning_text.delta", item_id=self._output[-1]["id"],
                                  output_index=len(self._output) - 1, content_index=0, delta=text))  # fmt: skip
        return events

    def _text_delta(self, text: str) -> list[bytes]:
        events = []
        if self._open is None or self._open["type"] != "message":
            if text.isspace():
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
            events += self._close()
            item = message_item(new_id("msg"), "", status="in_progress")
            item["content"] = []
            events.append(self._begin(item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self._output) - 1, content_index=0, part=part))  # fmt: skip
        self._text += text
        item_id, index = str(self._output[-1]["id"]), len(self._output) - 1
        events.append(self._event("response.output_text.delta", item_id=item_id, output_index=index,
                                  content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return events

    def _call_delta(self, part: dict[str, Any]) -> list[bytes]:
        events = []
        function = part.get("function") or {}
        index = int(part.get("index", 0))
        item = self._calls.get(index)
        if item is None:
            events += self._close()
            self._blank = ""  # blanks before a tool call are no message
            item = function_call_item(new_id("fc"), part.get("id") or new_id("call"), function.get("name") or "", "",
                                      status="in_progress")  # fmt: skip
            self._calls[index] = item
            events.append(self._begin(item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._output.index(item), delta=function["arguments"]))  # fmt: skip
        return events

    def _close(self) -> list[bytes]:
        """The done events of the item in progress, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._output) - 1
        events = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self._text)
            item.update(done)
            events += [
                self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self._text),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=done["content"][0] if done["content"] else {"type": "reasoning_text", "text": ""}),
            ]  # fmt: skip
            self._text = ""
        elif item["type"] == "message":
            done = message_item(item["id"], self._text)
            item.update(done)
            events += [
                self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self._text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=done["content"][0]),
            ]  # fmt: skip
            self._text = ""
        else:
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events
