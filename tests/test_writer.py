"""The group-commit writer's SQLite path (SQLite's own driver) stores what SQLAlchemy's path stores."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from store import CallWrite, Store
from store._derived import Seat, seat_all_sqlite
from store._engine import dumps
from store._writer import write_batch, write_batch_sqlite


def _batches() -> list[list[CallWrite]]:
    """Calls of two trajectories in one group: two with every column, then an error call with the fewest."""
    full = {"id": "call-1", "trajectory_id": "t-1", "group_id": "g-1", "policy": "agent",
            "endpoint": "chat.completions", "model": "agent", "served_model": "base", "version": 2, "stream": True,
            "request": {"model": "agent", "messages": [{"role": "user", "content": "2+2? \u00e9"}]},
            "response": {"choices": [{"message": {"content": "4"}}]}, "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": [4], "logprobs": [-0.25], "other_choices": [], "finish_reason": "stop",
            "prompt_tokens": 3, "completion_tokens": 1, "status_code": 200, "error": None, "latency_ms": 1.5,
            "ttft_ms": 0.5, "started_at": 100.0}  # fmt: skip
    second = {**full, "id": "call-2", "started_at": 101.0}
    failed = {"id": "call-3", "trajectory_id": "t-2", "group_id": "g-1", "policy": "agent", "endpoint": "completions",
              "model": "agent", "served_model": "base", "version": 2, "stream": False, "request": {"prompt": "x"},
              "response": None, "status_code": 502, "error": "upstream down", "latency_ms": 2.0,
              "started_at": 102.0}  # fmt: skip
    return [
        [
            CallWrite(full, "t-1", "g-1", "agent", "header", None, None, 100.0, 2),
            CallWrite(second, "t-1", "g-1", "agent", "header", None, "tail-1", 101.0, 2),
        ],
        [CallWrite(failed, "t-2", "g-1", "agent", "new", "task-1", None, 102.0, 2)],
    ]


def _dump(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    conn = sqlite3.connect(path)
    try:
        return {
            "groups": conn.execute("SELECT * FROM groups ORDER BY id").fetchall(),
            # updated_at is the commit's clock
            "trajectories": conn.execute(
                "SELECT id, group_id, policy, keyed_by, created_at, n_calls, last_version, tail_hash, reward, metrics "
                "FROM trajectories ORDER BY id"
            ).fetchall(),
            "calls": conn.execute("SELECT * FROM calls ORDER BY pk").fetchall(),
        }
    finally:
        conn.close()


async def test_the_sqlite_driver_path_stores_what_sqlalchemy_stores(tmp_path: Path) -> None:
    paths = {"sqlalchemy": tmp_path / "a.db", "driver": tmp_path / "b.db"}
    for path in paths.values():
        store = await Store.open(f"sqlite+aiosqlite:///{path}", capture=False)
        await store.close()
    engine = create_engine(f"sqlite:///{paths['sqlalchemy']}", json_serializer=dumps)  # as the store's own
    for batch in _batches():
        with engine.begin() as conn:
            write_batch(conn, "sqlite", batch)
    engine.dispose()
    raw = sqlite3.connect(paths["driver"])
    for batch in _batches():
        write_batch_sqlite(raw, batch)
    raw.close()

    through_sqlalchemy, through_driver = _dump(paths["sqlalchemy"]), _dump(paths["driver"])
    assert len(through_driver["calls"]) == 3
    assert through_driver == through_sqlalchemy
    assert through_driver["calls"][2][11] == "null"  # a None response is JSON null, as SQLAlchemy writes it


async def test_seats_asked_together_fill_a_group_in_order_then_open_the_next(tmp_path: Path) -> None:
    path = tmp_path / "seats.db"
    store = await Store.open(f"sqlite+aiosqlite:///{path}", capture=False)
    await store.close()
    conn = sqlite3.connect(path)
    seats = [Seat("agent", "task-1", f"t-{i}", "new", 2, 100.0 + i) for i in range(5)]
    groups = seat_all_sqlite(conn, [*seats[:3], seats[0]])  # t-0 asked again: the group it got
    groups += seat_all_sqlite(conn, seats[3:])
    stored = conn.execute("SELECT task_seq, seats FROM groups ORDER BY task_seq").fetchall()
    conn.close()
    assert groups[:3] == [groups[0], groups[0], groups[2]] and groups[2] != groups[0]
    assert groups[3] == groups[0]
    assert groups[4] == groups[2] and groups[5] not in (groups[0], groups[2])
    assert stored == [(1, 2), (2, 2), (3, 1)]


async def _writes_by_thread(monkeypatch: Any) -> list[str]:
    """Names of the threads that committed call batches, in order."""
    import store._writer as writer

    threads: list[str] = []

    def spying(conn: sqlite3.Connection, writes: Any) -> None:
        write_batch_sqlite(conn, writes)
        threads.append(threading.current_thread().name)

    monkeypatch.setattr(writer, "write_batch_sqlite", spying)
    return threads


async def test_a_lone_call_is_committed_on_the_callers_thread_when_the_writer_is_idle(
    tmp_path: Path, monkeypatch: Any
) -> None:
    threads = await _writes_by_thread(monkeypatch)
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'lone.db'}")
    first = _batches()[0]
    await store.record_call(first[0], alone=True)
    await store.record_call(first[1])  # one of many: through the writer's thread
    group = await store.join_task_group("agent", "task-9", "t-9", keyed_by="new", group_size=8, alone=True)
    await store.close()
    assert threads == [threading.current_thread().name, "tracetrain-store-writer"]
    conn = sqlite3.connect(tmp_path / "lone.db")
    assert conn.execute("SELECT id FROM calls ORDER BY pk").fetchall() == [("call-1",), ("call-2",)]
    assert conn.execute("SELECT group_id FROM trajectories WHERE id = 't-9'").fetchall() == [(group,)]
    conn.close()


async def test_a_lone_call_goes_through_the_writer_when_sqlites_lock_is_taken(tmp_path: Path, monkeypatch: Any) -> None:
    """Another process (here: another connection) holds the write lock: the call waits its turn, and is kept."""
    threads = await _writes_by_thread(monkeypatch)
    path = tmp_path / "locked.db"
    store = await Store.open(f"sqlite+aiosqlite:///{path}")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    recording = asyncio.ensure_future(store.record_call(_batches()[0][0], alone=True))
    await asyncio.sleep(0.2)
    assert not recording.done()  # the writer's thread waits for the lock (its busy timeout)
    other.execute("ROLLBACK")
    await asyncio.wait_for(recording, 10)
    other.close()
    await store.close()
    assert threads == ["tracetrain-store-writer"]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT id FROM calls").fetchall() == [("call-1",)]
    conn.close()


def _new_trajectory_call(trajectory_id: str, call_id: str, group_size: int) -> CallWrite:
    """The first call of a new trajectory whose seat is left to its record (``seat_in``)."""
    row = {"id": call_id, "trajectory_id": trajectory_id, "group_id": "", "policy": "agent",
           "endpoint": "chat.completions", "model": "agent", "served_model": "base", "version": 0, "stream": False,
           "request": {"messages": [{"role": "user", "content": "2+2?"}]}, "response": None, "status_code": 200,
           "error": None, "latency_ms": 1.0, "started_at": 100.0}  # fmt: skip
    return CallWrite(row, trajectory_id, "", "agent", "new", "task-1", None, 100.0, 0, seat_in=group_size)


async def test_a_seat_left_to_the_record_is_taken_in_its_transaction(tmp_path: Path, monkeypatch: Any) -> None:
    """Seated in order, alone or through the writer; a trajectory seated meanwhile keeps the group it got."""
    import store._writer as writer

    seat_commits: list[int] = []  # transactions that took seats alone

    def seating(conn: sqlite3.Connection, seats: list[Seat]) -> list[str]:
        seat_commits.append(len(seats))
        return seat_all_sqlite(conn, seats)

    monkeypatch.setattr(writer, "seat_all_sqlite", seating)
    threads = await _writes_by_thread(monkeypatch)
    path = tmp_path / "seated.db"
    store = await Store.open(f"sqlite+aiosqlite:///{path}")
    assert store.seats_with_records
    writes = [_new_trajectory_call(f"t-{i}", f"call-{i}", group_size=2) for i in range(3)]
    await store.record_call(writes[0], alone=True)
    await store.record_call(writes[1])  # through the writer's thread
    await store.record_call(writes[2], alone=True)
    seated = await store.join_task_group("agent", "task-2", "t-late", keyed_by="header", group_size=2)
    late = _new_trajectory_call("t-late", "call-late", group_size=2)  # keyed by another call while in flight
    await store.record_call(late, alone=True)
    await store.close()
    here = threading.current_thread().name
    assert seat_commits == [1]  # only t-late's own seat: the others were taken in their records' transactions
    assert threads == [here, "tracetrain-store-writer", here, here]
    groups = [w.group_id for w in writes]
    assert groups[0] == groups[1] != groups[2] and all(groups) and late.group_id == seated
    conn = sqlite3.connect(path)
    stored = dict(conn.execute("SELECT id, group_id FROM trajectories").fetchall())
    assert stored == {"t-0": groups[0], "t-1": groups[1], "t-2": groups[2], "t-late": seated}
    assert dict(conn.execute("SELECT id, group_id FROM calls").fetchall()) == {
        "call-0": groups[0], "call-1": groups[1], "call-2": groups[2], "call-late": seated
    }  # fmt: skip
    seats = conn.execute("SELECT task_seq, seats FROM groups WHERE task_key = 'task-1' ORDER BY task_seq").fetchall()
    assert seats == [(1, 2), (2, 1)]
    assert conn.execute("SELECT n_calls FROM trajectories WHERE id = 't-late'").fetchall() == [(1,)]
    conn.close()


def test_sqlalchemys_path_refuses_a_seat_left_to_the_record() -> None:
    engine = create_engine("sqlite://")
    with engine.connect() as conn, pytest.raises(ValueError, match="SQLite only"):
        write_batch(conn, "postgresql", [_new_trajectory_call("t-0", "call-0", group_size=2)])


async def test_a_seated_trajectory_is_written_once_with_its_first_calls_values(tmp_path: Path) -> None:
    """The row a record's seat writes holds its call already (one call, its version and tail hash; never among
    the seats waiting for a call), with no second statement on it; two records of one new trajectory in a batch
    both count, the later's values last."""
    path = tmp_path / "first.db"
    await (await Store.open(f"sqlite+aiosqlite:///{path}")).close()
    conn = sqlite3.connect(path, isolation_level=None)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    alone = _new_trajectory_call("t-0", "call-0", group_size=3)
    alone.version, alone.tail_hash = 3, "tail-0"
    write_batch_sqlite(conn, [alone])
    assert not [s for s in statements if s.startswith("UPDATE trajectories") or "ON CONFLICT" in s]
    assert sum(s.startswith("INSERT INTO trajectories") for s in statements) == 1
    twice = [_new_trajectory_call("t-1", "call-1", group_size=3), _new_trajectory_call("t-1", "call-2", group_size=3)]
    twice[1].version, twice[1].tail_hash = 4, "tail-2"
    write_batch_sqlite(conn, twice)
    rows = conn.execute("SELECT id, n_calls, last_version, tail_hash FROM trajectories ORDER BY id").fetchall()
    assert rows == [("t-0", 1, 3, "tail-0"), ("t-1", 2, 4, "tail-2")]
    assert conn.execute("SELECT seats FROM groups").fetchall() == [(2,)]
    conn.close()
