"""The SDK against the real proxy on loopback: the wire contract holds both ways."""

from __future__ import annotations

from conftest import RunningProxy
from fake_vllm import EOS_TOKEN_ID, FakeVLLM, Reply

import tracetrain

TASK = [{"role": "user", "content": "Capital of France?"}]


def test_agent_run_scored_and_read_back_with_the_sync_sdk(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="Paris"), Reply(content="Lyon"))
    with tracetrain.Client(proxy.url) as tt:
        ids = [tracetrain.new_trajectory_id() for _ in range(2)]
        for trajectory_id in ids:
            agent = proxy.client(base_url=tt.openai_base_url(trajectory_id, group_id="capitals"))
            reply = agent.chat.completions.create(model="agent", messages=TASK).choices[0].message.content
            tt.post_reward(trajectory_id, 1.0 if reply == "Paris" else 0.0, metrics={"len": float(len(reply))})
        summaries = list(tt.iter_trajectories(group_id="capitals", page_size=1))
        assert sorted(s.id for s in summaries) == sorted(ids)
        first = tt.get_trajectory(ids[0])
        assert first.reward == 1.0 and first.calls[0].completion_token_ids == [*fake.tokenize("Paris"), EOS_TOKEN_ID]
        assert first.calls[0].served_model == fake.base_model and first.calls[0].version == 0
        group = tt.list_groups().data[0]
        assert (group.id, group.size, group.n_rewarded, group.state) == ("capitals", 2, 2, "ready")
        try:
            tt.post_reward("no-such-trajectory", 1.0)
        except tracetrain.NotFoundError as exc:
            assert "no-such-trajectory" in str(exc)
        else:
            raise AssertionError("an unknown trajectory was accepted")


async def test_batch_rewards_with_the_async_sdk(proxy: RunningProxy) -> None:
    async with tracetrain.AsyncClient(proxy.url + "/v1") as tt:
        ids = [tracetrain.new_trajectory_id() for _ in range(3)]
        agent = proxy.async_client()
        for trajectory_id in ids:
            await agent.chat.completions.create(
                model="agent", messages=TASK, extra_headers=tracetrain.trajectory_headers(trajectory_id)
            )
        await agent.close()
        rewards = await tt.post_rewards([(ids[0], 1.0), {"trajectory_id": ids[1], "reward": 0.5}, (ids[2], 0.0)])
        assert [r.reward for r in rewards] == [1.0, 0.5, 0.0]
        page = await tt.list_trajectories(rewarded=True, limit=10)
        assert {t.id for t in page.data} == set(ids)
