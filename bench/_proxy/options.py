"""What a run measures: the targets, the modes, and the options of the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# "responses" and "messages": tracetrain's /v1/responses and /v1/messages (translated to chat for the same
# upstream), so their added latency reads beside chat's ("tracetrain"). "exporting": a second tracetrain process,
# the same but exporting every call over OTLP and to Langfuse (a collector on loopback), beside "tracetrain".
TARGETS = ("direct", "tracetrain", "exporting", "responses", "messages", "litellm")
# The targets served by a tracetrain process, each by the API it speaks.
TRACETRAIN_APIS = {"tracetrain": "chat", "exporting": "chat", "responses": "responses", "messages": "messages"}
MODES = ("plain", "stream")


@dataclass(frozen=True, slots=True)
class Options:
    duration_s: int
    warmup_s: int
    concurrency: tuple[int, ...]
    targets: tuple[str, ...]
    ttfb_requests: int
    out: Path | None
    profile: Path | None
    upstreams: int = 1  # fake vLLM servers behind tracetrain (its router spreads trajectories over them)
    observe: bool = False  # tracetrain with --langfuse (to a local collector) and /metrics scraped every second
