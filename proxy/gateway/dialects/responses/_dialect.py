"""OpenAI's Responses API, translated to chat completions for vLLM and back (``RESPONSES``, a ``Dialect``).

What is served, in the Responses API's own grammar as the openai SDK, the OpenAI Agents SDK and
the Codex CLI send it: ``input`` as a string or items (messages with text, image and file parts,
``function_call``, ``function_call_output``, ``reasoning``: its text goes back to the model as the
``reasoning`` of the answer after it), ``instructions``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (JSON
schema or object), ``reasoning.effort`` (vLLM's ``reasoning_effort``: for a template that takes it,
and ``enable_thinking`` off at "none"), streams.

What the model cannot use never fails a call (``tracetrain_core._responses_api``): images for a model
that reads text only and files become placeholders it reads; hosted tools (web search, file search,
Codex's sub-agent namespace...) are left out with a note at the end of the system prompt, and the
items of their earlier calls are skipped. Refused with a 400 that says what to do:
``previous_response_id`` and ``conversation`` (the proxy keeps no response state: send the whole
input, as the Agents SDK and Codex do by default), ``background``, ``prompt`` templates and item
references. ``store`` is accepted and ignored: every call is recorded anyway, and nothing can be
fetched back by id (``store: false`` semantics).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from proxy.errors import ContextLengthExceeded, InvalidRequest, ProxyError, error_response
from proxy.gateway._call import Call
from proxy.gateway._served import Served
from proxy.gateway.dialects._dialect import ChatTranslation
from proxy.gateway.dialects.responses._shape import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    status_of,
    usage_of,
)
from proxy.gateway.dialects.responses._stream import ResponsesStream
from tracetrain_core import responses_chat_messages


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Reasoning(_Open):
    # vLLM's reasoning_effort values (OpenAI's, and DeepSeek's "max").
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class ResponsesRequest(_Open):
    """The fields of ``POST /v1/responses`` the proxy reads (others are kept and ignored)."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    text: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    # Refused when set (see the module docstring).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None


_ROLES = ("user", "system", "developer", "assistant")
_TEXT_FIELDS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# Items of stored state: the proxy keeps none. Any other item the proxy does not read (a hosted tool's call) is skipped.
_STATEFUL_ITEMS = frozenset({"item_reference"})
_STATELESS = "the proxy keeps no responses: send the whole conversation as `input`, as the Agents SDK and Codex do"


# Items and tools are checked by hand, not by pydantic models: a model per item cost ~5 us, on every call.
def _field(item: dict[str, Any], name: str, where: str, kinds: type | tuple[type, ...], *, required: bool = True,
           nonempty: bool = False) -> None:  # fmt: skip
    value = item.get(name)
    if value is None and not required:
        return
    if value is None or not isinstance(value, kinds):
        problem = "Field required" if name not in item else f"expected {_kind_names(kinds)}"
    elif nonempty and not value:
        problem = "must not be empty"
    else:
        return
    raise InvalidRequest(f"Invalid value for '{where}.{name}': {problem}.", param=f"{where}.{name}")


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    names = {str: "a string", list: "an array", dict: "an object", bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _check_message(item: dict[str, Any], where: str) -> None:
    if item.get("role") not in _ROLES:
        raise InvalidRequest(
            f"Invalid value for '{where}.role': expected one of {', '.join(_ROLES)}.", param=f"{where}.role"
        )
    _field(item, "content", where, (str, list))
    content = item["content"]
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequest(
                f"Unsupported content part type {str(kind)[:50]!r} at '{where}.content[{j}]': "
                "use input_text, output_text, input_image or input_file.",
                param=f"{where}.content[{j}].type",
            )
        if kind in _TEXT_FIELDS:
            _field(part, _TEXT_FIELDS[kind], f"{where}.content[{j}]", str)


def _check_item(item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _check_message(item, where)
    elif kind == "function_call":
        _field(item, "call_id", where, str, nonempty=True)
        _field(item, "name", where, str, nonempty=True)
        _field(item, "arguments", where, str)
    elif kind == "function_call_output":
        _field(item, "call_id", where, str, nonempty=True)
        _field(item, "output", where, (str, list))
    elif not isinstance(kind, str) or kind in _STATEFUL_ITEMS:
        raise InvalidRequest(
            f"Unsupported input item type {str(kind)[:50]!r} at '{where}': the proxy takes messages, "
            f"function_call, function_call_output and reasoning items (item references need stored responses; "
            f"{_STATELESS}).",
            param=f"{where}.type",
        )


def _check_items(items: list[dict[str, Any]]) -> None:
    for i, item in enumerate(items):
        _check_item(item, f"input[{i}]")


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function tools in chat's shape; the others (hosted by OpenAI) are left out, with a note in the
    prompt (``tracetrain_core.responses_chat_messages``)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            continue
        where = f"tools[{i}]"
        _field(tool, "name", where, str, nonempty=True)
        _field(tool, "description", where, str, required=False)
        _field(tool, "parameters", where, dict, required=False)
        _field(tool, "strict", where, bool, required=False)
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "Unsupported 'tool_choice': use 'auto', 'none', 'required' or {'type': 'function', 'name': ...}.",
        param="tool_choice",
    )


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {"name": str(fmt.get("name") or "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = bool(fmt["strict"])
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(
        "Unsupported 'text.format': use {'type': 'text'}, {'type': 'json_object'} or "
        "{'type': 'json_schema', 'name': ..., 'schema': {...}}.",
        param="text.format",
    )


def _refuse_state(request: ResponsesRequest) -> None:
    if request.previous_response_id is not None:
        raise InvalidRequest(f"'previous_response_id' is not supported: {_STATELESS}.", param="previous_response_id")
    if request.conversation is not None:
        raise InvalidRequest(f"'conversation' is not supported: {_STATELESS}.", param="conversation")
    if request.background:
        raise InvalidRequest("'background' responses are not supported: call without it.", param="background")
    if request.prompt is not None:
        raise InvalidRequest("Prompt templates ('prompt') are not supported: send the input itself.", param="prompt")


def to_chat(body: dict[str, Any], served: Served) -> dict[str, Any]:
    """A Responses request as the chat completions request vLLM is sent."""
    try:
        request = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc.errors()) from exc
    _refuse_state(request)
    if isinstance(request.input, list):
        _check_items(request.input)
    messages = responses_chat_messages(body, images=served.images)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("'input' holds no message: send at least one.", param="input")
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    tools = _chat_tools(request.tools or [])
    if tools:
        chat["tools"] = tools
        if request.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
        if request.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = request.parallel_tool_calls
    for name, value in (("max_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p)):  # fmt: skip
        if value is not None:
            chat[name] = value
    if request.reasoning is not None and request.reasoning.effort is not None:
        chat["reasoning_effort"] = request.reasoning.effort
    response_format = _response_format(request.text) if request.text else None
    if response_format is not None:
        chat["response_format"] = response_format
    if request.stream:
        chat["stream"] = True
    return chat


def from_chat(chat: dict[str, Any], body: dict[str, Any], model: str) -> dict[str, Any]:
    """A non-streamed chat completion as the Responses API's response.

    Its thinking (vLLM's ``reasoning``, with ``--reasoning-parser``) is a ``reasoning`` item first, as
    OpenAI's open-weight models answer; text that is only blanks (a tool parser's ``"\n\n"`` before a
    call) is no message item.
    """
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = []
    if message.get("reasoning"):
        output.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content") and not message["content"].isspace():
        output.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            function_call_item(new_id("fc"), call.get("id") or new_id("call"), function.get("name") or "",
                               function.get("arguments") or "")
        )  # fmt: skip
    status, incomplete = status_of(choice.get("finish_reason"))
    created = int(chat.get("created") or time.time())
    return response_object(
        body, model, new_id("resp"), created, output, status, incomplete, usage_of(chat.get("usage"))
    )


class ResponsesDialect(ChatTranslation):
    """The Responses API, translated to chat completions (a ``proxy.gateway.dialects.Dialect``)."""

    endpoint = "responses"

    def to_chat(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        return to_chat(body, served)

    def from_chat(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return from_chat(chat, call.body, call.route.public_name)

    def stream(self, call: Call) -> ResponsesStream:
        return ResponsesStream(call.body, call.route.public_name)

    def error(self, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        if isinstance(exc, ContextLengthExceeded):
            exc = exc.with_param("input")  # as OpenAI's Responses API names it
        return error_response(exc, headers)  # the Responses API answers errors in OpenAI's shape


RESPONSES = ResponsesDialect()
