"""Wire schemas of the data API: rewards in, trajectories and groups out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from proxy._params import Id
from store import COMPACT_COLUMNS, Call, RewardRecord

# A JSON number that is finite and not a boolean or a string.
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory_id: Id
    # None: the weighted sum of the metrics (the policy's reward_weights).
    reward: Finite | None = None
    metrics: dict[str, Finite] = Field(default_factory=dict)
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
    if mean is not None:
        std = max(0.0, float(m["reward_sq_mean"]) - float(mean) ** 2) ** 0.5
    return {
        "object": "group",
        **{name: m[name] for name in _GROUP_FIELDS},
        "state": state,
        "size": int(m["size"]),
        "n_rewarded": int(m["n_rewarded"]),
        "reward_mean": mean,
        "reward_std": std,
    }
