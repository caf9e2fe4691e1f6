"""The fake vLLM speaks vLLM 0.32's wire protocol, as seen by httpx and the openai client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import EOS_TOKEN_ID, FakeVLLM, Reply, ToolCall, serve_in_thread
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

BASE = "fake/base-model"
HELLO = [{"role": "user", "content": "hi there"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM()


@pytest.fixture
def url(fake: FakeVLLM) -> Iterator[str]:
    with serve_in_thread(fake.app) as base_url:
        yield base_url


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=10) as client:
        yield client


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as openai_client:
        yield openai_client


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": BASE, "messages": HELLO, **body})


def events(response: httpx.Response) -> list[Any]:
    """The decoded ``data:`` payloads of an SSE body; ``[DONE]`` stays a string."""
    payloads = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


# ---------------------------------------------------------------- tokens


def test_tokenizer_round_trips_and_is_stable_across_instances() -> None:
    text = "Héllo,  wörld!\n\t<|im_end|> 42 naïve_snake_case 🙂"
    ids = FakeVLLM().tokenize(text)
    assert FakeVLLM.detokenize(ids) == text
    assert FakeVLLM("other/model").tokenize(text) == ids
    assert EOS_TOKEN_ID in ids


def test_hash_collisions_fall_back_to_bytes_and_still_decode() -> None:
    first, second = FakeVLLM.tokenize("aef"), FakeVLLM.tokenize("arl")  # crc32 puts both on id 9298
    assert first != second
    assert 1 in {len(first), len(second)}
    assert FakeVLLM.detokenize([*first, *second, *first]) == "aefarlaef"


def test_token_ids_are_left_out_unless_asked(http: httpx.Client) -> None:
    body = chat(http).json()
    assert body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None


def test_token_ids_are_the_rendered_prompt_and_the_reply(http: httpx.Client, fake: FakeVLLM) -> None:
    body = chat(http, return_token_ids=True).json()
    assert body["prompt_token_ids"] == fake.tokenize(fake.render_chat(HELLO))
    assert body["choices"][0]["token_ids"] == fake.tokenize("echo: hi there")
    assert body["choices"][0]["message"]["content"] == "echo: hi there"
    assert body["usage"] == {
        "prompt_tokens": len(body["prompt_token_ids"]),
        "total_tokens": len(body["prompt_token_ids"]) + len(body["choices"][0]["token_ids"]),
        "completion_tokens": len(body["choices"][0]["token_ids"]),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def test_next_prompt_starts_with_previous_prompt_and_completion(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.emit_eos = True  # as a real model, the completion ends with <|im_end|>
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))
    first = chat(http, tools=[WEATHER_TOOL], return_token_ids=True).json()
    message = first["choices"][0]["message"]
    history = [
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"},
    ]
    second = chat(http, messages=history, tools=[WEATHER_TOOL], return_token_ids=True).json()
    turn = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert turn[-1] == EOS_TOKEN_ID
    assert second["prompt_token_ids"][: len(turn)] == turn


# ---------------------------------------------------------------- streaming


def test_stream_opens_with_role_then_sends_one_chunk_per_token(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.script(Reply("Hello, world!"))
    chunks = events(chat(http, stream=True, return_token_ids=True))
    expected_ids = fake.tokenize("Hello, world!")
    role, *tokens, done = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == fake.tokenize(fake.render_chat(HELLO))
    assert len(tokens) == len(expected_ids)
    assert [c["choices"][0]["token_ids"] for c in tokens] == [[i] for i in expected_ids]
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == "Hello, world!"
    assert all("prompt_token_ids" not in c for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * (len(tokens) - 1) + ["stop"]
    assert done == "[DONE]"


def test_stream_ends_with_a_usage_chunk_when_asked(http: httpx.Client) -> None:
    *chunks, usage, done = events(chat(http, stream=True, stream_options={"include_usage": True}))
    completion = len(chunks) - 1  # minus the role chunk
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == completion
    assert set(usage["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens"}
    assert "system_fingerprint" in usage and "system_fingerprint" not in chunks[-1]
    assert done == "[DONE]"


def test_stream_chunks_arrive_before_the_stream_ends(url: str, fake: FakeVLLM) -> None:
    # Six 0.2 s sleeps lie between the first word and the end. The client reads the first word when it gets to
    # it, maybe late on a loaded machine (that shortens what it measures): the bound leaves it 0.6 s of that.
    # A server that buffered would deliver everything within milliseconds.
    fake.token_delay_s = 0.2
    fake.script(Reply("one two three four"))
    arrivals: list[float] = []
    with (
        httpx.Client(base_url=url) as http,
        http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "stream": True}) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 1 + 7 + 1  # role, "one", " ", "two", ..., [DONE]
    assert arrivals[-1] - arrivals[1] >= 0.6


def test_client_hang_up_stops_the_stream(url: str, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.05
    fake.script(Reply("word " * 100))
    with (
        httpx.Client(base_url=url) as http,
        http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "stream": True}) as response,
    ):
        next(response.iter_lines())
    deadline = time.monotonic() + 5
    while fake.disconnected_streams == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.disconnected_streams == 1


def test_fail_mid_stream_drops_the_connection_after_the_first_token(url: str, fake: FakeVLLM) -> None:
    fake.script(Reply("never finished", fail_mid_stream=True))
    received: list[str] = []
    with (
        httpx.Client(base_url=url) as http,
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "stream": True}) as response,
    ):
        received.extend(line for line in response.iter_lines() if line)
    assert len(received) == 2  # the role chunk and one token
    assert json.loads(received[1].removeprefix("data: "))["choices"][0]["delta"] == {"content": "never"}


# ---------------------------------------------------------------- tool calls, n, max_tokens, logprobs


def test_scripted_tool_call_parses_with_the_openai_client(client: openai.OpenAI, fake: FakeVLLM) -> None:
    fake.script(Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}', id="call_1")]))
    completion = client.chat.completions.create(model=BASE, messages=HELLO, tools=[WEATHER_TOOL])  # type: ignore[arg-type,list-item]
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert (call.id, call.type) == ("call_1", "function")
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')  # type: ignore[union-attr]


def test_streamed_tool_call_accumulates_in_the_openai_client(client: openai.OpenAI, fake: FakeVLLM) -> None:
    fake.script(Reply("Checking.", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]))
    with client.chat.completions.stream(model=BASE, messages=HELLO, tools=[WEATHER_TOOL]) as stream:  # type: ignore[arg-type,list-item]
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-")
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')


def test_tool_markup_is_plain_content_when_the_request_has_no_tools(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.script(Reply(tool_calls=[ToolCall("get_weather", "{}")]))
    choice = chat(http).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>\n")


def test_n_choices_have_distinct_indexes(http: httpx.Client) -> None:
    body = chat(http, n=3).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 3 * len(FakeVLLM.tokenize("echo: hi there"))
    chunks = events(chat(http, n=2, stream=True))[:-1]
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # one role chunk per choice
    assert {c["choices"][0]["index"] for c in chunks[2:]} == {0, 1}


def test_max_tokens_truncates_with_finish_reason_length(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.script(Reply("one two three"), Reply("one two three"))
    body = chat(http, max_tokens=2, return_token_ids=True).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == "one "
    assert body["choices"][0]["token_ids"] == fake.tokenize("one ")
    last = events(chat(http, max_completion_tokens=3, stream=True))[-2]
    assert last["choices"][0]["finish_reason"] == "length"


def test_completions_default_to_sixteen_tokens_like_vllm(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.script(Reply("x " * 20))
    choice = http.post("/v1/completions", json={"model": BASE, "prompt": "go"}).json()["choices"][0]
    assert (choice["finish_reason"], choice["text"]) == ("length", "x " * 8)


def test_chat_logprobs_have_vllm_shape(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.script(Reply("Hi there"))
    content = chat(http, logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]["content"]
    ids = fake.tokenize("Hi there")
    assert [entry["token"] for entry in content] == ["Hi", " ", "there"]
    for token_id, entry in zip(ids, content, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == fake.sampled_logprob(token_id) < 0
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token", "logprob", "bytes")}


def test_completions_take_token_id_prompts_and_put_ids_on_the_choice(http: httpx.Client, fake: FakeVLLM) -> None:
    prompt = fake.tokenize("Once upon")
    fake.script(Reply(" a time"))
    body = {"model": BASE, "prompt": prompt, "return_token_ids": True, "logprobs": 1}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert choice["token_ids"] == fake.tokenize(" a time")
    assert choice["logprobs"]["tokens"] == [" ", "a", " ", "time"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]
    stream = http.post("/v1/completions", json={**body, "stream": True})
    first, *rest = events(stream)[:-1]
    assert first["choices"][0]["prompt_token_ids"] == prompt
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in rest)


# ---------------------------------------------------------------- models, adapters, errors


def test_unknown_model_is_a_vllm_not_found_error(http: httpx.Client) -> None:
    response = chat(http, model="no/such-model")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": f"The model `no/such-model` does not exist. Valid aliases: {BASE}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_lora_load_list_serve_unload(http: httpx.Client, fake: FakeVLLM) -> None:
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": "/ckpt/step-1"})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'step-1' added successfully.")
    cards = http.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [(BASE, BASE, None), ("step-1", "/ckpt/step-1", BASE)]
    assert chat(http, model="step-1").json()["model"] == "step-1"
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "step-1"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'step-1' removed successfully.")
    assert fake.loras == {}
    assert chat(http, model="step-1").status_code == 404


def test_loading_a_loaded_lora_again_is_a_400(http: httpx.Client) -> None:
    http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/ckpt/a"})
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/ckpt/a2"})
    assert again.status_code == 400
    assert again.json()["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in again.json()["error"]["message"]
    in_place = {"lora_name": "a", "lora_path": "/ckpt/a2", "load_inplace": True}
    assert http.post("/v1/load_lora_adapter", json=in_place).status_code == 200


def test_unloading_an_unknown_lora_is_a_404(http: httpx.Client) -> None:
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The lora adapter 'ghost' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


def test_failed_lora_loads_answer_like_vllm(http: httpx.Client, fake: FakeVLLM) -> None:
    fake.fail_next_load = fake.lora_not_found_message("b", "/tmp/ckpt/b")
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/tmp/ckpt/b"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Loading lora b failed: No adapter found for <path>"
    fake.fail_next_load = "corrupt adapter weights"
    broken = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/ckpt/b"})
    assert (broken.status_code, broken.json()["error"]["type"]) == (500, "InternalServerError")
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/ckpt/b"}).status_code == 200


def test_scripted_error_status_surfaces_in_the_openai_client(client: openai.OpenAI, fake: FakeVLLM) -> None:
    fake.script(Reply(status=503, error_message="engine overloaded"))
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=BASE, messages=HELLO)  # type: ignore[arg-type]
    assert caught.value.status_code == 503
    assert caught.value.body == {
        "message": "engine overloaded",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }


def test_requests_record_what_was_forwarded(http: httpx.Client, fake: FakeVLLM) -> None:
    chat(http, return_token_ids=True, logprobs=True)
    http.post("/v1/completions", json={"prompt": "x"})
    assert fake.requests[0]["return_token_ids"] is True
    assert fake.requests[0]["logprobs"] is True
    assert fake.requests[1] == {"prompt": "x"}


def test_scripted_replies_are_used_in_order_then_echo(client: openai.OpenAI, fake: FakeVLLM) -> None:
    fake.script(Reply("first"), Reply("second"))
    answers = [
        client.chat.completions.create(model=BASE, messages=HELLO).choices[0].message.content  # type: ignore[arg-type]
        for _ in range(3)
    ]
    assert answers == ["first", "second", "echo: hi there"]


def test_health_and_ping_answer_empty_200s(http: httpx.Client) -> None:
    for path in ("/health", "/ping"):
        response = http.get(path)
        assert (response.status_code, response.text) == (200, "")


def test_serve_in_thread_serves_any_asgi_app() -> None:
    async def hello(request: object) -> PlainTextResponse:
        return PlainTextResponse("hello")

    with serve_in_thread(Starlette(routes=[Route("/", hello)])) as base_url:
        assert base_url.startswith("http://127.0.0.1:")
        assert httpx.get(base_url).text == "hello"


# ---------------------------------------------------------------- pause and sleep (fake_vllm_rl.py)


def test_pause_wait_answers_once_the_running_stream_has_finished(url: str, fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.02
    fake.script(Reply(" ".join(["word"] * 20)))
    with (
        httpx.Client(base_url=url, timeout=10) as http,
        http.stream(
            "POST", "/v1/chat/completions", json={"model": BASE, "messages": HELLO, "stream": True}
        ) as streamed,
    ):
        lines = streamed.iter_lines()
        first = next(lines)
        with httpx.Client(base_url=url, timeout=10) as other:
            assert other.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
        assert fake.handover.running == 0, "the pause answered before the stream finished"
        rest = [line for line in lines if line]
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    assert fake.handover.aborted == 0


def test_generation_is_refused_while_paused_or_asleep_and_served_after_waking(
    http: httpx.Client, fake: FakeVLLM
) -> None:
    http.post("/pause", params={"mode": "wait"})
    paused = chat(http)
    http.post("/sleep", params={"level": 1, "mode": "wait"})
    asleep = chat(http)
    assert (paused.status_code, asleep.status_code) == (503, 503)
    assert "while the engine is paused" in paused.json()["error"]["message"]
    assert fake.handover.refused == ["/v1/chat/completions while paused", "/v1/chat/completions while asleep"]

    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert http.get("/is_paused").json() == {"is_paused": False}, "waking up resumes, as vLLM's engine does"
    assert http.post("/resume").json() == {"status": "resumed"}
    assert chat(http).status_code == 200
    assert fake.handover.calls == [
        "pause mode=wait", "refused /v1/chat/completions", "sleep level=1 mode=wait", "refused /v1/chat/completions",
        "wake_up", "resume", f"chat {BASE}",
    ]  # fmt: skip


def test_a_vllm_that_stays_asleep_or_fails_says_so(http: httpx.Client, fake: FakeVLLM) -> None:
    http.post("/sleep", params={"level": 1, "mode": "wait"})
    fake.handover.stay_asleep = True
    assert http.post("/wake_up").json() == {"status": "sleeping", "tags": None}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    fake.handover.failing = {"wake_up"}
    failed = http.post("/wake_up")
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
