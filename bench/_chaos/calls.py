"""One call in each API's own grammar, and how its client judges the answer: whole, or failed.

A streamed answer is whole only if it ends as its API ends a good stream (chat and completions:
``data: [DONE]`` with no error event before it; Responses: ``response.completed``; Messages:
``message_stop``) and carries some text; anything else (an error event, a connection cut, an
error status) is a failure, as the API's own SDK would raise it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

APIS = ("chat", "completions", "responses", "messages")
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
          "messages": "/v1/messages"}  # fmt: skip


@dataclass(slots=True)
class Outcome:
    """What one call's client saw."""

    kind: str  # "ordinary" or a hostile class
    api: str
    stream: bool
    trajectory_id: str
    started: float  # time.monotonic()
    ended: float = 0.0
    status: int = 0  # 0: no answer at all (the connection failed)
    whole: bool = False  # a complete, well-formed answer
    error: str = ""  # what went wrong, as the client saw it
    expected: bool = False  # hostile: refused or failed as it should be
    extra: dict[str, Any] = field(default_factory=dict)


def body(api: str, task: str, *, stream: bool, **fields: Any) -> dict[str, Any]:
    """A small request of ``api`` asking ``task``; ``fields`` are added to it."""
    if api == "chat":
        made = {"messages": [{"role": "user", "content": task}], "max_tokens": 24}
    elif api == "completions":
        made = {"prompt": task, "max_tokens": 16}
    elif api == "responses":
        made = {"input": task, "max_output_tokens": 24}
    else:
        made = {"messages": [{"role": "user", "content": task}], "max_tokens": 24}
    return {"model": "agent", **made, "stream": stream, **fields}


def new_trajectory(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:16]}"


async def call(
    client: httpx.AsyncClient, kind: str, api: str, task: str, *, stream: bool, cut_after_first_event: bool = False,
    trajectory_id: str | None = None, **fields: Any,
) -> Outcome:  # fmt: skip
    """One call; ``cut_after_first_event``: the client hangs up once the stream's first event arrived."""
    outcome = Outcome(kind, api, stream, trajectory_id or new_trajectory(kind), time.monotonic())
    headers = {"X-Trajectory-Id": outcome.trajectory_id}
    made = body(api, task, stream=stream, **fields)
    try:
        content = orjson.dumps(made)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: the standard library does
        content = json.dumps(made).encode()
    try:
        async with client.stream("POST", _PATHS[api], content=content, headers=headers) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread())[:300].decode(errors="replace")
            elif not stream:
                outcome.whole = _whole_answer(api, orjson.loads(await response.aread()))
                outcome.error = "" if outcome.whole else "an incomplete answer"
            else:
                await _read_stream(api, response, outcome, cut_after_first_event)
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        outcome.whole = False
    outcome.ended = time.monotonic()
    return outcome


def _whole_answer(api: str, answer: Any) -> bool:
    if not isinstance(answer, dict):
        return False
    if api == "chat":
        return bool(answer["choices"][0]["message"].get("content"))
    if api == "completions":
        return bool(answer["choices"][0].get("text"))
    if api == "responses":
        return answer.get("status") == "completed" and bool(answer.get("output"))
    return answer.get("type") == "message" and bool(answer.get("content"))


async def _read_stream(api: str, response: httpx.Response, outcome: Outcome, cut: bool) -> None:
    text, ended, failed = [], False, ""
    event = ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
            if event == "error" or event == "response.failed":
                failed = event
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if cut:
            outcome.error = "the client hung up after the first event"
            return  # leaving the block closes the connection mid-stream
        if data == "[DONE]":
            ended = True
            continue
        chunk = orjson.loads(data)
        if "error" in chunk and api in ("chat", "completions"):
            failed = "error event"
        text.append(_delta_text(api, event, chunk))
        if (api == "responses" and event == "response.completed") or (api == "messages" and event == "message_stop"):
            ended = True
    outcome.whole = ended and not failed and bool("".join(text))
    outcome.error = "" if outcome.whole else (failed or "the stream ended without its closing event")


def _delta_text(api: str, event: str, chunk: dict[str, Any]) -> str:
    if api == "chat":
        choices = chunk.get("choices") or [{}]
        return str((choices[0].get("delta") or {}).get("content") or "")
    if api == "completions":
        choices = chunk.get("choices") or [{}]
        return str(choices[0].get("text") or "")
    if api == "responses":
        return str(chunk.get("delta") or "") if event == "response.output_text.delta" else ""
    delta = chunk.get("delta") or {}
    return str(delta.get("text") or "") if event == "content_block_delta" else ""
