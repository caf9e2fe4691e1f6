"""A person's score as a reward: the admin API, the review queue, the judge's scores overridden, the export.

A real proxy over loopback HTTP, the fake vLLM as its upstream (and as the judge's model), the
real OpenAI client as the agent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from test_admin import ADMIN, BEARER, csrf_of, login
from test_judge import attempt, fake_judge, judgements, wait_for

from tracetrain_cli._main import main as tracetrain


def feedback(proxy: RunningProxy, trajectory_id: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{proxy.url}/admin/trajectories/{trajectory_id}/feedback", json=body, headers=headers)


def trajectory(proxy: RunningProxy, trajectory_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}").json())


def queue(proxy: RunningProxy, **params: Any) -> dict[str, Any]:
    return dict(httpx.get(f"{proxy.url}/admin/review", params=params).json())


def test_a_persons_score_is_the_reward_over_a_services_with_its_source_and_note(proxy: RunningProxy) -> None:
    attempt(proxy, "t1")
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t1", "reward": 0.2}).raise_for_status()

    scored = feedback(proxy, "t1", {"score": 0.9, "note": "  right city, polite  "})

    assert scored.status_code == 200 and scored.json()["source"] == "human" and scored.json()["reward"] == 0.9
    t = trajectory(proxy, "t1")
    assert (t["reward"], t["reward_source"], t["reward_note"]) == (0.9, "human", "right city, polite")
    # A service's later reward is recorded beside the person's score, never over it.
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t1", "reward": 0.1}).raise_for_status()
    t = trajectory(proxy, "t1")
    assert (t["reward"], t["reward_source"]) == (0.9, "human")
    assert [(r["source"], r["reward"], r["explanation"]) for r in t["rewards"]] == [
        ("service", 0.2, None), ("human", 0.9, "right city, polite"), ("service", 0.1, None)
    ]  # fmt: skip
    listed = httpx.get(f"{proxy.v1}/trajectories").json()["data"][0]
    assert (listed["reward_source"], listed["reward_note"]) == ("human", "right city, polite")
    # A second score replaces the first: the person changed their mind.
    feedback(proxy, "t1", {"score": 0}).raise_for_status()
    assert (trajectory(proxy, "t1")["reward"], trajectory(proxy, "t1")["reward_note"]) == (0.0, None)
    assert 'tracetrain_rewards_total{policy="agent",source="human"} 2.0' in httpx.get(f"{proxy.url}/metrics").text


def test_a_persons_score_overrides_the_judges_before_and_after_it_judged(start_proxy, fake: FakeVLLM) -> None:
    fake_judge(fake)
    # The quiet time is the window for the first score to come before the judge: 0.5 s was one slow post away.
    proxy = start_proxy(reward_source="judge", group_size=2, min_group_size=2, batch_groups=1000, judge_quiet_s=3.0)
    fake.script(Reply("Paris."), Reply("Lyon."))
    attempt(proxy, "right")
    attempt(proxy, "wrong")
    feedback(proxy, "wrong", {"score": 0.7, "note": "Lyon is close"}).raise_for_status()  # before the judge

    wait_for(lambda: [j for j in judgements(proxy) if j["state"] == "ok"])

    right, wrong = trajectory(proxy, "right"), trajectory(proxy, "wrong")
    assert (right["reward"], right["reward_source"]) == (1.0, "judge")
    assert (wrong["reward"], wrong["reward_source"], wrong["reward_note"]) == (0.7, "human", "Lyon is close")
    assert [(r["source"], r["reward"]) for r in wrong["rewards"]] == [("human", 0.7), ("judge", 0.0)]
    feedback(proxy, "right", {"score": 0.4}).raise_for_status()  # after the judge
    assert (trajectory(proxy, "right")["reward"], trajectory(proxy, "right")["reward_source"]) == (0.4, "human")


def test_with_reward_source_human_the_queue_lists_what_awaits_a_score_and_scores_train(start_proxy) -> None:
    proxy = start_proxy(reward_source="human", group_size=2, min_group_size=2, batch_groups=1)
    for trajectory_id in ("a1", "a2", "b1"):
        attempt(proxy, trajectory_id, task=f"Capital of {trajectory_id[0]}?")
    refused = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "a1", "reward": 1.0})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rewards_come_from_people"

    listed = queue(proxy)
    assert [t["id"] for t in listed["data"]] == ["a1", "a2", "b1"] and listed["total"] == 3  # oldest first
    page = queue(proxy, limit=2)
    assert [t["id"] for t in page["data"]] == ["a1", "a2"] and page["has_more"]
    assert [t["id"] for t in queue(proxy, limit=2, after=page["next_cursor"])["data"]] == ["b1"]

    feedback(proxy, "a1", {"score": 1}).raise_for_status()
    assert [t["id"] for t in queue(proxy)["data"]] == ["a2", "b1"]
    feedback(proxy, "a2", {"score": 0.25}).raise_for_status()  # its group is complete: it trains

    jobs = wait_for(lambda: httpx.get(f"{proxy.url}/admin/jobs").json()["data"])
    assert jobs[0]["group_ids"] == [trajectory(proxy, "a1")["group_id"]]
    assert [t["id"] for t in queue(proxy)["data"]] == ["b1"]  # a training group's trajectories leave the queue
    assert judgements(proxy) == []  # no judge runs with people as the source


BAD = [
    ({"score": 1.5}, 400, "score"),
    ({"score": -0.1}, 400, "score"),
    ({"score": "0.5"}, 400, "score"),
    ({"score": True}, 400, "score"),
    ({"score": None}, 400, "score"),
    ({}, 400, "score"),
    ({"score": 0.5, "note": "x" * 4001}, 400, "note"),
    ({"score": 0.5, "note": 7}, 400, "note"),
    ({"score": 0.5, "stars": 5}, 400, "stars"),
    ([0.5], 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_feedback_is_a_4xx_in_openais_shape_and_records_nothing(
    proxy: RunningProxy, body: Any, status: int, param: str | None
) -> None:
    attempt(proxy, "t1")
    answer = feedback(proxy, "t1", body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert param is None or error["param"] == param
    assert trajectory(proxy, "t1")["rewards"] == []


def test_feedback_for_a_bad_or_unknown_id_or_a_body_that_is_not_json(proxy: RunningProxy) -> None:
    attempt(proxy, "t1")
    unknown = feedback(proxy, "nobody", {"score": 0.5})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "trajectory_not_found"
    for bad_id in ("a%20b", "x" * 201, "%00"):
        assert feedback(proxy, bad_id, {"score": 0.5}).status_code == 400, bad_id
    garbled = httpx.post(f"{proxy.url}/admin/trajectories/t1/feedback", content=b"{score: 1")
    assert garbled.status_code == 400 and "not valid JSON" in garbled.json()["error"]["message"]
    assert queue(proxy, after="x").get("error") is not None


def test_feedback_needs_the_admin_token_or_a_session_with_its_csrf_token(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    attempt(proxy, "t1")
    assert feedback(proxy, "t1", {"score": 0.5}).status_code == 401
    assert feedback(proxy, "t1", {"score": 0.5}, Authorization="Bearer not-the-admin-token").status_code == 401
    assert httpx.get(f"{proxy.url}/admin/review").status_code == 401
    with login(proxy) as client:
        csrf = csrf_of(client.get("/admin").text)
        refused = client.post("/admin/trajectories/t1/feedback", json={"score": 0.5})
        assert refused.status_code == 403
        assert client.post("/admin/trajectories/t1/feedback", json={"score": 0.5},
                           headers={"X-CSRF-Token": csrf}).status_code == 200  # fmt: skip
        # The dashboard's form: the score saved, then the next trajectory awaiting one.
        attempt(proxy, "t2")
        attempt(proxy, "t3")
        done = client.post("/admin/ui/trajectories/t2/feedback", data={"score": "0.8", "note": "", "csrf_token": csrf})
        assert done.status_code == 303 and done.headers["location"] == "/admin/ui/trajectories/t3?notice=scored"
        bad = client.post("/admin/ui/trajectories/t3/feedback", data={"score": "lots", "csrf_token": csrf})
        assert bad.status_code == 400 and "from 0 to 1" in bad.text
        forged = client.post("/admin/ui/trajectories/t3/feedback", data={"score": "0.1", "csrf_token": "0" * 64})
        assert forged.status_code == 403
    t2 = httpx.get(f"{proxy.v1}/trajectories/t2", headers=BEARER).json()
    assert (t2["reward"], t2["reward_source"]) == (0.8, "human")


def test_the_export_carries_each_rewards_source_and_a_persons_note(proxy: RunningProxy, tmp_path: Path) -> None:
    attempt(proxy, "t1")
    attempt(proxy, "t2")
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "t1", "reward": 0.5}).raise_for_status()
    feedback(proxy, "t2", {"score": 1.0, "note": "exactly right"}).raise_for_status()
    out = tmp_path / "export.jsonl"
    assert tracetrain(["export", "--data-dir", str(proxy.settings.data_dir), "--output", str(out)]) == 0
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert (rows["t1"]["reward_source"], rows["t1"]["reward_note"]) == ("service", None)
    assert (rows["t2"]["reward_source"], rows["t2"]["reward_note"]) == ("human", "exactly right")


def test_a_score_and_the_review_queue_keep_to_the_policy_named(start_proxy) -> None:
    proxy = start_proxy(policies=("a", "b"), policy_configs={"b": {"reward_source": "human"}})
    for policy, trajectory_id in (("a", "a-1"), ("b", "b-1"), ("b", "b-2")):
        proxy.client(default_headers={"X-Trajectory-Id": trajectory_id}).chat.completions.create(
            model=policy, messages=[{"role": "user", "content": "Capital of Peru?"}]
        )

    # Several policies and none named: a 400 that says to name one; each queue holds its own policy's.
    assert httpx.get(f"{proxy.url}/admin/review").status_code == 400
    assert [t["id"] for t in queue(proxy, policy="a")["data"]] == ["a-1"]
    listed = queue(proxy, policy="b")
    assert [t["id"] for t in listed["data"]] == ["b-1", "b-2"] and listed["reward_source"] == "human"
    # A score naming b reaches b's trajectories only: a's is a 404, as an unknown one, and nothing is recorded.
    named_b = httpx.post(f"{proxy.url}/admin/trajectories/a-1/feedback?policy=b", json={"score": 0.5})
    assert named_b.status_code == 404 and named_b.json()["error"]["code"] == "trajectory_not_found"
    assert trajectory(proxy, "a-1")["rewards"] == []
    scored = httpx.post(f"{proxy.url}/admin/trajectories/b-1/feedback?policy=b", json={"score": 0.5})
    assert scored.status_code == 200 and trajectory(proxy, "b-1")["reward_source"] == "human"
    assert [t["id"] for t in queue(proxy, policy="b")["data"]] == ["b-2"]
    # b takes people's scores only: a posted reward is refused for it, not for a.
    refused = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "b-2", "reward": 1.0})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rewards_come_from_people"
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "a-1", "reward": 1.0}).raise_for_status()
