"""``POST /admin/evaluations``: a version's scores on what it was not trained on, checked and kept in the store
(bounded), for the trainer's run loggers to read (``tests/test_run_log.py`` follows them into the runs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert

import store._evaluations as evaluations
from store import Store, connect
from store._tables import AdapterVersion

ADMIN = "admin-token-9f8e7d6c5b4a"
BEARER = {"Authorization": f"Bearer {ADMIN}"}


def post(proxy: Any, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{proxy.url}/admin/evaluations", json=body, headers=BEARER, **kwargs)


def stored(proxy: Any, policy: str = "agent") -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        opened = await Store.open(proxy.settings.resolved_database_url, capture=False)
        try:
            return await opened.evaluations.since(policy)
        finally:
            await opened.close()

    return asyncio.run(read())


def add_version(proxy: Any, version: int) -> None:
    async def insert_row() -> None:
        engine = await connect(proxy.settings.resolved_database_url)
        async with engine.begin() as conn:
            await conn.execute(insert(AdapterVersion.__table__).values(  # type: ignore[attr-defined]
                policy="agent", version=version, path="/nowhere", state="trained", metrics={},
                created_at=time.time()))  # fmt: skip
        await engine.dispose()

    asyncio.run(insert_row())


def test_a_versions_scores_are_recorded_in_order(start_proxy: Callable[..., Any]) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    first = post(proxy, {"version": 0, "scores": {"held_out_success": 0.125, "valid_json": 0.5}, "samples": 200})
    assert first.status_code == 200, first.text
    assert [(e["name"], e["value"], e["samples"]) for e in first.json()["data"]] == [
        ("held_out_success", 0.125, 200), ("valid_json", 0.5, 200)
    ]  # fmt: skip
    add_version(proxy, 1)
    assert post(proxy, {"version": 1, "scores": {"held_out_success": 0.5}}).status_code == 200
    rows = stored(proxy)
    assert [(r["version"], r["name"], r["value"]) for r in rows] == [
        (0, "held_out_success", 0.125), (0, "valid_json", 0.5), (1, "held_out_success", 0.5)
    ]  # fmt: skip
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    assert stored(proxy, "other") == []


def test_a_version_never_trained_is_a_404(start_proxy: Callable[..., Any]) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    response = post(proxy, {"version": 7, "scores": {"held_out_success": 0.5}})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "version" and "agent@7" in response.json()["error"]["message"]
    assert stored(proxy) == []


@pytest.mark.parametrize(
    "body",
    [
        {"version": 0, "scores": {}},
        {"version": 0, "scores": {"x": "0.5"}},
        {"version": 0, "scores": {"x": True}},
        {"version": 0, "scores": {"x": None}},
        {"version": 0, "scores": {"has space": 0.5}},
        {"version": 0, "scores": {"": 0.5}},
        {"version": 0, "scores": {"x" * 65: 0.5}},
        {"version": 0, "scores": {f"m{i}": 0.5 for i in range(33)}},
        {"version": 0, "scores": {"x": 1e6 + 1}},  # beyond the documented range, |x| <= 1e6
        {"version": 0, "scores": {"x": -1e308}},
        {"version": -1, "scores": {"x": 0.5}},
        {"version": 2**40, "scores": {"x": 0.5}},
        {"version": 0, "scores": {"x": 0.5}, "samples": 0},
        {"version": 0, "scores": {"x": 0.5}, "policy": "other"},
        {"scores": {"x": 0.5}},
        [1, 2],
    ],
)
def test_bad_evaluations_are_a_400_and_record_nothing(start_proxy: Callable[..., Any], body: Any) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    response = post(proxy, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert stored(proxy) == []


def test_not_json_infinities_and_no_token_are_refused(start_proxy: Callable[..., Any]) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    for raw in (b'{"version": 0, "scores": {"x": NaN}}', b'{"version": 0, "scores": {"x": 1e999}}', b"{"):
        response = httpx.post(f"{proxy.url}/admin/evaluations", content=raw,
                              headers={**BEARER, "Content-Type": "application/json"})  # fmt: skip
        assert response.status_code == 400, raw
    anonymous = httpx.post(f"{proxy.url}/admin/evaluations", json={"version": 0, "scores": {"x": 0.5}})
    assert anonymous.status_code == 401
    assert stored(proxy) == []


def test_the_oldest_evaluations_go_beyond_the_bound(
    start_proxy: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evaluations, "KEEP", 3)
    proxy = start_proxy(admin_token=ADMIN)
    for i in range(5):
        assert post(proxy, {"version": 0, "scores": {"held_out_success": i / 10}}).status_code == 200
    assert [r["value"] for r in stored(proxy)] == [0.2, 0.3, 0.4]


def test_the_demo_posts_each_held_out_success_and_goes_on_when_refused(
    start_proxy: Callable[..., Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tracetrain_demo._lane import Lane
    from tracetrain_demo.report import HeldOut
    from tracetrain_demo.run import _post_evaluations

    proxy = start_proxy(admin_token=ADMIN)
    lane = Lane("city", "agent", proxy.url, tmp_path, rewards_port=0)
    lane.report.held_out.append(HeldOut(0, 0.375, 200, time.time(), time.time()))
    _post_evaluations(proxy.url, ADMIN, lane)
    [row] = stored(proxy)
    assert (row["version"], row["name"], row["value"], row["samples"]) == (0, "held_out_success", 0.375, 200)
    _post_evaluations(proxy.url, ADMIN, lane)  # each result is posted once
    assert len(stored(proxy)) == 1
    lane.report.held_out.append(HeldOut(0, 0.5, 200, time.time(), time.time()))
    _post_evaluations(proxy.url, "not-the-token", lane)
    assert "could not post the held-out evaluation of agent@0" in capsys.readouterr().out
    assert len(stored(proxy)) == 1
