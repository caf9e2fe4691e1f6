"""The demo's tool task: its checker, its split, and one tool episode through the proxy (fake vLLM behind it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall

from tracetrain import Client, Trajectory
from tracetrain_demo import lookup_agent, reward_service
from tracetrain_demo.lookup import INSTRUCTIONS, by_prompt, find_hotel, hotel_in, json_hotel, scenarios, score
from tracetrain_demo.tasks import TASKS
from trainer._samples import CapturedCall, build_samples


@pytest.fixture(params=[False], ids=["attempts"])
def rewards_url(proxy: RunningProxy, request: pytest.FixtureRequest) -> Iterator[str]:
    """The reward service scoring the lookup task, on loopback (parametrized: with its --call-rewards)."""
    client = Client(proxy.url)
    handler = type("Handler", (reward_service._Handler,),
                   {"client": client, "task": "lookup", "call_rewards": request.param})  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/finished"
    server.shutdown()
    server.server_close()
    client.close()


def test_the_split_shares_no_city_and_every_request_is_found_by_its_prompt() -> None:
    train, held_out = scenarios()
    assert (len(train), len(held_out)) == (400, 100)
    trained = {c for s in train for c in (s.origin, s.destination)}
    assert not trained & {c for s in held_out for c in (s.origin, s.destination)}
    assert all(by_prompt()[s.prompt] is s and s.destination in s.prompt for s in train + held_out)


def test_the_tool_answers_the_booked_hotel_and_refuses_what_it_does_not_know() -> None:
    assert find_hotel("oslo") == {"city": "Oslo", "hotel": hotel_in("Oslo")}
    assert "error" in find_hotel("Atlantis") and "error" in find_hotel(None) and "error" in find_hotel(3)
    assert hotel_in("Oslo") != hotel_in("Lima") or hotel_in("Oslo") != hotel_in("Rome")  # names vary by city


@pytest.mark.parametrize(
    ("cities", "reply", "reward", "success"),
    [
        (["DEST"], '{"hotel": "BOOKED"}', 1.0, True),
        ([], '{"hotel": "BOOKED"}', 1.0, True),  # guessed: cannot happen in practice, but it is the answer
        (["ORIGIN", "DEST"], '```json\n{"hotel": "BOOKED"}\n```', 1.0, True),
        (["DEST"], '{"hotel": "Hotel Nowhere"}', 0.5, False),  # the tool, the destination, valid JSON
        (["ORIGIN"], '{"hotel": "Hotel Nowhere"}', 0.3, False),  # looked up the wrong city
        (["DEST"], "Her hotel is BOOKED.", 0.4, False),  # right name, not JSON
        (["DEST"], "", 0.3, False),  # ran out of calls
        ([None], "", 0.1, False),  # a call whose arguments were not JSON
        ([], "I cannot look that up.", 0.0, False),
    ],
)
def test_the_checker_gives_partial_credit_for_each_step(cities: list[object], reply: str, reward: float,
                                                       success: bool) -> None:  # fmt: skip
    scenario = scenarios()[0][0]
    names = {"DEST": scenario.destination, "ORIGIN": scenario.origin}
    cities = [names.get(c, c) if isinstance(c, str) else c for c in cities]
    result = score(scenario, cities, reply.replace("BOOKED", hotel_in(scenario.destination)))
    assert result.reward == pytest.approx(reward)
    assert result.success is success
    assert json_hotel('{"hotel": 3}') is None


def test_one_tool_episode_is_one_trajectory_of_two_calls_that_merge_and_is_rewarded(
    proxy: RunningProxy, fake: FakeVLLM, rewards_url: str
) -> None:
    scenario = scenarios()[0][0]
    booked = hotel_in(scenario.destination)
    fake.script(Reply(tool_calls=[ToolCall("find_hotel", f'{{"city": "{scenario.destination}"}}')]),
                Reply(content=f'{{"hotel": "{booked}"}}'))  # fmt: skip
    episode = lookup_agent.attempt(proxy.client(), "agent", scenario, "L-0", "L", temperature=1.0, max_tokens=48)
    assert (episode["calls"], episode["reply"], episode["tool_cities"]) == (2, f'{{"hotel": "{booked}"}}',
                                                                            [scenario.destination])  # fmt: skip
    first, second = fake.requests[0]["messages"], fake.requests[1]["messages"]
    assert first == [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": scenario.prompt}]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert booked in second[3]["content"] and fake.requests[0]["tools"][0]["function"]["name"] == "find_hotel"
    assert TASKS["lookup"].score_episode(episode).success

    assert httpx.post(rewards_url, json={"trajectory_id": "L-0"}).status_code == 204
    sdk = Client(proxy.url)
    trajectory = sdk.get_trajectory("L-0")
    assert len(trajectory.calls) == 2 and trajectory.reward == pytest.approx(1.0)
    calls = [CapturedCall(c.prompt_token_ids, c.completion_token_ids, c.logprobs) for c in trajectory.calls]
    samples, stats = build_samples(calls)
    assert (len(samples), stats.merged, stats.mismatched) == (1, 1, 0)  # the fake's template re-renders exactly
    sdk.close()


def _rewarded(proxy: RunningProxy, fake: FakeVLLM, rewards_url: str, trajectory_id: str, *replies: Reply) -> Trajectory:
    """One attempt at the first training request, the model answering ``replies``, reported to the reward service."""
    fake.script(*replies)
    lookup_agent.attempt(proxy.client(), "agent", scenarios()[0][0], trajectory_id, "G", temperature=1.0, max_tokens=48)
    assert httpx.post(rewards_url, json={"trajectory_id": trajectory_id}).status_code == 204
    with Client(proxy.url) as sdk:
        return sdk.get_trajectory(trajectory_id)


def _lookup(city: str) -> Reply:
    return Reply(tool_calls=[ToolCall("find_hotel", f'{{"city": "{city}"}}')])


@pytest.mark.parametrize("rewards_url", [True], ids=["call-rewards"], indirect=True)
def test_the_reward_service_rewards_each_tool_call_by_the_city_it_named(
    proxy: RunningProxy, fake: FakeVLLM, rewards_url: str
) -> None:
    scenario = scenarios()[0][0]
    answer = Reply(content=f'{{"hotel": "{hotel_in(scenario.destination)}"}}')
    trajectory = _rewarded(proxy, fake, rewards_url, "C-0", _lookup(scenario.origin), _lookup(scenario.destination),
                           answer)  # fmt: skip
    # The wrong city's call 0, the destination's 1; the answer has no reward of its own (the trajectory's judges it).
    assert [call.reward for call in trajectory.calls] == [0.0, 1.0, None]
    assert trajectory.reward == pytest.approx(1.0)


def test_without_call_rewards_the_service_rewards_the_attempt_alone(
    proxy: RunningProxy, fake: FakeVLLM, rewards_url: str
) -> None:
    trajectory = _rewarded(proxy, fake, rewards_url, "A-0", _lookup(scenarios()[0][0].destination),
                           Reply(content="no idea"))  # fmt: skip
    assert [call.reward for call in trajectory.calls] == [None, None]
    assert trajectory.reward == pytest.approx(0.3)


def test_the_summary_says_how_calls_became_samples_and_why_they_split() -> None:
    from tracetrain_demo.report import Step, turns

    metrics = {"reward_mean": 0.3, "loss": 0.1, "seconds": 4.0, "samples": 48, "samples_trajectories": 32,
               "samples_calls": 64, "samples_merged": 16, "samples_split_rerendered": 16,
               "samples_split_not_extended": 0, "trained_tokens": 900, "samples_completion_tokens": 1000,
               "samples_tokens": 9000, "samples_call_tokens": 12000, "logprob_mismatch_mean": 0.05,
               "logprob_mismatch_on_policy": 0.04, "sampler_correction": "tis"}  # fmt: skip
    lines = turns([Step.of(1, metrics, 10.0), Step.of(2, metrics, 10.0)])
    assert lines[0].startswith("turns: 2.00 calls and 1.50 samples per trajectory (32 calls merged")
    assert "split: 32 because the prompt re-rendered the previous turn, 0 because it did not extend it" in lines[0]
    assert lines[1].startswith("tokens: 1800 trained of 2000 sampled (90%); training forwarded 18000 of the 24000")
    assert lines[2] == ("sampler/learner gap: 0.0500 nats per token on average over the steps (0.0400 on-policy); "
                        "correction: tis")  # fmt: skip
    assert turns([Step(1, 0.3, 0.1, 4.0, 10.0)]) == []  # steps from before the accounting: nothing to say
