"""After the run: what the store holds, set against what the clients saw; the report and its targets.

- **Ordinary calls failed that the upstream answered**: an ordinary call that did not get a whole answer,
  outside the window in which vLLM was dead (killed, until it answered again and a few seconds more).
- **Records lost**: an ordinary call answered whole whose trajectory has no recorded call with status 200,
  outside the window in which the disk was full (then a call is answered and, by design, not recorded:
  counted as ``tracetrain_capture_failures{reason="disk_full"}``).
- **Broken calls trained on**: a call whose client saw it fail (an in-stream error, a dropped upstream, its
  own hang-up, vLLM killed under it) recorded as status 200 with no error: what the trainer, the judge and
  export would take for a whole call.
- **Groups stuck**: an ``open`` group holding a trajectory without a reward once every trajectory the clients
  know of was rewarded and the seat timeout passed: a group that can never be ready.
"""

from __future__ import annotations

import sqlite3
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .calls import Outcome
from .hostile import BROKEN

Window = tuple[float, float]


def _overlaps(outcome: Outcome, windows: Sequence[Window]) -> bool:
    return any(outcome.started <= end and outcome.ended >= start for start, end in windows)


@dataclass
class Verdict:
    ordinary: Counter[str] = field(default_factory=Counter)  # "api/mode" -> answered whole
    ordinary_failed: list[Outcome] = field(default_factory=list)  # failed though the upstream answered
    upstream_down: int = 0  # ordinary calls failed while vLLM was dead
    lost: list[str] = field(default_factory=list)
    disk_full_answered: int = 0
    disk_full_unrecorded: int = 0
    broken: Counter[str] = field(default_factory=Counter)  # class -> calls whose client saw them fail
    trained: Counter[str] = field(default_factory=Counter)  # "class on api" -> of those, recorded 200 without error
    hostile: dict[str, Counter[str]] = field(default_factory=dict)  # class -> "as expected" / "unexpected"
    unexpected: dict[str, list[str]] = field(default_factory=dict)  # class -> a few of what went otherwise
    stuck: list[str] = field(default_factory=list)

    @property
    def targets_met(self) -> bool:
        return not (self.ordinary_failed or self.lost or sum(self.trained.values()) or self.stuck)


def _recorded(db: Path) -> dict[str, list[tuple[int, str | None]]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT trajectory_id, status_code, error FROM calls").fetchall()
    by_trajectory: dict[str, list[tuple[int, str | None]]] = defaultdict(list)
    for trajectory_id, status, error in rows:
        by_trajectory[trajectory_id].append((int(status), error))
    return by_trajectory


def stuck_groups(db: Path) -> list[str]:
    query = (
        "SELECT DISTINCT g.id FROM groups g JOIN trajectories t ON t.group_id = g.id "
        "WHERE g.state = 'open' AND t.reward IS NULL"
    )
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return [row[0] for row in conn.execute(query)]


def judge(outcomes: Sequence[Outcome], db: Path, vllm_down: Sequence[Window], disk_full: Sequence[Window]) -> Verdict:
    recorded = _recorded(db)
    verdict = Verdict(stuck=stuck_groups(db))
    for outcome in outcomes:
        rows = recorded.get(outcome.trajectory_id, [])
        whole_rows = [r for r in rows if r[0] == 200 and r[1] is None]
        if outcome.kind == "ordinary":
            _ordinary(verdict, outcome, whole_rows, vllm_down, disk_full)
        else:
            _hostile(verdict, outcome, _overlaps(outcome, vllm_down))
        if not outcome.whole and (outcome.kind == "ordinary" or outcome.kind in BROKEN):
            verdict.broken[outcome.kind] += 1
            if whole_rows:
                verdict.trained[f"{outcome.kind} on {outcome.api}{' streamed' if outcome.stream else ''}"] += 1
    return verdict


def _ordinary(
    verdict: Verdict, outcome: Outcome, whole_rows: list[Any], vllm_down: Sequence[Window], disk_full: Sequence[Window]
) -> None:
    mode = "stream" if outcome.stream else "plain"
    if not outcome.whole:
        if _overlaps(outcome, vllm_down):
            verdict.upstream_down += 1
        else:
            verdict.ordinary_failed.append(outcome)
        return
    verdict.ordinary[f"{outcome.api}/{mode}"] += 1
    if _overlaps(outcome, disk_full):
        verdict.disk_full_answered += 1
        verdict.disk_full_unrecorded += not whole_rows
    elif not whole_rows:
        verdict.lost.append(outcome.trajectory_id)


def _hostile(verdict: Verdict, outcome: Outcome, vllm_dead: bool) -> None:
    tally = verdict.hostile.setdefault(outcome.kind, Counter())
    if not outcome.expected and vllm_dead:
        tally["failed while vLLM was dead"] += 1
        return
    tally["as expected" if outcome.expected else "unexpected"] += 1
    if not outcome.expected:
        seen = verdict.unexpected.setdefault(outcome.kind, [])
        if len(seen) < 3:
            seen.append(f"{outcome.api} status {outcome.status}: {outcome.error[:120]}")


def report(verdict: Verdict, meta: dict[str, Any]) -> list[str]:
    """The run in lines of text (Markdown-friendly)."""
    answered = sum(verdict.ordinary.values())
    lines = [f"chaos run: {meta['duration_s']:.0f} s, ordinary concurrency {meta['concurrency']}, "
             f"{meta['hostile_workers']} hostile workers, CPU: {meta['cpu']}", ""]  # fmt: skip
    lines.append(f"ordinary calls answered whole: {answered} ("
                 + ", ".join(f"{k} {v}" for k, v in sorted(verdict.ordinary.items())) + ")")  # fmt: skip
    lines.append(f"ordinary calls failed while vLLM was dead (killed, restarted): {verdict.upstream_down}")
    for name in ("vllm_down", "disk_full"):
        for start, end in meta.get(name, []):
            lines.append(f"    {name.replace('_', ' ')}: {start - meta['started']:.1f}-{end - meta['started']:.1f} s")
    lines.append(f"ordinary calls failed that the upstream answered: {len(verdict.ordinary_failed)}   [target 0]")
    for outcome in verdict.ordinary_failed[:5]:
        at = outcome.started - meta["started"]
        lines.append(f"    at {at:.1f}-{outcome.ended - meta['started']:.1f} s: {outcome.api} stream={outcome.stream} "
                     f"status {outcome.status}: {outcome.error[:150]}")  # fmt: skip
    lines.append(f"records lost: {len(verdict.lost)}   [target 0]")
    lines.append(f"answered while the disk was full: {verdict.disk_full_answered} "
                 f"(unrecorded by design, counted on /metrics: {verdict.disk_full_unrecorded})")  # fmt: skip
    broken = ", ".join(f"{k} {v}" for k, v in sorted(verdict.broken.items()))
    lines.append(f"broken calls (the client saw a failure): {sum(verdict.broken.values())} ({broken})")
    trained = ", ".join(f"{k} {v}" for k, v in sorted(verdict.trained.items())) or "none"
    lines.append(f"broken calls trained on (recorded 200 without error): {sum(verdict.trained.values())} "
                 f"({trained})   [target 0]")  # fmt: skip
    lines.append(f"groups stuck: {len(verdict.stuck)}   [target 0]")
    lines.append("hostile calls, answered as they should be / otherwise (/ failed while vLLM was dead):")
    for kind, tally in sorted(verdict.hostile.items()):
        dead = f" / {tally['failed while vLLM was dead']}" if tally["failed while vLLM was dead"] else ""
        lines.append(f"    {kind}: {tally['as expected']} / {tally['unexpected']}{dead}")
        lines += [f"        {example}" for example in verdict.unexpected.get(kind, [])]
    for line in meta.get("notes", []):
        lines.append(line)
    return lines
