"""Wire schemas of the data API: rewards in, trajectories and groups out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from proxy._params import Id
from store import COMPACT_COLUMNS, Call, RewardRecord

# Every number a client posts as a measurement (a reward, a reward's metric, an evaluation's score) is at most
# this far from 0: the group statistics, the advantages, the regression guard's and the canary's tests square
# and sum them in doubles, and 1e200 squared is past the largest one. A reward scale needs far less.
SCORE_LIMIT = 1e6
# A JSON number within that range, not a boolean or a string.
Score = Annotated[StrictFloat, Field(ge=-SCORE_LIMIT, le=SCORE_LIMIT, allow_inf_nan=False)]
# A metric's name as every logger takes it: letters, digits and _ . - /, at most 64 characters.
MetricName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,63}$")]
MAX_METRICS = 32  # names per reward, as per evaluation: each trajectory read carries them all


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory_id: Id
    # None: the weighted sum of the metrics (the policy's reward_weights).
    reward: Score | None = None
    metrics: dict[MetricName, Score] = Field(default_factory=dict, max_length=MAX_METRICS)
    # One call of the trajectory (its X-Call-Id) to reward, not the whole trajectory.
    call_id: Id | None = None


class RewardBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rewards: list[RewardPost] = Field(min_length=1, max_length=10_000)


def reward_view(reward: RewardRecord) -> dict[str, Any]:
    return {
        "object": "reward",
        "trajectory_id": reward.trajectory_id,
        "group_id": reward.group_id,
        "reward": reward.reward,
        "metrics": reward.metrics,
        "source": reward.source,
        "explanation": reward.explanation,
        "created_at": reward.created_at,
        "call_id": reward.call_id,
    }


_TRAJECTORY_FIELDS = (
    "id",
    "group_id",
    "policy",
    "keyed_by",
    "created_at",
    "updated_at",
    "n_calls",
    "last_version",
    "reward",
    "reward_source",
    "reward_note",
    "demonstration",
    "metrics",
    "rewarded_at",
)
# A call as readers see it: whole (store._compact rebuilt it), so the columns saying how are left out.
_CALL_FIELDS = tuple(name for name in Call.model_fields if name != "pk" and name not in COMPACT_COLUMNS)
_GROUP_FIELDS = ("id", "policy", "created_at")


def trajectory_view(m: Mapping[str, Any]) -> dict[str, Any]:
    return {"object": "trajectory", **{name: m[name] for name in _TRAJECTORY_FIELDS}}


def call_view(m: Mapping[str, Any]) -> dict[str, Any]:
    return {"object": "call", **{name: m[name] for name in _CALL_FIELDS}}


def group_view(m: Mapping[str, Any], state: str) -> dict[str, Any]:
    mean = m["reward_mean"]
    std = None
    if mean is not None:  # the store reads rewards clipped to SCORE_LIMIT, so neither square overflows
        mean = float(mean)
        std = math.sqrt(max(0.0, float(m["reward_sq_mean"]) - mean * mean))
    return {
        "object": "group",
        **{name: m[name] for name in _GROUP_FIELDS},
        "state": state,
        "size": int(m["size"]),
        "n_rewarded": int(m["n_rewarded"]),
        "reward_mean": mean,
        "reward_std": std,
    }
