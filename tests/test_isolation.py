"""No call harms another: a record that cannot be written fails alone, a batch the database refuses is written row by
row, and a call that is never recorded leaves no seat for its group to wait on."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from test_postgres import pg_url  # noqa: F401  (pg_url is a fixture)

from store import CallWrite, Store, StoreError

TASK = [{"role": "user", "content": "Capital of Peru?"}]


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


def call(call_id: str, trajectory_id: str, **fields: Any) -> CallWrite:
    row = {"id": call_id, "trajectory_id": trajectory_id, "group_id": "g-1", "policy": "agent",
           "endpoint": "messages", "model": "agent", "served_model": "base", "version": 0, "stream": False,
           "request": {"messages": [{"role": "user", "content": "2+2?"}]}, "response": {"content": "4"},
           "prompt_token_ids": [1, 2], "completion_token_ids": [3], "logprobs": [-0.5], "status_code": 200,
           "error": None, "latency_ms": 1.0, "started_at": 100.0, **fields}  # fmt: skip
    return CallWrite(row, trajectory_id, "g-1", "agent", "header", None, None, 100.0, 0)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


async def stored_ids(store: Store) -> set[str]:
    records = [await store.reads.trajectory(f"t-{i}") for i in range(20)]
    return {c["id"] for record in records if record is not None for c in record.calls}


async def test_a_record_that_cannot_be_written_fails_alone_beside_its_batch(store_url: str) -> None:
    """orjson reads 1024 levels of nesting and writes 254: such a record failed the group commit of every call
    that shared its transaction."""
    store = await Store.open(store_url)
    writes = [call(f"c-{i}", f"t-{i}") for i in range(20)]
    writes[7] = call("c-7", "t-7", request={"metadata": nested(300)})
    try:
        results = await asyncio.gather(*(store.record_call(w) for w in writes), return_exceptions=True)
        assert isinstance(results[7], StoreError)
        assert "request" in str(results[7])
        assert [r for i, r in enumerate(results) if i != 7] == [None] * 19
        assert await stored_ids(store) == {f"c-{i}" for i in range(20)} - {"c-7"}
    finally:
        await store.close()


async def test_a_batch_the_database_refuses_is_written_row_by_row(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row the database itself refuses (past every check) fails alone: the batch is written again row by row."""
    import store._writer as writer

    refused = sqlite3.IntegrityError("CHECK constraint failed: refused row")

    def refusing(write: Callable[..., None]) -> Callable[..., None]:
        def wrapped(*args: Any) -> None:
            if any(w.call["id"] == "c-3" for w in args[-1]):
                raise refused
            write(*args)

        return wrapped

    monkeypatch.setattr(writer, "write_batch_sqlite", refusing(writer.write_batch_sqlite))
    monkeypatch.setattr(writer, "write_batch", refusing(writer.write_batch))
    store = await Store.open(store_url)
    try:
        results = await asyncio.gather(*(store.record_call(call(f"c-{i}", f"t-{i}")) for i in range(12)),
                                       return_exceptions=True)  # fmt: skip
        assert isinstance(results[3], StoreError)
        assert [r for i, r in enumerate(results) if i != 3] == [None] * 11
        assert await stored_ids(store) == {f"c-{i}" for i in range(12)} - {"c-3"}
    finally:
        await store.close()


async def test_a_nul_in_a_calls_error_does_not_fail_it_on_postgres(pg_url: str) -> None:  # noqa: F811
    """PostgreSQL's text refuses NUL, SQLite's takes it: the record is made storable before it is queued."""
    store = await Store.open(pg_url)
    try:
        failed = call("c-0", "t-0", status_code=502, error="upstream said a\x00b", response=None)
        await asyncio.gather(store.record_call(failed), store.record_call(call("c-1", "t-1")))
        record = await store.reads.trajectory("t-0")
    finally:
        await store.close()
    assert record is not None and record.calls[0]["error"] == "upstream said a\ufffdb"


# -- no stuck group ----------------------------------------------------------------------------------------


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The database refuses the record of any call whose request names ``"user": "poison"``."""
    import store._writer as writer

    write = writer.write_batch_sqlite

    def refusing(conn: sqlite3.Connection, writes: list[CallWrite]) -> None:
        if any("poison" in str(w.call["request"]) for w in writes):  # the request as a dict, or encoded
            raise sqlite3.IntegrityError("CHECK constraint failed: poison")
        write(conn, writes)

    monkeypatch.setattr(writer, "write_batch_sqlite", refusing)
    yield


def attempts(proxy: RunningProxy, users: list[str]) -> list[httpx.Response]:
    """One call per user at once, each a new trajectory of the same task (so of one derived group)."""
    answers: list[httpx.Response] = [httpx.Response(0)] * len(users)

    def one(i: int) -> None:
        body = {"model": "agent", "messages": TASK, "user": users[i]}
        answers[i] = httpx.post(f"{proxy.v1}/chat/completions", json=body, timeout=30)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(users))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def group_of(proxy: RunningProxy, trajectory_id: str) -> dict[str, Any]:
    group_id = httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}").json()["group_id"]
    (group,) = [g for g in httpx.get(f"{proxy.v1}/groups").json()["data"] if g["id"] == group_id]
    return group


def test_a_call_whose_record_fails_leaves_no_seat_and_its_group_trains_without_it(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, poisoned: None
) -> None:
    proxy = start_proxy(min_group_size=2)
    fake.script(*[Reply("Lima.", delay_s=0.3)] * 4)  # the four overlap: each is seated as it is keyed
    answers = attempts(proxy, ["a", "b", "poison", "c"])
    assert [a.status_code for a in answers] == [200, 200, 503, 200]
    for answer in (answers[0], answers[1], answers[3]):
        reward = {"trajectory_id": answer.headers["X-Trajectory-Id"], "reward": 1.0}
        httpx.post(f"{proxy.v1}/rewards", json=reward).raise_for_status()
    group = group_of(proxy, answers[0].headers["X-Trajectory-Id"])
    assert group["state"] == "ready" and group["size"] == 3
    assert proxy.rows("SELECT seats FROM groups WHERE id = ?", group["id"])[0]["seats"] == 3
    assert proxy.rows("SELECT * FROM trajectories WHERE n_calls = 0") == []


def test_a_seat_whose_call_never_came_is_given_back_after_the_seat_timeout(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    """A replica that died between keying a new trajectory and recording its call left a seat with no call."""
    # The dead replica's seat is a minute old; 3 s (swept every 1.5 s), not less, so that a live call slowed by a
    # loaded machine between its keying and its record never loses its own seat.
    proxy = start_proxy(min_group_size=2, seat_timeout_s=3.0)
    ids = []
    for _ in range(2):
        answer = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": TASK})
        ids.append(answer.headers["X-Trajectory-Id"])
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": ids[-1], "reward": 0.5}).raise_for_status()
    group_id = answer.headers["X-Group-Id"]
    with sqlite3.connect(proxy.db_path) as conn:  # the dead replica's seat, taken a minute ago
        conn.execute(
            "INSERT INTO trajectories (id, group_id, policy, keyed_by, created_at, updated_at, n_calls, last_version,"
            " metrics) VALUES ('crashed', ?, 'agent', 'new', ?, ?, 0, 0, '{}')", (group_id, time.time() - 60,
                                                                                  time.time() - 60),
        )  # fmt: skip
        conn.execute("UPDATE groups SET seats = seats + 1 WHERE id = ?", (group_id,))
    deadline = time.monotonic() + 30
    while group_of(proxy, ids[0])["state"] != "ready":
        assert time.monotonic() < deadline, "the crashed call's seat was never given back"
        time.sleep(0.1)
    assert proxy.rows("SELECT seats FROM groups WHERE id = ?", group_id)[0]["seats"] == 2
    assert proxy.rows("SELECT * FROM trajectories WHERE id = 'crashed'") == []


def test_a_reward_the_full_disk_cannot_take_is_a_503_to_retry(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    """It was a 500 whose exception left the app, and uvicorn dropped the kept-alive connection under the client."""
    from test_full_disk import fill, mounted_small_disk

    with mounted_small_disk(tmp_path / "small-disk") as disk:
        proxy = start_proxy(data_dir=disk)
        answer = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": TASK})
        trajectory_id = answer.headers["X-Trajectory-Id"]
        filler = fill(disk)
        with httpx.Client(base_url=proxy.v1) as client:
            refused = client.post("/rewards", json={"trajectory_id": trajectory_id, "reward": 1.0})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_unavailable"
            assert "disk is full" in refused.json()["error"]["message"]
            filler.unlink()
            taken = client.post("/rewards", json={"trajectory_id": trajectory_id, "reward": 1.0})
            assert taken.status_code == 200  # on the same connection


def test_a_record_the_store_refuses_fails_its_call_alone_over_http(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case with the door's depth check taken away: a Messages call whose metadata is nested 300 deep,
    beside thirty ordinary chat calls. Its record is refused before it joins a batch: it alone fails (400, in
    Anthropic's shape, not retried by SDKs), and every ordinary call is answered and recorded."""
    import proxy.gateway.dialects._dialect as wire

    monkeypatch.setattr(wire, "check_nesting", lambda raw, body: None)
    proxy = start_proxy()
    fake.script(*[Reply("Lima.", delay_s=0.2)] * 31)
    deep: Any = "deep"
    for _ in range(300):
        deep = {"k": deep}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, path: str, body: dict[str, Any]) -> None:
        answers[name] = httpx.post(f"{proxy.v1}{path}", json=body, headers={"X-Trajectory-Id": name}, timeout=30)

    messages = {"model": "agent", "max_tokens": 16, "messages": TASK, "metadata": deep}
    threads = [threading.Thread(target=send, args=("deep", "/messages", messages))]
    chat = {"model": "agent", "messages": TASK}
    threads += [threading.Thread(target=send, args=(f"ok-{i}", "/chat/completions", chat)) for i in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = answers.pop("deep")
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "cannot be stored" in refused.json()["error"]["message"]
    assert {name: a.status_code for name, a in answers.items()} == {f"ok-{i}": 200 for i in range(30)}
    recorded = {row["trajectory_id"] for row in proxy.rows("SELECT trajectory_id FROM calls")}
    assert recorded == {f"ok-{i}" for i in range(30)}
