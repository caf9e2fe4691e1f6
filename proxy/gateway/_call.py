"""One call in flight, and the record it becomes (``call_write``): what the forwarder and a stream's relay share."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.gateway._capture import Asked, Capture, Endpoint
from proxy.gateway._keying import Conversation, Key
from proxy.gateway._policies import Route
from proxy.gateway._served import Served
from store import CallWrite


@dataclass(slots=True)
class Call:
    """One call in flight: what it asked, where it goes, whose it is."""

    endpoint: Endpoint
    body: dict[str, Any]
    route: Route
    key: Key
    conversation: Conversation
    asked: Asked
    started_at: float
    t0: float
    # The API the client spoke when the proxy translated it to chat ("responses", "messages"): the endpoint recorded.
    api: str | None = None
    served: Served = field(default_factory=Served)  # what the model and its vLLM take (the app's)
    # The grammar vLLM samples this call under (tracetrain_core.structured_outputs); None: unconstrained.
    structured_outputs: dict[str, Any] | None = None
    # The record's id, known before the answer: every response names it (X-Call-Id) so that one call can be
    # rewarded. Ordered by time as UUIDv7 is (the clock's nanoseconds, then 64 random bits): the calls' unique
    # index then grows at its end, not at a random page of it in every commit (a lone call's record: ~8% faster).
    id: str = field(default_factory=lambda: f"call-{time.time_ns():016x}{os.urandom(8).hex()}")

    def headers(self) -> dict[str, str]:
        return {
            "X-Trajectory-Id": self.key.trajectory_id,
            "X-Group-Id": self.key.group_id,
            "X-Call-Id": self.id,
            "X-Policy-Version": str(self.route.version),
        }


def call_write(
    call: Call,
    capture: Capture | None,
    response: dict[str, Any] | None,
    status: int,
    error: str | None,
    ttft_ms: float | None,
) -> CallWrite:
    """The store's record of ``call``: what vLLM answered (``capture``), how it ended, its trajectory's row."""
    first = capture.first if capture else None
    usage = (capture.usage if capture else None) or {}
    tail = None
    if call.key.keyed_by in ("thread", "new") and first is not None and status == 200:
        tail = call.conversation.tail_after(first.message())
    others = (
        [
            {"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            for i, c in sorted(capture.choices.items())[1:]
        ]
        if capture
        else []
    )
    row = {
        "id": call.id,
        "trajectory_id": call.key.trajectory_id,
        "group_id": call.key.group_id,
        "policy": call.route.policy,
        "endpoint": call.api or call.endpoint,
        "model": str(call.body.get("model")),
        "served_model": call.route.served_model,
        "version": call.route.version,
        "stream": bool(call.body.get("stream")),
        "request": call.body,
        "response": response,
        "prompt_token_ids": capture.prompt_ids() if capture else [],
        "completion_token_ids": first.token_ids if first else [],
        "logprobs": first.logprobs if first else [],
        "other_choices": others,
        "finish_reason": first.finish_reason if first else None,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "status_code": status,
        "error": error,
        "latency_ms": (time.perf_counter() - call.t0) * 1000,
        "ttft_ms": ttft_ms,
        "started_at": call.started_at,
        "structured_outputs": call.structured_outputs,
    }
    return CallWrite(
        row,
        call.key.trajectory_id,
        call.key.group_id,
        call.route.policy,
        call.key.keyed_by,
        call.key.task_key,
        tail,
        call.started_at,
        call.route.version,
        call.key.seat_in,
    )
