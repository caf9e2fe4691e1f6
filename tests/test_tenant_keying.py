"""Two tenants racing on one id: a trajectory or group id is the first policy's whose call names it.

Tenant alpha's call is held by the fake vLLM while tenant beta, with its own key and policy, names the same
trajectory or group id: beta is refused with a 404 in its API's shape (saying the id is taken, not by whom),
on SQLite, on PostgreSQL, and through another proxy replica on the same PostgreSQL; alpha's call is answered
and recorded in alpha's own trajectory and group, and beta reads, lists and rewards none of it. Below the
HTTP tests, the store's own guards: keying on two replicas at once, a record naming another policy's id, and
a job's read.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from sqlalchemy import insert
from test_replicas import _pg_url

from proxy.errors import GroupNotFound, TrajectoryNotFound
from proxy.gateway import Keyer, KeyHints
from proxy.gateway._keying import Conversation
from store import CallWrite, KeyTaken, Store
from store._tables import trajectories as T

ALPHA_KEY = "alpha-key-" + "a" * 24
BETA_KEY = "beta-key-" + "b" * 24
ALPHA_TASK = [{"role": "user", "content": "tenant alpha: which table holds the orders?"}]
BETA_TASK = [{"role": "user", "content": "tenant beta: which table holds the invoices?"}]
HOLD_S = 2.0  # alpha's call stays with vLLM this long: beta comes meanwhile (on a fixed proxy, whenever it comes)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest) -> str | None:
    """None: the proxy's own SQLite file; else a PostgreSQL URL (skipped without one)."""
    return None if request.param == "sqlite" else _pg_url()


def tenants(start_proxy: Callable[..., RunningProxy], database: str | None, **options: Any) -> RunningProxy:
    """A proxy serving alpha and beta, each to its own key; on ``database`` when one is named."""
    if database is not None:
        options["database_url"] = database
    return start_proxy(policies=("alpha", "beta"), policy_keys=(("alpha", ALPHA_KEY), ("beta", BETA_KEY)), **options)


def client(proxy: RunningProxy, key: str, **headers: str) -> openai.OpenAI:
    """A client with ``key``, closed when the proxy stops."""
    made = openai.OpenAI(base_url=proxy.v1, api_key=key, max_retries=0, default_headers=headers or None)
    proxy._stack.callback(made.close)
    return made


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def alpha_held(fake: FakeVLLM) -> Iterator[Callable[[Callable[[], Any]], Future[Any]]]:
    """``hold(call)``: runs alpha's ``call`` in a thread and returns once vLLM has it (and holds it ``HOLD_S``)."""
    arrived = threading.Event()

    def reply_for(body: dict[str, Any]) -> Reply | None:
        if "tenant alpha" not in str(body.get("messages")):
            return None
        arrived.set()
        return Reply("orders", delay_s=HOLD_S)

    fake.reply_for = reply_for
    with ThreadPoolExecutor(max_workers=1) as pool:

        def hold(call: Callable[[], Any]) -> Future[Any]:
            arrived.clear()
            running = pool.submit(call)
            assert arrived.wait(timeout=60), "alpha's call never reached vLLM"
            return running

        yield hold


def assert_taken(error: openai.NotFoundError, code: str) -> None:
    assert error.code == code and "is taken by another policy" in error.message
    assert "alpha" not in error.message  # whose it is stays alpha's business


def only_alphas(proxy: RunningProxy, trajectory_id: str) -> None:
    """The trajectory is alpha's, with alpha's call alone, and beta neither reads nor rewards it."""
    mine = httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}", headers=auth(ALPHA_KEY))
    assert mine.status_code == 200, mine.text
    assert mine.json()["policy"] == "alpha"
    assert [c["policy"] for c in mine.json()["calls"]] == ["alpha"]
    assert "tenant alpha" in str(mine.json()["calls"][0]["request"])
    assert httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}", headers=auth(BETA_KEY)).status_code == 404
    reward = {"trajectory_id": trajectory_id, "reward": 1.0}
    assert httpx.post(f"{proxy.v1}/rewards", json=reward, headers=auth(BETA_KEY)).status_code == 404
    listed = httpx.get(f"{proxy.v1}/trajectories", headers=auth(BETA_KEY)).json()["data"]
    assert trajectory_id not in [t["id"] for t in listed]


# -- over HTTP, one proxy --------------------------------------------------------------------------------------------


def test_a_trajectory_id_is_the_first_tenants_from_its_first_call_and_another_tenant_racing_on_it_is_a_404(
    start_proxy: Callable[..., RunningProxy], database: str | None, alpha_held: Any
) -> None:
    proxy = tenants(start_proxy, database)
    alpha = client(proxy, ALPHA_KEY, **{"X-Trajectory-Id": "run-1"})
    beta = client(proxy, BETA_KEY, **{"X-Trajectory-Id": "run-1"})
    answered = alpha_held(lambda: alpha.chat.completions.with_raw_response.create(model="alpha", messages=ALPHA_TASK))

    with pytest.raises(openai.NotFoundError) as chat:
        beta.chat.completions.create(model="beta", messages=BETA_TASK)
    assert_taken(chat.value, "trajectory_not_found")
    with pytest.raises(openai.NotFoundError) as responses:
        beta.responses.create(model="beta", input="tenant beta: which table?")
    assert_taken(responses.value, "trajectory_not_found")
    assert not answered.done()  # all of it while alpha's call was still in flight

    raw = answered.result(timeout=60)
    assert raw.headers["x-trajectory-id"] == "run-1"
    assert raw.parse().choices[0].message.content == "orders"
    only_alphas(proxy, "run-1")


def test_a_new_group_id_is_the_first_tenants_from_its_first_call_and_another_tenant_racing_on_it_is_a_404(
    start_proxy: Callable[..., RunningProxy], database: str | None, alpha_held: Any
) -> None:
    proxy = tenants(start_proxy, database)
    alpha = client(proxy, ALPHA_KEY, **{"X-Group-Id": "task-7"})
    answered = alpha_held(lambda: alpha.chat.completions.with_raw_response.create(model="alpha", messages=ALPHA_TASK))

    claude = anthropic.Anthropic(base_url=proxy.url, api_key=BETA_KEY, max_retries=0,
                                 default_headers={"X-Group-Id": "task-7", "X-Trajectory-Id": "beta-1"})  # fmt: skip
    with pytest.raises(anthropic.NotFoundError) as messages:
        claude.messages.create(model="beta", max_tokens=16, messages=BETA_TASK)  # type: ignore[arg-type]
    error = messages.value.body["error"]  # type: ignore[index]
    assert messages.value.body["type"] == "error" and error["type"] == "not_found_error"  # type: ignore[index]
    assert "is taken by another policy" in error["message"] and "alpha" not in error["message"]
    beta = client(proxy, BETA_KEY, **{"X-Group-Id": "task-7"})
    with pytest.raises(openai.NotFoundError) as streamed:
        for _ in beta.chat.completions.create(model="beta", messages=BETA_TASK, stream=True):
            pass
    assert_taken(streamed.value, "group_not_found")
    assert not answered.done()

    raw = answered.result(timeout=60)
    assert raw.headers["x-group-id"] == "task-7"
    only_alphas(proxy, raw.headers["x-trajectory-id"])
    groups = httpx.get(f"{proxy.v1}/groups", headers=auth(ALPHA_KEY)).json()["data"]
    assert [(g["id"], g["policy"], g["size"]) for g in groups] == [("task-7", "alpha", 1)]
    assert httpx.get(f"{proxy.v1}/groups", headers=auth(BETA_KEY)).json()["data"] == []
    # Beta names groups of its own as ever.
    own = client(proxy, BETA_KEY, **{"X-Group-Id": "task-8"})
    assert own.chat.completions.with_raw_response.create(model="beta", messages=BETA_TASK).headers["x-group-id"] == (
        "task-8"
    )
    claude.close()


# -- over HTTP, two replicas on one PostgreSQL --------------------------------------------------------------------


def test_two_proxy_replicas_on_one_postgres_give_a_raced_trajectory_and_group_id_to_the_first_tenant(
    start_proxy: Callable[..., RunningProxy], alpha_held: Any, tmp_path: Path
) -> None:
    pg_url = _pg_url()
    first, second = (tenants(start_proxy, pg_url, data_dir=tmp_path / name) for name in ("a", "b"))
    alpha = client(first, ALPHA_KEY, **{"X-Trajectory-Id": "run-1", "X-Group-Id": "task-7"})
    answered = alpha_held(lambda: alpha.chat.completions.with_raw_response.create(model="alpha", messages=ALPHA_TASK))

    by_trajectory = client(second, BETA_KEY, **{"X-Trajectory-Id": "run-1", "X-Group-Id": "beta-group"})
    with pytest.raises(openai.NotFoundError) as trajectory:
        by_trajectory.chat.completions.create(model="beta", messages=BETA_TASK)
    assert_taken(trajectory.value, "trajectory_not_found")
    by_group = client(second, BETA_KEY, **{"X-Trajectory-Id": "beta-1", "X-Group-Id": "task-7"})
    with pytest.raises(openai.NotFoundError) as group:
        by_group.chat.completions.create(model="beta", messages=BETA_TASK)
    assert_taken(group.value, "group_not_found")
    assert not answered.done()

    assert answered.result(timeout=60).headers["x-trajectory-id"] == "run-1"
    only_alphas(second, "run-1")
    only_alphas(first, "run-1")


# -- the store's guards ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}" if request.param == "sqlite" else _pg_url()


@pytest.fixture
def pg_url() -> str:
    return _pg_url()


@pytest.fixture
async def replicas(shared_url: str) -> AsyncIterator[tuple[Store, Store]]:
    """Two stores on one database: what two proxy processes hold."""
    a, b = await Store.open(shared_url), await Store.open(shared_url)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def record(policy: str, trajectory_id: str, group_id: str) -> CallWrite:
    """The record of one call of ``policy``, as the forwarder writes it."""
    now = time.time()
    row = {"id": f"call-{uuid.uuid4().hex}", "trajectory_id": trajectory_id, "group_id": group_id, "policy": policy,
           "endpoint": "chat.completions", "model": policy, "served_model": policy, "version": 0, "stream": False,
           "request": {"model": policy, "messages": ALPHA_TASK}, "response": None, "status_code": 200,
           "latency_ms": 1.0, "started_at": now}  # fmt: skip
    return CallWrite(row, trajectory_id, group_id, policy, "header", None, None, now, 0)


async def test_two_policies_keying_one_new_trajectory_id_on_two_replicas_at_once_leave_it_to_one(
    replicas: tuple[Store, Store],
) -> None:
    keyers = [Keyer(store, group_size=4, thread_ttl_s=60) for store in replicas]
    for n in range(5):
        hints = KeyHints(header_trajectory=f"run-{n}")
        keyed = await asyncio.gather(
            *(k.resolve(p, hints, Conversation(p, ALPHA_TASK)) for k, p in zip(keyers, ("alpha", "beta"), strict=True)),
            return_exceptions=True,
        )
        assert sorted(type(k).__name__ for k in keyed) == ["Key", "TrajectoryNotFound"], keyed
        assert "is taken by another policy" in str(next(k for k in keyed if isinstance(k, TrajectoryNotFound)))


async def test_two_policies_naming_one_new_group_on_two_postgres_replicas_at_once_leave_it_to_one(pg_url: str) -> None:
    stores = [await Store.open(pg_url), await Store.open(pg_url)]
    try:
        keyers = [Keyer(store, group_size=4, thread_ttl_s=60) for store in stores]
        for n in range(5):
            keyed = await asyncio.gather(
                *(k.resolve(p, KeyHints(header_trajectory=f"{p}-{n}", header_group=f"task-{n}"),
                            Conversation(p, ALPHA_TASK)) for k, p in zip(keyers, ("alpha", "beta"), strict=True)),
                return_exceptions=True,
            )  # fmt: skip
            assert sorted(type(k).__name__ for k in keyed) == ["GroupNotFound", "Key"], keyed
            assert isinstance(next(k for k in keyed if not isinstance(k, GroupNotFound)).group_id, str)
    finally:
        for store in stores:
            await store.close()


async def test_a_record_naming_another_policys_trajectory_or_group_is_refused_and_its_batch_is_written(
    replicas: tuple[Store, Store],
) -> None:
    first, second = replicas
    await first.record_call(record("alpha", "run-1", "task-1"))
    with pytest.raises(KeyTaken) as trajectory:
        await second.record_call(record("beta", "run-1", "beta-group"))
    assert (trajectory.value.kind, trajectory.value.key) == ("trajectory", "run-1")
    with pytest.raises(KeyTaken) as group:
        await second.record_call(record("beta", "beta-1", "task-1"))
    assert (group.value.kind, group.value.key) == ("group", "task-1")
    # Two policies' first records of one new id in one group commit: the first is written, the other refused.
    written = await asyncio.gather(
        first.record_call(record("alpha", "run-2", "task-2")), first.record_call(record("beta", "run-2", "beta-2")),
        first.record_call(record("alpha", "run-3", "task-3")), return_exceptions=True,
    )  # fmt: skip
    assert [type(w).__name__ for w in written] == ["NoneType", "KeyTaken", "NoneType"]
    async with first.engine.connect() as conn:
        rows = (await conn.execute(T.select().order_by(T.c.id))).all()
    assert [(r.id, r.policy, r.group_id, r.n_calls) for r in rows] == [
        ("run-1", "alpha", "task-1", 1), ("run-2", "alpha", "task-2", 1), ("run-3", "alpha", "task-3", 1)
    ]  # fmt: skip
    groups = await first.reads.groups(min_group_size=1, policy=None, state=None, limit=100, after=None)
    assert {(g["id"], g["policy"]) for g in groups} == {("task-1", "alpha"), ("task-2", "alpha"), ("task-3", "alpha")}


async def test_a_job_reads_only_its_own_policys_trajectories_of_its_groups(replicas: tuple[Store, Store]) -> None:
    store = replicas[0]
    await store.record_call(record("alpha", "run-1", "task-1"))
    now = time.time()
    async with store.engine.begin() as conn:  # a row no keying writes: another policy's trajectory in alpha's group
        await conn.execute(insert(T).values(id="planted", group_id="task-1", policy="beta", keyed_by="header",
                                            created_at=now, updated_at=now, n_calls=0, metrics={}))  # fmt: skip
    async with store.engine.begin() as conn:
        await conn.execute(T.update().values(reward=1.0, rewarded_at=now))
    trained = await store.jobs.rewarded_trajectories(["task-1"], policy="alpha")
    assert [(t.id, len(t.calls)) for t in trained] == [("run-1", 1)]
