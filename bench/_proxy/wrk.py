"""The load generator: ``wrk --latency`` with ``bench/wrk/chat.lua``, and the line that script prints."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .servers import Server

WRK_SCRIPT = Path(__file__).resolve().parents[1] / "wrk" / "chat.lua"


@dataclass(frozen=True, slots=True)
class WrkResult:
    """What ``chat.lua``'s ``done()`` reports for one wrk run (latencies in ms)."""

    sent: int  # requests written, including those in flight when wrk stopped
    completed: int  # responses received
    duration_s: float
    errors: dict[str, int]  # connect, read, write, timeout, status (non-2xx/3xx answers)
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.completed / self.duration_s

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def parse_wrk(stdout: str) -> WrkResult:
    """Read the ``BENCH_RESULT key=value ...`` line that ``bench/wrk/chat.lua`` prints."""
    match = re.search(r"^BENCH_RESULT (.*)$", stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no BENCH_RESULT line:\n{stdout}")
    v = {key: float(value) for key, value in (pair.split("=") for pair in match.group(1).split())}
    return WrkResult(
        sent=int(v["sent"]),
        completed=int(v["completed"]),
        duration_s=v["duration_us"] / 1e6,
        errors={k: int(v[k]) for k in ("connect", "read", "write", "timeout", "status")},
        p50_ms=v["p50_us"] / 1000,
        p99_ms=v["p99_us"] / 1000,
    )


def run_wrk(server: Server, mode: str, concurrency: int, seconds: int, tag: str) -> WrkResult:
    """``wrk --latency`` with min(2, c) threads and c connections; ids are ``TAG-<thread>-<n>``."""
    load = [f"-t{min(2, concurrency)}", f"-c{concurrency}", f"-d{seconds}s", "--latency", "--timeout", "30s"]
    argv = ["wrk", *load, "-s", str(WRK_SCRIPT), server.url, "--", server.model, mode, tag, server.api]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr}{done.stdout}")
    return parse_wrk(done.stdout)
