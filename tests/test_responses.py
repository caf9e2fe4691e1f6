"""The Responses API (``/v1/responses``), through the real openai SDK, against the fake vLLM.

Each call goes to vLLM as a chat completion (proxy.gateway.dialects.responses): these tests check the
Responses grammar the SDK reads back, that the record is token-exact (the prompt ids are the
chat template's rendering of the translated messages), keying and threading, and the 4xx
answers for what the proxy does not serve.
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from conftest import RunningProxy
from fake_vllm import EOS_TOKEN_ID, FakeVLLM, Reply, ToolCall
from test_capture import stored_calls

from tracetrain_core import call_messages, call_reply

INSTRUCTIONS = "Answer in one sentence."
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER_TOOL = {
    "type": "function",
    "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"},
}


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, as sent."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, orjson.loads(line[6:])))
    return events


def test_non_streamed_response_is_recorded_token_exact(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Paris is the capital."))
    raw = proxy.client().responses.with_raw_response.create(
        model="agent", instructions=INSTRUCTIONS, input="What is the capital of France?"
    )
    response = raw.parse()
    assert response.output_text == "Paris is the capital."
    assert response.status == "completed" and response.model == "agent@0" and response.id.startswith("resp_")
    assert response.output[0].id.startswith("msg_")
    call = stored_calls(proxy, raw.headers["x-trajectory-id"])[0]
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert fake.requests[-1]["messages"] == messages
    assert call["endpoint"] == "responses"
    assert call["request"] == {
        "model": "agent",
        "instructions": INSTRUCTIONS,
        "input": "What is the capital of France?",
    }
    assert call["response"] == orjson.loads(raw.content)
    assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(messages, None))
    assert call["completion_token_ids"] == [*fake.tokenize("Paris is the capital."), EOS_TOKEN_ID]
    assert len(call["logprobs"]) == len(call["completion_token_ids"]) and all(lp < 0 for lp in call["logprobs"])
    assert response.usage is not None
    assert response.usage.output_tokens == len(call["completion_token_ids"]) == call["completion_tokens"]
    assert response.usage.input_tokens == len(call["prompt_token_ids"])
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_the_client_gets_no_token_fields(proxy: RunningProxy) -> None:
    body = httpx.post(f"{proxy.v1}/responses", json={"model": "agent", "input": "Hi"}).json()
    text = orjson.dumps(body).decode()
    assert "token_ids" not in text and "prompt_token_ids" not in text
    assert body["output"][0]["content"][0]["logprobs"] == []
    assert body["object"] == "response" and body["error"] is None


def test_streamed_response_sends_the_responses_events_and_records_what_the_client_saw(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content="Paris, of course."))
    body = {"model": "agent", "input": [{"role": "user", "content": "Capital of France?"}], "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        trajectory_id = response.headers["x-trajectory-id"]
        events = sse_events(response)
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == "Paris, of course."
    completed = events[-1][1]["response"]
    assert completed["status"] == "completed" and completed["output"][0]["content"][0]["text"] == deltas
    call = stored_calls(proxy, trajectory_id)[0]
    assert call["response"] == completed and call["stream"] is True and call["endpoint"] == "responses"
    messages = [{"role": "user", "content": "Capital of France?"}]
    assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(messages, None))
    assert call["completion_token_ids"] == [*fake.tokenize("Paris, of course."), EOS_TOKEN_ID]
    assert len(call["logprobs"]) == len(call["completion_token_ids"])
    assert completed["usage"]["output_tokens"] == len(call["completion_token_ids"])


def test_the_sdks_stream_helper_reads_the_final_response(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Let me check.", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))
    with proxy.client().responses.stream(model="agent", input="Weather in Paris?", tools=[WEATHER_TOOL]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == "Let me check."
    call = final.output[1]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    assert call.id.startswith("fc_") and call.call_id
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_stream_is_forwarded_before_upstream_finishes(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.2
    fake.script(Reply(content="one two three four five six"))
    started = time.perf_counter()
    arrivals = []
    for event in proxy.client().responses.create(model="agent", input="Count.", stream=True):
        if event.type == "response.output_text.delta":
            arrivals.append(time.perf_counter() - started)
    total = time.perf_counter() - started
    assert len(arrivals) >= 6
    assert arrivals[0] < total - 0.8, f"first delta at {arrivals[0]:.2f}s of {total:.2f}s: the proxy buffered"


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_tool_loop_is_one_trajectory_of_token_exact_calls(
    proxy: RunningProxy, fake: FakeVLLM, stream: bool
) -> None:
    client = proxy.client()
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]), Reply(content="It is sunny."))
    question = [{"role": "user", "content": "Weather in Paris?"}]

    def create(items: list) -> tuple[str, object]:
        kwargs = {"model": "agent", "instructions": INSTRUCTIONS, "input": items, "tools": [WEATHER_TOOL]}
        if not stream:
            raw = client.responses.with_raw_response.create(**kwargs)
            return raw.headers["x-trajectory-id"], raw.parse()
        with client.responses.with_streaming_response.create(**kwargs, stream=True) as raw:
            events = list(raw.parse())
            return raw.headers["x-trajectory-id"], events[-1].response

    first_id, first = create(question)
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    # What the SDK's users send back: the output items, then the tool's output.
    items = [*question, *(item.model_dump(exclude_none=True) for item in first.output)]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"})
    second_id, second = create(items)
    assert second.output_text == "It is sunny."
    assert second_id == first_id, "the continuation threads into the first call's trajectory"
    forwarded = fake.requests[-1]
    assert forwarded["tools"] == [CHAT_WEATHER_TOOL]
    assert forwarded["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": call.arguments}
    assert forwarded["messages"][3] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24 C"}
    calls = stored_calls(proxy, first_id)
    assert len(calls) == 2
    for stored, sent in zip(calls, fake.requests[-2:], strict=True):
        assert stored["prompt_token_ids"] == fake.tokenize(fake.render_chat(sent["messages"], sent["tools"]))
        assert len(stored["logprobs"]) == len(stored["completion_token_ids"]) > 0
    # The second prompt extends the first prompt plus its completion: the trainer merges them into one sample.
    first_call, second_call = calls
    assert second_call["prompt_token_ids"][: len(first_call["prompt_token_ids"])] == first_call["prompt_token_ids"]
    assert call_messages("responses", second_call["request"]) == forwarded["messages"]
    assert call_reply("responses", second_call["response"]) == {"role": "assistant", "content": "It is sunny."}


def test_settings_translate_to_chat(proxy: RunningProxy, fake: FakeVLLM) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    proxy.client().responses.create(
        model="agent", input="Capital of France?", tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        max_output_tokens=40, temperature=0.5, top_p=0.9, store=True,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    sent = fake.requests[-1]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["parallel_tool_calls"] is False
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"]) == (40, 0.5, 0.9)
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": schema, "strict": True}}  # fmt: skip
    assert "store" not in sent and "text" not in sent


def test_developer_messages_and_content_parts_become_chat_messages(proxy: RunningProxy, fake: FakeVLLM) -> None:
    proxy.client().responses.create(
        model="agent",
        input=[
            {"role": "developer", "content": "You are terse."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
    )
    assert fake.requests[-1]["messages"] == [{"role": "system", "content": "You are terse."},
                                             {"role": "user", "content": "Hi"}]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_max_output_tokens_cut_is_incomplete(proxy: RunningProxy, fake: FakeVLLM, stream: bool) -> None:
    fake.script(Reply(content="one two three four five six seven"))
    body = {"model": "agent", "input": "Count.", "max_output_tokens": 3, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{proxy.v1}/responses", json=body) as response:
            name, data = sse_events(response)[-1]
        assert name == "response.incomplete"
        result = data["response"]
    else:
        result = httpx.post(f"{proxy.v1}/responses", json=body).json()
    assert result["status"] == "incomplete"
    assert result["incomplete_details"] == {"reason": "max_output_tokens"}
    assert result["usage"]["output_tokens"] == 3


def test_keying_prefixes_headers_and_pins_work_as_for_chat(proxy: RunningProxy) -> None:
    client = proxy.client(base_url=f"{proxy.url}/g/grp-r/t/traj-r/v1")
    raw = client.responses.with_raw_response.create(model="agent@0", input="Hi")
    assert (raw.headers["x-trajectory-id"], raw.headers["x-group-id"]) == ("traj-r", "grp-r")
    assert raw.headers["x-policy-version"] == "0" and raw.parse().model == "agent@0"
    raw = proxy.client().responses.with_raw_response.create(
        model="agent", input="Hi", extra_headers={"X-Trajectory-Id": "traj-h", "X-Group-Id": "grp-h"}
    )
    assert (raw.headers["x-trajectory-id"], raw.headers["x-group-id"]) == ("traj-h", "grp-h")
    assert [c["endpoint"] for c in stored_calls(proxy, "traj-r") + stored_calls(proxy, "traj-h")] == ["responses"] * 2


def test_an_unkeyed_conversation_that_resends_its_history_joins_its_trajectory(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    client = proxy.client()
    fake.script(Reply(content="Paris."), Reply(content="Lyon."))
    raw = client.responses.with_raw_response.create(model="agent", input="Capital of France?")
    first = raw.parse()
    items = [{"role": "user", "content": "Capital of France?"}, *(i.model_dump() for i in first.output),
             {"role": "user", "content": "And its second city?"}]  # fmt: skip
    again = client.responses.with_raw_response.create(model="agent", input=items)
    assert again.headers["x-trajectory-id"] == raw.headers["x-trajectory-id"]
    assert [c["endpoint"] for c in stored_calls(proxy, raw.headers["x-trajectory-id"])] == ["responses"] * 2


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
        ({"conversation": "conv_1"}, "conversation", "send the whole conversation"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "Field required"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "whole conversation"),
        ({"input": [{"type": ["message"], "role": "user"}]}, "input[0].type", "Unsupported input item type"),
        ({"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, "input[0].content[0].type", "Unsupported"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "Field required"),
        ({"input": 5}, "input.str", "Invalid value"),
        ({"input": []}, "input", "no message"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"temperature": "hot"}, "temperature", "Invalid value"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format", "json_schema"),
        ({"background": True}, "background", "not supported"),
    ],
)  # fmt: skip
def test_what_the_proxy_does_not_serve_is_a_clear_400(proxy: RunningProxy, body: dict, param: str, says: str) -> None:
    response = httpx.post(f"{proxy.v1}/responses", json={"model": "agent", "input": "Hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and says in error["message"]
    assert httpx.get(f"{proxy.v1}/trajectories").json()["data"] == [], "a refused call starts no trajectory"


def test_bad_json_unknown_models_and_upstream_errors_answer_in_openai_shape(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    bad = httpx.post(f"{proxy.v1}/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    unknown = httpx.post(f"{proxy.v1}/responses", json={"model": "gpt-4o", "input": "Hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    fake.script(Reply(status=400, error_message="This model's maximum context length is 64 tokens."))
    upstream = httpx.post(f"{proxy.v1}/responses", json={"model": "agent", "input": "Hi"})
    assert upstream.status_code == 400 and "maximum context length" in upstream.json()["error"]["message"]
    assert upstream.headers["x-trajectory-id"]


def test_a_stream_broken_upstream_ends_with_response_failed_and_is_recorded(
    proxy: RunningProxy, fake: FakeVLLM
) -> None:
    fake.script(Reply(content="one two three", fail_mid_stream=True))
    body = {"model": "agent", "input": "Count.", "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/responses", json=body) as response:
        trajectory_id = response.headers["x-trajectory-id"]
        name, data = sse_events(response)[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    call = stored_calls(proxy, trajectory_id)[0]
    assert call["status_code"] == 502 and call["response"]["status"] == "failed"


def test_the_key_is_accepted_as_x_api_key_too(start_proxy) -> None:
    proxy = start_proxy(api_keys="k-" + "a" * 30)
    missing = httpx.post(f"{proxy.v1}/responses", json={"model": "agent", "input": "Hi"})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": "k-" + "a" * 30}, {"Authorization": "Bearer " + "k-" + "a" * 30}):
        assert httpx.post(f"{proxy.v1}/responses", json={"model": "agent", "input": "Hi"}, headers=headers).is_success
    wrong = httpx.post(f"{proxy.v1}/chat/completions", headers={"x-api-key": "wrong"},
                       json={"model": "agent", "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert wrong.status_code == 401
