"""Several vLLM servers behind one proxy: stickiness by hash, the load bound, failover, restore, data parallel.

Two fake vLLM servers on loopback; the real proxy routes over both (``proxy.gateway.upstream._router``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, serve_in_thread
from test_publishing import adapters, record_trained_adapter, wait_for

from proxy import Settings
from proxy.gateway.upstream._placement import score, server_salt


class Server:
    """A fake vLLM on a fixed port that can be killed and started again (as a fresh process would be)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.fake = FakeVLLM(emit_eos=True)
        self._stack: ExitStack | None = None

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def start(self, fake: FakeVLLM | None = None) -> None:
        self.fake = fake or self.fake
        self._stack = ExitStack()
        self._stack.enter_context(serve_in_thread(self.fake.app, port=self.port))

    def kill(self) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    def trajectories(self) -> set[str]:
        """The trajectories whose calls reached this server (each test message starts with its id)."""
        return {str(body["messages"][-1]["content"]).split()[0] for body in self.fake.requests}


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    pair = (Server(), Server())
    for server in pair:
        server.start()
    yield pair
    for server in pair:
        if server._stack is not None:
            server.kill()


@pytest.fixture
def two(start_proxy: Callable[..., RunningProxy], servers: tuple[Server, Server]) -> RunningProxy:
    return start_proxy(upstreams=(servers[0].v1, servers[1].v1), health_check_s=0.1)


def call(proxy: RunningProxy, trajectory: str, turn: int = 0, model: str = "agent") -> Any:
    return proxy.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"{trajectory} turn {turn}"}],
        extra_headers={"X-Trajectory-Id": trajectory},
    )


def states(proxy: RunningProxy) -> dict[str, str]:
    return {u["url"]: u["state"] for u in httpx.get(f"{proxy.url}/admin/overview").json()["upstreams"]}


def ranked(trajectory: str, servers: Sequence[Server]) -> list[Server]:
    """The servers in the trajectory's own order (``proxy.gateway.upstream._placement``: its hash, load aside)."""
    return sorted(servers, key=lambda s: score(trajectory, server_salt(s.v1)), reverse=True)


def spread(prefix: str, servers: Sequence[Server], each: int) -> list[str]:
    """Trajectory ids, ``each`` of them ranking each server first (ports are random: the hash is not)."""
    ids = (f"{prefix}{i}" for i in range(10_000))
    by_server: dict[int, list[str]] = {id(s): [] for s in servers}
    for trajectory in ids:
        mine = by_server[id(ranked(trajectory, servers)[0])]
        if len(mine) < each:
            mine.append(trajectory)
        if all(len(found) == each for found in by_server.values()):
            break
    return [t for pair in zip(*by_server.values(), strict=True) for t in pair]


def test_calls_of_one_trajectory_stay_on_the_first_server_of_its_ranking(
    two: RunningProxy, servers: tuple[Server, Server]
) -> None:
    trajectories = [f"t{i}" for i in range(20)]
    for turn in range(3):
        for trajectory in trajectories:
            call(two, trajectory, turn)
    for server in servers:
        assert server.trajectories() == {t for t in trajectories if ranked(t, servers)[0] is server}
    assert all(server.trajectories() for server in servers), "the hash spreads new trajectories over both"
    assert len(servers[0].fake.requests) + len(servers[1].fake.requests) == 60


def test_a_new_trajectory_whose_server_is_over_its_load_bound_goes_to_the_next_of_its_ranking(
    two: RunningProxy, servers: tuple[Server, Server]
) -> None:
    busy, idle = servers
    for server in servers:
        server.fake.token_delay_s = 0.1
    slow = [t for t in (f"slow{i}" for i in range(60)) if ranked(t, servers)[0] is busy][:3]
    # Three calls in flight on one server, none on the other: the bound is ceil(1.5 * (3 + 1) / 2) = 3.
    streams = [
        two.client().chat.completions.create(
            model="agent",
            messages=[{"role": "user", "content": f"{t} " + "word " * 30}],
            extra_headers={"X-Trajectory-Id": t},
            stream=True,
        )
        for t in slow
    ]
    wait_for(lambda: set(slow) <= busy.trajectories())
    new = [t for t in (f"n{i}" for i in range(40)) if ranked(t, servers)[0] is busy][:3]
    for trajectory in new:
        call(two, trajectory)
    assert set(new) <= idle.trajectories() and not set(new) & busy.trajectories()
    in_flight = {u["url"]: u["in_flight"] for u in httpx.get(f"{two.url}/admin/overview").json()["upstreams"]}
    assert in_flight == {busy.v1: 3, idle.v1: 0}
    for stream in streams:
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert wait_for(
        lambda: all(u["in_flight"] == 0 for u in httpx.get(f"{two.url}/admin/overview").json()["upstreams"])
    )
    busy.fake.token_delay_s = 0.0
    call(two, new[0], 1)  # the load is gone: the trajectory's calls go to its own server again
    assert new[0] in busy.trajectories()


def test_calls_for_a_killed_server_go_to_the_other_with_no_client_failure(
    start_proxy: Callable[..., RunningProxy], servers: tuple[Server, Server]
) -> None:
    # No health check after the first: the refused connections alone take the server out.
    proxy = start_proxy(upstreams=(servers[0].v1, servers[1].v1), health_check_s=3600)
    trajectories = spread("k", servers, 3)
    for trajectory in trajectories:
        call(proxy, trajectory)
    dead, alive = servers
    moved = dead.trajectories()
    assert len(moved) == 3
    dead.kill()
    before = len(alive.fake.requests)
    for trajectory in trajectories:  # every one answered, those of the dead server by the other
        assert call(proxy, trajectory, 1).choices[0].message.content == f"echo: {trajectory} turn 1"
    assert len(alive.fake.requests) - before == len(trajectories)
    stream = proxy.client().chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "s1 stream"}],
        stream=True,
        extra_headers={"X-Trajectory-Id": sorted(moved)[0]},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "echo: s1 stream"
    assert states(proxy) == {dead.v1: "down", alive.v1: "serving"}
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert f'tracetrain_upstream_up{{upstream="{dead.v1}"}} 0.0' in metrics
    assert f'tracetrain_upstream_failovers{{upstream="{dead.v1}"}} 1.0' in metrics  # then it was out of rotation
    statuses = [row[0] for row in proxy.rows("SELECT status_code FROM calls")]
    assert statuses == [200] * 13


def test_a_server_back_gets_every_published_adapter_before_it_takes_traffic(
    two: RunningProxy, servers: tuple[Server, Server], tmp_path: Path
) -> None:
    first, second = servers
    record_trained_adapter(two, 1, tmp_path)
    wait_for(lambda: adapters(two)["active_version"] == 1)
    assert set(first.fake.loras) == set(second.fake.loras) == {"agent@1"}
    second.kill()
    wait_for(lambda: states(two)[second.v1] == "down")
    record_trained_adapter(two, 2, tmp_path)
    wait_for(lambda: adapters(two)["active_version"] == 2)  # published on the server in rotation alone
    assert set(first.fake.loras) == {"agent@1", "agent@2"}

    restarted = FakeVLLM(emit_eos=True)  # a new process: no adapter loaded
    seen: list[tuple[str, set[str]]] = []

    def note(body: dict[str, Any]) -> None:
        seen.append((body["model"], set(restarted.loras)))

    restarted.reply_for = lambda body: note(body)  # type: ignore[func-returns-value]
    second.start(restarted)
    wait_for(lambda: states(two)[second.v1] == "serving")
    assert set(restarted.loras) == {"agent@1", "agent@2"}
    for trajectory in spread("r", servers, 4):
        call(two, trajectory)
    assert seen, "the server back in rotation took no traffic"
    assert all(model in loaded for model, loaded in seen), seen
    views = {u["url"]: u["versions"] for u in httpx.get(f"{two.url}/admin/overview").json()["upstreams"]}
    assert views == {first.v1: ["agent@1", "agent@2"], second.v1: ["agent@1", "agent@2"]}
    metrics = httpx.get(f"{two.url}/metrics").text
    assert f'tracetrain_upstream_version_loaded{{policy="agent",upstream="{second.v1}",version="2"}} 1.0' in metrics


def test_the_alias_flips_only_once_both_servers_hold_the_adapter(
    two: RunningProxy, servers: tuple[Server, Server], tmp_path: Path
) -> None:
    first, second = servers
    active_when_loaded: list[int] = []
    inner = second.fake.app

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/load_lora_adapter":
            # Asked from another thread: the proxy's alias at the moment this server is asked to load.
            got: list[int] = []
            thread = threading.Thread(target=lambda: got.append(adapters(two)["active_version"]))
            thread.start()
            thread.join()
            active_when_loaded.extend(got)
        await inner(scope, receive, send)

    second.fake.app = watching  # type: ignore[assignment]
    second.kill()
    second.start()
    wait_for(lambda: states(two)[second.v1] == "serving")
    record_trained_adapter(two, 1, tmp_path)
    wait_for(lambda: adapters(two)["active_version"] == 1)
    assert active_when_loaded == [0]
    assert set(first.fake.loras) == set(second.fake.loras) == {"agent@1"}

    second.fake.fail_next_load = "Loading lora agent@2 failed: No adapter found for <path>"
    record_trained_adapter(two, 2, tmp_path)
    wait_for(lambda: [a for a in adapters(two)["data"] if a["state"] == "failed"])
    assert adapters(two)["active_version"] == 1
    assert "agent@2" not in first.fake.loras, "a server kept a version the other could not load"


def test_a_server_killed_while_loading_leaves_the_rotation_and_the_adapter_is_published_on_the_others(
    two: RunningProxy, servers: tuple[Server, Server], tmp_path: Path
) -> None:
    first, second = servers
    asked = threading.Event()
    inner = second.fake.app

    async def hanging(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/load_lora_adapter":
            asked.set()
            while True:  # until the kill: uvicorn's shutdown cancels it and answers 500
                await asyncio.sleep(0.01)
        await inner(scope, receive, send)

    second.fake.app = hanging  # type: ignore[assignment]
    second.kill()
    second.start()
    wait_for(lambda: states(two)[second.v1] == "serving")
    record_trained_adapter(two, 1, tmp_path)
    assert asked.wait(10) and adapters(two)["active_version"] == 0
    second.kill()
    wait_for(lambda: adapters(two)["active_version"] == 1)
    assert set(first.fake.loras) == {"agent@1"} and states(two) == {first.v1: "serving", second.v1: "down"}
    (adapter,) = adapters(two)["data"]
    assert adapter["state"] == "published"
    assert [call(two, f"m{i}").model for i in range(3)] == ["agent@1"] * 3


def test_a_data_parallel_vllm_is_refused_and_says_why(
    start_proxy: Callable[..., RunningProxy], servers: tuple[Server, Server]
) -> None:
    plain, parallel = servers
    parallel.fake.data_parallel_size = 2
    proxy = start_proxy(upstreams=(plain.v1, parallel.v1), health_check_s=0.1)
    for i in range(4):
        call(proxy, f"d{i}")
    assert not parallel.fake.requests
    (view,) = [u for u in httpx.get(f"{proxy.url}/admin/overview").json()["upstreams"] if u["url"] == parallel.v1]
    assert view["state"] == "refused" and "data parallel (2 engines" in view["problem"]
    assert httpx.get(f"{proxy.url}/readyz").status_code == 200  # the other server serves
    assert f'tracetrain_upstream_state{{state="refused",upstream="{parallel.v1}"}} 1.0' in (
        httpx.get(f"{proxy.url}/metrics").text
    )

    alone = start_proxy(upstreams=(parallel.v1,), data_dir=proxy.settings.data_dir.parent / "alone")
    answer = httpx.post(
        f"{alone.v1}/chat/completions", json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert answer.status_code == 503 and "--data-parallel-size" in answer.json()["error"]["message"]
    assert httpx.get(f"{alone.url}/readyz").status_code == 503


def test_upstreams_come_from_repeated_flags_or_one_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRACETRAIN_UPSTREAMS", "http://a:8000/v1, http://b:8000/v1/")
    assert Settings(data_dir=tmp_path).upstreams == ("http://a:8000/v1", "http://b:8000/v1")
    assert Settings(data_dir=tmp_path, upstream="http://c:8000/v1").upstreams == ("http://c:8000/v1",)
    monkeypatch.delenv("TRACETRAIN_UPSTREAMS")
    monkeypatch.setenv("TRACETRAIN_UPSTREAM", "http://d:8000/v1")
    assert Settings(data_dir=tmp_path).upstream == "http://d:8000/v1"
    with pytest.raises(ValueError, match="named twice"):
        Settings(upstreams=("http://a/v1", "http://a/v1/"))
    with pytest.raises(ValueError, match="http"):
        Settings(upstreams=("http://a/v1", "a:8000"))


def test_serve_refuses_the_removed_replica_flag_and_says_what_replaces_it(capsys: pytest.CaptureFixture[str]) -> None:
    from tracetrain_cli._main import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--upstream", "http://127.0.0.1:9/v1", "--replica", "http://127.0.0.1:10/v1", "--no-train"])
    assert "--replica was removed" in str(stopped.value) and "--upstream (repeatable)" in str(stopped.value)
