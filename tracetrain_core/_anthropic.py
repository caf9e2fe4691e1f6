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
- an assistant's ``thinking`` blocks are its ``reasoning``, as a chat client sends a reasoning model's
  answer back (the chat template keeps or drops it, as it does for chat); the proxy checks their
  signatures first, so this is thinking the policy sampled; ``redacted_thinking`` blocks are dropped;
- images (also inside tool results) are image parts when ``images`` (the model reads them), else a
  text placeholder (``tracetrain_core._omitted``), as are PDF documents; a text document is its
  text; a block of a newer API version is a placeholder too; Anthropic's server tools (web search,
  code execution...) are left out with a note at the end of the system prompt: readers never fail
  on a stored body, and every reader sees the notes vLLM read.

Pure Python (stdlib only): no store, proxy, web framework or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tracetrain_core._omitted import add_note, base64_size, dropped_tools, omitted, tools_note

_BILLING_HEADER = "x-anthropic-billing-header"
_ARGUMENTS = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False), without a new encoder per call
# A custom tool has no type (or "custom"); a server tool a dated one (web_search_20250305...).
_CUSTOM_TOOL_TYPES = (None, "custom")
_UNKNOWN_BLOCK = "not supported by this server"


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
    blocks = [b for b in content if isinstance(b, dict)]
    calls = [_tool_call(b) for b in blocks if b.get("type") == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": _text([b for b in blocks if b.get("type") == "text"])}
    thinking = [
        str(b["thinking"]) for b in blocks if b.get("type") == "thinking" and isinstance(b.get("thinking"), str)
    ]
    if thinking:
        message["reasoning"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _media(block: Mapping[str, Any], images: bool) -> dict[str, Any]:
    """An image or document block as a chat part: the image itself when the model reads images, else text."""
    found = block.get("source")
    source: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    kind, media_type = source.get("type"), source.get("media_type")
    if block.get("type") == "document":
        if kind == "text" and isinstance(source.get("data"), str):
            return _text_part(source["data"], block.get("title"))
        if kind == "content":
            return _text_part(_text(source.get("content")) or "", block.get("title"))
        name = media_type if isinstance(media_type, str) else str(kind or "file")
        return _text_part(omitted("document", name, base64_size(source.get("data")) if kind == "base64" else None))
    if images and kind == "base64" and isinstance(source.get("data"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{source['data']}"}}
    if images and kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if kind == "url":
        return _text_part(omitted("image", str(source.get("url"))[:200]))
    image_type = media_type if isinstance(media_type, str) else None
    return _text_part(omitted("image", image_type, base64_size(source.get("data")) if kind == "base64" else None))


def _text_part(text: str, title: Any = None) -> dict[str, Any]:
    return {"type": "text", "text": f"{title}\n{text}" if isinstance(title, str) and title else text}


def _parts(content: Any, images: bool) -> list[dict[str, Any]]:
    """A user turn's or a tool result's blocks (but tool results) as chat parts, in order."""
    if isinstance(content, str):
        return [_text_part(content)]
    parts = []
    for block in content if isinstance(content, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and "text" in block:
            parts.append(_text_part(str(block["text"])))
        elif kind in ("image", "document"):
            parts.append(_media(block, images))
        elif isinstance(kind, str) and kind not in ("tool_result", "thinking", "redacted_thinking"):
            parts.append(_text_part(omitted(f"{kind[:50]} block", why=_UNKNOWN_BLOCK)))
    return parts


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]] | None:
    """Text parts as one string joined with newlines (as vLLM joins them); with an image, the parts."""
    if not parts:
        return None
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _user(content: Any, images: bool) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, its other blocks as user messages, in their order."""
    if not isinstance(content, list):
        return [{"role": "user", "content": _text(content) or ""}]
    out: list[dict[str, Any]] = []
    pending: list[Any] = []  # blocks since the last tool result

    def flush() -> None:
        text = _content(_parts(pending, images))
        if text is not None:
            out.append({"role": "user", "content": text})
        pending.clear()

    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_result":
            flush()
            result = _content(_parts(block.get("content"), images))
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result or ""})
        else:
            pending.append(block)
    flush()
    return out


def anthropic_chat_messages(body: Mapping[str, Any], *, images: bool = False) -> list[dict[str, Any]]:
    """A Messages request's ``system`` and ``messages`` as chat messages (lenient: never raises).

    ``images``: the served model reads images (they go as image parts); else each is a placeholder.

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
            out.extend(_user(message.get("content"), images))
        elif message.get("role") == "system":
            out.append({"role": "system", "content": _system(message.get("content")) or ""})
    add_note(out, tools_note(dropped_tools(body.get("tools"), _CUSTOM_TOOL_TYPES)))
    return out


def anthropic_reply(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A Messages response's content as one chat assistant message; None for a failed call.

    >>> anthropic_reply({"type": "message", "content": [{"type": "text", "text": "4"}]})
    {'role': 'assistant', 'content': '4'}
    """
    if not isinstance(response, Mapping) or not isinstance(response.get("content"), list):
        return None
    return _assistant(response["content"])
