"""A person's score as a reward: ``POST /admin/trajectories/{id}/feedback`` and the dashboard's review.

A score is a number from 0 to 1 with an optional note and an optional demonstration (the answer the
person wanted: kept on the trajectory, exported, and an example for ``tracetrain sft``); it is
recorded as a ``rewards`` row with source "human" and becomes the trajectory's reward, over a
service's or the judge's (which are still recorded beside it, and never replace it:
``store._rewards``). A group whose trajectories are all scored becomes ready and trains, as with
any reward; a score given after the group trained is recorded and shown, but the step that used
the earlier reward stays.

The review queue is what awaits a person's score: trajectories no person scored yet, in a
group still open, oldest first (with ``--reward-source human`` the unrewarded ones; beside a
judge, its scores await review too).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationError

from proxy._params import MAX_INT
from proxy._policy_keys import EVERY, Scope
from proxy.data._service import RewardsWritten
from proxy.data._wire import reward_view, trajectory_view
from proxy.errors import InvalidRequest, store_errors
from store import RewardIn, Store

MAX_NOTE = 4000  # characters: a reviewer's remark, not a document
MAX_DEMONSTRATION = 100_000  # characters: an answer, however long an agent's answers get
_PK_CURSOR = re.compile(r"[0-9]{1,10}")


class FeedbackPost(BaseModel):
    """A person's score of one trajectory."""

    model_config = ConfigDict(extra="forbid")

    score: Annotated[StrictFloat, Field(ge=0.0, le=1.0, allow_inf_nan=False, description="From 0 (bad) to 1 (good).")]
    note: Annotated[str | None, Field(max_length=MAX_NOTE, description="Why, in the reviewer's words.")] = None
    demonstration: Annotated[
        str | None,
        Field(max_length=MAX_DEMONSTRATION, description="The answer the reviewer wanted: an SFT example."),
    ] = None


def parse_feedback(raw: bytes) -> FeedbackPost:
    """The body of ``POST /admin/trajectories/{id}/feedback``, validated whole (a 400 that names the field)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON ({exc}).") from exc
    return validate_feedback(body)


def validate_feedback(body: Any) -> FeedbackPost:
    try:
        return FeedbackPost.model_validate(body)
    except ValidationError as exc:
        hint = (f'Send {{"score": a number from 0 to 1, "note": text of at most {MAX_NOTE} characters or null, '
                f'"demonstration": the answer wanted, at most {MAX_DEMONSTRATION} characters, or null}}.')
        raise InvalidRequest.from_validation(exc.errors(), hint) from exc


async def give_feedback(
    store: Store, trajectory_id: str, feedback: FeedbackPost, *, written: RewardsWritten, scope: Scope = EVERY
) -> dict[str, Any]:
    """Record a person's score of ``trajectory_id`` as its reward (404 for an unknown id, or one of a policy outside
    ``scope``); the reward written."""
    note = (feedback.note or "").strip() or None
    demonstration = (feedback.demonstration or "").strip() or None
    given = RewardIn(trajectory_id, feedback.score, {}, "human", note, demonstration=demonstration)
    with store_errors():
        rewards = await store.add_rewards([given], scope.policies)
    await written(rewards)
    return reward_view(rewards[0])


async def review_queue(store: Store, policy: str, *, limit: int, after: str | None) -> dict[str, Any]:
    """What awaits a person's score, oldest first, in keyset pages; ``total``: how many in all."""
    cursor = None
    if after is not None:
        if not _PK_CURSOR.fullmatch(after) or int(after) > MAX_INT:
            raise InvalidRequest("'after' must be a cursor returned as next_cursor.", param="after")
        cursor = int(after)
    rows = await store.reads.review_queue(policy, limit=limit, after=cursor)
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {
        "object": "list",
        "data": [trajectory_view(r) for r in rows],
        "has_more": has_more,
        "next_cursor": str(rows[-1]["pk"]) if has_more and rows else None,
        "total": await store.reads.review_count(policy),
    }
