"""Anthropic's Messages API (``POST /v1/messages``) as a chat completion, and back (a ``Dialect``).

vLLM's own ``/v1/messages`` returns no token ids, so each call goes to vLLM as a chat completion
on the chat path, which captures the exact prompt ids, sampled ids and logprobs
(docs/ARCHITECTURE.md, "Every API on the chat path"). The request's turn:

- ``system`` and ``messages`` become chat messages (``tracetrain_core.anthropic_chat_messages``, which the
  readers share); image and document blocks are refused (the policy reads text only);
- ``max_tokens`` (required, as in Anthropic's API), ``stop_sequences`` -> ``stop``,
  ``temperature``, ``top_p``, ``top_k``; ``tools`` (``input_schema`` -> ``parameters``) and
  ``tool_choice`` (``auto``, ``any`` -> ``required``, ``tool`` -> a named function, ``none``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``); Anthropic's server tools
  (web search, code execution...) are refused: the proxy runs none;
- ``output_config.format`` (a JSON schema) -> ``response_format``, which vLLM decodes to;
- whatever else the client sends (``metadata``, ``thinking``, ``cache_control``...) is kept in
  the record and not sent to vLLM.

The answer's turn is ``_shape`` (non-streamed) and ``_stream`` (events).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from proxy.errors import InvalidRequest, ProxyError
from proxy.gateway.dialects._dialect import ChatTranslation
from proxy.gateway.dialects.messages import _shape as out
from proxy.gateway.dialects.messages._stream import MessagesStream
from proxy.gateway.dialects.messages._wire import CountTokensRequest, MessagesRequest, ToolChoice
from tracetrain_core import anthropic_chat_messages

_REFUSED_BLOCKS = {
    "image": "Image blocks are not supported: the policy reads text only.",
    "document": "Document blocks are not supported: the policy reads text only; send the text as a text block.",
}
_SCALARS = {"str", "int", "float", "bool", "none"}
# Sampling settings that keep their name and meaning in chat completions.
_SAME = ("temperature", "top_p", "top_k", "stream")


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # pydantic puts the union member it tried in the location ("str", "list[tagged-union[...]]"): noise
        # to a client. Of a union's errors, the deepest says most (a bad block, not "not a string").
        errors = [{**e, "loc": [p for p in e["loc"] if not _is_member(p)]} for e in exc.errors()]
        raise InvalidRequest.from_validation(sorted(errors, key=lambda e: -len(e["loc"]))) from exc


def _is_member(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in _SCALARS)


def _refuse_unreadable(request: CountTokensRequest) -> None:
    """Images, documents (also inside tool results) and server tools: a 400 that says why."""
    for i, message in enumerate(request.messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
            parts = [block] + (
                list(block.content) if block.type == "tool_result" and isinstance(block.content, list) else []
            )
            for part in parts:
                if part.type in _REFUSED_BLOCKS:
                    raise InvalidRequest(_REFUSED_BLOCKS[part.type], param=f"messages.{i}.content.{j}")
            if block.type == "tool_result" and message.role != "user":
                raise InvalidRequest("tool_result blocks belong in a user message.", param=f"messages.{i}.content.{j}")
            if block.type == "tool_use" and message.role != "assistant":
                raise InvalidRequest(
                    "tool_use blocks belong in an assistant message.", param=f"messages.{i}.content.{j}"
                )
    for i, tool in enumerate(request.tools or ()):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"Server tools ({tool.type!r}) are not supported: the proxy runs no tools; define it as a custom"
                " tool with an input_schema and run it in the agent.",
                param=f"tools.{i}",
            )


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type 'tool' needs the tool's 'name'.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_tools(request: CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat's shape (none when the client sent none)."""
    chat: dict[str, Any] = {}
    if request.tools:
        chat["tools"] = [
            {"type": "function", "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description is not None else {}),
                "parameters": tool.input_schema if tool.input_schema is not None else {"type": "object"},
            }}
            for tool in request.tools
        ]  # fmt: skip
    if request.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(request.tool_choice)
        if request.tool_choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat


def _messages(request: CountTokensRequest, body: dict[str, Any]) -> list[dict[str, Any]]:
    _refuse_unreadable(request)
    messages = anthropic_chat_messages(body)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest(
            "messages hold nothing to answer: send a user or assistant message with some content.", param="messages"
        )
    return messages


def count_tokens_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/messages/count_tokens`` body as the chat body vLLM's ``/tokenize`` renders (messages, tools)."""
    request: CountTokensRequest = _validated(CountTokensRequest, body)
    return {"model": request.model, "messages": _messages(request, body), **_chat_tools(request)}


class MessagesDialect(ChatTranslation):
    """Anthropic's Messages API, translated to chat completions (a ``proxy.gateway.dialects.Dialect``)."""

    endpoint = "messages"

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        request: MessagesRequest = _validated(MessagesRequest, body)
        chat: dict[str, Any] = {"model": request.model, "messages": _messages(request, body),
                                "max_tokens": request.max_tokens}  # fmt: skip
        if request.stop_sequences:
            chat["stop"] = request.stop_sequences
        for name in _SAME:
            if getattr(request, name) is not None:
                chat[name] = getattr(request, name)
        chat.update(_chat_tools(request))
        if request.output_config is not None and request.output_config.format is not None:
            # Structured outputs: vLLM decodes to the schema, as Anthropic's API promises.
            schema = request.output_config.format.schema_
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return chat

    def from_chat(self, chat: dict[str, Any], body: dict[str, Any], model: str) -> dict[str, Any]:
        return out.from_chat(chat, body, model)

    def stream(self, body: dict[str, Any], model: str) -> MessagesStream:
        return MessagesStream(model, body.get("stop_sequences"))

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        return out.error_response(exc, headers)


MESSAGES = MessagesDialect()
