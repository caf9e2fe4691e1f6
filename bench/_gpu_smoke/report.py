"""What a section of the smoke run found, and the report (JSON and Markdown) made of them."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "failed", "skipped"]


@dataclass
class Result:
    name: str
    status: Status
    why: str = ""  # a skip's reason, a failure's error, or a short note
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class Skip(Exception):
    """Raised by a section that cannot run on this machine; the message is the reason."""


def run_section(name: str, section: Callable[[dict[str, Any]], str], figures: dict[str, Any]) -> Result:
    """Run ``section`` (it fills ``figures`` and returns a note); its Skip or error becomes the result."""
    import time

    started = time.monotonic()
    try:
        note = section(figures)
        status: Status = "ok"
    except Skip as skip:
        status, note = "skipped", str(skip)
    except Exception as exc:  # a smoke run reports every section, whatever one of them does
        status, note = "failed", "".join(traceback.format_exception(exc)[-3:]).strip()
    result = Result(name, status, note, figures, round(time.monotonic() - started, 1))
    print(f"[{result.status:>7}] {name} ({result.seconds} s): {note.splitlines()[-1] if note else ''}", flush=True)
    return result


def write(results: list[Result], header: dict[str, Any], out: Path) -> str:
    """Write ``gpu_smoke.json`` and ``gpu_smoke.md`` under ``out``; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_smoke.json").write_text(json.dumps({**header, "sections": [asdict(r) for r in results]}, indent=2))
    lines = [f"# GPU smoke run: {header.get('gpu', 'no GPU')}", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| section | status | seconds | figures / why |", "|---|---|---|---|"]
    for r in results:
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in r.figures.items())
        why = r.why.replace("\n", " ").replace("|", "/")
        lines.append(f"| {r.name} | {r.status} | {r.seconds} | {shown}{'; ' if shown and why else ''}{why} |")
    text = "\n".join(lines) + "\n"
    (out / "gpu_smoke.md").write_text(text)
    return text


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
