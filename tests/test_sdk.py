"""The thin client, against a respx-faked tracetrain server."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pydantic
import pytest
import respx

import tracetrain
from tracetrain import (
    APIConnectionError,
    APIError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    NotFoundError,
    RewardIn,
)

ROOT = "http://tt.test"


@pytest.fixture
def server() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=ROOT, assert_all_called=False) as router:
        yield router


def reward_json(trajectory_id: str, reward: float, **extra: Any) -> dict[str, Any]:
    return {
        "object": "reward",
        "trajectory_id": trajectory_id,
        "group_id": "g-1",
        "reward": reward,
        "metrics": {},
        "source": "external",
        "created_at": 1700000000.0,
        **extra,
    }


def summary_json(trajectory_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "object": "trajectory",
        "id": trajectory_id,
        "group_id": "g-1",
        "policy": "capitals",
        "created_at": 1700000000.0,
        "updated_at": 1700000005.0,
        "n_calls": 1,
        "last_version": 3,
        "reward": None,
        "metrics": {},
        "rewarded_at": None,
        **extra,
    }


def call_json(trajectory_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "object": "call",
        "id": "call-1",
        "trajectory_id": trajectory_id,
        "endpoint": "chat.completions",
        "model": "capitals",
        "served_model": "capitals@3",
        "version": 3,
        "stream": False,
        "request": {"messages": [{"role": "user", "content": "Capital of France?"}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": "Paris"}}]},
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "status_code": 200,
        "error": None,
        "latency_ms": 12.5,
        "ttft_ms": None,
        "started_at": 1700000001.0,
        **extra,
    }


def group_json(group_id: str) -> dict[str, Any]:
    return {
        "object": "group",
        "id": group_id,
        "policy": "capitals",
        "state": "ready",
        "size": 8,
        "n_rewarded": 8,
        "reward_mean": 0.5,
        "reward_std": 0.25,
        "created_at": 1700000000.0,
    }


def page_json(items: list[dict[str, Any]], next_cursor: str | None = None) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": next_cursor is not None, "next_cursor": next_cursor}


def sent_json(route: respx.Route) -> Any:
    return json.loads(route.calls.last.request.content)


# --- URLs and keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("base_url", [ROOT, f"{ROOT}/", f"{ROOT}/v1", f"{ROOT}/v1/"])
def test_base_url_with_or_without_v1_reaches_the_same_endpoints(server: respx.MockRouter, base_url: str) -> None:
    route = server.post("/v1/rewards").respond(json=page_json([reward_json("t-1", 1.0)]))
    with Client(base_url) as client:
        assert client.openai_base_url() == f"{ROOT}/v1"
        client.post_reward("t-1", 1.0)
    assert route.calls.last.request.url == f"{ROOT}/v1/rewards"


def test_openai_base_url_puts_quoted_trajectory_and_group_in_the_path() -> None:
    with Client(ROOT) as client:
        assert client.openai_base_url("traj 1/a") == f"{ROOT}/t/traj%201%2Fa/v1"
        assert client.openai_base_url("traj-1", group_id="task?7") == f"{ROOT}/g/task%3F7/t/traj-1/v1"


def test_openai_base_url_rejects_a_group_without_a_trajectory() -> None:
    with Client(ROOT) as client, pytest.raises(ValueError, match="trajectory_id"):
        client.openai_base_url(group_id="task-7")


def test_base_url_without_scheme_is_rejected() -> None:
    with pytest.raises(ValueError, match="http"):
        Client("127.0.0.1:8100")


def test_trajectory_headers_name_the_trajectory_and_the_group() -> None:
    assert tracetrain.trajectory_headers("traj-1") == {"X-Trajectory-Id": "traj-1"}
    assert tracetrain.trajectory_headers("traj-1", "task-7") == {
        "X-Trajectory-Id": "traj-1",
        "X-Group-Id": "task-7",
    }


def test_new_trajectory_ids_are_unique_and_url_safe() -> None:
    ids = {tracetrain.new_trajectory_id() for _ in range(100)}
    assert len(ids) == 100
    with Client(ROOT) as client:
        for trajectory_id in ids:
            assert client.openai_base_url(trajectory_id) == f"{ROOT}/t/{trajectory_id}/v1"


# --- rewards -------------------------------------------------------------------------------------


def test_post_reward_sends_the_exact_body_with_the_api_key(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards").respond(json=page_json([reward_json("t-1", 0.75, metrics={"json_valid": 1.0})]))
    with Client(ROOT, api_key="sk-reward") as client:
        reward = client.post_reward("t-1", 0.75, metrics={"json_valid": 1.0})

    request = route.calls.last.request
    assert request.headers["Authorization"] == "Bearer sk-reward"
    assert sent_json(route) == {"trajectory_id": "t-1", "reward": 0.75, "metrics": {"json_valid": 1.0}}
    assert reward.trajectory_id == "t-1"
    assert reward.reward == 0.75
    assert reward.metrics == {"json_valid": 1.0}
    assert reward.group_id == "g-1"


def test_post_reward_without_metrics_leaves_them_out(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards").respond(json=page_json([reward_json("t-1", 0.0)]))
    with Client(ROOT) as client:
        client.post_reward("t-1", 0.0)
    assert sent_json(route) == {"trajectory_id": "t-1", "reward": 0.0}
    assert "Authorization" not in route.calls.last.request.headers


async def test_async_post_reward_sends_the_exact_body(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards").respond(json=page_json([reward_json("t-1", 1.0)]))
    async with AsyncClient(f"{ROOT}/v1", api_key="sk-reward") as client:
        reward = await client.post_reward("t-1", 1.0, {"steps": 3.0})
    assert sent_json(route) == {"trajectory_id": "t-1", "reward": 1.0, "metrics": {"steps": 3.0}}
    assert route.calls.last.request.headers["Authorization"] == "Bearer sk-reward"
    assert reward.reward == 1.0


def test_post_rewards_sends_one_batch_from_mixed_inputs(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards").respond(
        json=page_json([reward_json("t-1", 1.0), reward_json("t-2", 0.5), reward_json("t-3", 0.0)])
    )
    with Client(ROOT) as client:
        rewards = client.post_rewards(
            [
                ("t-1", 1.0),
                {"trajectory_id": "t-2", "reward": 0.5, "metrics": {"len": 12.0}},
                RewardIn(trajectory_id="t-3", reward=0.0),
            ]
        )
    assert route.call_count == 1
    assert sent_json(route) == {
        "rewards": [
            {"trajectory_id": "t-1", "reward": 1.0},
            {"trajectory_id": "t-2", "reward": 0.5, "metrics": {"len": 12.0}},
            {"trajectory_id": "t-3", "reward": 0.0},
        ]
    }
    assert [r.trajectory_id for r in rewards] == ["t-1", "t-2", "t-3"]


async def test_async_post_rewards_sends_one_batch(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards").respond(json=page_json([reward_json("t-1", 1.0), reward_json("t-2", 0.0)]))
    async with AsyncClient(ROOT) as client:
        rewards = await client.post_rewards([("t-1", 1.0), ("t-2", 0.0)])
    assert route.call_count == 1
    assert sent_json(route) == {
        "rewards": [{"trajectory_id": "t-1", "reward": 1.0}, {"trajectory_id": "t-2", "reward": 0.0}]
    }
    assert [r.reward for r in rewards] == [1.0, 0.0]


def test_post_rewards_with_nothing_sends_nothing(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards")
    with Client(ROOT) as client:
        assert client.post_rewards([]) == []
    assert not route.called


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_rejected_before_sending(server: respx.MockRouter, bad: float) -> None:
    route = server.post("/v1/rewards")
    with Client(ROOT) as client:
        with pytest.raises(ValueError, match="finite"):
            client.post_reward("t-1", bad)
        with pytest.raises(ValueError, match="finite"):
            client.post_reward("t-1", 1.0, metrics={"score": bad})
        with pytest.raises(ValueError, match="finite"):
            client.post_rewards([("t-1", 1.0), ("t-2", bad)])
    assert not route.called


async def test_async_non_finite_reward_is_rejected_before_sending(server: respx.MockRouter) -> None:
    route = server.post("/v1/rewards")
    async with AsyncClient(ROOT) as client:
        with pytest.raises(ValueError, match="finite"):
            await client.post_reward("t-1", math.nan)
        with pytest.raises(ValueError, match="finite"):
            await client.post_rewards([{"trajectory_id": "t-1", "reward": math.inf}])
    assert not route.called


# --- errors --------------------------------------------------------------------------------------


def openai_error(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": "trajectory_id", "code": code}}


def test_unknown_trajectory_raises_not_found_with_the_server_message(server: respx.MockRouter) -> None:
    server.post("/v1/rewards").respond(
        404, json=openai_error("trajectory 't-9' not found", "not_found_error", "trajectory_not_found")
    )
    with Client(ROOT) as client, pytest.raises(NotFoundError) as caught:
        client.post_reward("t-9", 1.0)
    error = caught.value
    assert error.status_code == 404
    assert error.message == "trajectory 't-9' not found"
    assert error.type == "not_found_error"
    assert error.param == "trajectory_id"
    assert error.code == "trajectory_not_found"
    assert "trajectory 't-9' not found" in str(error)


async def test_async_unknown_trajectory_raises_not_found(server: respx.MockRouter) -> None:
    server.get("/v1/trajectories/t-9").respond(404, json=openai_error("no such trajectory", "not_found_error"))
    async with AsyncClient(ROOT) as client:
        with pytest.raises(NotFoundError, match="no such trajectory") as caught:
            await client.get_trajectory("t-9")
    assert caught.value.status_code == 404


@pytest.mark.parametrize(
    ("status", "error_class"),
    [(400, BadRequestError), (422, BadRequestError), (401, AuthenticationError), (403, AuthenticationError)],
)
def test_error_status_picks_the_error_class(server: respx.MockRouter, status: int, error_class: type[APIError]) -> None:
    server.get("/v1/groups").respond(status, json=openai_error("nope", "invalid_request_error"))
    with Client(ROOT) as client, pytest.raises(error_class) as caught:
        client.list_groups()
    assert caught.value.status_code == status
    assert caught.value.message == "nope"


def test_error_body_that_is_not_json_is_kept_as_the_message(server: respx.MockRouter) -> None:
    server.get("/v1/groups").respond(502, text="bad gateway from the load balancer")
    with Client(ROOT) as client, pytest.raises(APIError) as caught:
        client.list_groups()
    assert type(caught.value) is APIError
    assert caught.value.status_code == 502
    assert caught.value.message == "bad gateway from the load balancer"
    assert caught.value.type is None


def test_malformed_success_body_raises_api_error(server: respx.MockRouter) -> None:
    server.get("/v1/groups").respond(200, json={"object": "list", "data": [{"id": "g-1"}]})
    with Client(ROOT) as client, pytest.raises(APIError, match="unreadable response") as caught:
        client.list_groups()
    assert isinstance(caught.value.__cause__, pydantic.ValidationError)


def test_connection_error_raises_api_connection_error(server: respx.MockRouter) -> None:
    server.post("/v1/rewards").mock(side_effect=httpx.ConnectError("connection refused"))
    with Client(ROOT) as client, pytest.raises(APIConnectionError, match="/v1/rewards") as caught:
        client.post_reward("t-1", 1.0)
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert isinstance(caught.value, tracetrain.TracetrainError)


async def test_async_timeout_raises_api_connection_error(server: respx.MockRouter) -> None:
    server.get("/v1/trajectories").mock(side_effect=httpx.ReadTimeout("timed out"))
    async with AsyncClient(ROOT) as client:
        with pytest.raises(APIConnectionError) as caught:
            await client.list_trajectories()
    assert isinstance(caught.value.__cause__, httpx.ReadTimeout)


# --- trajectories and groups ---------------------------------------------------------------------


def test_list_trajectories_sends_only_the_filters_given(server: respx.MockRouter) -> None:
    route = server.get("/v1/trajectories").respond(json=page_json([summary_json("t-1")], "cur-1"))
    with Client(ROOT) as client:
        page = client.list_trajectories(group_id="g-1", rewarded=False, limit=5)
    assert dict(route.calls.last.request.url.params) == {"group_id": "g-1", "rewarded": "false", "limit": "5"}
    assert [t.id for t in page.data] == ["t-1"]
    assert page.has_more is True
    assert page.next_cursor == "cur-1"


def fake_pages(server: respx.MockRouter, path: str, pages: dict[str | None, dict[str, Any]]) -> respx.Route:
    unserved = dict(pages)

    def answer(request: httpx.Request) -> httpx.Response:
        # Each page is served once: a client that loses the cursor fails instead of looping.
        return httpx.Response(200, json=unserved.pop(request.url.params.get("after")))

    return server.get(path).mock(side_effect=answer)


def test_iter_trajectories_follows_cursors_and_keeps_the_filters(server: respx.MockRouter) -> None:
    route = fake_pages(
        server,
        "/v1/trajectories",
        {
            None: page_json([summary_json("t-1"), summary_json("t-2")], "cur-a"),
            "cur-a": page_json([summary_json("t-3")], "cur-b"),
            "cur-b": page_json([summary_json("t-4")]),
        },
    )
    with Client(ROOT) as client:
        ids = [t.id for t in client.iter_trajectories(policy="capitals", rewarded=True, page_size=2)]
    assert ids == ["t-1", "t-2", "t-3", "t-4"]
    sent = [dict(call.request.url.params) for call in route.calls]
    assert sent == [
        {"policy": "capitals", "rewarded": "true", "limit": "2"},
        {"policy": "capitals", "rewarded": "true", "limit": "2", "after": "cur-a"},
        {"policy": "capitals", "rewarded": "true", "limit": "2", "after": "cur-b"},
    ]


async def test_async_iter_trajectories_follows_cursors(server: respx.MockRouter) -> None:
    route = fake_pages(
        server,
        "/v1/trajectories",
        {None: page_json([summary_json("t-1")], "cur-a"), "cur-a": page_json([summary_json("t-2")])},
    )
    async with AsyncClient(ROOT) as client:
        ids = [t.id async for t in client.iter_trajectories(group_id="g-1")]
    assert ids == ["t-1", "t-2"]
    assert route.call_count == 2
    assert route.calls.last.request.url.params["group_id"] == "g-1"


def test_iter_groups_follows_cursors(server: respx.MockRouter) -> None:
    fake_pages(
        server,
        "/v1/groups",
        {None: page_json([group_json("g-1")], "cur-a"), "cur-a": page_json([group_json("g-2")])},
    )
    with Client(ROOT) as client:
        groups = list(client.iter_groups(state="ready"))
    assert [g.id for g in groups] == ["g-1", "g-2"]
    assert groups[0].reward_std == 0.25


async def test_async_list_groups_sends_filters_and_parses_groups(server: respx.MockRouter) -> None:
    route = server.get("/v1/groups").respond(json=page_json([group_json("g-1")]))
    async with AsyncClient(ROOT) as client:
        page = await client.list_groups(policy="capitals", state="ready", limit=50, after="cur-x")
    assert dict(route.calls.last.request.url.params) == {
        "policy": "capitals",
        "state": "ready",
        "limit": "50",
        "after": "cur-x",
    }
    assert page.data[0].state == "ready"
    assert page.has_more is False


def test_get_trajectory_quotes_the_id_and_parses_calls(server: respx.MockRouter) -> None:
    route = server.get(url__startswith=f"{ROOT}/v1/trajectories/").respond(
        json={**summary_json("a/b c"), "calls": [call_json("a/b c")]}
    )
    with Client(ROOT) as client:
        trajectory = client.get_trajectory("a/b c")
    assert route.calls.last.request.url.raw_path == b"/v1/trajectories/a%2Fb%20c"
    assert trajectory.id == "a/b c"
    call = trajectory.calls[0]
    assert call.prompt_token_ids == [1, 2, 3]
    assert call.completion_token_ids == [4, 5]
    assert call.logprobs == [-0.5, -0.25]
    assert call.served_model == "capitals@3"


def test_unknown_fields_from_a_newer_server_are_kept(server: respx.MockRouter) -> None:
    server.get("/v1/trajectories/t-1").respond(
        json={
            **summary_json("t-1", tags=["eval"]),
            "calls": [call_json("t-1", endpoint="responses", cached_tokens=7)],
        }
    )
    with Client(ROOT) as client:
        trajectory = client.get_trajectory("t-1")
    assert trajectory.model_extra == {"tags": ["eval"]}
    assert trajectory.calls[0].model_extra == {"cached_tokens": 7}
    assert trajectory.calls[0].endpoint == "responses"


def test_response_models_are_frozen(server: respx.MockRouter) -> None:
    server.get("/v1/trajectories/t-1").respond(json=summary_json("t-1"))
    with Client(ROOT) as client:
        trajectory = client.get_trajectory("t-1")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        trajectory.reward = 1.0  # type: ignore[misc]


def test_client_accepts_a_custom_transport() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=page_json([group_json("g-1")]))

    with Client(ROOT, api_key="k", transport=httpx.MockTransport(handler)) as client:
        page = client.list_groups()
    assert [g.id for g in page.data] == ["g-1"]
    assert seen[0].headers["Authorization"] == "Bearer k"
