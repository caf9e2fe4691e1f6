"""A person's score on the dashboard and the admin API: the review queue, and the score itself."""

from __future__ import annotations

from typing import Any

from proxy.admin._service import Sources
from proxy.data import FeedbackPost, give_feedback, review_queue
from proxy.errors import TrajectoryNotFound


async def queue(services: Sources, *, limit: int, after: str | None) -> dict[str, Any]:
    """What awaits a person's score, oldest first (``proxy.data._feedback``)."""
    listing = await review_queue(services.store, services.settings.policy, limit=limit, after=after)
    return {**listing, "reward_source": services.settings.reward_source}


async def score(services: Sources, trajectory_id: str, feedback: FeedbackPost) -> dict[str, Any]:
    """Record a person's score (source "human") as the trajectory's reward; the reward written."""
    return await give_feedback(services.store, trajectory_id, feedback, written=services.scheduler.rewards_written)


async def neighbours(services: Sources, trajectory_id: str) -> dict[str, str | None]:
    """The trajectories before and after ``trajectory_id`` in the review queue (the dashboard's k and j)."""
    row = await services.store.reads.trajectory_key(trajectory_id)
    if row is None:
        raise TrajectoryNotFound(f"No trajectory with id '{trajectory_id}'.", param="trajectory_id")
    previous, following = await services.store.reads.review_neighbours(services.settings.policy, row)
    return {"previous": previous, "next": following}
