"""The check that every request tracetrain answered is a row of its ``calls`` table."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Records:
    stored: int  # rows in ``calls`` for the benchmark's requests
    completed: int  # responses the clients received
    sent: int  # requests written, including those in flight when wrk stopped
    short: list[str]  # batches with fewer rows than responses
    by_batch: dict[str, tuple[int, int, int]]  # tag -> (sent, answered, stored)

    @property
    def ok(self) -> bool:
        return not self.short


def merged(parts: Sequence[Records]) -> Records:
    """The records of several tracetrain processes (each its own database) as one."""
    by_batch = {tag: counts for part in parts for tag, counts in part.by_batch.items()}
    return Records(sum(p.stored for p in parts), sum(p.completed for p in parts), sum(p.sent for p in parts),
                   [s for p in parts for s in p.short], by_batch)  # fmt: skip


def count_records(db: Path, batches: Sequence[tuple[str, int, int]]) -> Records:
    """Rows per trajectory-id prefix; a batch is short when it has fewer rows than responses."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    by_batch, short = {}, []
    try:
        for tag, sent, answered in batches:
            (rows,) = conn.execute("SELECT count(*) FROM calls WHERE trajectory_id LIKE ?", (tag + "-%",)).fetchone()
            by_batch[tag] = (sent, answered, rows)
            if rows < answered:
                short.append(f"{tag}: {rows} stored < {answered} answered")
    finally:
        conn.close()
    sent, answered, stored = (sum(counts[i] for counts in by_batch.values()) for i in range(3))
    return Records(stored, answered, sent, short, by_batch)
