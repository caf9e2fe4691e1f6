"""The OpenTelemetry export: each captured call a span in the GenAI semantic conventions, a trajectory a trace.

The real proxy runs against the fake vLLM on loopback and exports, through OpenTelemetry's own SDK and
OTLP/HTTP exporter, to a receiver on loopback that decodes the requests with ``opentelemetry-proto``
(``tests/otlp_receiver.py``). Queue bounds, outages and shutdown are tested on one receiver's pipeline.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fake_vllm import FakeVLLM, Reply, serve_in_thread
from fastapi import FastAPI
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.resources import Resource
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
from otlp_receiver import Answer, OtlpReceiver, attributes, otlp_receiver, wait_until
from pydantic import ValidationError

from proxy import Settings, create_app
from proxy.observability import Exporters, start_exporters
from proxy.observability._export_process import ExportConfig
from proxy.observability._genai import call_attributes
from proxy.observability._otlp import OtlpExport, Receiver
from store import CallWrite

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
RESOURCE = Resource.create({"service.name": "tracetrain"})


def trace_of(trajectory_id: str) -> bytes:
    return hashlib.sha256(trajectory_id.encode()).digest()[:16]


@dataclass
class ExportingProxy:
    url: str
    app: FastAPI

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    @property
    def exporters(self) -> Exporters:
        exporters = self.app.state.services.exporters
        assert isinstance(exporters, Exporters)
        return exporters

    def otlp(self) -> dict[str, int]:
        return self.exporters.stats()["otlp"]

    def calls(self, trajectory_id: str) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.v1}/trajectories/{trajectory_id}").json()["calls"])


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture
def start_exporting(tmp_path: Path, fake: FakeVLLM, receiver: OtlpReceiver) -> Iterator[Callable[..., ExportingProxy]]:
    stops: list[Any] = []

    def start(**settings: Any) -> ExportingProxy:
        options = {"upstream": f"{fake.url}/v1", "data_dir": tmp_path / "data", "otlp_endpoint": receiver.url}  # type: ignore[attr-defined]
        app = create_app(Settings(**{**options, **settings}))
        serving = serve_in_thread(app)
        url = serving.__enter__()
        stops.append(serving)
        return ExportingProxy(url, app)

    yield start
    for serving in reversed(stops):
        serving.__exit__(None, None, None)


def recorded_call(i: int, trajectory_id: str = "traj-direct", **call: Any) -> CallWrite:
    """A CallWrite shaped like the proxy's (see proxy.gateway._call.call_write)."""
    row = {
        "id": f"call-{i:032x}", "trajectory_id": trajectory_id, "group_id": "grp", "policy": "agent",
        "endpoint": "chat.completions", "model": "agent", "served_model": "agent@2", "version": 2, "stream": False,
        "request": {"model": "agent", "messages": QUESTION, "temperature": 0.7},
        "response": {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}]},
        "finish_reason": "stop", "prompt_tokens": 12, "completion_tokens": 3, "status_code": 200, "error": None,
        "latency_ms": 40.0, "ttft_ms": None, "started_at": 1_700_000_000.0 + i,
    } | call  # fmt: skip
    return CallWrite(row, trajectory_id, "grp", "agent", "header", None, None, row["started_at"], 2)


def pipeline(receiver: OtlpReceiver, **config: Any) -> OtlpExport:
    fast = {"flush_interval_s": 0.05, "timeout_s": 2.0, "shutdown_timeout_s": 1.0}
    render = Receiver("otlp", f"{receiver.url}/v1/traces", lambda w: call_attributes(w, content=False))
    return OtlpExport(render, ExportConfig(**{**fast, **config}), RESOURCE)


def by_start(spans: list[Span]) -> list[Span]:
    return sorted(spans, key=lambda s: s.start_time_unix_nano)


# -- what a collector receives ------------------------------------------------------------------------------------


def test_each_call_is_a_genai_span_and_each_trajectory_its_own_trace(
    start_exporting: Callable[..., ExportingProxy], fake: FakeVLLM, receiver: OtlpReceiver
) -> None:
    proxy = start_exporting()
    fake.script(Reply(content="Paris."), Reply(content="Yes."), Reply(content="Rome."))
    a = {"X-Trajectory-Id": "traj-otel-a", "X-Group-Id": "grp-capitals"}
    body = {"model": "agent", "messages": QUESTION, "temperature": 0.5, "top_p": 0.9, "max_tokens": 16,
            "seed": 7, "stop": ["\n\n"]}  # fmt: skip
    assert httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=a).status_code == 200
    streamed = {"model": "agent", "messages": [*QUESTION, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "Sure?"}], "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=streamed, headers=a) as response:
        response.read()
    b = {"X-Trajectory-Id": "traj-otel-b"}
    assert httpx.post(f"{proxy.v1}/completions", json={"model": "agent", "prompt": "Italy:"}, headers=b).is_success

    wait_until(lambda: len(receiver.spans()) == 3)
    spans = by_start(receiver.spans())
    assert [s.trace_id for s in spans] == [trace_of("traj-otel-a")] * 2 + [trace_of("traj-otel-b")]
    assert len({s.span_id for s in spans}) == 3 and all(len(s.span_id) == 8 for s in spans)
    assert [s.name for s in spans] == ["chat agent", "chat agent", "text_completion agent"]
    assert {s.kind for s in spans} == {Span.SPAN_KIND_CLIENT}
    assert receiver.received[0].resource["service.name"] == "tracetrain"

    calls = proxy.calls("traj-otel-a") + proxy.calls("traj-otel-b")
    for span, call in zip(spans, calls, strict=True):
        got = attributes(span.attributes)
        assert got["gen_ai.provider.name"] == "vllm" and got["gen_ai.system"] == "vllm"
        assert got["gen_ai.request.model"] == "agent"
        assert got["gen_ai.response.model"] == "agent@0"
        assert got["gen_ai.usage.input_tokens"] == call["prompt_tokens"] > 0
        assert got["gen_ai.usage.output_tokens"] == call["completion_tokens"] > 0
        assert got["gen_ai.response.finish_reasons"] == [call["finish_reason"]]
        assert got["gen_ai.conversation.id"] == call["trajectory_id"]
        assert got["tracetrain.call.id"] == call["id"]
        assert abs(span.start_time_unix_nano - call["started_at"] * 1e9) < 1e3  # within a microsecond
        assert abs((span.end_time_unix_nano - span.start_time_unix_nano) - call["latency_ms"] * 1e6) < 1e3
        assert "gen_ai.input.messages" not in got  # content is opt-in
        assert span.status.code == Status.STATUS_CODE_UNSET
    first, stream, text = (attributes(s.attributes) for s in spans)
    assert first["gen_ai.operation.name"] == "chat" and text["gen_ai.operation.name"] == "text_completion"
    assert (first["gen_ai.request.temperature"], first["gen_ai.request.top_p"]) == (0.5, 0.9)
    assert (first["gen_ai.request.max_tokens"], first["gen_ai.request.seed"]) == (16, 7)
    assert first["gen_ai.request.stop_sequences"] == ["\n\n"]
    assert first["gen_ai.response.id"].startswith("chatcmpl-")
    assert first["tracetrain.group.id"] == "grp-capitals" and first["gen_ai.request.stream"] is False
    assert stream["gen_ai.request.stream"] is True and stream["gen_ai.response.time_to_first_chunk"] > 0
    assert "gen_ai.request.temperature" not in stream  # not asked: vLLM's default, not a guess


def test_the_attribute_names_are_the_semantic_conventions_own() -> None:
    defined = {v for k, v in vars(gen_ai_attributes).items() if k.startswith("GEN_AI_")}
    written = call_attributes(recorded_call(1, ttft_ms=5.0, stream=True, status_code=502, error="down"), content=True)
    unknown = {name for name in written if name.startswith("gen_ai.") and name not in defined}
    assert unknown == set()
    assert {n.split(".")[0] for n in written} == {"gen_ai", "tracetrain", "error"}


def test_messages_are_in_the_spans_only_when_asked(
    start_exporting: Callable[..., ExportingProxy], fake: FakeVLLM, receiver: OtlpReceiver
) -> None:
    proxy = start_exporting(otlp_content=True)
    fake.script(Reply(content="Paris."))
    assert httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}).is_success
    wait_until(lambda: len(receiver.spans()) == 1)
    got = attributes(receiver.spans()[0].attributes)
    assert orjson.loads(got["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "What is the capital of France?"}]}
    ]
    assert orjson.loads(got["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "Paris."}], "finish_reason": "stop"}
    ]


def test_tool_calls_and_their_results_are_typed_parts() -> None:
    function = {"name": "look_up", "arguments": '{"q": 1}'}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": function}],
    }
    messages = [*QUESTION, call, {"role": "tool", "tool_call_id": "c1", "content": "Paris"}]
    write = recorded_call(1, request={"model": "agent", "messages": messages})
    got = orjson.loads(call_attributes(write, content=True)["gen_ai.input.messages"])  # type: ignore[arg-type]
    assert got[1] == {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "look_up",
                                                      "arguments": {"q": 1}}]}  # fmt: skip
    assert got[2] == {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "Paris"}]}


def test_a_reward_is_a_span_of_evaluation_events_in_its_trajectory_trace(
    start_exporting: Callable[..., ExportingProxy], receiver: OtlpReceiver
) -> None:
    proxy = start_exporting()
    key = {"X-Trajectory-Id": "traj-rewarded"}
    assert httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}, headers=key)
    reward = {"trajectory_id": "traj-rewarded", "reward": 0.75, "metrics": {"correct": 1.0}}
    assert httpx.post(f"{proxy.v1}/rewards", json=reward).status_code == 200
    wait_until(lambda: len(receiver.spans()) == 2)
    [span] = [s for s in receiver.spans() if s.name == "reward"]
    assert span.trace_id == trace_of("traj-rewarded")
    assert span.start_time_unix_nano == span.end_time_unix_nano > 0
    assert [e.name for e in span.events] == ["gen_ai.evaluation.result"] * 2
    scores = {attributes(e.attributes)["gen_ai.evaluation.name"]: e for e in span.events}
    assert attributes(scores["reward"].attributes)["gen_ai.evaluation.score.value"] == 0.75
    assert attributes(scores["correct"].attributes)["gen_ai.evaluation.score.value"] == 1.0
    assert attributes(span.attributes)["tracetrain.reward.source"] == "service"
    sent = 'tracetrain_export_items{outcome="sent",receiver="otlp"} 2.0'
    wait_until(lambda: sent in httpx.get(f"{proxy.url}/metrics").text)  # published every 0.2 s


def test_a_failed_call_is_an_error_span(receiver: OtlpReceiver) -> None:
    export = pipeline(receiver)
    export.call_recorded(recorded_call(1, status_code=502, error="upstream down", response=None, finish_reason=None))
    export.close()
    [span] = receiver.spans()
    assert span.status.code == Status.STATUS_CODE_ERROR and span.status.message == "upstream down"
    got = attributes(span.attributes)
    assert got["error.type"] == "502" and "gen_ai.response.finish_reasons" not in got


# -- outages, bounds, shutdown ------------------------------------------------------------------------------------


@pytest.mark.parametrize("outage", ["503", "refused", "hanging"])
def test_a_dead_collector_neither_slows_nor_fails_calls_and_what_it_missed_is_counted(
    start_exporting: Callable[..., ExportingProxy], receiver: OtlpReceiver, outage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")  # the SDK's retries give up after 2 s, not 10
    if outage == "503":
        receiver.answer = Answer(503)
    elif outage == "hanging":
        receiver.hang()
    proxy = start_exporting()
    if outage == "refused":
        receiver.stop()
    key = {"X-Trajectory-Id": "traj-outage"}
    started = time.perf_counter()
    for _ in range(5):
        response = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": QUESTION},
                              headers=key)  # fmt: skip
        assert response.status_code == 200
    # Nothing waited for the collector: a call that did would take the SDK's 2 s timeout, 10 s for five; ~0.1 s
    # without, and the bound sits between so that only waiting, not a loaded machine, breaks it.
    assert time.perf_counter() - started < 5.0
    assert len(proxy.calls("traj-outage")) == 5
    if outage == "hanging":
        wait_until(receiver.entered.is_set)
        assert proxy.otlp()["sent"] == 0
        receiver.release()
        wait_until(lambda: proxy.otlp()["sent"] == 5)
    else:
        wait_until(lambda: proxy.otlp()["failed"] == 5)  # given up after the SDK's retries, and counted
        assert proxy.otlp()["sent"] == 0


def test_a_full_queue_drops_and_counts_by_count_and_by_bytes(receiver: OtlpReceiver) -> None:
    receiver.hang()
    export = pipeline(receiver, max_queue=4, batch_size=1)
    for i in range(10):
        export.call_recorded(recorded_call(i))
    wait_until(receiver.entered.is_set)  # at most one in flight and four queued: the rest dropped, at once
    assert export.queued <= 4 and export.stats()["dropped"] >= 5
    receiver.release()
    export.close()
    stats = export.stats()
    assert (stats["queued"], stats["queued_bytes"], stats["rejected"], stats["failed"]) == (0, 0, 0, 0)
    assert stats["sent"] + stats["dropped"] == 10 and stats["sent"] == len(receiver.spans()) <= 5

    receiver.hang()
    small = pipeline(receiver, max_queue_bytes=3 * 2048 + 100, batch_size=1)  # each call: ~2 kB estimated
    long_prompt = recorded_call(99, prompt_tokens=10_000)  # ~160 kB estimated: never fits
    small.call_recorded(long_prompt)
    for i in range(5):
        small.call_recorded(recorded_call(i))
    assert small.stats()["dropped"] >= 3 and small.queued_bytes <= 3 * 2048 + 100
    receiver.release()
    small.close()


def test_shutdown_sends_what_is_queued_and_gives_up_in_time(receiver: OtlpReceiver) -> None:
    export = pipeline(receiver, flush_interval_s=60.0)  # nothing leaves before shutdown
    for i in range(3):
        export.call_recorded(recorded_call(i))
    export.close()
    assert len(receiver.spans()) == 3 and export.stats()["sent"] == 3

    receiver.hang()
    stuck = pipeline(receiver, flush_interval_s=60.0, shutdown_timeout_s=0.3, timeout_s=30.0)
    for i in range(3):
        stuck.call_recorded(recorded_call(i))
    started = time.perf_counter()
    stuck.close()
    assert time.perf_counter() - started < 10.0  # 0.3 s and overhead; without the limit, the 30 s request timeout
    assert stuck.stats()["sent"] == 0
    stuck.call_recorded(recorded_call(9))  # after shutdown: dropped, not queued
    assert stuck.queued == 0 and stuck.stats()["dropped"] >= 1
    receiver.release()


def test_refusals_and_partial_successes_count_as_rejected(receiver: OtlpReceiver) -> None:
    receiver.answer = Answer.rejecting(1)
    export = pipeline(receiver, batch_size=2)
    export.call_recorded(recorded_call(1))
    export.call_recorded(recorded_call(2))
    wait_until(lambda: export.stats()["sent"] + export.stats()["rejected"] == 2)
    receiver.answer = Answer(400, b"bad request", "text/plain")
    export.call_recorded(recorded_call(3))
    wait_until(lambda: export.stats()["rejected"] == 2)
    export.close()
    assert (export.stats()["sent"], export.stats()["failed"]) == (1, 0)


# -- configuration ------------------------------------------------------------------------------------------------


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
                 "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "TRACETRAIN_OTLP_ENDPOINT",
                 "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_standard_variables_turn_the_export_on(otel_env: pytest.MonkeyPatch) -> None:
    assert Settings().otlp_endpoint is None
    assert Settings(otlp_endpoint="http://collector:4318").otlp_endpoint == "http://collector:4318/v1/traces"
    assert (
        Settings(otlp_endpoint="https://c.example/otlp/v1/traces").otlp_endpoint == "https://c.example/otlp/v1/traces"
    )
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/prefix/")
    assert Settings().otlp_endpoint == "http://collector:4318/prefix/v1/traces"
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/custom")
    assert Settings().otlp_endpoint == "http://traces:4318/custom"  # the signal's own URL, as it is
    assert Settings(otlp_endpoint="http://flag:4318").otlp_endpoint == "http://flag:4318/v1/traces"
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert Settings().otlp_endpoint is None
    otel_env.delenv("OTEL_TRACES_EXPORTER")
    otel_env.setenv("OTEL_SDK_DISABLED", "true")
    assert Settings().otlp_endpoint is None
    otel_env.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    assert Settings().otlp_content is True


def test_grpc_and_other_schemes_are_refused_with_what_to_do(otel_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="http"):
        Settings(otlp_endpoint="collector:4317")
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ValidationError, match="4318"):
        Settings(otlp_endpoint="http://collector:4317")


def test_the_collectors_headers_reach_it_and_a_password_in_its_url_is_not_logged(
    start_exporting: Callable[..., ExportingProxy],
    receiver: OtlpReceiver,
    otel_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=ck-123456")
    with_password = receiver.url.replace("http://", "http://user:pa55word-secret@")
    with caplog.at_level(logging.INFO, logger="tracetrain"):
        proxy = start_exporting(otlp_endpoint=with_password)
    assert httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": QUESTION}).is_success
    wait_until(lambda: len(receiver.spans()) == 1)
    assert receiver.received[0].headers["x-collector-key"] == "ck-123456"
    assert "exporting traces over OTLP" in caplog.text and "pa55word-secret" not in caplog.text


# -- the export process --------------------------------------------------------------------------------------------


async def eventually(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_the_export_process_takes_what_is_handed_over_within_its_bound_and_says_what_it_dropped(
    receiver: OtlpReceiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(otlp_endpoint=receiver.url, data_dir=tmp_path)
    exporters = start_exporters(settings, ExportConfig(max_queue=5, flush_interval_s=0.05))
    assert exporters is not None
    for i in range(12):  # the new process is still importing: nothing is taken yet
        exporters.call_recorded(recorded_call(i))
    assert exporters.stats()["handoff"] == {"queued": 5, "queued_bytes": 5 * 2048 + 5 * 16 * 15, "dropped": 7}
    await eventually(lambda: exporters.stats()["otlp"]["sent"] == 5)
    assert exporters.stats()["handoff"]["queued"] == 0 and len(receiver.spans()) == 5

    exporters._process.kill()  # a crash: calls go on being answered, their spans are dropped and said so
    await eventually(lambda: not exporters._process.is_alive())
    with caplog.at_level(logging.WARNING, logger="tracetrain.export"):
        exporters.call_recorded(recorded_call(20))
        exporters._hand_over()
    assert "the export process is gone" in caplog.text and exporters.stats()["handoff"]["dropped"] == 8
    await exporters.aclose()


async def test_shutdown_lets_the_export_process_send_what_was_handed_over(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    exporters = start_exporters(Settings(otlp_endpoint=receiver.url, data_dir=tmp_path),
                                ExportConfig(flush_interval_s=60.0))  # fmt: skip
    assert exporters is not None
    for i in range(3):
        exporters.call_recorded(recorded_call(i))
    started = time.perf_counter()
    await exporters.aclose()
    assert len(receiver.spans()) == 3 and time.perf_counter() - started < 15
    assert exporters.stats()["otlp"]["sent"] == 3 and exporters.stats()["handoff"]["dropped"] == 0
    assert not exporters._process.is_alive()
