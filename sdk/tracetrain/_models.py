"""Wire models of the tracetrain reward and trajectory API.

Response models are frozen and keep fields they do not know (`extra="allow"`, read
them from `model_extra`), so a newer server never breaks an older client. Times are
unix seconds, as on the wire. Enumerations the server may grow (a call's `endpoint`,
a group's `state`) are plain `str` for the same reason; their known values are listed
on the field.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


_M = TypeVar("_M", bound=BaseModel)


class Page(_Response, Generic[_M]):
    """One page of a list endpoint. Pass `next_cursor` as `after` to get the next one."""

    object: str = "list"
    data: list[_M]
    has_more: bool = False
    next_cursor: str | None = None


class RewardIn(BaseModel):
    """A reward to post for one trajectory, or one of its calls (`call_id`: a response's `X-Call-Id`).

    Non-finite numbers are rejected on construction. Without `reward`, the server weighs `metrics` into
    one (the policy's `--reward-weights`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    trajectory_id: str = Field(min_length=1)
    reward: float | None = None
    metrics: dict[str, float] | None = None
    call_id: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _a_reward_or_metrics(self) -> RewardIn:
        if self.reward is None and not self.metrics:
            raise ValueError("give a reward, or metrics for the server to weigh into one")
        return self


class Reward(_Response):
    """A reward as the server recorded it."""

    object: str = "reward"
    trajectory_id: str
    group_id: str
    reward: float
    metrics: dict[str, float] = Field(default_factory=dict)
    source: str = "service"  # "service" (posted), "judge" or "human" (a person's score)
    created_at: float
    call_id: str | None = None  # the call rewarded; None: the whole trajectory


class TrajectorySummary(_Response):
    """A captured trajectory without its calls, as listed by `list_trajectories`."""

    object: str = "trajectory"
    id: str
    group_id: str
    policy: str
    created_at: float
    updated_at: float
    n_calls: int
    last_version: int
    reward: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    rewarded_at: float | None = None


class Call(_Response):
    """One captured model call: the request, the response and the exact tokens sampled."""

    object: str = "call"
    id: str
    trajectory_id: str
    endpoint: str = Field(description='"chat.completions" or "completions"')
    model: str = Field(description="the model the agent asked for")
    served_model: str = Field(description="the versioned adapter that answered, e.g. policy@7")
    version: int
    stream: bool
    request: dict[str, Any]
    response: dict[str, Any] | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    completion_token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int
    completion_tokens: int
    status_code: int
    error: str | None = None
    latency_ms: float
    ttft_ms: float | None = None
    started_at: float
    reward: float | None = None  # this call's own reward (posted with its call_id), if any


class Trajectory(TrajectorySummary):
    """A trajectory with its calls, in the order they were made."""

    calls: list[Call] = Field(default_factory=list)


class Group(_Response):
    """A GRPO group: trajectories of the same task, compared with each other."""

    object: str = "group"
    id: str
    policy: str
    state: str = Field(description='"open", "ready", "training", "trained" or "failed"')
    size: int
    n_rewarded: int
    reward_mean: float | None = None
    reward_std: float | None = None
    created_at: float
