"""What exporting one call costs, by part: the proxy's hand-off against the export process's work.

For N recorded calls shaped like the proxy's (a chat call of a few hundred bytes), side by side:

- hand-off: what the proxy's process does per call (``call_tuple``, and pickling it as the
  multiprocessing queue's thread does);
- in the export process, per receiver: the span from the record, its attributes rendered (GenAI
  conventions; Langfuse's dialect), and OpenTelemetry's encoder (``encode_spans``, protobuf), in
  batches of 512 as the batch processor sends them; gzip for Langfuse.

Prints microseconds per call for each, best of ``--rounds``, and the ratio of the export work to the hand-off.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource

from proxy.observability._export_wire import call_tuple, write_of
from proxy.observability._genai import call_attributes
from proxy.observability._langfuse_wire import generation_attributes
from proxy.observability._otlp import _CallSpan
from store import CallWrite

BATCH = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def recorded_call(i: int) -> CallWrite:
    """A chat call's record as the proxy makes it (proxy.gateway._call.call_write), its token ids included."""
    row = {
        "id": f"call-{i:032x}", "trajectory_id": f"traj-{i}", "group_id": "grp", "policy": "agent",
        "endpoint": "chat.completions", "model": "agent", "served_model": "agent@2", "version": 2, "stream": False,
        "request": {"model": "agent", "messages": QUESTION, "temperature": 0.7, "max_tokens": 16},
        "response": {"id": f"chatcmpl-{i}", "choices": [{"index": 0, "message": {"role": "assistant",
                     "content": "The capital of France is Paris."}}]},
        "prompt_token_ids": list(range(30)), "completion_token_ids": list(range(8)), "logprobs": [-0.5] * 8,
        "finish_reason": "stop", "prompt_tokens": 30, "completion_tokens": 8, "status_code": 200, "error": None,
        "latency_ms": 40.0, "ttft_ms": None, "started_at": 1_700_000_000.0 + i,
    }  # fmt: skip
    return CallWrite(row, row["trajectory_id"], "grp", "agent", "header", None, None, row["started_at"], 2)


def best_us(work: Callable[[], Any], n: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n, rounds = args.calls, args.rounds
    resource = Resource.create({"service.name": "tracetrain"})
    writes = [recorded_call(i) for i in range(n)]
    tuples = [call_tuple(w) for w in writes]
    records = [write_of(t) for t in tuples]
    genai = partial(call_attributes, content=False)

    def spans(render: Callable[..., Any]) -> list[_CallSpan]:
        return [_CallSpan(w, render, resource) for w in records]

    def encoded(render: Callable[..., Any]) -> list[bytes]:
        built = spans(render)
        return [encode_spans(built[i : i + BATCH]).SerializePartialToString() for i in range(0, n, BATCH)]

    langfuse_bodies = encoded(generation_attributes)
    rows = {
        "hand-off: call_tuple": best_us(lambda: [call_tuple(w) for w in writes], n, rounds),
        "hand-off: pickle (the queue's thread)": best_us(lambda: pickle.dumps(tuples, protocol=5), n, rounds),
        "export: span + GenAI attributes": best_us(lambda: [dict(s.attributes) for s in spans(genai)], n, rounds),
        "export: + OpenTelemetry's encoder (OTLP)": best_us(lambda: encoded(genai), n, rounds),
        "export: Langfuse's span, encoded": best_us(lambda: encoded(generation_attributes), n, rounds),
        "export: gzip of Langfuse's batches": best_us(lambda: [gzip.compress(b) for b in langfuse_bodies], n, rounds),
    }
    for name, us in rows.items():
        print(f"{name:45s} {us:8.2f} us/call")
    hand_off = rows["hand-off: call_tuple"] + rows["hand-off: pickle (the queue's thread)"]
    export = sum(v for k, v in rows.items() if k.startswith("export: ") and "span + GenAI" not in k)
    print(
        f"\nhand-off {hand_off:.2f} us/call in the proxy's process; both receivers' encoding {export:.2f} us/call "
        f"in the export process ({export / hand_off:.0f}x)"
    )


if __name__ == "__main__":
    main()
