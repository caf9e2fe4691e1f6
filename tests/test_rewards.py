"""POST /v1/rewards, and reading trajectories and groups back."""

from __future__ import annotations

import math
import sqlite3

import httpx
import pytest
from conftest import RunningProxy

TASK = [{"role": "user", "content": "Name a prime."}]


def run(proxy: RunningProxy, trajectory_id: str, group_id: str | None = None, messages: list | None = None) -> None:
    headers = {"X-Trajectory-Id": trajectory_id} | ({"X-Group-Id": group_id} if group_id else {})
    proxy.client(default_headers=headers).chat.completions.create(model="agent", messages=messages or TASK)


def rewards(proxy: RunningProxy, body: object) -> httpx.Response:
    return httpx.post(f"{proxy.v1}/rewards", json=body)


def test_a_reward_is_recorded_on_its_trajectory(proxy: RunningProxy) -> None:
    run(proxy, "t1", "g1")
    response = rewards(proxy, {"trajectory_id": "t1", "reward": 0.75, "metrics": {"correct": 1.0, "len": 12}})
    assert response.status_code == 200
    created = response.json()["data"][0]
    assert (created["trajectory_id"], created["group_id"], created["reward"]) == ("t1", "g1", 0.75)
    stored = httpx.get(f"{proxy.v1}/trajectories/t1").json()
    assert stored["reward"] == 0.75 and stored["metrics"] == {"correct": 1.0, "len": 12.0}
    assert stored["rewarded_at"] is not None


def test_a_batch_is_recorded_together(proxy: RunningProxy) -> None:
    for t in ("a", "b", "c"):
        run(proxy, t, "g")
    response = rewards(
        proxy, {"rewards": [{"trajectory_id": t, "reward": r} for t, r in [("a", 1), ("b", 0), ("c", 0.5)]]}
    )
    assert response.status_code == 200 and len(response.json()["data"]) == 3
    rows = proxy.rows("SELECT id, reward FROM trajectories ORDER BY id")
    assert [(r["id"], r["reward"]) for r in rows] == [("a", 1.0), ("b", 0.0), ("c", 0.5)]


def test_a_batch_with_one_unknown_id_changes_nothing(proxy: RunningProxy) -> None:
    run(proxy, "known", "g")
    response = rewards(
        proxy, {"rewards": [{"trajectory_id": "known", "reward": 1.0}, {"trajectory_id": "ghost", "reward": 1.0}]}
    )
    assert response.status_code == 404
    assert "ghost" in response.json()["error"]["message"]
    assert proxy.rows("SELECT reward FROM trajectories")[0]["reward"] is None
    assert proxy.rows("SELECT count(*) AS n FROM rewards")[0]["n"] == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"trajectory_id": "t", "reward": NaN}',
        b'{"trajectory_id": "t", "reward": Infinity}',
        b'{"trajectory_id": "t", "reward": 1e999}',
        b'{"trajectory_id": "t", "reward": "0.5"}',
        b'{"trajectory_id": "t", "reward": true}',
        b'{"trajectory_id": "t"}',
        b'{"trajectory_id": "t", "reward": 1, "metrics": {"x": "high"}}',
        b'{"trajectory_id": "t", "reward": 1, "extra": 1}',
        b'{"rewards": []}',
        b'{"rewards": [{"trajectory_id": "t", "reward": 1}, {"trajectory_id": "t", "reward": NaN}]}',
        b"not json",
    ],
)
def test_invalid_rewards_are_rejected_and_change_nothing(proxy: RunningProxy, raw: bytes) -> None:
    run(proxy, "t", "g")
    response = httpx.post(f"{proxy.v1}/rewards", content=raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert proxy.rows("SELECT reward FROM trajectories")[0]["reward"] is None


def test_trajectories_filter_by_reward_state_group_and_policy(proxy: RunningProxy) -> None:
    run(proxy, "r1", "g1")
    run(proxy, "u1", "g1")
    run(proxy, "u2", "g2")
    rewards(proxy, {"trajectory_id": "r1", "reward": 1.0})

    def ids(**params: object) -> list[str]:
        return [t["id"] for t in httpx.get(f"{proxy.v1}/trajectories", params=params).json()["data"]]

    assert ids(rewarded="true") == ["r1"]
    assert ids(rewarded="false") == ["u2", "u1"]
    assert ids(group_id="g1") == ["u1", "r1"]
    assert ids(policy="agent") == ["u2", "u1", "r1"]
    assert ids(policy="other") == []


def test_trajectory_pages_follow_the_cursor(proxy: RunningProxy) -> None:
    for i in range(5):
        run(proxy, f"p{i}", "g")
    seen, after = [], None
    while True:
        page = httpx.get(f"{proxy.v1}/trajectories", params={"limit": 2, **({"after": after} if after else {})}).json()
        seen += [t["id"] for t in page["data"]]
        if not page["has_more"]:
            break
        after = page["next_cursor"]
    assert seen == ["p4", "p3", "p2", "p1", "p0"]


def test_groups_report_size_rewards_and_readiness(start_proxy) -> None:
    proxy = start_proxy(min_group_size=2)
    for t in ("a", "b"):
        run(proxy, t, "ready-group")
    run(proxy, "c", "waiting-group")
    run(proxy, "d", "waiting-group")
    rewards(
        proxy,
        {
            "rewards": [
                {"trajectory_id": "a", "reward": 1.0},
                {"trajectory_id": "b", "reward": 0.0},
                {"trajectory_id": "c", "reward": 1.0},
            ]
        },
    )
    groups = {g["id"]: g for g in httpx.get(f"{proxy.v1}/groups").json()["data"]}
    ready, waiting = groups["ready-group"], groups["waiting-group"]
    assert (ready["state"], ready["size"], ready["n_rewarded"]) == ("ready", 2, 2)
    assert ready["reward_mean"] == pytest.approx(0.5) and ready["reward_std"] == pytest.approx(0.5)
    assert (waiting["state"], waiting["size"], waiting["n_rewarded"]) == ("open", 2, 1)
    only_ready = httpx.get(f"{proxy.v1}/groups", params={"state": "ready"}).json()["data"]
    assert [g["id"] for g in only_ready] == ["ready-group"]
    only_open = httpx.get(f"{proxy.v1}/groups", params={"state": "open"}).json()["data"]
    assert [g["id"] for g in only_open] == ["waiting-group"]


def test_unknown_group_state_filter_is_a_400(proxy: RunningProxy) -> None:
    response = httpx.get(f"{proxy.v1}/groups", params={"state": "cooking"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "state"


def test_unknown_trajectory_is_a_404(proxy: RunningProxy) -> None:
    response = httpx.get(f"{proxy.v1}/trajectories/nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "trajectory_not_found"


# -- bounds: every number a client posts has one that fits what reads it -----------------------------------------------


@pytest.mark.parametrize("reward", [1e6 + 1, -1e6 - 1, 1e200, -1e308, 1.7976931348623157e308])
def test_a_reward_beyond_the_documented_range_is_a_400_naming_it(proxy: RunningProxy, reward: float) -> None:
    run(proxy, "t", "g")
    for body in ({"trajectory_id": "t", "reward": reward},
                 {"trajectory_id": "t", "reward": 1, "metrics": {"m": reward}},
                 {"rewards": [{"trajectory_id": "t", "reward": reward}]}):  # fmt: skip
        response = rewards(proxy, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "1000000" in error["message"], error
    assert proxy.rows("SELECT reward FROM trajectories")[0]["reward"] is None


def test_rewards_at_the_ends_of_the_range_are_recorded(proxy: RunningProxy) -> None:
    run(proxy, "lo", "g")
    run(proxy, "hi", "g")
    response = rewards(proxy, {"rewards": [{"trajectory_id": "lo", "reward": -1e6, "metrics": {"m": 1e6}},
                                           {"trajectory_id": "hi", "reward": 1e6}]})  # fmt: skip
    assert response.status_code == 200, response.text
    group = httpx.get(f"{proxy.v1}/groups").json()["data"][0]
    assert group["reward_mean"] == 0.0 and group["reward_std"] == pytest.approx(1e6)


@pytest.mark.parametrize(
    "metrics",
    [
        {f"m{i}": 1.0 for i in range(33)},  # more names than the cap
        {"x" * 65: 1.0},  # a name longer than the cap
        {"": 1.0},
        {"has space": 1.0},
    ],
    ids=["too-many", "too-long", "empty", "not-a-metric-name"],
)
def test_reward_metrics_are_capped_in_count_and_name(proxy: RunningProxy, metrics: dict[str, float]) -> None:
    run(proxy, "t", "g")
    response = rewards(proxy, {"trajectory_id": "t", "reward": 1.0, "metrics": metrics})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("metrics"), response.json()
    assert proxy.rows("SELECT count(*) AS n FROM rewards")[0]["n"] == 0


def test_reward_metrics_up_to_the_cap_are_recorded(proxy: RunningProxy) -> None:
    run(proxy, "t", "g")
    metrics = {f"{'m' * 60}.{i:02d}": float(i) for i in range(32)}  # 32 names of 63 characters: "/" "." "-" "_" too
    metrics["eval/pass-rate_1"] = metrics.pop(f"{'m' * 60}.00")
    assert rewards(proxy, {"trajectory_id": "t", "reward": 1.0, "metrics": metrics}).status_code == 200
    assert httpx.get(f"{proxy.v1}/trajectories/t").json()["metrics"] == metrics


def test_rewards_stored_before_the_bound_existed_do_not_break_the_reads(start_proxy) -> None:
    """Rows written by an earlier version (no bound then) are shown, never a 500 on any page that reads them."""
    admin = "admin-" + "b" * 30
    proxy = start_proxy(admin_token=admin)
    for t in ("huge", "huger", "zero"):
        run(proxy, t, "old-group")
    rewards(proxy, {"rewards": [{"trajectory_id": t, "reward": 0.0} for t in ("huge", "huger", "zero")]})
    with sqlite3.connect(proxy.db_path) as conn:  # as an earlier version wrote them
        for t, r in (("huge", 1e308), ("huger", 1e308), ("zero", 0.0)):
            conn.execute("UPDATE trajectories SET reward = ?, metrics = ? WHERE id = ?", (r, '{"m": 1e308}', t))
            conn.execute("UPDATE rewards SET value = ? WHERE trajectory_id = ?", (r, t))
    bearer = {"Authorization": f"Bearer {admin}"}
    for url in (f"{proxy.v1}/groups", f"{proxy.url}/admin/groups", f"{proxy.url}/admin/groups/old-group",
                f"{proxy.v1}/trajectories", f"{proxy.v1}/trajectories/huge", f"{proxy.url}/admin/ui/groups",
                f"{proxy.url}/admin/ui/groups/old-group", f"{proxy.url}/admin/ui/trajectories/huge"):  # fmt: skip
        response = httpx.get(url, headers=bearer)
        assert response.status_code == 200, (url, response.text[:300])
    group = httpx.get(f"{proxy.v1}/groups").json()["data"][0]
    assert group["reward_mean"] is not None and math.isfinite(group["reward_mean"])
    assert group["reward_std"] is not None and math.isfinite(group["reward_std"])
    members = httpx.get(f"{proxy.url}/admin/groups/old-group", headers=bearer).json()
    text = str(members)
    assert "nan" not in text.lower() and "inf" not in text.lower().replace("info", ""), text[:500]
