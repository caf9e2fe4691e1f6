"""Rewards in; trajectories and groups out."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from proxy._params import Cursor, GroupViewState, Id, Limit, json_body
from proxy._services import Services
from proxy.api._deps import RewardScope, ServicesDep, reward_scope
from proxy.data import RewardBatch, RewardPost
from proxy.data import _service as _data

router = APIRouter(dependencies=[Depends(reward_scope)], tags=["data"])


def _reward_source(services: Services) -> _data.RewardSources:
    registry = services.registry
    return lambda policy: registry.get(policy).settings.reward_source if policy in registry else None


def _reward_weights(services: Services) -> _data.RewardWeightsOf:
    registry = services.registry
    return lambda policy: registry.get(policy).settings.reward_weights if policy in registry else None


# The body is parsed by the service (one form or the batch form, with errors that say
# which); this only documents it.
_REWARD_BODY = json_body(
    RewardPost | RewardBatch,
    {
        "one": {"trajectory_id": "traj-1", "reward": 1.0, "metrics": {"correct": 1.0}},
        "batch": {"rewards": [{"trajectory_id": "traj-1", "reward": 0.5}]},
        "one call": {"trajectory_id": "traj-1", "call_id": "call-1", "reward": 1.0},
        "weighted": {"trajectory_id": "traj-1", "metrics": {"correct": 1.0, "format": 0.5}},
    },
)


@router.post("/v1/rewards", openapi_extra=_REWARD_BODY)
async def post_rewards(request: Request, services: ServicesDep, scope: RewardScope) -> dict[str, Any]:
    """Record a reward, or a batch (`{"rewards": [...]}`) atomically: one unknown id rejects all (a trajectory
    of a policy the key may not reach is unknown). With `call_id` (a response's `X-Call-Id`) a reward is one call's:
    a call that is not the trajectory's is a 404 (`call_not_found`). Without `reward`, the reward is the weighted
    sum of `metrics` (the policy's `--reward-weights`; a 400 when it has none, or a component is missing).

    When enough groups become ready, a training job is queued. For a policy whose reward source is
    `judge`, rewards come from the judge, and a posted one is refused (409).
    """
    return await _data.post_rewards(
        services.store, await request.body(), reward_source=_reward_source(services),
        written=services.scheduler.rewards_written, scope=scope, reward_weights=_reward_weights(services),
    )  # fmt: skip


@router.get("/v1/trajectories")
async def list_trajectories(
    services: ServicesDep,
    group_id: Id | None = None,
    policy: Id | None = None,
    rewarded: bool | None = None,
    limit: Limit = 20,
    after: Cursor = None,
    *,
    scope: RewardScope,
) -> dict[str, Any]:
    """Captured trajectories (of the policies the key may reach), newest first."""
    return await _data.list_trajectories(
        services.store, group_id=group_id, policy=policy, rewarded=rewarded, limit=limit, after=after, scope=scope
    )


@router.get("/v1/trajectories/{trajectory_id}")
async def get_trajectory(trajectory_id: Id, services: ServicesDep, scope: RewardScope) -> dict[str, Any]:
    """One trajectory with its calls in order: requests, responses, token ids and logprobs."""
    return await _data.get_trajectory(services.store, trajectory_id, scope)


@router.get("/v1/groups")
async def list_groups(
    services: ServicesDep,
    policy: Id | None = None,
    state: GroupViewState | None = None,
    limit: Limit = 20,
    after: Cursor = None,
    *,
    scope: RewardScope,
) -> dict[str, Any]:
    """Groups (of the policies the key may reach) with their size, rewards and state; `ready` means all
    rewarded and big enough."""
    return await _data.list_groups(
        services.store,
        min_group_size=services.settings.min_group_size,
        min_group_sizes={served.name: served.settings.min_group_size for served in services.registry},
        policy=policy,
        state=state,
        limit=limit,
        after=after,
        scope=scope,
    )
