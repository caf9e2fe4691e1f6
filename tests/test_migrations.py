"""Schema migrations (``store._migrate``, ``store/migrations``) and ``tracetrain db``.

Each test runs on SQLite, and on PostgreSQL when TRACETRAIN_TEST_POSTGRES_URL names a server
(`.ci/postgres.sh` starts one): there every test makes its own databases and drops them, so
it never meets another test's tables. A database of tracetrain 35c4648, the last release
without migrations, is built from that release's DDL in tests/data/ (written by
tests/tools/dump_legacy_schema.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import sqlite3
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, MetaData, event, insert, inspect, make_url, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlmodel import SQLModel

import store._tables  # noqa: F401  (registers the tables)
from store._errors import SchemaTooNew, StoreError
from store._migrate import FIRST, LEGACY, Upgrade, alembic_config, current_revision, head, revisions, upgrade
from tracetrain_cli._main import main

DATA = Path(__file__).parent / "data"
NEW_COLUMNS: dict[str, dict[str, Any]] = {
    "training_jobs": {
        "lease_expires_at": None,
        "reclaimed": 0,
        "gpu_state": "none",
        "gpu_requested_at": None,
        "gpu_granted_at": None,
        "gpu_released_at": None,
        "gpu_asleep_s": None,
    },
    "adapters": {"lease_owner": None, "lease_expires_at": None, "reclaimed": 0, "guard": None},
    "policies": {
        "training": "active",
        "training_reason": None,
        "paused_at": None,
        "rolled_back_at": None,
        "config": None,
        "state": "serving",
        "retired_at": None,
    },  # 0009: every old policy is served
    "groups": {"judge_owner": None, "judge_lease_expires_at": None},
    # 0007: every old row is whole; 0013: no old row was sampled under a grammar it recorded; 0014: no call rewarded
    "calls": {"prefix_of": None, "prefix_tokens": 0, "prefix_messages": 0, "structured_outputs": None, "reward": None},
    "trajectories": {"reward_note": None, "demonstration": None},  # 0012, 0014
    "rewards": {"call_id": None},  # 0014: every old reward is a trajectory's
}
# Values a revision renames: 0012 calls a posted reward's source "service" (it was "external").
RENAMED: dict[str, dict[str, dict[Any, Any]]] = {
    "rewards": {"source": {"external": "service"}},
    "trajectories": {"reward_source": {"external": "service"}},
}
# Columns a revision fills from the rows already there: derived groups numbered within their task, seats taken.
BACKFILLED: dict[str, dict[str, dict[str, Any]]] = {
    "groups": {
        "g-open": {"task_seq": 1, "seats": 1},
        "g-training": {"task_seq": None, "seats": 0},
        "g-trained": {"task_seq": 1, "seats": 2},
        "g-failed": {"task_seq": None, "seats": 0},
    },
}
MakeDatabase = Callable[[], str]
_T = TypeVar("_T")


def _in_thread(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run on a loop of its own in another thread, whatever loop this thread has."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _admin(server_url: str, statement: str) -> None:
    conn = await asyncpg.connect(make_url(server_url).set(drivername="postgresql").render_as_string(False))
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def make_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeDatabase]:
    """Makes empty databases of the backend under test; each call, another one."""
    made: list[str] = []
    server = os.environ.get("TRACETRAIN_TEST_POSTGRES_URL")
    if request.param == "postgresql" and not server:
        pytest.skip("set TRACETRAIN_TEST_POSTGRES_URL to run the migrations on PostgreSQL (.ci/postgres.sh)")

    def make() -> str:
        name = f"tt_mig_{secrets.token_hex(6)}"
        made.append(name)
        if request.param == "sqlite":
            return f"sqlite+aiosqlite:///{tmp_path / name}.db"
        assert server is not None
        _in_thread(_admin(server, f'CREATE DATABASE "{name}"'))
        return make_url(server).set(database=name).render_as_string(hide_password=False)

    yield make
    if request.param == "postgresql":
        assert server is not None
        for name in made:
            _in_thread(_admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@asynccontextmanager
async def opened(url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(url)
    try:
        yield engine
    finally:
        await engine.dispose()


# -- a database of tracetrain 35c4648, and what it holds ---------------------------------------------------------

T0 = 1_764_000_000.25


def release_rows() -> dict[str, list[dict[str, Any]]]:
    """A store that was used: rows in every table, in each state a group, job or adapter can be in."""
    chat = {"messages": [{"role": "user", "content": "Capital of Peru?"}], "temperature": 0.7, "logprobs": True}
    reply = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Lima."}}]}
    return {
        "policies": [
            {"name": "agent", "base_model": "smollm2-135m-instruct", "active_version": 2, "created_at": T0,
             "updated_at": T0 + 900.5},
        ],
        "groups": [
            {"id": "g-open", "policy": "agent", "task_key": "a1b2c3", "state": "open", "job_id": None,
             "created_at": T0},
            {"id": "g-training", "policy": "agent", "task_key": None, "state": "training", "job_id": 2,
             "created_at": T0 + 1},
            {"id": "g-trained", "policy": "agent", "task_key": "d4e5f6", "state": "trained", "job_id": 3,
             "created_at": T0 + 2},
            {"id": "g-failed", "policy": "agent", "task_key": None, "state": "failed", "job_id": 4,
             "created_at": T0 + 3},
        ],
        "trajectories": [
            {"id": "t-rewarded", "group_id": "g-trained", "policy": "agent", "keyed_by": "header", "created_at": T0,
             "updated_at": T0 + 5, "n_calls": 2, "last_version": 1, "tail_hash": None, "reward": 1.0,
             "reward_source": "external", "metrics": {"pass": 1.0, "steps": 2.0}, "rewarded_at": T0 + 6},
            {"id": "t-judged", "group_id": "g-trained", "policy": "agent", "keyed_by": "thread", "created_at": T0,
             "updated_at": T0 + 5, "n_calls": 1, "last_version": 1, "tail_hash": "9f8e7d", "reward": 0.25,
             "reward_source": "judge", "metrics": {}, "rewarded_at": T0 + 7},
            {"id": "t-waiting", "group_id": "g-open", "policy": "agent", "keyed_by": "new", "created_at": T0 + 8,
             "updated_at": T0 + 8, "n_calls": 1, "last_version": 2, "tail_hash": "0a1b2c", "reward": None,
             "reward_source": None, "metrics": {}, "rewarded_at": None},
        ],
        "calls": [
            {"id": "c-1", "trajectory_id": "t-rewarded", "group_id": "g-trained", "policy": "agent",
             "endpoint": "chat.completions", "model": "agent", "served_model": "agent@1", "version": 1,
             "stream": False, "request": chat, "response": reply, "prompt_token_ids": [1, 9906, 28, 2],
             "completion_token_ids": [43, 4412, 13, 0], "logprobs": [-0.125, -2.5e-05, -3.75, 0.0],
             "other_choices": [], "finish_reason": "stop", "prompt_tokens": 4, "completion_tokens": 4,
             "status_code": 200, "error": None, "latency_ms": 81.5, "ttft_ms": 12.25, "started_at": T0 + 1},
            {"id": "c-2", "trajectory_id": "t-rewarded", "group_id": "g-trained", "policy": "agent",
             "endpoint": "chat.completions", "model": "agent", "served_model": "agent@1", "version": 1,
             "stream": True, "request": {**chat, "n": 2, "stream": True}, "response": reply,
             "prompt_token_ids": [1, 9906, 28, 2, 43, 4412], "completion_token_ids": [7, 8],
             "logprobs": [-0.5, -1.0],
             "other_choices": [{"token_ids": [9], "logprobs": [-4.5], "finish_reason": "length"}],
             "finish_reason": "stop", "prompt_tokens": 6, "completion_tokens": 2, "status_code": 200,
             "error": None, "latency_ms": 40.0, "ttft_ms": 5.5, "started_at": T0 + 2},
            {"id": "c-3", "trajectory_id": "t-waiting", "group_id": "g-open", "policy": "agent",
             "endpoint": "completions", "model": "agent", "served_model": "smollm2-135m-instruct", "version": 0,
             "stream": False, "request": {"prompt": "Once upon", "max_tokens": 99999}, "response": None,
             "prompt_token_ids": [], "completion_token_ids": [], "logprobs": [], "other_choices": [],
             "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0, "status_code": 400,
             "error": "max_tokens is too large", "latency_ms": 3.0, "ttft_ms": None, "started_at": T0 + 8},
        ],
        "rewards": [
            {"trajectory_id": "t-rewarded", "group_id": "g-trained", "value": 1.0, "metrics": {"pass": 1.0},
             "source": "external", "explanation": None, "created_at": T0 + 6},
            {"trajectory_id": "t-judged", "group_id": "g-trained", "value": 0.25, "metrics": {},
             "source": "judge", "explanation": "answered, but named the wrong city first", "created_at": T0 + 7},
        ],
        "training_jobs": [
            {"id": 1, "policy": "agent", "state": "queued", "group_ids": ["g-open"], "version": None,
             "metrics": {}, "progress": 0.0, "error": None, "worker": None, "created_at": T0 + 10,
             "started_at": None, "finished_at": None},
            {"id": 2, "policy": "agent", "state": "running", "group_ids": ["g-training"], "version": None,
             "metrics": {}, "progress": 0.5, "error": None, "worker": "trainer-host:4242", "created_at": T0 + 11,
             "started_at": T0 + 12, "finished_at": None},
            {"id": 3, "policy": "agent", "state": "succeeded", "group_ids": ["g-trained"], "version": 1,
             "metrics": {"loss": 0.0625, "kl": 0.001, "groups": 1}, "progress": 1.0, "error": None,
             "worker": "trainer-host:4242", "created_at": T0 + 13, "started_at": T0 + 14, "finished_at": T0 + 60},
            {"id": 4, "policy": "agent", "state": "failed", "group_ids": ["g-failed"], "version": None,
             "metrics": {}, "progress": 0.25, "error": "CUDA out of memory", "worker": "trainer-host:4243",
             "created_at": T0 + 15, "started_at": T0 + 16, "finished_at": T0 + 17},
        ],
        "adapters": [
            {"policy": "agent", "version": 1, "path": "/data/adapters/agent/v1", "job_id": 3, "state": "retired",
             "error": None, "metrics": {"loss": 0.0625}, "created_at": T0 + 60, "published_at": T0 + 61},
            {"policy": "agent", "version": 2, "path": "/data/adapters/agent/v2", "job_id": None,
             "state": "published", "error": None, "metrics": {}, "created_at": T0 + 70, "published_at": T0 + 71},
            {"policy": "agent", "version": 3, "path": "/data/adapters/agent/v3", "job_id": None, "state": "loading",
             "error": None, "metrics": {}, "created_at": T0 + 80, "published_at": None},
            {"policy": "agent", "version": 4, "path": "/data/adapters/agent/v4", "job_id": None, "state": "trained",
             "error": None, "metrics": {}, "created_at": T0 + 90, "published_at": None},
        ],
        "judgements": [
            {"group_id": "g-trained", "policy": "agent", "reward_source": "both", "trigger": "complete",
             "state": "ok", "model": "openai/gpt-4o-mini", "cache_key": "c0ffee", "cached": False, "attempts": 1,
             "n_trajectories": 2,
             "scores": [{"trajectory_id": "t-rewarded", "label": "A", "score": 0.9, "explanation": "right"},
                        {"trajectory_id": "t-judged", "label": "B", "score": 0.25, "explanation": "late"}],
             "error": None, "usage": {"prompt_tokens": 812, "completion_tokens": 64}, "started_at": T0 + 20,
             "finished_at": T0 + 23.5},
        ],
    }  # fmt: skip


def _create_release_schema(conn: Connection) -> None:
    ddl = (DATA / f"schema_35c4648.{conn.dialect.name}.sql").read_text()
    body = "\n".join(line for line in ddl.splitlines() if not line.startswith("--"))
    for statement in body.split(";"):
        if statement.strip():
            conn.exec_driver_sql(statement)


def _fill(conn: Connection) -> None:
    tables = MetaData()
    tables.reflect(conn)
    for name, rows in release_rows().items():
        conn.execute(insert(tables.tables[name]), rows)


async def build_release_database(url: str, *, rows: bool = True) -> None:
    """The database tracetrain 35c4648 would have left: its tables (no alembic_version), and rows."""
    async with opened(url) as engine, engine.begin() as conn:
        await conn.run_sync(_create_release_schema)
        if rows:
            await conn.run_sync(_fill)


def _all_rows(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    tables = MetaData()
    tables.reflect(conn)
    return {
        name: [dict(row._mapping) for row in conn.execute(select(table).order_by(*table.primary_key.columns))]
        for name, table in tables.tables.items()
        if name != "alembic_version"
    }


def _schema(conn: Connection) -> dict[str, Any]:
    """Everything create_all or a migration decides: columns, types, defaults, keys, indexes, their names."""
    inspector = inspect(conn)
    return {
        name: {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], c.get("default")) for c in inspector.get_columns(name)
            ],
            "primary_key": inspector.get_pk_constraint(name)["constrained_columns"],
            "unique": sorted((u["name"] or "", u["column_names"]) for u in inspector.get_unique_constraints(name)),
            "indexes": sorted((i["name"] or "", i["column_names"], i["unique"]) for i in inspector.get_indexes(name)),
        }
        for name in sorted(inspector.get_table_names())
        if name != "alembic_version"
    }


def _catalog(conn: Connection) -> list[tuple[Any, ...]]:
    """The database's own record of the DDL: SQLite's statements as written, Postgres's catalog."""
    if conn.dialect.name == "sqlite":
        query = "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE tbl_name != 'alembic_version'"
    else:
        query = """
            SELECT table_name, column_name, data_type, is_nullable, column_default FROM information_schema.columns
                WHERE table_schema = 'public' AND table_name != 'alembic_version'
            UNION ALL SELECT tablename, indexname, indexdef, '', '' FROM pg_indexes
                WHERE schemaname = 'public' AND tablename != 'alembic_version'
            UNION ALL SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), contype::text, ''
                FROM pg_constraint WHERE connamespace = 'public'::regnamespace
                AND conrelid::regclass::text != 'alembic_version'
        """
    return sorted(tuple(row) for row in conn.exec_driver_sql(query))


def _to(revision: str) -> Callable[[Connection], None]:
    return lambda conn: command.upgrade(alembic_config(conn), revision)


# -- the store's migrations ----------------------------------------------------------------------------------------


async def test_the_models_and_the_migrations_agree(make_database: MakeDatabase) -> None:
    async with opened(make_database()) as engine:
        await upgrade(engine)
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), SQLModel.metadata))
    assert diff == [], f"store/_tables.py and store/migrations/versions/ differ; add a revision for: {diff}"


async def test_revision_0001_makes_exactly_the_schema_35c4648_made(make_database: MakeDatabase) -> None:
    release, migrated = make_database(), make_database()
    await build_release_database(release, rows=False)
    async with opened(migrated) as engine, engine.begin() as conn:
        await conn.run_sync(_to(FIRST))
    async with opened(release) as a, a.connect() as conn_a, opened(migrated) as b, b.connect() as conn_b:
        assert await conn_b.run_sync(_catalog) == await conn_a.run_sync(_catalog)


async def test_a_35c4648_database_is_upgraded_with_every_row_intact(make_database: MakeDatabase) -> None:
    url = make_database()
    await build_release_database(url)
    async with opened(url) as engine:
        async with engine.connect() as conn:
            before = await conn.run_sync(_all_rows)
        assert await current_revision(engine) == LEGACY

        done = await upgrade(engine)

        assert done == Upgrade(from_revision=FIRST, to_revision=head(), legacy=True)
        assert await current_revision(engine) == head()
        async with engine.connect() as conn:
            after = await conn.run_sync(_all_rows)
    assert {name: len(rows) for name, rows in before.items()} == {name: len(r) for name, r in release_rows().items()}
    for name, rows in before.items():
        added = NEW_COLUMNS.get(name, {})
        filled = BACKFILLED.get(name, {})
        new = added.keys() | {k for values in filled.values() for k in values}
        renamed = RENAMED.get(name, {})
        rows = [{k: renamed[k].get(v, v) if k in renamed else v for k, v in row.items()} for row in rows]
        assert [{k: v for k, v in row.items() if k not in new} for row in after[name]] == rows, name
        assert all({k: row[k] for k in added} == added for row in after[name]), name
        for row in after[name] if filled else ():
            assert {k: row[k] for k in filled[row["id"]]} == filled[row["id"]], (name, row["id"])


async def test_upgrading_an_empty_database_runs_every_revision(make_database: MakeDatabase) -> None:
    async with opened(make_database()) as engine:
        assert await current_revision(engine) is None

        done = await upgrade(engine)

        assert done == Upgrade(from_revision=None, to_revision=head(), legacy=False)
        assert done.changed
        assert await current_revision(engine) == head() == revisions()[-1]
        async with engine.connect() as conn:
            tables = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    assert tables == set(SQLModel.metadata.tables) | {"alembic_version"}


async def test_upgrading_twice_changes_nothing_and_costs_one_query(make_database: MakeDatabase) -> None:
    async with opened(make_database()) as engine:
        await upgrade(engine)
        async with engine.connect() as conn:
            schema = await conn.run_sync(_schema)
        statements: list[str] = []
        event.listen(engine.sync_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))

        again = await upgrade(engine)

        assert again == Upgrade(from_revision=head(), to_revision=head(), legacy=False)
        assert not again.changed
        assert len(statements) == 1, statements
        async with engine.connect() as conn:
            assert await conn.run_sync(_schema) == schema


async def test_a_database_from_a_newer_tracetrain_is_refused_and_left_alone(make_database: MakeDatabase) -> None:
    async with opened(make_database()) as engine:
        await upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = '0099_from_the_future'"))

        with pytest.raises(SchemaTooNew, match=rf"0099_from_the_future.*{head()}.*[Uu]pgrade tracetrain"):
            await upgrade(engine)

        assert await current_revision(engine) == "0099_from_the_future"


async def test_a_database_with_only_some_of_the_tables_is_not_taken_for_35c4648(make_database: MakeDatabase) -> None:
    async with opened(make_database()) as engine:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE policies (name VARCHAR PRIMARY KEY)"))
        assert await current_revision(engine) == LEGACY

        with pytest.raises(StoreError, match="not adapters, calls, groups, judgements, rewards"):
            await upgrade(engine)

        assert await current_revision(engine) == LEGACY


async def test_downgrading_the_claims_gives_back_the_35c4648_schema_and_rows(make_database: MakeDatabase) -> None:
    release, url = make_database(), make_database()
    await build_release_database(release, rows=False)
    await build_release_database(url)
    async with opened(url) as engine:
        async with engine.connect() as conn:
            before = await conn.run_sync(_all_rows)
        await upgrade(engine)

        async with engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(alembic_config(c), FIRST))

        assert await current_revision(engine) == FIRST
        async with engine.connect() as conn:
            assert await conn.run_sync(_all_rows) == before
            schema = await conn.run_sync(_schema)
    async with opened(release) as engine, engine.connect() as conn:
        assert schema == await conn.run_sync(_schema)


async def test_upgrading_past_0007_queues_again_every_running_job_of_a_policy_but_the_oldest(
    make_database: MakeDatabase,
) -> None:
    async with opened(make_database()) as engine:
        async with engine.begin() as conn:
            await conn.run_sync(_to("0006_replicas"))
            for job_id, policy in ((1, "agent"), (2, "agent"), (3, "agent"), (4, "other")):
                await conn.execute(
                    text("INSERT INTO training_jobs (id, policy, state, group_ids, metrics, progress, worker, "
                         "lease_expires_at, reclaimed, created_at, started_at, gpu_state) VALUES (:id, :policy, "
                         "'running', '[]', '{}', 0.5, :worker, 9e9, 0, 1.0, 1.0, 'none')"),
                    {"id": job_id, "policy": policy, "worker": f"host:{job_id}"},
                )  # fmt: skip
        await upgrade(engine)
        async with engine.connect() as conn:
            rows = (
                await conn.execute(text("SELECT id, state, worker, reclaimed FROM training_jobs ORDER BY id"))
            ).all()
    assert [tuple(r) for r in rows] == [
        (1, "running", "host:1", 0), (2, "queued", None, 1), (3, "queued", None, 1), (4, "running", "host:4", 0)
    ]  # fmt: skip


async def test_engines_upgrading_the_same_database_together_migrate_it_once(make_database: MakeDatabase) -> None:
    url = make_database()
    async with opened(url) as first, opened(url) as second:
        done = await asyncio.gather(upgrade(first), upgrade(second))

        assert sorted(d.changed for d in done) == [False, True]
        assert {d.to_revision for d in done} == {head()}
        assert await current_revision(first) == head()


# Imports first, says so, then upgrades when told: the replicas start their upgrades together.
REPLICA = """
import asyncio, sys
from sqlalchemy.ext.asyncio import create_async_engine
from store._migrate import upgrade

async def main() -> None:
    engine = create_async_engine(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    done = await upgrade(engine)
    await engine.dispose()
    print(done.changed, done.to_revision, flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_replica_processes_starting_together_migrate_the_database_once(make_database: MakeDatabase) -> None:
    url = make_database()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "sdk")])}
    replicas = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", REPLICA, url, env=env, stdin=PIPE, stdout=PIPE, stderr=PIPE
        )
        for _ in range(3)
    ]
    for replica in replicas:
        assert replica.stdout is not None
        assert await replica.stdout.readline() == b"ready\n"
    for replica in replicas:
        assert replica.stdin is not None
        replica.stdin.write(b"go\n")
        await replica.stdin.drain()

    results = await asyncio.gather(*(replica.communicate() for replica in replicas))

    assert [replica.returncode for replica in replicas] == [0, 0, 0], [err.decode() for _, err in results]
    assert sorted(out.decode().split()[0] for out, _ in results) == ["False", "False", "True"]
    assert {out.decode().split()[1] for out, _ in results} == {head()}


# -- tracetrain db ---------------------------------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data directory whose store, tracetrain.db, exists and is empty."""
    monkeypatch.delenv("TRACETRAIN_DATABASE_URL", raising=False)
    sqlite3.connect(tmp_path / "tracetrain.db").close()
    return tmp_path


def _db(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["db", *argv])
    out, err = capsys.readouterr()
    return status, out.strip(), err.strip()


def test_db_current_says_what_each_kind_of_store_is(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite+aiosqlite:///{data_dir / 'tracetrain.db'}"
    shown = f"sqlite:///{data_dir / 'tracetrain.db'}"
    assert _db(capsys, "current", "--data-dir", str(data_dir)) == (0, f"{shown}: empty", "")

    asyncio.run(build_release_database(url))
    assert _db(capsys, "current", "--data-dir", str(data_dir)) == (
        0, f"{shown}: no migration history: a database written by tracetrain 35c4648 (run tracetrain db upgrade)", "",
    )  # fmt: skip

    async def stamp_first() -> None:
        async with opened(url) as engine, engine.begin() as conn:
            await conn.run_sync(lambda c: command.stamp(alembic_config(c), FIRST))

    asyncio.run(stamp_first())
    assert _db(capsys, "current", "--data-dir", str(data_dir)) == (
        0, f"{shown}: revision {FIRST} (head is {head()}: run tracetrain db upgrade)", "",
    )  # fmt: skip

    assert main(["db", "upgrade", "--data-dir", str(data_dir)]) == 0
    capsys.readouterr()
    assert _db(capsys, "current", "--data-dir", str(data_dir)) == (0, f"{shown}: revision {head()} (head)", "")


def test_db_upgrade_says_what_it_did(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shown = f"sqlite:///{data_dir / 'tracetrain.db'}"
    asyncio.run(build_release_database(f"sqlite+aiosqlite:///{data_dir / 'tracetrain.db'}"))

    assert _db(capsys, "upgrade", "--data-dir", str(data_dir)) == (
        0, f"{shown}: upgraded from no migration history (tracetrain 35c4648) to {head()}", "",
    )  # fmt: skip
    assert _db(capsys, "upgrade", "--data-dir", str(data_dir)) == (0, f"{shown}: already at {head()}", "")


def test_db_commands_refuse_a_store_from_a_newer_tracetrain(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--data-dir", str(data_dir)]) == 0
    with sqlite3.connect(data_dir / "tracetrain.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_from_the_future'")
    capsys.readouterr()

    for command_name in ("upgrade", "current"):
        status, out, err = _db(capsys, command_name, "--data-dir", str(data_dir))
        assert (status, out) == (2, ""), command_name
        assert "0099_from_the_future" in err and head() in err and "Upgrade tracetrain" in err, err


@pytest.mark.parametrize("make_database", ["postgresql"], indirect=True)  # a SQLite URL has no password
def test_db_commands_never_print_the_password(
    make_database: MakeDatabase, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = make_database()
    password = make_url(url).password
    assert password
    monkeypatch.delenv("TRACETRAIN_DATABASE_URL", raising=False)

    upgraded = _db(capsys, "upgrade", "--database-url", url)
    current = _db(capsys, "current", "--database-url", url)

    assert upgraded[0] == current[0] == 0
    assert upgraded[1].endswith(f": upgraded from empty to {head()}")
    assert current[1].endswith(f": revision {head()} (head)")
    assert current[1].startswith("postgresql://") and ":***@" in current[1]
    assert str(password) not in "".join(upgraded[1:] + current[1:])


def test_db_without_a_subcommand_shows_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db"]) == 2
    out = capsys.readouterr().out
    assert "current" in out and "upgrade" in out


async def test_two_databases_upgrading_together_in_one_process_each_get_every_table(
    make_database: MakeDatabase,
) -> None:
    # Alembic's `op` and `context` are module globals: two upgrades interleaving on one event loop
    # (or in two threads) would send one database's DDL to the other's connection.
    async with opened(make_database()) as first, opened(make_database()) as second:
        done = await asyncio.gather(upgrade(first), upgrade(second))

        assert [d.changed for d in done] == [True, True]
        for engine in (first, second):
            async with engine.connect() as conn:
                diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), SQLModel.metadata))
            assert diff == []


async def test_an_in_memory_database_upgrades_to_head() -> None:
    async with opened("sqlite+aiosqlite:///:memory:") as engine:
        done = await upgrade(engine)

        assert done == Upgrade(from_revision=None, to_revision=head(), legacy=False)
        assert await current_revision(engine) == head()
