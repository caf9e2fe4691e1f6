"""What keying a new unkeyed trajectory costs: the seat in its derived group is a write in the store.

    python bench/keying.py [DATABASE_URL]   # default: a fresh SQLite file; a Postgres URL is wiped first

1,000 ``Keyer.resolve`` calls of new trajectories over 50 tasks, one after another, as the only
call in flight (``alone``: the seat is written on the event loop's thread on SQLite) and as one
of many (through the group-commit writer's thread), in alternating turns of 100.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time

import asyncpg

from proxy.gateway import Keyer, KeyHints
from proxy.gateway._keying import Conversation
from store import Store


async def main(url: str, n: int = 1000) -> None:
    if url.startswith("postgresql"):
        conn = await asyncpg.connect(url.replace("+asyncpg", ""))
        await conn.execute("DROP SCHEMA public CASCADE")
        await conn.execute("CREATE SCHEMA public")
        await conn.close()
    store = await Store.open(url)
    keyer = Keyer(store, group_size=8, thread_ttl_s=60)
    took: dict[bool, float] = {}
    # Side by side, in turns of 100: a lone call's seat on the event loop's thread, and through the writer's.
    for turn in range(2 * n // 100):
        alone = turn % 2 == 0
        started = time.perf_counter()
        for i in range(100):
            messages = [{"role": "user", "content": f"task {i % 50}"}]
            await keyer.resolve("agent", KeyHints(), Conversation("agent", messages), alone=alone)
        took[alone] = took.get(alone, 0.0) + time.perf_counter() - started
    name = url.split(":")[0]
    for alone, label in ((False, "through the writer"), (True, "alone (on this thread)")):
        print(f"{name}: {took[alone] / n * 1e3:.3f} ms per new unkeyed trajectory, {label} (n={n})")
    print(f"{name}: alone / through the writer = {took[True] / took[False]:.2f}")
    await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else f"sqlite+aiosqlite:///{tempfile.mkdtemp()}/keying.db"))
