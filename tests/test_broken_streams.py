"""A stream vLLM breaks is a failed call: each API's stream ends in its own failure grammar, the record says failed,
and no reader takes it for a whole answer.

vLLM 0.32 reports an engine failure inside a stream as ``data: {"error": {...}}`` then ``data: [DONE]``
(``tests/data/vllm_protocol/apis_stream_engine_dead.json``, the engine core killed mid-stream; the fake's
``Reply.stream_error``); an upstream can also drop the connection (``Reply.fail_mid_stream``). The clients are
the real SDKs: openai (chat and Responses) and anthropic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

from proxy.judge._prompt import call_messages as judge_messages
from store import Store
from tracetrain_cli._main import main
from trainer import build_samples
from trainer._batch import TrajectoryData
from trainer._sft import read_export, sft_examples

ENGINE = "EngineCore encountered an issue. See stack trace (above) for the root cause."  # vLLM 0.32's words
FAILURES = {"engine": Reply("one two three four", stream_error=ENGINE),
            "dropped": Reply("one two three four", fail_mid_stream=True)}  # fmt: skip
# What each failure is recorded as: vLLM's own code and words, or 502 for a connection the upstream dropped.
RECORDED = {"engine": (500, ENGINE), "dropped": (502, "the upstream")}
QUESTION = "Count to four."


def chat(proxy: RunningProxy, trajectory: str) -> str:
    """A streamed chat call through the openai SDK; what it raised."""
    client = proxy.client(default_headers={"X-Trajectory-Id": trajectory})
    with pytest.raises(openai.APIError) as raised:
        for _ in client.chat.completions.create(model="agent", messages=[{"role": "user", "content": QUESTION}],
                                                stream=True):  # fmt: skip
            pass
    return raised.value.message


def responses(proxy: RunningProxy, trajectory: str) -> str:
    """A streamed Responses call through the openai SDK: its last event is response.failed."""
    client = proxy.client(default_headers={"X-Trajectory-Id": trajectory})
    events = list(client.responses.create(model="agent", input=QUESTION, stream=True))
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    return failed.response.error.message


def messages(proxy: RunningProxy, trajectory: str) -> str:
    """A streamed Messages call through the anthropic SDK: it raises on Anthropic's error event."""
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0,
                                 default_headers={"X-Trajectory-Id": trajectory})  # fmt: skip
    with client, pytest.raises(anthropic.APIStatusError) as raised:
        for _ in client.messages.create(model="agent", max_tokens=64, stream=True,
                                        messages=[{"role": "user", "content": QUESTION}]):  # fmt: skip
            pass
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    return str(raised.value.body["error"]["message"])  # type: ignore[index]


APIS = {"chat.completions": chat, "responses": responses, "messages": messages}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("api", APIS)
def test_a_broken_stream_ends_in_its_apis_failure_grammar_and_is_recorded_failed(
    proxy: RunningProxy, fake: FakeVLLM, api: str, failure: str
) -> None:
    fake.script(FAILURES[failure])
    said = APIS[api](proxy, "t-broken")
    status, error = RECORDED[failure]
    assert error in said
    [call] = httpx.get(f"{proxy.v1}/trajectories/t-broken").json()["calls"]
    assert (call["endpoint"], call["status_code"]) == (api, status) and call["error"].startswith(error)
    assert call["completion_token_ids"], "what was sampled before the failure is kept"
    if api == "responses":
        assert call["response"]["status"] == "failed" and call["response"]["error"]["message"] == call["error"]
    if api == "messages":
        assert call["response"]["stop_reason"] is None  # it never stopped
    reason = "upstream_error" if failure == "engine" else "upstream_closed"
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert f'tracetrain_broken_streams_total{{endpoint="{api}",reason="{reason}"}} 1.0' in metrics


def test_chat_forwards_vllms_error_event_as_vllm_sent_it_then_done(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(FAILURES["engine"])
    body = {"model": "agent", "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    error = {"error": {"message": ENGINE, "type": "InternalServerError", "param": None, "code": 500}}
    assert lines[-2:] == [f"data: {orjson.dumps(error).decode().replace(',', ', ').replace(':', ': ')}",
                          "data: [DONE]"]  # fmt: skip


def test_the_messages_error_event_is_anthropics_api_error(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(FAILURES["engine"])
    body = {"model": "agent", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": QUESTION}]}
    with httpx.stream("POST", f"{proxy.url}/v1/messages", json=body) as response:
        lines = list(response.iter_lines())
    assert lines[-3:-1] == ["event: error", 'data: {"type":"error","error":{"type":"api_error","message":"'
                            + ENGINE + '"}}']  # fmt: skip
    assert "event: message_stop" not in lines


@pytest.fixture
def half_broken(proxy: RunningProxy, fake: FakeVLLM) -> RunningProxy:
    """Trajectory "t1": one whole Messages call, then one that vLLM broke mid-stream; rewarded."""
    fake.script(Reply("Paris."), FAILURES["engine"])
    with anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0,
                             default_headers={"X-Trajectory-Id": "t1", "X-Group-Id": "g1"}) as client:  # fmt: skip
        history: list[Any] = [{"role": "user", "content": "Capital of France?"}]
        answer = client.messages.create(model="agent", max_tokens=64, messages=history)
        history += [{"role": "assistant", "content": answer.content[0].text}, {"role": "user", "content": QUESTION}]
        with pytest.raises(anthropic.APIStatusError):
            for _ in client.messages.create(model="agent", max_tokens=64, messages=history, stream=True):
                pass
    assert httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t1", "reward": 1.0}).status_code == 200
    return proxy


async def test_the_trainer_skips_a_broken_call(half_broken: RunningProxy) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{half_broken.db_path}", capture=False)
    try:
        [stored] = await store.jobs.rewarded_trajectories(["g1"], policy="agent")
    finally:
        await store.close()
    trajectory = TrajectoryData.from_store(stored)
    assert [c.status_code for c in trajectory.calls] == [200, 500]
    samples, stats = build_samples(trajectory.calls)
    assert stats.skipped_failed == 1 and len(samples) == 1 and samples[0].n_calls == 1


def test_the_judge_reads_a_broken_call_as_failed(half_broken: RunningProxy) -> None:
    calls = httpx.get(f"{half_broken.v1}/trajectories/t1").json()["calls"]
    whole, broken = (judge_messages(c["endpoint"], c["request"], c["response"], c["error"]) for c in calls)
    assert whole[-1] == {"role": "assistant", "content": "Paris."}
    assert broken[-1] == {"role": "assistant", "content": f"[the call failed: {ENGINE}]"}


def test_export_and_sft_leave_a_broken_call_out(half_broken: RunningProxy, tmp_path: Path) -> None:
    out = tmp_path / "export.jsonl"
    assert main(["export", "--data-dir", str(half_broken.settings.data_dir), "--output", str(out)]) == 0
    [row] = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [c["status_code"] for c in row["calls"]] == [200, 500]
    assert row["messages"][-1] == {"role": "assistant", "content": "Paris.", "name": None, "tool_calls": None,
                                   "tool_call_id": None}  # the last *answered* call's conversation  # fmt: skip
    examples = sft_examples(read_export(out))
    assert len(examples.rows) == 1 and examples.rows[0]["completion"][0]["content"] == "Paris."
