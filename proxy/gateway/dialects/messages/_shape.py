"""A chat completion's answer in Anthropic's Messages shape: ids, stop reasons, content blocks, usage, errors.

Shared by the non-streamed translation (``_dialect``) and the stream's (``_stream``), so
both report a call alike:

- the model's thinking (vLLM's ``reasoning``, with ``--reasoning-parser``) is a ``thinking`` block first,
  signed by the proxy (``Served.signer``): the signature is checked when the client sends the block
  back, as Anthropic checks its own; shown only to a client that asked for thinking (``thinking``
  enabled or adaptive), as Anthropic's API does;
- text that is only blanks (a Hermes-style parser's ``"\n\n"`` before a tool call) is no block:
  Anthropic's API never sends one, and refuses one sent back;
- an answer with a ``tool_use`` block stops with ``tool_use``, also when vLLM said ``stop`` (a named
  or required tool choice: vLLM, like OpenAI, finishes it so), as Anthropic's forced tool use does;
- usage in Anthropic's terms: ``input_tokens`` are the prompt's tokens that vLLM's prefix cache did not
  hold, ``cache_read_input_tokens`` those it held (vLLM's ``cached_tokens``, with
  ``--enable-prompt-tokens-details``), and ``output_tokens_details.thinking_tokens`` the thinking's share
  of ``output_tokens`` (where vLLM counts it);
- a prompt over the context is Anthropic's ``prompt is too long: N tokens > M maximum``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from starlette.responses import Response

from proxy import errors
from proxy.errors import ContextLengthExceeded, ProxyError
from proxy.gateway._served import Signer
from proxy.gateway.dialects._dialect import usage_detail

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
THINKING = "thinking"  # what a thinking block's signature signs: the kind, then the text


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


def stop(
    finish_reason: Any, matched: Any, stop_sequences: Sequence[str] | None, used_tools: bool
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for vLLM's ``finish_reason`` and ``stop_reason``.

    vLLM's ``stop_reason`` is the stop string that ended the text (or a stop token's id, or None);
    ``used_tools``: the answer holds a ``tool_use`` block.
    """
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    if used_tools and finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    return _FINISH.get(str(finish_reason), "end_turn"), None


def usage(chat_usage: Any, prompt_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's usage in Anthropic's terms (see the module docstring); ``prompt_tokens`` before usage arrives."""
    chat_usage = chat_usage if isinstance(chat_usage, dict) else {}
    cached = usage_detail(chat_usage, "prompt_tokens_details", "cached_tokens")
    prompt = int(chat_usage.get("prompt_tokens") or prompt_tokens or 0)
    tokens: dict[str, Any] = {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": int(chat_usage.get("completion_tokens") or 0),
    }
    if isinstance(chat_usage.get("completion_tokens_details"), dict):
        tokens["output_tokens_details"] = {
            "thinking_tokens": usage_detail(chat_usage, "completion_tokens_details", "reasoning_tokens")
        }
    return tokens


def thinking_block(text: str, signer: Signer) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": signer.sign(THINKING, text)}


def shows_thinking(body: dict[str, Any]) -> bool:
    """The client asked for thinking blocks (``thinking`` enabled or adaptive), as Anthropic's API sends them."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def message(chat_id: Any, model: str, content: list[dict[str, Any]], stopped: tuple[str | None, str | None],
            tokens: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
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


def from_chat(chat: dict[str, Any], body: dict[str, Any], model: str, signer: Signer) -> dict[str, Any]:
    """A non-streamed chat completion as a Messages response (its first choice: Messages has one)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0]
    reply = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if reply.get("reasoning") and shows_thinking(body):
        content.append(thinking_block(reply["reasoning"], signer))
    if reply.get("content") and not reply["content"].isspace():
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(call.get("id")), "name": function.get("name"),
                        "input": tool_input(function.get("arguments") or "")})  # fmt: skip
    used_tools = bool(reply.get("tool_calls"))
    stopped = stop(choice.get("finish_reason"), choice.get("stop_reason"), body.get("stop_sequences"), used_tools)
    return message(chat.get("id"), model, content, stopped, usage(chat.get("usage")))


def error_body(status: int, text: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": text}}


def error_response(exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
    """``exc`` in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), its status kept."""
    text = exc.message
    if isinstance(exc, ContextLengthExceeded) and exc.prompt_tokens is not None and exc.limit is not None:
        text = f"prompt is too long: {exc.prompt_tokens} tokens > {exc.limit} maximum"  # Anthropic's words
    return errors.error_response(exc, headers, body=error_body(exc.status_code, text))
