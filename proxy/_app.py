"""``create_app(settings)``: the FastAPI app, its routes (``proxy.api``) and its services (``proxy._services``)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import APIRouter, FastAPI
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from proxy._services import build_services
from proxy._settings import Settings
from proxy._throttle import LoginThrottle
from proxy.api import GENERATION_PATHS, ROUTERS, Door, add_error_handlers, serve_generation
from proxy.observability import Metrics


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    on_upstream_stuck: Callable[[str], None] | None = None,
) -> FastAPI:
    """Build the proxy. ``transport`` replaces the network for tests (``httpx.MockTransport``).

    ``on_upstream_stuck`` is called when vLLM did not wake up after a training step
    (``--share-gpu``), with the reason: ``tracetrain serve`` restarts its vLLM child then.
    """
    metrics = Metrics()  # the app's own registry, alive as long as the app
    throttle = LoginThrottle()  # wrong admin tokens per address, counted alike by the door and the routes

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with build_services(
            settings, metrics, transport=transport, on_upstream_stuck=on_upstream_stuck, throttle=throttle
        ) as services:
            app.state.services = services
            yield

    app = _App(
        title="tracetrain",
        summary="OpenAI-compatible proxy with transparent trajectory capture for RL.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.door = Door(settings, metrics, throttle)
    app.router.routes.extend(_api_routes())
    add_error_handlers(app)
    return app


@functools.cache
def _api_routes() -> tuple[BaseRoute, ...]:
    """The routes of ``ROUTERS``, built once per process and shared by every app it makes.

    Including a router builds each route's parameter models and dependency tree: ~0.1 s of CPU for every app,
    which a test suite that starts hundreds of proxies felt. A route holds nothing of one app (the services are
    reached through ``request.app.state``); so it also answers to no app's ``dependency_overrides``.
    """
    routes = APIRouter()
    for router in ROUTERS:
        routes.include_router(router)
    return tuple(routes.routes)


class _App(FastAPI):
    """FastAPI, with the front door's checks on every request (``proxy.api._door``) and the plain generation
    paths served before its middleware (``proxy.api._openai``)."""

    door: Door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        refused, receive = self.door.check(scope, receive)
        if refused is not None:
            await refused(scope, receive, send)
            return
        serving = GENERATION_PATHS.get(scope["path"])
        if serving is not None and scope["method"] == "POST" and not self.root_path:
            scope["app"] = self
            await serve_generation(serving, scope, receive, send)
            return
        await super().__call__(scope, receive, send)
