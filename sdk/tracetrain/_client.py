"""`Client` and `AsyncClient` for the tracetrain proxy's reward and trajectory API.

Both share one layer without I/O: each API call is an `_Operation` that says what to
send and how to read the answer. The two clients differ only in how they send it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeAlias, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from ._errors import APIError, error_from_response, translate_transport_errors
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


def _post_reward(trajectory_id: str, reward: float, metrics: Mapping[str, float] | None) -> _Operation[Reward]:
    item = RewardIn(trajectory_id=trajectory_id, reward=reward, metrics=None if metrics is None else dict(metrics))
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


class _BaseClient:
    def __init__(self, base_url: str, api_key: str | None) -> None:
        self._root = _root_url(base_url)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @property
    def base_url(self) -> str:
        """The server's root URL, without `/v1`."""
        return self._root

    def openai_base_url(self, trajectory_id: str | None = None, group_id: str | None = None) -> str:
        """The base URL to hand an unmodified OpenAI-compatible agent.

        With a `trajectory_id` (and optionally a `group_id`) every call the agent makes
        is recorded into that trajectory, without the agent sending any header::

            client.openai_base_url()                    # http://host:8100/v1
            client.openai_base_url("traj-1")            # http://host:8100/t/traj-1/v1
            client.openai_base_url("traj-1", "task-7")  # http://host:8100/g/task-7/t/traj-1/v1
        """
        if trajectory_id is None:
            if group_id is not None:
                raise ValueError("a group_id needs a trajectory_id: the URL keys calls by trajectory")
            return f"{self._root}/v1"
        prefix = "" if group_id is None else f"/g/{_segment(group_id, 'group_id')}"
        return f"{self._root}{prefix}/t/{_segment(trajectory_id, 'trajectory_id')}/v1"


class Client(_BaseClient):
    """Synchronous client for posting rewards and reading trajectories.

    `base_url` is the server's root (``http://127.0.0.1:8100``); a trailing ``/v1`` is
    accepted too. `api_key` is sent as a bearer token on every request. `transport`
    replaces httpx's network transport (e.g. ``httpx.MockTransport`` in tests).
    Use it as a context manager, or call `close()`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key)
        self._http = httpx.Client(base_url=self._root, headers=self._headers, timeout=timeout, transport=transport)

    def _send(self, operation: _Operation[_T]) -> _T:
        request = self._http.build_request(
            operation.method, operation.path, params=operation.params, json=operation.json
        )
        with translate_transport_errors(request):
            response = self._http.send(request)
        return operation.read(response)

    def post_reward(self, trajectory_id: str, reward: float, metrics: Mapping[str, float] | None = None) -> Reward:
        """Post the reward of one trajectory; raises `NotFoundError` if the server does not know it."""
        return self._send(_post_reward(trajectory_id, reward, metrics))

    def post_rewards(self, rewards: Iterable[RewardLike]) -> list[Reward]:
        """Post several rewards in one request; every one is validated before anything is sent."""
        items = [_to_reward_in(r) for r in rewards]
        return self._send(_post_rewards(items)) if items else []

    def list_trajectories(
        self,
        *,
        group_id: str | None = None,
        policy: str | None = None,
        rewarded: bool | None = None,
        limit: int = 20,
        after: str | None = None,
    ) -> Page[TrajectorySummary]:
        """One page of trajectories, newest first, filtered by group, policy and reward state."""
        return self._send(_list_trajectories(group_id, policy, rewarded, limit, after))

    def iter_trajectories(
        self,
        *,
        group_id: str | None = None,
        policy: str | None = None,
        rewarded: bool | None = None,
        page_size: int = 20,
        after: str | None = None,
    ) -> Iterator[TrajectorySummary]:
        """Every matching trajectory, fetching pages lazily by following `next_cursor`."""
        return _iterate(
            lambda cursor: self.list_trajectories(
                group_id=group_id, policy=policy, rewarded=rewarded, limit=page_size, after=cursor
            ),
            after,
        )

    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        """One trajectory with its calls and token ids."""
        return self._send(_get_trajectory(trajectory_id))

    def list_groups(
        self,
        *,
        policy: str | None = None,
        state: str | None = None,
        limit: int = 20,
        after: str | None = None,
    ) -> Page[Group]:
        """One page of groups with their size, reward statistics and training state."""
        return self._send(_list_groups(policy, state, limit, after))

    def iter_groups(
        self,
        *,
        policy: str | None = None,
        state: str | None = None,
        page_size: int = 20,
        after: str | None = None,
    ) -> Iterator[Group]:
        """Every matching group, fetching pages lazily by following `next_cursor`."""
        return _iterate(
            lambda cursor: self.list_groups(policy=policy, state=state, limit=page_size, after=cursor), after
        )

    def close(self) -> None:
        """Close the underlying connections."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_BaseClient):
    """Asynchronous twin of `Client`: the same methods, awaited; iterators are async.

    Use it with ``async with``, or call `aclose()`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key)
        self._http = httpx.AsyncClient(base_url=self._root, headers=self._headers, timeout=timeout, transport=transport)

    async def _send(self, operation: _Operation[_T]) -> _T:
        request = self._http.build_request(
            operation.method, operation.path, params=operation.params, json=operation.json
        )
        with translate_transport_errors(request):
            response = await self._http.send(request)
        return operation.read(response)

    async def post_reward(
        self, trajectory_id: str, reward: float, metrics: Mapping[str, float] | None = None
    ) -> Reward:
        """Post the reward of one trajectory; see `Client.post_reward`."""
        return await self._send(_post_reward(trajectory_id, reward, metrics))

    async def post_rewards(self, rewards: Iterable[RewardLike]) -> list[Reward]:
        """Post several rewards in one request; see `Client.post_rewards`."""
        items = [_to_reward_in(r) for r in rewards]
        return await self._send(_post_rewards(items)) if items else []

    async def list_trajectories(
        self,
        *,
        group_id: str | None = None,
        policy: str | None = None,
        rewarded: bool | None = None,
        limit: int = 20,
        after: str | None = None,
    ) -> Page[TrajectorySummary]:
        """One page of trajectories; see `Client.list_trajectories`."""
        return await self._send(_list_trajectories(group_id, policy, rewarded, limit, after))

    def iter_trajectories(
        self,
        *,
        group_id: str | None = None,
        policy: str | None = None,
        rewarded: bool | None = None,
        page_size: int = 20,
        after: str | None = None,
    ) -> AsyncIterator[TrajectorySummary]:
        """Every matching trajectory, for ``async for``; see `Client.iter_trajectories`."""
        return _aiterate(
            lambda cursor: self.list_trajectories(
                group_id=group_id, policy=policy, rewarded=rewarded, limit=page_size, after=cursor
            ),
            after,
        )

    async def get_trajectory(self, trajectory_id: str) -> Trajectory:
        """One trajectory with its calls and token ids."""
        return await self._send(_get_trajectory(trajectory_id))

    async def list_groups(
        self,
        *,
        policy: str | None = None,
        state: str | None = None,
        limit: int = 20,
        after: str | None = None,
    ) -> Page[Group]:
        """One page of groups; see `Client.list_groups`."""
        return await self._send(_list_groups(policy, state, limit, after))

    def iter_groups(
        self,
        *,
        policy: str | None = None,
        state: str | None = None,
        page_size: int = 20,
        after: str | None = None,
    ) -> AsyncIterator[Group]:
        """Every matching group, for ``async for``; see `Client.iter_groups`."""
        return _aiterate(
            lambda cursor: self.list_groups(policy=policy, state=state, limit=page_size, after=cursor), after
        )

    async def aclose(self) -> None:
        """Close the underlying connections."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
