"""Anthropic's Messages API as chat messages: what vLLM renders for a ``/v1/messages`` call, and what readers show.

The proxy turns each Messages call into a chat completion (``proxy.gateway.dialects.messages._dialect``); these two
pure functions are that turn's message half, shared with the dashboard, export, SFT and Langfuse,
so every reader sees exactly the messages vLLM got:

- ``system`` (a string or text blocks) is one system message, and a ``system`` message among the
  messages (Claude Code sends them mid-conversation) one more, where it stands; Claude Code's
  attribution line (``x-anthropic-billing-header: ...``) is dropped from them, as vLLM drops it;
- a message's text blocks are joined with a newline, as vLLM joins a chat message's text parts;
- an assistant's ``tool_use`` blocks are its ``tool_calls`` (the ``toolu_...`` id kept, ``input`` as
  JSON text), each user ``tool_result`` block a ``tool`` message at its place in the turn;
  ``is_error`` is not rendered (chat has no such field: the result's text says what failed);
- ``thinking`` and ``redacted_thinking`` blocks are dropped (the policy writes none; a client that
  replays another model's thinking sends text the policy never sampled);
- anything else (images, documents, blocks of newer API versions) is skipped here: the proxy
  refuses images and documents before this runs, and readers must never fail on a stored body.

Pure Python (stdlib only): no store, proxy, web framework or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_BILLING_HEADER = "x-anthropic-billing-header"
_ARGUMENTS = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False), without a new encoder per call


def _text(content: Any) -> str | None:
    """A string, or the text of a list of blocks joined with newlines; None when it holds no text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text" and "text" in b]
    return "\n".join(str(t) for t in texts) if texts else None


def _system(content: Any) -> str | None:
    """A system prompt's text without Claude Code's attribution line, as vLLM (0.32) drops it from system messages.

    ``x-anthropic-billing-header: cc_version=...; cch=...;`` may change on every request: kept, it would
    stop a Claude Code session from threading; vLLM renders the prompt without it anyway.
    """
    if isinstance(content, list):
        kept = []
        for block in content:
            text = block.get("text") if isinstance(block, dict) else None
            if isinstance(text, str) and text.startswith(_BILLING_HEADER):
                rest = text.partition("\n")[2]
                if rest:
                    kept.append({**block, "text": rest})
            else:
                kept.append(block)
        content = kept
    elif isinstance(content, str) and content.startswith(_BILLING_HEADER):
        content = content.partition("\n")[2]
    return _text(content)


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    # Written as vLLM's tool parsers write arguments (json.dumps), so a replayed call reads as it was answered.
    arguments = _ARGUMENTS.encode(block.get("input") if block.get("input") is not None else {})
    return {"id": block.get("id"), "type": "function", "function": {"name": block.get("name"), "arguments": arguments}}


def _assistant(content: Any) -> dict[str, Any]:
    if not isinstance(content, list):
        return {"role": "assistant", "content": _text(content)}
    texts = [b for b in content if isinstance(b, dict) and b.get("type") == "text"]
    calls = [_tool_call(b) for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": _text(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: Any) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, its text as user messages, in their order."""
    if not isinstance(content, list):
        return [{"role": "user", "content": _text(content) or ""}]
    out: list[dict[str, Any]] = []
    pending: list[Any] = []  # text blocks since the last tool result

    def flush() -> None:
        text = _text(pending)
        if text is not None:
            out.append({"role": "user", "content": text})
        pending.clear()

    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_result":
            flush()
            result = _text(block.get("content"))
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result or ""})
        elif block.get("type") == "text":
            pending.append(block)
    flush()
    return out


def anthropic_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A Messages request's ``system`` and ``messages`` as chat messages (lenient: never raises).

    >>> anthropic_chat_messages({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]})
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    out: list[dict[str, Any]] = []
    system = _system(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            out.append(_assistant(message.get("content")))
        elif message.get("role") == "user":
            out.extend(_user(message.get("content")))
        elif message.get("role") == "system":
            out.append({"role": "system", "content": _system(message.get("content")) or ""})
    return out


def anthropic_reply(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A Messages response's content as one chat assistant message; None for a failed call.

    >>> anthropic_reply({"type": "message", "content": [{"type": "text", "text": "4"}]})
    {'role': 'assistant', 'content': '4'}
    """
    if not isinstance(response, Mapping) or not isinstance(response.get("content"), list):
        return None
    return _assistant(response["content"])
