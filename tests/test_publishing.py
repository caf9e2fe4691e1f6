"""Adapters the trainer records are loaded into vLLM, served as policy@N, rolled back, unloaded."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

TASK = [{"role": "user", "content": "Capital of Peru?"}]


def record_trained_adapter(
    proxy: RunningProxy, version: int, tmp_path: Path, job_id: int | None = None, created_at: float | None = None
) -> Path:
    """What the trainer does after a step: write the adapter directory and record it (``created_at``: when its
    step began, now by default)."""
    path = tmp_path / "adapters" / "agent" / str(version)
    path.mkdir(parents=True)
    proxy.rows(
        "INSERT INTO adapters (policy, version, path, job_id, state, metrics, created_at) "
        "VALUES ('agent', ?, ?, ?, 'trained', '{}', ?)",
        version, str(path), job_id, time.time() if created_at is None else created_at,
    )  # fmt: skip
    return path


def wait_for(condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def adapters(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(f"{proxy.url}/admin/adapters").json()


def test_trained_adapter_is_loaded_then_serves_the_policy(proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path) -> None:
    path = record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    assert fake.loras == {"agent@1": str(path)}
    raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=TASK)
    assert raw.headers["x-policy-version"] == "1" and raw.parse().model == "agent@1"
    assert fake.requests[-1]["model"] == "agent@1"
    assert proxy.rows("SELECT version, served_model FROM calls")[-1][:] == (1, "agent@1")
    assert [m.id for m in proxy.client().models.list().data] == ["agent", "agent@0", "agent@1"]
    assert proxy.client().chat.completions.create(model="agent@0", messages=TASK).model == "agent@0"
    listed = adapters(proxy)["data"][0]
    assert (listed["version"], listed["state"]) == (1, "published") and listed["published_at"]


def test_a_failed_load_keeps_the_old_version_and_fails_the_job(
    proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path
) -> None:
    proxy.rows("INSERT INTO training_jobs (id, policy, state, group_ids, metrics, progress, created_at) "
               "VALUES (7, 'agent', 'succeeded', '[]', '{}', 1.0, ?)", time.time())  # fmt: skip
    fake.fail_next_load = "No adapter found for <path>"
    record_trained_adapter(proxy, 1, tmp_path, job_id=7)
    failed = wait_for(lambda: [a for a in adapters(proxy)["data"] if a["state"] == "failed"])
    assert "No adapter found" in failed[0]["error"]
    assert adapters(proxy)["active_version"] == 0
    job = httpx.get(f"{proxy.url}/admin/jobs").json()["data"][0]
    assert job["state"] == "failed" and "publishing failed" in job["error"]
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"


def test_rollback_and_forward_to_any_version_on_disk(start_proxy, fake: FakeVLLM, tmp_path: Path) -> None:
    proxy = start_proxy(keep_versions=1, unload_grace_s=0)
    for version in (1, 2):
        record_trained_adapter(proxy, version, tmp_path)
        wait_for(lambda v=version: adapters(proxy)["active_version"] == v)
    wait_for(lambda: "agent@1" not in fake.loras)  # outside the window of one
    rolled = httpx.post(f"{proxy.url}/admin/adapters/1/activate").json()
    assert rolled["active_version"] == 1 and "agent@1" in fake.loras
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@1"
    httpx.post(f"{proxy.url}/admin/adapters/0/activate").raise_for_status()
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"
    missing = httpx.post(f"{proxy.url}/admin/adapters/9/activate")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_a_request_in_flight_finishes_on_its_version(start_proxy, fake: FakeVLLM, tmp_path: Path) -> None:
    proxy = start_proxy(keep_versions=1, unload_grace_s=0)
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    # A stream long enough (9 s) to outlast the publish of @2 on a busy machine; it is sped up
    # only once the check is done, so @1 cannot be unloaded for having finished meanwhile.
    fake.token_delay_s = 0.15
    fake.script(Reply(content=" ".join(f"w{i}" for i in range(60))), Reply(content="Lima"))
    stream = proxy.client().chat.completions.create(model="agent", messages=TASK, stream=True)
    first = next(iter(stream))
    assert first.model == "agent@1"
    record_trained_adapter(proxy, 2, tmp_path)
    wait_for(lambda: adapters(proxy)["active_version"] == 2)
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@2"
    assert "agent@1" in fake.loras, "unloaded while a request was still running on it"
    fake.token_delay_s = 0.0
    rest = list(stream)
    assert all(chunk.model == "agent@1" for chunk in rest)
    wait_for(lambda: "agent@1" not in fake.loras)
    versions = [row["version"] for row in proxy.rows("SELECT version FROM calls ORDER BY started_at")]
    assert versions == [1, 2]


def test_a_restarted_vllm_gets_the_published_adapters_again(
    proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path
) -> None:
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: "agent@1" in fake.loras)
    fake.loras.clear()  # vLLM restarted: adapters are gone
    wait_for(lambda: "agent@1" in fake.loras, timeout=15)


def test_the_policy_alias_is_stored_even_when_vllm_is_down_at_start(start_proxy, fake: FakeVLLM) -> None:
    """A flip updates the policy's row: it must exist before vLLM ever answered."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    proxy = start_proxy(upstream=f"http://127.0.0.1:{dead}/v1")
    assert [(r["name"], r["active_version"]) for r in proxy.rows("SELECT name, active_version FROM policies")] == [
        ("agent", 0)
    ]


async def test_the_publisher_syncs_wholly_only_when_the_store_changed(
    fake: FakeVLLM, tmp_path: Path, monkeypatch: Any
) -> None:
    """Polls read the publishing state only; a trained adapter changes it and is published at once."""
    import asyncio
    import sqlite3

    import proxy.training._publisher as publishing
    from proxy import Settings
    from proxy.gateway import PolicyRegistry, Upstream
    from proxy.gateway.upstream._router import Router
    from store import Store

    monkeypatch.setattr(publishing, "_FULL_SYNC_S", 3600.0)  # no whole sync on the clock: only on a change
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    await store.policies.ensure("agent", fake.base_model)
    syncs: list[int] = []
    async with httpx.AsyncClient() as client:
        upstream = Upstream(f"{fake.url}/v1", [client], timeout_s=10.0)  # type: ignore[attr-defined]
        router = Router([upstream])
        await router.check_once()
        registry = PolicyRegistry()
        publisher = publishing.Publisher(store, registry, router, Settings(keep_versions=3), poll_s=0.02)
        await publisher.adopt()
        whole_sync = publisher.sync_once

        async def counted() -> None:
            syncs.append(registry.get("agent").active_version)
            await whole_sync()

        publisher.sync_once = counted  # type: ignore[method-assign]
        polling = asyncio.create_task(publisher.run())
        await asyncio.sleep(0.4)  # ~20 polls, nothing changed
        idle = len(syncs)
        path = tmp_path / "adapters" / "agent" / "1"
        path.mkdir(parents=True)
        conn = sqlite3.connect(tmp_path / "tt.db")
        conn.execute(
            "INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
            "VALUES ('agent', 1, ?, 'trained', '{}', ?)", (str(path), time.time()),
        )  # fmt: skip
        conn.commit()
        conn.close()
        for _ in range(200):
            if registry.get("agent").active_version == 1:
                break
            await asyncio.sleep(0.02)
        polling.cancel()
        upstream.close()
    await store.close()
    assert idle == 1  # the first poll's
    assert registry.get("agent").active_version == 1 and fake.loras == {"agent@1": str(path)}
