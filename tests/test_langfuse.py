"""Langfuse export: what reaches Langfuse's endpoints (mocked with respx), in batches, and
what an outage costs (no capture, no latency; counted drops; delivery resumes).

The real proxy runs against the fake vLLM on loopback; respx answers for Langfuse and lets
loopback traffic through. Exporter-level behaviour (batching, retries, the bounded queue,
shutdown) is tested on the exporter directly, with short intervals.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gzip
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import respx
from fake_vllm import FakeVLLM, Reply, serve_in_thread
from fastapi import FastAPI
from langfuse import Langfuse, LangfuseOtelSpanAttributes
from pydantic import SecretStr, ValidationError

from proxy import Settings, create_app
from proxy.observability._langfuse import LangfuseConfig, LangfuseExporter
from proxy.observability._langfuse_wire import SCORES_PATH, TRACES_PATH, generation_span, trace_id
from store import CallWrite
from tracetrain_cli._serve_command import settings_from
from tracetrain_cli._serve_flags import add_serve_parser

LANGFUSE = "https://langfuse.test"
PUBLIC_KEY = "pk-lf-0a1b2c3d-public"
SECRET_KEY = "sk-lf-9f8e7d6c-very-secret"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# -- helpers -------------------------------------------------------------------------------


@dataclass
class LangfuseAPI:
    """respx routes standing in for Langfuse's two endpoints."""

    router: respx.MockRouter
    traces: respx.Route
    scores: respx.Route

    def spans(self) -> list[dict[str, Any]]:
        return [span for call in self.traces.calls for span in spans_of(call.request)]

    def scores_sent(self) -> list[dict[str, Any]]:
        return [score for call in self.scores.calls for score in orjson.loads(call.request.content)]


def spans_of(request: httpx.Request) -> list[dict[str, Any]]:
    assert request.headers["content-encoding"] == "gzip"
    body = orjson.loads(gzip.decompress(request.content))
    return [span for rs in body["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]]


def attributes(span: dict[str, Any]) -> dict[str, Any]:
    """OTLP key/value list -> dict (intValue stays the string OTLP JSON writes)."""
    return {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def config(**overrides: Any) -> LangfuseConfig:
    fast = {"flush_interval_s": 0.05, "backoff_s": 0.01, "max_backoff_s": 0.05, "shutdown_timeout_s": 1.0}
    return LangfuseConfig(PUBLIC_KEY, SecretStr(SECRET_KEY), LANGFUSE, **{**fast, **overrides})


def recorded_call(i: int, trajectory_id: str = "traj-direct", **call: Any) -> CallWrite:
    """A CallWrite shaped like the proxy's (see proxy.gateway._forward._call_write)."""
    row = {
        "id": f"call-{i:032x}",
        "trajectory_id": trajectory_id,
        "group_id": "grp-direct",
        "policy": "agent",
        "endpoint": "chat.completions",
        "model": "agent",
        "served_model": "agent@2",
        "version": 2,
        "stream": False,
        "request": {"model": "agent", "messages": QUESTION, "temperature": 0.7},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}}]},
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "status_code": 200,
        "error": None,
        "latency_ms": 40.0,
        "ttft_ms": None,
        "started_at": 1_700_000_000.0 + i,
    } | call
    return CallWrite(row, trajectory_id, "grp-direct", "agent", "header", None, None, row["started_at"], 2)


@pytest.fixture
def langfuse_api() -> Iterator[LangfuseAPI]:
    with respx.mock(assert_all_called=False) as router:
        router.route(host="127.0.0.1").pass_through()  # the proxy, the fake vLLM and the test's clients
        traces = router.post(f"{LANGFUSE}{TRACES_PATH}").respond(200, json={})
        scores = router.post(f"{LANGFUSE}{SCORES_PATH}").respond(202, json={"message": "Accepted"})
        yield LangfuseAPI(router, traces, scores)


@dataclass
class ProxyWithLangfuse:
    url: str
    app: FastAPI

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    @property
    def exporter(self) -> LangfuseExporter:
        exporter = self.app.state.services.langfuse
        assert isinstance(exporter, LangfuseExporter)
        return exporter

    def calls(self, trajectory_id: str) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.v1}/trajectories/{trajectory_id}").json()["calls"])


@pytest.fixture
def proxy(tmp_path: Path, fake: FakeVLLM, langfuse_api: LangfuseAPI) -> Iterator[ProxyWithLangfuse]:
    settings = Settings(
        upstream=f"{fake.url}/v1",  # type: ignore[attr-defined]
        data_dir=tmp_path / "data",
        langfuse=True,
        langfuse_public_key=PUBLIC_KEY,
        langfuse_secret_key=SecretStr(SECRET_KEY),
        langfuse_base_url=LANGFUSE,
    )
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield ProxyWithLangfuse(url, app)


# -- what is sent -----------------------------------------------------------------------------


def test_a_trajectory_is_one_trace_its_calls_generations_and_its_reward_scores(
    proxy: ProxyWithLangfuse, fake: FakeVLLM, langfuse_api: LangfuseAPI
) -> None:
    key = {"X-Trajectory-Id": "traj-langfuse-1", "X-Group-Id": "grp-capital"}
    fake.script(Reply(content="Paris."), Reply(content="Yes, Paris."))
    body = {"model": "agent", "messages": QUESTION, "temperature": 0.5, "max_tokens": 16, "user": "alice"}
    first = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=key).json()
    follow_up = [*QUESTION, first["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
    streamed = {"model": "agent", "messages": follow_up, "stream": True, "top_p": 0.9, "seed": 7}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=streamed, headers=key) as response:
        response.read()
    reward = {"trajectory_id": "traj-langfuse-1", "reward": 0.75, "metrics": {"correct": 1.0}}
    assert httpx.post(f"{proxy.v1}/rewards", json=reward).status_code == 200

    wait_until(lambda: proxy.exporter.sent == 4)  # 2 generations, the reward and its metric
    calls = proxy.calls("traj-langfuse-1")
    spans = sorted(langfuse_api.spans(), key=lambda s: int(s["startTimeUnixNano"]))
    assert len(spans) == 2
    expected_trace = Langfuse.create_trace_id(seed="traj-langfuse-1")  # findable from the trajectory id
    assert [s["traceId"] for s in spans] == [expected_trace, expected_trace]
    assert len({s["spanId"] for s in spans}) == 2

    for span, call in zip(spans, calls, strict=True):
        a = attributes(span)
        assert a["langfuse.observation.type"] == "generation"
        assert a["langfuse.observation.model.name"] == fake.base_model
        assert a["langfuse.version"] == "agent@0"
        assert a["langfuse.trace.name"] == "agent"
        assert a["session.id"] == "grp-capital"
        assert a["langfuse.trace.metadata.trajectory_id"] == "traj-langfuse-1"
        assert a["langfuse.observation.metadata.call_id"] == call["id"]
        usage = orjson.loads(a["langfuse.observation.usage_details"])
        assert usage == {
            "input": call["prompt_tokens"],
            "output": call["completion_tokens"],
            "total": call["prompt_tokens"] + call["completion_tokens"],
        }
        assert usage["input"] > 0 and usage["output"] > 0
        start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
        assert abs(start - call["started_at"] * 1e9) < 1e3  # within a microsecond of the record
        assert abs((end - start) - call["latency_ms"] * 1e6) < 1e3

    plain, stream = attributes(spans[0]), attributes(spans[1])
    assert orjson.loads(plain["langfuse.observation.model.parameters"]) == {"temperature": 0.5, "max_tokens": 16}
    assert orjson.loads(stream["langfuse.observation.model.parameters"]) == {"top_p": 0.9, "seed": 7}
    assert plain["user.id"] == "alice"
    assert orjson.loads(plain["langfuse.observation.input"]) == QUESTION
    assert orjson.loads(plain["langfuse.observation.output"])["content"] == "Paris."
    assert orjson.loads(stream["langfuse.observation.input"]) == follow_up
    assert orjson.loads(stream["langfuse.observation.output"])["content"] == "Yes, Paris."
    assert stream["langfuse.observation.metadata.stream"] is True
    assert "langfuse.observation.completion_start_time" not in plain
    first_token = orjson.loads(stream["langfuse.observation.completion_start_time"])
    first_token_s = datetime.fromisoformat(first_token.replace("Z", "+00:00")).timestamp()
    assert abs(first_token_s - (calls[1]["started_at"] + calls[1]["ttft_ms"] / 1000)) < 1e-3
    assert int(spans[1]["startTimeUnixNano"]) < first_token_s * 1e9 < int(spans[1]["endTimeUnixNano"])

    scores = {s["name"]: s for s in langfuse_api.scores_sent()}
    assert set(scores) == {"reward", "correct"}
    assert scores["reward"]["value"] == 0.75 and scores["correct"]["value"] == 1.0
    assert {s["traceId"] for s in scores.values()} == {expected_trace}
    assert scores["reward"]["dataType"] == "NUMERIC"
    assert scores["reward"]["metadata"]["trajectory_id"] == "traj-langfuse-1"

    request = langfuse_api.traces.calls.last.request
    credentials = base64.b64encode(f"{PUBLIC_KEY}:{SECRET_KEY}".encode()).decode()
    assert request.headers["authorization"] == f"Basic {credentials}"
    assert request.headers["x-langfuse-ingestion-version"] == "4"
    assert langfuse_api.scores.calls.last.request.headers["authorization"] == f"Basic {credentials}"


def test_span_attributes_are_the_ones_the_langfuse_sdk_defines() -> None:
    known = {v for k, v in vars(LangfuseOtelSpanAttributes).items() if not k.startswith("_")}
    metadata = (LangfuseOtelSpanAttributes.OBSERVATION_METADATA, LangfuseOtelSpanAttributes.TRACE_METADATA)
    write = recorded_call(1, status_code=502, error="upstream down", response=None, ttft_ms=12.0, stream=True)
    names = set(attributes(generation_span(write)))
    unknown = {n for n in names if n not in known and not n.startswith(tuple(f"{m}." for m in metadata))}
    assert unknown == set()
    assert trace_id("traj-x") == Langfuse.create_trace_id(seed="traj-x")


def test_a_failed_call_is_an_error_generation() -> None:
    span = generation_span(recorded_call(1, status_code=502, error="upstream down", response=None))
    a = attributes(span)
    assert a["langfuse.observation.level"] == "ERROR"
    assert a["langfuse.observation.status_message"] == "upstream down"
    assert span["status"] == {"code": 2, "message": "upstream down"}
    assert orjson.loads(a["langfuse.observation.output"]) is None


def test_without_the_flag_nothing_is_sent(start_proxy: Callable[..., Any], langfuse_api: LangfuseAPI) -> None:
    running = start_proxy()
    assert httpx.post(f"{running.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}).is_success
    running.stop()
    assert not langfuse_api.traces.called and not langfuse_api.scores.called


# -- batching ---------------------------------------------------------------------------------


async def test_calls_that_arrive_within_the_flush_interval_go_in_one_request(langfuse_api: LangfuseAPI) -> None:
    exporter = LangfuseExporter(config(flush_interval_s=0.2))
    exporter.start()
    for i in range(7):
        exporter.call_recorded(recorded_call(i))
    await eventually(lambda: exporter.sent == 7)
    await exporter.aclose()
    assert langfuse_api.traces.call_count == 1
    assert [attributes(s)["langfuse.observation.metadata.call_id"] for s in langfuse_api.spans()] == [
        f"call-{i:032x}" for i in range(7)
    ]


async def test_a_full_batch_leaves_at_once_and_the_rest_at_shutdown(langfuse_api: LangfuseAPI) -> None:
    exporter = LangfuseExporter(config(batch_size=10, flush_interval_s=60))
    exporter.start()
    for i in range(25):
        exporter.call_recorded(recorded_call(i))
    await eventually(lambda: exporter.sent == 20, timeout_s=2)  # two full batches, no 60 s wait
    assert exporter.queued == 5
    await exporter.aclose()  # flushes the partial batch
    sizes = [len(spans_of(call.request)) for call in langfuse_api.traces.calls]
    assert sizes == [10, 10, 5]
    assert exporter.sent == 25 and exporter.dropped == 0


async def test_a_large_batch_is_split_by_bytes(langfuse_api: LangfuseAPI) -> None:
    exporter = LangfuseExporter(config(max_batch_bytes=5_000))
    exporter.start()
    for i in range(6):  # about 2.4 kB of JSON each: two fit under 5 kB, three do not
        longer = {"model": "agent", "messages": [{"role": "user", "content": "x" * 500}]}
        exporter.call_recorded(recorded_call(i, request=longer))
    await eventually(lambda: exporter.sent == 6)
    await exporter.aclose()
    assert [len(spans_of(c.request)) for c in langfuse_api.traces.calls] == [2, 2, 2]
    envelope = 200
    assert all(len(gzip.decompress(c.request.content)) < 5_000 + envelope for c in langfuse_api.traces.calls)


async def test_calls_and_rewards_of_one_batch_go_to_their_two_endpoints(langfuse_api: LangfuseAPI) -> None:
    exporter = LangfuseExporter(config())
    exporter.start()
    exporter.call_recorded(recorded_call(1, trajectory_id="traj-a"))
    reward = {"trajectory_id": "traj-a", "group_id": "g", "reward": 1.0, "metrics": {}, "source": "judge"}
    exporter.rewards_recorded([reward | {"explanation": "best of its group"}])
    await eventually(lambda: exporter.sent == 2)
    await exporter.aclose()
    [score] = langfuse_api.scores_sent()
    assert score["name"] == "reward.judge" and score["comment"] == "best of its group"
    assert score["traceId"] == langfuse_api.spans()[0]["traceId"] == trace_id("traj-a")


# -- outages ----------------------------------------------------------------------------------


class Hang:
    """A Langfuse that holds every request open until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.entered.set()
        while not self.released.is_set():
            await asyncio.sleep(0.01)
        return httpx.Response(503)


@pytest.mark.parametrize("outage", ["503", "refused", "hanging"])
def test_an_outage_neither_loses_captures_nor_slows_calls_and_delivery_resumes(
    proxy: ProxyWithLangfuse, langfuse_api: LangfuseAPI, outage: str
) -> None:
    hang = Hang()
    if outage == "503":
        langfuse_api.traces.mock(return_value=httpx.Response(503, text="maintenance"))
    elif outage == "refused":
        langfuse_api.traces.mock(side_effect=httpx.ConnectError("connection refused"))
    else:
        langfuse_api.traces.mock(side_effect=hang)
    key = {"X-Trajectory-Id": "traj-outage"}
    body = {"model": "agent", "messages": QUESTION}
    started = time.perf_counter()
    for _ in range(5):
        assert httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=key).status_code == 200
    elapsed = time.perf_counter() - started
    assert len(proxy.calls("traj-outage")) == 5  # every call captured
    wait_until(lambda: langfuse_api.traces.called or hang.entered.is_set())  # the export was tried
    assert elapsed < 2.0  # a hanging Langfuse would hold the calls forever if they waited for it
    assert proxy.exporter.sent == 0

    hang.released.set()
    langfuse_api.traces.mock(side_effect=None, return_value=httpx.Response(200, json={}))
    wait_until(lambda: proxy.exporter.sent == 5)
    assert proxy.exporter.retries >= 1
    assert (proxy.exporter.failed, proxy.exporter.dropped) == (0, 0)
    delivered = spans_of(langfuse_api.traces.calls.last.request)
    assert {attributes(s)["langfuse.trace.metadata.trajectory_id"] for s in delivered} == {"traj-outage"}


async def test_a_full_queue_drops_and_counts_then_sends_what_it_kept(langfuse_api: LangfuseAPI) -> None:
    exporter = LangfuseExporter(config(max_queue=10))
    for i in range(25):  # not started yet: nothing leaves the queue
        exporter.call_recorded(recorded_call(i))
    assert (exporter.queued, exporter.dropped) == (10, 15)
    exporter.start()
    await eventually(lambda: exporter.sent == 10)
    await exporter.aclose()
    assert exporter.stats() == {
        "queued": 0, "sent": 10, "dropped": 15, "rejected": 0, "failed": 0, "failed_batches": 0, "retries": 0
    }  # fmt: skip


async def test_retries_back_off_exponentially(langfuse_api: LangfuseAPI) -> None:
    sent_at: list[float] = []
    replies = iter([httpx.Response(503), httpx.Response(429), httpx.Response(200, json={})])

    def reply(request: httpx.Request) -> httpx.Response:
        sent_at.append(time.monotonic())
        return next(replies)

    langfuse_api.traces.mock(side_effect=reply)
    exporter = LangfuseExporter(config(backoff_s=0.1, max_backoff_s=1.0))
    exporter.start()
    exporter.call_recorded(recorded_call(0))
    await eventually(lambda: exporter.sent == 1)
    await exporter.aclose()
    waits = [later - earlier for earlier, later in itertools.pairwise(sent_at)]
    # Lower bounds only (a loaded machine only adds): backoff_s, then twice it, each halved at worst.
    assert exporter.retries == 2 and waits[0] >= 0.05 and waits[1] >= 0.1


async def test_a_request_is_given_up_after_bounded_retries_and_later_ones_still_go(langfuse_api: LangfuseAPI) -> None:
    langfuse_api.traces.mock(return_value=httpx.Response(503))
    exporter = LangfuseExporter(config(max_attempts=3))
    exporter.start()
    for i in range(4):
        exporter.call_recorded(recorded_call(i))
    await eventually(lambda: exporter.failed_batches == 1)
    assert langfuse_api.traces.call_count == 3
    assert (exporter.failed, exporter.retries, exporter.sent) == (4, 2, 0)

    langfuse_api.traces.mock(return_value=httpx.Response(200, json={}))
    exporter.call_recorded(recorded_call(9))
    await eventually(lambda: exporter.sent == 1)
    await exporter.aclose()
    assert exporter.failed == 4  # what was given up stays given up, and counted


async def test_too_many_requests_is_retried_but_a_refusal_is_not(langfuse_api: LangfuseAPI) -> None:
    langfuse_api.traces.mock(side_effect=[httpx.Response(429), httpx.Response(200, json={})])
    exporter = LangfuseExporter(config())
    exporter.start()
    exporter.call_recorded(recorded_call(1))
    await eventually(lambda: exporter.sent == 1)
    assert langfuse_api.traces.call_count == 2

    langfuse_api.traces.mock(side_effect=None, return_value=httpx.Response(401, json={"message": "Invalid keys"}))
    exporter.call_recorded(recorded_call(2))
    exporter.call_recorded(recorded_call(3))
    await eventually(lambda: exporter.rejected == 2)
    await exporter.aclose()
    assert langfuse_api.traces.call_count == 3


async def test_partial_successes_count_what_was_rejected(langfuse_api: LangfuseAPI) -> None:
    langfuse_api.traces.mock(return_value=httpx.Response(200, json={"partialSuccess": {"rejectedSpans": "1"}}))
    langfuse_api.scores.mock(return_value=httpx.Response(207, json={"accepted": 1, "rejected": 1, "errors": []}))
    exporter = LangfuseExporter(config())
    exporter.start()
    exporter.call_recorded(recorded_call(1))
    exporter.call_recorded(recorded_call(2))
    exporter.rewards_recorded([{"trajectory_id": "traj-direct", "reward": 0.5, "metrics": {"len": 3}}])
    await eventually(lambda: exporter.sent + exporter.rejected == 4)
    await exporter.aclose()
    assert (exporter.sent, exporter.rejected) == (2, 2)


async def test_shutdown_gives_up_within_its_time_limit_and_counts_what_was_left(langfuse_api: LangfuseAPI) -> None:
    langfuse_api.traces.mock(side_effect=httpx.ConnectError("refused"))
    exporter = LangfuseExporter(config(shutdown_timeout_s=0.3, backoff_s=0.2, max_backoff_s=0.2, max_attempts=100))
    exporter.start()
    for i in range(3):
        exporter.call_recorded(recorded_call(i))
    started = time.perf_counter()
    await exporter.aclose()
    assert time.perf_counter() - started < 1.0
    assert (exporter.sent, exporter.dropped) == (0, 3)
    exporter.call_recorded(recorded_call(4))  # after shutdown: dropped, not queued
    assert (exporter.queued, exporter.dropped) == (0, 4)


# -- settings and secrets -------------------------------------------------------------------------


@pytest.fixture
def no_langfuse_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_BASE_URL", "LANGFUSE_HOST"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_langfuse_without_keys_refuses_to_start(no_langfuse_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY"):
        Settings(langfuse=True)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    with pytest.raises(SystemExit, match="LANGFUSE_PUBLIC_KEY"):
        settings_from(parser.parse_args(["serve", "--langfuse", "--upstream", "http://127.0.0.1:9/v1"]))


def test_keys_and_server_come_from_the_usual_langfuse_variables(no_langfuse_env: pytest.MonkeyPatch) -> None:
    no_langfuse_env.setenv("LANGFUSE_PUBLIC_KEY", PUBLIC_KEY)
    no_langfuse_env.setenv("LANGFUSE_SECRET_KEY", SECRET_KEY)
    no_langfuse_env.setenv("LANGFUSE_HOST", "http://langfuse.internal:3000")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    settings = settings_from(parser.parse_args(["serve", "--langfuse", "--upstream", "http://127.0.0.1:9/v1"]))
    assert settings.langfuse is True
    assert settings.langfuse_public_key == PUBLIC_KEY
    assert settings.langfuse_secret_key.get_secret_value() == SECRET_KEY
    assert settings.langfuse_base_url == "http://langfuse.internal:3000"
    no_langfuse_env.setenv("LANGFUSE_BASE_URL", "https://eu.cloud.langfuse.com")  # the newer name wins
    assert Settings().langfuse_base_url == "https://eu.cloud.langfuse.com"
    assert Settings().langfuse is False  # the keys alone turn nothing on


async def test_the_secret_key_never_shows(
    langfuse_api: LangfuseAPI, no_langfuse_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    langfuse_api.traces.mock(return_value=httpx.Response(401, json={"message": "Invalid credentials"}))
    langfuse_api.scores.mock(side_effect=httpx.ConnectError("refused"))
    exporter = LangfuseExporter(config(max_attempts=2))
    exporter.start()
    with caplog.at_level(logging.DEBUG, logger="tracetrain"):
        exporter.call_recorded(recorded_call(1))
        exporter.rewards_recorded([{"trajectory_id": "traj-direct", "reward": 1.0}])
        await eventually(lambda: exporter.rejected == 1 and exporter.failed == 1)
        await exporter.aclose()
    settings = Settings(langfuse=True, langfuse_public_key=PUBLIC_KEY, langfuse_secret_key=SECRET_KEY)
    shown = [caplog.text, repr(exporter), repr(exporter.config), repr(settings), str(settings.model_dump())]
    assert "Invalid credentials" in caplog.text and "refused" in caplog.text  # the failures are logged
    assert not any(SECRET_KEY in text for text in shown)
