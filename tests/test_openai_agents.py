"""The OpenAI Agents SDK with its defaults (``Agent(model="agent")``, ``Runner``: the Responses API) through the proxy.

Configured only by base URL and key (``set_default_openai_client``), and its tracing off
(``OPENAI_AGENTS_DISABLE_TRACING``: it would export traces to OpenAI's servers). A function tool
loop must be one trajectory of token-exact calls, non-streamed (``Runner.run``) and streamed
(``Runner.run_streamed``), on the fake vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall

agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")


@agents.function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture
async def agent(proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[object]:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    yield agents.Agent(name="weather", instructions="Answer briefly.", model="agent", tools=[get_weather])
    await client.close()


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agents_tool_loop_is_one_trajectory_of_token_exact_calls(
    proxy: RunningProxy, fake: FakeVLLM, agent: object, streamed: bool
) -> None:
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]), Reply(content="Sunny in Paris."))
    if streamed:
        run = agents.Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in run.stream_events():
            pass
    else:
        run = await agents.Runner.run(agent, "Weather in Paris?")
    assert run.final_output == "Sunny in Paris."
    [trajectory] = httpx.get(f"{proxy.v1}/trajectories").json()["data"]
    calls = httpx.get(f"{proxy.v1}/trajectories/{trajectory['id']}").json()["calls"]
    assert [(c["endpoint"], c["stream"]) for c in calls] == [("responses", streamed)] * 2
    assert fake.requests[-1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": fake.requests[-1]["messages"][-2]["tool_calls"][0]["id"],
        "content": "sunny in Paris",
    }
    for call, sent in zip(calls, fake.requests[-2:], strict=True):
        assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(sent["messages"], sent["tools"]))
        assert len(call["completion_token_ids"]) == len(call["logprobs"]) > 0
    merged = calls[0]["prompt_token_ids"] + calls[0]["completion_token_ids"]
    assert calls[1]["prompt_token_ids"][: len(merged)] == merged
