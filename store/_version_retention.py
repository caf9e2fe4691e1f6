"""Retention of adapter versions: which versions keep their files, and the move of the others to ``pruned``.

Every training step writes a version (57 MB on disk for the demo's 135M model, and the same
weights again as ``adapter_files`` blobs). A version keeps its files while it is one of:

- the newest ``keep`` versions of its policy (``--keep-versions``, 3 by default);
- the version the policy serves (``policies.active_version``), and every ``published`` one
  (loaded in vLLM, so a request may pin it as ``policy@N``);
- the newest version the regression guard kept (``guard.state == "kept"``): its rollback target;
- any version not yet published (``trained``, ``loading``).

Every other version in ``retired``, ``failed``, ``rolled_back`` or ``discarded`` moves to
``pruned`` in one transaction with the deletion of its stored files; its row, metrics and
guard record stay (history). The trainer deletes the directories of pruned versions on its
disk (``trainer._retention``): the proxy may not see that disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._lifecycle import AdapterState, move
from store._tables import adapter_files as F
from store._tables import adapters as A
from store._tables import policies as P

_PRUNABLE = (AdapterState.RETIRED, AdapterState.FAILED, AdapterState.ROLLED_BACK, AdapterState.DISCARDED)


@dataclass(frozen=True, slots=True)
class Pruned:
    version: int
    path: str


def versions_to_keep(rows: list[dict[str, Any]], active: int, keep: int) -> set[int]:
    """The versions of one policy that keep their files (see the module docstring); ``rows``: its adapters."""
    versions = sorted(int(row["version"]) for row in rows)
    kept = set(versions[-keep:]) | {active}
    kept |= {int(row["version"]) for row in rows if row["state"] not in {s.value for s in _PRUNABLE}}
    accepted = [int(row["version"]) for row in rows if (row["guard"] or {}).get("state") == "kept"]
    if accepted:
        kept.add(max(accepted))
    return kept


async def prune_versions(engine: AsyncEngine, policy: str, keep: int) -> list[Pruned]:
    """Move the versions of ``policy`` retention does not keep to ``pruned``, deleting their stored files.

    Returns the versions this call pruned (another process pruning at the same time wins
    each row once: the moves are guarded).
    """
    if keep < 1:
        raise ValueError("keep at least the newest version (keep >= 1)")
    async with engine.begin() as conn:
        active = (await conn.execute(select(P.c.active_version).where(P.c.name == policy))).scalar()
        rows = [
            dict(row._mapping)
            for row in await conn.execute(
                select(A.c.version, A.c.state, A.c.guard, A.c.path).where(
                    A.c.policy == policy, A.c.state != AdapterState.PRUNED.value
                )
            )
        ]
        kept = versions_to_keep(rows, int(active or 0), keep)
        pruned = []
        for row in rows:
            if row["version"] in kept or row["state"] not in {s.value for s in _PRUNABLE}:
                continue
            where = (A.c.policy == policy) & (A.c.version == row["version"])
            if await move(conn, A, where, AdapterState(row["state"]), AdapterState.PRUNED):
                await conn.execute(delete(F).where(F.c.policy == policy, F.c.version == row["version"]))
                pruned.append(Pruned(int(row["version"]), str(row["path"])))
    return pruned


async def pruned_versions(engine: AsyncEngine, policy: str) -> set[int]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(A.c.version).where(A.c.policy == policy, A.c.state == AdapterState.PRUNED.value)
        )
        return {int(v) for v in rows.scalars()}
