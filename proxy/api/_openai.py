"""The generation routes (OpenAI's, and Anthropic's Messages API), under ``/v1`` and the keying path prefixes.

Each endpoint is one row of ``ENDPOINTS``: its path, the function that serves it, and what FastAPI
documents of it (OpenAPI, the body examples). A call in one of the proxy's dialects is served by
``_forwarding(name)``: the inference key checked (``inference_scope``: a policy key confines the call to its
policies), the raw body, the key hints and that scope handed to ``Forwarder.handle``, the one call path of
every API; every error it raises is
answered in its dialect's shape (OpenAI's; Anthropic's on ``/v1/messages``). A new endpoint is a row
here (and, for a new API, a dialect in ``proxy.gateway.dialects``).

The routes are FastAPI routes for everything but serving: each request goes straight to a plain
ASGI callable (``_GenerationRoute``), since FastAPI's per-request machinery (dependency solving, its
request wrapper and exit stacks) cost more than our own code on this path. The plain paths (no
keying prefix) skip even Starlette's middleware and route matching (~12% of the proxy under load):
the app hands them to ``serve_generation`` first (``proxy._app``), which answers errors as the app's
handlers do: both call ``proxy.errors.response_for``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy._params import ID_PATTERN, json_body
from proxy._services import Services
from proxy.api._deps import InferenceScope, ServicesDep, inference_scope
from proxy.errors import InvalidRequest, ProxyError, UpstreamError, database_failure, response_for
from proxy.gateway import KeyHints
from proxy.gateway.dialects import (
    DIALECTS,
    MESSAGES,
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    DialectName,
    MessagesRequest,
    ResponsesRequest,
)
from store import DRIVER_ERRORS

router = APIRouter(dependencies=[Depends(inference_scope)], tags=["openai"])

PREFIXES = ("", "/t/{trajectory_id}", "/g/{group_id}/t/{trajectory_id}")
_ID = re.compile(ID_PATTERN)


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


async def _body(request: Request) -> bytes:
    """The call's body, read from ``receive`` as ``Request.body()`` reads it, without its context manager and
    stream wrapper: every generation call pays for them. A client gone before its body ends: ``ClientDisconnect``."""
    chunks: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _forwarding(name: DialectName) -> Serve:
    """The serving function of a call in the dialect ``name``: the forwarder's path, errors in the dialect's shape."""
    dialect = DIALECTS[name]

    async def forward(request: Request, services: Services) -> Response:
        try:
            scope = await inference_scope(request, services)
            return await services.forwarder.handle(name, await _body(request), key_hints(request), scope)
        except ProxyError as exc:
            return dialect.error(exc)
        except DRIVER_ERRORS as exc:  # a database failure no store method translated: a 503, in the API's shape
            return dialect.error(database_failure(exc, f"serve {request.url.path}"))

    return forward


async def _count_tokens(request: Request, services: Services) -> Response:
    try:
        scope = await inference_scope(request, services)
        count = await services.forwarder.count_tokens(await request.body(), scope)
    except ProxyError as exc:
        return MESSAGES.error(exc)
    return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One generation endpoint: how it is served, and what FastAPI documents of it."""

    path: str  # under /v1, and under each keying prefix
    serve: Serve
    name: str  # the OpenAPI operation's name
    doc: str
    body: dict[str, Any]  # its body's schema and examples (bodies are validated by their dialect, not by FastAPI)


_USER = [{"role": "user", "content": "2+2?"}]

ENDPOINTS = (
    Endpoint(
        "chat/completions", _forwarding("chat.completions"), "chat_completions",
        "OpenAI's chat completions, forwarded to the policy's newest version and captured.",
        json_body(ChatCompletionRequest, {"chat": {"model": "agent", "messages": _USER}}),
    ),
    Endpoint(
        "completions", _forwarding("completions"), "completions",
        "OpenAI's (legacy) text completions, forwarded and captured.",
        json_body(CompletionRequest, {"completion": {"model": "agent", "prompt": "2+2=", "max_tokens": 4}}),
    ),
    Endpoint(
        "responses", _forwarding("responses"), "responses",
        "OpenAI's Responses API, translated to a chat completion for the policy and captured alike.",
        json_body(ResponsesRequest, {"responses": {"model": "agent", "input": "2+2?"}}),
    ),
    Endpoint(
        "messages", _forwarding("messages"), "messages",
        "Anthropic's Messages API (``x-api-key`` accepted), translated to a chat completion and captured alike.",
        json_body(MessagesRequest, {"messages": {"model": "agent", "max_tokens": 64, "messages": _USER}}),
    ),
    Endpoint(
        "messages/count_tokens", _count_tokens, "count_tokens",
        "Anthropic's token count of a Messages request, as vLLM renders its prompt.",
        json_body(CountTokensRequest, {"count": {"model": "agent", "messages": _USER}}),
    ),
)  # fmt: skip

# The paths served before the app's middleware and routing (see the module docstring).
GENERATION_PATHS: dict[str, Serve] = {f"/v1/{endpoint.path}": endpoint.serve for endpoint in ENDPOINTS}
_SERVE_BY_NAME: dict[str, Serve] = {endpoint.name: endpoint.serve for endpoint in ENDPOINTS}


async def _documented(request: Request, services: ServicesDep) -> Response:
    """What FastAPI documents of every generation route; its ``_GenerationRoute`` serves it instead."""
    raise NotImplementedError


class _GenerationRoute(APIRoute):
    """Documented by FastAPI like any route; served by a plain ASGI callable (see the module docstring)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        serving = _SERVE_BY_NAME[self.name]

        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            services: Services = scope["app"].state.services
            response = await serving(Request(scope, receive), services)
            await response(scope, receive, send)

        self.app = serve


async def serve_generation(serving: Serve, scope: Scope, receive: Receive, send: Send) -> None:
    """A generation call on a plain path, its errors answered as the app's handlers answer them."""
    request = Request(scope, receive)
    try:
        response = await serving(request, scope["app"].state.services)
    except Exception as exc:
        response = response_for(exc, request.method, request.url.path)
    await response(scope, receive, send)


async def list_models(services: ServicesDep, scope: InferenceScope) -> dict[str, object]:
    """Each policy the key may use: its alias and its loaded versions."""
    if services.registry.base_model is None:
        # Still listable while vLLM starts; generation calls answer 502/503 until it is up.
        with contextlib.suppress(UpstreamError):
            services.registry.base_model = await services.router.base_model()
    return services.registry.model_list(scope)


for _prefix in PREFIXES:
    for _endpoint in ENDPOINTS:
        router.add_api_route(
            f"{_prefix}/v1/{_endpoint.path}", _documented, methods=["POST"], name=_endpoint.name,
            description=_endpoint.doc, include_in_schema=not _prefix, openapi_extra=_endpoint.body,
            route_class_override=_GenerationRoute,
        )  # fmt: skip
    router.add_api_route(f"{_prefix}/v1/models", list_models, methods=["GET"], include_in_schema=not _prefix)
