"""Ready groups become training jobs; the admin API creates them on demand and is guarded."""

from __future__ import annotations

import httpx
import pytest
from conftest import RunningProxy

ADMIN = "admin-" + "z" * 30
KEY = "key-" + "k" * 30


def attempt(proxy: RunningProxy, task: str, trajectory_id: str, reward: float | None = None) -> str:
    raw = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id}).chat.completions.with_raw_response.create(
        model="agent", messages=[{"role": "user", "content": task}]
    )
    if reward is not None:
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory_id, "reward": reward}).raise_for_status()
    return raw.headers["x-group-id"]


def jobs(proxy: RunningProxy) -> list[dict]:
    return httpx.get(f"{proxy.url}/admin/jobs").json()["data"]


def test_a_job_is_queued_when_enough_groups_are_ready(start_proxy) -> None:
    proxy = start_proxy(batch_groups=2, min_group_size=2)
    first = [attempt(proxy, "task A", f"a{i}", reward=float(i)) for i in range(2)]
    assert jobs(proxy) == []  # one ready group is not a batch
    second = [attempt(proxy, "task B", f"b{i}", reward=float(i)) for i in range(2)]
    queued = jobs(proxy)
    assert len(queued) == 1 and queued[0]["state"] == "queued"
    assert sorted(queued[0]["group_ids"]) == sorted({first[0], second[0]})
    groups = {g["id"]: g["state"] for g in httpx.get(f"{proxy.v1}/groups").json()["data"]}
    assert groups == {first[0]: "training", second[0]: "training"}
    # A group is used once: the same task now opens a new group.
    assert attempt(proxy, "task A", "a-later") != first[0]


def test_an_unrewarded_member_keeps_its_group_waiting(start_proxy) -> None:
    proxy = start_proxy(batch_groups=1, min_group_size=2)
    attempt(proxy, "task A", "a0", reward=1.0)
    attempt(proxy, "task A", "a1")
    assert jobs(proxy) == []
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "a1", "reward": 0.0}).raise_for_status()
    assert len(jobs(proxy)) == 1


def test_train_now_takes_every_ready_group(start_proxy) -> None:
    proxy = start_proxy(batch_groups=10, min_group_size=2)
    nothing = httpx.post(f"{proxy.url}/admin/train")
    assert nothing.status_code == 400 and "ready" in nothing.json()["error"]["message"]
    group = attempt(proxy, "task A", "a0", reward=0.0)
    attempt(proxy, "task A", "a1", reward=1.0)
    job = httpx.post(f"{proxy.url}/admin/train").json()
    assert job["state"] == "queued" and job["group_ids"] == [group]


def test_admin_api_needs_the_admin_token_when_set(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    for method, path in [("GET", "/admin/jobs"), ("GET", "/admin/adapters"), ("POST", "/admin/train"),
                         ("POST", "/admin/adapters/0/activate")]:  # fmt: skip
        response = httpx.request(method, f"{proxy.url}{path}")
        assert response.status_code == 401, path
        assert response.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(f"{proxy.url}/admin/jobs", headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200


@pytest.mark.parametrize("path", ["/admin/jobs", "/admin/adapters"])
def test_admin_api_is_refused_beyond_loopback_without_a_token(start_proxy, path: str) -> None:
    proxy = start_proxy(host="0.0.0.0", api_keys=KEY)
    response = httpx.get(f"{proxy.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 403 and "TRACETRAIN_ADMIN_TOKEN" in response.json()["error"]["message"]
