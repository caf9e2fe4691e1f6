"""The demo's Agents SDK task: an OpenAI Agents SDK agent with its defaults, through the proxy's /v1/responses.

The agent reads OPENAI_BASE_URL like any app; the SDK's default provider speaks the Responses API, which
the proxy translates to chat for the fake vLLM. An attempt must be one trajectory of calls that merge
into one sample, and the reward service must score it from what the proxy captured (Responses bodies).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import httpx
import openai
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall

from tracetrain import Client
from tracetrain_demo import agents_sdk, reward_service
from tracetrain_demo.lookup import hotel_in, scenarios
from tracetrain_demo.tasks import TASKS
from trainer._samples import CapturedCall, build_samples

agents = pytest.importorskip("agents", reason="openai-agents is in the demo and test extras")


@pytest.fixture
def sdk_env(proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment an Agents SDK app reads."""
    monkeypatch.setenv("OPENAI_BASE_URL", proxy.v1)
    monkeypatch.setenv("OPENAI_API_KEY", "unused")


@pytest.fixture(params=[False], ids=["attempts"])
def rewards_url(proxy: RunningProxy, request: pytest.FixtureRequest) -> Iterator[str]:
    """The reward service scoring the Agents SDK task, on loopback (parametrized: with its --call-rewards)."""
    client = Client(proxy.url)
    handler = type("Handler", (reward_service._Handler,),
                   {"client": client, "task": "agents-sdk", "call_rewards": request.param})  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/finished"
    server.shutdown()
    server.server_close()
    client.close()


def _attempt(scenario: object, trajectory_id: str, group_id: str) -> dict[str, object]:
    """One attempt as the agent program makes it: on a client from the environment, closed after."""

    async def run() -> dict[str, object]:
        async with openai.AsyncOpenAI(max_retries=0) as client:
            attempt = TASKS["agents-sdk"].attempt
            return dict(await attempt(client, "agent", scenario, trajectory_id, group_id, temperature=0.7,
                                      max_tokens=48))  # fmt: skip

    return asyncio.run(run())


def test_an_agents_sdk_attempt_is_one_responses_trajectory_whose_calls_merge_and_is_rewarded(
    proxy: RunningProxy, fake: FakeVLLM, sdk_env: None, rewards_url: str
) -> None:
    scenario = scenarios()[0][0]
    booked = hotel_in(scenario.destination)
    fake.script(Reply(tool_calls=[ToolCall("find_hotel", json.dumps({"city": scenario.destination}))]),
                Reply(content=json.dumps({"hotel": booked})))  # fmt: skip
    episode = _attempt(scenario, "A-0", "A")
    assert (episode["calls"], episode["reply"], episode["tool_cities"]) == (2, json.dumps({"hotel": booked}),
                                                                            [scenario.destination])  # fmt: skip
    assert TASKS["agents-sdk"].score_episode(episode).success

    # What vLLM was sent: the instructions as the system turn, the tool, a first call that must use it.
    first, second = fake.requests
    assert first["messages"] == [{"role": "system", "content": agents_sdk.INSTRUCTIONS},
                                 {"role": "user", "content": scenario.prompt}]  # fmt: skip
    assert first["tools"][0]["function"]["name"] == "find_hotel" and first["tool_choice"] == "required"
    assert second.get("tool_choice") != "required"  # the SDK's reset_tool_choice: the model may answer
    assert second["messages"][-1]["role"] == "tool" and booked in second["messages"][-1]["content"]

    assert httpx.post(rewards_url, json={"trajectory_id": "A-0"}).status_code == 204
    sdk = Client(proxy.url)
    trajectory = sdk.get_trajectory("A-0")
    assert [c.endpoint for c in trajectory.calls] == ["responses", "responses"]
    assert trajectory.group_id == "A" and trajectory.reward == pytest.approx(1.0)
    calls = [CapturedCall(c.prompt_token_ids, c.completion_token_ids, c.logprobs) for c in trajectory.calls]
    samples, stats = build_samples(calls)
    assert (len(samples), stats.merged, stats.mismatched) == (1, 1, 0)  # the second prompt extends the first call
    sdk.close()


@pytest.mark.parametrize("rewards_url", [True], ids=["call-rewards"], indirect=True)
def test_the_reward_service_rewards_each_responses_call_that_looked_up_by_its_city(
    proxy: RunningProxy, fake: FakeVLLM, sdk_env: None, rewards_url: str
) -> None:
    scenario = scenarios()[0][0]
    fake.script(Reply(tool_calls=[ToolCall("find_hotel", json.dumps({"city": scenario.origin}))]),
                Reply(tool_calls=[ToolCall("find_hotel", json.dumps({"city": scenario.destination}))]),
                Reply(content=json.dumps({"hotel": hotel_in(scenario.destination)})))  # fmt: skip
    assert _attempt(scenario, "R-0", "R")["calls"] == 3
    assert httpx.post(rewards_url, json={"trajectory_id": "R-0"}).status_code == 204
    with Client(proxy.url) as sdk:
        trajectory = sdk.get_trajectory("R-0")
    assert [call.reward for call in trajectory.calls] == [0.0, 1.0, None] and trajectory.reward == pytest.approx(1.0)


def test_a_wrong_lookup_earns_partial_credit_from_the_captured_responses(
    proxy: RunningProxy, fake: FakeVLLM, sdk_env: None, rewards_url: str
) -> None:
    scenario = scenarios()[0][0]
    fake.script(Reply(tool_calls=[ToolCall("find_hotel", json.dumps({"city": scenario.origin}))]),
                Reply(content='{"hotel": "Hotel Nowhere"}'))  # fmt: skip
    episode = _attempt(scenario, "W-0", "W")
    assert episode["tool_cities"] == [scenario.origin]
    assert httpx.post(rewards_url, json={"trajectory_id": "W-0"}).status_code == 204
    sdk = Client(proxy.url)
    trajectory = sdk.get_trajectory("W-0")
    assert trajectory.reward == pytest.approx(0.3)  # the tool and valid JSON, not the destination
    assert trajectory.metrics == {"success": 0.0, "called_tool": 1.0, "called_destination": 0.0, "valid_json": 1.0}
    assert trajectory.reward == pytest.approx(TASKS["agents-sdk"].score_episode(episode).reward)
    sdk.close()


def test_an_agent_that_keeps_calling_tools_stops_at_the_turn_limit_with_no_reply(
    proxy: RunningProxy, fake: FakeVLLM, sdk_env: None
) -> None:
    scenario = scenarios()[0][0]
    call = Reply(tool_calls=[ToolCall("find_hotel", json.dumps({"city": scenario.destination}))])
    fake.script(*[call] * agents_sdk.MAX_TURNS)
    episode = _attempt(scenario, "M-0", "M")
    assert (episode["calls"], episode["reply"]) == (agents_sdk.MAX_TURNS, "")
    assert episode["tool_cities"] == [scenario.destination] * agents_sdk.MAX_TURNS
    assert len(fake.requests) == agents_sdk.MAX_TURNS


def test_the_agent_program_runs_a_round_of_sdk_attempts_at_once_and_reports_each(
    proxy: RunningProxy, sdk_env: None, rewards_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracetrain_demo import agent

    assert agent.main(["--task", "agents-sdk", "--questions", "2", "--attempts", "3", "--rounds", "2",
                       "--done-url", rewards_url, "--tag", "s"]) == 0  # fmt: skip
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 12 and all(e["calls"] == 1 for e in printed)  # the fake echoes: no tool call
    sdk = Client(proxy.url)
    trajectories = sdk.list_trajectories(limit=50).data
    assert {t.id for t in trajectories} == {e["trajectory_id"] for e in printed}
    assert all(t.n_calls == 1 and t.reward is not None for t in trajectories)
    assert len({t.group_id for t in trajectories}) == 4  # a group per request per round
    sdk.close()


@pytest.mark.parametrize(
    ("request_input", "output", "reward"),
    [
        # The SDK's own shapes: input items with string content, a function call and its output, a message.
        (
            "items",
            [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ANSWER"}]}],
            1.0,
        ),
        # Content as parts, as other Responses clients send it.
        (
            "parts",
            [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ANSWER"}]}],
            1.0,
        ),
        # A last call that still calls the tool has no reply: credit for the lookups alone.
        ("items", [{"type": "function_call", "name": "find_hotel", "call_id": "c2", "arguments": "{not json"}], 0.3),
    ],
)
def test_the_checker_reads_a_captured_responses_call(request_input: str, output: list[dict[str, object]],
                                                     reward: float) -> None:  # fmt: skip
    scenario = scenarios()[1][3]  # a held-out request: the reward service scores those too
    booked = hotel_in(scenario.destination)
    user = scenario.prompt if request_input == "items" else [{"type": "input_text", "text": scenario.prompt}]
    request = {"instructions": agents_sdk.INSTRUCTIONS, "input": [
        {"role": "user", "content": user},
        {"type": "function_call", "name": "find_hotel", "call_id": "c1",
         "arguments": json.dumps({"city": scenario.destination})},
        {"type": "function_call_output", "call_id": "c1", "output": json.dumps({"hotel": booked})},
    ]}  # fmt: skip
    output = json.loads(json.dumps(output).replace("ANSWER", json.dumps({"hotel": booked}).replace('"', '\\"')))
    assert agents_sdk.score_call(request, {"output": output}).reward == pytest.approx(reward)


def test_a_call_that_is_not_one_of_the_tasks_requests_is_refused() -> None:
    with pytest.raises(ValueError, match="does not start with one of the task's requests"):
        agents_sdk.score_call({"input": "Hello"}, {"output": []})
    with pytest.raises(ValueError, match="does not start with one of the task's requests"):
        agents_sdk.score_call({"input": [{"type": "function_call_output", "call_id": "x", "output": "{}"}]}, None)


def test_the_sdk_agents_calls_reach_vllm_as_the_tool_tasks_agent_sends_them(
    proxy: RunningProxy, fake: FakeVLLM, sdk_env: None
) -> None:
    """What vLLM renders (the tool template) for each call is the same for both agents: the same task for the
    model, whichever agent and API run it (bench/learning.py's judge and TRL's side rely on it)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tracetrain_demo import lookup, lookup_agent

    scenario = scenarios()[1][0]
    replies = (Reply(tool_calls=[ToolCall("find_hotel", json.dumps({"city": scenario.destination}))]),
               Reply(content=json.dumps({"hotel": hotel_in(scenario.destination)})))  # fmt: skip
    fake.script(*replies)
    _attempt(scenario, "S-0", "S")
    fake.script(*replies)
    lookup_agent.attempt(proxy.client(), "agent", scenario, "C-0", "C", temperature=0.7, max_tokens=48)
    sdk_calls, chat_calls = fake.requests[:2], fake.requests[2:]
    template = lookup.TEMPLATE.read_text()

    def prompt(body: dict[str, object]) -> str:
        rendered = render_jinja_template([body["messages"]], tools=body["tools"], chat_template=template,
                                         add_generation_prompt=True)  # fmt: skip
        return str(rendered[0][0])

    for sdk_call, chat_call in zip(sdk_calls, chat_calls, strict=True):
        assert prompt(sdk_call) == prompt(chat_call)
        assert (sdk_call["temperature"], sdk_call["max_tokens"]) == (chat_call["temperature"], chat_call["max_tokens"])
        assert (sdk_call.get("tool_choice") or "auto") == chat_call["tool_choice"]  # vLLM: none named is "auto"
    assert "find_hotel(city: string): The hotel booked for the traveller in a city." in prompt(sdk_calls[0])


def test_each_captured_responses_call_is_rewarded_by_the_city_its_lookup_named() -> None:
    scenario = scenarios()[0][0]
    request = {"instructions": agents_sdk.INSTRUCTIONS, "input": scenario.prompt}

    def lookup(city: str) -> dict[str, object]:
        output = [
            {"type": "function_call", "name": "find_hotel", "call_id": "c", "arguments": json.dumps({"city": city})}
        ]
        return {"output": output}

    assert agents_sdk.call_reward(request, lookup(scenario.destination)) == 1.0
    assert agents_sdk.call_reward(request, lookup(scenario.origin)) == 0.0
    answer = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "{}"}]}]
    assert agents_sdk.call_reward(request, {"output": answer}) is None  # an answer: the trajectory's reward judges it
