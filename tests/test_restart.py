"""The store outlives the proxy: what was captured is there after a restart, and keys still resolve."""

from __future__ import annotations

import httpx
from fake_vllm import FakeVLLM, Reply

TASK = [{"role": "user", "content": "Capital of Peru?"}]


def test_store_survives_a_proxy_restart(start_proxy, fake: FakeVLLM) -> None:
    first = start_proxy()
    fake.script(Reply(content="Lima."))
    unkeyed = first.client().chat.completions.with_raw_response.create(model="agent", messages=TASK)
    first.client(default_headers={"X-Trajectory-Id": "keyed"}).chat.completions.create(model="agent", messages=TASK)
    first.stop()

    second = start_proxy()
    stored = httpx.get(f"{second.v1}/trajectories/keyed").json()
    assert stored["n_calls"] == 1 and stored["calls"][0]["completion_token_ids"]
    assert httpx.post(f"{second.v1}/rewards", json={"trajectory_id": "keyed", "reward": 1.0}).status_code == 200

    # A header-keyed trajectory keeps its group; an unkeyed one still threads.
    again = second.client(default_headers={"X-Trajectory-Id": "keyed"}).chat.completions.with_raw_response.create(
        model="agent", messages=[{"role": "user", "content": "something else"}]
    )
    assert again.headers["x-group-id"] == stored["group_id"]
    follow_up = [*TASK, {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "Sure?"}]
    threaded = second.client().chat.completions.with_raw_response.create(model="agent", messages=follow_up)
    assert threaded.headers["x-trajectory-id"] == unkeyed.headers["x-trajectory-id"]
    # New attempts at the same task join the group derived before the restart.
    fresh = second.client().chat.completions.with_raw_response.create(model="agent", messages=TASK)
    assert fresh.headers["x-group-id"] == unkeyed.headers["x-group-id"]
