"""A prompt over vLLM's context, in each API's words, so that agents recognise it (and compact their history).

vLLM 0.32 refuses such a prompt with a 400 whose message begins "This model's maximum context length is"
(``tests/data/vllm_protocol/apis_error_context_length.json``; the fake says it in the same words). Clients
look for OpenAI's ``code: "context_length_exceeded"`` (Codex, the Agents SDK, the openai SDK's users) and for
Anthropic's "prompt is too long: N tokens > M maximum" (Claude Code).
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from claude_code import claude_env, needs_claude, run_claude
from codex_cli import needs_codex, run_codex
from conftest import RunningProxy
from fake_vllm import FakeVLLM

LIMIT = 64
LONG = "Tell me everything about Paris, its history, its streets and its people. " * 20


@pytest.fixture
def small(fake: FakeVLLM) -> FakeVLLM:
    fake.max_model_len = LIMIT
    return fake


def refused_call(proxy: RunningProxy, trajectory: str) -> dict:
    [call] = httpx.get(f"{proxy.v1}/trajectories/{trajectory}").json()["calls"]
    return dict(call)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_completions_answer_openais_context_length_exceeded(
    proxy: RunningProxy, small: FakeVLLM, stream: bool
) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": f"t-chat-{stream}"})
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="agent", messages=[{"role": "user", "content": LONG}], stream=stream)
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "messages")
    assert raised.value.body["message"].startswith(f"This model's maximum context length is {LIMIT} tokens.")  # type: ignore[index]
    assert (refused_call(proxy, f"t-chat-{stream}")["status_code"]) == 400
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="agent", prompt=LONG, stream=stream)
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "prompt")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_answer_openais_context_length_exceeded_on_its_input(
    proxy: RunningProxy, small: FakeVLLM, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        proxy.client().responses.create(model="agent", input=LONG, stream=stream)
    assert (raised.value.code, raised.value.param, raised.value.type) == (
        "context_length_exceeded", "input", "invalid_request_error")  # fmt: skip


async def test_the_agents_sdk_raises_the_code_it_can_compact_on(
    proxy: RunningProxy, small: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    try:
        with pytest.raises(openai.BadRequestError) as raised:
            await agents.Runner.run(agents.Agent(name="a", instructions="Answer.", model="agent"), LONG)
    finally:
        await client.close()
    assert raised.value.code == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_answer_anthropics_prompt_is_too_long(proxy: RunningProxy, small: FakeVLLM, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": LONG}]
    with client, pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="agent", max_tokens=16, stream=stream, messages=messages)
    assert raised.value.body == {
        "type": "error",
        "error": {  # type: ignore[comparison-overlap]
            "type": "invalid_request_error",
            "message": f"prompt is too long: {LIMIT + 1} tokens > {LIMIT} maximum",
        },
    }


@needs_codex
def test_codex_knows_its_context_window_is_full(proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path) -> None:
    fake.max_model_len = 2000  # Codex's own prompt is longer
    (tmp_path / "work").mkdir()
    out = run_codex("Say hi.", proxy.v1, tmp_path / "home", tmp_path / "work", check=False, timeout_s=120)
    assert "ran out of room in the model's context window" in out, out[-2000:]
    assert len(fake.requests) == 1  # recognised: not retried as a server error


@needs_claude
def test_claude_code_knows_its_prompt_is_too_long(proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path) -> None:
    fake.max_model_len = 2000  # Claude Code's system prompt and tools are longer
    (tmp_path / "work").mkdir()
    env = claude_env(proxy.url, "unused", tmp_path / "home", max_output_tokens=256)
    out = run_claude("Say hi.", env, tmp_path / "work", expect_failure=True)
    assert "Prompt is too long" in out and f"limit {2000}" in out, out[-2000:]
