"""The Responses API's conversations as chat messages: what vLLM is sent, and what every reader shows.

One function each way, used by the proxy's translation (``proxy.gateway.dialects.responses._dialect``, after it
validated the body) and by every reader (``tracetrain_core.call_messages``), so
threading, the dashboard, export and the SFT path see exactly the messages vLLM rendered.
Lenient: what is not a known item is skipped (the proxy refused what it cannot serve before). What the
model cannot use becomes a placeholder it reads (``tracetrain_core._omitted``): an image when the model
reads text only, a file; tools hosted by OpenAI (web search, file search...) are left out with a note
at the end of the system prompt.

Pure Python: no store, proxy, web framework or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tracetrain_core._omitted import add_note, base64_size, data_url_parts, dropped_tools, omitted, tools_note

# Text parts of Responses messages and of function call outputs; chat has one text part type.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "reasoning_text"})
_FUNCTION_TOOLS = ("function",)


def responses_chat_messages(body: Mapping[str, Any], *, images: bool = False) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` of a Responses request as chat messages.

    A string input is one user message; items become messages in order: a ``message`` item
    (``developer`` becomes ``system``: chat templates know no developer role), a ``function_call``
    joins the assistant message before it (a chat reply carries its text and tool calls
    together) or starts one, a ``function_call_output`` is a ``tool`` message; a ``reasoning`` item's
    text is the ``reasoning`` of the assistant message after it (what the model thought before that
    answer, as a chat client sends it back). ``images``: the served model reads images (image parts),
    else each is a placeholder.

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
    reasoning: list[str] = []  # reasoning items not yet given to an assistant message
    for item in items if isinstance(items, list) else ():
        if isinstance(item, Mapping):
            _add_item(messages, item, reasoning, images)
    add_note(messages, tools_note(dropped_tools(body.get("tools"), _FUNCTION_TOOLS)))
    return messages


def _add_item(messages: list[dict[str, Any]], item: Mapping[str, Any], reasoning: list[str], images: bool) -> None:
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        message = {"role": "system" if role == "developer" else role, "content": _content(item.get("content"), images)}
        messages.append(_thought(message, reasoning))
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and not reasoning:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append(_thought({"role": "assistant", "content": None, "tool_calls": [call]}, reasoning))
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _content(output, images)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    elif kind == "reasoning":
        parts = item.get("content")
        text = _joined_text(parts) if isinstance(parts, list) else ""
        if text:
            reasoning.append(text)


def _thought(message: dict[str, Any], reasoning: list[str]) -> dict[str, Any]:
    """An assistant message takes the reasoning items before it."""
    if message["role"] == "assistant" and reasoning:
        message["reasoning"] = "\n".join(reasoning)
        reasoning.clear()
    return message


def _content(content: Any, images: bool = False) -> str | list[dict[str, Any]]:
    """A message's content: a string stays one; text parts become one string; with images (read), chat's parts."""
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
            parts.append(_image(part, images))
        elif kind == "input_file":
            name = part.get("filename") or part.get("file_id") or part.get("file_url")
            size = base64_size(str(part.get("file_data") or "").rpartition(",")[2]) if part.get("file_data") else None
            parts.append({"type": "text", "text": omitted("file", str(name)[:200] if name else None, size)})
        elif isinstance(kind, str):  # a part of a newer API version
            parts.append({"type": "text", "text": omitted(f"{kind[:50]} part", why="not supported by this server")})
    if all(part["type"] == "text" for part in parts):
        # Text parts as one string, joined as vLLM joins them for a template that takes strings (Codex sends several).
        return "\n".join(str(part["text"] or "") for part in parts)
    return parts


def _image(part: Mapping[str, Any], images: bool) -> dict[str, Any]:
    url = part.get("image_url")
    if images and isinstance(url, str):
        image: dict[str, Any] = {"url": url}
        if part.get("detail"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    media_type, size = data_url_parts(url)
    if media_type is None and isinstance(url, str):
        return {"type": "text", "text": omitted("image", url[:200])}
    name = media_type or (f"file {part['file_id']}" if isinstance(part.get("file_id"), str) else None)
    return {"type": "text", "text": omitted("image", name, size)}


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
    (``call_id`` as the call's id), ``reasoning`` items' text as ``reasoning``: the way the chat reply
    vLLM produced them looked.
    """
    output = (response or {}).get("output")
    if not isinstance(output, list) or not output:
        return None
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "reasoning" and isinstance(item.get("content"), list):
            thoughts.append(_joined_text(item["content"]))
        elif item.get("type") == "message":
            texts.append(_joined_text(item.get("content")))
        elif item.get("type") == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments") or ""}
            calls.append({"id": item.get("call_id"), "type": "function", "function": function})
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if any(thoughts):
        reply["reasoning"] = "\n".join(t for t in thoughts if t)
    if calls:
        reply["tool_calls"] = calls
    return reply
