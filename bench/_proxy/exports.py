"""Exporters on against off: "exporting" beside "tracetrain", and what reached the collector.

"exporting" is a second ``tracetrain serve``, the same as "tracetrain" but exporting every call over
OTLP (``--otlp-endpoint``, spans without messages) and to Langfuse (``--langfuse``, spans with messages,
gzipped), both to one collector on loopback that decodes each request (``tests/otlp_receiver.py``). Both
targets run in every cell, back to back, in an order that rotates from cell to cell.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .options import MODES
from .runs import Cell
from .servers import Server


@dataclass(frozen=True, slots=True)
class Exported:
    spans: dict[str, int]  # by the collector's path: /v1/traces (OTLP), /api/public/otel/v1/traces (Langfuse)
    counted: dict[str, dict[str, int]]  # the exporter's own counters, by receiver and outcome (/metrics)
    recorded: int  # calls the exporting process recorded (those wrk abandoned in flight included)
    answered: int  # responses its clients received


def collect(
    collector: Server, exporting: Server, recorded: int, answered: int, quiet_s: float = 3.0, limit_s: float = 30.0
) -> Exported:
    """What the collector decoded, once it stopped growing, and what the exporter counted."""
    deadline, last, still_since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        with urllib.request.urlopen(collector.url + "/count", timeout=5) as response:
            counts = json.loads(response.read())
        if counts != last:
            last, still_since = counts, time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            break
        time.sleep(0.5)
    with urllib.request.urlopen(exporting.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    counted: dict[str, dict[str, int]] = {}
    for labels, value in re.findall(r"^tracetrain_export_items\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counted.setdefault(named["receiver"], {})[named["outcome"]] = int(float(value))
    return Exported(dict((last or {}).get("spans", {})), counted, recorded, answered)


EXPORT_HEAD = (
    "mode|conc|off req/s|on req/s|on/off|off p50 ms|on p50 ms|on-off p50 ms|off p99 ms|on p99 ms|on-off p99 ms|"
    "proxy CPU ms/req off|proxy CPU ms/req on|export process CPU ms/req"
)


def export_rows(cells: Sequence[Cell], concurrency: Sequence[int]) -> list[list[str]]:
    """Per cell: "tracetrain" (exporters off) beside "exporting" (on)."""
    find = {(x.target, x.mode, x.concurrency): x for x in cells}
    rows = []
    for mode in MODES:
        for c in concurrency:
            off, on = find.get(("tracetrain", mode, c)), find.get(("exporting", mode, c))
            if off is None or on is None:
                continue
            a, b = off.result, on.result
            # The proxy's own process in each, then the export process of "exporting".
            cpu = [1000 * x.cpus.get(name, 0.0) / x.result.rps if x.result.rps else 0.0
                   for x, name in ((off, off.target), (on, on.target), (on, "export"))]  # fmt: skip
            ratio = f"{b.rps / a.rps:.3f}" if a.rps else "n/a"
            p50 = [f"{a.p50_ms:.2f}", f"{b.p50_ms:.2f}", f"{b.p50_ms - a.p50_ms:+.2f}"]
            p99 = [f"{a.p99_ms:.2f}", f"{b.p99_ms:.2f}", f"{b.p99_ms - a.p99_ms:+.2f}"]
            rows.append([mode, str(c), f"{a.rps:.0f}", f"{b.rps:.0f}", ratio, *p50, *p99, *(f"{x:.3f}" for x in cpu)])
    return rows


def export_verdicts(cells: Sequence[Cell], exported: Exported | None) -> list[str]:
    """Every answered call reached both receivers, and the exporter counted no loss."""
    out = []
    if exported is not None:
        otlp, langfuse = exported.spans.get("/v1/traces", 0), exported.spans.get("/api/public/otel/v1/traces", 0)
        lost = sum(v for counts in exported.counted.values() for k, v in counts.items() if k in ("dropped", "failed"))
        ok = otlp == langfuse >= exported.answered and lost == 0
        out.append(f"{'met    ' if ok else 'NOT MET'}  every answered call exported: {exported.answered} answered "
                   f"({exported.recorded} recorded), {otlp} spans at the OTLP collector, {langfuse} at Langfuse's "
                   f"endpoint; exporter's counts {json.dumps(exported.counted, sort_keys=True)}")  # fmt: skip
    return out


def as_json(exported: Exported | None) -> dict[str, Any] | None:
    if exported is None:
        return None
    return {"spans": exported.spans, "counted": exported.counted, "recorded": exported.recorded,
            "answered": exported.answered}  # fmt: skip
