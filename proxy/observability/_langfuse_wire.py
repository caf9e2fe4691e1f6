"""What Langfuse receives: a call's span attributes in Langfuse's dialect, rewards as scores. Pure, no I/O.

A trajectory is a trace, each captured call a generation in it, each reward a score on it.
The trace id is ``Langfuse.create_trace_id(seed=trajectory_id)`` (the first 16 bytes of the
id's SHA-256, as the SDK derives one, and as ``proxy.observability._genai.trace_id`` does for
every receiver), and the trajectory id is in the trace's metadata. Two endpoints, the ones the
v5 SDK itself uses:

- ``POST /api/public/otel/v1/traces``: OTLP/HTTP, sent by the same OpenTelemetry exporter as any
  collector's spans (``proxy.observability._otlp``), gzipped, with ``x-langfuse-ingestion-version: 4``;
  each span carries the SDK's ``langfuse.*`` attributes written here, the trace's on every span
  (what v4 ingestion expects);
- ``POST /api/public/scores``: a JSON list of scores; 202, or 207 with accepted and rejected counts.

Both take basic auth, public key as the user and secret key as the password.
``tests/test_langfuse.py`` checks the attribute names and the trace id against the SDK.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from proxy.observability._genai import trace_id as otel_trace_id
from store import CallWrite, redact
from tracetrain_core import call_messages, call_reply

TRACES_PATH = "/api/public/otel/v1/traces"
SCORES_PATH = "/api/public/scores"
# Request fields that are the prompt, who asked or the transport, not how to sample (the Responses API's
# input and instructions, Anthropic's system are the prompt too).
_NOT_PARAMETERS = frozenset({"model", "messages", "prompt", "user", "stream", "input", "instructions", "system"})


def rejected_scores(response: httpx.Response) -> int:
    """Scores: 202 accepts all; 207 says ``{"accepted": A, "rejected": R, "errors": [...]}``."""
    if response.status_code != 207:
        return 0
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return int(orjson.loads(response.content).get("rejected") or 0)
    return 0


def trace_id(trajectory_id: str) -> str:
    """The Langfuse trace id of a trajectory, in hex: ``Langfuse.create_trace_id(seed=trajectory_id)``."""
    return f"{otel_trace_id(trajectory_id):032x}"


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _input(call: Mapping[str, Any]) -> Any:
    request = call["request"]
    if call["endpoint"] in ("responses", "messages"):  # shown as the chat messages vLLM was sent
        return call_messages(call["endpoint"], request)
    return request.get("messages", request.get("prompt"))


def _output(call: Mapping[str, Any]) -> Any:
    if call["endpoint"] in ("responses", "messages"):
        return call_reply(call["endpoint"], call.get("response"))
    choices = (call.get("response") or {}).get("choices") or []
    if call["endpoint"] == "chat.completions":
        outputs = [choice.get("message") for choice in choices]
    else:
        outputs = [choice.get("text") for choice in choices]
    return outputs[0] if len(outputs) == 1 else outputs or None


def generation_attributes(write: CallWrite) -> dict[str, str | bool | int | float]:
    """A recorded call's span attributes as Langfuse reads a generation (the span itself: ``_otlp._CallSpan``)."""
    call = write.call
    request: dict[str, Any] = call["request"]
    prompt_tokens, completion_tokens = int(call["prompt_tokens"]), int(call["completion_tokens"])
    parameters = {
        k: v
        for k, v in request.items()
        if k not in _NOT_PARAMETERS and (isinstance(v, str | int | float | bool) or k == "stop")
    }
    attributes: dict[str, str | bool | int | float | None] = {
        # the trace: on every span, as Langfuse v4 expects
        "langfuse.trace.name": write.policy,
        "session.id": write.group_id,  # a GRPO group (one task, several samples) is a session
        "user.id": request.get("user") if isinstance(request.get("user"), str) else None,
        "langfuse.trace.metadata.trajectory_id": write.trajectory_id,
        "langfuse.trace.metadata.group_id": write.group_id,
        "langfuse.trace.metadata.policy": write.policy,
        # the generation
        "langfuse.observation.type": "generation",
        "langfuse.observation.model.name": call["served_model"],
        "langfuse.observation.model.parameters": _json(parameters),
        "langfuse.observation.usage_details": _json(
            {"input": prompt_tokens, "output": completion_tokens, "total": prompt_tokens + completion_tokens}
        ),
        "langfuse.observation.input": _json(_input(call)),
        "langfuse.observation.output": _json(_output(call)),
        "langfuse.version": f"{write.policy}@{write.version}",
        "langfuse.observation.metadata.call_id": call["id"],
        "langfuse.observation.metadata.requested_model": call["model"],
        "langfuse.observation.metadata.endpoint": call["endpoint"],
        "langfuse.observation.metadata.stream": bool(call["stream"]),
        "langfuse.observation.metadata.status_code": int(call["status_code"]),
        "langfuse.observation.metadata.finish_reason": call["finish_reason"],
        "langfuse.observation.metadata.keyed_by": write.keyed_by,
        "langfuse.observation.metadata.latency_ms": float(call["latency_ms"]),
    }
    if call.get("ttft_ms") is not None:
        first_token = float(call["started_at"]) + float(call["ttft_ms"]) / 1000
        attributes["langfuse.observation.completion_start_time"] = _json(_iso(first_token))
    if call["status_code"] != 200:
        attributes["langfuse.observation.level"] = "WARNING" if call["status_code"] == 499 else "ERROR"
        attributes["langfuse.observation.status_message"] = redact(call["error"])
    return {k: v for k, v in attributes.items() if v is not None}


def reward_scores(reward: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A reward as Langfuse scores on its trajectory's trace: ``reward``, then one per metric."""
    trajectory_id = str(reward["trajectory_id"])
    source = str(reward.get("source") or "service")
    common = {
        "traceId": trace_id(trajectory_id),
        "dataType": "NUMERIC",
        "timestamp": _iso(float(reward.get("created_at") or time.time())),
        "metadata": {
            "trajectory_id": trajectory_id,
            "group_id": reward.get("group_id"),
            "source": source,
        },
    }
    name = "reward" if source == "service" else f"reward.{source}"  # the judge's: reward.judge; a person's: .human
    comment = {"comment": reward["explanation"]} if reward.get("explanation") else {}
    scores = [{"id": uuid.uuid4().hex, "name": name, "value": float(reward["reward"]), **common, **comment}]
    for metric, value in (reward.get("metrics") or {}).items():
        scores.append({"id": uuid.uuid4().hex, "name": str(metric), "value": float(value), **common})
    return scores
