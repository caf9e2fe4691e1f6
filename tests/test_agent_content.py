"""What agents send that the policy cannot use never ends their session, and what they rely on is there.

Images (inside Anthropic ``tool_result``s and messages, inside Responses ``function_call_output``s and inputs),
documents and files reach a model that reads text only as a placeholder it reads and the record keeps
(``tracetrain_core._omitted``), or, for a model that reads images, as the images; tools only OpenAI or
Anthropic host are left out with a note. Also here: a forced tool ends the loop, ``message_start`` counts the
prompt, cached prompt tokens show in each API's usage. The clients are the real SDKs, the Agents SDK, Codex
(with its default configuration) and Claude Code, on the fake vLLM.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from claude_code import claude_env, needs_claude, run_claude
from codex_cli import codex_config, needs_codex, run_codex
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall, serve_in_thread

from tracetrain_cli._serve_command import reads_images
from tracetrain_core import call_messages

# A 1x1 PNG, base64 (67 bytes).
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
PLACEHOLDER = "[image omitted: image/png, 70 B; this model reads text only]"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
FUNCTION = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}


@pytest.fixture
def sdk(proxy: RunningProxy) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) as client:
        yield client


def only_call(proxy: RunningProxy) -> dict[str, Any]:
    calls = [c for t in httpx.get(f"{proxy.v1}/trajectories").json()["data"]
             for c in httpx.get(f"{proxy.v1}/trajectories/{t['id']}").json()["calls"]]  # fmt: skip
    assert len(calls) == 1
    return dict(calls[0])


# ---------------------------------------------------------------- images, documents, files


def test_an_image_in_a_tool_result_reaches_a_text_model_as_a_placeholder(
    proxy: RunningProxy, fake: FakeVLLM, sdk: anthropic.Anthropic
) -> None:
    history: list[Any] = [
        {"role": "user", "content": "What is in shot.png?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]},
    ]  # fmt: skip
    fake.script(Reply("A white pixel."))
    answer = sdk.messages.create(model="agent", max_tokens=64, messages=history)
    assert answer.content[0].text == "A white pixel."  # type: ignore[union-attr]
    assert fake.requests[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": PLACEHOLDER}
    call = only_call(proxy)
    assert call["request"]["messages"] == history  # the record keeps what the agent sent
    assert call_messages("messages", call["request"])[-1]["content"] == PLACEHOLDER  # and every reader the note


def test_responses_images_and_files_in_inputs_and_tool_outputs_become_placeholders(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    image = {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Compare:"}, image,
                                     {"type": "input_file", "filename": "report.pdf",
                                      "file_data": f"data:application/pdf;base64,{PNG}"}]},
        {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "here:"},
                                                                          image]},
    ]  # fmt: skip
    fake.script(Reply("Both white."))
    assert proxy.client().responses.create(model="agent", input=items).output_text == "Both white."
    user, _, tool = fake.requests[-1]["messages"]
    assert user["content"] == f"Compare:\n{PLACEHOLDER}\n[file omitted: report.pdf, 70 B; this model reads text only]"
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": f"here:\n{PLACEHOLDER}"}
    assert call_messages("responses", only_call(proxy)["request"]) == fake.requests[-1]["messages"]


def test_a_model_that_reads_images_gets_them(start_proxy: Callable[..., RunningProxy], fake: FakeVLLM) -> None:
    proxy = start_proxy(reads_images=True)
    fake.script(Reply("A pixel."))
    with anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) as sdk:
        sdk.messages.create(model="agent", max_tokens=64, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}])  # fmt: skip
    assert fake.requests[-1]["messages"][-1]["content"] == [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
    ]


def test_serve_knows_a_model_reads_images_from_its_vision_tower(tmp_path: Path) -> None:
    for name, config, sees in (("vl", {"vision_config": {"depth": 32}, "text_config": {}}, True),
                               ("text", {"hidden_size": 576}, False), ("none", None, False)):  # fmt: skip
        model = tmp_path / name
        model.mkdir()
        if config is not None:
            (model / "config.json").write_text(json.dumps(config))
        assert reads_images(model) is sees, name


@needs_claude
def test_claude_code_reading_a_png_goes_on(proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "shot.png").write_bytes(base64.b64decode(PNG))
    fake.script(Reply(tool_calls=[ToolCall("Read", json.dumps({"file_path": str(work / "shot.png")}))]),
                Reply(content="It is one white pixel."))  # fmt: skip
    env = claude_env(proxy.url, "unused", tmp_path / "home", max_output_tokens=256)
    assert "It is one white pixel." in run_claude("What is in shot.png?", env, work)
    tool_result = fake.requests[-1]["messages"][-1]
    assert tool_result["role"] == "tool" and "[image omitted: image/png" in tool_result["content"]


# ---------------------------------------------------------------- hosted tools


def test_hosted_tools_are_left_out_with_a_note_the_model_reads(proxy: RunningProxy, fake: FakeVLLM) -> None:
    tools = [FUNCTION, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}]
    fake.script(Reply("Sunny."))
    proxy.client().responses.create(model="agent", instructions="Be brief.", input="Weather?", tools=tools)
    sent = fake.requests[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["messages"][0] == {"role": "system", "content": "Be brief.\n\n[tools omitted: web_search, "
                                   "file_search; this server runs function tools only]"}  # fmt: skip


async def test_an_agent_with_a_hosted_tool_runs_on_the_proxy(
    proxy: RunningProxy, fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
    import openai

    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    fake.script(Reply("I cannot search; it is probably sunny."))
    try:
        run = await agents.Runner.run(agents.Agent(name="a", model="agent", tools=[agents.WebSearchTool()]), "Hi")
    finally:
        await client.close()
    assert run.final_output == "I cannot search; it is probably sunny."
    assert "tools" not in fake.requests[-1] and "web_search" in fake.requests[-1]["messages"][0]["content"]


@needs_codex
def test_codex_with_only_its_provider_configured_runs_a_tool_loop(
    proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("the answer is 42\n")
    fake.script(Reply(tool_calls=[ToolCall("exec_command", '{"cmd": "cat note.txt"}')]), Reply(content="It says 42."))
    assert "web_search" not in codex_config(proxy.v1)  # Codex's defaults: its hosted web search and sub-agents on
    out = run_codex("What does note.txt say?", proxy.v1, tmp_path / "home", work)
    assert "It says 42." in out
    [trajectory] = httpx.get(f"{proxy.v1}/trajectories").json()["data"]
    first = httpx.get(f"{proxy.v1}/trajectories/{trajectory['id']}").json()["calls"][0]
    hosted = {t["type"] for t in first["request"]["tools"]} - {"function"}
    assert hosted, "Codex sent tools only OpenAI hosts"
    assert {t["type"] for t in fake.requests[0]["tools"]} == {"function"}, "only function tools reach vLLM"
    assert "[tools omitted: " in fake.requests[0]["messages"][0]["content"]


# ---------------------------------------------------------------- what agents' loops read


FORCED: dict[str, Any] = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_ends_with_tool_use_so_the_loop_goes_on(
    fake: FakeVLLM, sdk: anthropic.Anthropic, stream: bool
) -> None:
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))  # vLLM: finish_reason "stop"
    question = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        with sdk.messages.stream(model="agent", max_tokens=64, messages=question, **FORCED) as events:
            message = events.get_final_message()
    else:
        message = sdk.messages.create(model="agent", max_tokens=64, messages=question, **FORCED)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]


async def test_an_agents_sdk_tool_choice_names_a_tool_and_the_run_goes_on(
    proxy: RunningProxy, fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
    import openai

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agent = agents.Agent(name="w", model="agent", tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="get_weather"))  # fmt: skip
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]), Reply("Sunny in Paris."))
    try:
        run = await agents.Runner.run(agent, "Weather in Paris?")
    finally:
        await client.close()
    assert run.final_output == "Sunny in Paris."
    assert fake.requests[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_message_start_counts_the_prompt(proxy: RunningProxy, fake: FakeVLLM) -> None:
    body = {"model": "agent", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{proxy.url}/v1/messages", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    start = events[0]
    assert start["type"] == "message_start" and events[-1]["type"] == "message_stop"
    prompt = fake.tokenize(fake.render_chat(fake.requests[-1]["messages"]))
    assert start["message"]["usage"]["input_tokens"] == len(prompt) > 0


@pytest.fixture
def caching(start_proxy: Callable[..., RunningProxy]) -> Iterator[tuple[RunningProxy, FakeVLLM]]:
    """vLLM reporting cached prompt tokens (serve passes --enable-prompt-tokens-details)."""
    fake = FakeVLLM(emit_eos=True, enable_prompt_tokens_details=True)
    with serve_in_thread(fake.app) as url:
        yield start_proxy(upstreams=(f"{url}/v1",)), fake


def test_cached_prompt_tokens_show_in_every_apis_usage(caching: tuple[RunningProxy, FakeVLLM]) -> None:
    proxy, _ = caching
    system = "You are a careful assistant. " * 30  # longer than one 32-token block
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    chat = proxy.client().chat.completions.create
    chat(model="agent", messages=messages)  # fills the prefix cache
    usage = chat(model="agent", messages=messages).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached and cached % 32 == 0
    response = proxy.client().responses.create(model="agent", instructions=system, input="Hi")
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == cached
    with anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) as sdk:
        answer = sdk.messages.create(model="agent", max_tokens=64, system=system,
                                     messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert answer.usage.cache_read_input_tokens == cached
    assert answer.usage.input_tokens + cached == usage.prompt_tokens
