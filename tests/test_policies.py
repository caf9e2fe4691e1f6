"""Several policies on one server: their life cycle in the store, each one's settings, adding and retiring
them at run time (on one proxy and across two on one store), and the order the trainer takes their jobs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from test_publishing import wait_for

from store import PolicyAdded, PolicyState, Store

QUESTION = [{"role": "user", "content": "Which table holds the orders?"}]


def record_adapter(proxy: RunningProxy, policy: str, version: int) -> None:
    """What the trainer does after a step of ``policy``: write the directory, record it."""
    path = proxy.settings.data_dir / "adapters" / policy / str(version)
    path.mkdir(parents=True)
    proxy.rows("INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
               "VALUES (?, ?, ?, 'trained', '{}', ?)", policy, version, str(path), time.time())  # fmt: skip


def served(proxy: RunningProxy) -> list[str]:
    return sorted({m["id"].partition("@")[0] for m in httpx.get(f"{proxy.v1}/models").json()["data"]})


def call(proxy: RunningProxy, model: str, **body: Any) -> openai.types.chat.ChatCompletion:
    return proxy.client().chat.completions.create(model=model, messages=QUESTION, **body)


# -- the store ---------------------------------------------------------------------------------------------------------


async def test_a_policy_is_served_retired_and_served_again_and_retiring_keeps_its_rows(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    try:
        assert await store.policies.add("sql", "base", {"group_size": 4}) is PolicyAdded.ADDED
        assert await store.policies.add("sql", "base") is PolicyAdded.SERVING
        await store.adapters.record("sql", 1, str(tmp_path / "1"), None, {})
        assert await store.policies.retire("sql") and not await store.policies.retire("sql")
        row = await store.policies.get("sql")
        assert row is not None and row["state"] == PolicyState.RETIRED and row["retired_at"] is not None
        assert [p["name"] for p in await store.policies.serving()] == []
        assert await store.adapters.get("sql", 1) is not None  # its data stays
        assert await store.policies.add("sql", "base") is PolicyAdded.READDED
        row = await store.policies.get("sql")
        assert row is not None and (row["state"], row["retired_at"]) == ("serving", None)
        assert row["config"] == {"group_size": 4}  # kept while it was retired
        assert await store.policies.configure("sql", {"batch_groups": 2})
        assert not await store.policies.configure("x", {})
        assert (await store.policies.get("sql") or {})["config"] == {"batch_groups": 2}
    finally:
        await store.close()


async def queued(store: Store, policy: str, n: int) -> list[int]:
    made = []
    for k in range(n):
        group = f"{policy}-{k}-{time.monotonic_ns()}"
        async with store.engine.begin() as conn:
            from sqlalchemy import insert

            from store._tables import groups as G

            await conn.execute(insert(G).values(id=group, policy=policy, state="open", created_at=time.time()))
        job = await store.jobs.create(policy, [group])
        assert job is not None
        made.append(job)
    return made


async def test_the_trainer_claims_the_policy_trained_least_recently_first(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    try:
        await queued(store, "a", 6)  # a floods
        await queued(store, "b", 1)
        await queued(store, "c", 2)
        order = []
        while (job := await store.jobs.claim_next("worker", 60.0)) is not None:
            order.append(job["policy"])
            assert await store.jobs.finish(job["id"], "worker", ok=True, metrics={}, version=None, error=None)
            time.sleep(0.001)  # each claim starts after the one before
        # Round robin while every policy has work; the flood goes on alone after.
        assert order == ["a", "b", "c", "a", "c", "a", "a", "a", "a"]
    finally:
        await store.close()


async def test_a_running_job_holds_its_policy_but_not_the_others_and_a_retired_policy_is_not_trained(
    tmp_path: Path,
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    try:
        await queued(store, "a", 2)
        await queued(store, "b", 1)
        first = await store.jobs.claim_next("w1", 60.0)
        second = await store.jobs.claim_next("w2", 60.0)  # a second worker: another policy's job
        assert first is not None and second is not None and (first["policy"], second["policy"]) == ("a", "b")
        assert await store.jobs.claim_next("w3", 60.0) is None  # a's next waits for a's running step
        await store.policies.add("a", "base")
        assert await store.policies.retire("a")
        assert await store.jobs.finish(first["id"], "w1", ok=True, metrics={}, version=None, error=None)
        assert await store.jobs.claim_next("w1", 60.0) is None  # retired: its queued job stays queued
        assert await store.policies.add("a", "base") is PolicyAdded.READDED
        again = await store.jobs.claim_next("w1", 60.0, policies=["a"], first_versions={"a": 7})
        assert again is not None and (again["policy"], again["version"]) == ("a", 7)
    finally:
        await store.close()


# -- each policy's settings ----------------------------------------------------------------------------------------


def test_each_policy_fills_groups_samples_and_trains_by_its_own_settings(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    sql = {"group_size": 2, "batch_groups": 1, "min_group_size": 2,
           "sampling": {"temperature": 0.3, "top_p": 0.9, "max_tokens": 7}}  # fmt: skip
    proxy = start_proxy(policies=("support", "sql"), policy_configs={"sql": sql}, batch_groups=4, group_size=8)
    for model in ("support", "sql"):
        for _ in range(3):
            call(proxy, model)
    sizes = {
        (r["policy"], r["n"])
        for r in proxy.rows(
            "SELECT g.policy, count(*) AS n FROM trajectories t JOIN groups g ON g.id = t.group_id GROUP BY g.id"
        )
    }
    assert sizes == {("support", 3), ("sql", 2), ("sql", 1)}  # sql's derived groups take 2 each
    sent = [(r["model"], r.get("temperature"), r.get("top_p"), r.get("max_tokens")) for r in fake.requests[-6:]]
    assert sent == [(fake.base_model, None, None, None)] * 3 + [(fake.base_model, 0.3, 0.9, 7)] * 3
    call(proxy, "sql", temperature=1.1)  # what the client says wins
    assert fake.requests[-1]["temperature"] == 1.1
    recorded = proxy.rows("SELECT request FROM calls WHERE policy = 'sql' ORDER BY started_at LIMIT 1")
    assert '"temperature":0.3' in recorded[0]["request"].replace(" ", "")  # training reads what sampled the call
    # sql trains on one ready group; support would need four.
    ids = [r["id"] for r in proxy.rows("SELECT t.id FROM trajectories t JOIN groups g ON g.id = t.group_id "
                                       "WHERE g.seats = 2 OR g.policy = 'support'")]  # fmt: skip
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": [{"trajectory_id": t, "reward": 1.0} for t in ids]})
    made = httpx.get(f"{proxy.url}/admin/jobs").json()["data"]
    assert [job["policy"] for job in made] == ["sql"]
    settings = httpx.get(f"{proxy.url}/admin/policies/sql").json()["settings"]
    assert (settings["group_size"], settings["batch_groups"], settings["keep_versions"]) == (2, 1, 3)


def test_a_policy_rewarded_by_the_judge_refuses_posted_rewards_and_the_others_take_them(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(policies=("support", "sql"), policy_configs={"sql": {"reward_source": "judge"}})
    for model in ("support", "sql"):
        proxy.client(default_headers={"X-Trajectory-Id": f"{model}-1"}).chat.completions.create(
            model=model, messages=QUESTION
        )
    both = [{"trajectory_id": "support-1", "reward": 1.0}, {"trajectory_id": "sql-1", "reward": 1.0}]
    refused = httpx.post(f"{proxy.v1}/rewards", json={"rewards": both})
    assert refused.status_code == 409 and "sql" in refused.json()["error"]["message"]
    assert [r["reward"] for r in proxy.rows("SELECT reward FROM trajectories")] == [None, None]
    ok = httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": "support-1", "reward": 1.0})
    assert ok.status_code == 200


def test_each_policy_keeps_its_own_window_of_versions_loaded_in_vllm(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    proxy = start_proxy(policies=("support", "sql"), policy_configs={"sql": {"keep_versions": 1}}, keep_versions=2,
                        unload_grace_s=0)  # fmt: skip
    for version in (1, 2, 3):
        for policy in ("support", "sql"):
            record_adapter(proxy, policy, version)
        wait_for(lambda v=version: {f"support@{v}", f"sql@{v}"} <= set(fake.loras))
    wait_for(lambda: set(fake.loras) == {"support@2", "support@3", "sql@3"})
    assert call(proxy, "support").model == call(proxy, "sql").model.replace("sql", "support") == "support@3"


# -- added and retired at run time -------------------------------------------------------------------------------------


def test_a_policy_is_added_configured_retired_and_added_again_through_the_admin_api(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    proxy = start_proxy(unload_grace_s=0)
    with pytest.raises(openai.NotFoundError):
        call(proxy, "sql")
    added = httpx.post(f"{proxy.url}/admin/policies", json={"name": "sql", "config": {"group_size": 2}})
    assert added.status_code == 201 and added.json()["added"] and added.json()["settings"]["group_size"] == 2
    assert served(proxy) == ["agent", "sql"] and call(proxy, "sql").model == "sql@0"  # at once on this replica
    assert httpx.post(f"{proxy.url}/admin/policies", json={"name": "sql"}).status_code == 409
    record_adapter(proxy, "sql", 1)
    wait_for(lambda: "sql@1" in fake.loras)
    assert call(proxy, "sql").model == "sql@1"
    patched = httpx.patch(f"{proxy.url}/admin/policies/sql", json={"config": {"batch_groups": 9}})
    assert patched.json()["config"] == {"batch_groups": 9} and patched.json()["settings"]["group_size"] == 8

    retired = httpx.post(f"{proxy.url}/admin/policies/sql/retire")
    assert retired.status_code == 200 and retired.json()["state"] == "retired"
    assert served(proxy) == ["agent"]
    with pytest.raises(openai.NotFoundError):
        call(proxy, "sql")
    wait_for(lambda: "sql@1" not in fake.loras)  # its versions leave vLLM
    # Its data stays readable.
    assert len(httpx.get(f"{proxy.v1}/trajectories", params={"policy": "sql"}).json()["data"]) == 2
    assert httpx.get(f"{proxy.url}/admin/adapters", params={"policy": "sql"}).json()["data"][0]["version"] == 1
    assert httpx.post(f"{proxy.url}/admin/policies/sql/retire").status_code == 409

    again = httpx.post(f"{proxy.url}/admin/policies", json={"name": "sql"})
    assert again.status_code == 201 and not again.json()["added"] and again.json()["config"] == {"batch_groups": 9}
    assert "sql@1" in fake.loras and call(proxy, "sql").model == "sql@1"  # loaded again before it serves


def test_the_admin_api_refuses_bad_names_bad_settings_and_unnamed_policies(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(policies=("support", "sql"))
    admin = f"{proxy.url}/admin"
    for name in ("..", "-x", "a@1", "", "x" * 101, "a b"):
        assert httpx.post(f"{admin}/policies", json={"name": name}).status_code == 400, name
    for config in ({"group_size": 0}, {"nope": 1}, {"judge_rubric": "@/etc/passwd"}, {"sampling": {"top_p": 2}},
                   {"reward_source": "vibes"}):  # fmt: skip
        response = httpx.post(f"{admin}/policies", json={"name": "new", "config": config})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error", config
    assert httpx.post(f"{admin}/policies/nope/retire").status_code == 404
    assert httpx.get(f"{admin}/adapters").status_code == 400  # two served: which one?
    assert "(sql, support)" in httpx.post(f"{admin}/train").json()["error"]["message"]
    assert httpx.get(f"{admin}/training", params={"policy": "nope"}).status_code == 404
    assert httpx.get(f"{admin}/training", params={"policy": "sql"}).json()["policy"] == "sql"


HUGE = 79717771397495269223366349815808  # an integer past every column and loop that reads a setting


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [("group_size", HUGE, "1024"), ("min_group_size", 2**63, "1024"), ("batch_groups", 10**6, "1024"),
     ("keep_versions", HUGE, "100"), ("regression_margin", 1e308, "1000000"), ("canary_minutes", 1e300, "525600"),
     ("reward_timeout_s", 1e200, "31536000"), ("judge_quiet_s", 1e300, "31536000"),
     ("judge_idle_s", 1e300, "31536000"), ("canary_margin", 1e7, "1000000")],
)  # fmt: skip
def test_a_setting_beyond_its_declared_bound_is_a_400_naming_the_field_and_the_bound(
    start_proxy: Callable[..., RunningProxy], field: str, value: float, bound: str
) -> None:
    proxy = start_proxy(policies=("agent", "sql"))
    for method, url, body in (("PATCH", "/admin/policies/sql", {"config": {field: value}}),
                              ("POST", "/admin/policies", {"name": "new", "config": {field: value}})):  # fmt: skip
        response = httpx.request(method, f"{proxy.url}{url}", json=body)
        assert response.status_code == 400, (method, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and field in error["param"], error
        assert bound in error["message"], error
    assert httpx.get(f"{proxy.url}/admin/policies/sql").json()["config"] == {}


def test_a_policy_config_file_beyond_a_bound_names_the_field_and_the_bound(tmp_path: Path) -> None:
    from proxy import PolicyOverrides, Settings

    path = tmp_path / "sql.toml"
    path.write_text(f"group_size = {HUGE}\n")
    with pytest.raises(ValueError, match=r"group_size: .*1024"):
        PolicyOverrides.from_file(path)
    with pytest.raises(ValueError, match=r"group_size"):
        Settings(group_size=HUGE)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"], indirect=True)
def test_a_policy_added_on_one_replica_is_served_by_the_other_and_retired_from_either(
    start_proxy: Callable[..., RunningProxy], database: str, tmp_path: Path
) -> None:
    a = start_proxy(database_url=database, data_dir=tmp_path / "a", unload_grace_s=0)
    b = start_proxy(database_url=database, data_dir=tmp_path / "b", unload_grace_s=0)
    assert httpx.post(f"{a.url}/admin/policies", json={"name": "sql"}).status_code == 201
    wait_for(lambda: served(b) == ["agent", "sql"], timeout=15)  # through the store, within a sync
    assert call(b, "sql").model == "sql@0"
    assert httpx.post(f"{b.url}/admin/policies/sql/retire").status_code == 200
    wait_for(lambda: served(a) == ["agent"], timeout=15)
    with pytest.raises(openai.NotFoundError):
        call(a, "sql")


@pytest.fixture
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    from test_replicas import _pg_url

    return f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}" if request.param == "sqlite" else _pg_url()


def test_a_restarted_vllm_gets_every_policys_published_versions_back(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    proxy = start_proxy(policies=("support", "sql"))
    for policy in ("support", "sql"):
        record_adapter(proxy, policy, 1)
    wait_for(lambda: {"support@1", "sql@1"} <= set(fake.loras))
    fake.loras.clear()  # what a vLLM restarted under the proxy holds: the base model alone
    wait_for(lambda: {"support@1", "sql@1"} <= set(fake.loras), timeout=15)  # the publisher's check, every 5 s
    assert call(proxy, "support").model == "support@1" and call(proxy, "sql").model == "sql@1"


@pytest.mark.filterwarnings("ignore:Item 'summary' on TypedDict")  # litellm's response types, built on first use
def test_the_judge_scores_only_the_groups_of_the_policies_it_rewards(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM
) -> None:
    from fake_vllm import Reply
    from test_judge import fake_judge

    asked = fake_judge(fake)
    judged = {"reward_source": "judge", "judge_quiet_s": 0.2, "group_size": 2, "min_group_size": 2,
              "batch_groups": 1, "judge_rubric": "Name the capital."}  # fmt: skip
    proxy = start_proxy(policies=("support", "sql"), policy_configs={"sql": judged}, group_size=2, min_group_size=2)
    fake.script(Reply("Paris."), Reply("Lyon."), Reply("Paris."), Reply("Lyon."))
    task = [{"role": "user", "content": "What is the capital of France?"}]
    for model in ("sql", "sql", "support", "support"):
        proxy.client().chat.completions.create(model=model, messages=task)
    jobs = wait_for(lambda: httpx.get(f"{proxy.url}/admin/jobs").json()["data"], timeout=15)
    assert [job["policy"] for job in jobs] == ["sql"]  # its group was judged, rewarded and queued
    time.sleep(0.5)  # a scan or two more: support's complete group is never judged
    assert len(asked) == 1 and "Name the capital." in str(asked[0]["messages"])  # its own rubric
    rewards = {(r["policy"], r["reward"]) for r in proxy.rows("SELECT policy, reward FROM trajectories")}
    assert rewards == {("sql", 1.0), ("sql", 0.0), ("support", None)}
