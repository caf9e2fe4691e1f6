"""The client's layer without I/O: each API call is an `_Operation` that says what to send
and how to read the answer; `Client` and `AsyncClient` differ only in how they send it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from ._errors import APIError, error_from_response
from ._models import Group, Page, Reward, RewardIn, Trajectory, TrajectorySummary

TRAJECTORY_HEADER = "X-Trajectory-Id"
GROUP_HEADER = "X-Group-Id"

RewardLike: TypeAlias = RewardIn | tuple[str, float] | Mapping[str, Any]
"""A reward to post: a `RewardIn`, a `(trajectory_id, reward)` pair or a mapping of `RewardIn`'s fields."""

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


def new_trajectory_id() -> str:
    """A fresh, URL-safe trajectory id such as ``traj-3f2a...``."""
    return f"traj-{uuid.uuid4().hex}"


def trajectory_headers(trajectory_id: str, group_id: str | None = None) -> dict[str, str]:
    """Headers that key a call to a trajectory (and group), for agents that can set headers.

    >>> trajectory_headers("traj-1", group_id="task-7")
    {'X-Trajectory-Id': 'traj-1', 'X-Group-Id': 'task-7'}
    """
    headers = {TRAJECTORY_HEADER: _require_id(trajectory_id, "trajectory_id")}
    if group_id is not None:
        headers[GROUP_HEADER] = _require_id(group_id, "group_id")
    return headers


def _require_id(value: str, name: str) -> str:
    if not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _segment(value: str, name: str) -> str:
    return quote(_require_id(value, name), safe="")


def _root_url(base_url: str) -> str:
    """The server's root URL, whether `base_url` was given with a trailing `/v1`, `/`, or neither."""
    root = base_url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root.removesuffix("/v1").rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    return root


@dataclass(frozen=True, slots=True)
class _Operation(Generic[_T]):
    """One API call, independent of sync or async I/O."""

    method: str
    path: str
    parse: Callable[[Any], _T]
    params: dict[str, str | int] | None = None
    json: Any = None

    def read(self, response: httpx.Response) -> _T:
        if response.is_error:
            raise error_from_response(response)
        try:
            return self.parse(response.json())
        except ValueError as exc:  # invalid JSON, or JSON that does not fit the model
            raise APIError(response.status_code, f"unreadable response body: {exc}", type="invalid_response") from exc


def _to_reward_in(item: RewardLike) -> RewardIn:
    if isinstance(item, RewardIn):
        return item
    if isinstance(item, tuple):
        trajectory_id, reward = item
        return RewardIn(trajectory_id=trajectory_id, reward=reward)
    if isinstance(item, Mapping):
        return RewardIn.model_validate(item)
    raise TypeError(f"expected RewardIn, (trajectory_id, reward) or a mapping, got {type(item).__name__}")


def _reward_body(reward: RewardIn) -> dict[str, Any]:
    return reward.model_dump(mode="json", exclude_none=True)


def _read_rewards(body: Any) -> list[Reward]:
    return Page[Reward].model_validate(body).data


def _read_one_reward(body: Any) -> Reward:
    rewards = _read_rewards(body)
    if len(rewards) != 1:
        raise ValueError(f"expected one reward in the response, got {len(rewards)}")
    return rewards[0]


def _post_reward(
    trajectory_id: str, reward: float | None, metrics: Mapping[str, float] | None, call_id: str | None
) -> _Operation[Reward]:
    item = RewardIn(trajectory_id=trajectory_id, reward=reward, metrics=None if metrics is None else dict(metrics),
                    call_id=call_id)  # fmt: skip
    return _Operation("POST", "/v1/rewards", _read_one_reward, json=_reward_body(item))


def _post_rewards(items: list[RewardIn]) -> _Operation[list[Reward]]:
    return _Operation("POST", "/v1/rewards", _read_rewards, json={"rewards": [_reward_body(r) for r in items]})


def _page_params(limit: int, after: str | None, **filters: str | bool | None) -> dict[str, str | int]:
    params: dict[str, str | int] = {}
    for name, value in filters.items():
        if isinstance(value, bool):
            params[name] = "true" if value else "false"
        elif value is not None:
            params[name] = value
    params["limit"] = limit
    if after is not None:
        params["after"] = after
    return params


def _list_trajectories(
    group_id: str | None, policy: str | None, rewarded: bool | None, limit: int, after: str | None
) -> _Operation[Page[TrajectorySummary]]:
    params = _page_params(limit, after, group_id=group_id, policy=policy, rewarded=rewarded)
    return _Operation("GET", "/v1/trajectories", Page[TrajectorySummary].model_validate, params=params)


def _get_trajectory(trajectory_id: str) -> _Operation[Trajectory]:
    path = f"/v1/trajectories/{_segment(trajectory_id, 'trajectory_id')}"
    return _Operation("GET", path, Trajectory.model_validate)


def _list_groups(policy: str | None, state: str | None, limit: int, after: str | None) -> _Operation[Page[Group]]:
    params = _page_params(limit, after, policy=policy, state=state)
    return _Operation("GET", "/v1/groups", Page[Group].model_validate, params=params)


def _iterate(fetch: Callable[[str | None], Page[_M]], after: str | None) -> Iterator[_M]:
    while True:
        page = fetch(after)
        yield from page.data
        if not page.has_more or page.next_cursor is None:
            return
        after = page.next_cursor


async def _aiterate(fetch: Callable[[str | None], Awaitable[Page[_M]]], after: str | None) -> AsyncIterator[_M]:
    while True:
        page = await fetch(after)
        for item in page.data:
            yield item
        if not page.has_more or page.next_cursor is None:
            return
        after = page.next_cursor
