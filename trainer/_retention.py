"""Retention on the trainer's disk: the files of pruned versions go, and every optimizer state but the newest.

After each step the worker asks the store to prune (``Store.adapters.prune``: the versions
retention keeps are listed in ``store._version_retention``), then sweeps its adapter
directory: a pruned version's directory is deleted, so is a half-written one left by a
process that died while writing (``.N.tmp-PID``), and ``optimizer.pt`` is deleted from every
version but the newest. Resuming needs only the newest's; training from an older version
(after a rollback) starts AdamW's moments afresh, as from an SFT warm start. The sweep
reads the store's verdict each time, so a directory a crash left behind goes at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from store import Store
from trainer._adapters import OPTIMIZER

log = logging.getLogger("tracetrain.trainer")


async def retain(store: Store, policy: str, adapters_dir: Path, keep: int) -> None:
    """Prune ``policy``'s versions beyond retention in the store, then sweep ``adapters_dir``."""
    pruned = await store.adapters.prune(policy, keep)
    if pruned:
        log.info("retention: %s@%s pruned (keeping %d versions)", policy, ",".join(str(p.version) for p in pruned),
                 keep)  # fmt: skip
    gone = await store.adapters.pruned_versions(policy)
    await asyncio.to_thread(sweep, adapters_dir, gone)


def sweep(adapters_dir: Path, pruned: set[int]) -> None:
    """Delete the directories of ``pruned`` versions and of dead writes; keep ``optimizer.pt`` only in the newest."""
    if not adapters_dir.is_dir():
        return
    steps: list[tuple[int, Path]] = []
    for entry in adapters_dir.iterdir():
        if entry.name.isascii() and entry.name.isdecimal() and entry.is_dir():
            if int(entry.name) in pruned:
                shutil.rmtree(entry, ignore_errors=True)
            else:
                steps.append((int(entry.name), entry))
        elif entry.name.startswith(".") and ".tmp-" in entry.name and not _writing(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
    for _, step in sorted(steps)[:-1]:
        (step / OPTIMIZER).unlink(missing_ok=True)


def _writing(name: str) -> bool:
    """Whether the process that names this temporary directory (``.N.tmp-PID``) still runs."""
    pid = name.rpartition(".tmp-")[2].split("-")[0]
    if not pid.isdecimal():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
