"""Several proxy replicas on one store: every rule the store enforces holds across them.

The store-level races run two ``Store`` instances (two engines, as two processes have) on one
database: SQLite, and PostgreSQL when TRACETRAIN_TEST_POSTGRES_URL names a database it may
wipe. The last test runs two real proxies on one PostgreSQL with a real OpenAI client
spreading its traffic over both.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from sqlalchemy import insert, update
from sqlalchemy.exc import IntegrityError
from test_judge import fake_judge
from test_postgres import sql
from test_publishing import wait_for

from proxy import Settings
from proxy.gateway import Keyer, KeyHints, PolicyRegistry, Upstream
from proxy.gateway._keying import Conversation
from proxy.gateway.upstream._router import Router
from proxy.judge._service import JudgeService
from proxy.training._publisher import Publisher
from proxy.training._scheduler import JobScheduler
from store import CallWrite, RewardIn, Store
from store._tables import groups as G
from store._tables import training_jobs as J
from store._tables import trajectories as T

TASK: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
PG_ENV = "TRACETRAIN_TEST_POSTGRES_URL"


def _pg_url() -> str:
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"set {PG_ENV} to run replicas on PostgreSQL (.ci/postgres.sh starts one)")
    for statement in ("DROP SCHEMA public CASCADE", "CREATE SCHEMA public"):
        sql(url, statement)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    return _pg_url()


@pytest.fixture
async def replicas(database: str) -> AsyncIterator[tuple[Store, Store]]:
    """Two stores on one database: what two proxy processes hold."""
    a = await Store.open(database)
    b = await Store.open(database)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def recorded(key: Any, when: float) -> CallWrite:
    """The record of a call keyed to ``key``, as the forwarder writes it."""
    row = {"id": f"call-{uuid.uuid4().hex}", "trajectory_id": key.trajectory_id, "group_id": key.group_id,
           "policy": "agent", "endpoint": "chat.completions", "model": "agent", "served_model": "agent", "version": 0,
           "stream": False, "request": {"model": "agent", "messages": TASK}, "response": None, "status_code": 200,
           "latency_ms": 1.0, "started_at": when}  # fmt: skip
    return CallWrite(row, key.trajectory_id, key.group_id, "agent", key.keyed_by, key.task_key, None, when, 0)


async def group_sizes(store: Store) -> list[int]:
    groups = await store.reads.groups(min_group_size=1, policy=None, state=None, limit=100, after=None)
    return sorted(g["size"] for g in groups)


# -- derived groups -------------------------------------------------------------------------------------------------


async def test_attempts_alternating_between_replicas_fill_one_group_before_the_next(
    replicas: tuple[Store, Store],
) -> None:
    keyers = [Keyer(store, group_size=4, thread_ttl_s=60) for store in replicas]
    groups = []
    for i in range(8):  # the same task, one attempt after another, through replica A, B, A, B...
        key = await keyers[i % 2].resolve("agent", KeyHints(), Conversation("agent", TASK))
        await replicas[i % 2].record_call(recorded(key, time.time()))
        groups.append(key.group_id)
    assert [groups.count(g) for g in dict.fromkeys(groups)] == [4, 4]
    assert groups[:4] == [groups[0]] * 4  # the first group fills before the second opens
    assert await group_sizes(replicas[0]) == [4, 4]


async def test_attempts_racing_on_two_replicas_never_overfill_a_group(replicas: tuple[Store, Store]) -> None:
    keyers = [Keyer(store, group_size=4, thread_ttl_s=60) for store in replicas]

    async def attempt(i: int) -> str:
        key = await keyers[i % 2].resolve("agent", KeyHints(), Conversation("agent", TASK))
        await replicas[i % 2].record_call(recorded(key, time.time()))
        return key.group_id

    groups = await asyncio.gather(*(attempt(i) for i in range(22)))
    assert sorted(Counter(groups).values()) == [2, 4, 4, 4, 4, 4]  # one group still filling, not one per replica
    assert await group_sizes(replicas[0]) == [2, 4, 4, 4, 4, 4]


async def test_a_new_trajectory_keyed_on_two_replicas_at_once_gets_one_group(replicas: tuple[Store, Store]) -> None:
    keyers = [Keyer(store, group_size=2, thread_ttl_s=60) for store in replicas]
    for n in range(5):
        hints = KeyHints(header_trajectory=f"run-{n}")
        a, b = await asyncio.gather(*(k.resolve("agent", hints, Conversation("agent", TASK)) for k in keyers))
        assert a.group_id == b.group_id
    assert await group_sizes(replicas[0]) == [1, 2, 2]  # five trajectories, two seats a group, none taken twice


# -- the judge ------------------------------------------------------------------------------------------------------


# litellm's response types warn about a pydantic feature when first built; judging must not fail on that.
_LITELLM_TYPES = "ignore:Item 'summary' on TypedDict"


@pytest.mark.filterwarnings(_LITELLM_TYPES)
async def test_two_replicas_scanning_together_judge_a_group_once(
    replicas: tuple[Store, Store], fake: FakeVLLM, tmp_path: Path
) -> None:
    thinking = threading.Event()  # both scans see the group due while the first judge still thinks
    asked = fake_judge(fake, held=thinking)
    settings = Settings(upstream=f"{fake.url}/v1", data_dir=tmp_path, reward_source="judge", group_size=2,  # type: ignore[attr-defined]
                        min_group_size=2, batch_groups=5, judge_quiet_s=0.05)  # fmt: skip
    judges = []
    for store in replicas:
        registry = PolicyRegistry.of("agent", base_model=fake.base_model, settings=settings)
        scheduler = JobScheduler(store, registry)
        judges.append(JudgeService(settings, store, registry, scheduler, backoff_s=0.01))
    keyer = Keyer(replicas[0], group_size=2, thread_ttl_s=60)
    for _ in range(2):
        key = await keyer.resolve("agent", KeyHints(), Conversation("agent", TASK))
        await replicas[0].record_call(recorded(key, time.time()))
    await asyncio.sleep(0.1)  # quiet
    try:
        started = await asyncio.gather(*(judge.scan_once() for judge in judges))
        assert [len(s) for s in started] == [1, 1]  # both saw it due
        thinking.set()
        deadline = time.monotonic() + 60  # the first judgement imports litellm: seconds on a busy machine
        while any(judge._tasks for judge in judges):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert [await judge.scan_once() for judge in judges] == [[], []]
    finally:
        for judge in judges:
            await judge.close()
    judged = await replicas[1].judgements.find(group_id=None, state=None, limit=10)
    assert [j["state"] for j in judged] == ["ok"] and len(asked) == 1


# -- publishing -----------------------------------------------------------------------------------------------------


async def test_an_adapter_a_dead_replica_left_loaded_is_published_by_another(
    replicas: tuple[Store, Store], fake: FakeVLLM, tmp_path: Path
) -> None:
    path = tmp_path / "adapters" / "agent" / "1"
    path.mkdir(parents=True)
    dead, alive = replicas
    await dead.policies.ensure("agent", fake.base_model)
    await dead.adapters.record("agent", 1, str(path), None, {})
    # The dead replica claimed it, loaded it into the shared vLLM, and died before marking it published.
    assert await dead.adapters.claim_trained("agent", "dead-host:1", lease_s=0.0) == [(1, str(path))]
    async with httpx.AsyncClient() as client:
        vllm = Upstream(f"{fake.url}/v1", [client], timeout_s=10.0)  # type: ignore[attr-defined]
        await vllm.load_lora("agent@1", str(path))
        router = Router([vllm])
        await router.check_once()  # in rotation: the publisher loads only into servers that serve
        publisher = Publisher(alive, PolicyRegistry(), router, Settings(keep_versions=3))
        await publisher.sync_once()
        vllm.close()
    adapter = await alive.adapters.get("agent", 1)
    assert adapter is not None and (adapter["state"], adapter["reclaimed"]) == ("published", 1)
    assert await alive.policies.active_version("agent") == 1 and "agent@1" in fake.loras


async def test_a_version_leaves_vllm_after_the_unload_grace_even_while_another_replica_still_serves_it(
    replicas: tuple[Store, Store], fake: FakeVLLM, tmp_path: Path
) -> None:
    # The bound docs/SCALING.md states: in-flight calls are counted per replica, so a call another replica
    # runs on a version that left the window is safe for --unload-grace after this replica saw it leave.
    grace = 0.5
    async with httpx.AsyncClient() as client:
        registries = [PolicyRegistry(fake.base_model) for _ in replicas]
        publishers, upstreams = [], []
        for store, registry in zip(replicas, registries, strict=True):
            upstreams.append(Upstream(f"{fake.url}/v1", [client], timeout_s=10.0))  # type: ignore[attr-defined]
            router = Router([upstreams[-1]])
            await router.check_once()
            publishers.append(Publisher(store, registry, router, Settings(keep_versions=1), unload_grace_s=grace))
        a, b = publishers
        await replicas[0].policies.ensure("agent", fake.base_model)
        for version in (1, 2):
            (tmp_path / str(version)).mkdir()
            await replicas[0].adapters.record("agent", version, str(tmp_path / str(version)), None, {})
            # Read before A's sync: in version 2's, A sees agent@1 leave the window and its grace begins, so
            # any time measured from here is at least the time since the grace began.
            left = time.monotonic()
            await a.sync_once()
            await b.sync_once()
        assert registries[1].get("agent").active_version == 2 and "agent@2" in fake.loras
        # A loaded machine may take longer than the grace to get here: agent@1 may have left by then, rightly.
        assert "agent@1" in fake.loras or time.monotonic() - left >= grace, "unloaded within the grace"
        with registries[1].serving("agent", 1):  # a long call through replica B, started on agent@1 before the flip
            await a.sync_once()
            await b.sync_once()
            assert "agent@1" in fake.loras or time.monotonic() - left >= grace, "unloaded within the grace"
            deadline = time.monotonic() + 60  # only a broken unload waits this long
            while "agent@1" in fake.loras and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                await a.sync_once()
            assert "agent@1" not in fake.loras, "replica A does not see B's call: it unloads after the grace"
            assert time.monotonic() - left >= grace, "unloaded within the grace"
        assert (await replicas[1].adapters.get("agent", 1) or {})["state"] == "retired"
        for upstream in upstreams:
            upstream.close()


async def test_only_the_claims_owner_publishes_and_the_alias_never_moves_back(
    replicas: tuple[Store, Store], tmp_path: Path
) -> None:
    a, b = replicas
    await a.policies.ensure("agent", "base")
    for version in (1, 2):
        await a.adapters.record("agent", version, str(tmp_path / str(version)), None, {})
    assert await a.adapters.claim_trained("agent", "replica-a", lease_s=0.0) == [(1, str(tmp_path / "1")),
                                                                                (2, str(tmp_path / "2"))]  # fmt: skip
    assert len(await b.adapters.reclaim_expired()) == 2  # A stalled: its leases ran out
    assert [v for v, _ in await b.adapters.claim_trained("agent", "replica-b", lease_s=60.0)] == [1, 2]
    assert await b.adapters.published("agent", 2, "replica-b")
    assert await b.policies.flip("agent", 2, forward_only=True)
    # A wakes up and finishes its publish of 1: it no longer owns the claim, and the alias stays on 2.
    assert not await a.adapters.published("agent", 1, "replica-a")
    assert not await a.policies.flip("agent", 1, forward_only=True)
    assert await a.policies.active_version("agent") == 2


# -- training -------------------------------------------------------------------------------------------------------


async def test_two_replicas_scheduling_together_train_a_group_once(replicas: tuple[Store, Store]) -> None:
    keyer = Keyer(replicas[0], group_size=2, thread_ttl_s=60)
    ids = []
    for _ in range(4):
        key = await keyer.resolve("agent", KeyHints(), Conversation("agent", TASK))
        await replicas[0].record_call(recorded(key, time.time()))
        ids.append(key.trajectory_id)
    await replicas[0].add_rewards([RewardIn(t, float(i % 2)) for i, t in enumerate(ids)])
    served = Settings(batch_groups=2, min_group_size=2)
    schedulers = [JobScheduler(s, PolicyRegistry.of("agent", settings=served)) for s in replicas]
    jobs = await asyncio.gather(*(s.maybe_create_job("agent") for s in schedulers for _ in range(3)))
    made = [j for j in jobs if j is not None]
    assert len(made) == 1 and len(made[0]["group_ids"]) == 2
    claims = await asyncio.gather(
        *(store.jobs.claim("agent", f"worker-{i}", lease_s=60) for i, store in enumerate(replicas))
    )
    assert sorted(c is None for c in claims) == [False, True]


async def queue_jobs(store: Store, n: int) -> list[int]:
    """``n`` queued jobs of one policy, each over a rewarded group of its own (as the scheduler makes them)."""
    now, jobs = time.time(), []
    for i in range(n):
        async with store.engine.begin() as conn:
            await conn.execute(insert(G).values(id=f"job-g{i}", policy="agent", state="open", created_at=now))
            await conn.execute(insert(T).values(id=f"job-t{i}", group_id=f"job-g{i}", policy="agent",
                                                keyed_by="header", created_at=now, updated_at=now, reward=1.0,
                                                metrics={}))  # fmt: skip
        job = await store.jobs.create("agent", [f"job-g{i}"])
        assert job is not None
        jobs.append(job)
    return jobs


async def test_two_workers_of_one_policy_train_one_step_at_a_time_each_on_the_version_its_claim_gave(
    replicas: tuple[Store, Store], tmp_path: Path
) -> None:
    await queue_jobs(replicas[0], 4)
    recorded_versions = []
    for step in range(1, 5):  # each round: both workers claim at once; one wins, records, finishes
        claims = await asyncio.gather(
            *(store.jobs.claim("agent", f"worker-{i}", lease_s=60) for i, store in enumerate(replicas))
        )
        (won,) = [c for c in claims if c is not None]
        assert won["version"] == step, "the claim gives the version after the newest adapter"
        assert await replicas[0].jobs.claim("agent", "worker-late", lease_s=60) is None, "a second step ran at once"
        store = replicas[int(won["worker"][-1])]
        assert await store.adapters.record("agent", won["version"], str(tmp_path), won["id"], {}, owner=won["worker"])
        assert await store.jobs.finish(won["id"], won["worker"], ok=True, metrics={}, version=won["version"],
                                       error=None)  # fmt: skip
        recorded_versions.append(won["version"])
    assert recorded_versions == [1, 2, 3, 4]
    assert await replicas[1].jobs.claim("agent", "worker-1", lease_s=60) is None  # none left


async def test_the_store_refuses_a_second_running_job_of_a_policy_whoever_writes_it(
    replicas: tuple[Store, Store],
) -> None:
    first, second = await queue_jobs(replicas[0], 2)
    assert (await replicas[0].jobs.claim("agent", "worker-a", lease_s=60) or {}).get("id") == first
    async with replicas[1].engine.connect() as conn:  # a writer that skips the claim's check: the index decides
        with pytest.raises(IntegrityError):
            await conn.execute(update(J).where(J.c.id == second).values(state="running", worker="worker-b"))
            await conn.commit()


async def test_a_worker_whose_claim_was_lost_records_nothing_and_its_successor_records_that_version(
    replicas: tuple[Store, Store], tmp_path: Path
) -> None:
    slow, fresh = replicas
    await queue_jobs(slow, 1)
    stalled = await slow.jobs.claim("agent", "slow-host:1", lease_s=0.01)
    assert stalled is not None and stalled["version"] == 1
    await asyncio.sleep(0.05)
    assert [job for job, _ in await fresh.jobs.reclaim_expired()] == [stalled["id"]]
    taken = await fresh.jobs.claim("agent", "fresh-host:2", lease_s=60)
    assert taken is not None and (taken["id"], taken["version"]) == (stalled["id"], 1)
    assert not await slow.adapters.record("agent", 1, str(tmp_path / "slow"), stalled["id"], {}, owner="slow-host:1")
    assert await slow.adapters.get("agent", 1) is None
    assert await fresh.adapters.record("agent", 1, str(tmp_path / "fresh"), taken["id"], {}, owner="fresh-host:2")
    assert (await fresh.adapters.get("agent", 1) or {})["path"] == str(tmp_path / "fresh")


async def test_a_step_that_recorded_nothing_leaves_no_gap_in_the_versions(replicas: tuple[Store, Store]) -> None:
    await queue_jobs(replicas[0], 2)
    skipped = await replicas[0].jobs.claim("agent", "worker-a", lease_s=60, first_version=1)
    assert skipped is not None and skipped["version"] == 1
    assert await replicas[0].jobs.finish(skipped["id"], "worker-a", ok=True, metrics={}, version=None, error=None)
    following = await replicas[1].jobs.claim("agent", "worker-b", lease_s=60)
    assert following is not None and following["version"] == 1
    await replicas[1].jobs.finish(following["id"], "worker-b", ok=True, metrics={}, version=None, error=None)


async def test_the_claim_skips_versions_a_workers_disk_already_holds(replicas: tuple[Store, Store]) -> None:
    await queue_jobs(replicas[0], 1)
    claimed = await replicas[0].jobs.claim("agent", "worker-a", lease_s=60, first_version=6)
    assert claimed is not None and claimed["version"] == 6


# -- two real proxies on one PostgreSQL -----------------------------------------------------------------------------


@pytest.mark.filterwarnings(_LITELLM_TYPES)
def test_two_proxies_on_one_postgres_share_groups_judgements_adapters_and_threads(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, tmp_path: Path
) -> None:
    pg_url = _pg_url()
    asked = fake_judge(fake, delay_s=0.3)
    options: dict[str, Any] = {"database_url": pg_url, "reward_source": "judge", "group_size": 4, "min_group_size": 4,
                               "batch_groups": 2, "judge_quiet_s": 0.3, "judge_idle_s": 60}  # fmt: skip
    proxies = [start_proxy(data_dir=tmp_path / name, **options) for name in ("a", "b")]
    clients = [p.client() for p in proxies]
    fake.script(*[Reply("Paris." if i % 2 else "Lyon.") for i in range(8)])
    groups = []
    for i in range(8):  # the same task 8 times, alternating between the replicas
        raw = clients[i % 2].chat.completions.with_raw_response.create(model="agent", messages=TASK)
        groups.append(raw.headers["x-group-id"])
    assert sorted(Counter(groups).values()) == [4, 4]

    jobs = wait_for(lambda: httpx.get(f"{proxies[0].url}/admin/jobs").json()["data"], timeout=20)
    ok = [j for j in httpx.get(f"{proxies[1].url}/admin/judgements").json()["data"] if j["state"] == "ok"]
    assert sorted(j["group_id"] for j in ok) == sorted(set(groups)) and len(asked) == 2  # each group judged once
    assert len(jobs) == 1 and sorted(jobs[0]["group_ids"]) == sorted(set(groups))  # each group trained once

    # The trainer records the step's adapter: one replica publishes it, both serve it.
    path = tmp_path / "adapters" / "agent" / "1"
    path.mkdir(parents=True)
    sql(pg_url, "INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
                "VALUES ('agent', 1, $1, 'trained', '{}', $2)", str(path), time.time())  # fmt: skip
    wait_for(lambda: all(httpx.get(f"{p.url}/admin/adapters").json()["active_version"] == 1 for p in proxies))
    assert [c.chat.completions.create(model="agent", messages=TASK).model for c in clients] == ["agent@1"] * 2
    assert fake.handover.calls.count("load agent@1") == 1
    (adapter,) = sql(pg_url, "SELECT state, reclaimed FROM adapters")
    assert (adapter["state"], adapter["reclaimed"]) == ("published", 0)

    # An unkeyed conversation threads whichever replica takes its next call.
    fake.script(Reply("Rome."), Reply("Yes."), Reply("Sure."))
    task: list[Any] = [{"role": "user", "content": "Capital of Italy?"}]
    first = clients[0].chat.completions.with_raw_response.create(model="agent", messages=task)
    turns: list[Any] = [*task, {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "Sure?"}]
    second = clients[1].chat.completions.with_raw_response.create(model="agent", messages=turns)
    turns += [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Really?"}]
    third = clients[0].chat.completions.with_raw_response.create(model="agent", messages=turns)
    assert len({r.headers["x-trajectory-id"] for r in (first, second, third)}) == 1
    (thread,) = sql(pg_url, "SELECT n_calls FROM trajectories WHERE id = $1", first.headers["x-trajectory-id"])
    assert thread["n_calls"] == 3
