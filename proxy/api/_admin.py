"""The admin JSON API: everything the dashboard shows, and its actions.

Reads: overview, trajectories, groups, training jobs, adapters, training state, canary trials,
the review queue. Actions: train now, activate a version (rollback/forward), resume training after
the regression guard paused it, end a canary trial (promote or roll back), a person's score of a
trajectory, end every dashboard session, and record a version's evaluation (for the trainer's run
loggers). Each is about one policy: ``?policy=NAME`` (optional while one policy is served; lists of
jobs and trials show every policy's without it; a trial or trajectory of another policy than the one
named is a 404); the policies themselves are ``proxy.api._admin_policies``. The admin token
(``Authorization: Bearer``) or a dashboard session with its CSRF token admits a request
(``proxy._credentials``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from proxy._params import Cursor, GroupViewState, Id, Limit, PolicyName, TrialId, UnixTime, Version, json_body
from proxy._policy_keys import EVERY, Scope
from proxy.admin import _policies, _review, _trials
from proxy.admin import _service as _admin
from proxy.admin._evaluations import EvaluationPost, record_evaluation
from proxy.api._deps import ServicesDep, require_admin
from proxy.data import FeedbackPost, parse_feedback
from proxy.errors import InvalidRequest

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])

# The policy a per-policy read or an action is about; optional while the proxy serves one policy.
PolicyParam = Annotated[
    PolicyName | None, Query(description="The policy (optional while one is served; see GET /admin/policies).")
]


@router.get("/overview")
async def overview(services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """Requests per minute, trajectories (open, rewarded), each policy (the version it serves, ready groups,
    training state), training jobs by state, the last step, the running job and vLLM's health; of `policy`
    alone when named."""
    if policy is not None:
        policy = await _policies.chosen(services, policy)
    return await _admin.overview(services, policy)


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
async def list_jobs(services: ServicesDep, limit: Limit = 50, policy: PolicyParam = None) -> dict[str, Any]:
    """Training jobs (steps) of every policy, or of `policy`, newest first, with their metrics and progress."""
    if policy is not None:
        policy = await _policies.chosen(services, policy)
    return await _admin.list_jobs(services, limit, policy)


@router.get("/adapters")
async def list_adapters(services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """The policy's adapter versions on disk, which are loaded, and which one serves it."""
    return await _admin.list_adapters(services, await _policies.chosen(services, policy))


@router.get("/training")
async def training(services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """Whether the policy trains, or why the regression guard paused it."""
    return await _admin.training_state(services, await _policies.chosen(services, policy))


@router.post("/training/resume")
async def resume_training(services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """Resume the policy's training after the regression guard paused it (it rolled a worse version back)."""
    return await _admin.resume_training(services, await _policies.chosen(services, policy))


@router.post("/train")
async def train_now(services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """Create a training job from every ready group of the policy now, without waiting for a full batch (409
    while its training is paused)."""
    name = await _policies.chosen(services, policy)
    await _admin.refuse_while_paused(services, name)
    job = await services.scheduler.maybe_create_job(name, force=True)
    if job is None:
        size = services.registry.get(name).settings.min_group_size if name in services.registry else None
        raise InvalidRequest(
            f"No group is ready to train {name} on: a group is ready when all its trajectories are rewarded and it "
            f"has at least {size or services.settings.min_group_size} of them (see GET /admin/groups?state=ready"
            f"&policy={name}); a retired policy trains nothing."
        )
    return {"object": "training_job", **job}


@router.post("/adapters/{version}/activate")
async def activate(version: Version, services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """Serve `version` as the policy (0 is the base model): a rollback or a roll forward."""
    name = await _policies.chosen(services, policy)
    active = await services.publisher.activate(name, version)
    return {"object": "policy", "policy": name, "active_version": active}


@router.post("/sessions/revoke")
async def revoke_sessions(services: ServicesDep) -> dict[str, str]:
    """End every dashboard session issued so far, on every replica sharing the store: each browser logs in again.
    (Logging out ends one session; rotating the admin token ends them all too.)"""
    await services.credentials.admin.revoke_all()
    return {"revoked": "all sessions"}


@router.post("/evaluations")
async def post_evaluation(post: EvaluationPost, services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """Record a version's scores on what it was not trained on (held-out success, a benchmark), e.g.
    `{"version": 3, "scores": {"held_out_success": 0.62}, "samples": 200}`. The trainer logs them to its run
    (`--log-to`) at that version's step."""
    return await record_evaluation(services.store, await _policies.chosen(services, policy), post)


@router.get("/trials")
async def list_trials(services: ServicesDep, limit: Limit = 50, policy: PolicyParam = None) -> dict[str, Any]:
    """Canary trials of every policy, or of `policy`, newest first: each version's share of new trajectories,
    rewards with 95% intervals, the paired test, the verdict and why (a policy's `canary` setting)."""
    if policy is not None:
        policy = await _policies.chosen(services, policy)
    return await _trials.list_trials(services, policy, limit)


@router.post("/trials/{trial_id}/promote")
async def promote_trial(trial_id: TrialId, services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """End a running trial: its version serves everything (409 once the trial has ended; 404 for a trial of
    another policy than `policy`)."""
    return await _trials.end_trial(services, trial_id, "promoted", await _named(services, policy))


@router.post("/trials/{trial_id}/roll-back")
async def roll_back_trial(trial_id: TrialId, services: ServicesDep, policy: PolicyParam = None) -> dict[str, Any]:
    """End a running trial: its version serves nothing, and training goes on from the version it was tried
    against (409 once the trial has ended; 404 for a trial of another policy than `policy`)."""
    return await _trials.end_trial(services, trial_id, "rolled_back", await _named(services, policy))


@router.get("/review")
async def review_queue(
    services: ServicesDep, limit: Limit = 50, after: Cursor = None, policy: PolicyParam = None
) -> dict[str, Any]:
    """What awaits a person's score in the policy's groups, oldest first: trajectories no person scored yet, in a
    group still open."""
    return await _review.queue(services, await _policies.chosen(services, policy), limit=limit, after=after)


_FEEDBACK_BODY = json_body(FeedbackPost, {"score": {"score": 0.8, "note": "right answer, too long"}})


@router.post("/trajectories/{trajectory_id}/feedback", openapi_extra=_FEEDBACK_BODY)
async def feedback(
    trajectory_id: Id, request: Request, services: ServicesDep, policy: PolicyParam = None
) -> dict[str, Any]:
    """A person's score of a trajectory (`{"score": 0 to 1, "note"?}`): its reward, with source `human`, over a
    service's or the judge's (a 404 for a trajectory of another policy than `policy`)."""
    named = await _named(services, policy)
    scope = EVERY if named is None else Scope(frozenset({named}))
    return await _review.score(services, trajectory_id, parse_feedback(await request.body()), scope)


async def _named(services: ServicesDep, policy: str | None) -> str | None:
    """The policy a request names, checked (a 404 for one the store does not hold); None when it names none."""
    return None if policy is None else await _policies.chosen(services, policy)
