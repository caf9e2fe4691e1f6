"""The group judge: its prompt, its validation, its retries against a provider, and judging in the proxy.

Provider HTTP is mocked with respx at the OpenAI API (litellm's ``openai/...`` route, with
``api_base`` at a fake host); the proxy-level tests also use the fake vLLM as the judge
through ``hosted_vllm/...``, as ``--reward-source judge`` does by default.
"""

from __future__ import annotations

import argparse
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import respx
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply
from test_publishing import wait_for as publishing_wait_for

from proxy import Settings
from proxy.judge._client import Judge, JudgeFailed
from proxy.judge._prompt import (
    DEFAULT_RUBRIC,
    InvalidJudgement,
    TrajectoryText,
    build_prompt,
    call_messages,
    parse_scores,
    trajectory_messages,
)

JUDGE_API = "https://judge.test/v1"
PROVIDER_KEY = "sk-test-" + "q" * 40
ADMIN = "admin-" + "z" * 30
KEY = "key-" + "k" * 30

SYSTEM = {"role": "system", "content": "You answer geography questions."}
TASK = {"role": "user", "content": "What is the capital of France?"}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def two_trajectories() -> list[TrajectoryText]:
    return [
        TrajectoryText("traj-a", [SYSTEM, TASK, reply("Paris.")]),
        TrajectoryText("traj-b", [SYSTEM, TASK, reply("Lyon, I think.")]),
    ]


def answer(*scores: tuple[str, float], explanation: str = "because") -> str:
    return orjson.dumps({"scores": [{"id": i, "explanation": explanation, "score": s} for i, s in scores]}).decode()


def completion(content: str) -> httpx.Response:
    """An OpenAI chat completion, as the provider answers it."""
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-judge",
            "object": "chat.completion",
            "created": 1,
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        },
    )


def provider_error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "error", "param": None, "code": None}})


@pytest.fixture
def judge_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[respx.Route]:
    """The OpenAI API at JUDGE_API, mocked; loopback traffic (the proxy, the fake vLLM) passes through."""
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("DISABLE_AIOHTTP_TRANSPORT", "True")  # litellm's default transport is not httpx's
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="127.0.0.1").pass_through()
        yield mock.post(f"{JUDGE_API}/chat/completions")


def openai_judge(**options: Any) -> Judge:
    return Judge("openai/gpt-4o-mini", api_base=JUDGE_API, backoff_s=0.01, **options)


def sent(route: respx.Route, index: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(route.calls[index].request.content)
    return body


# ---------------------------------------------------------------- the prompt


def test_the_shared_prefix_is_sent_once_and_each_continuation_is_labelled() -> None:
    prompt = build_prompt(two_trajectories(), DEFAULT_RUBRIC)
    assert prompt.labels == ["t1", "t2"] and prompt.trajectory_ids == ["traj-a", "traj-b"]
    assert prompt.shared == 2
    system, user = prompt.messages
    assert DEFAULT_RUBRIC in system["content"] and "t1, t2" in system["content"]
    text = user["content"]
    assert text.count("capital of France") == 1 and text.count("geography") == 1
    context = text.index("<context>")
    first, second = text.index('<trajectory id="t1">'), text.index('<trajectory id="t2">')
    assert context < first < text.index("Paris.") < second < text.index("Lyon, I think.")
    assert "traj-a" not in text  # the judge sees labels only


def test_trajectories_without_a_common_start_are_shown_whole() -> None:
    prompt = build_prompt(
        [TrajectoryText("a", [TASK, reply("Paris")]), TrajectoryText("b", [SYSTEM, TASK, reply("Paris")])], "r"
    )
    assert prompt.shared == 0
    assert "<context>" not in prompt.messages[1]["content"]
    assert prompt.messages[1]["content"].count("capital of France") == 2


def test_identical_trajectories_say_they_add_nothing() -> None:
    same = [SYSTEM, TASK, reply("Paris")]
    prompt = build_prompt([TrajectoryText("a", same), TrajectoryText("b", list(same))], "r")
    assert prompt.messages[1]["content"].count("nothing beyond the shared context") == 2


def test_an_agent_loop_reads_as_one_conversation() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    tool_call = {"role": "assistant", "content": None, "tool_calls": [call]}
    first = call_messages("chat.completions", {"messages": [TASK]}, {"choices": [{"message": tool_call}]}, None)
    tool = {"role": "tool", "tool_call_id": "c1", "content": "Paris"}
    second = call_messages(
        "chat.completions", {"messages": [TASK, tool_call, tool]}, {"choices": [{"message": reply("Paris")}]}, None
    )
    failed = call_messages("completions", {"prompt": "Again?"}, None, "upstream answered 500")
    merged = trajectory_messages([first, second, failed])
    assert [m["role"] for m in merged] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert merged[1]["tool_calls"] == [{"name": "lookup", "arguments": "{}"}]
    assert merged[-1]["content"] == "[the call failed: upstream answered 500]"


def test_the_cache_key_follows_the_model_the_rubric_and_the_content() -> None:
    base = build_prompt(two_trajectories(), "rubric")
    assert base.cache_key("openai/gpt-4o-mini") == build_prompt(two_trajectories(), "rubric").cache_key(
        "openai/gpt-4o-mini"
    )
    changed = two_trajectories()
    changed[1].messages[-1]["content"] = "Marseille."
    assert len({
        base.cache_key("openai/gpt-4o-mini"),
        base.cache_key("openai/gpt-4o"),
        build_prompt(two_trajectories(), "another rubric").cache_key("openai/gpt-4o-mini"),
        build_prompt(changed, "rubric").cache_key("openai/gpt-4o-mini"),
    }) == 4  # fmt: skip


# ---------------------------------------------------------------- validation


def test_a_valid_answer_is_returned_in_label_order() -> None:
    scores = parse_scores("```json\n" + answer(("t2", 0.25), ("t1", 1)) + "\n```", ["t1", "t2"])
    assert [(s.id, s.score) for s in scores] == [("t1", 1.0), ("t2", 0.25)]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "empty"),
        ("Trajectory 1 is better.", "Invalid JSON"),
        ('{"ratings": []}', "scores: Field required"),
        (answer(("t1", 1.0)), "no score for t2"),
        (answer(("t1", 1.0), ("t1", 0.5), ("t2", 0.0)), "t1 was scored more than once"),
        (answer(("t1", 1.0), ("t2", 0.0), ("t3", 0.5)), "1 unknown id: score only t1, t2"),
        (answer(("t1", 1.5), ("t2", 0.0)), "less than or equal to 1"),
        (answer(("t1", -0.1), ("t2", 0.0)), "greater than or equal to 0"),
        ('{"scores": [{"id": "t1", "score": "high"}, {"id": "t2", "score": 0}]}', "valid number"),
        ('{"scores": [{"id": "t1", "score": NaN}, {"id": "t2", "score": 0}]}', "finite number"),
    ],
)
def test_an_answer_must_score_every_id_exactly_once_within_0_and_1(content: str, reason: str) -> None:
    with pytest.raises(InvalidJudgement, match=re.escape(reason)):
        parse_scores(content, ["t1", "t2"])


# ---------------------------------------------------------------- the provider, mocked


async def test_a_valid_answer_takes_one_request_with_a_json_schema(judge_api: respx.Route) -> None:
    judge_api.side_effect = [completion(answer(("t1", 0.9), ("t2", 0.2), explanation="Paris is right."))]
    verdict = await openai_judge().judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert [(s.score, s.explanation) for s in verdict.scores] == [(0.9, "Paris is right."), (0.2, "Paris is right.")]
    assert verdict.attempts == 1 and verdict.usage == {"prompt_tokens": 100, "completion_tokens": 20}
    body = sent(judge_api)
    assert body["model"] == "gpt-4o-mini"
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["scores"]["items"]["properties"]["id"]["enum"] == ["t1", "t2"]
    assert judge_api.calls[0].request.headers["authorization"] == f"Bearer {PROVIDER_KEY}"


@pytest.mark.parametrize(
    "bad",
    [
        "not json at all",
        answer(("t1", 1.0)),  # t2 missing
        answer(("t1", 1.0), ("t1", 0.0)),  # t1 twice, t2 missing
        answer(("t1", 1.0), ("t2", 0.0), ("t9", 0.5)),  # an id that does not exist
    ],
)
async def test_an_invalid_answer_is_asked_again_with_the_reason(judge_api: respx.Route, bad: str) -> None:
    judge_api.side_effect = [completion(bad), completion(answer(("t1", 1.0), ("t2", 0.0)))]
    verdict = await openai_judge().judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert [s.score for s in verdict.scores] == [1.0, 0.0] and verdict.attempts == 2
    retry = sent(judge_api)["messages"]
    assert retry[-2] == {"role": "assistant", "content": bad}
    assert "could not be used" in retry[-1]["content"]
    assert verdict.usage["prompt_tokens"] == 200


async def test_a_rate_limit_is_retried_after_a_backoff(judge_api: respx.Route) -> None:
    judge_api.side_effect = [
        provider_error(429, "Rate limit reached for gpt-4o-mini"),
        completion(answer(("t1", 0.0), ("t2", 1.0))),
    ]
    verdict = await openai_judge().judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert [s.score for s in verdict.scores] == [0.0, 1.0]
    assert verdict.attempts == 2 and judge_api.call_count == 2  # litellm retried nothing itself


async def test_backoffs_double(judge_api: respx.Route) -> None:
    overloaded = provider_error(503, "Overloaded")
    replies = iter([overloaded, overloaded, completion(answer(("t1", 0.0), ("t2", 1.0)))])
    asked_at: list[float] = []

    def reply(request: httpx.Request) -> httpx.Response:
        asked_at.append(time.monotonic())
        return next(replies)

    judge_api.side_effect = reply
    judge = Judge("openai/gpt-4o-mini", api_base=JUDGE_API, backoff_s=0.1, max_attempts=3)
    verdict = await judge.judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert verdict.attempts == 3
    waits = [later - earlier for earlier, later in itertools.pairwise(asked_at)]
    # Lower bounds only (a loaded machine only adds): backoff_s, then twice it, each -20% at worst.
    assert waits[0] >= 0.08 and waits[1] >= 0.16


async def test_a_retry_after_is_honoured(judge_api: respx.Route) -> None:
    rate_limited = httpx.Response(429, headers={"retry-after": "0.5"}, json={"error": {"message": "Slow down"}})
    replies = iter([rate_limited, completion(answer(("t1", 0.0), ("t2", 1.0)))])
    asked_at: list[float] = []

    def reply(request: httpx.Request) -> httpx.Response:
        asked_at.append(time.monotonic())
        return next(replies)

    judge_api.side_effect = reply
    verdict = await openai_judge().judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert verdict.attempts == 2 and asked_at[1] - asked_at[0] >= 0.5  # not the 0.01 s backoff


async def test_the_attempts_are_bounded_and_the_last_reason_kept(judge_api: respx.Route) -> None:
    judge_api.side_effect = [completion("nope")] * 2 + [provider_error(429, "Rate limit reached")]
    with pytest.raises(JudgeFailed) as failed:
        await openai_judge(max_attempts=3).judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert failed.value.attempts == 3 and judge_api.call_count == 3
    assert "no valid answer after 3 attempts" in failed.value.reason and "RateLimitError" in failed.value.reason


async def test_a_rejected_key_fails_at_once_without_showing_the_key(judge_api: respx.Route) -> None:
    judge_api.side_effect = [provider_error(401, f"Incorrect API key provided: {PROVIDER_KEY}.")]
    with pytest.raises(JudgeFailed) as failed:
        await openai_judge().judge(build_prompt(two_trajectories(), DEFAULT_RUBRIC))
    assert failed.value.attempts == 1 and judge_api.call_count == 1
    assert "AuthenticationError" in failed.value.reason and PROVIDER_KEY not in failed.value.reason


# ---------------------------------------------------------------- judging inside the proxy


def attempt(proxy: RunningProxy, trajectory_id: str, task: str = "What is the capital of France?") -> str:
    raw = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id}).chat.completions.with_raw_response.create(
        model="agent", messages=[{"role": "user", "content": task}]
    )
    return raw.headers["x-group-id"]


def wait_for(condition: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    return publishing_wait_for(condition, timeout=timeout_s)


def judgements(proxy: RunningProxy, **params: Any) -> list[dict[str, Any]]:
    response = httpx.get(f"{proxy.url}/admin/judgements", params=params)
    response.raise_for_status()
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def fake_judge(fake: FakeVLLM, delay_s: float = 0.0, held: threading.Event | None = None) -> list[dict[str, Any]]:
    """Make the fake vLLM answer judge requests (they carry a response_format): 1 for Paris, else 0; after
    ``delay_s``, and with ``held``, once that event is set."""
    asked: list[dict[str, Any]] = []

    def reply_for(body: dict[str, Any]) -> Reply | None:
        if "response_format" not in body:
            return None
        asked.append(body)
        prompt = body["messages"][-1]["content"]
        blocks = re.findall(r'<trajectory id="(t\d+)">\n(.*?)\n</trajectory>', prompt, re.DOTALL)
        scores = [(label, 1.0 if "Paris" in text else 0.0) for label, text in blocks]
        return Reply(answer(*scores, explanation="Checked the capital."), delay_s=delay_s, held=held)

    fake.reply_for = reply_for
    return asked


def test_with_reward_source_judge_a_full_group_is_judged_and_trains(start_proxy, fake: FakeVLLM) -> None:
    asked = fake_judge(fake)
    proxy = start_proxy(reward_source="judge", group_size=2, min_group_size=2, batch_groups=1, judge_quiet_s=0.2)
    fake.script(Reply("Paris."), Reply("Lyon."))
    group = attempt(proxy, "right")
    assert attempt(proxy, "wrong") == group
    jobs = wait_for(lambda: httpx.get(f"{proxy.url}/admin/jobs").json()["data"])
    assert jobs[0]["group_ids"] == [group]
    assert len(asked) == 1 and asked[0]["model"] == fake.base_model  # hosted_vllm/<base model> at the upstream
    trajectories = {t["id"]: t for t in httpx.get(f"{proxy.v1}/trajectories").json()["data"]}
    assert {t: (v["reward"], v["reward_source"]) for t, v in trajectories.items()} == {
        "right": (1.0, "judge"),
        "wrong": (0.0, "judge"),
    }
    rewards = httpx.get(f"{proxy.v1}/trajectories/right").json()["rewards"]
    assert [(r["source"], r["reward"], r["explanation"]) for r in rewards] == [("judge", 1.0, "Checked the capital.")]
    (judged,) = judgements(proxy)
    assert (judged["state"], judged["trigger"], judged["model"]) == ("ok", "complete", f"hosted_vllm/{fake.base_model}")
    assert [s["trajectory_id"] for s in judged["scores"]] == ["right", "wrong"]
    # The judge's request went straight to vLLM: it is no trajectory of the policy.
    assert len(trajectories) == 2
    refused = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "right", "reward": 0.5})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rewards_come_from_the_judge"
    taken = httpx.post(f"{proxy.url}/admin/groups/{group}/judge")  # a job took the group: its rewards are fixed
    assert taken.status_code == 409 and "training" in taken.json()["error"]["message"]


def test_a_group_that_changes_while_judged_is_not_written_but_judged_again(start_proxy, fake: FakeVLLM) -> None:
    thinking = threading.Event()
    asked = fake_judge(fake, held=thinking)
    proxy = start_proxy(reward_source="judge", group_size=2, judge_quiet_s=0.1, judge_idle_s=60)
    attempt(proxy, "a")
    attempt(proxy, "b")
    wait_for(lambda: asked)
    attempt(proxy, "a", "And of Italy?")  # the agent goes on while the judge thinks
    thinking.set()
    ok = wait_for(lambda: judgements(proxy, state="ok"))
    (failed,) = judgements(proxy, state="failed")
    assert "changed while it was judged" in failed["error"] and failed["id"] < ok[0]["id"]
    assert len(asked) == 2 and "Italy" in asked[1]["messages"][-1]["content"]
    assert [r["n"] for r in proxy.rows("SELECT count(*) AS n FROM rewards")] == [2]


def test_a_group_that_stays_small_is_judged_once_idle(start_proxy, fake: FakeVLLM) -> None:
    fake_judge(fake)
    proxy = start_proxy(reward_source="judge", group_size=8, min_group_size=2, judge_quiet_s=60, judge_idle_s=0.3)
    attempt(proxy, "only")
    time.sleep(0.5)
    assert judgements(proxy) == []  # one trajectory is below min_group_size
    attempt(proxy, "second")
    (judged,) = wait_for(lambda: judgements(proxy))
    assert (judged["state"], judged["trigger"], judged["n_trajectories"]) == ("ok", "idle", 2)


def test_with_both_the_external_reward_stays_and_the_judge_score_is_recorded(start_proxy, fake: FakeVLLM) -> None:
    asked = fake_judge(fake)
    proxy = start_proxy(reward_source="both", group_size=8, min_group_size=2, judge_quiet_s=0.2)
    fake.script(Reply("Paris."), Reply("Lyon."))
    group = attempt(proxy, "right")
    attempt(proxy, "wrong")
    posted = [{"trajectory_id": "right", "reward": 0.25}, {"trajectory_id": "wrong", "reward": 0.75}]
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": posted}).raise_for_status()
    (judged,) = wait_for(lambda: judgements(proxy, state="ok"))
    assert judged["trigger"] == "complete" and judged["reward_source"] == "both"
    right = httpx.get(f"{proxy.v1}/trajectories/right").json()
    assert (right["reward"], right["reward_source"]) == (0.25, "service")
    assert [(r["source"], r["reward"]) for r in right["rewards"]] == [("service", 0.25), ("judge", 1.0)]
    # Asked again about the same content, the judge is not asked again.
    again = httpx.post(f"{proxy.url}/admin/groups/{group}/judge").json()
    assert again["state"] == "ok" and again["cached"] is True and again["attempts"] == 0
    assert len(asked) == 1


def test_a_rejudge_of_an_unchanged_group_costs_no_request(start_proxy, judge_api: respx.Route) -> None:
    judge_api.side_effect = [completion(answer(("t1", 1.0), ("t2", 0.0)))]
    proxy = start_proxy(judge_model="openai/gpt-4o-mini", judge_api_base=JUDGE_API)
    group = attempt(proxy, "a")
    attempt(proxy, "b")
    first = httpx.post(f"{proxy.url}/admin/groups/{group}/judge").json()
    second = httpx.post(f"{proxy.url}/admin/groups/{group}/judge").json()
    assert (first["state"], first["cached"], first["attempts"]) == ("ok", False, 1)
    assert (second["state"], second["cached"], second["cache_key"]) == ("ok", True, first["cache_key"])
    assert judge_api.call_count == 1
    # With external rewards, judging on demand records scores beside them and sets no reward.
    assert [t["reward"] for t in httpx.get(f"{proxy.v1}/trajectories").json()["data"]] == [None, None]
    assert len(proxy.rows("SELECT * FROM rewards WHERE source = 'judge'")) == 4


def test_when_every_attempt_fails_the_failure_is_recorded_and_nothing_is_written(
    start_proxy, judge_api: respx.Route
) -> None:
    judge_api.side_effect = [completion(answer(("t1", 1.0)))] * 3  # t2 never scored
    proxy = start_proxy(
        reward_source="judge", judge_model="openai/gpt-4o-mini", judge_api_base=JUDGE_API, batch_groups=1
    )
    group = attempt(proxy, "a")
    attempt(proxy, "b")
    failed = httpx.post(f"{proxy.url}/admin/groups/{group}/judge")
    assert failed.status_code == 200
    body = failed.json()
    assert (body["state"], body["attempts"], body["scores"]) == ("failed", 3, [])
    assert "no score for t2" in body["error"]
    assert judge_api.call_count == 3
    assert proxy.rows("SELECT count(*) AS n FROM rewards")[0]["n"] == 0
    assert [r["reward"] for r in proxy.rows("SELECT reward FROM trajectories")] == [None, None]
    assert httpx.get(f"{proxy.url}/admin/jobs").json()["data"] == []
    (shown,) = judgements(proxy, state="failed", group_id=group)
    assert shown["error"] == body["error"] and shown["finished_at"] >= shown["started_at"]


def test_a_failed_group_is_not_retried_in_a_loop(start_proxy, judge_api: respx.Route) -> None:
    judge_api.side_effect = [provider_error(401, "Incorrect API key provided.")] * 5
    proxy = start_proxy(
        reward_source="judge",
        judge_model="openai/gpt-4o-mini",
        judge_api_base=JUDGE_API,
        group_size=2,
        judge_quiet_s=0.1,
        judge_idle_s=60,
    )
    attempt(proxy, "a")
    attempt(proxy, "b")
    (failed,) = wait_for(lambda: judgements(proxy))
    assert (failed["state"], failed["attempts"]) == ("failed", 1) and "AuthenticationError" in failed["error"]
    time.sleep(0.5)  # several scans: the group waits for judge_idle_s (or a change, or an admin) before a retry
    assert len(judgements(proxy)) == 1 and judge_api.call_count == 1
    assert httpx.get(f"{proxy.v1}/groups").json()["data"][0]["state"] == "open"


def test_judging_an_unknown_group_is_a_404(proxy: RunningProxy) -> None:
    response = httpx.post(f"{proxy.url}/admin/groups/nope/judge")
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("not_found_error", "group_not_found", "group_id")


def test_the_judge_routes_need_the_admin_token_when_set(start_proxy) -> None:
    proxy = start_proxy(admin_token=ADMIN)
    for method, path in [("POST", "/admin/groups/g/judge"), ("GET", "/admin/judgements")]:
        response = httpx.request(method, f"{proxy.url}{path}")
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error", path
    ok = httpx.get(f"{proxy.url}/admin/judgements", headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200 and ok.json()["data"] == []


def test_the_judge_routes_are_refused_beyond_loopback_without_a_token(start_proxy) -> None:
    proxy = start_proxy(host="0.0.0.0", api_keys=KEY)
    response = httpx.get(f"{proxy.url}/admin/judgements", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 403


# ---------------------------------------------------------------- settings and flags


def test_the_rubric_can_come_from_a_file(tmp_path: Path) -> None:
    rubric = tmp_path / "rubric.md"
    rubric.write_text("Shorter answers win.\n")
    assert Settings(judge_rubric=f"@{rubric}").judge_rubric == "Shorter answers win."
    with pytest.raises(ValueError, match="cannot read the judge rubric"):
        Settings(judge_rubric=f"@{tmp_path / 'missing.md'}")


def test_serve_flags_choose_the_reward_source_and_the_judge(tmp_path: Path) -> None:
    from tracetrain_cli._serve_command import settings_from
    from tracetrain_cli._serve_flags import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    (tmp_path / "rubric.md").write_text("Be right.")
    args = parser.parse_args(
        ["serve", "--reward-source", "judge", "--judge-model", "anthropic/claude-x", "--judge-rubric",
         f"@{tmp_path / 'rubric.md'}"]
    )  # fmt: skip
    settings = settings_from(args)
    assert (settings.reward_source, settings.judge_model, settings.judge_rubric) == (
        "judge",
        "anthropic/claude-x",
        "Be right.",
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reward-source", "vibes"])
