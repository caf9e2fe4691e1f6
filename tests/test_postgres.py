"""The store on PostgreSQL (asyncpg): what several proxy replicas and a remote trainer share.

Runs when TRACETRAIN_TEST_POSTGRES_URL names a database it may wipe (`.ci/run` starts one
with `.ci/postgres.sh`); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import asyncpg
import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import EOS_TOKEN_ID, FakeVLLM, Reply

TASK = [{"role": "user", "content": "Capital of Peru?"}]


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


@pytest.fixture
def pg_url() -> str:
    url = os.environ.get("TRACETRAIN_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("set TRACETRAIN_TEST_POSTGRES_URL to run the store on PostgreSQL (.ci/postgres.sh starts one)")

    async def reset() -> None:
        conn = await asyncpg.connect(_dsn(url))
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public;")
        await conn.close()

    asyncio.run(reset())
    return url


def sql(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(_dsn(url))
        try:
            return list(await conn.fetch(query, *args))
        finally:
            await conn.close()

    return asyncio.run(run())


def test_capture_rewards_groups_and_jobs_on_postgres(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, pg_url: str
) -> None:
    proxy = start_proxy(database_url=pg_url, batch_groups=1, min_group_size=2)
    client = proxy.async_client()

    async def attempts() -> list[str]:
        async def one(i: int) -> str:
            headers = {"X-Trajectory-Id": f"t{i}", "X-Group-Id": f"g{i % 3}"}
            if i % 2:
                stream = await client.chat.completions.create(
                    model="agent", messages=TASK, stream=True, extra_headers=headers
                )
                async for _ in stream:
                    pass
            else:
                await client.chat.completions.create(model="agent", messages=TASK, extra_headers=headers)
            return f"t{i}"

        ids = await asyncio.gather(*(one(i) for i in range(30)))
        await client.close()
        return list(ids)

    ids = asyncio.run(attempts())
    rows = sql(pg_url, "SELECT trajectory_id, completion_token_ids, status_code FROM calls")
    assert sorted(r["trajectory_id"] for r in rows) == sorted(ids)
    assert all(r["status_code"] == 200 for r in rows)
    call = httpx.get(f"{proxy.v1}/trajectories/t0").json()["calls"][0]
    assert call["completion_token_ids"] == [*fake.tokenize("echo: Capital of Peru?"), EOS_TOKEN_ID]

    bad = httpx.post(f"{proxy.v1}/rewards", json={"rewards": [{"trajectory_id": "t0", "reward": 1.0},
                                                              {"trajectory_id": "ghost", "reward": 1.0}]})  # fmt: skip
    assert bad.status_code == 404 and sql(pg_url, "SELECT count(*) AS n FROM rewards")[0]["n"] == 0
    rewards = [{"trajectory_id": f"t{i}", "reward": float(i % 2)} for i in range(0, 30, 3)]  # all of g0
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards}).raise_for_status()
    groups = {g["id"]: g for g in httpx.get(f"{proxy.v1}/groups").json()["data"]}
    assert groups["g0"]["state"] == "training" and groups["g0"]["size"] == 10  # taken by the job
    assert groups["g1"]["state"] == "open" and groups["g1"]["n_rewarded"] == 0
    job = httpx.get(f"{proxy.url}/admin/jobs").json()["data"][0]
    assert job["group_ids"] == ["g0"] and job["state"] == "queued"


def test_training_reads_each_calls_sampling_parameters_on_postgres(
    start_proxy: Callable[..., RunningProxy], pg_url: str
) -> None:
    from store import Store

    proxy = start_proxy(database_url=pg_url, batch_groups=1, min_group_size=2)
    client = proxy.client()
    for i, extra in enumerate([{"temperature": 0.5, "top_p": 0.9, "extra_body": {"top_k": 20}}, {}]):
        headers = {"X-Trajectory-Id": f"t{i}", "X-Group-Id": "g"}
        client.chat.completions.create(model="agent", messages=TASK, extra_headers=headers, **extra)
    rewards = [{"trajectory_id": f"t{i}", "reward": float(i)} for i in range(2)]
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards}).raise_for_status()

    async def read() -> list[tuple[float | None, ...]]:
        store = await Store.open(pg_url, capture=False)
        try:
            trajectories = await store.jobs.rewarded_trajectories(["g"], policy="agent")
        finally:
            await store.close()
        return [(c.temperature, c.top_p, c.top_k, c.min_p) for t in trajectories for c in t.calls]

    assert asyncio.run(read()) == [(0.5, 0.9, 20.0, None), (None, None, None, None)]


def test_threading_survives_a_restart_on_postgres(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, pg_url: str
) -> None:
    first = start_proxy(database_url=pg_url)
    fake.script(Reply(content="Lima."))
    opened = first.client().chat.completions.with_raw_response.create(model="agent", messages=TASK)
    first.stop()
    second = start_proxy(database_url=pg_url)
    follow_up = [*TASK, {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "Sure?"}]
    threaded = second.client().chat.completions.with_raw_response.create(model="agent", messages=follow_up)
    assert threaded.headers["x-trajectory-id"] == opened.headers["x-trajectory-id"]
    assert threaded.headers["x-group-id"] == opened.headers["x-group-id"]


def test_publishing_and_rollback_on_postgres(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, pg_url: str, tmp_path
) -> None:
    proxy = start_proxy(database_url=pg_url)
    path = tmp_path / "adapters" / "agent" / "1"
    path.mkdir(parents=True)
    sql(pg_url, "INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
                "VALUES ('agent', 1, $1, 'trained', '{}', $2)", str(path), time.time())  # fmt: skip
    deadline = time.monotonic() + 10
    while httpx.get(f"{proxy.url}/admin/adapters").json()["active_version"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@1"
    httpx.post(f"{proxy.url}/admin/adapters/0/activate").raise_for_status()
    assert sql(pg_url, "SELECT active_version FROM policies")[0]["active_version"] == 0
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"
