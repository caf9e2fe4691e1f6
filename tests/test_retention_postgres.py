"""Compact capture, retention and disk usage on PostgreSQL (asyncpg), as replicas sharing one store run them.

Runs when TRACETRAIN_TEST_POSTGRES_URL names a database it may wipe (`.ci/postgres.sh` starts one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from test_compact_capture import converse
from test_postgres import pg_url, sql  # noqa: F401  (pg_url: the fixture)

from store import AdapterFile, PruneRule, Store


def test_a_multi_turn_trajectory_is_stored_compactly_and_read_whole_on_postgres(
    start_proxy: Callable[..., RunningProxy],
    fake: FakeVLLM,
    pg_url: str,  # noqa: F811
) -> None:
    proxy = start_proxy(database_url=pg_url)
    sent = converse(proxy, "multi", 4)

    rows = sql(pg_url, "SELECT prefix_of, prefix_tokens FROM calls ORDER BY pk")
    assert rows[0]["prefix_of"] is None and all(r["prefix_of"] and r["prefix_tokens"] > 0 for r in rows[1:])
    calls = httpx.get(f"{proxy.v1}/trajectories/multi").json()["calls"]
    assert [c["prompt_token_ids"] for c in calls] == [fake.tokenize(fake.render_chat(m, None)) for m in sent]
    assert [c["request"]["messages"] for c in calls] == sent


def test_pruning_trajectories_and_versions_and_measuring_the_store_on_postgres(
    start_proxy: Callable[..., RunningProxy],
    fake: FakeVLLM,
    pg_url: str,  # noqa: F811
) -> None:
    proxy = start_proxy(database_url=pg_url)
    converse(proxy, "old", 2)
    converse(proxy, "recent", 2)
    proxy.stop()
    old = time.time() - 10 * 86_400
    sql(pg_url, "UPDATE trajectories SET updated_at = $1 WHERE id = 'old'", old)
    sql(pg_url, "UPDATE groups SET state = 'trained'")

    async def run() -> tuple[int, list[int], dict[str, int]]:
        store = await Store.open(pg_url, capture=False)
        try:
            report = await store.prune_trajectories(PruneRule(before=time.time() - 86_400))
            await store.vacuum()
            for version in (1, 2, 3):
                files = [AdapterFile("adapter_config.json", b"{}")]
                await store.adapters.record("agent", version, f"/x/{version}", None, {}, files)
            await store.adapters.published("agent", 1)
            await store.adapters.retired("agent", 1)
            pruned = [p.version for p in await store.adapters.prune("agent", keep=2)]
            return report.trajectories, pruned, await store.disk_bytes()
        finally:
            await store.close()

    deleted, pruned, usage = asyncio.run(run())
    assert deleted == 1 and pruned == [1]
    assert [r["id"] for r in sql(pg_url, "SELECT id FROM trajectories")] == ["recent"]
    assert sql(pg_url, "SELECT count(*) AS n FROM calls WHERE trajectory_id = 'old'")[0]["n"] == 0
    assert [r["version"] for r in sql(pg_url, "SELECT version FROM adapter_files ORDER BY version")] == [2, 3]
    assert 0 < usage["calls"] < usage["database"] and usage["adapter_files"] > 0
