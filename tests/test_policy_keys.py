"""Keys bound to a policy (``--policy-key NAME=KEY``): each reaches its own policy and nothing of another's.

One rule everywhere: another policy's model, trajectory, group or reward is a 404, the same answer as for one
that does not exist, on every route family: chat and text completions, the Responses and Messages APIs,
count_tokens, the path prefixes, threading, /v1/models, rewards and the read API.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

SUPPORT_KEY = "support-key-" + "s" * 24
SQL_KEY = "sql-key-" + "q" * 24
BOTH_KEY = "both-key-" + "b" * 24  # named for both policies
API_KEY = "inference-key-" + "i" * 24  # --api-keys: every policy
REWARD_KEY = "reward-key-" + "r" * 24  # --reward-keys: every policy
QUESTION = [{"role": "user", "content": "Which table holds the orders?"}]


@pytest.fixture
def tenants(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(
        policies=("support", "sql"),
        policy_keys=(("support", SUPPORT_KEY), ("sql", SQL_KEY), ("support", BOTH_KEY), ("sql", BOTH_KEY)),
        api_keys=(API_KEY,),
        reward_keys=(REWARD_KEY,),
    )


def as_key(proxy: RunningProxy, key: str, base_url: str | None = None, **headers: str) -> openai.OpenAI:
    """A client with ``key``, closed when the proxy stops (a client left to the collector warns of its socket)."""
    client = openai.OpenAI(base_url=base_url or proxy.v1, api_key=key, max_retries=0, default_headers=headers or None)
    proxy._stack.callback(client.close)
    return client


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sql_trajectory(proxy: RunningProxy, trajectory_id: str = "sql-1", group: str = "sql-group") -> str:
    """A trajectory of the sql policy, rewarded 0.5, in a group sql names."""
    headers = {"X-Trajectory-Id": trajectory_id, "X-Group-Id": group}
    as_key(proxy, SQL_KEY, **headers).chat.completions.create(model="sql", messages=QUESTION)
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory_id, "reward": 0.5},
               headers=auth(SQL_KEY)).raise_for_status()  # fmt: skip
    return trajectory_id


def same_but_the_id(a: dict[str, Any], b: dict[str, Any], *ids: str) -> bool:
    """Two error bodies that differ only in the id each names: the other policy's looks like a missing one."""

    def plain(body: dict[str, Any]) -> str:
        text = str(body)
        for value in ids:
            text = text.replace(value, "ID")
        return text

    return plain(a) == plain(b)


def test_a_policy_key_calls_its_model_in_every_api_and_another_policys_is_an_unknown_model(
    tenants: RunningProxy,
) -> None:
    support = as_key(tenants, SUPPORT_KEY)
    assert support.chat.completions.create(model="support", messages=QUESTION).model == "support@0"
    for model in ("sql", "sql@0", "nope"):
        with pytest.raises(openai.NotFoundError) as chat:
            support.chat.completions.create(model=model, messages=QUESTION)
        assert chat.value.code == "model_not_found" and "sql" not in re.sub(model, "", chat.value.message)
    with pytest.raises(openai.NotFoundError):
        support.completions.create(model="sql", prompt="SELECT", max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        support.responses.create(model="sql", input="Which table?")
    assert support.responses.create(model="support", input="Which table?").model == "support@0"

    claude = anthropic.Anthropic(base_url=tenants.url, api_key=SUPPORT_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as messages:
        claude.messages.create(model="sql", max_tokens=16, messages=QUESTION)  # type: ignore[arg-type]
    assert messages.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="sql", messages=QUESTION)  # type: ignore[arg-type]
    assert claude.messages.count_tokens(model="support", messages=QUESTION).input_tokens > 0  # type: ignore[arg-type]
    claude.close()
    support.close()
    # Nothing of the refused calls was recorded.
    assert [row["policy"] for row in tenants.rows("SELECT policy FROM calls")] == ["support"] * 2


def test_v1_models_lists_only_the_policies_a_key_may_use(tenants: RunningProxy) -> None:
    def listed(key: str) -> list[str]:
        return [m["id"] for m in httpx.get(f"{tenants.v1}/models", headers=auth(key)).json()["data"]]

    assert listed(SUPPORT_KEY) == ["support", "support@0"]
    assert listed(SQL_KEY) == ["sql", "sql@0"]
    assert listed(BOTH_KEY) == listed(API_KEY) == ["sql", "sql@0", "support", "support@0"]
    assert httpx.get(f"{tenants.v1}/models").status_code == 401  # a policy key is needed even on loopback


def test_a_path_prefix_or_header_naming_another_policys_trajectory_or_group_is_a_404(tenants: RunningProxy) -> None:
    sql_trajectory(tenants)
    support_url = f"{tenants.url}/t/sql-1/v1"
    with pytest.raises(openai.NotFoundError) as by_path:
        as_key(tenants, SUPPORT_KEY, support_url).chat.completions.create(model="support", messages=QUESTION)
    assert by_path.value.code == "trajectory_not_found"
    with pytest.raises(openai.NotFoundError):
        as_key(tenants, SUPPORT_KEY, **{"X-Trajectory-Id": "sql-1"}).chat.completions.create(
            model="support", messages=QUESTION
        )
    in_its_group = f"{tenants.url}/g/sql-group/t/support-9/v1"
    with pytest.raises(openai.NotFoundError) as by_group:
        as_key(tenants, SUPPORT_KEY, in_its_group).chat.completions.create(model="support", messages=QUESTION)
    assert by_group.value.code == "group_not_found"
    # Not even a key for every policy mixes them: a trajectory and a group hold one policy's calls.
    with pytest.raises(openai.NotFoundError):
        as_key(tenants, API_KEY, support_url).chat.completions.create(model="support", messages=QUESTION)
    rows = tenants.rows("SELECT trajectory_id, policy FROM calls")
    assert {(r["trajectory_id"], r["policy"]) for r in rows} == {("sql-1", "sql")}
    assert [r["policy"] for r in tenants.rows("SELECT policy FROM groups WHERE id = 'sql-group'")] == ["sql"]


def test_threading_never_joins_another_policys_trajectory(tenants: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content="orders"), Reply(content="order_items"))
    first = as_key(tenants, SQL_KEY).chat.completions.with_raw_response.create(model="sql", messages=QUESTION)
    reply = first.parse().choices[0].message.model_dump(exclude_none=True)
    follow_up = [*QUESTION, reply, {"role": "user", "content": "And the items?"}]
    second = as_key(tenants, SUPPORT_KEY).chat.completions.with_raw_response.create(model="support", messages=follow_up)
    assert second.headers["x-trajectory-id"] != first.headers["x-trajectory-id"]
    rows = tenants.rows("SELECT id, policy, n_calls FROM trajectories ORDER BY created_at")
    assert [(r["policy"], r["n_calls"]) for r in rows] == [("sql", 1), ("support", 1)]


def test_a_policy_key_reads_and_rewards_only_its_policys_data_and_the_rest_is_not_found(
    tenants: RunningProxy,
) -> None:
    sql_trajectory(tenants)
    as_key(tenants, SUPPORT_KEY, **{"X-Trajectory-Id": "support-1"}).chat.completions.create(
        model="support", messages=QUESTION
    )
    support = auth(SUPPORT_KEY)

    other = httpx.get(f"{tenants.v1}/trajectories/sql-1", headers=support)
    missing = httpx.get(f"{tenants.v1}/trajectories/no-such-1", headers=support)
    assert other.status_code == missing.status_code == 404
    assert same_but_the_id(other.json(), missing.json(), "sql-1", "no-such-1")
    assert httpx.get(f"{tenants.v1}/trajectories/support-1", headers=support).json()["policy"] == "support"

    listed = httpx.get(f"{tenants.v1}/trajectories", headers=support).json()["data"]
    assert [t["id"] for t in listed] == ["support-1"]
    assert httpx.get(f"{tenants.v1}/trajectories", params={"policy": "sql"}, headers=support).json()["data"] == []
    assert {g["policy"] for g in httpx.get(f"{tenants.v1}/groups", headers=support).json()["data"]} == {"support"}

    posted = httpx.post(f"{tenants.v1}/rewards", json={"trajectory_id": "sql-1", "reward": 1.0}, headers=support)
    unknown = httpx.post(f"{tenants.v1}/rewards", json={"trajectory_id": "no-such-1", "reward": 1.0}, headers=support)
    assert posted.status_code == unknown.status_code == 404
    assert same_but_the_id(posted.json(), unknown.json(), "sql-1", "no-such-1")
    batch = {"rewards": [{"trajectory_id": "support-1", "reward": 1.0}, {"trajectory_id": "sql-1", "reward": 1.0}]}
    assert httpx.post(f"{tenants.v1}/rewards", json=batch, headers=support).status_code == 404
    rewards = {r["id"]: r["reward"] for r in tenants.rows("SELECT id, reward FROM trajectories")}
    assert rewards == {"sql-1": 0.5, "support-1": None}  # the batch was refused whole
    ok = httpx.post(f"{tenants.v1}/rewards", json={"trajectory_id": "support-1", "reward": 1.0}, headers=support)
    assert ok.status_code == 200


def test_inference_and_reward_keys_keep_meaning_every_policy(tenants: RunningProxy) -> None:
    sql_trajectory(tenants)
    every = as_key(tenants, API_KEY)
    assert every.chat.completions.create(model="support", messages=QUESTION).model == "support@0"
    assert every.chat.completions.create(model="sql", messages=QUESTION).model == "sql@0"
    reader = auth(REWARD_KEY)
    assert len(httpx.get(f"{tenants.v1}/trajectories", headers=reader).json()["data"]) == 3
    assert httpx.get(f"{tenants.v1}/trajectories/sql-1", headers=reader).status_code == 200
    # A reward key reads and rewards; it does not call a model.
    assert httpx.post(f"{tenants.v1}/chat/completions", json={"model": "sql", "messages": QUESTION},
                      headers=reader).status_code == 401  # fmt: skip


def test_with_policy_keys_a_call_without_a_key_or_with_a_wrong_one_is_refused(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(policies=("support", "sql"), policy_keys=(("support", SUPPORT_KEY),))
    body = {"model": "support", "messages": QUESTION}
    assert httpx.post(f"{proxy.v1}/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=auth("not-a-key-" + "x" * 20))
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "Invalid key."
    assert httpx.get(f"{proxy.v1}/trajectories").status_code == 401
    assert httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=auth(SUPPORT_KEY)).status_code == 200
    # A key named for a policy not served yet reaches nothing, until that policy is added.
    only = start_proxy(policies=("support",), policy_keys=(("sql", SQL_KEY),), data_dir=proxy.settings.data_dir / "b")
    assert httpx.get(f"{only.v1}/models", headers=auth(SQL_KEY)).json()["data"] == []


def test_policy_keys_are_never_shown_or_logged(
    start_proxy: Callable[..., RunningProxy], caplog: pytest.LogCaptureFixture
) -> None:
    from proxy import Settings

    settings = Settings(policies=("support",), policy_keys=(f"support={SUPPORT_KEY}",))
    assert SUPPORT_KEY not in repr(settings) and SUPPORT_KEY not in str(settings.model_dump())
    with pytest.raises(ValueError, match="placeholder"):
        Settings(policy_keys=("support=short",))
    with pytest.raises(ValueError, match="NAME=KEY"):
        Settings(policy_keys=("support",))
    proxy = start_proxy(policies=("support",), policy_keys=(("support", SUPPORT_KEY),))
    httpx.post(f"{proxy.v1}/chat/completions", json={"model": "support", "messages": QUESTION},
               headers=auth(SUPPORT_KEY + "x"))  # fmt: skip
    assert SUPPORT_KEY not in caplog.text
    assert SUPPORT_KEY not in httpx.get(f"{proxy.url}/metrics").text
