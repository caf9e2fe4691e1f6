"""tracetrain under ``py-spy record --gil`` during a plain c=64 run, summed up by function and package."""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .runs import Bench
from .servers import tool

PROFILE_RATE_HZ = 100


def profile_tracetrain(bench: Bench, raw: Path, seconds: int) -> str:
    """py-spy on tracetrain during a plain c=64 wrk run: samples of the GIL holder's stack.

    Blocking mode (py-spy pauses the process for each sample): ``--nonblocking`` reads the
    stacks while they change, and truncated most of them here.
    """
    bench.settle()
    sampling = ["--rate", str(PROFILE_RATE_HZ), "--gil", "--format", "raw", "--output", str(raw)]
    pid = str(bench.servers["tracetrain"].proc.pid)
    argv = [tool("py-spy"), "record", "--pid", pid, "--duration", str(seconds), *sampling]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as spy:
        time.sleep(0.5)
        result = bench.load("tracetrain", "plain", 64, seconds + 2, "profile")
        spy.wait(seconds + 30)
    return summarize_pyspy(raw, seconds) + f"\n  (load while profiled: {result.rps:.0f} req/s)"


def _frame_key(frame: str) -> str:
    """``Forwarder.handle (proxy/gateway/_forward.py:115)`` -> ``proxy/gateway/_forward.py:Forwarder.handle``."""
    match = re.match(r"^(.*) \((.*?)(?::\d+)?\)$", frame)
    return f"{match.group(2)}:{match.group(1)}" if match else frame


def _thread_kind(frames: Sequence[str]) -> str:
    """The event loop's thread, or a worker thread named by the function it runs."""
    if not frames[0].startswith("threading.py:"):
        return "main thread (event loop)"
    return next((f for f in frames if not f.startswith("threading.py:")), "threading")


def summarize_pyspy(raw: Path, seconds: int, top: int = 15) -> str:
    """Samples by thread, top functions by own samples, tracetrain's by total, own samples by package."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_frame_key(f) for f in stack.split(";") if f] or ["<no Python frame>"]
        threads[_thread_kind(frames)] += int(count)
        own[frames[-1]] += int(count)
        packages[frames[-1].split("/")[0].split(":")[0]] += int(count)
        total.update(dict.fromkeys((f for f in frames if not f.startswith("tracetrain_cli/_main.py")), int(count)))
    samples = sum(own.values())
    if not samples:
        return "py-spy recorded no samples"

    def rows(counter: Counter[str], keep: int, prefix: str = "") -> list[str]:
        picked = [(k, v) for k, v in counter.most_common() if k.startswith(prefix)][:keep]
        return [f"    {100 * v / samples:5.1f}%  {k}" for k, v in picked]

    held = 100 * samples / (PROFILE_RATE_HZ * seconds)
    lines = [f"py-spy --gil, {PROFILE_RATE_HZ} Hz, {seconds} s: {samples} samples (GIL held {held:.0f}% of the time)"]
    lines += ["  by thread (% of samples):", *rows(threads, 5)]
    lines += ["  own time, top functions:", *rows(own, top)]
    lines += ["  total time, tracetrain's functions (proxy/):", *rows(total, top, "proxy/")]
    lines += ["  own time by package:", *rows(packages, 12)]
    return "\n".join(lines)
