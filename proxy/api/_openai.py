"""The OpenAI-compatible routes, under ``/v1`` and the keying path prefixes.

The two generation endpoints are FastAPI routes for everything but serving: FastAPI
documents them (OpenAPI, the body examples) from the functions below, while each request
goes straight to a plain ASGI callable (``_GenerationRoute``). That callable does what
FastAPI's request handler did for these routes: the inference key check
(``require_inference_key``), the raw body, the key hints; errors still reach the app's
handlers, so they keep OpenAI's shape. FastAPI's per-request machinery (dependency
solving, its request wrapper and exit stacks) cost more than our own code on this path.

The Responses API and Anthropic's Messages API (``/v1/responses``, ``/v1/messages``,
``/v1/messages/count_tokens``) are served the same way; their calls are translated to chat
(``_translated``) and every error they raise is answered in their own API's shape.

The plain paths (``POST /v1/chat/completions``, ``POST /v1/completions`` and the three above)
skip even Starlette's middleware and route matching (~12% of the proxy under load): the app hands
them to ``serve_generation`` first (``proxy._app``), which answers errors as the app's handlers
do: both call ``proxy.errors.response_for``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy._params import ID_PATTERN, json_body
from proxy._services import Services
from proxy.api._deps import ServicesDep, require_inference_key
from proxy.errors import InvalidRequest, ProxyError, UpstreamError, response_for
from proxy.gateway import KeyHints
from proxy.gateway._capture import Endpoint
from proxy.gateway._translated import handle as handle_translated
from proxy.gateway._wire import ChatCompletionRequest, CompletionRequest, json_object
from proxy.gateway.dialects import (
    MESSAGES,
    RESPONSES,
    CountTokensRequest,
    Dialect,
    MessagesRequest,
    ResponsesRequest,
    count_tokens_chat,
)

router = APIRouter(dependencies=[Depends(require_inference_key)], tags=["openai"])

PREFIXES = ("", "/t/{trajectory_id}", "/g/{group_id}/t/{trajectory_id}")
_ID = re.compile(ID_PATTERN)
# Bodies are forwarded as sent and validated by the forwarder; these only document them.
_CHAT_BODY = json_body(
    ChatCompletionRequest, {"chat": {"model": "agent", "messages": [{"role": "user", "content": "2+2?"}]}}
)
_COMPLETION_BODY = json_body(CompletionRequest, {"completion": {"model": "agent", "prompt": "2+2=", "max_tokens": 4}})
_RESPONSES_BODY = json_body(ResponsesRequest, {"responses": {"model": "agent", "input": "2+2?"}})
_MESSAGES_BODY = json_body(
    MessagesRequest,
    {"messages": {"model": "agent", "max_tokens": 64, "messages": [{"role": "user", "content": "2+2?"}]}},
)
_COUNT_BODY = json_body(
    CountTokensRequest, {"count": {"model": "agent", "messages": [{"role": "user", "content": "2+2?"}]}}
)


def _checked(value: str | None, name: str) -> str | None:
    if value is not None and not _ID.match(value):
        raise InvalidRequest(
            f"Invalid {name} {value[:50]!r}: use 1-200 letters, digits, '_', '-', '.' or ':'.", param=name
        )
    return value


def key_hints(request: Request) -> KeyHints:
    headers, path = request.headers, request.path_params
    return KeyHints(
        header_trajectory=_checked(headers.get("x-trajectory-id"), "X-Trajectory-Id"),
        header_group=_checked(headers.get("x-group-id"), "X-Group-Id"),
        path_trajectory=_checked(path.get("trajectory_id"), "trajectory id"),
        path_group=_checked(path.get("group_id"), "group id"),
    )


Serve = Callable[[Request, Services], Awaitable[Response]]


def _forwarding(endpoint: Endpoint) -> Serve:
    async def forward(request: Request, services: Services) -> Response:
        await require_inference_key(request, services)
        return await services.forwarder.handle(endpoint, await request.body(), key_hints(request))

    return forward


_chat, _completions = _forwarding("chat.completions"), _forwarding("completions")


async def chat_completions(request: Request, services: ServicesDep) -> Response:
    """OpenAI's chat completions, forwarded to the policy's newest version and captured."""
    return await _chat(request, services)


async def completions(request: Request, services: ServicesDep) -> Response:
    """OpenAI's (legacy) text completions, forwarded and captured."""
    return await _completions(request, services)


async def _translated(dialect: Dialect, request: Request, services: Services) -> Response:
    """A call in an API the proxy translates to chat; every error in that API's own shape."""
    try:
        await require_inference_key(request, services)
        return await handle_translated(services.forwarder, dialect, await request.body(), key_hints(request))
    except ProxyError as exc:
        return dialect.error(exc)


async def _count_tokens(request: Request, services: Services) -> Response:
    try:
        await require_inference_key(request, services)
        chat = count_tokens_chat(json_object(await request.body()))
        count = await services.forwarder.count_tokens(chat)
    except ProxyError as exc:
        return MESSAGES.error(exc)
    return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")


async def responses(request: Request, services: ServicesDep) -> Response:
    """OpenAI's Responses API, translated to a chat completion for the policy and captured alike."""
    return await _translated(RESPONSES, request, services)


async def messages(request: Request, services: ServicesDep) -> Response:
    """Anthropic's Messages API (``x-api-key`` accepted), translated to a chat completion and captured alike."""
    return await _translated(MESSAGES, request, services)


async def count_tokens(request: Request, services: ServicesDep) -> Response:
    """Anthropic's token count of a Messages request, as vLLM renders its prompt."""
    return await _count_tokens(request, services)


async def _responses(request: Request, services: Services) -> Response:
    return await _translated(RESPONSES, request, services)


async def _messages(request: Request, services: Services) -> Response:
    return await _translated(MESSAGES, request, services)


# What serves each documented route, without FastAPI's request handling (see the module docstring).
_SERVE: dict[Callable[..., Any], Serve] = {
    chat_completions: _chat,
    completions: _completions,
    responses: _responses,
    messages: _messages,
    count_tokens: _count_tokens,
}


class _GenerationRoute(APIRoute):
    """Documented by FastAPI like any route; served by a plain ASGI callable (see the module docstring)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        serving = _SERVE[endpoint]

        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            services: Services = scope["app"].state.services
            response = await serving(Request(scope, receive), services)
            await response(scope, receive, send)

        self.app = serve


# The paths served before the app's middleware and routing (see the module docstring).
GENERATION_PATHS: dict[str, Serve] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
    "/v1/messages/count_tokens": _count_tokens,
}


async def serve_generation(serving: Serve, scope: Scope, receive: Receive, send: Send) -> None:
    """A generation call on a plain path, its errors answered as the app's handlers answer them."""
    request = Request(scope, receive)
    try:
        response = await serving(request, scope["app"].state.services)
    except Exception as exc:
        response = response_for(exc, request.method, request.url.path)
    await response(scope, receive, send)


async def list_models(services: ServicesDep) -> dict[str, object]:
    """The policy alias and its loaded versions."""
    if services.registry.base_model is None:
        # Still listable while vLLM starts; generation calls answer 502/503 until it is up.
        with contextlib.suppress(UpstreamError):
            services.registry.base_model = await services.router.base_model()
    return services.registry.model_list()


for _prefix in PREFIXES:
    router.add_api_route(
        f"{_prefix}/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=not _prefix,
        openapi_extra=_CHAT_BODY, route_class_override=_GenerationRoute,
    )  # fmt: skip
    router.add_api_route(
        f"{_prefix}/v1/completions", completions, methods=["POST"], include_in_schema=not _prefix,
        openapi_extra=_COMPLETION_BODY, route_class_override=_GenerationRoute,
    )  # fmt: skip
    for _path, _endpoint, _body in (("responses", responses, _RESPONSES_BODY), ("messages", messages, _MESSAGES_BODY),
                                    ("messages/count_tokens", count_tokens, _COUNT_BODY)):  # fmt: skip
        router.add_api_route(
            f"{_prefix}/v1/{_path}", _endpoint, methods=["POST"], include_in_schema=not _prefix,
            openapi_extra=_body, route_class_override=_GenerationRoute,
        )  # fmt: skip
    router.add_api_route(f"{_prefix}/v1/models", list_models, methods=["GET"], include_in_schema=not _prefix)
