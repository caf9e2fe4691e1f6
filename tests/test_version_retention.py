"""Retention of adapter versions: the newest K, the served, the published and the guard's last kept one
keep their files; the others are pruned (files and stored blobs deleted, rows and metrics kept)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from sqlalchemy import insert, select, update
from test_trainer_worker import A, G, J, T, fetch, run_worker, seed_store, settings_for

from store import AdapterFile, Store, connect
from store._tables import adapter_files as F
from store._tables import calls as C
from store._version_retention import versions_to_keep
from tracetrain_vllm._adapter_fetch import prune_cache
from trainer._adapters import OPTIMIZER
from trainer._retention import sweep


def adapter(version: int, state: str, guard: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"version": version, "state": state, "guard": guard, "path": f"/a/{version}"}


def test_the_newest_the_served_the_published_the_unpublished_and_the_last_kept_version_stay() -> None:
    rows = [
        adapter(1, "retired"),
        adapter(2, "retired", {"state": "kept"}),  # the guard's last kept: a rollback target
        adapter(3, "rolled_back", {"state": "rolled_back"}),
        adapter(4, "retired"),  # served: the alias points here (an admin rolled back)
        adapter(5, "published"),  # loaded in vLLM: a request may pin it
        adapter(6, "failed"),
        adapter(7, "discarded"),
        adapter(8, "retired"),
        adapter(9, "trained"),  # not published yet
    ]
    assert versions_to_keep(rows, active=4, keep=2) == {2, 4, 5, 8, 9}


async def _recorded(url: str, states: dict[int, str]) -> None:
    store = await Store.open(url, capture=False)
    try:
        await store.policies.ensure("agent", "tiny")
        for version, state in states.items():
            files = [AdapterFile("adapter_config.json", b"{}"), AdapterFile("adapter_model.safetensors", b"w" * 100)]
            await store.adapters.record("agent", version, f"/nowhere/{version}", None, {"loss": version}, files)
            async with store.engine.begin() as conn:
                await conn.execute(update(A).where(A.c.version == version).values(state=state))
    finally:
        await store.close()


def test_pruning_moves_versions_to_pruned_and_deletes_their_stored_files_only(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    asyncio.run(_recorded(url, {1: "retired", 2: "failed", 3: "retired", 4: "published"}))

    async def prune() -> tuple[list[Any], list[Any]]:
        store = await Store.open(url, capture=False)
        try:
            first = await store.adapters.prune("agent", keep=2)
            again = await store.adapters.prune("agent", keep=2)
            return first, again
        finally:
            await store.close()

    first, again = asyncio.run(prune())
    assert [(p.version, p.path) for p in first] == [(1, "/nowhere/1"), (2, "/nowhere/2")] and again == []
    rows = {row.version: row for row in asyncio.run(fetch(url, select(A)))}
    assert {v: row.state for v, row in rows.items()} == {1: "pruned", 2: "pruned", 3: "retired", 4: "published"}
    assert rows[1].metrics == {"loss": 1}  # history stays
    files = asyncio.run(fetch(url, select(F.c.version).distinct()))
    assert sorted(v for (v,) in files) == [3, 4]


def test_activating_a_pruned_version_is_a_409_that_says_why(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy()
    url = f"sqlite+aiosqlite:///{proxy.db_path}"
    asyncio.run(_recorded(url, {1: "retired", 2: "retired", 3: "published"}))
    asyncio.run(_pruned(url))

    answer = httpx.post(f"{proxy.url}/admin/adapters/1/activate")

    assert answer.status_code == 409
    assert "pruned" in answer.json()["error"]["message"] and answer.json()["error"]["param"] == "version"
    page = httpx.get(f"{proxy.url}/admin/ui/adapters").text
    assert page.count("files pruned") == 2 and "adapters/1/activate" not in page and "adapters/3/activate" in page


async def _pruned(url: str) -> None:
    store = await Store.open(url, capture=False)
    try:
        assert [p.version for p in await store.adapters.prune("agent", keep=1)] == [1, 2]
    finally:
        await store.close()


def test_the_sweep_deletes_pruned_and_dead_writes_and_keeps_the_newest_optimizer_state(tmp_path: Path) -> None:
    for version in (1, 2, 3, 4):
        (tmp_path / str(version)).mkdir()
        (tmp_path / str(version) / OPTIMIZER).write_bytes(b"moments")
        (tmp_path / str(version) / "adapter_model.safetensors").write_bytes(b"w")
    (tmp_path / ".5.tmp-999999999").mkdir()  # a write whose process is gone
    live = tmp_path / f".6.tmp-{os.getpid()}"
    live.mkdir()  # a write in progress

    sweep(tmp_path, pruned={1})

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["2", "3", "4", live.name])
    assert [(tmp_path / v / OPTIMIZER).exists() for v in ("2", "3", "4")] == [False, False, True]
    assert all((tmp_path / v / "adapter_model.safetensors").exists() for v in ("2", "3", "4"))


def test_the_resolvers_cache_keeps_the_newest_versions_and_the_one_just_fetched(tmp_path: Path) -> None:
    for name in ("1-aaaa", "2-bbbb", "3-cccc", "4-dddd", "4-eeee", ".5-ffff.tmp-1"):
        (tmp_path / name).mkdir()

    prune_cache(tmp_path, keep=2, fetched=tmp_path / "1-aaaa")

    assert sorted(p.name for p in tmp_path.iterdir()) == [".5-ffff.tmp-1", "1-aaaa", "3-cccc", "4-dddd", "4-eeee"]


async def _queue_job(url: str, group_id: str, version: int) -> None:
    """Another job over a new group: the first one's calls again (new ids), as served by ``version``."""
    engine = await connect(url)
    now = time.time()
    async with engine.begin() as conn:
        await conn.execute(insert(G).values(id=group_id, policy="agent", state="training", created_at=now))
        for i, reward in enumerate((1.0, 0.0, 0.5)):
            await conn.execute(insert(T).values(id=f"{group_id}-{i}", group_id=group_id, policy="agent",
                                                keyed_by="header", created_at=now, updated_at=now, reward=reward,
                                                metrics={}))  # fmt: skip
        columns = [c for c in C.columns if c.name != "pk"]
        calls = (await conn.execute(select(*columns).where(C.c.trajectory_id.like("g1-%")))).all()
        for k, call in enumerate(calls):
            row = dict(call._mapping)
            row |= {"id": f"{group_id}-call-{k}", "group_id": group_id, "version": version,
                    "trajectory_id": f"{group_id}-{row['trajectory_id'].rpartition('-')[2]}"}  # fmt: skip
            await conn.execute(insert(C).values(**row))
        await conn.execute(insert(J).values(policy="agent", state="queued", group_ids=[group_id], metrics={},
                                            progress=0.0, created_at=now))  # fmt: skip
    await engine.dispose()


def test_the_worker_prunes_after_each_step_and_stores_no_files_when_told(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = settings_for(tmp_path, tiny_model_dir, keep_versions=2, adapter_files=False)
    url = settings.database_url
    asyncio.run(seed_store(url, {"g1": [1.0, 0.0, 0.5]}))
    for step in range(1, 5):
        if step > 1:
            asyncio.run(_queue_job(url, f"g{step}", step - 1))
        assert asyncio.run(run_worker(settings)) == 1
        # What the publisher does: publish the new version, retire the one before (out of the window).
        asyncio.run(_publish(url, step))

    states = {row.version: row.state for row in asyncio.run(fetch(url, select(A)))}
    assert states == {1: "pruned", 2: "pruned", 3: "retired", 4: "published"}
    adapters = settings.adapters_of("agent")
    assert sorted(p.name for p in adapters.iterdir()) == ["3", "4"]
    assert not (adapters / "3" / OPTIMIZER).exists() and (adapters / "4" / OPTIMIZER).exists()
    assert asyncio.run(fetch(url, select(F.c.pk))) == []  # adapters went by path: no blobs in the store


async def _publish(url: str, version: int) -> None:
    store = await Store.open(url, capture=False)
    try:
        async with store.engine.begin() as conn:
            await conn.execute(update(A).where(A.c.version == version).values(state="published"))
            await conn.execute(update(A).where(A.c.version < version, A.c.state == "published").values(state="retired"))
        await store.policies.flip("agent", version)
    finally:
        await store.close()


def test_serve_passes_retention_to_its_trainer_and_vllm_and_reads_the_disk_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from tracetrain_cli._serve import trainer_argv
    from tracetrain_cli._serve_command import _with_adapter_resolver, settings_from
    from tracetrain_cli._serve_flags import add_serve_parser
    from tracetrain_cli._vllm_process import VLLMLaunch
    from trainer.__main__ import parse_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    flags = [
        "--keep-versions",
        "5",
        "--keep-trajectories",
        "30",
        "--min-free-disk",
        "2048",
        "--data-dir",
        str(tmp_path),
    ]
    settings = settings_from(parser.parse_args(["serve", *flags]))
    assert (settings.keep_versions, settings.keep_trajectories_days, settings.min_free_disk_mb) == (5, 30.0, 2048)
    # serve hands its trainer the store's URL in the environment, never on the command line (ps shows that).
    monkeypatch.setenv("TRACETRAIN_DATABASE_URL", settings.resolved_database_url)

    by_path = parse_args(trainer_argv(settings, tmp_path, "cpu", [])[3:])
    assert (by_path.keep_versions, by_path.adapter_files) == (5, False)  # vLLM loads the directory: no blobs
    resolver = settings.model_copy(update={"adapter_delivery": "resolver"})
    assert parse_args(trainer_argv(resolver, tmp_path, "cpu", [])[3:]).adapter_files is True
    overridden = parse_args(trainer_argv(settings, tmp_path, "cpu", ["--keep-versions", "2"])[3:])
    assert overridden.keep_versions == 2  # --trainer-arg wins

    _, launch = _with_adapter_resolver(settings, VLLMLaunch(model="m", port=8001, data_dir=tmp_path))
    assert launch.env()["TRACETRAIN_ADAPTERS_KEEP"] == "5"
