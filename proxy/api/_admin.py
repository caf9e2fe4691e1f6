"""The admin JSON API: everything the dashboard shows, and its two actions.

Reads: overview, trajectories, groups, training jobs, adapters, training state. Actions:
train now, activate a version (rollback/forward), resume training after the regression
guard paused it, end every dashboard session, and record a version's evaluation (for the trainer's run
loggers). The admin token (``Authorization: Bearer``) or a dashboard session with its CSRF token admits a
request (``proxy._credentials``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from proxy._params import Cursor, GroupViewState, Id, Limit, UnixTime, Version
from proxy.admin import _service as _admin
from proxy.admin._evaluations import EvaluationPost, record_evaluation
from proxy.api._deps import ServicesDep, require_admin
from proxy.errors import InvalidRequest

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


@router.get("/overview")
async def overview(services: ServicesDep) -> dict[str, Any]:
    """Requests per minute, trajectories (open, rewarded), ready groups, the version each policy serves,
    training jobs by state, the last step, the running job and vLLM's health."""
    return await _admin.overview(services)


@router.get("/trajectories")
async def list_trajectories(
    services: ServicesDep,
    policy: Id | None = None,
    group_id: Id | None = None,
    rewarded: bool | None = None,
    version: Annotated[Version | None, Query(description="The version of the trajectory's last call.")] = None,
    created_after: UnixTime = None,
    created_before: UnixTime = None,
    limit: Limit = 50,
    after: Cursor = None,
) -> dict[str, Any]:
    """Trajectories, newest first, filtered."""
    return await _admin.list_trajectories(
        services, policy=policy, group_id=group_id, rewarded=rewarded, version=version,
        created_after=created_after, created_before=created_before, limit=limit, after=after,
    )  # fmt: skip


@router.get("/trajectories/{trajectory_id}")
async def get_trajectory(trajectory_id: Id, services: ServicesDep) -> dict[str, Any]:
    """One trajectory: its calls in order (each with the messages it added, its reply, token ids, the text of
    every completion token and its sampling logprob) and every reward posted for it."""
    return await _admin.trajectory_detail(services, trajectory_id)


@router.get("/groups")
async def list_groups(
    services: ServicesDep,
    policy: Id | None = None,
    state: GroupViewState | None = None,
    limit: Limit = 50,
    after: Cursor = None,
) -> dict[str, Any]:
    """Groups with their size, reward mean and std, and state."""
    return await _admin.list_groups(services, policy=policy, state=state, limit=limit, after=after)


@router.get("/groups/{group_id}")
async def get_group(group_id: Id, services: ServicesDep) -> dict[str, Any]:
    """A group's members side by side: reward, advantage (scaled and centered, as the trainer computes them),
    final answer, the judge's score and explanation; and the group's judgements (ok or failed, with why)."""
    return await _admin.group_detail(services, group_id)


@router.get("/jobs")
async def list_jobs(services: ServicesDep, limit: Limit = 50) -> dict[str, Any]:
    """Training jobs (steps), newest first, with their metrics and progress."""
    return await _admin.list_jobs(services, limit)


@router.get("/adapters")
async def list_adapters(services: ServicesDep) -> dict[str, Any]:
    """Adapter versions on disk, which are loaded, and which one serves the policy."""
    return await _admin.list_adapters(services)


@router.get("/training")
async def training(services: ServicesDep) -> dict[str, Any]:
    """Whether the policy trains, or why the regression guard paused it."""
    return await _admin.training_state(services)


@router.post("/training/resume")
async def resume_training(services: ServicesDep) -> dict[str, Any]:
    """Resume training after the regression guard paused it (it rolled a worse version back)."""
    return await _admin.resume_training(services)


@router.post("/train")
async def train_now(services: ServicesDep) -> dict[str, Any]:
    """Create a training job from every ready group now, without waiting for a full batch (409 while paused)."""
    await _admin.refuse_while_paused(services)
    job = await services.scheduler.maybe_create_job(force=True)
    if job is None:
        raise InvalidRequest(
            "No group is ready: a group is ready when all its trajectories are rewarded and it has at least "
            f"{services.settings.min_group_size} of them (see GET /admin/groups?state=ready)."
        )
    return {"object": "training_job", **job}


@router.post("/adapters/{version}/activate")
async def activate(version: Version, services: ServicesDep) -> dict[str, Any]:
    """Serve `version` as the policy (0 is the base model): a rollback or a roll forward."""
    active = await services.publisher.activate(version)
    return {"object": "policy", "policy": services.registry.policy, "active_version": active}


@router.post("/sessions/revoke")
async def revoke_sessions(services: ServicesDep) -> dict[str, str]:
    """End every dashboard session issued so far, on every replica sharing the store: each browser logs in again.
    (Logging out ends one session; rotating the admin token ends them all too.)"""
    await services.credentials.admin.revoke_all()
    return {"revoked": "all sessions"}


@router.post("/evaluations")
async def post_evaluation(post: EvaluationPost, services: ServicesDep) -> dict[str, Any]:
    """Record a version's scores on what it was not trained on (held-out success, a benchmark), e.g.
    `{"version": 3, "scores": {"held_out_success": 0.62}, "samples": 200}`. The trainer logs them to its run
    (`--log-to`) at that version's step."""
    return await record_evaluation(services.store, services.registry.policy, post)
