"""Weighted components: a reward posted as metrics alone is their weighted sum (``--reward-weights``), and each
component's mean is a step metric (the dashboard, ``/metrics``, the trackers).

A real proxy over loopback HTTP, the fake vLLM as its upstream, the real OpenAI client as the agent, the SDK as
the reward service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from test_step_watch import finish_step

import tracetrain
from proxy import PolicyOverrides
from proxy.observability._metrics import Metrics
from store import Store
from trainer._batch import TrajectoryData, build_batch
from trainer._config import TrainConfig
from trainer._samples import CapturedCall

TASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 't.db'}", capture=False)
    yield opened
    await opened.close()


def attempt(proxy: RunningProxy, trajectory_id: str, model: str = "agent") -> None:
    proxy.client(default_headers={"X-Trajectory-Id": trajectory_id}).chat.completions.create(model=model, messages=TASK)


def test_a_reward_posted_as_metrics_is_their_weighted_sum(start_proxy: Any) -> None:
    proxy = start_proxy(reward_weights="correct=1,format=0.25")
    attempt(proxy, "t1")
    attempt(proxy, "t2")
    with tracetrain.Client(proxy.url) as tt:
        reward = tt.post_reward("t1", metrics={"correct": 1.0, "format": 0.5, "length": 40.0})
        assert reward.reward == 1.125 and reward.metrics == {"correct": 1.0, "format": 0.5, "length": 40.0}
        assert tt.get_trajectory("t1").reward == 1.125
        # A reward given wins over its metrics; the batch form weighs each item that has none.
        given = tt.post_rewards([{"trajectory_id": "t2", "reward": 0.3, "metrics": {"correct": 1.0}},
                                 {"trajectory_id": "t2", "metrics": {"correct": 0.0, "format": 1.0}}])  # fmt: skip
        assert [r.reward for r in given] == [0.3, 0.25] and tt.get_trajectory("t2").reward == 0.25


def test_a_missing_component_or_no_weights_is_a_400_and_nothing_is_recorded(start_proxy: Any) -> None:
    weighed = start_proxy(reward_weights="correct=1,format=0.25")
    attempt(weighed, "t1")
    missing = httpx.post(f"{weighed.v1}/rewards", json={"trajectory_id": "t1", "metrics": {"correct": 1.0}})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "metrics"
    assert "format" in missing.json()["error"]["message"]
    huge = httpx.post(
        f"{weighed.v1}/rewards", json={"trajectory_id": "t1", "metrics": {"correct": 1.7e308, "format": 1.7e308}}
    )
    assert huge.status_code == 400
    plain = start_proxy()
    attempt(plain, "t1")
    unweighed = httpx.post(f"{plain.v1}/rewards", json={"trajectory_id": "t1", "metrics": {"correct": 1.0}})
    assert unweighed.status_code == 400 and unweighed.json()["error"]["param"] == "reward"
    assert "--reward-weights" in unweighed.json()["error"]["message"]
    nothing = httpx.post(f"{plain.v1}/rewards", json={"trajectory_id": "t1"})
    assert nothing.status_code == 400
    for proxy in (weighed, plain):
        assert httpx.get(f"{proxy.v1}/trajectories/t1").json()["rewards"] == []


def test_a_policys_own_weights_override_the_servers(start_proxy: Any) -> None:
    own = PolicyOverrides(reward_weights={"correct": 2.0, "fast": 1.0})
    proxy = start_proxy(policies=("agent", "sql"), reward_weights="correct=1", policy_configs={"sql": own})
    attempt(proxy, "a1")
    attempt(proxy, "s1", model="sql")
    metrics = {"correct": 1.0, "fast": 0.5}
    assert (
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "a1", "metrics": metrics}).json()["data"][0]["reward"]
        == 1.0
    )
    assert (
        httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "s1", "metrics": metrics}).json()["data"][0]["reward"]
        == 2.5
    )
    assert PolicyOverrides.model_validate({"reward_weights": "a=1, b=-0.5"}).reward_weights == {"a": 1.0, "b": -0.5}


def test_each_components_mean_is_a_step_metric() -> None:
    calls = [CapturedCall([1, 2], [3, 4], [-0.1, -0.2], 200, 0)]
    trajectories = [TrajectoryData("a", "g", 1.0, calls, {"correct": 1.0, "format": 0.0}),
                    TrajectoryData("b", "g", 0.0, calls, {"correct": 0.0}),
                    TrajectoryData("c", "g", 0.5, calls, {})]  # fmt: skip
    metrics = build_batch(trajectories, TrainConfig(), trained_version=0).metrics
    assert metrics["reward_component_correct"] == 0.5 and metrics["reward_component_format"] == 0.0


async def test_metrics_show_the_newest_steps_component_means(store: Store) -> None:
    await finish_step(store, 1, {"reward_component_correct": 0.1, "reward_component_old": 0.9})
    await finish_step(store, 2, {"reward_component_correct": 0.75, "reward_component_format": 0.5})
    text = (await Metrics().render(store, loaded_versions={"agent": 2})).decode()
    assert 'tracetrain_training_reward_component_mean{component="correct",policy="agent"} 0.75' in text
    assert 'tracetrain_training_reward_component_mean{component="format",policy="agent"} 0.5' in text
    assert 'component="old"' not in text
