"""Langfuse export: what reaches Langfuse's two endpoints, and what an outage costs (no capture, no
latency; counted drops; delivery resumes).

The real proxy runs against the fake vLLM on loopback and exports to a receiver on loopback standing in
for Langfuse (``tests/otlp_receiver.py``): the generations arrive as OTLP/HTTP protobuf from OpenTelemetry's
own exporter and are decoded with ``opentelemetry-proto``; the scores arrive as JSON. The attribute names
and the trace id are checked against the ``langfuse`` SDK's. The score sender's batching, retries, bounded
queue and shutdown are tested on it directly, with short intervals.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fake_vllm import FakeVLLM, Reply, serve_in_thread
from fastapi import FastAPI
from langfuse import Langfuse, LangfuseOtelSpanAttributes
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.resources import Resource
from otlp_receiver import Answer, OtlpReceiver, attributes, otlp_receiver, wait_until
from pydantic import SecretStr, ValidationError

from proxy import Settings, create_app
from proxy.observability import Exporters
from proxy.observability._export_process import ExportConfig, langfuse_receiver
from proxy.observability._langfuse import LangfuseConfig, LangfuseScores
from proxy.observability._langfuse_wire import SCORES_PATH, TRACES_PATH, generation_attributes, trace_id
from proxy.observability._otlp import OtlpExport
from store import CallWrite
from tracetrain_cli._serve_command import settings_from
from tracetrain_cli._serve_flags import add_serve_parser

PUBLIC_KEY = "pk-lf-0a1b2c3d-public"
SECRET_KEY = "sk-lf-9f8e7d6c-very-secret"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def langfuse() -> Iterator[OtlpReceiver]:
    """Langfuse's two endpoints on loopback: traces decoded, scores kept as JSON; 200 and 202 unless told."""
    with otlp_receiver() as receiver:
        receiver.answer = lambda got: Answer(202 if got.path == SCORES_PATH else 200, b"{}", "application/json")
        yield receiver


def scores_sent(receiver: OtlpReceiver) -> list[dict[str, Any]]:
    return [score for got in receiver.requests_to(SCORES_PATH) for score in got.json()]


async def eventually(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def config(base_url: str, **overrides: Any) -> LangfuseConfig:
    fast = {"flush_interval_s": 0.05, "backoff_s": 0.01, "max_backoff_s": 0.05, "shutdown_timeout_s": 1.0}
    return LangfuseConfig(PUBLIC_KEY, SecretStr(SECRET_KEY), base_url, **{**fast, **overrides})


def recorded_call(i: int, trajectory_id: str = "traj-direct", **call: Any) -> CallWrite:
    """A CallWrite shaped like the proxy's (see proxy.gateway._call.call_write)."""
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


@dataclass
class ProxyWithLangfuse:
    url: str
    app: FastAPI

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    @property
    def exported(self) -> dict[str, int]:
        exporters = self.app.state.services.exporters
        assert isinstance(exporters, Exporters)
        return exporters.stats()["langfuse"]

    def calls(self, trajectory_id: str) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.v1}/trajectories/{trajectory_id}").json()["calls"])


@pytest.fixture
def proxy(tmp_path: Path, fake: FakeVLLM, langfuse: OtlpReceiver) -> Iterator[ProxyWithLangfuse]:
    settings = Settings(
        upstream=f"{fake.url}/v1",  # type: ignore[attr-defined]
        data_dir=tmp_path / "data",
        langfuse=True,
        langfuse_public_key=PUBLIC_KEY,
        langfuse_secret_key=SecretStr(SECRET_KEY),
        langfuse_base_url=langfuse.url,
    )
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield ProxyWithLangfuse(url, app)


# -- what is sent -----------------------------------------------------------------------------


def test_a_trajectory_is_one_trace_its_calls_generations_and_its_reward_scores(
    proxy: ProxyWithLangfuse, fake: FakeVLLM, langfuse: OtlpReceiver
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

    wait_until(lambda: len(langfuse.spans(TRACES_PATH)) == 2 and len(scores_sent(langfuse)) == 2)
    calls = proxy.calls("traj-langfuse-1")
    spans = sorted(langfuse.spans(TRACES_PATH), key=lambda s: s.start_time_unix_nano)
    expected_trace = Langfuse.create_trace_id(seed="traj-langfuse-1")  # findable from the trajectory id
    assert [s.trace_id.hex() for s in spans] == [expected_trace, expected_trace]
    assert len({s.span_id for s in spans}) == 2
    assert all(s.name == "chat agent" for s in spans)  # no reward span: Langfuse gets rewards as scores

    for span, call in zip(spans, calls, strict=True):
        a = attributes(span.attributes)
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
        start, end = span.start_time_unix_nano, span.end_time_unix_nano
        assert abs(start - call["started_at"] * 1e9) < 1e3  # within a microsecond of the record
        assert abs((end - start) - call["latency_ms"] * 1e6) < 1e3
        assert not any(name.startswith("gen_ai.") for name in a)  # Langfuse's dialect only

    plain, stream = attributes(spans[0].attributes), attributes(spans[1].attributes)
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
    assert spans[1].start_time_unix_nano < first_token_s * 1e9 < spans[1].end_time_unix_nano

    scores = {s["name"]: s for s in scores_sent(langfuse)}
    assert set(scores) == {"reward", "correct"}
    assert scores["reward"]["value"] == 0.75 and scores["correct"]["value"] == 1.0
    assert {s["traceId"] for s in scores.values()} == {expected_trace}
    assert scores["reward"]["dataType"] == "NUMERIC"
    assert scores["reward"]["metadata"]["trajectory_id"] == "traj-langfuse-1"

    credentials = "Basic " + base64.b64encode(f"{PUBLIC_KEY}:{SECRET_KEY}".encode()).decode()
    [traces] = {got.path: got for got in langfuse.requests_to(TRACES_PATH)}.values()
    assert traces.headers["authorization"] == credentials
    assert traces.headers["x-langfuse-ingestion-version"] == "4"
    assert traces.headers["content-encoding"] == "gzip"
    assert traces.headers["content-type"] == "application/x-protobuf"
    assert langfuse.requests_to(SCORES_PATH)[-1].headers["authorization"] == credentials
    wait_until(lambda: proxy.exported["sent"] == 2)  # the export process publishes its counters every 0.2 s


def test_span_attributes_are_the_ones_the_langfuse_sdk_defines() -> None:
    known = {v for k, v in vars(LangfuseOtelSpanAttributes).items() if not k.startswith("_")}
    metadata = (LangfuseOtelSpanAttributes.OBSERVATION_METADATA, LangfuseOtelSpanAttributes.TRACE_METADATA)
    write = recorded_call(1, status_code=502, error="upstream down", response=None, ttft_ms=12.0, stream=True)
    names = set(generation_attributes(write))
    unknown = {n for n in names if n not in known and not n.startswith(tuple(f"{m}." for m in metadata))}
    assert unknown == set()
    assert trace_id("traj-x") == Langfuse.create_trace_id(seed="traj-x")


def test_a_failed_call_is_an_error_generation(langfuse: OtlpReceiver) -> None:
    export = OtlpExport(langfuse_receiver(config(langfuse.url)), ExportConfig(flush_interval_s=0.05),
                        Resource.create({}))  # fmt: skip
    export.call_recorded(recorded_call(1, status_code=502, error="upstream down", response=None))
    export.close()
    [span] = langfuse.spans(TRACES_PATH)
    a = attributes(span.attributes)
    assert a["langfuse.observation.level"] == "ERROR"
    assert a["langfuse.observation.status_message"] == "upstream down"
    assert (span.status.code, span.status.message) == (Status.STATUS_CODE_ERROR, "upstream down")
    assert orjson.loads(a["langfuse.observation.output"]) is None
    assert span.kind == Span.SPAN_KIND_CLIENT


def test_without_the_flag_nothing_is_sent(start_proxy: Callable[..., Any], langfuse: OtlpReceiver) -> None:
    running = start_proxy()
    assert httpx.post(f"{running.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}).is_success
    running.stop()
    assert langfuse.attempts == []


def test_a_collectors_headers_never_reach_langfuse(
    start_proxy: Callable[..., Any], langfuse: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_EXPORTER_OTLP_HEADERS hold the collector's key: Langfuse, another company, must not get it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=ck-5f4e3d2c1b")
    with otlp_receiver() as collector:
        running = start_proxy(otlp_endpoint=collector.url, langfuse=True, langfuse_public_key=PUBLIC_KEY,
                              langfuse_secret_key=SECRET_KEY, langfuse_base_url=langfuse.url)  # fmt: skip
        assert httpx.post(f"{running.v1}/chat/completions", json={"model": "agent", "messages": QUESTION})
        wait_until(lambda: len(collector.spans()) == 1 and len(langfuse.spans(TRACES_PATH)) == 1)
        running.stop()
    assert collector.received[0].headers["x-collector-key"] == "ck-5f4e3d2c1b"
    assert "authorization" not in collector.received[0].headers
    assert "x-collector-key" not in langfuse.requests_to(TRACES_PATH)[0].headers
    assert collector.spans()[0].trace_id == langfuse.spans(TRACES_PATH)[0].trace_id  # one trace, two receivers


# -- outages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("outage", ["503", "refused", "hanging"])
def test_an_outage_neither_loses_captures_nor_slows_calls_and_delivery_resumes(
    proxy: ProxyWithLangfuse, langfuse: OtlpReceiver, outage: str
) -> None:
    port = int(langfuse.url.rsplit(":", 1)[1])
    healthy = langfuse.answer
    if outage == "503":
        langfuse.answer = Answer(503, b"maintenance", "text/plain")
    elif outage == "refused":
        langfuse.stop()
    else:
        langfuse.hang()
    key = {"X-Trajectory-Id": "traj-outage"}
    body = {"model": "agent", "messages": QUESTION}
    started = time.perf_counter()
    for _ in range(5):
        assert httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=key).status_code == 200
    elapsed = time.perf_counter() - started
    assert len(proxy.calls("traj-outage")) == 5  # every call captured
    # A call that waited for Langfuse would take the exporter's 10 s timeout (or httpx's 5 s would fail it): a
    # bound far above the ~0.1 s five calls take, so that only waiting, never a loaded machine, breaks it.
    assert elapsed < 5 * 2.0
    if outage == "refused":
        time.sleep(1.2)  # the exporter tried, and waits to try again
        langfuse.start(port)
    else:
        wait_until(lambda: bool(langfuse.attempts))  # the export was tried
    assert proxy.exported["sent"] == 0

    langfuse.answer = healthy
    langfuse.release()
    wait_until(lambda: proxy.exported["sent"] == 5)  # the SDK's retries delivered them
    assert (proxy.exported["failed"], proxy.exported["dropped"]) == (0, 0)
    assert {attributes(s.attributes)["langfuse.trace.metadata.trajectory_id"] for s in langfuse.spans(TRACES_PATH)} == {
        "traj-outage"
    }


# -- scores: batching, retries, bounds ----------------------------------------------------------------


def reward(trajectory_id: str = "traj-direct", value: float = 0.5, **more: Any) -> dict[str, Any]:
    return {"trajectory_id": trajectory_id, "group_id": "g", "reward": value, "metrics": {}} | more


async def test_scores_that_arrive_within_the_flush_interval_go_in_one_request(langfuse: OtlpReceiver) -> None:
    scores = LangfuseScores(config(langfuse.url, flush_interval_s=0.2))
    scores.start()
    for i in range(7):
        scores.rewards_recorded([reward(f"traj-{i}", metrics={"len": i})])
    await eventually(lambda: scores.sent == 14)
    await scores.aclose()
    assert len(langfuse.requests_to(SCORES_PATH)) == 1
    assert [s["traceId"] for s in scores_sent(langfuse)][::2] == [trace_id(f"traj-{i}") for i in range(7)]


async def test_a_full_batch_of_scores_leaves_at_once_and_the_rest_at_shutdown(langfuse: OtlpReceiver) -> None:
    scores = LangfuseScores(config(langfuse.url, batch_size=10, flush_interval_s=60))
    scores.start()
    scores.rewards_recorded([reward(f"traj-{i}") for i in range(25)])
    await eventually(lambda: scores.sent == 20, timeout_s=20)  # two full batches, not after the 60 s interval
    assert scores.queued == 5
    await scores.aclose()  # flushes the partial batch
    assert [len(got.json()) for got in langfuse.requests_to(SCORES_PATH)] == [10, 10, 5]
    assert scores.sent == 25 and scores.dropped == 0


async def test_the_judges_reward_is_its_own_score_with_its_explanation(langfuse: OtlpReceiver) -> None:
    scores = LangfuseScores(config(langfuse.url))
    scores.start()
    scores.rewards_recorded([reward("traj-a", 1.0, source="judge", explanation="best of its group")])
    await eventually(lambda: scores.sent == 1)
    await scores.aclose()
    [score] = scores_sent(langfuse)
    assert score["name"] == "reward.judge" and score["comment"] == "best of its group"
    assert score["traceId"] == trace_id("traj-a")


async def test_a_full_queue_drops_and_counts_then_sends_what_it_kept(langfuse: OtlpReceiver) -> None:
    scores = LangfuseScores(config(langfuse.url, max_queue=10))
    scores.rewards_recorded([reward(f"traj-{i}") for i in range(25)])  # not started yet: nothing leaves
    assert (scores.queued, scores.dropped) == (10, 15)
    scores.start()
    await eventually(lambda: scores.sent == 10)
    await scores.aclose()
    assert scores.stats() == {"queued": 0, "sent": 10, "dropped": 15, "rejected": 0, "failed": 0}


async def test_retries_back_off_exponentially(langfuse: OtlpReceiver) -> None:
    replies = iter([Answer(503), Answer(429), Answer(202, b"{}", "application/json")])
    sent_at: list[float] = []

    def reply(got: Any) -> Answer:
        sent_at.append(time.monotonic())
        return next(replies)

    langfuse.answer = reply
    scores = LangfuseScores(config(langfuse.url, backoff_s=0.1, max_backoff_s=1.0))
    scores.start()
    scores.rewards_recorded([reward()])
    await eventually(lambda: scores.sent == 1)
    await scores.aclose()
    waits = [later - earlier for earlier, later in itertools.pairwise(sent_at)]
    # Lower bounds only (a loaded machine only adds): backoff_s, then twice it, each halved at worst.
    assert len(sent_at) == 3 and waits[0] >= 0.05 and waits[1] >= 0.1


async def test_a_request_is_given_up_after_bounded_retries_and_later_ones_still_go(langfuse: OtlpReceiver) -> None:
    langfuse.answer = Answer(503)
    scores = LangfuseScores(config(langfuse.url, max_attempts=3))
    scores.start()
    scores.rewards_recorded([reward(f"traj-{i}") for i in range(4)])
    await eventually(lambda: scores.failed == 4)
    assert len(langfuse.attempts) == 3 and scores.sent == 0
    langfuse.answer = Answer(202, b"{}", "application/json")
    scores.rewards_recorded([reward("traj-9")])
    await eventually(lambda: scores.sent == 1)
    await scores.aclose()
    assert scores.failed == 4  # what was given up stays given up, and counted


async def test_too_many_requests_is_retried_but_a_refusal_is_not(langfuse: OtlpReceiver) -> None:
    replies = iter([Answer(429), Answer(202, b"{}", "application/json")])
    langfuse.answer = lambda got: next(replies)
    scores = LangfuseScores(config(langfuse.url))
    scores.start()
    scores.rewards_recorded([reward()])
    await eventually(lambda: scores.sent == 1)
    assert len(langfuse.attempts) == 2
    langfuse.answer = Answer(401, b'{"message": "Invalid keys"}', "application/json")
    scores.rewards_recorded([reward("traj-2"), reward("traj-3")])
    await eventually(lambda: scores.rejected == 2)
    await scores.aclose()
    assert len(langfuse.attempts) == 3


async def test_partial_successes_count_what_was_rejected(langfuse: OtlpReceiver) -> None:
    langfuse.answer = Answer(207, b'{"accepted": 1, "rejected": 1, "errors": []}', "application/json")
    scores = LangfuseScores(config(langfuse.url))
    scores.start()
    scores.rewards_recorded([{"trajectory_id": "traj-direct", "reward": 0.5, "metrics": {"len": 3}}])
    await eventually(lambda: scores.sent + scores.rejected == 2)
    await scores.aclose()
    assert (scores.sent, scores.rejected) == (1, 1)


async def test_shutdown_gives_up_within_its_time_limit_and_counts_what_was_left(langfuse: OtlpReceiver) -> None:
    langfuse.stop()  # refused
    scores = LangfuseScores(config(langfuse.url, shutdown_timeout_s=0.3, backoff_s=0.2, max_backoff_s=0.2,
                                   max_attempts=100))  # fmt: skip
    scores.start()
    scores.rewards_recorded([reward(f"traj-{i}") for i in range(3)])
    started = time.perf_counter()
    await scores.aclose()
    assert time.perf_counter() - started < 5.0  # not 0.3 s plus overhead: 100 attempts 0.1-0.2 s apart take 10 s+
    assert (scores.sent, scores.dropped) == (0, 3)
    scores.rewards_recorded([reward("traj-4")])  # after shutdown: dropped, not queued
    assert (scores.queued, scores.dropped) == (0, 4)


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


def test_the_secret_key_never_shows(
    proxy: ProxyWithLangfuse,
    langfuse: OtlpReceiver,
    no_langfuse_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    langfuse.answer = Answer(401, b'{"message": "Invalid credentials"}', "application/json")
    with caplog.at_level(logging.DEBUG):
        key = {"X-Trajectory-Id": "traj-secret"}
        assert httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}, headers=key)
        assert httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "traj-secret", "reward": 1.0}).is_success
        wait_until(lambda: proxy.exported["rejected"] == 1 and len(langfuse.attempts) == 2)
        exporters = proxy.app.state.services.exporters
        wait_until(lambda: exporters.scores.rejected == 1)
    settings = Settings(langfuse=True, langfuse_public_key=PUBLIC_KEY, langfuse_secret_key=SECRET_KEY)
    shown = [caplog.text, repr(exporters.scores), repr(exporters.scores.config), repr(settings),
             str(settings.model_dump()), httpx.get(f"{proxy.url}/metrics").text]  # fmt: skip
    assert "Invalid credentials" in caplog.text  # the refusal is logged
    assert not any(SECRET_KEY in text for text in shown)
    assert not any(base64.b64encode(f"{PUBLIC_KEY}:{SECRET_KEY}".encode()).decode() in text for text in shown)
