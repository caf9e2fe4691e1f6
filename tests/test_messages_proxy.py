"""Anthropic's Messages API (``/v1/messages``) through the real anthropic SDK, against the fake vLLM.

Each call goes to vLLM as a chat completion (proxy.gateway.dialects.messages._dialect): these tests check what the
SDK reads back, that the record is token-exact (the prompt ids are the chat template's rendering
of the translated messages), the tool loop's threading and ids, ``count_tokens``, the beta
surface Claude Code uses, and errors as the SDK's own exceptions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from claude_code import claude_env, needs_claude, run_claude
from conftest import RunningProxy
from dialect_calls import SERVED
from fake_vllm import EOS_TOKEN_ID, FakeVLLM, Reply, ToolCall

from proxy.gateway.dialects.messages._dialect import MESSAGES
from tracetrain_core import anthropic_chat_messages

SYSTEM = "Answer in one sentence."
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
KEY = "sk-tracetrain-test-key-0123456789"


def stored_calls(proxy: RunningProxy, trajectory_id: str, key: str = "") -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    calls: list[dict[str, Any]] = httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}", headers=headers).json()["calls"]
    return calls


Client = Callable[..., anthropic.Anthropic]


@pytest.fixture
def client() -> Iterator[Client]:
    """The real SDK configured only by base URL and key, as a user would; closed after the test."""
    made: list[anthropic.Anthropic] = []

    def make(proxy: RunningProxy, api_key: str = "unused") -> anthropic.Anthropic:
        made.append(anthropic.Anthropic(base_url=proxy.url, api_key=api_key, max_retries=0))
        return made[-1]

    yield make
    for sdk in made:
        sdk.close()


def rendered(fake: FakeVLLM, body: dict[str, Any]) -> list[int]:
    """The ids the fake vLLM's template renders a Messages body's translation into."""
    chat = MESSAGES.to_chat(body, SERVED)
    return fake.tokenize(fake.render_chat(chat["messages"], chat.get("tools")))


def test_a_message_is_answered_and_recorded_token_exact(client: Client, proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Paris is the capital."))
    raw = client(proxy).messages.with_raw_response.create(
        model="agent", max_tokens=64, system=SYSTEM, messages=QUESTION, metadata={"user_id": "u-1"}
    )
    message = raw.parse()
    assert message.content[0].type == "text" and message.content[0].text == "Paris is the capital."
    assert (message.model, message.stop_reason, message.role) == ("agent@0", "end_turn", "assistant")
    assert message.id.startswith("msg_")
    sent = {"model": "agent", "max_tokens": 64, "system": SYSTEM, "messages": QUESTION, "metadata": {"user_id": "u-1"}}
    assert fake.requests[-1]["messages"] == [{"role": "system", "content": SYSTEM}, *QUESTION]
    assert "metadata" not in fake.requests[-1]
    [call] = stored_calls(proxy, raw.headers["x-trajectory-id"])
    assert call["endpoint"] == "messages" and call["request"] == sent
    assert call["response"] == message.to_dict()
    assert call["prompt_token_ids"] == rendered(fake, sent)
    assert call["completion_token_ids"] == [*fake.tokenize("Paris is the capital."), EOS_TOKEN_ID]
    assert len(call["logprobs"]) == len(call["completion_token_ids"])
    assert message.usage.input_tokens == len(call["prompt_token_ids"])
    assert message.usage.output_tokens == len(call["completion_token_ids"])


def test_a_streamed_message_arrives_as_events_and_is_recorded_as_the_sdk_assembled_it(
    client: Client, proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content="Paris, of course."))
    with client(proxy).messages.stream(model="agent", max_tokens=64, messages=QUESTION) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
        trajectory_id = stream.response.headers["x-trajectory-id"]
    assert "".join(pieces) == "Paris, of course." and len(pieces) > 1  # token by token, not one buffered block
    [call] = stored_calls(proxy, trajectory_id)
    assert call["stream"] is True and call["status_code"] == 200
    assert call["response"] == {k: v for k, v in final.to_dict().items() if k != "stop_details"}
    assert call["prompt_token_ids"] == rendered(fake, {"model": "agent", "max_tokens": 64, "messages": QUESTION})
    assert call["completion_token_ids"] == [*fake.tokenize("Paris, of course."), EOS_TOKEN_ID]
    assert final.usage.input_tokens == len(call["prompt_token_ids"])


def test_a_stream_is_forwarded_before_upstream_finishes(client: Client, proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.2
    fake.script(Reply(content="one two three four five six"))
    started = time.perf_counter()
    arrivals = []
    for event in client(proxy).messages.create(model="agent", max_tokens=64, messages=QUESTION, stream=True):
        if event.type == "content_block_delta":
            arrivals.append(time.perf_counter() - started)
    total = time.perf_counter() - started
    assert len(arrivals) >= 6
    assert arrivals[0] < total - 0.8, f"first delta at {arrivals[0]:.2f}s of {total:.2f}s: the proxy buffered"


def test_keying_prefixes_headers_and_pins_work_as_for_chat(client: Client, proxy: RunningProxy) -> None:
    prefixed = anthropic.Anthropic(base_url=f"{proxy.url}/g/grp-m/t/traj-m", api_key="unused", max_retries=0)
    try:
        raw = prefixed.messages.with_raw_response.create(model="agent@0", max_tokens=16, messages=QUESTION)
    finally:
        prefixed.close()
    assert (raw.headers["x-trajectory-id"], raw.headers["x-group-id"]) == ("traj-m", "grp-m")
    assert raw.headers["x-policy-version"] == "0" and raw.parse().model == "agent@0"
    raw = client(proxy).messages.with_raw_response.create(
        model="agent",
        max_tokens=16,
        messages=QUESTION,
        extra_headers={"X-Trajectory-Id": "traj-h", "X-Group-Id": "grp-h"},
    )
    assert (raw.headers["x-trajectory-id"], raw.headers["x-group-id"]) == ("traj-h", "grp-h")
    with pytest.raises(anthropic.NotFoundError):
        client(proxy).messages.create(model="agent@7", max_tokens=16, messages=QUESTION)  # no such version
    assert [c["endpoint"] for c in stored_calls(proxy, "traj-m") + stored_calls(proxy, "traj-h")] == ["messages"] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_round_trips_the_tool_use_id_and_stays_one_trajectory(
    client: Client, proxy: RunningProxy, fake: FakeVLLM, stream: bool
) -> None:
    fake.script(
        Reply(content="", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}', id="chatcmpl-tool-7f3a")]),
        Reply(content="It is 18 C in Paris."),
    )
    sdk = client(proxy)

    def ask(messages: list[Any]) -> anthropic.types.Message:
        if stream:
            with sdk.messages.stream(model="agent", max_tokens=64, tools=[WEATHER], messages=messages) as events:
                return events.get_final_message()
        return sdk.messages.create(model="agent", max_tokens=64, tools=[WEATHER], messages=messages)

    first = ask(QUESTION)
    [use] = first.content
    assert use.type == "tool_use" and use.id == "toolu_7f3a" and use.input == {"city": "Paris"}
    assert first.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}
    loop = [*QUESTION, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = ask(loop)
    assert second.content[0].type == "text" and second.content[0].text == "It is 18 C in Paris."
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert fake.requests[-1]["messages"][-2:] == [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "toolu_7f3a", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "toolu_7f3a", "content": "18 C"},
    ]  # fmt: skip
    rows = proxy.rows("SELECT trajectory_id, prompt_token_ids, completion_token_ids FROM calls ORDER BY started_at")
    assert len(rows) == 2 and rows[0]["trajectory_id"] == rows[1]["trajectory_id"]  # threaded, unkeyed
    calls = stored_calls(proxy, rows[0]["trajectory_id"])
    # The second prompt extends the first prompt and its completion: the samples merge for training.
    assert calls[1]["prompt_token_ids"][
        : len(calls[0]["prompt_token_ids"]) + len(calls[0]["completion_token_ids"])
    ] == (calls[0]["prompt_token_ids"] + calls[0]["completion_token_ids"])


def test_count_tokens_is_the_prompt_length_the_call_records(
    client: Client, proxy: RunningProxy, fake: FakeVLLM
) -> None:
    sdk = client(proxy)
    counted = sdk.messages.count_tokens(model="agent", system=SYSTEM, messages=QUESTION, tools=[WEATHER])
    raw = sdk.messages.with_raw_response.create(model="agent", max_tokens=8, system=SYSTEM, messages=QUESTION,
                                                tools=[WEATHER])  # fmt: skip
    [call] = stored_calls(proxy, raw.headers["x-trajectory-id"])
    assert counted.input_tokens == len(call["prompt_token_ids"]) == raw.parse().usage.input_tokens


def test_the_beta_surface_claude_code_uses_does_not_break_a_call(
    client: Client, proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content="Fine."))
    message = client(proxy).beta.messages.create(  # POST /v1/messages?beta=true with an anthropic-beta header
        model="agent", max_tokens=64, messages=QUESTION, betas=["interleaved-thinking-2025-05-14"],
        thinking={"type": "enabled", "budget_tokens": 1024}, context_management={"edits": []},
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
    )  # fmt: skip
    assert message.content[0].type == "text" and message.content[0].text == "Fine."
    assert fake.requests[-1]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert not {"thinking", "context_management", "betas"} & set(fake.requests[-1])


def test_the_sdk_key_header_is_accepted_as_an_inference_key(client: Client, start_proxy: Any) -> None:
    proxy = start_proxy(api_keys=KEY)
    message = client(proxy, api_key=KEY).messages.create(model="agent", max_tokens=16, messages=QUESTION)
    assert message.type == "message"
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(proxy, api_key="sk-wrong-but-long-enough-0123456789").messages.create(
            model="agent", max_tokens=16, messages=QUESTION
        )
    assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    counted = client(proxy, api_key=KEY).messages.count_tokens(model="agent", messages=QUESTION)
    assert counted.input_tokens > 0


@pytest.mark.parametrize(
    ("fields", "error", "says"),
    [
        ({"model": "no-such-model"}, anthropic.NotFoundError, "no-such-model"),
        ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
    ],
)  # fmt: skip
def test_bad_calls_raise_the_sdks_own_errors(
    client: Client, proxy: RunningProxy, fields: dict[str, Any], error: type[anthropic.APIStatusError], says: str
) -> None:
    with pytest.raises(error) as raised:
        client(proxy).messages.create(**{"model": "agent", "max_tokens": 16, "messages": QUESTION, **fields})
    assert raised.value.body["type"] == "error" and says in raised.value.body["error"]["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/messages", b'{"model": "agent", "messages": [{"role": "user", "content": "Hi"}]}', "max_tokens"),
        (
            "/v1/messages",
            b'{"model": "agent", "max_tokens": "x", "messages": [{"role": "user", "content": "Hi"}]}',
            "max_tokens",
        ),
        ("/v1/messages", b'{"model": 7, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}', "model"),
        ("/v1/messages", b"not json", "not valid JSON"),
        ("/v1/messages/count_tokens", b"[1, 2]", "JSON object"),
        ("/v1/messages/count_tokens", b'{"model": "agent", "messages": [{"role": "user", "content": 5}]}', "content"),
        ("/t/bad id/v1/messages", b'{"model": "agent", "max_tokens": 8, "messages": []}', "trajectory id"),
    ],
)
def test_bodies_the_sdk_would_not_send_get_a_400_in_anthropics_shape(
    proxy: RunningProxy, path: str, body: bytes, says: str
) -> None:
    response = httpx.post(proxy.url + path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert says in answer["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_own_refusal_reaches_the_sdk_as_its_error(
    client: Client, proxy: RunningProxy, fake: FakeVLLM, stream: bool
) -> None:
    fake.script(Reply(status=400, error_message="This model's maximum context length is 1024 tokens."))
    with pytest.raises(anthropic.BadRequestError, match="maximum context length") as raised:
        client(proxy).messages.create(model="agent", max_tokens=16, messages=QUESTION, stream=stream)
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    [row] = proxy.rows("SELECT status_code, endpoint FROM calls")
    assert (row["status_code"], row["endpoint"]) == (400, "messages")


def test_a_stream_broken_upstream_raises_in_the_sdk_and_is_recorded(
    client: Client, proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content="Paris is the capital of France.", fail_mid_stream=True))
    with (
        pytest.raises(anthropic.APIStatusError),
        client(proxy).messages.stream(model="agent", max_tokens=64, messages=QUESTION) as stream,
    ):
        for _ in stream:
            pass
    [row] = proxy.rows("SELECT status_code, endpoint, error FROM calls")
    assert (row["status_code"], row["endpoint"]) == (502, "messages") and row["error"]


def test_readers_see_the_messages_vllm_got(client: Client, proxy: RunningProxy, fake: FakeVLLM) -> None:
    raw = client(proxy).messages.with_raw_response.create(
        model="agent", max_tokens=16, system=SYSTEM, messages=QUESTION
    )
    [call] = stored_calls(proxy, raw.headers["x-trajectory-id"])
    assert anthropic_chat_messages(call["request"]) == fake.requests[-1]["messages"]


@needs_claude
def test_claude_code_runs_a_tool_loop_through_the_proxy_captured_as_one_trajectory(
    start_proxy: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy = start_proxy(api_keys=KEY)
    note = tmp_path / "note.txt"
    note.write_text("tracetrain was here\n")

    def reply(body: dict[str, Any]) -> Reply:
        # Claude Code reads the file the model asks for, then the model answers from the tool's result.
        if body["messages"][-1]["role"] == "tool":
            return Reply(content="The note says: tracetrain was here.")
        return Reply(tool_calls=[ToolCall("Read", json.dumps({"file_path": str(note)}))])

    fake.reply_for = reply
    env = claude_env(proxy.url, KEY, tmp_path / "home")
    answer = run_claude("What does note.txt say?", env, tmp_path, "--allowedTools", "Read")
    assert "The note says: tracetrain was here." in answer
    rows = proxy.rows("SELECT trajectory_id, endpoint, stream, request, status_code FROM calls ORDER BY started_at")
    assert len(rows) == 2 and {r["trajectory_id"] for r in rows} == {rows[0]["trajectory_id"]}  # threaded
    assert all(r["endpoint"] == "messages" and r["stream"] and r["status_code"] == 200 for r in rows)
    calls = stored_calls(proxy, rows[0]["trajectory_id"], KEY)
    [use] = calls[0]["response"]["content"]
    results = [b for b in calls[1]["request"]["messages"][-1]["content"] if b.get("type") == "tool_result"]
    assert use["type"] == "tool_use" and results[0]["tool_use_id"] == use["id"]
    assert "tracetrain was here" in json.dumps(results[0]["content"])
    for call, sent in zip(calls, fake.requests[-2:], strict=True):
        assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(sent["messages"], sent.get("tools")))
    first = calls[0]["prompt_token_ids"] + calls[0]["completion_token_ids"]
    assert calls[1]["prompt_token_ids"][: len(first)] == first  # one sample for training
