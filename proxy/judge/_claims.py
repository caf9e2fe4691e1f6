"""One judgement of a group at a time: a lock per group in this process, a claim in the store across replicas.

Several proxy replicas each scan for groups to judge; a group is judged by one of them at a
time. A judge claims the group in the store first (an owner and a lease, renewed every third
of it while the judge model thinks) and writes only while the claim is its own. A replica
that finds the claim taken skips the group; an admin who asks then gets a 409. A replica
that died mid-judgement leaves a claim that runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator

from store import Store

# A judge's claim on a group: renewed every third of it while the judge model thinks, so only a
# dead replica's claim runs out (and its group waits this long for another replica).
JUDGE_LEASE_S = 60.0


class GroupClaims:
    """This process's hold on groups being judged: ``async with claims.hold(group_id) as claimed``."""

    def __init__(self, store: Store, *, lease_s: float = JUDGE_LEASE_S) -> None:
        self._store = store
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"  # this judge's claims in the store
        self._lease_s = lease_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}

    def __contains__(self, group_id: str) -> bool:
        """Whether a judgement of the group runs (or waits) in this process."""
        return group_id in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, group_id: str) -> AsyncIterator[bool]:
        """This process's lock on the group, then the store's claim: True while both are held, False when
        another replica has the claim. The claim is renewed while the block runs and given back after it."""
        lock = self._locks.setdefault(group_id, asyncio.Lock())
        self._lock_users[group_id] = self._lock_users.get(group_id, 0) + 1
        try:
            async with lock, self._claim(group_id) as claimed:
                yield claimed
        finally:
            self._lock_users[group_id] -= 1
            if not self._lock_users[group_id]:
                del self._lock_users[group_id], self._locks[group_id]

    @contextlib.asynccontextmanager
    async def _claim(self, group_id: str) -> AsyncIterator[bool]:
        judgements = self._store.judgements
        if not await judgements.claim(group_id, self.owner, self._lease_s):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(self._lease_s / 3)
                if not await judgements.renew(group_id, self.owner, self._lease_s):
                    return  # taken over: the write will say so

        renewing = asyncio.create_task(renew(), name=f"judge-claim-{group_id}")
        try:
            yield True
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await renewing
            await judgements.release(group_id, self.owner)
