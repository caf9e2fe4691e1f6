"""Which trajectory and group a call lands in: headers, path prefixes, threading, derived groups."""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall

from proxy.gateway import KeyHints

TASK = [{"role": "system", "content": "You answer capitals."}, {"role": "user", "content": "Capital of Peru?"}]


def trajectory(proxy: RunningProxy, trajectory_id: str) -> dict:
    response = httpx.get(f"{proxy.v1}/trajectories/{trajectory_id}")
    assert response.status_code == 200, response.text
    return response.json()


def test_headers_key_the_trajectory_and_group(proxy: RunningProxy) -> None:
    client = proxy.client(default_headers={"X-Trajectory-Id": "run-1", "X-Group-Id": "grp-a"})
    raw = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    assert (raw.headers["x-trajectory-id"], raw.headers["x-group-id"]) == ("run-1", "grp-a")
    client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "unrelated"}])
    stored = trajectory(proxy, "run-1")
    assert stored["group_id"] == "grp-a" and stored["keyed_by"] == "header" and stored["n_calls"] == 2


def test_path_prefix_keys_the_trajectory(proxy: RunningProxy) -> None:
    client = proxy.client(base_url=f"{proxy.url}/t/run-2/v1")
    raw = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    assert raw.headers["x-trajectory-id"] == "run-2"
    assert trajectory(proxy, "run-2")["keyed_by"] == "path"
    assert client.models.list().data[0].id == "agent"


def test_path_prefix_keys_group_and_trajectory(proxy: RunningProxy) -> None:
    client = proxy.client(base_url=f"{proxy.url}/g/grp-b/t/run-3/v1")
    raw = client.completions.with_raw_response.create(model="agent", prompt="hello")
    assert (raw.headers["x-trajectory-id"], raw.headers["x-group-id"]) == ("run-3", "grp-b")
    assert trajectory(proxy, "run-3")["group_id"] == "grp-b"


def test_header_wins_over_path_prefix(proxy: RunningProxy) -> None:
    client = proxy.client(base_url=f"{proxy.url}/t/from-path/v1", default_headers={"X-Trajectory-Id": "from-header"})
    raw = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    assert raw.headers["x-trajectory-id"] == "from-header"


def test_unkeyed_continuation_threads_into_the_same_trajectory(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client()
    fake.script(Reply(content="Lima."), Reply(content="About 10 million."))
    first = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    reply = first.parse().choices[0].message
    follow_up = [*TASK, reply.model_dump(exclude_none=True), {"role": "user", "content": "Population?"}]
    second = client.chat.completions.with_raw_response.create(model="agent", messages=follow_up)
    assert second.headers["x-trajectory-id"] == first.headers["x-trajectory-id"]
    stored = trajectory(proxy, first.headers["x-trajectory-id"])
    assert stored["keyed_by"] == "new" and stored["n_calls"] == 2


def test_threading_tolerates_reserialized_tool_calls(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client()
    fake.script(Reply(tool_calls=[ToolCall("lookup", '{"country": "Peru", "field": "capital"}')]))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    first = client.chat.completions.with_raw_response.create(model="agent", messages=TASK, tools=tools)
    assert first.parse().choices[0].message.tool_calls
    # A framework re-serializes the arguments and drops fields the proxy never compares.
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_rewritten",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"field":"capital","country":"Peru"}'},
            }
        ],
    }
    follow_up = [*TASK, echoed, {"role": "tool", "tool_call_id": "call_rewritten", "content": "Lima"}]
    second = client.chat.completions.with_raw_response.create(model="agent", messages=follow_up, tools=tools)
    assert second.headers["x-trajectory-id"] == first.headers["x-trajectory-id"]


def test_streamed_reply_threads_too(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client()
    fake.script(Reply(content="Lima."))
    with client.chat.completions.with_streaming_response.create(model="agent", messages=TASK, stream=True) as r:
        first_id = r.headers["x-trajectory-id"]
        text = "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices)
    follow_up = [*TASK, {"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
    second = client.chat.completions.with_raw_response.create(model="agent", messages=follow_up)
    assert second.headers["x-trajectory-id"] == first_id


def test_a_changed_history_starts_a_new_trajectory(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client()
    fake.script(Reply(content="Lima."))
    first = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    edited = [*TASK, {"role": "assistant", "content": "Cusco."}, {"role": "user", "content": "Sure?"}]
    second = client.chat.completions.with_raw_response.create(model="agent", messages=edited)
    assert second.headers["x-trajectory-id"] != first.headers["x-trajectory-id"]


def test_a_rewarded_trajectory_takes_no_continuation(proxy: RunningProxy, fake: FakeVLLM) -> None:
    client = proxy.client()
    fake.script(Reply(content="Lima."))
    first = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    httpx.post(f"{proxy.v1}/rewards", json={"trajectory_id": first.headers["x-trajectory-id"], "reward": 1.0})
    follow_up = [*TASK, {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "Sure?"}]
    second = client.chat.completions.with_raw_response.create(model="agent", messages=follow_up)
    assert second.headers["x-trajectory-id"] != first.headers["x-trajectory-id"]


def test_the_same_task_asked_again_forms_one_derived_group(proxy: RunningProxy) -> None:
    client = proxy.client()
    groups = set()
    trajectories = set()
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
        groups.add(raw.headers["x-group-id"])
        trajectories.add(raw.headers["x-trajectory-id"])
    other = client.chat.completions.with_raw_response.create(
        model="agent", messages=[TASK[0], {"role": "user", "content": "Capital of Chile?"}]
    )
    assert len(groups) == 1 and len(trajectories) == 3
    assert other.headers["x-group-id"] not in groups


def test_later_turns_do_not_change_the_derived_group(proxy: RunningProxy) -> None:
    client = proxy.client()
    a = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    longer = [*TASK, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "again"}]
    b = client.chat.completions.with_raw_response.create(model="agent", messages=longer)
    assert a.headers["x-trajectory-id"] != b.headers["x-trajectory-id"]
    assert a.headers["x-group-id"] == b.headers["x-group-id"]


def test_a_full_derived_group_opens_the_next_one(start_proxy) -> None:
    proxy = start_proxy(group_size=2)
    client = proxy.client()
    groups = [
        client.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers["x-group-id"]
        for _ in range(5)
    ]
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4]


def test_header_keyed_trajectory_without_group_gets_the_derived_group(proxy: RunningProxy) -> None:
    a = proxy.client(default_headers={"X-Trajectory-Id": "a1"}).chat.completions.with_raw_response.create(
        model="agent", messages=TASK
    )
    b = proxy.client(default_headers={"X-Trajectory-Id": "b1"}).chat.completions.with_raw_response.create(
        model="agent", messages=TASK
    )
    assert a.headers["x-group-id"] == b.headers["x-group-id"]


def test_invalid_trajectory_id_is_rejected_in_openai_shape(proxy: RunningProxy) -> None:
    response = httpx.post(
        f"{proxy.v1}/chat/completions",
        headers={"X-Trajectory-Id": "bad id <script>"},
        json={"model": "agent", "messages": TASK},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-Trajectory-Id"


async def test_a_call_the_store_cannot_key_is_not_answered_and_says_why(fake: FakeVLLM, tmp_path: Path) -> None:
    """A call whose seat cannot be written is not answered: the store's 503 in OpenAI's shape, not a 500."""
    from proxy.errors import StoreUnavailable as ProxyStoreUnavailable
    from proxy.gateway._forward import Forwarder
    from proxy.gateway._keying import Conversation, Key
    from proxy.gateway._policies import PolicyRegistry
    from proxy.gateway.upstream._client import Upstream
    from proxy.observability._metrics import Metrics
    from store import Store, StoreUnavailable

    class BrokenStore:
        async def resolve(self, policy: str, hints: KeyHints, conversation: Conversation, **_: bool) -> Key:
            raise StoreUnavailable("could not write to the store: disk I/O error")

    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    async with httpx.AsyncClient() as control:
        upstream = Upstream(f"{fake.url}/v1", [control], timeout_s=30.0)  # type: ignore[attr-defined]
        forwarder = Forwarder(upstream, store, BrokenStore(), PolicyRegistry.of("agent"), Metrics())  # type: ignore[arg-type]
        for hints in (KeyHints(header_trajectory="run-8"), KeyHints()):
            with pytest.raises(ProxyStoreUnavailable) as raised:
                await forwarder.handle("chat.completions", orjson.dumps({"model": "agent", "messages": TASK}), hints)
            assert raised.value.status_code == 503 and "disk I/O error" in raised.value.message
        upstream.close()
    await store.close()
    conn = sqlite3.connect(tmp_path / "tt.db")
    assert conn.execute("SELECT count(*) FROM calls").fetchall() == [(0,)]
    conn.close()


@pytest.fixture
def seat_commits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The trajectory ids the writer seats in transactions of their own (``seat_all_sqlite``), in order."""
    import store._writer as writer

    seated: list[str] = []
    seat_all = writer.seat_all_sqlite

    def seating(conn, seats):  # type: ignore[no-untyped-def]
        seated.extend(seat.trajectory_id for seat in seats)
        return seat_all(conn, seats)

    monkeypatch.setattr(writer, "seat_all_sqlite", seating)
    return seated


def test_a_lone_calls_new_trajectory_is_seated_in_its_record_and_a_streams_before_its_first_byte(
    proxy: RunningProxy, seat_commits: list[str]
) -> None:
    """One commit for a non-streamed call's seat and record; a stream tells its group in its first bytes,
    so it is seated on its own, while vLLM starts on the call."""
    client = proxy.client()
    plain = client.chat.completions.with_raw_response.create(model="agent", messages=TASK)
    with client.chat.completions.with_streaming_response.create(model="agent", messages=TASK, stream=True) as stream:
        streamed = {"trajectory": stream.headers["x-trajectory-id"], "group": stream.headers["x-group-id"]}
        list(stream.iter_lines())
    assert seat_commits == [streamed["trajectory"]]
    group = plain.headers["x-group-id"]
    assert group.startswith("grp-") and streamed["group"] == group  # the same task: one derived group
    rows = proxy.rows("SELECT id, group_id FROM trajectories")
    expected = {plain.headers["x-trajectory-id"]: group, streamed["trajectory"]: group}
    assert {r["id"]: r["group_id"] for r in rows} == expected
    assert [r["group_id"] for r in proxy.rows("SELECT group_id FROM calls")] == [group, group]


async def test_a_lone_stream_is_sent_upstream_before_its_seat_and_closed_if_the_seat_fails(
    fake: FakeVLLM, tmp_path: Path
) -> None:
    """The seat's commit overlaps vLLM's start; a seat that fails answers 503 and hangs up on vLLM."""
    from proxy.errors import StoreUnavailable as ProxyStoreUnavailable
    from proxy.gateway._forward import Forwarder
    from proxy.gateway._keying import Key, Keyer
    from proxy.gateway._policies import PolicyRegistry
    from proxy.gateway.upstream._client import Upstream
    from proxy.observability._metrics import Metrics
    from store import Store, StoreUnavailable

    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'tt.db'}")
    requests_sent_at_seat: list[int] = []

    class WatchedKeyer(Keyer):
        fail = False

        async def seat(self, policy: str, key: Key, *, alone: bool) -> Key:
            requests_sent_at_seat.append(sum(c._busy for c in upstream._generation._open))
            if self.fail:
                raise StoreUnavailable("could not write to the store: disk I/O error")
            return await super().seat(policy, key, alone=alone)

    fake.token_delay_s = 0.05
    fake.script(Reply(content="warm"), Reply(content="seated"), Reply(content=" ".join(f"w{i}" for i in range(40))))
    async with httpx.AsyncClient() as control:
        upstream = Upstream(f"{fake.url}/v1", [control], timeout_s=30.0)  # type: ignore[attr-defined]
        keyer = WatchedKeyer(store, group_size=8, thread_ttl_s=60)
        forwarder = Forwarder(upstream, store, keyer, PolicyRegistry.of("agent"), Metrics())
        body = orjson.dumps({"model": "agent", "messages": TASK, "stream": True})
        for name in ("warm", "seated"):  # the first opens the kept connection the second's request leaves on
            response = await forwarder.handle("chat.completions", body, KeyHints(header_trajectory=name))
            assert response.headers["x-group-id"].startswith("grp-")
            async for _ in response.body_iterator:  # type: ignore[attr-defined]
                pass
            await response._relay.finish()  # type: ignore[attr-defined]  # as RelayResponse does: the connection is kept
            response._relay.close()  # type: ignore[attr-defined]
        keyer.fail = True
        with pytest.raises(ProxyStoreUnavailable):
            await forwarder.handle("chat.completions", body, KeyHints(header_trajectory="unseated"))
        for _ in range(100):
            if fake.disconnected_streams:
                break
            await asyncio.sleep(0.05)
        in_flight = [server.in_flight for server in forwarder._router.servers]
        upstream.close()
    await store.close()
    assert requests_sent_at_seat[1:] == [1, 1]  # the request was upstream when the seat began
    assert fake.disconnected_streams == 1 and in_flight == [0]
    conn = sqlite3.connect(tmp_path / "tt.db")
    assert conn.execute("SELECT trajectory_id FROM calls ORDER BY pk").fetchall() == [("warm",), ("seated",)]
    conn.close()


def test_concurrent_calls_new_trajectories_are_seated_in_their_records(
    proxy: RunningProxy, fake: FakeVLLM, seat_commits: list[str]
) -> None:
    """Not only a lone call: each non-streamed call's seat is taken in its record's transaction (no commit of its
    own), and calls of one task still fill one derived group."""
    fake.script(*[Reply(content="Lima.", delay_s=0.3) for _ in range(4)])  # all four in flight at once
    client = proxy.client()

    def ask(_: int) -> httpx.Headers:
        return client.chat.completions.with_raw_response.create(model="agent", messages=TASK).headers

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert seat_commits == []
    groups = {headers["x-group-id"] for headers in answers}
    assert len(groups) == 1 and next(iter(groups)).startswith("grp-")
    rows = proxy.rows("SELECT id, group_id FROM trajectories")
    assert {r["id"]: r["group_id"] for r in rows} == {h["x-trajectory-id"]: h["x-group-id"] for h in answers}
