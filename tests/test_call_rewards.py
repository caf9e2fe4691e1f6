"""A call's reward: every answer names its call (``X-Call-Id``), and ``POST /v1/rewards`` rewards one call.

A real proxy over loopback HTTP, the fake vLLM as its upstream, the real OpenAI and Anthropic clients as the
agent, the SDK as the reward service.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

import tracetrain

TASK = [{"role": "user", "content": "Capital of France?"}]


def trajectory(proxy: RunningProxy, trajectory_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}").json())


def test_every_api_streamed_or_not_names_the_recorded_call_in_x_call_id(proxy: RunningProxy) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "t-apis"})
    named = [
        client.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers["X-Call-Id"],
        client.completions.with_raw_response.create(model="agent", prompt="Paris is").headers["X-Call-Id"],
        client.responses.with_raw_response.create(model="agent", input="Capital of France?").headers["X-Call-Id"],
    ]
    with client.chat.completions.with_streaming_response.create(model="agent", messages=TASK, stream=True) as s:
        named.append(s.headers["X-Call-Id"])
        s.read()
    with client.responses.with_streaming_response.create(model="agent", input="Count.", stream=True) as s:
        named.append(s.headers["X-Call-Id"])
        s.read()
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0,
                                 default_headers={"X-Trajectory-Id": "t-apis"})  # fmt: skip
    message = claude.messages.with_raw_response.create(model="agent", max_tokens=32, messages=TASK)  # type: ignore[arg-type]
    named.append(message.headers["X-Call-Id"])
    with claude.messages.with_streaming_response.create(model="agent", max_tokens=32, messages=TASK, stream=True) as s:  # type: ignore[arg-type]
        named.append(s.headers["X-Call-Id"])
        s.read()

    recorded = [c["id"] for c in trajectory(proxy, "t-apis")["calls"]]
    assert recorded == named and len(set(named)) == 7


def test_a_reward_with_call_id_is_that_calls_and_leaves_the_trajectory_unrewarded(proxy: RunningProxy) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "t1"})
    first = client.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers["X-Call-Id"]
    second = client.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers["X-Call-Id"]

    posted = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t1", "call_id": second, "reward": 0.25})

    assert posted.status_code == 200 and posted.json()["data"][0]["call_id"] == second
    t = trajectory(proxy, "t1")
    assert [(c["id"], c["reward"]) for c in t["calls"]] == [(first, None), (second, 0.25)]
    assert t["reward"] is None and t["rewarded_at"] is None  # a call's reward does not complete its trajectory
    # The batch form, beside the whole trajectory's reward; the latest reward of a call wins.
    batch = {"rewards": [{"trajectory_id": "t1", "call_id": first, "reward": -1.0},
                         {"trajectory_id": "t1", "call_id": second, "reward": 0.5},
                         {"trajectory_id": "t1", "reward": 1.0}]}  # fmt: skip
    httpx.post(f"{proxy.v1}/rewards", json=batch).raise_for_status()
    t = trajectory(proxy, "t1")
    assert [c["reward"] for c in t["calls"]] == [-1.0, 0.5] and t["reward"] == 1.0
    assert [(r["call_id"], r["reward"]) for r in t["rewards"]] == [
        (second, 0.25), (first, -1.0), (second, 0.5), (None, 1.0)
    ]  # fmt: skip


def test_a_call_of_another_trajectory_or_none_is_a_404_and_nothing_is_recorded(proxy: RunningProxy) -> None:
    theirs = (
        proxy.client(default_headers={"X-Trajectory-Id": "t-other"})
        .chat.completions.with_raw_response.create(model="agent", messages=TASK)
        .headers["X-Call-Id"]
    )
    proxy.client(default_headers={"X-Trajectory-Id": "t-mine"}).chat.completions.create(model="agent", messages=TASK)

    for call_id in (theirs, "call-unknown"):
        batch = {"rewards": [{"trajectory_id": "t-mine", "reward": 1.0},
                             {"trajectory_id": "t-mine", "call_id": call_id, "reward": 1.0}]}  # fmt: skip
        refused = httpx.post(f"{proxy.v1}/rewards", json=batch)
        assert refused.status_code == 404, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("call_not_found", "call_id") and call_id in error["message"]
    bad = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t-mine", "call_id": "a b", "reward": 1.0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "call_id"
    assert trajectory(proxy, "t-mine")["rewards"] == [] and trajectory(proxy, "t-mine")["reward"] is None
    assert [c["reward"] for c in trajectory(proxy, "t-other")["calls"]] == [None]


async def test_the_sdk_rewards_one_call_sync_and_async(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Paris"), Reply(content="Lyon"))
    ids = [tracetrain.new_trajectory_id() for _ in range(2)]
    calls = []
    for trajectory_id in ids:
        agent = proxy.client(default_headers=tracetrain.trajectory_headers(trajectory_id))
        calls.append(agent.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers["X-Call-Id"])

    with tracetrain.Client(proxy.url) as tt:
        reward = tt.post_reward(ids[0], 1.0, call_id=calls[0])
        assert (reward.call_id, reward.reward) == (calls[0], 1.0)
        assert [c.reward for c in tt.get_trajectory(ids[0]).calls] == [1.0]
        try:
            tt.post_reward(ids[0], 1.0, call_id=calls[1])
        except tracetrain.NotFoundError as exc:
            assert calls[1] in str(exc)
        else:
            raise AssertionError("another trajectory's call was rewarded")
    async with tracetrain.AsyncClient(proxy.url) as att:
        reward = await att.post_reward(ids[1], 0.0, call_id=calls[1])
        assert reward.call_id == calls[1]
        assert [c.reward for c in (await att.get_trajectory(ids[1])).calls] == [0.0]
        [batched] = await att.post_rewards([{"trajectory_id": ids[1], "call_id": calls[1], "reward": 0.5}])
        assert batched.call_id == calls[1] and (await att.get_trajectory(ids[1])).calls[0].reward == 0.5


def test_the_trajectory_page_shows_each_calls_reward(proxy: RunningProxy) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "t-page"})
    call_id = client.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers["X-Call-Id"]
    client.chat.completions.create(model="agent", messages=TASK)
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t-page", "call_id": call_id, "reward": 0.75})

    page = httpx.get(f"{proxy.url}/admin/ui/trajectories/t-page").text

    assert page.count('class="call-reward"') == 1 and "reward 0.750" in page
    assert f'<section class="call" id="{call_id}">' in page and f'<span class="mono">{call_id}</span>' in page
