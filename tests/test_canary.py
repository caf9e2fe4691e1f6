"""Trying a version before it serves everyone: canary trials decided by the rewards of the trajectories each served.

A real proxy over loopback HTTP, the fake vLLM as its upstream, the real OpenAI client as the
agent. Each group is one task attempted ``size`` times (``X-Group-Id``); each attempt is
rewarded by what the version that served it earns (``reward_of(version)``). Version 0 (the
base model) serves before; the "trainer" records adapter 1 and the publisher puts it on trial.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from test_publishing import adapters, record_trained_adapter, wait_for

TASK = [{"role": "user", "content": "Capital of Peru?"}]
CANARY = {"canary": 0.5, "canary_groups": 6, "min_group_size": 2, "batch_groups": 1000, "unload_grace_s": 0}
_groups = iter(range(10**6))


@pytest.fixture(autouse=True)
def _group_ids_from_zero() -> None:
    """Each test's groups are g0, g1, ...: the split (a hash of the ids) and so each test's outcome are the
    same however the tests are picked."""
    global _groups
    _groups = iter(range(10**6))


def call(proxy: RunningProxy, trajectory: str, group: str | None = None, model: str = "agent") -> int:
    """One call of ``trajectory``; the version that served it."""
    headers = {"X-Trajectory-Id": trajectory, **({"X-Group-Id": group} if group else {})}
    raw = proxy.client().chat.completions.with_raw_response.create(model=model, messages=TASK, extra_headers=headers)
    return int(raw.headers["x-policy-version"])


def reward(proxy: RunningProxy, trajectory: str, value: float) -> None:
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": trajectory, "reward": value}).raise_for_status()


def play_group(proxy: RunningProxy, reward_of: Callable[[int], float], size: int = 8) -> list[int]:
    """One task attempted ``size`` times, each attempt rewarded by its version's ``reward_of``; the versions."""
    group = f"g{next(_groups)}"
    versions = [call(proxy, f"{group}-t{i}", group) for i in range(size)]
    for i, version in enumerate(versions):
        reward(proxy, f"{group}-t{i}", reward_of(version))
    return versions


def trials(proxy: RunningProxy, **headers: str) -> dict[str, Any]:
    return dict(httpx.get(f"{proxy.url}/admin/trials", headers=headers).json())


def running(proxy: RunningProxy) -> dict[str, Any] | None:
    return trials(proxy)["running"]


def put_on_trial(proxy: RunningProxy, version: int, tmp_path: Path) -> dict[str, Any]:
    record_trained_adapter(proxy, version, tmp_path)
    return wait_for(lambda: (t := running(proxy)) is not None and t["candidate"] == version and t)


def until_ended(proxy: RunningProxy, trial_id: int, play: Callable[[], list[int]], most: int = 30) -> dict[str, Any]:
    """Play groups until the trial ends; the trial as it ended, with ``played``: the versions that served."""
    served: list[int] = []
    for _ in range(most):
        served += play()
        time.sleep(0.05)
        ended = next(t for t in trials(proxy)["data"] if t["id"] == trial_id)
        if ended["state"] != "running":
            return {**ended, "played": served}
    wait_for(lambda: next(t for t in trials(proxy)["data"] if t["id"] == trial_id)["state"] != "running", timeout=60)
    return {**next(t for t in trials(proxy)["data"] if t["id"] == trial_id), "played": served}


def bernoulli(rng: random.Random, p: float) -> float:
    return float(rng.random() < p)


def test_a_worse_version_is_rolled_back_after_serving_about_its_share(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    rng = random.Random(7)
    before = [call(proxy, f"before-{i}") for i in range(8)]  # begun before the trial: they keep the baseline
    trial = put_on_trial(proxy, 1, tmp_path)
    assert trial["baseline"] == 0 and trial["fraction"] == 0.5 and adapters(proxy)["active_version"] == 0

    ended = until_ended(proxy, trial["id"], lambda: play_group(proxy, lambda v: 0.0 if v == 1 else bernoulli(rng, 0.6)))

    assert before == [0] * 8 and [call(proxy, f"before-{i}") for i in range(8)] == [0] * 8
    assert ended["state"] == "rolled_back" and ended["decided_by"] == "test" and ended["reason"].startswith("worse")
    # The share of the trajectories served while the trial ran (the trial's own count: a group played across
    # its end, on a slow machine, has its later calls on the baseline) and of every call played. The trial
    # decides within 3-4 groups, 24-32 trajectories, and these ids draw few candidates (7 of g0-g2's 24;
    # g3 adds 1 of 8 when the last look runs after its calls): "about its share" at that size is 0.2-0.75.
    share = ended["verdict"]["shares"]["candidate"]
    assert 0.2 < share < 0.75 and 0 < ended["played"].count(1) / len(ended["played"]) < 0.75, ended
    look = ended["verdict"]["look"]
    assert look["n"] <= 6 and look["difference"] < -0.3 and look["p_worse"] < 0.05 / 4
    assert ended["verdict"]["candidate"]["mean"] == 0.0 and ended["verdict"]["baseline"]["interval"] is not None
    row = next(a for a in adapters(proxy)["data"] if a["version"] == 1)
    assert row["state"] == "rolled_back" and "canary trial" in row["error"]
    assert adapters(proxy)["active_version"] == 0
    assert {call(proxy, f"after-{i}") for i in range(12)} == {0}  # the baseline serves every new trajectory
    training = httpx.get(f"{proxy.url}/admin/training").json()
    assert not training["paused"]  # a canary's rollback is routine: training goes on, from @0


BENCH_PACE_S = 0.5 / 8  # bench/canary.py's pace: 8 trajectories begun every 0.5 s


def play_ungrouped(proxy: RunningProxy, trial_id: int, reward_of: Callable[[int], float], most: int) -> dict[str, Any]:
    """Conversations each its own group, begun at most at the bench's pace, each rewarded 8 conversations after
    its answer (rewards come late), until the trial ends or ``most`` are played; the trial with ``played``."""
    pending: list[tuple[str, int]] = []
    played: list[int] = []
    for i in range(most):
        began = time.monotonic()
        trajectory = f"u{i}"
        played.append(version := call(proxy, trajectory, trajectory))
        pending.append((trajectory, version))
        if len(pending) > 8:
            trajectory, version = pending.pop(0)
            reward(proxy, trajectory, reward_of(version))
        if i % 16 == 15:
            ended = next(t for t in trials(proxy)["data"] if t["id"] == trial_id)
            if ended["state"] != "running":
                return {**ended, "played": played}
        time.sleep(max(0.0, BENCH_PACE_S - (time.monotonic() - began)))
    return {**next(t for t in trials(proxy)["data"] if t["id"] == trial_id), "played": played}


def test_a_worse_version_on_ungrouped_traffic_is_rolled_back_within_two_minutes_at_the_bench_pace(
    start_proxy, tmp_path: Path
) -> None:
    proxy = start_proxy(**{**CANARY, "canary": 0.3})
    trial = put_on_trial(proxy, 1, tmp_path)

    # Two minutes of the bench's traffic, at most: a slower machine plays fewer conversations a minute, and the
    # windows (seconds long) then hold fewer each, so the count bounds the trial however loaded the machine is.
    ended = play_ungrouped(proxy, trial["id"], lambda v: 0.0 if v == 1 else 1.0, most=int(120 / BENCH_PACE_S))

    assert ended["state"] == "rolled_back" and ended["decided_by"] == "test", ended["reason"]
    assert "3 paired groups (3 of them time windows)" in ended["reason"]
    look = ended["verdict"]["look"]
    assert look["difference"] == -1.0 and look["p_worse"] == 0.0
    assert 0.15 < ended["verdict"]["shares"]["candidate"] < 0.45 and 1 in ended["played"]
    assert adapters(proxy)["active_version"] == 0 and {call(proxy, f"after-{i}") for i in range(12)} == {0}


def test_on_mixed_traffic_groups_and_time_windows_both_count(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**{**CANARY, "canary": 0.3})
    trial = put_on_trial(proxy, 1, tmp_path)
    worse = lambda v: 0.0 if v == 1 else 1.0  # noqa: E731

    # Groups first (g1 and g2 hold both versions on this trial; g0 the baseline's alone), complete at once; then
    # conversations of their own, whose windows complete seconds later: the first look needs both kinds.
    played = [play_group(proxy, worse) for _ in range(3)]
    ended = play_ungrouped(proxy, trial["id"], worse, most=int(120 / BENCH_PACE_S))

    assert [set(versions) for versions in played] == [{0}, {0, 1}, {0, 1}]
    assert ended["state"] == "rolled_back" and ended["decided_by"] == "test", ended["reason"]
    windows = re.search(r"(\d+) paired groups \((\d+) of them time windows\)", ended["reason"])
    assert windows and 0 < int(windows[2]) < int(windows[1]) == ended["verdict"]["look"]["n"], ended["reason"]
    assert adapters(proxy)["active_version"] == 0


def test_an_equal_version_is_promoted_at_the_trials_bound(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    rng = random.Random(5)
    trial = put_on_trial(proxy, 1, tmp_path)

    ended = until_ended(proxy, trial["id"], lambda: play_group(proxy, lambda v: bernoulli(rng, 0.6)))

    assert ended["state"] == "promoted" and ended["decided_by"] == "bound", ended
    assert ended["verdict"]["look"]["n"] == 6 and "not shown worse" in ended["reason"]
    assert adapters(proxy)["active_version"] == 1
    assert {call(proxy, f"after-{i}") for i in range(12)} == {1}
    # The regression guard watches the promoted version against the one it replaced.
    guard = next(a for a in adapters(proxy)["data"] if a["version"] == 1)["guard"]
    assert guard["state"] == "watching" and guard["baseline_version"] == 0


def test_pins_bypass_the_trial_and_unpinned_trajectories_split(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    assert [call(proxy, f"before-{i}") for i in range(8)] == [0] * 8
    put_on_trial(proxy, 1, tmp_path)

    assert [call(proxy, f"before-{i}") for i in range(8)] == [0] * 8  # begun before the trial: on the baseline
    pinned = [call(proxy, f"pinned-{i}", model="agent@0") for i in range(10)]
    pinned += [call(proxy, f"pinned-{i}", model="agent@1") for i in range(10)]
    split = Counter(call(proxy, f"split-{i}") for i in range(40))

    assert pinned == [0] * 10 + [1] * 10
    assert split[0] > 8 and split[1] > 8 and split[0] + split[1] == 40
    for i in range(10):  # each trajectory keeps its version, call after call
        first = call(proxy, f"sticky-{i}")
        assert [call(proxy, f"sticky-{i}") for _ in range(3)] == [first] * 3


def test_without_a_canary_a_new_version_serves_everything_at_once(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(min_group_size=2, batch_groups=1000)
    record_trained_adapter(proxy, 1, tmp_path)
    wait_for(lambda: adapters(proxy)["active_version"] == 1)
    assert {call(proxy, f"t{i}") for i in range(8)} == {1} and running(proxy) is None


@pytest.mark.parametrize("model", ["agent@7", "agent@x"])
def test_an_unloaded_pin_is_still_a_404_during_a_trial(start_proxy, tmp_path: Path, model: str) -> None:
    proxy = start_proxy(**CANARY)
    put_on_trial(proxy, 1, tmp_path)
    answer = httpx.post(f"{proxy.v1}/chat/completions", json={"model": model, "messages": TASK})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_versions_trained_during_a_trial_wait_and_the_newest_goes_on_trial_next(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    rng = random.Random(3)
    trial = put_on_trial(proxy, 1, tmp_path)
    record_trained_adapter(proxy, 2, tmp_path)  # steps go on from @1 meanwhile
    record_trained_adapter(proxy, 3, tmp_path)
    time.sleep(1.5)
    states = {a["version"]: a["state"] for a in adapters(proxy)["data"]}
    assert states == {1: "published", 2: "trained", 3: "trained"} and running(proxy)["candidate"] == 1
    assert 2 not in adapters(proxy)["loaded_versions"]

    until_ended(proxy, trial["id"], lambda: play_group(proxy, lambda v: bernoulli(rng, 0.6)))

    following = wait_for(lambda: (t := running(proxy)) is not None and t["candidate"] == 3 and t)
    assert following["baseline"] == 1 and adapters(proxy)["active_version"] == 1
    passed = next(a for a in adapters(proxy)["data"] if a["version"] == 2)
    assert passed["state"] == "discarded" and "passed over: agent@3" in passed["error"]


def test_a_rollback_discards_the_versions_trained_from_the_rolled_back_one(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    trial = put_on_trial(proxy, 1, tmp_path)
    record_trained_adapter(proxy, 2, tmp_path)
    time.sleep(0.5)
    promote = httpx.post(f"{proxy.url}/admin/trials/{trial['id']}/roll-back")
    assert promote.status_code == 200 and promote.json()["state"] == "rolled_back"
    assert promote.json()["decided_by"] == "admin"

    waiting = wait_for(lambda: next(a for a in adapters(proxy)["data"] if a["version"] == 2)["state"] == "discarded")
    assert waiting and adapters(proxy)["active_version"] == 0 and running(proxy) is None
    # A step that was running from @1 when it was rolled back records after: it is discarded too.
    record_trained_adapter(proxy, 3, tmp_path, created_at=time.time() - 60)  # recorded as begun before the roll-back
    wait_for(lambda: next(a for a in adapters(proxy)["data"] if a["version"] == 3)["state"] == "discarded")
    # A step begun after it trains from @0 and goes on trial against @0.
    record_trained_adapter(proxy, 4, tmp_path)
    assert wait_for(lambda: (t := running(proxy)) is not None and t["candidate"] == 4 and t)["baseline"] == 0


def test_the_admin_ends_a_trial_either_way_with_the_token_and_nothing_else(start_proxy, tmp_path: Path) -> None:
    token = "admin-token-for-the-canary-tests-0123456789"
    auth = {"Authorization": f"Bearer {token}"}
    proxy = start_proxy(admin_token=token, **CANARY)
    trial = put_on_trial_as(proxy, 1, tmp_path, auth)
    base = f"{proxy.url}/admin/trials"
    assert httpx.post(f"{base}/{trial['id']}/promote").status_code == 401
    assert httpx.post(f"{base}/{trial['id']}/promote", headers={"Authorization": "Bearer wrong-token-x"}) \
        .status_code == 401  # fmt: skip
    activate = httpx.post(f"{proxy.url}/admin/adapters/0/activate", headers=auth)
    assert activate.status_code == 409 and activate.json()["error"]["code"] == "trial_running"

    promoted = httpx.post(f"{base}/{trial['id']}/promote", headers=auth)

    assert promoted.status_code == 200 and promoted.json()["state"] == "promoted"
    assert promoted.json()["reason"] == "promoted by an admin" and promoted.json()["decided_by"] == "admin"
    assert httpx.get(f"{proxy.url}/admin/adapters", headers=auth).json()["active_version"] == 1
    again = httpx.post(f"{base}/{trial['id']}/roll-back", headers=auth)
    assert again.status_code == 409 and again.json()["error"]["code"] == "trial_ended"
    for bad, status in (("0", 400), ("abc", 400), (str(2**40), 400), ("999", 404)):
        answer = httpx.post(f"{base}/{bad}/promote", headers=auth)
        assert answer.status_code == status and set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_canary_verdicts_total{by="admin",policy="agent",verdict="promoted"} 1.0' in metrics
    assert 'tracetrain_canary_trials{policy="agent",state="promoted"} 1.0' in metrics


def put_on_trial_as(proxy: RunningProxy, version: int, tmp_path: Path, auth: dict[str, str]) -> dict[str, Any]:
    record_trained_adapter(proxy, version, tmp_path)
    get = lambda: httpx.get(f"{proxy.url}/admin/trials", headers=auth).json()["running"]  # noqa: E731
    return wait_for(lambda: (t := get()) is not None and t["candidate"] == version and t)


def test_metrics_show_the_running_trial(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    rng = random.Random(1)
    trial = put_on_trial(proxy, 1, tmp_path)
    for _ in range(4):
        play_group(proxy, lambda v: bernoulli(rng, 0.5))
    wait_for(lambda: (running(proxy)["verdict"] or {}).get("look", {}).get("n", 0) >= 3)
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'tracetrain_canary_candidate_version{policy="agent"} 1.0' in metrics
    assert 'tracetrain_canary_share{arm="candidate",policy="agent"}' in metrics
    assert 'tracetrain_canary_reward_mean{arm="baseline",bound="low",policy="agent"}' in metrics
    assert 'tracetrain_canary_difference{bound="mean",policy="agent"}' in metrics
    httpx.post(f"{proxy.url}/admin/trials/{trial['id']}/promote").raise_for_status()
    assert "tracetrain_canary_candidate_version{" not in httpx.get(f"{proxy.url}/metrics").text


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    from test_replicas import _pg_url

    return _pg_url()


def test_two_proxies_on_one_store_give_each_trajectory_one_version(
    start_proxy, fake: Any, tmp_path: Path, shared_store: str
) -> None:
    from fake_vllm import Reply

    a, b = (start_proxy(data_dir=tmp_path / name, database_url=shared_store, **CANARY) for name in ("a", "b"))
    assert [call(a, f"pre-{i}") for i in range(8)] == [0] * 8  # begun before the trial
    path = tmp_path / "adapters" / "agent" / "1"
    path.mkdir(parents=True)
    httpx.get(f"{a.url}/admin/adapters")  # the store exists: the trainer records into it
    _record_shared(shared_store, str(path))
    wait_for(lambda: running(a) is not None and running(b) is not None)
    time.sleep(1.5)  # each replica adopts the store's trial within a second

    served: dict[str, set[int]] = {}
    for i in range(24):
        first, other = (a, b) if i % 2 else (b, a)
        trajectory = f"both-{i}"
        served[trajectory] = {call(first, trajectory), call(other, trajectory), call(first, trajectory)}

    assert all(len(versions) == 1 for versions in served.values()), served
    assert Counter(v for versions in served.values() for v in versions).keys() == {0, 1}
    assert [call(b, f"pre-{i}") for i in range(8)] == [0] * 8  # the other replica keeps them on the baseline too
    # An unkeyed conversation keeps its version whichever replica takes its next call.
    for i in range(6):
        task = [{"role": "user", "content": f"Capital of country {i}?"}]
        fake.script(Reply("Lima."), Reply("Yes."))
        first = a.client().chat.completions.with_raw_response.create(model="agent", messages=task)
        turns = [*task, {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "Sure?"}]
        second = b.client().chat.completions.with_raw_response.create(model="agent", messages=turns)
        assert first.headers["x-trajectory-id"] == second.headers["x-trajectory-id"]
        assert first.headers["x-policy-version"] == second.headers["x-policy-version"]


def _record_shared(url: str, path: str) -> None:
    """The trainer records adapter 1 in the shared store."""
    if url.startswith("sqlite"):
        import sqlite3

        with sqlite3.connect(url.split("///", 1)[1]) as conn:
            conn.execute("INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
                         "VALUES ('agent', 1, ?, 'trained', '{}', ?)", (path, time.time()))  # fmt: skip
        return
    from test_postgres import sql

    sql(url, "INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
             "VALUES ('agent', 1, $1, 'trained', '{}', $2)", path, time.time())  # fmt: skip


def test_the_dashboard_shows_each_trial_and_ends_one_with_its_csrf_token(start_proxy, tmp_path: Path) -> None:
    from test_admin import ADMIN, BEARER, csrf_of, login

    proxy = start_proxy(admin_token=ADMIN, **CANARY)
    rng = random.Random(9)
    record_trained_adapter(proxy, 1, tmp_path)
    get = lambda: httpx.get(f"{proxy.url}/admin/trials", headers=BEARER).json()["running"]  # noqa: E731
    trial = wait_for(lambda: get())
    for _ in range(4):
        play_group(proxy, lambda v: bernoulli(rng, 0.5))
    wait_for(lambda: ((get() or {}).get("verdict") or {}).get("look", {}).get("n", 0) >= 3)
    with login(proxy) as client:
        page = client.get("/admin/ui/trials")
        assert page.status_code == 200 and 'id="trial-running"' in page.text
        assert "agent@1 against @0" in page.text and "paired groups" in page.text and "95%" in page.text
        assert client.get("/admin").text.count('id="trial"') == 1  # the overview names it too
        forged = client.post(f"/admin/ui/trials/{trial['id']}/roll-back", data={"csrf_token": "0" * 64})
        assert forged.status_code == 403 and get() is not None

        done = client.post(f"/admin/ui/trials/{trial['id']}/roll-back", data={"csrf_token": csrf_of(page.text)})

        assert done.status_code == 303 and done.headers["location"] == "/admin/ui/trials?notice=rolled_back&version=1"
        ended = client.get(done.headers["location"]).text
        assert "agent@1 is rolled back" in ended and "rolled back by an admin" in ended
        again = client.post(f"/admin/ui/trials/{trial['id']}/roll-back", data={"csrf_token": csrf_of(page.text)})
        assert again.status_code == 409 and "has ended already" in again.text


def test_a_trial_whose_baseline_the_guard_rolled_back_is_rolled_back_too(start_proxy, tmp_path: Path) -> None:
    proxy = start_proxy(**CANARY)
    first = put_on_trial(proxy, 1, tmp_path)
    httpx.post(f"{proxy.url}/admin/trials/{first['id']}/promote").raise_for_status()
    second = put_on_trial(proxy, 2, tmp_path)
    assert second["baseline"] == 1
    # The regression guard rolls @1 back (its store transaction, as store.Guards.roll_back writes it).
    proxy.rows("UPDATE policies SET active_version = 0, rolled_back_at = ?", time.time())
    proxy.rows("UPDATE adapters SET state = 'rolled_back' WHERE version = 1")

    ended = wait_for(lambda: (t := trials(proxy)["data"][0])["state"] != "running" and t)

    assert ended["id"] == second["id"] and ended["state"] == "rolled_back" and ended["decided_by"] == "alias"
    assert "from @1 to @0" in ended["reason"]
    assert adapters(proxy)["active_version"] == 0 and {call(proxy, f"t{i}") for i in range(8)} == {0}


def record_for(proxy: RunningProxy, policy: str, version: int, tmp_path: Path) -> None:
    """The trainer records ``policy``'s adapter ``version``."""
    path = tmp_path / "adapters" / policy / str(version)
    path.mkdir(parents=True)
    proxy.rows("INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
               "VALUES (?, ?, ?, 'trained', '{}', ?)", policy, version, str(path), time.time())  # fmt: skip


def test_a_trial_of_one_policy_leaves_another_policys_serving_untouched(
    start_proxy, fake: Any, tmp_path: Path
) -> None:
    # b tries no version (canary 0 overrides the server's) and serves b@2; a puts a@1 on trial against a@0.
    proxy = start_proxy(policies=("a", "b"), policy_configs={"b": {"canary": 0}}, **CANARY)
    record_for(proxy, "b", 1, tmp_path)
    wait_for(lambda: httpx.get(f"{proxy.url}/admin/adapters?policy=b").json()["active_version"] == 1)
    record_for(proxy, "b", 2, tmp_path)
    wait_for(lambda: httpx.get(f"{proxy.url}/admin/adapters?policy=b").json()["active_version"] == 2)
    record_for(proxy, "a", 1, tmp_path)
    trial = wait_for(lambda: httpx.get(f"{proxy.url}/admin/trials?policy=a").json()["running"])
    assert (trial["policy"], trial["candidate"], trial["baseline"]) == ("a", 1, 0)
    time.sleep(1.2)  # every sync since has adopted the trial

    served_a = [call(proxy, f"a-{i}", model="a") for i in range(24)]
    fake.requests.clear()
    served_b = [call(proxy, f"b-{i}", model="b") for i in range(24)]

    assert set(served_a) == {0, 1}  # a's new trajectories split between its two versions
    assert served_b == [2] * 24  # b's all go to b's alias, whatever a's split would draw for them
    assert {r["model"] for r in fake.requests} == {"b@2"}
    assert httpx.get(f"{proxy.url}/admin/trials?policy=b").json() | {"data": None} == {
        "object": "list", "policy": "b", "canary": {"fraction": None, "margin": 0.05, "alpha": 0.05, "max_groups": 6,
                                                     "max_minutes": 30.0},
        "running": None, "data": None,
    }  # fmt: skip
    listed = httpx.get(f"{proxy.url}/admin/trials").json()  # every policy's
    assert [t["policy"] for t in listed["data"]] == ["a"] and listed["running"] is None
    # Another policy's trial is a 404 for an admin who names b, as an unknown trial.
    named_b = httpx.post(f"{proxy.url}/admin/trials/{trial['id']}/promote?policy=b")
    assert named_b.status_code == 404 and named_b.json()["error"]["code"] == "trial_not_found"
    assert httpx.post(f"{proxy.url}/admin/trials/{trial['id']}/promote?policy=a").json()["state"] == "promoted"
    assert {call(proxy, f"b-late-{i}", model="b") for i in range(8)} == {2}
