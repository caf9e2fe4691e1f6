"""`Client` and `AsyncClient` for the tracetrain proxy's reward and trajectory API.

Each API call is an `_Operation` (`_operations.py`) that says what to send and how to
read the answer; the two clients differ only in how they send it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Self, TypeVar

import httpx

from ._errors import translate_transport_errors
from ._models import Group, Page, Reward, Trajectory, TrajectorySummary
from ._operations import (
    GROUP_HEADER,
    TRAJECTORY_HEADER,
    RewardLike,
    _aiterate,
    _get_trajectory,
    _iterate,
    _list_groups,
    _list_trajectories,
    _Operation,
    _post_reward,
    _post_rewards,
    _root_url,
    _segment,
    _to_reward_in,
    new_trajectory_id,
    trajectory_headers,
)

_T = TypeVar("_T")

__all__ = ["GROUP_HEADER", "TRAJECTORY_HEADER", "AsyncClient", "Client", "RewardLike", "new_trajectory_id",
           "trajectory_headers"]


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

    def post_reward(
        self,
        trajectory_id: str,
        reward: float | None = None,
        metrics: Mapping[str, float] | None = None,
        *,
        call_id: str | None = None,
    ) -> Reward:
        """Post the reward of one trajectory, or of one of its calls (`call_id`: the `X-Call-Id` header of the
        call's response); raises `NotFoundError` if the server does not know the trajectory, or the call is not
        the trajectory's. Without `reward`, the server weighs `metrics` into one (`--reward-weights`).

        >>> raw = openai_client.chat.completions.with_raw_response.create(...)  # doctest: +SKIP
        >>> tt.post_reward(raw.headers["X-Trajectory-Id"], 1.0, call_id=raw.headers["X-Call-Id"])  # doctest: +SKIP
        """
        return self._send(_post_reward(trajectory_id, reward, metrics, call_id))

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
        self,
        trajectory_id: str,
        reward: float | None = None,
        metrics: Mapping[str, float] | None = None,
        *,
        call_id: str | None = None,
    ) -> Reward:
        """Post the reward of one trajectory, or of one of its calls; see `Client.post_reward`."""
        return await self._send(_post_reward(trajectory_id, reward, metrics, call_id))

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
