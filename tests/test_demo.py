"""The demo's parts: the task's checker, the agent and the reward service, on loopback.

The agent and the reward service run against the real proxy (the fake vLLM behind it):
an attempt is captured as one trajectory in its group, the reward service reads it back
and posts the checker's reward. The whole demo on real vLLM is `make demo`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

from tracetrain import Client
from tracetrain_demo import agent, reward_service
from tracetrain_demo.task import FORMAT, RETRY, by_country, country_of, json_answer, scenarios, score


def test_the_split_is_fixed_and_held_out_questions_are_never_trained_on() -> None:
    train, held_out = scenarios()
    assert len(held_out) == 24 and len(train) > 60
    assert not {s.country for s in train} & {s.country for s in held_out}
    assert scenarios() == (train, held_out)


@pytest.mark.parametrize(
    ("reply", "turns", "reward", "success"),
    [
        ('{"answer": "Lima"}', 2, 1.0, True),
        ('```json\n{"answer": "lima"}\n```', 2, 1.0, True),
        ('{"answer": "Lima"}', 3, 0.8, True),  # needed the retry turn
        ('{"answer": "Cusco"}', 2, 0.4, False),  # valid JSON, wrong city
        ("The capital of Peru is Lima.", 2, 0.2, False),  # right city, not JSON
        ("The capital of Peru is Limassol.", 2, 0.0, False),  # a word containing it is not it
        ('{"answer": ["Lima"]}', 2, 0.2, False),
        ("", 3, 0.0, False),
    ],
)
def test_the_checker_gives_partial_credit(reply: str, turns: int, reward: float, success: bool) -> None:
    result = score(by_country()["Peru"], reply, turns)
    assert result.reward == pytest.approx(reward)
    assert result.success is success


def test_accents_and_other_spellings_count() -> None:
    assert score(by_country()["Colombia"], '{"answer": "Bogotá"}', 1).success
    assert score(by_country()["Ukraine"], '{"answer": "Kiev"}', 1).success
    assert json_answer('{"answer": 3}') is None
    assert country_of(by_country()["South Korea"].question) == "South Korea"
    assert country_of("hello") is None


@pytest.fixture
def rewards_url(proxy: RunningProxy) -> Iterator[str]:
    client = Client(proxy.url)
    handler = type("Handler", (reward_service._Handler,), {"client": client})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/finished"
    server.shutdown()
    server.server_close()
    client.close()


def test_an_attempt_is_one_trajectory_and_the_reward_service_scores_it(
    proxy: RunningProxy, fake: FakeVLLM, rewards_url: str
) -> None:
    peru = by_country()["Peru"]
    fake.script(
        Reply(content="The capital of Peru is Lima."), Reply(content="Lima."), Reply(content='{"answer": "Lima"}'),
        Reply(content="It is Cusco."), Reply(content='{"answer": "Cusco"}'),
    )  # fmt: skip
    client = proxy.client()
    first = agent.attempt(client, "agent", peru, "peru-0", "peru", temperature=1.0, max_tokens=16)
    second = agent.attempt(client, "agent", peru, "peru-1", "peru", temperature=1.0, max_tokens=16)
    assert (first["turns"], second["turns"]) == (3, 2)
    assert first["served_by"] == "agent@0"
    # each turn extends the conversation; the retry carries the agent's check back to the model
    assert [m["content"] for m in fake.requests[2]["messages"]] == [
        peru.question,
        "The capital of Peru is Lima.",
        FORMAT,
        "Lima.",
        RETRY,
    ]

    for trajectory_id in ("peru-0", "peru-1"):
        assert httpx.post(rewards_url, json={"trajectory_id": trajectory_id}).status_code == 204
    sdk = Client(proxy.url)
    rewards = {t.id: t.reward for t in sdk.list_trajectories(group_id="peru").data}
    assert rewards == {"peru-0": pytest.approx(0.8), "peru-1": pytest.approx(0.4)}
    [group] = sdk.list_groups().data
    assert group.state == "ready" and group.size == 2
    sdk.close()

    assert httpx.post(rewards_url, json={"trajectory_id": "no-such-thing"}).status_code == 400


def test_the_agent_reads_only_the_environment_and_reports_each_attempt(
    proxy: RunningProxy, rewards_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", proxy.v1)
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    assert agent.main(["--questions", "2", "--attempts", "3", "--done-url", rewards_url, "--tag", "t"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 6
    sdk = Client(proxy.url)
    trajectories = sdk.list_trajectories(limit=50).data
    assert len(trajectories) == 6 and all(t.reward == 0.0 for t in trajectories)  # the fake echoes: no JSON
    assert all(t.n_calls == 3 for t in trajectories)  # question, JSON, retry
    assert len({t.group_id for t in trajectories}) == 2
    sdk.close()


def test_the_demo_uses_the_admin_token_serve_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tracetrain_demo.run import _admin_token

    monkeypatch.delenv("TRACETRAIN_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="set TRACETRAIN_ADMIN_TOKEN"):
        _admin_token(tmp_path)
    (tmp_path / "admin-token").write_text("made-by-serve-" + "x" * 20 + "\n")  # as `tracetrain serve` writes it
    assert _admin_token(tmp_path) == "made-by-serve-" + "x" * 20
    monkeypatch.setenv("TRACETRAIN_ADMIN_TOKEN", "from-the-environment-" + "y" * 10)
    assert _admin_token(tmp_path) == "from-the-environment-" + "y" * 10
