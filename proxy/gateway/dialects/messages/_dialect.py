"""Anthropic's Messages API (``POST /v1/messages``) as a chat completion, and back (a ``Dialect``).

vLLM's own ``/v1/messages`` returns no token ids, so each call goes to vLLM as a chat completion
on the chat path, which captures the exact prompt ids, sampled ids and logprobs
(docs/ARCHITECTURE.md, "Every API on the chat path"). The request's turn:

- ``system`` and ``messages`` become chat messages (``tracetrain_core.anthropic_chat_messages``, which the
  readers share): images go to a model that reads them, and are a placeholder the model reads
  otherwise, as are binary documents and blocks of newer API versions; ``thinking`` blocks are the
  answer's ``reasoning`` once their signature checks out (a bad one: Anthropic's 400);
- ``max_tokens`` (required, as in Anthropic's API), ``stop_sequences`` -> ``stop``,
  ``temperature``, ``top_p``, ``top_k``; custom ``tools`` (``input_schema`` -> ``parameters``) and
  ``tool_choice`` (``auto``, ``any`` -> ``required``, ``tool`` -> a named function, ``none``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``); Anthropic's server tools
  (web search, code execution...) are left out, with a note to the model: the proxy runs none;
- ``thinking``, as vLLM's own Messages endpoint maps it: ``disabled`` -> ``reasoning_effort: "none"``
  (vLLM then renders the template with ``enable_thinking: false``, for templates that take it: Qwen3's,
  and the like), ``enabled`` -> ``thinking_token_budget`` (only with a ``--reasoning-parser``: vLLM
  refuses it otherwise), ``adaptive`` -> nothing; ``output_config.effort`` -> ``reasoning_effort``;
- ``output_config.format`` (a JSON schema) -> ``response_format``, which vLLM decodes to;
- whatever else the client sends (``metadata``, ``cache_control``...) is kept in the record and not
  sent to vLLM.

The answer's turn is ``_shape`` (non-streamed) and ``_stream`` (events).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from proxy.errors import InvalidRequest, ProxyError
from proxy.gateway._call import Call
from proxy.gateway._served import Served, Signer
from proxy.gateway.dialects._dialect import ChatTranslation
from proxy.gateway.dialects.messages import _shape as out
from proxy.gateway.dialects.messages._stream import MessagesStream
from proxy.gateway.dialects.messages._wire import CountTokensRequest, MessagesRequest, ThinkingBlock, ToolChoice
from tracetrain_core import anthropic_chat_messages

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


def _check_blocks(request: CountTokensRequest, signer: Signer) -> None:
    """Blocks where Anthropic's API takes them, and thinking the proxy signed: else a 400 that says why."""
    for i, message in enumerate(request.messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
            where = f"messages.{i}.content.{j}"
            if block.type == "tool_result" and message.role != "user":
                raise InvalidRequest("tool_result blocks belong in a user message.", param=where)
            if block.type == "tool_use" and message.role != "assistant":
                raise InvalidRequest("tool_use blocks belong in an assistant message.", param=where)
            if isinstance(block, ThinkingBlock) and not signer.verify(out.THINKING, block.thinking, block.signature):
                # Anthropic's words for a thinking block it did not sign, or that was changed.
                raise InvalidRequest(f"{where}: Invalid `signature` in `thinking` block", param=where)


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type 'tool' needs the tool's 'name'.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_tools(request: CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat's shape (none when the client sent none)."""
    chat: dict[str, Any] = {}
    tools = [
        {"type": "function", "function": {
            "name": tool.name,
            **({"description": tool.description} if tool.description is not None else {}),
            "parameters": tool.input_schema if tool.input_schema is not None else {"type": "object"},
        }}
        for tool in request.tools or () if tool.type in (None, "custom")  # server tools: left out (a note)
    ]  # fmt: skip
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(request.tool_choice) if request.tool_choice is not None else None
    if request.tool_choice is not None and tools:  # a choice among no tools would be vLLM's 400
        chat["tool_choice"] = choice
        if request.tool_choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat


def _messages(request: CountTokensRequest, body: dict[str, Any], served: Served) -> list[dict[str, Any]]:
    _check_blocks(request, served.signer)
    messages = anthropic_chat_messages(body, images=served.images)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest(
            "messages hold nothing to answer: send a user or assistant message with some content.", param="messages"
        )
    return messages


def _thinking(request: MessagesRequest, served: Served) -> dict[str, Any]:
    """``thinking`` and ``output_config.effort`` as vLLM's chat takes them (see the module docstring)."""
    chat: dict[str, Any] = {}
    if request.output_config is not None and request.output_config.effort is not None:
        chat["reasoning_effort"] = request.output_config.effort
    if request.thinking is None:
        return chat
    if request.thinking.type == "disabled":
        chat["reasoning_effort"] = "none"
    elif request.thinking.type == "enabled" and served.reasoning:
        chat["thinking_token_budget"] = request.thinking.budget_tokens
    return chat


def count_tokens_chat(body: dict[str, Any], served: Served) -> dict[str, Any]:
    """A ``/v1/messages/count_tokens`` body as the chat body vLLM's ``/tokenize`` renders (messages, tools)."""
    request: CountTokensRequest = _validated(CountTokensRequest, body)
    return {"model": request.model, "messages": _messages(request, body, served), **_chat_tools(request)}


class MessagesDialect(ChatTranslation):
    """Anthropic's Messages API, translated to chat completions (a ``proxy.gateway.dialects.Dialect``)."""

    endpoint = "messages"

    def to_chat(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        request: MessagesRequest = _validated(MessagesRequest, body)
        chat: dict[str, Any] = {"model": request.model, "messages": _messages(request, body, served),
                                "max_tokens": request.max_tokens}  # fmt: skip
        if request.stop_sequences:
            chat["stop"] = request.stop_sequences
        for name in _SAME:
            if getattr(request, name) is not None:
                chat[name] = getattr(request, name)
        chat.update(_chat_tools(request))
        chat.update(_thinking(request, served))
        if request.output_config is not None and request.output_config.format is not None:
            # Structured outputs: vLLM decodes to the schema, as Anthropic's API promises.
            schema = request.output_config.format.schema_
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return chat

    def from_chat(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return out.from_chat(chat, call.body, call.route.public_name, call.served.signer)

    def stream(self, call: Call) -> MessagesStream:
        body = call.body
        return MessagesStream(call.route.public_name, body.get("stop_sequences"), call.served.signer,
                              thinking=out.shows_thinking(body))  # fmt: skip

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        return out.error_response(exc, headers)


MESSAGES = MessagesDialect()
