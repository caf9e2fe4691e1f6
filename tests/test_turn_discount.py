"""How call rewards train: each call's return (its reward, the later calls' discounted by the turn discount,
the trajectory's), group-relative advantages over those returns, and a group without call rewards trained
exactly as before. The maths on hand-made lists; the batch on hand-made calls; and the whole path over
loopback (the real OpenAI client as the agent, the SDK rewarding one call, the store's read for training).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from test_trainer_samples import ASSISTANT, IM_END, TOOL, USER, call, header, turn

import tracetrain
from proxy import PolicyOverrides
from store import Store
from tracetrain_core import call_advantages, discounted_sums, group_advantages
from trainer._batch import TrajectoryData, build_batch
from trainer._config import TrainConfig


def test_a_calls_term_is_its_own_value_and_the_later_ones_discounted() -> None:
    assert discounted_sums([0.0, 0.0, 0.0], 0.5) == [0.0, 0.0, 0.0]
    # -1 + 0.5 * (0 + 0.5 * 2) = -0.5; 0 + 0.5 * 2 = 1; 2
    assert discounted_sums([-1.0, 0.0, 2.0], 0.5) == [-0.5, 1.0, 2.0]
    assert discounted_sums([1.0, 1.0], 1.0) == [2.0, 1.0]  # undiscounted: every later value counts
    assert discounted_sums([1.0, 1.0], 0.0) == [1.0, 1.0]  # a call's own value alone
    with pytest.raises(ValueError, match="turn discount"):
        discounted_sums([1.0], 1.5)


def test_each_kind_of_reward_is_normalized_against_its_own_kind_in_the_group() -> None:
    # Group a: outcomes 1 and 0 (advantages +1, -1); tool-call rewards 1 and 0 (normalized +1, -1); the answer
    # calls have none. Group b: one member, no baseline.
    r = call_advantages([[1.0, None], [0.0, None], [1.0]], [1.0, 0.0, 1.0], ["a", "a", "b"], discount=0.0, scale=True)
    assert r.advantages == [[2.0, 1.0], [-2.0, -1.0], [0.0]]
    assert (r.keep, r.groups, r.dropped_groups, r.dropped_samples) == ([True, True, False], 2, 1, 1)
    # The discount carries a call's normalized reward to the calls before it: 0.5 of it to the first call.
    later = call_advantages([[None, 1.0], [None, 0.0]], [1.0, 1.0], ["a", "a"], discount=0.5, scale=True)
    assert later.advantages == [[0.5, 1.0], [-0.5, -1.0]] and later.keep == [True, True]
    unscaled = call_advantages([[None, 3.0], [None, 1.0]], [2.0, 0.0], ["a", "a"], discount=1.0, scale=False)
    assert unscaled.advantages == [[2.0, 2.0], [-2.0, -2.0]]  # outcome +-1, calls +-1, unscaled
    # Neither kind varies: no signal. A lone call reward has nothing in its group to be measured against.
    assert call_advantages([[1.0, None], [1.0]], [1.0, 1.0], ["a", "a"], discount=1.0, scale=True).keep == [False] * 2
    assert call_advantages([[-1.0], [None]], [1.0, 1.0], ["a", "a"], discount=1.0, scale=True).keep == [False] * 2


def test_a_call_without_a_reward_is_not_charged_with_the_other_calls_rewards() -> None:
    """The tool task: every tool call right (rewarded 1), the answers judged by the outcome alone. The answer
    calls' advantages are the outcome's, to the bit: a baseline shared with the tool calls' rewards would push
    every answer down by their mean, and unlearned the task's answers as its tool calls improved."""
    rng = random.Random(11)
    for _ in range(100):
        n = rng.randint(2, 8)
        rewards = [rng.choice([0.0, 1.0]) for _ in range(n)]
        tool = [rng.choice([0.0, 1.0, 1.0]) for _ in range(n)]
        for discount in (0.0, 0.5, 1.0):
            r = call_advantages([[t, None] for t in tool], rewards, ["g"] * n, discount=discount, scale=True)
            outcome = group_advantages(rewards, ["g"] * n, scale=True)
            assert [a[1] for a in r.advantages] == [o if k else 0.0 for o, k in zip(outcome.advantages, r.keep,
                                                                                    strict=True)]  # fmt: skip
            # Summed over the group, each kind's advantages are centred: no push up or down of every answer.
            assert abs(sum(a[1] for a in r.advantages)) <= 1e-9 * n


def test_without_call_rewards_the_advantages_are_bit_identical_to_group_advantages() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        rewards = [rng.choice([0.0, 1.0, rng.random(), rng.gauss(0, 3)]) for _ in range(n)]
        groups = [rng.choice("abc") for _ in range(n)]
        discount = rng.choice([0.0, 0.5, 0.9, 1.0])
        calls: list[list[float | None]] = [[None] * rng.randint(1, 5) for _ in rewards]
        for scale in (True, False):
            before = group_advantages(rewards, groups, scale=scale)
            after = call_advantages(calls, rewards, groups, discount=discount, scale=scale)
            assert [a[0] for a in after.advantages] == before.advantages  # exact floats, not approximately
            assert all(len(set(a)) == 1 for a in after.advantages)  # every call of a trajectory alike
            assert (after.keep, after.dropped_groups, after.dropped_samples) == (
                before.keep, before.dropped_groups, before.dropped_samples
            )  # fmt: skip


def _two_call_trajectory(trajectory_id: str, reward: float, call_rewards: list[float | None]) -> TrajectoryData:
    prompt = turn(USER, 21) + header(ASSISTANT)
    second = [*prompt, 30, IM_END, 3, *turn(TOOL, 40), *header(ASSISTANT)]
    calls = [call(prompt, [30, IM_END]), call(second, [32, IM_END])]  # the second extends the first: merged
    return TrajectoryData(trajectory_id, "g", reward, calls, {}, call_rewards)


def test_a_group_without_call_rewards_trains_as_before_whatever_the_discount() -> None:
    trajectories = [_two_call_trajectory("a", 1.0, [None, None]), _two_call_trajectory("b", 0.0, [None, None])]
    before = build_batch(trajectories, TrainConfig(), trained_version=0)
    after = build_batch(trajectories, TrainConfig(), trained_version=0, turn_discount=0.3)
    assert after.advantages == before.advantages == [1.0, -1.0]
    assert [s.token_ids for s in after.samples] == [s.token_ids for s in before.samples]
    assert all(s.n_calls == 2 for s in after.samples) and after.metrics["call_rewarded_groups"] == 0


def test_a_group_with_call_rewards_trains_each_call_with_its_own_advantage() -> None:
    trajectories = [_two_call_trajectory("a", 1.0, [-1.0, None]), _two_call_trajectory("b", 1.0, [0.0, None])]
    batch = build_batch(trajectories, TrainConfig(), trained_version=0, turn_discount=0.5)
    # Outcomes alike (no outcome signal); the tool calls' rewards -1 and 0: normalized -1 and +1; the answers none.
    assert batch.advantages == [-1.0, 0.0, 1.0, 0.0]
    assert [s.n_calls for s in batch.samples] == [1, 1, 1, 1]  # one sample per call: one advantage per segment
    assert [sum(s.loss_mask) for s in batch.samples] == [2, 2, 2, 2]
    assert batch.metrics["call_rewarded_groups"] == 1 and batch.metrics["calls_per_trajectory"] == 2.0


def test_a_rewarded_call_over_loopback_reaches_the_trainers_advantages(start_proxy: Any, fake: FakeVLLM) -> None:
    proxy: RunningProxy = start_proxy(policy_configs={"agent": PolicyOverrides(turn_discount=0.5)})
    fake.script(*(Reply(content=f"step {i}") for i in range(4)))
    ids = [tracetrain.new_trajectory_id() for _ in range(2)]
    calls: dict[str, list[str]] = {}
    for trajectory_id in ids:
        agent = proxy.client(base_url=f"{proxy.url}/g/task/t/{trajectory_id}/v1")
        messages: list[Any] = [{"role": "user", "content": "Find it."}]
        for _ in range(2):
            raw = agent.chat.completions.with_raw_response.create(model="agent", messages=messages)
            calls.setdefault(trajectory_id, []).append(raw.headers["X-Call-Id"])
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                         {"role": "user", "content": "Go on."}]  # fmt: skip
    with tracetrain.Client(proxy.url) as tt:
        tt.post_reward(ids[0], -1.0, call_id=calls[ids[0]][0])  # its first call's tool call failed
        tt.post_reward(ids[1], 0.0, call_id=calls[ids[1]][0])  # the other's worked
        tt.post_rewards([(ids[0], 1.0), (ids[1], 1.0)])

    async def read() -> tuple[list[TrajectoryData], float]:
        store = await Store.open(f"sqlite+aiosqlite:///{proxy.db_path}", capture=False)
        try:
            stored = await store.jobs.rewarded_trajectories(["task"], policy="agent")
            policy = await store.policies.get("agent")
            return [TrajectoryData.from_store(t) for t in stored], float((policy or {})["config"]["turn_discount"])
        finally:
            await store.close()

    trajectories, discount = asyncio.run(read())
    assert discount == 0.5 and [t.call_rewards for t in trajectories] == [[-1.0, None], [0.0, None]]
    batch = build_batch(trajectories, TrainConfig(), trained_version=0, turn_discount=discount)
    assert batch.advantages == [-1.0, 0.0, 1.0, 0.0]  # the failed call down, the one that worked up, answers alike


def test_serves_turn_discount_reaches_its_trainer(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from tracetrain_cli._serve import trainer_argv
    from tracetrain_cli._serve_command import settings_from
    from tracetrain_cli._serve_flags import add_serve_parser
    from trainer.__main__ import parse_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    settings = settings_from(parser.parse_args(["serve", "--turn-discount", "0.8", "--data-dir", str(tmp_path)]))
    monkeypatch.setenv("TRACETRAIN_DATABASE_URL", settings.resolved_database_url)
    assert settings.turn_discount == 0.8
    assert parse_args(trainer_argv(settings, tmp_path, "cpu", [])[3:]).turn_discount == 0.8
    with pytest.raises(SystemExit):
        settings_from(parser.parse_args(["serve", "--turn-discount", "1.5", "--data-dir", str(tmp_path)]))
