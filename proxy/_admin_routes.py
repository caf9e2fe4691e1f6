"""The admin API: training jobs, adapter versions, train now, activate (rollback/forward)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path
from sqlalchemy import select

from proxy._deps import ServicesDep, require_admin
from proxy.errors import InvalidRequest
from proxy.store import A, J

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])

_JOB_FIELDS = ("id", "policy", "state", "group_ids", "version", "metrics", "progress", "error", "worker",
               "created_at", "started_at", "finished_at")  # fmt: skip
_ADAPTER_FIELDS = ("policy", "version", "path", "job_id", "state", "error", "metrics", "created_at", "published_at")


@router.post("/train")
async def train_now(services: ServicesDep) -> dict[str, Any]:
    """Create a training job from every ready group now, without waiting for a full batch."""
    job = await services.scheduler.maybe_create_job(force=True)
    if job is None:
        raise InvalidRequest(
            "No group is ready: a group is ready when all its trajectories are rewarded and it has at least "
            f"{services.settings.min_group_size} of them (see GET /v1/groups?state=ready)."
        )
    return {"object": "training_job", **job}


@router.get("/jobs")
async def list_jobs(services: ServicesDep, limit: int = 50) -> dict[str, Any]:
    """Training jobs, newest first, with their metrics."""
    async with services.store.engine.connect() as conn:
        rows = (await conn.execute(select(J).order_by(J.c.id.desc()).limit(limit))).all()
    return {"object": "list", "data": [{"object": "training_job", **{f: r._mapping[f] for f in _JOB_FIELDS}}
                                       for r in rows]}  # fmt: skip


@router.get("/adapters")
async def list_adapters(services: ServicesDep) -> dict[str, Any]:
    """Adapter versions on disk, which are loaded, and which one serves the policy."""
    registry = services.registry
    async with services.store.engine.connect() as conn:
        rows = (await conn.execute(select(A).where(A.c.policy == registry.policy).order_by(A.c.version))).all()
    return {
        "object": "list",
        "policy": registry.policy,
        "active_version": registry.active_version,
        "loaded_versions": sorted(registry.loaded_versions),
        "data": [{"object": "adapter", **{f: r._mapping[f] for f in _ADAPTER_FIELDS}} for r in rows],
    }


@router.post("/adapters/{version}/activate")
async def activate(version: Annotated[int, Path(ge=0)], services: ServicesDep) -> dict[str, Any]:
    """Serve `version` as the policy (0 is the base model): a rollback or a roll forward."""
    active = await services.publisher.activate(version)
    return {"object": "policy", "policy": services.registry.policy, "active_version": active}
