"""The Responses API's conversations as chat messages: what vLLM is sent, and what every reader shows.

One function each way, used by the proxy's translation (``proxy.gateway.dialects.responses._dialect``, after it
validated the body) and by every reader (``tracetrain_core.call_messages``), so
threading, the dashboard, export and the SFT path see exactly the messages vLLM rendered.
Lenient: what is not a known item or part is skipped (the proxy refused it before).

Pure Python: no store, proxy, web framework or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Text parts of Responses messages and of function call outputs; chat has one text part type.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})


def responses_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` of a Responses request as chat messages.

    A string input is one user message; items become messages in order: a ``message`` item
    (``developer`` becomes ``system``: chat templates know no developer role), a ``function_call``
    joins the assistant message before it (a chat reply carries its text and tool calls
    together) or starts one, a ``function_call_output`` is a ``tool`` message; reasoning items
    are dropped (the proxy never emits them).

    >>> responses_chat_messages({"instructions": "Be brief.", "input": "Hi"})
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for item in items if isinstance(items, list) else ():
        if isinstance(item, Mapping):
            _add_item(messages, item)
    return messages


def _add_item(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        messages.append({"role": "system" if role == "developer" else role, "content": _content(item.get("content"))})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _joined_text(output)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})


def _content(content: Any) -> str | list[dict[str, Any]]:
    """A message's content: a string stays one; text parts become one string; with images, chat's parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if isinstance(kind, str) and kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text") if kind != "refusal" else part.get("refusal")})
        elif kind == "input_image":
            image: dict[str, Any] = {"url": part.get("image_url")}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
    if all(part["type"] == "text" for part in parts):
        # Text parts as one string, joined as vLLM joins them for a template that takes strings (Codex sends several).
        return "\n".join(str(part["text"] or "") for part in parts)
    return parts


def _joined_text(parts: Any) -> str:
    if not isinstance(parts, Sequence):
        return ""
    texts = (
        p.get("text")
        for p in parts
        if isinstance(p, Mapping) and isinstance(p.get("type"), str) and p["type"] in _TEXT_PARTS
    )
    return "".join(str(text or "") for text in texts)


def responses_reply(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A Responses API response's output as one chat assistant message; None without output.

    Text of ``message`` items joined into ``content``; ``function_call`` items as ``tool_calls``
    (``call_id`` as the call's id), the way the chat reply vLLM produced them looked.
    """
    output = (response or {}).get("output")
    if not isinstance(output, list) or not output:
        return None
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            texts.append(_joined_text(item.get("content")))
        elif item.get("type") == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments") or ""}
            calls.append({"id": item.get("call_id"), "type": "function", "function": function})
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        reply["tool_calls"] = calls
    return reply
