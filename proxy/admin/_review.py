"""A person's score on the dashboard and the admin API: the review queue, and the score itself.

The review queue is one policy's; a score reaches only the trajectories of the policies in its ``scope``
(the policy the request names: another policy's trajectory is a 404, as an unknown one).
"""

from __future__ import annotations

from typing import Any

from proxy._policy_keys import EVERY, Scope
from proxy.admin._service import Sources
from proxy.data import FeedbackPost, give_feedback, review_queue
from proxy.errors import TrajectoryNotFound


async def queue(services: Sources, policy: str, *, limit: int, after: str | None) -> dict[str, Any]:
    """What awaits a person's score in ``policy``'s groups, oldest first (``proxy.data._feedback``)."""
    listing = await review_queue(services.store, policy, limit=limit, after=after)
    source = services.registry.get(policy).settings.reward_source if policy in services.registry else None
    return {**listing, "policy": policy, "reward_source": source or services.settings.reward_source}


async def score(services: Sources, trajectory_id: str, feedback: FeedbackPost, scope: Scope = EVERY) -> dict[str, Any]:
    """Record a person's score (source "human") as the trajectory's reward; the reward written."""
    return await give_feedback(services.store, trajectory_id, feedback, written=services.scheduler.rewards_written,
                               scope=scope)  # fmt: skip


async def neighbours(services: Sources, trajectory_id: str) -> dict[str, str | None]:
    """The trajectories before and after ``trajectory_id`` in its policy's review queue (the dashboard's k and j)."""
    row = await services.store.reads.trajectory_key(trajectory_id)
    if row is None:
        raise TrajectoryNotFound(f"No trajectory with id '{trajectory_id}'.", param="trajectory_id")
    key, policy = row
    previous, following = await services.store.reads.review_neighbours(policy, key)
    return {"previous": previous, "next": following}
