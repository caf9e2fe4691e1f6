"""The shape of a captured conversation: a chat message's canonical form, a response's reply, shared prefixes.

These are the shape of what the store holds, read alike by the store's readers, the proxy
(keying and threading, the judge, the dashboard), the trainer and the command line.
The tail hashes the store keeps for threading are blake2b digests of ``canonical_message``
bytes, so a change here would stop every open trajectory from threading after an upgrade.

Pure Python (orjson only): no store, proxy, trainer, web framework or torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import orjson

from tracetrain_core._anthropic import anthropic_chat_messages, anthropic_reply
from tracetrain_core._responses_api import responses_chat_messages, responses_reply

T = TypeVar("T")


def canonical_message(message: Mapping[str, Any]) -> bytes:
    """A chat message as threading compares it, as bytes to hash.

    Role, content, name and tool calls count; content parts that are all text are joined
    (a framework may send either spelling), a missing content equals an empty one and so does
    one of blanks only (a tool parser may answer ``"\n\n"`` before a tool call; Anthropic's API
    refuses such a text block, so its clients drop it before sending the history back), tool-call
    ids are dropped and arguments re-serialized with sorted keys (frameworks re-serialize
    them), and every other field (``tool_call_id``, ``reasoning``, which clients may strip,
    ``refusal``...) is ignored.

    >>> canonical_message({"role": "user", "content": [{"type": "text", "text": "Hi"}], "refusal": None})
    b'["user","Hi",null,[]]'
    """
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = "".join(texts) if len(texts) == len(content) else content
    tool_calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        with contextlib.suppress(orjson.JSONDecodeError):  # not JSON: compare it as it is
            arguments = orjson.dumps(orjson.loads(arguments), option=orjson.OPT_SORT_KEYS).decode()
        tool_calls.append([function.get("name"), arguments])
    if isinstance(content, str) and content.isspace():
        content = ""
    canonical = [message.get("role"), content or "", message.get("name"), tool_calls]
    return orjson.dumps(canonical)


def same_message(sent: Any, seen: Any) -> bool:
    """Whether an agent sent back a message it was given (or that was its reply), as threading judges it."""
    if not isinstance(sent, Mapping) or not isinstance(seen, Mapping):
        return False
    return canonical_message(sent) == canonical_message(seen)


def first_choice(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A response's first choice, the one a trajectory goes on from; None for a failed call."""
    choices = (response or {}).get("choices") or []
    first = choices[0] if choices else None
    return first if isinstance(first, dict) else None


def reply_message(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The assistant message of a chat response's first choice (a copy); None without one.

    A completions response has text, not a message: None too (its callers say how to show text).
    """
    first = first_choice(response)
    message = first.get("message") if first is not None else None
    return {"role": "assistant", **message} if isinstance(message, dict) else None


def call_messages(endpoint: str, request: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    """A captured call's request as chat messages, whatever API it spoke; None for a text prompt.

    The one place every reader (the dashboard, the judge, export, the SFT path, Langfuse) turns a
    ``calls.request`` into a conversation: chat's messages as sent; the Responses API's
    ``instructions`` and ``input``, Anthropic's ``system`` and ``messages``, as the proxy translated
    them for vLLM.
    """
    request = request or {}
    if endpoint == "responses":
        return responses_chat_messages(request)
    if endpoint == "messages":
        return anthropic_chat_messages(request)
    if endpoint == "chat.completions":
        return [m for m in request.get("messages") or () if isinstance(m, dict)]
    return None


def call_tools(endpoint: str, request: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    """A captured call's tool definitions in chat's shape (``{"type": "function", "function": ...}``); None without."""
    tools = (request or {}).get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    if endpoint == "responses":  # {"type": "function", "name", "description", "parameters"}; hosted tools left out
        keys = ("name", "description", "parameters", "strict")
        tools = [
            {"type": "function", "function": {k: t[k] for k in keys if k in t}}
            for t in tools if isinstance(t, dict) and t.get("type") == "function"
        ]  # fmt: skip
    elif endpoint == "messages":  # Anthropic's {"name", "description", "input_schema"}
        tools = [
            {"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                              "parameters": t.get("input_schema")}}
            for t in tools if isinstance(t, dict) and t.get("type") in (None, "custom")
        ]  # fmt: skip
    return [t for t in tools if isinstance(t, dict)] or None


def call_reply(endpoint: str, response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A captured call's reply as one chat assistant message (tool calls in chat's shape); None without one."""
    if endpoint == "responses":
        return responses_reply(response)
    if endpoint == "messages":
        return anthropic_reply(response)
    return reply_message(response)


def common_prefix(*sequences: Sequence[T], same: Callable[[T, T], bool] | None = None) -> int:
    """How many leading items all ``sequences`` share (``same`` compares two items; default ``==``).

    >>> common_prefix([1, 2, 3], [1, 2, 4], [1, 2])
    2
    """
    if not sequences:
        raise ValueError("common_prefix needs at least one sequence")
    for i, items in enumerate(zip(*sequences, strict=False)):
        head = items[0]
        if not all((same(head, other) if same is not None else head == other) for other in items[1:]):
            return i
    return min(len(s) for s in sequences)
