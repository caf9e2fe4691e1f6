"""``create_app(settings)``: the FastAPI application and everything its lifespan builds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy._deps import Services, ServicesDep
from proxy._settings import Settings, is_loopback
from proxy.admin import _dashboard as _dashboard_routes
from proxy.admin import _routes as _admin_routes
from proxy.admin._auth import AdminAuth
from proxy.admin._dashboard import PageResponse, bad_page_request
from proxy.admin._token_texts import TokenTexts
from proxy.data import _routes as _data_routes
from proxy.errors import GpuBusy, InvalidRequest, NotFound, ProxyError, UpstreamError, UpstreamNotReady, error_body
from proxy.gateway import _routes as _openai_routes
from proxy.gateway._forward import Forwarder, error_response, server_error_response
from proxy.gateway._gate import NOT_AWAKE, RETRY_AFTER_FAILED_S, Gate
from proxy.gateway._keying import Keyer
from proxy.gateway._policies import PolicyRegistry
from proxy.gateway._router import Router
from proxy.gateway._upstream import Upstream
from proxy.judge import _routes as _judge_routes
from proxy.judge._service import JudgeService
from proxy.observability._disk import DiskWatch
from proxy.observability._langfuse import start_langfuse
from proxy.observability._metrics import Metrics
from proxy.training import _adapter_routes
from proxy.training._guard import RegressionGuard
from proxy.training._handover import HandoverCoordinator
from proxy.training._publisher import Publisher
from proxy.training._regression import GuardConfig
from proxy.training._reward_timeout import RewardTimeout
from proxy.training._scheduler import JobScheduler
from proxy.training._step_watch import StepWatch
from store import Store

log = logging.getLogger("tracetrain.proxy")

# Generation calls go through each Upstream's own kept connections; these httpx clients carry only the control calls.
_UPSTREAM_POOLS = 1


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

    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await Store.open(settings.resolved_database_url)
        clients = [
            httpx.AsyncClient(
                transport=transport,
                timeout=httpx.Timeout(settings.upstream_timeout_s, connect=5.0),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            )
            for _ in range(_UPSTREAM_POOLS)
        ]
        router = Router(
            [Upstream(url, clients, timeout_s=settings.upstream_timeout_s) for url in settings.upstreams],
            health_check_s=settings.health_check_s,
        )
        registry = PolicyRegistry(settings.policy, settings.served_model)
        if registry.base_model is None:
            try:
                registry.base_model = await router.base_model()
            except UpstreamError as exc:
                log.warning("upstream not answering yet (%s); will ask again on the first call", exc.message)
        # The policy row holds the alias; it must exist even while vLLM is still starting.
        registry.active_version = await store.policies.ensure(settings.policy, registry.base_model or "")
        keyer = Keyer(store, group_size=settings.group_size, thread_ttl_s=settings.thread_ttl_s)
        langfuse = start_langfuse(settings)  # None unless --langfuse
        gate = Gate(settings.handover_wait_s, metrics)  # closed only by the hand-over's coordinator
        forwarder = Forwarder(router, store, keyer, registry, metrics, langfuse, gate)
        scheduler = JobScheduler(
            store,
            policy=settings.policy,
            batch_groups=settings.batch_groups,
            min_group_size=settings.min_group_size,
        )
        publisher = Publisher(
            store, registry, router, keep_versions=settings.keep_versions, unload_grace_s=settings.unload_grace_s,
            guard=settings.regression_guard, delivery=settings.adapter_delivery,
        )  # fmt: skip
        # Publishing starts once this proxy serves: a vLLM that fetches an adapter by name
        # (tracetrain_vllm's resolver) may fetch it from this very proxy.
        await publisher.adopt()
        await router.check_once(functools.partial(publisher.restore, paths_only=True))  # then they take traffic
        background = [
            asyncio.create_task(publisher.run(), name="tracetrain-publisher"),
            asyncio.create_task(router.run(publisher.restore), name="tracetrain-upstream-health"),
        ]
        background.append(asyncio.create_task(StepWatch(store).run(), name="tracetrain-step-watch"))
        if settings.regression_guard:
            cfg = GuardConfig(margin=settings.regression_margin, alpha=settings.regression_alpha,
                              max_groups=settings.regression_groups)  # fmt: skip
            guard = RegressionGuard(store, publisher, metrics, cfg, policy=settings.policy)
            background.append(asyncio.create_task(guard.run(), name="tracetrain-regression-guard"))
        handover, handing_over = None, None
        if settings.share_gpu:
            handover = HandoverCoordinator(
                store, publisher, router.upstreams, gate, metrics, policy=settings.policy,
                timeout_s=settings.handover_timeout_s, on_stuck=on_upstream_stuck,
            )  # fmt: skip
            handing_over = asyncio.create_task(handover.run(), name="tracetrain-gpu-handover")

        def report_rewards(rewards: list[dict[str, Any]]) -> None:
            metrics.rewards_recorded([r["source"] for r in rewards])
            if langfuse is not None:
                langfuse.rewards_recorded(rewards)

        judging = JudgeService(settings, store, registry, scheduler, on_rewards=report_rewards)
        judging.start()  # scans for complete groups unless rewards are external only
        if settings.reward_timeout_s is not None:
            timeouts = RewardTimeout(settings, store, judging, metrics)
            background.append(asyncio.create_task(timeouts.run(), name="tracetrain-reward-timeout"))
        disk = DiskWatch(store, metrics, settings.data_dir, min_free_bytes=settings.min_free_disk_mb * 2**20,
                         keep_trajectories_days=settings.keep_trajectories_days)  # fmt: skip
        background.append(asyncio.create_task(disk.run(), name="tracetrain-disk"))
        app.state.services = Services(
            settings,
            store,
            router.upstreams[0],
            router,
            registry,
            keyer,
            forwarder,
            scheduler,
            publisher,
            metrics,
            TokenTexts(router.upstreams[0]),
            judging,
            report_rewards,
            langfuse=langfuse,
            handover=handover,
            disk=disk,
        )
        try:
            yield
        finally:
            await judging.close()
            for task in (handing_over, *reversed(background)):  # a hand-over under way wakes vLLM as it ends
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if langfuse is not None:
                await langfuse.aclose()  # sends what is still queued, within its time limit
            for client in clients:
                await client.aclose()
            for upstream in router.upstreams:
                upstream.close()
            await store.close()  # writes every queued record first

    app = _App(
        title="tracetrain",
        summary="OpenAI-compatible proxy with transparent trajectory capture for RL.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.include_router(_openai_routes.router)
    app.include_router(_data_routes.router)
    app.include_router(_admin_routes.router)
    app.include_router(_judge_routes.router)
    app.include_router(_dashboard_routes.router)
    app.include_router(_adapter_routes.router)
    app.state.admin_auth = AdminAuth(settings.admin_token, loopback=is_loopback(settings.host))
    _add_health_routes(app)
    _add_error_handlers(app)
    return app


def _add_health_routes(app: FastAPI) -> None:
    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the proxy answers."""
        return {"status": "ok"}

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def metrics(services: ServicesDep) -> Response:
        """Prometheus exposition: requests, latency, tokens, captures, rewards, training steps, versions."""
        langfuse = services.langfuse.stats() if services.langfuse is not None else None
        body = await services.metrics.render(
            services.store, len(services.registry.loaded_versions), langfuse, services.router.views()
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/readyz", tags=["health"])
    async def readyz(services: ServicesDep) -> Response:
        """Readiness: the upstream answers and serves a base model (and woke up after the last training step)."""
        if services.handover is not None and services.handover.not_awake is not None:
            problem = f"vLLM did not wake up after a training step: {services.handover.not_awake}"
            return error_response(GpuBusy(problem, retry_after_s=RETRY_AFTER_FAILED_S, code=NOT_AWAKE))
        try:
            model = await services.router.base_model()
        except UpstreamError as exc:
            return error_response(exc)
        if not services.router.serving():
            return error_response(UpstreamNotReady(services.router.why_none()))
        services.registry.base_model = services.registry.base_model or model
        ready: dict[str, Any] = {"status": "ready", "base_model": model}
        if services.handover is not None and services.handover.gave_up is not None:
            ready["training"] = f"stopped: {services.handover.gave_up}"  # serving is fine; training is not
        usage = services.disk.latest if services.disk is not None else None
        if usage is not None and usage.low:  # still ready: a full disk stops capture, not serving
            ready["warnings"] = [usage.warning()]
        return Response(orjson.dumps(ready), media_type="application/json")


class _App(FastAPI):
    """FastAPI, with the two plain generation paths served before its middleware (``proxy.gateway._routes``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serving = _openai_routes.GENERATION_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if serving is not None and scope["method"] == "POST" and not self.root_path:
            scope["app"] = self
            await _openai_routes.serve_generation(serving, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProxyError)
    async def proxy_error(_request: Request, exc: ProxyError) -> Response:
        return error_response(exc)

    @app.exception_handler(PageResponse)
    async def page_response(_request: Request, exc: PageResponse) -> Response:
        return exc.response  # a dashboard page's refusal or error page, already rendered

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = InvalidRequest.from_validation(exc.errors())
        return bad_page_request(request, error) or error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound(f"Unknown request URL: {request.method} {request.url.path}."))
        body = error_body(str(exc.detail), "invalid_request_error")
        return Response(
            orjson.dumps(body), status_code=exc.status_code, media_type="application/json", headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return server_error_response()
