"""A captured call as OpenTelemetry's GenAI semantic conventions read it: pure functions, no I/O.

Each call is one span (kind CLIENT, named ``"{operation} {model}"``): ``gen_ai.operation.name``
(``chat``; ``text_completion`` for the legacy completions API), ``gen_ai.provider.name`` and the
older ``gen_ai.system`` (``vllm``: the server that sampled it), the model the client asked for
(``gen_ai.request.model``) and the version that answered (``gen_ai.response.model``,
``agent@3``), the sampling parameters (``gen_ai.request.*``), usage, finish reasons, the
trajectory as ``gen_ai.conversation.id``, and tracetrain's own keys (``tracetrain.*``). A failed
call has ``error.type`` (its HTTP status) and an error status.

A trajectory is a trace: ``trace_id(trajectory_id)`` is the first 16 bytes of its id's SHA-256,
the id Langfuse derives from the same seed (``Langfuse.create_trace_id(seed=...)``), so one
trajectory has the same trace id in every receiver. A reward is a span of its own in that trace,
with one ``gen_ai.evaluation.result`` event per score: the reward, then each of its metrics.

Messages are content: they are exported only when asked (``content=True``; the conventions make
them opt-in), as ``gen_ai.input.messages`` and ``gen_ai.output.messages`` in the conventions'
JSON shape (roles with typed parts: text, tool calls, tool results, reasoning).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from store import CallWrite
from tracetrain_core import call_messages, call_reply

AttributeValue = str | bool | int | float | list[str]

EVALUATION_EVENT = "gen_ai.evaluation.result"
_OPERATIONS = {"completions": "text_completion"}  # every other API is a chat
# Request fields the conventions name, and the field that carries each in OpenAI's and Anthropic's APIs.
_NUMBERS = {
    "gen_ai.request.temperature": ("temperature",),
    "gen_ai.request.top_p": ("top_p",),
    "gen_ai.request.top_k": ("top_k",),
    "gen_ai.request.max_tokens": ("max_tokens", "max_completion_tokens", "max_output_tokens"),
    "gen_ai.request.frequency_penalty": ("frequency_penalty",),
    "gen_ai.request.presence_penalty": ("presence_penalty",),
    "gen_ai.request.seed": ("seed",),
    "gen_ai.request.choice.count": ("n",),
}


def trace_id(trajectory_id: str) -> int:
    """The trace of a trajectory: the first 16 bytes of its id's SHA-256 (Langfuse's ``create_trace_id``)."""
    return int.from_bytes(hashlib.sha256(trajectory_id.encode()).digest()[:16], "big")


def span_id(seed: str) -> int:
    """A span's id from what it stands for (a call's id): the first 8 bytes of its SHA-256."""
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") or 1  # 0 is not a valid id


def estimated_bytes(call: Mapping[str, Any]) -> int:
    """What a queued call's span keeps alive, roughly: its request's and response's text, by their token counts."""
    return 2048 + 16 * (int(call.get("prompt_tokens") or 0) + int(call.get("completion_tokens") or 0))


def operation(endpoint: str) -> str:
    return _OPERATIONS.get(endpoint, "chat")


def span_name(write: CallWrite) -> str:
    return f"{operation(write.call['endpoint'])} {write.call['model']}"


def call_attributes(write: CallWrite, *, content: bool) -> dict[str, AttributeValue]:
    """The span attributes of a recorded call (``content``: its messages too)."""
    call = write.call
    request: Mapping[str, Any] = call["request"] or {}
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation(call["endpoint"]),
        "gen_ai.provider.name": "vllm",
        "gen_ai.system": "vllm",
        "gen_ai.request.model": str(call["model"]),
        "gen_ai.response.model": f"{write.policy}@{write.version}",
        "gen_ai.conversation.id": write.trajectory_id,
        "gen_ai.usage.input_tokens": int(call["prompt_tokens"]),
        "gen_ai.usage.output_tokens": int(call["completion_tokens"]),
    }
    for name, fields in _NUMBERS.items():
        value = next((request[f] for f in fields if _is_number(request.get(f))), None)
        if value is not None:
            attributes[name] = value
    stop = request.get("stop", request.get("stop_sequences"))
    if isinstance(stop, str):
        attributes["gen_ai.request.stop_sequences"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and stop:
        attributes["gen_ai.request.stop_sequences"] = list(stop)
    if call["finish_reason"]:
        attributes["gen_ai.response.finish_reasons"] = [str(call["finish_reason"])]
    response = call.get("response")
    if isinstance(response, Mapping) and isinstance(response.get("id"), str):
        attributes["gen_ai.response.id"] = response["id"]
    if call.get("ttft_ms") is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = float(call["ttft_ms"]) / 1000
    if call["status_code"] != 200:
        attributes["error.type"] = str(call["status_code"])  # the HTTP status the client got
    attributes |= {
        "gen_ai.request.stream": bool(call["stream"]),
        # tracetrain's own: the trajectory is gen_ai.conversation.id, the version is in gen_ai.response.model.
        "tracetrain.group.id": write.group_id,
        "tracetrain.call.id": str(call["id"]),
        "tracetrain.endpoint": str(call["endpoint"]),
        "tracetrain.keyed_by": write.keyed_by,
    }
    if content:
        attributes["gen_ai.input.messages"] = _json(input_messages(call))
        attributes["gen_ai.output.messages"] = _json(output_messages(call))
    return attributes


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def input_messages(call: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request as the conventions' input messages (``[{"role", "parts": [...]}]``)."""
    messages = call_messages(call["endpoint"], call["request"])
    if messages is None:  # a text prompt (the completions API)
        prompt = (call["request"] or {}).get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
        return [{"role": "user", "parts": [_text(t) for t in texts if isinstance(t, str)]}]
    return [_message(m) for m in messages]


def output_messages(call: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The reply as the conventions' output messages, with its finish reason; empty for a failed call."""
    finish = str(call.get("finish_reason") or "")
    reply = call_reply(call["endpoint"], call.get("response"))
    if reply is not None:
        return [_message(reply) | {"finish_reason": finish}]
    choices = (call.get("response") or {}).get("choices") or []
    texts = [c.get("text") for c in choices if isinstance(c, dict) and isinstance(c.get("text"), str)]
    return [{"role": "assistant", "parts": [_text(str(texts[0]))], "finish_reason": finish}] if texts else []


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "content": text}


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    role = str(message.get("role") or "user")
    parts: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        parts.append({"type": "reasoning", "content": reasoning})
    body = message.get("content")
    if role == "tool":
        parts.append({"type": "tool_call_response", "id": message.get("tool_call_id"), "response": body})
        return {"role": role, "parts": parts}
    if isinstance(body, str):
        parts.append(_text(body))
    elif isinstance(body, list):
        for part in body:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(_text(part["text"]))
            elif isinstance(part, dict):
                parts.append({"type": str(part.get("type") or "unknown")})
    for tool_call in message.get("tool_calls") or ():
        if not isinstance(tool_call, dict):
            continue
        function = tool_call.get("function") or {}
        arguments = function.get("arguments")
        with contextlib.suppress(orjson.JSONDecodeError):  # else shown as the model wrote it
            arguments = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        parts.append({"type": "tool_call", "id": tool_call.get("id"), "name": function.get("name"),
                      "arguments": arguments})  # fmt: skip
    return {"role": role, "parts": parts}


def reward_scores(reward: Mapping[str, Any]) -> list[tuple[str, float]]:
    """A reward's scores by name: ``reward`` (``reward.judge`` for the judge's, ``reward.human`` for a person's),
    then each of its metrics."""
    source = str(reward.get("source") or "service")
    name = "reward" if source == "service" else f"reward.{source}"
    return [(name, float(reward["reward"]))] + [
        (str(metric), float(value)) for metric, value in (reward.get("metrics") or {}).items()
    ]


def evaluation_attributes(name: str, value: float, explanation: str | None = None) -> dict[str, AttributeValue]:
    """One ``gen_ai.evaluation.result`` event's attributes."""
    attributes: dict[str, AttributeValue] = {"gen_ai.evaluation.name": name, "gen_ai.evaluation.score.value": value}
    if explanation:
        attributes["gen_ai.evaluation.explanation"] = explanation
    return attributes
