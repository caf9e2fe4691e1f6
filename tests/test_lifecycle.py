"""The life cycle of jobs and adapters: guarded moves, claims with leases, reclaiming exactly once.

The store-level tests run on SQLite and, when TRACETRAIN_TEST_POSTGRES_URL is set, on
PostgreSQL, where two replicas really race.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import httpx
import pytest
from conftest import RunningProxy
from sqlalchemy import insert, select

from store import AdapterState, GpuHandover, GroupState, JobState, Store, TrainingState, TransitionRefused, allowed
from store._lifecycle import move
from store._tables import adapters, groups, training_jobs, trajectories


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'tracetrain.db'}"
    else:
        url = os.environ.get("TRACETRAIN_TEST_POSTGRES_URL", "")
        if not url:
            pytest.skip("set TRACETRAIN_TEST_POSTGRES_URL to run the store on PostgreSQL (.ci/postgres.sh starts one)")
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public;")
        await conn.close()
    opened = await Store.open(url, capture=False)
    yield opened
    await opened.close()


async def queue_job(store: Store, n_groups: int = 2) -> int:
    """Rewarded groups and a job over them, as the proxy's scheduler makes it."""
    now = time.time()
    ids = [f"g{i}" for i in range(n_groups)]
    async with store.engine.begin() as conn:
        for group_id in ids:
            await conn.execute(insert(groups).values(id=group_id, policy="agent", state="open", created_at=now))
            await conn.execute(
                insert(trajectories).values(id=f"t-{group_id}", group_id=group_id, policy="agent", keyed_by="header",
                                            created_at=now, updated_at=now, reward=1.0, metrics={})
            )  # fmt: skip
    job_id = await store.jobs.create("agent", ids)
    assert job_id is not None
    return job_id


async def job_row(store: Store, job_id: int) -> dict[str, object]:
    async with store.engine.connect() as conn:
        return dict((await conn.execute(select(training_jobs).where(training_jobs.c.id == job_id))).one()._mapping)


async def test_a_group_is_taken_by_one_job_only(store: Store) -> None:
    await queue_job(store)
    assert await store.jobs.create("agent", ["g0"]) is None, "a group already training was taken again"
    assert await store.jobs.ready_groups("agent", 1) == []


async def test_two_workers_claiming_one_job_one_wins(store: Store) -> None:
    job_id = await queue_job(store)
    first, second = await asyncio.gather(
        store.jobs.claim("agent", "host-a:1", lease_s=60), store.jobs.claim("agent", "host-b:2", lease_s=60)
    )
    winners = [c for c in (first, second) if c is not None]
    assert len(winners) == 1 and winners[0]["id"] == job_id
    row = await job_row(store, job_id)
    assert row["state"] == JobState.RUNNING and row["worker"] == winners[0]["worker"]
    assert row["lease_expires_at"] is not None and float(row["lease_expires_at"]) > time.time() + 30  # type: ignore[arg-type]


async def test_a_job_whose_worker_died_is_queued_again_exactly_once(store: Store) -> None:
    job_id = await queue_job(store)
    assert await store.jobs.claim("agent", "dead-host:1", lease_s=0.01) is not None
    await asyncio.sleep(0.05)
    # Two replicas notice the expired lease at the same time: one takes the job back.
    taken = await asyncio.gather(store.jobs.reclaim_expired(), store.jobs.reclaim_expired())
    assert sorted(t for found in taken for t in found) == [(job_id, "dead-host:1")]
    row = await job_row(store, job_id)
    assert (row["state"], row["worker"], row["reclaimed"], row["lease_expires_at"]) == ("queued", None, 1, None)
    # Another worker trains it; the dead one, should it come back, cannot finish it.
    assert (await store.jobs.claim("agent", "host-b:2", lease_s=60) or {}).get("id") == job_id
    assert not await store.jobs.finish(job_id, "dead-host:1", ok=True, metrics={}, version=1, error=None)
    assert await store.jobs.finish(job_id, "host-b:2", ok=True, metrics={"loss": 0.1}, version=1, error=None)
    assert (await job_row(store, job_id))["state"] == JobState.SUCCEEDED
    async with store.engine.connect() as conn:
        states = set((await conn.execute(select(groups.c.state))).scalars())
    assert states == {GroupState.TRAINED}


async def test_a_renewed_lease_keeps_the_claim(store: Store) -> None:
    job_id = await queue_job(store)
    await store.jobs.claim("agent", "host-a:1", lease_s=0.2)
    # Renewed for a minute, then past the first lease: only a renewal that did not extend it lets it expire (a
    # renewal for 0.2 s would leave a loaded machine 0.2 s between it and the check).
    assert await store.jobs.renew(job_id, "host-a:1", lease_s=60, progress=0.5)
    await asyncio.sleep(0.3)
    assert await store.jobs.reclaim_expired() == []
    assert not await store.jobs.renew(job_id, "someone-else:9", lease_s=60), "renewed a claim it does not hold"
    assert (await job_row(store, job_id))["progress"] == 0.5


async def test_a_failed_step_fails_the_job_and_its_groups(store: Store) -> None:
    job_id = await queue_job(store)
    await store.jobs.claim("agent", "host-a:1", lease_s=60)
    assert await store.jobs.finish(job_id, "host-a:1", ok=False, metrics={}, version=None, error="boom")
    assert (await job_row(store, job_id))["state"] == JobState.FAILED
    async with store.engine.connect() as conn:
        assert set((await conn.execute(select(groups.c.state))).scalars()) == {GroupState.FAILED}


async def test_an_adapter_left_loading_is_claimed_again_once(store: Store, tmp_path: Path) -> None:
    await store.policies.ensure("agent", "base")
    await store.adapters.record("agent", 1, str(tmp_path), None, {})
    assert await store.adapters.claim_trained("agent", "proxy-a", lease_s=0.01) == [(1, str(tmp_path))]
    assert await store.adapters.claim_trained("agent", "proxy-b", lease_s=60) == [], "claimed twice"
    await asyncio.sleep(0.05)
    taken = await asyncio.gather(store.adapters.reclaim_expired(), store.adapters.reclaim_expired())
    assert [t for found in taken for t in found] == [("agent", 1, "proxy-a")]
    assert await store.adapters.claim_trained("agent", "proxy-b", lease_s=60) == [(1, str(tmp_path))]
    assert await store.adapters.published("agent", 1)
    row = await store.adapters.get("agent", 1)
    assert row is not None and (row["state"], row["reclaimed"], row["lease_owner"]) == ("published", 1, None)


async def test_a_move_outside_the_table_is_refused_and_a_lost_race_moves_nothing(store: Store, tmp_path: Path) -> None:
    await store.adapters.record("agent", 1, str(tmp_path), None, {})
    where = (adapters.c.policy == "agent") & (adapters.c.version == 1)
    async with store.engine.begin() as conn:
        with pytest.raises(TransitionRefused, match="published -> loading"):
            await move(conn, adapters, where, AdapterState.PUBLISHED, AdapterState.LOADING)
        # Legal, but the row is not in the state the mover expected: nothing happens.
        assert await move(conn, adapters, where, AdapterState.PUBLISHED, AdapterState.RETIRED) == 0
    assert (await store.adapters.get("agent", 1) or {})["state"] == AdapterState.TRAINED
    assert not await store.adapters.retired("agent", 1)


async def test_a_gpu_hand_over_is_asked_granted_and_released_by_its_owners_only(store: Store) -> None:
    job_id = await queue_job(store)
    await store.jobs.claim("agent", "host-a:1", lease_s=60)
    assert not await store.jobs.request_gpu(job_id, "host-b:2"), "another worker asked for this job's GPU"
    assert not await store.jobs.grant_gpu(job_id), "granted what nobody asked for"
    assert await store.jobs.request_gpu(job_id, "host-a:1")
    assert [r["id"] for r in await store.jobs.pending_gpu_requests("agent")] == [job_id]
    assert await store.jobs.grant_gpu(job_id) and not await store.jobs.grant_gpu(job_id)
    assert not await store.jobs.release_gpu(job_id, "host-b:2")
    assert await store.jobs.release_gpu(job_id, "host-a:1")
    assert not await store.jobs.revoke_gpu(job_id), "revoked a hand-over that had ended"
    await store.jobs.record_gpu_asleep(job_id, 1.5)
    row = await store.jobs.gpu_handover(job_id)
    assert row is not None and (row["gpu_state"], row["gpu_asleep_s"]) == (GpuHandover.RELEASED, 1.5)
    assert float(row["gpu_requested_at"]) <= float(row["gpu_granted_at"]) <= float(row["gpu_released_at"])
    assert await store.jobs.pending_gpu_requests("agent") == []


async def test_a_job_requeued_from_a_dead_worker_ends_its_hand_over_and_asks_again(store: Store) -> None:
    job_id = await queue_job(store)
    await store.jobs.claim("agent", "host-a:1", lease_s=0.01)
    await store.jobs.request_gpu(job_id, "host-a:1")
    await store.jobs.grant_gpu(job_id)
    await asyncio.sleep(0.02)

    assert await store.jobs.reclaim_expired() == [(job_id, "host-a:1")]

    assert (await store.jobs.gpu_handover(job_id) or {})["gpu_state"] == GpuHandover.REVOKED
    assert not await store.jobs.release_gpu(job_id, "host-a:1"), "the dead worker's release won"
    await store.jobs.claim("agent", "host-b:2", lease_s=60)
    assert await store.jobs.request_gpu(job_id, "host-b:2")


def test_every_state_can_be_reached_and_terminal_states_stay_put() -> None:
    for enum in (GroupState, JobState, AdapterState, GpuHandover, TrainingState):
        start = next(iter(enum))
        reached, frontier = {start}, [start]
        while frontier:
            state = frontier.pop()
            for new in enum:
                if allowed(state, new) and new not in reached:
                    reached.add(new)
                    frontier.append(new)
        assert reached == set(enum), f"{enum.__name__}: unreachable {set(enum) - reached}"
    assert not any(allowed(GroupState.TRAINED, s) for s in GroupState)
    assert not any(allowed(JobState.FAILED, s) for s in JobState)


def test_an_adapter_a_dead_proxy_left_loading_is_published_by_the_next(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    """The bug this life cycle fixes: a proxy died mid-publish, and the adapter stayed ``loading`` forever."""
    proxy = start_proxy()
    path = tmp_path / "adapters" / "agent" / "1"
    path.mkdir(parents=True)
    proxy.stop()
    proxy.rows(
        "INSERT INTO adapters (policy, version, path, state, metrics, created_at, lease_owner, lease_expires_at) "
        "VALUES ('agent', 1, ?, 'loading', '{}', ?, 'dead-host:1:0', ?)",
        str(path), time.time(), time.time() - 1,
    )  # fmt: skip
    proxy = start_proxy()
    deadline = time.monotonic() + 15
    while httpx.get(f"{proxy.url}/admin/adapters").json()["active_version"] != 1:
        assert time.monotonic() < deadline, "the adapter left loading was never published"
        time.sleep(0.1)
    [row] = proxy.rows("SELECT state, reclaimed, lease_owner FROM adapters")
    assert (row["state"], row["reclaimed"], row["lease_owner"]) == ("published", 1, None)
    assert "reclaimed 1\u00d7" in httpx.get(f"{proxy.url}/admin/ui/adapters").text
