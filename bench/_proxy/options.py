"""What a run measures: the targets, the modes, and the options of the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TARGETS = ("direct", "tracetrain", "litellm")
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
    observe: bool = False  # tracetrain with --langfuse (to a local sink) and /metrics scraped every second
