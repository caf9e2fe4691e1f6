"""The report: tables in text and Markdown, the issue's verdicts, the machine, the JSON file."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .exports import EXPORT_HEAD, Exported, as_json, export_rows, export_verdicts
from .options import MODES, TARGETS, Options
from .probe import Ttfb
from .records import Records
from .runs import Cell
from .wrk import WrkResult


@dataclass(slots=True)
class Results:
    info: dict[str, Any]
    cells: list[Cell]
    ttfb: dict[str, Ttfb]
    records: Records | None
    profile: str | None
    exported: Exported | None = None  # what the collector got from "exporting"

    def find(self, target: str, mode: str, c: int) -> WrkResult | None:
        return next((x.result for x in self.cells if (x.target, x.mode, x.concurrency) == (target, mode, c)), None)

    def added(self, target: str, mode: str, c: int, percentile: str) -> float | None:
        """A target's latency percentile (``p50_ms``, ``p99_ms``) minus the direct one."""
        mine, direct = self.find(target, mode, c), self.find("direct", mode, c)
        return getattr(mine, percentile) - getattr(direct, percentile) if mine and direct else None

    def ratio(self, mode: str, c: int) -> float | None:
        """tracetrain's requests/s over LiteLLM's."""
        tt, ll = self.find("tracetrain", mode, c), self.find("litellm", mode, c)
        return tt.rps / ll.rps if tt and ll and ll.rps else None

    def of_direct(self, mode: str, c: int) -> float | None:
        """tracetrain's requests/s over the upstream's own, in the same run."""
        tt, direct = self.find("tracetrain", mode, c), self.find("direct", mode, c)
        return tt.rps / direct.rps if tt and direct and direct.rps else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


SUMMARY_HEAD = "mode|conc|direct req/s|tracetrain req/s|responses req/s|messages req/s|litellm req/s|"
SUMMARY_HEAD += "tracetrain/direct|tracetrain/litellm|tt +p50 ms|tt +p99 ms|responses +p50 ms|responses +p99 ms|"
SUMMARY_HEAD += "messages +p50 ms|messages +p99 ms|litellm +p50 ms|litellm +p99 ms"


# "exporting" reads beside "tracetrain" in a table of its own (_proxy/exports.py).
SUMMARY_TARGETS = tuple(t for t in TARGETS if t != "exporting")


def summary_rows(res: Results, opts: Options) -> list[list[str]]:
    """Per (mode, concurrency): req/s of each target, the ratio, added p50/p99 of each proxy."""
    rows = []
    for mode in MODES:
        for c in opts.concurrency:
            rps = [_fmt(r.rps if (r := res.find(t, mode, c)) else None, ".0f") for t in SUMMARY_TARGETS]
            ratio, of_direct = res.ratio(mode, c), res.of_direct(mode, c)
            added = [_fmt(res.added(t, mode, c, p), "+.2f") for t in SUMMARY_TARGETS[1:] for p in ("p50_ms", "p99_ms")]
            ratios = [_fmt(of_direct, ".2f") + "x" if of_direct else "n/a", f"{ratio:.1f}x" if ratio else "n/a"]
            rows.append([mode, str(c), *rps, *ratios, *added])
    return rows


DETAIL_HEAD = "mode|conc|target|req/s|p50 ms|p99 ms|answered/sent|CPUs busy|CPU ms/req|wrk errors"


def detail_rows(res: Results) -> list[list[str]]:
    """Absolute numbers per run, with the CPU the processes used and any error wrk saw."""
    rows = []
    for x in res.cells:
        r = x.result
        errors = ", ".join(f"{k} {v}" for k, v in r.errors.items() if v) or "-"
        cpus = " ".join(f"{k} {v:.2f}" for k, v in x.cpus.items())
        cpu_ms = 1000 * x.cpus[x.target] / r.rps if r.completed else None
        row = [f"{r.rps:.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.completed}/{r.sent}", cpus]
        rows.append([x.mode, str(x.concurrency), x.target, *row, _fmt(cpu_ms, ".2f"), errors])
    return rows


def text_table(head: str, rows: Sequence[Sequence[str]]) -> str:
    names = head.split("|")
    widths = [max(len(n), *(len(r[i]) for r in rows)) for i, n in enumerate(names)]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in [names, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def markdown_table(head: str, rows: Sequence[Sequence[str]]) -> str:
    names = head.split("|")
    return "\n".join([f"| {' | '.join(names)} |", "|" + "---:|" * len(names), *(f"| {' | '.join(r)} |" for r in rows)])


def verdicts(res: Results, opts: Options) -> list[str]:
    """The issue's targets, each met or not, with its numbers."""

    def line(ok: bool, text: str) -> str:
        return f"{'met    ' if ok else 'NOT MET'}  {text}"

    out, top = [], max(opts.concurrency)
    of_direct = {m: res.of_direct(m, top) for m in MODES}
    if all(of_direct.values()):
        shown = ", ".join(f"{m} {r:.2f}x" for m, r in of_direct.items())
        worst = min(r or 0 for r in of_direct.values())
        out.append(line(worst >= 0.3, f"req/s >= 0.3x the upstream's own at c={top}: {shown}"))
    ratios = {m: res.ratio(m, top) for m in MODES}
    if all(ratios.values()):
        shown = ", ".join(f"{m} {r:.1f}x" for m, r in ratios.items())
        worst = min(r or 0 for r in ratios.values())
        out.append(line(worst >= 10, f"req/s >= 10x LiteLLM's at c={top}: {shown}"))
    plain, stream = (res.added("tracetrain", m, 1, "p50_ms") for m in ("plain", "stream"))
    if plain is not None:  # the target is non-streamed; a stream's is its first byte (below)
        whole = f" (a whole stream, not a target: {stream:+.2f} ms)" if stream is not None else ""
        out.append(line(plain <= 1, f"added p50 <= 1 ms at c=1, non-streamed: {plain:+.2f} ms{whole}"))
    for api in ("responses", "messages"):  # translated to chat and back: within 0.3 ms of chat's own
        mine, chat = res.added(api, "plain", 1, "p50_ms"), plain
        if mine is not None and chat is not None:
            out.append(line(mine - chat <= 0.3, f"/v1/{api} added p50 within 0.3 ms of chat's at c=1, "
                                                f"non-streamed: {mine:+.2f} ms vs {chat:+.2f} ms"))  # fmt: skip
    if "tracetrain" in res.ttfb and "direct" in res.ttfb:
        d50 = res.ttfb["tracetrain"].p50_ms - res.ttfb["direct"].p50_ms
        d99 = res.ttfb["tracetrain"].p99_ms - res.ttfb["direct"].p99_ms
        out.append(line(d50 <= 1, f"first streamed byte delayed <= 1 ms: p50 {d50:+.2f} ms (p99 {d99:+.2f} ms)"))
    if res.records is not None:
        shown = f"{res.records.stored} stored / {res.records.completed} answered"
        out.append(line(res.records.ok, f"every request is in the store: {shown}"))
    return out + export_verdicts(res.cells, res.exported)


def ttfb_rows(res: Results) -> list[list[str]]:
    direct = res.ttfb.get("direct")
    rows = []
    for name, t in res.ttfb.items():
        added = [t.p50_ms - direct.p50_ms, t.p99_ms - direct.p99_ms] if direct else [None, None]
        rows.append([name, str(t.n), f"{t.p50_ms:.2f}", f"{t.p99_ms:.2f}", *(_fmt(a, "+.2f") for a in added)])
    return rows


TTFB_HEAD = "target|n|TTFB p50 ms|TTFB p99 ms|added p50 ms|added p99 ms"


def print_report(res: Results, opts: Options) -> None:
    info = res.info
    where = f"{info['cpus']} CPUs ({info['cpu_model']}), {info['wrk']}, {opts.duration_s} s per cell"
    if opts.observe:
        where += "; tracetrain with --langfuse (to a collector on loopback) and /metrics scraped every second"
    print(f"\n# tracetrain proxy overhead: {info['date']}, {where}")
    for note in info["notes"]:
        print(f"note: {note}")
    print("\n" + text_table(SUMMARY_HEAD, summary_rows(res, opts)))
    print("\nper run (CPUs busy: the target, the upstream behind a proxy, wrk, everything else):")
    print(text_table(DETAIL_HEAD, detail_rows(res)))
    bad = [f"{x.target} {x.mode} c={x.concurrency}: {x.result.errors}" for x in res.cells if x.result.error_count]
    print("\nERRORS: " + "; ".join(bad) if bad else "\nwrk errors: none (no socket error, no non-2xx answer)")
    if res.ttfb:
        print("\ntime to first streamed byte (concurrency 1, one keep-alive connection):")
        print(text_table(TTFB_HEAD, ttfb_rows(res)))
    if exports := export_rows(res.cells, opts.concurrency):
        print("\nexporters off (tracetrain) and on (exporting: OTLP + Langfuse to a collector on loopback):")
        print(text_table(EXPORT_HEAD, exports))
    if res.records is not None:
        r = res.records
        abandoned = f"{r.sent} written, counting those wrk abandoned in flight when it stopped"
        print(f"\nrecords: {r.stored} stored / {r.completed} sent (answered requests; {abandoned})")
        for short in r.short:
            print(f"MISSING: {short}")
    print("\nverdicts:\n" + "\n".join(f"  {v}" for v in verdicts(res, opts)))
    print("\nMarkdown (for docs/BENCHMARKS.md):\n")
    print(markdown_table(SUMMARY_HEAD, summary_rows(res, opts)))
    if res.ttfb:
        print("\n" + markdown_table(TTFB_HEAD, ttfb_rows(res)))
    if exports:
        print("\n" + markdown_table(EXPORT_HEAD, exports))
    if res.profile:
        print("\n" + res.profile)


def machine_info(opts: Options, notes: Sequence[str]) -> dict[str, Any]:
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False).stdout.split(" [")[0]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu_model = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), "?")
    versions = {}
    for dist in ("tracetrain", "litellm", "uvicorn", "fastapi", "httpx", "aiohttp"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    machine = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpus": os.cpu_count(), "cpu_model": cpu_model}
    machine["observe"] = opts.observe
    return machine | {"python": platform.python_version(), "wrk": wrk, "versions": versions, "notes": list(notes)}


def write_json(path: Path, res: Results, opts: Options) -> None:
    records = {**asdict(res.records), "ok": res.records.ok} if res.records else None
    ttfb = {k: asdict(v) for k, v in res.ttfb.items()}
    doc: dict[str, Any] = {
        "meta": res.info,
        "cells": [{**asdict(x), "rps": x.result.rps} for x in res.cells],
        "ttfb": ttfb,
    }
    doc |= {"records": records, "verdicts": verdicts(res, opts), "profile": res.profile}
    doc["exported"] = as_json(res.exported)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
