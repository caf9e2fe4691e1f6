"""``--reward-timeout``: a complete group whose rewards do not come is judged, or closed unrewarded.

A real proxy over loopback HTTP with the fake vLLM as its upstream (and as the judge,
``hosted_vllm/...``, answering judge requests as tests/test_judge.py's ``fake_judge`` does).
"""

from __future__ import annotations

import httpx
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from test_judge import fake_judge
from test_publishing import wait_for

TASK = [{"role": "user", "content": "What is the capital of France?"}]


def attempt(proxy: RunningProxy, group: str, trajectory: str, reward: float | None = None) -> None:
    proxy.client().chat.completions.create(
        model="agent", messages=TASK, extra_headers={"X-Group-Id": group, "X-Trajectory-Id": trajectory}
    )
    if reward is not None:
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory, "reward": reward}).raise_for_status()


def group_state(proxy: RunningProxy, group: str) -> str:
    return str(next(g for g in httpx.get(f"{proxy.v1}/groups").json()["data"] if g["id"] == group)["state"])


def test_without_a_judge_a_group_missing_rewards_is_closed_unrewarded_and_never_blocks_the_batch(
    start_proxy,
) -> None:
    # Long enough that "prompt" below, rewarded right after each call, is never overdue on a loaded machine.
    proxy = start_proxy(reward_timeout_s=2.0, min_group_size=2, batch_groups=1)
    attempt(proxy, "late", "late-a", reward=1.0)
    attempt(proxy, "late", "late-b")  # its reward never comes
    attempt(proxy, "young", "young-a")  # too small to be complete: it waits

    wait_for(lambda: group_state(proxy, "late") == "unrewarded")

    assert group_state(proxy, "young") == "open"
    overview = httpx.get(f"{proxy.url}/admin/overview").json()
    assert overview["groups_unrewarded"] == 1 and overview["training"]["reward_timeout_s"] == 2.0
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_groups_unrewarded{policy="agent"} 1.0' in metrics
    assert 'tracetrain_reward_timeouts_total{outcome="unrewarded",policy="agent"} 1.0' in metrics
    assert "Groups unrewarded" in httpx.get(f"{proxy.url}/admin").text
    listed = httpx.get(f"{proxy.url}/admin/groups", params={"state": "unrewarded"}).json()["data"]
    assert [g["id"] for g in listed] == ["late"]
    # A reward arriving after the timeout is recorded, but the closed group never trains.
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "late-b", "reward": 0.0}).raise_for_status()
    assert group_state(proxy, "late") == "unrewarded"
    # A complete group rewarded in time trains at once: the closed one held nothing up.
    attempt(proxy, "prompt", "prompt-a", reward=1.0)
    attempt(proxy, "prompt", "prompt-b", reward=0.0)
    jobs = httpx.get(f"{proxy.url}/admin/jobs").json()["data"]
    assert [j["group_ids"] for j in jobs] == [["prompt"]]


def test_with_a_judge_the_judges_scores_become_the_groups_rewards(start_proxy, fake: FakeVLLM) -> None:
    asked = fake_judge(fake)
    proxy = start_proxy(reward_timeout_s=0.6, min_group_size=2, batch_groups=1,
                        judge_model=f"hosted_vllm/{fake.base_model}")  # fmt: skip
    fake.script(Reply("Paris."), Reply("Lyon."))
    attempt(proxy, "quiet", "right")
    attempt(proxy, "quiet", "wrong")

    jobs = wait_for(lambda: httpx.get(f"{proxy.url}/admin/jobs").json()["data"], timeout=60)  # litellm loads slowly

    assert jobs[0]["group_ids"] == ["quiet"] and len(asked) == 1
    listed = httpx.get(f"{proxy.v1}/trajectories").json()["data"]
    trajectories = {t["id"]: (t["reward"], t["reward_source"]) for t in listed}
    assert trajectories == {"right": (1.0, "judge"), "wrong": (0.0, "judge")}
    (judged,) = httpx.get(f"{proxy.url}/admin/judgements").json()["data"]
    assert (judged["state"], judged["trigger"], judged["reward_source"]) == ("ok", "timeout", "judge")
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_reward_timeouts_total{outcome="judged",policy="agent"} 1.0' in metrics


def test_a_group_the_judge_cannot_score_is_closed_unrewarded(start_proxy, fake: FakeVLLM) -> None:
    fake.reply_for = lambda body: Reply("not JSON at all") if "response_format" in body else None
    proxy = start_proxy(reward_timeout_s=0.4, min_group_size=2, judge_max_attempts=1,
                        judge_model=f"hosted_vllm/{fake.base_model}")  # fmt: skip
    attempt(proxy, "hard", "h-a")
    attempt(proxy, "hard", "h-b")

    wait_for(lambda: group_state(proxy, "hard") == "unrewarded", timeout=60)

    (failed,) = httpx.get(f"{proxy.url}/admin/judgements").json()["data"]
    assert (failed["state"], failed["trigger"]) == ("failed", "timeout")


def test_a_bad_reward_timeout_is_refused_at_start(start_proxy) -> None:
    from pydantic import ValidationError

    from proxy import Settings

    for bad in (0, -5, float("inf")):
        try:
            Settings(reward_timeout_s=bad)
        except ValidationError as exc:
            assert "reward_timeout_s" in str(exc)
        else:
            raise AssertionError(f"reward_timeout_s={bad} was accepted")
