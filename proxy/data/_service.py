"""The data API's service: rewards in; trajectories and groups out, read from the store.

Each function takes the ``Scope`` of the request's key (``proxy._policy_keys``): a trajectory or group of a
policy outside it is not found, exactly as an unknown one, and lists hold only the scope's policies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from pydantic import ValidationError

from proxy._params import MAX_INT
from proxy._policy_keys import EVERY, Scope
from proxy.data._wire import (
    MAX_METRICS,
    SCORE_LIMIT,
    RewardBatch,
    RewardPost,
    call_view,
    group_view,
    reward_view,
    trajectory_view,
)
from proxy.errors import Conflict, InvalidRequest, TrajectoryNotFound, store_errors
from store import GROUP_VIEW_STATES, RewardIn, RewardRecord, Store, TrajectoryFilter

# ASCII digits, few enough for int() and the store: str.isdigit() also takes "²".
_PK_CURSOR = re.compile(r"[0-9]{1,10}")


# Told of every reward written (``proxy.training.JobScheduler.rewards_written``: metrics, Langfuse, a job when due).
RewardsWritten = Callable[[Sequence[RewardRecord]], Awaitable[None]]
# policy -> its reward source ("external", "judge", "both" or "human"), for the policies served.
RewardSources = Callable[[str], str | None]
# policy -> its reward's components and their weights (--reward-weights); None: none configured.
RewardWeightsOf = Callable[[str], dict[str, float] | None]


def weighed_reward(policy: str, metrics: dict[str, float], weights: dict[str, float] | None) -> float:
    """A reward posted without a value: the weighted sum of its metrics. Every weighted component must be given
    (a missing one is a 400, never read as 0); metrics without a weight are kept and shown, not weighed."""
    if not weights:
        raise InvalidRequest(
            f"A reward needs a value: policy {policy} weighs no metrics into one (--reward-weights NAME=W,... or "
            "its reward_weights setting). Nothing was recorded.",
            param="reward",
        )
    if missing := sorted(name for name in weights if name not in metrics):
        raise InvalidRequest(
            f"The reward of policy {policy} is the weighted sum of {', '.join(sorted(weights))}; the metrics lack "
            f"{', '.join(missing)}. Give every component, or the reward itself. Nothing was recorded.",
            param="metrics",
        )
    reward = sum(weight * metrics[name] for name, weight in weights.items())
    if not (math.isfinite(reward) and abs(reward) <= SCORE_LIMIT):
        raise InvalidRequest(
            f"The weighted sum of the metrics is {reward:.6g}, outside the rewards' range [-{SCORE_LIMIT:g}, "
            f"{SCORE_LIMIT:g}]. Nothing was recorded.",
            param="metrics",
        )
    return reward


def refuse_external_rewards(policies: set[str], reward_source: RewardSources) -> None:
    """A policy whose rewards come from the judge alone (reward source ``judge``), or from people alone (``human``),
    takes no posted reward: a 409."""
    by_people = sorted(p for p in policies if reward_source(p) == "human")
    if by_people:
        raise Conflict(
            f"The rewards of {', '.join(by_people)} are people's scores (reward source human: the dashboard's review "
            "queue, or POST /admin/trajectories/{id}/feedback with the admin token). Give the policy the reward "
            "source external to post rewards. Nothing was recorded.",
            code="rewards_come_from_people",
        )
    judged = sorted(p for p in policies if reward_source(p) == "judge")
    if judged:
        raise Conflict(
            f"The rewards of {', '.join(judged)} come from the LLM judge (reward source judge), and one group must "
            "not mix sources. Give the policy the reward source both to post rewards and record the judge's scores "
            "beside them, or external to post rewards only. Nothing was recorded.",
            code="rewards_come_from_the_judge",
        )


async def post_rewards(
    store: Store,
    raw: bytes,
    *,
    reward_source: RewardSources,
    written: RewardsWritten,
    scope: Scope = EVERY,
    reward_weights: RewardWeightsOf | None = None,
) -> dict[str, Any]:
    """``POST /v1/rewards``: validated completely (one reward or a batch), recorded atomically (a trajectory
    outside ``scope`` is unknown, a policy rewarded by the judge alone refuses it: nothing is written), and told
    to ``written``. A reward given as metrics alone is their weighted sum (``weighed_reward``)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON ({exc}).") from exc
    try:
        if isinstance(body, dict) and "rewards" in body:
            items = RewardBatch.model_validate(body).rewards
        else:
            items = [RewardPost.model_validate(body)]
    except ValidationError as exc:
        hint = (f"A reward is a JSON number from -{SCORE_LIMIT:.0f} to {SCORE_LIMIT:.0f}; metrics map at most "
                f"{MAX_METRICS} names (letters, digits and _ . - /, up to 64 characters) to such numbers. "
                "Nothing was recorded.")  # fmt: skip
        raise InvalidRequest.from_validation(exc.errors(), hint) from exc
    with store_errors():
        rewards = await store.add_rewards(
            (RewardIn(r.trajectory_id, r.reward, dict(r.metrics), call_id=r.call_id) for r in items), scope.policies,
            lambda policies: refuse_external_rewards(policies, reward_source),
            lambda policy, metrics: weighed_reward(policy, metrics, reward_weights(policy) if reward_weights else None),
        )  # fmt: skip
    await written(rewards)
    return {"object": "list", "data": [reward_view(reward) for reward in rewards]}


def _page(rows: list[Any], limit: int, cursor_of: Any) -> tuple[list[Any], bool, str | None]:
    has_more = len(rows) > limit
    rows = rows[:limit]
    return rows, has_more, (cursor_of(rows[-1]) if has_more and rows else None)


async def list_trajectories(
    store: Store,
    *,
    group_id: str | None,
    policy: str | None,
    rewarded: bool | None,
    limit: int,
    after: str | None,
    version: int | None = None,
    created_after: float | None = None,
    created_before: float | None = None,
    scope: Scope = EVERY,
) -> dict[str, Any]:
    cursor = None
    if after is not None:
        if not _PK_CURSOR.fullmatch(after) or int(after) > MAX_INT:
            raise InvalidRequest("'after' must be a cursor returned as next_cursor.", param="after")
        cursor = int(after)
    where = TrajectoryFilter(group_id, policy, rewarded, version, created_after, created_before, scope.policies)
    rows = await store.reads.trajectories(where, limit=limit, after=cursor)
    rows, has_more, next_cursor = _page(rows, limit, lambda row: str(row["pk"]))
    return {
        "object": "list",
        "data": [trajectory_view(r) for r in rows],
        "has_more": has_more,
        "next_cursor": next_cursor,
    }


async def get_trajectory(store: Store, trajectory_id: str, scope: Scope = EVERY) -> dict[str, Any]:
    record = await store.reads.trajectory(trajectory_id)
    if record is None or not scope.allows(str(record.trajectory["policy"])):
        raise TrajectoryNotFound(f"No trajectory with id '{trajectory_id}'.", param="trajectory_id")
    return {
        **trajectory_view(record.trajectory),
        # Every reward it got, oldest first: posted ones and the judge's, each with its source and explanation.
        "rewards": [reward_view(r) for r in record.rewards],
        "calls": [call_view(c) for c in record.calls],
    }


async def list_groups(
    store: Store,
    *,
    min_group_size: int,
    policy: str | None,
    state: str | None,
    limit: int,
    after: str | None,
    min_group_sizes: dict[str, int] | None = None,
    scope: Scope = EVERY,
) -> dict[str, Any]:
    """Groups, newest first; ``min_group_sizes``: the served policies' own least sizes (what "ready" means)."""
    if state is not None and state not in GROUP_VIEW_STATES:
        raise InvalidRequest(f"'state' must be one of {', '.join(GROUP_VIEW_STATES)}.", param="state")
    cursor = None
    if after is not None:
        created, _, group = after.partition("|")
        try:
            cursor = (float(created), group)
        except ValueError as exc:
            raise InvalidRequest("'after' must be a cursor returned as next_cursor.", param="after") from exc
    rows = await store.reads.groups(min_group_size=min_group_size, policy=policy, state=state, limit=limit,
                                    after=cursor, policies=scope.policies, min_group_sizes=min_group_sizes)  # fmt: skip
    rows, has_more, next_cursor = _page(rows, limit, lambda row: f"{row['created_at']!r}|{row['id']}")
    return {
        "object": "list",
        "data": [group_view(r, r["view_state"]) for r in rows],
        "has_more": has_more,
        "next_cursor": next_cursor,
    }
