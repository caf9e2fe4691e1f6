"""The admin JSON API: everything the dashboard shows, and its actions.

Reads: overview, trajectories, groups, training jobs, adapters, training state, canary trials,
the review queue. Actions: train now, activate a version (rollback/forward), resume training after
the regression guard paused it, end a canary trial (promote or roll back), a person's score of a
trajectory. The admin token (``Authorization: Bearer``) or a dashboard session with its CSRF token
admits a request (``proxy._credentials``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from proxy._params import Cursor, GroupViewState, Id, Limit, TrialId, UnixTime, Version, json_body
from proxy.admin import _review, _trials
from proxy.admin import _service as _admin
from proxy.api._deps import ServicesDep, require_admin
from proxy.data import FeedbackPost, parse_feedback
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


@router.get("/trials")
async def list_trials(services: ServicesDep, limit: Limit = 50) -> dict[str, Any]:
    """Canary trials, newest first: each version's share of new trajectories, rewards with 95% intervals, the
    paired test, the verdict and why (`--canary`)."""
    return await _trials.list_trials(services, limit)


@router.post("/trials/{trial_id}/promote")
async def promote_trial(trial_id: TrialId, services: ServicesDep) -> dict[str, Any]:
    """End the running trial: its version serves everything (409 once the trial has ended)."""
    return await _trials.end_trial(services, trial_id, "promoted")


@router.post("/trials/{trial_id}/roll-back")
async def roll_back_trial(trial_id: TrialId, services: ServicesDep) -> dict[str, Any]:
    """End the running trial: its version serves nothing, and training goes on from the version it was tried
    against (409 once the trial has ended)."""
    return await _trials.end_trial(services, trial_id, "rolled_back")


@router.get("/review")
async def review_queue(services: ServicesDep, limit: Limit = 50, after: Cursor = None) -> dict[str, Any]:
    """What awaits a person's score, oldest first: trajectories no person scored yet, in a group still open."""
    return await _review.queue(services, limit=limit, after=after)


_FEEDBACK_BODY = json_body(FeedbackPost, {"score": {"score": 0.8, "note": "right answer, too long"}})


@router.post("/trajectories/{trajectory_id}/feedback", openapi_extra=_FEEDBACK_BODY)
async def feedback(trajectory_id: Id, request: Request, services: ServicesDep) -> dict[str, Any]:
    """A person's score of a trajectory (`{"score": 0 to 1, "note"?}`): its reward, with source `human`, over a
    service's or the judge's."""
    return await _review.score(services, trajectory_id, parse_feedback(await request.body()))
