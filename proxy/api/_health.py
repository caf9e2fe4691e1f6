"""``/healthz`` (the proxy answers), ``/readyz`` (vLLM serves; warnings that do not stop serving), ``/metrics``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from proxy.api._deps import ServicesDep
from proxy.errors import GpuBusy, UpstreamError, UpstreamNotReady, error_response
from proxy.gateway import NOT_AWAKE, RETRY_AFTER_FAILED_S
from proxy.gateway.upstream import UPSTREAM_STATES

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the proxy answers."""
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus exposition: requests, latency, tokens, captures, rewards, training steps, versions."""
    exported = services.exporters.stats() if services.exporters is not None else None
    loaded = {served.name: len(served.loaded_versions) for served in services.registry}
    body = await services.metrics.render(services.store, loaded, exported, services.router.views(), UPSTREAM_STATES)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz")
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
