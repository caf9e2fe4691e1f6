"""A chat completion's answer in Anthropic's Messages shape: ids, stop reasons, content blocks, errors.

Shared by the non-streamed translation (``_dialect``) and the stream's (``_stream``), so
both report a call alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from starlette.responses import Response

from proxy import errors
from proxy.errors import ProxyError

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); its SDKs raise by status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_VLLM_TOOL_PREFIX = "chatcmpl-tool-"


def message_id(chat_id: Any) -> str:
    """``msg_...`` from vLLM's ``chatcmpl-...`` (the same request id, as Anthropic's SDKs expect the prefix)."""
    return "msg_" + str(chat_id or "").removeprefix("chatcmpl-")


def tool_use_id(chat_id: Any) -> str:
    """``toolu_...`` from vLLM's ``chatcmpl-tool-...``; the client sends it back as its ``tool_result``'s id."""
    text = str(chat_id or "")
    return text if text.startswith("toolu_") else "toolu_" + text.removeprefix(_VLLM_TOOL_PREFIX)


def tool_input(arguments: str) -> Any:
    """A tool call's ``input``: its arguments parsed (vLLM's parsers emit JSON), else the text as generated."""
    try:
        return orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return arguments


def stop(finish_reason: Any, matched: Any, stop_sequences: Sequence[str] | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for vLLM's ``finish_reason`` and ``stop_reason``.

    vLLM's ``stop_reason`` is the stop string that ended the text (or a stop token's id, or None).
    """
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return _FINISH.get(str(finish_reason), "end_turn"), None


def usage(chat_usage: Any) -> dict[str, int]:
    chat_usage = chat_usage if isinstance(chat_usage, dict) else {}
    return {
        "input_tokens": int(chat_usage.get("prompt_tokens") or 0),
        "output_tokens": int(chat_usage.get("completion_tokens") or 0),
    }


def message(chat_id: Any, model: str, content: list[dict[str, Any]], stopped: tuple[str | None, str | None],
            tokens: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    return {
        "id": message_id(chat_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stopped[0],
        "stop_sequence": stopped[1],
        "usage": tokens,
    }


def from_chat(chat: dict[str, Any], body: dict[str, Any], model: str) -> dict[str, Any]:
    """A non-streamed chat completion as a Messages response (its first choice: Messages has one)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0]
    reply = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(call.get("id")), "name": function.get("name"),
                        "input": tool_input(function.get("arguments") or "")})  # fmt: skip
    stopped = stop(choice.get("finish_reason"), choice.get("stop_reason"), body.get("stop_sequences"))
    return message(chat.get("id"), model, content, stopped, usage(chat.get("usage")))


def error_body(status: int, text: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": text}}


def error_response(exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
    """``exc`` in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), its status kept."""
    return errors.error_response(exc, headers, body=error_body(exc.status_code, exc.message))
