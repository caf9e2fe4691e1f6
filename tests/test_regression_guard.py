"""Never silently worse: the regression guard rolls a worse version back and pauses training.

A real proxy over loopback HTTP, the fake vLLM as its upstream, the real OpenAI client as
the agent. Each group is one task attempted twice (``X-Group-Id``); its rewards are POSTed.
Version 0 (the base model) serves the baseline's groups; then the "trainer" records
adapter 1 and the publisher publishes it, and the guard watches what @1 earns.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import RunningProxy
from test_admin import ADMIN, csrf_of, login
from test_publishing import adapters, record_trained_adapter, wait_for

TASK = [{"role": "user", "content": "Capital of Peru?"}]
GUARDED = {"min_group_size": 2, "batch_groups": 1000, "unload_grace_s": 0}
_groups = iter(range(10**6))


def play_group(proxy: RunningProxy, rewards: list[float]) -> tuple[str, int]:
    """One task attempted once per reward, each attempt rewarded; (group id, version that served its last call)."""
    group = f"g{next(_groups)}"
    versions = []
    for i, reward in enumerate(rewards):
        trajectory = f"{group}-t{i}"
        raw = proxy.client().chat.completions.with_raw_response.create(
            model="agent", messages=TASK, extra_headers={"X-Group-Id": group, "X-Trajectory-Id": trajectory}
        )
        versions.append(int(raw.headers["x-policy-version"]))
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory, "reward": reward}).raise_for_status()
    return group, versions[-1]


def noisy(rng: random.Random, p: float) -> list[float]:
    return [float(rng.random() < p), float(rng.random() < p)]


def publish(proxy: RunningProxy, version: int, tmp_path: Path) -> None:
    record_trained_adapter(proxy, version, tmp_path)
    wait_for(lambda: adapters(proxy)["active_version"] == version)


def guard_of(proxy: RunningProxy, version: int) -> dict[str, Any]:
    row = next(a for a in adapters(proxy)["data"] if a["version"] == version)
    return {"adapter_state": row["state"], **(row["guard"] or {})}


def until_decided(proxy: RunningProxy, version: int, play: Callable[[], list[float]]) -> tuple[dict[str, Any], int]:
    """Play groups on ``version`` until the guard decides; (its record, groups played)."""
    for played in range(1, 13):
        _, served = play_group(proxy, play())
        if served != version:
            return guard_of(proxy, version), played - 1  # already rolled back
        with contextlib.suppress(AssertionError):  # a look that changes nothing is not recorded
            wait_for(lambda p=played: guard_of(proxy, version).get("n") == p, timeout=60)
        if guard_of(proxy, version).get("state") in ("kept", "rolled_back"):
            return guard_of(proxy, version), played
    raise AssertionError(f"no verdict on @{version} after 12 groups: {guard_of(proxy, version)}")


def baseline(proxy: RunningProxy, rng: random.Random, p: float, n: int = 10) -> None:
    for _ in range(n):
        play_group(proxy, noisy(rng, p))


def test_a_worse_version_is_rolled_back_and_training_pauses_until_resumed(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**GUARDED)
    rng = random.Random(7)
    baseline(proxy, rng, 0.8)
    queued = httpx.post(f"{proxy.url}/admin/train").json()  # a job queued before the rollback is cancelled
    publish(proxy, 1, tmp_path)

    verdict, played = until_decided(proxy, 1, lambda: [0.0, float(rng.random() < 0.1)])

    assert verdict["state"] == verdict["adapter_state"] == "rolled_back" and played <= 8, verdict
    assert verdict["baseline_version"] == 0 and verdict["mean"] < verdict["baseline_mean"]
    assert adapters(proxy)["active_version"] == 0
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"
    training = httpx.get(f"{proxy.url}/admin/training").json()
    assert training["paused"] and "agent@1 rolled back to @0" in training["training_reason"]
    job = next(j for j in httpx.get(f"{proxy.url}/admin/jobs").json()["data"] if j["id"] == queued["id"])
    assert job["state"] == "failed" and "paused" in job["error"]
    assert {g["state"] for g in httpx.get(f"{proxy.v1}/groups").json()["data"] if g["id"] in queued["group_ids"]} \
        <= {"open", "ready"}  # fmt: skip
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert re.search(r'tracetrain_training_paused\{policy="agent",reason="agent@1 rolled back[^"]*"\} 1\.0', metrics)
    assert 'tracetrain_regression_rollbacks_total{policy="agent"} 1.0' in metrics
    assert 'tracetrain_versions_rolled_back{policy="agent"} 1.0' in metrics
    refused = httpx.post(f"{proxy.url}/admin/train")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "training_paused"
    # A step that was running finishes; its adapter is discarded, not published.
    record_trained_adapter(proxy, 2, tmp_path)
    discarded = wait_for(lambda: guard_of(proxy, 2)["adapter_state"] == "discarded")
    assert discarded and adapters(proxy)["active_version"] == 0
    assert "paused" in next(a for a in adapters(proxy)["data"] if a["version"] == 2)["error"]

    resumed = httpx.post(f"{proxy.url}/admin/training/resume").json()

    assert not resumed["paused"] and resumed["training"] == "active"
    assert 'tracetrain_training_paused{policy="agent",reason=""} 0.0' in httpx.get(f"{proxy.url}/metrics").text
    assert httpx.post(f"{proxy.url}/admin/train").status_code == 200  # the reopened groups train again
    publish(proxy, 3, tmp_path)  # a step begun after the resume is published and watched against @0
    assert guard_of(proxy, 3)["state"] == "watching" and guard_of(proxy, 3)["baseline_version"] == 0


def test_a_better_version_is_kept(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**GUARDED)
    rng = random.Random(11)
    baseline(proxy, rng, 0.3)
    publish(proxy, 1, tmp_path)

    verdict, played = until_decided(proxy, 1, lambda: noisy(rng, 0.8))

    assert verdict["state"] == "kept" and played == 8 and verdict["mean"] > verdict["baseline_mean"]
    assert adapters(proxy)["active_version"] == 1
    assert not httpx.get(f"{proxy.url}/admin/training").json()["paused"]


def test_a_noisy_but_equal_version_is_kept(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**GUARDED)
    rng = random.Random(5)
    baseline(proxy, rng, 0.5)
    publish(proxy, 1, tmp_path)

    verdict, played = until_decided(proxy, 1, lambda: noisy(rng, 0.5))

    assert verdict["state"] == "kept" and played == 8, verdict
    assert adapters(proxy)["active_version"] == 1


def test_the_dashboard_says_why_training_paused_and_resumes_it_with_its_csrf_token(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(admin_token=ADMIN, **GUARDED)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    rng = random.Random(3)
    baseline(proxy, rng, 0.9, n=6)
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: httpx.get(f"{proxy.url}/admin/adapters", headers=auth).json()["active_version"] == 1)
    for _ in range(8):
        if play_group(proxy, [0.0, 0.0])[1] == 0:
            break
        time.sleep(1.2)  # the guard looks every second
    wait_for(lambda: httpx.get(f"{proxy.url}/admin/training", headers=auth).json()["paused"])
    with login(proxy) as client:
        page = client.get("/admin")
        assert 'id="training-paused"' in page.text and "agent@1 rolled back to @0" in page.text
        assert client.post("/admin/ui/training/resume", data={"csrf_token": "0" * 64}).status_code == 403
        assert httpx.get(f"{proxy.url}/admin/training", headers=auth).json()["paused"]

        done = client.post("/admin/ui/training/resume", data={"csrf_token": csrf_of(page.text)})

        assert done.status_code == 303 and done.headers["location"] == "/admin/ui/training?notice=resumed"
        assert "Training of agent resumed" in client.get(done.headers["location"]).text
    assert httpx.post(f"{proxy.url}/admin/training/resume").status_code == 401  # the API needs the token too
    assert not httpx.get(f"{proxy.url}/admin/training", headers=auth).json()["paused"]


def test_with_the_guard_off_a_worse_version_keeps_serving(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(regression_guard=False, **GUARDED)
    rng = random.Random(9)
    baseline(proxy, rng, 0.9, n=4)
    publish(proxy, 1, tmp_path)
    for _ in range(8):
        assert play_group(proxy, [0.0, 0.0])[1] == 1
    time.sleep(1.5)
    assert guard_of(proxy, 1) == {"adapter_state": "published"} and adapters(proxy)["active_version"] == 1
