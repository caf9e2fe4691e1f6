"""Several proxies behind a round-robin balancer: a trajectory's calls reach one vLLM server whichever proxy
takes them, and move together when that server dies.

Two real proxies (each with a store of its own: routing shares nothing) route over the same fake vLLM
servers; each trajectory's turns alternate between the proxies, as a round-robin balancer hands them out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningProxy
from test_publishing import wait_for
from test_router import Server, ranked, spread, states


def start_servers(n: int) -> list[Server]:
    started = [Server() for _ in range(n)]
    for server in started:
        server.start()
    return started


@pytest.fixture
def three() -> Iterator[list[Server]]:
    started = start_servers(3)
    yield started
    for server in started:
        if server._stack is not None:
            server.kill()


def proxies_over(start_proxy: Callable[..., RunningProxy], servers: list[Server], tmp_path: Path) -> list[RunningProxy]:
    upstreams = tuple(s.v1 for s in servers)
    started = [start_proxy(upstreams=upstreams, health_check_s=0.1, data_dir=tmp_path / n) for n in ("a", "b")]
    wait_for(lambda: all(set(states(p).values()) == {"serving"} for p in started))
    return started


def turn(proxy: RunningProxy, trajectory: str, n: int) -> Any:
    """One turn of a multi-turn agent: its history so far and a new user message."""
    history: list[Any] = []
    for k in range(n):
        history += [{"role": "user", "content": f"{trajectory} turn {k}"},
                    {"role": "assistant", "content": f"echo: {trajectory} turn {k}"}]  # fmt: skip
    return proxy.client().chat.completions.create(
        model="agent",
        messages=[*history, {"role": "user", "content": f"{trajectory} turn {n}"}],
        extra_headers={"X-Trajectory-Id": trajectory},
    )


def served(servers: list[Server]) -> dict[tuple[str, int], Server]:
    """Which server answered each (trajectory, turn): the last message of each request names both."""
    where: dict[tuple[str, int], Server] = {}
    for server in servers:
        for body in server.fake.requests:
            trajectory, _, n = str(body["messages"][-1]["content"]).split()
            assert (trajectory, int(n)) not in where, "a turn was sent twice"
            where[trajectory, int(n)] = server
    return where


def test_each_trajectory_stays_on_one_server_while_its_turns_alternate_between_two_proxies(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    servers = start_servers(2)
    try:
        proxies = proxies_over(start_proxy, servers, tmp_path)
        trajectories = [f"agent{i}" for i in range(20)]
        for n in range(4):
            for i, trajectory in enumerate(trajectories):
                reply = turn(proxies[(i + n) % 2], trajectory, n)  # A, B, A, B... (or B, A, ...)
                assert reply.choices[0].message.content == f"echo: {trajectory} turn {n}"
        where = served(servers)
        assert len(where) == 80
        for trajectory in trajectories:
            homes = {where[trajectory, n] for n in range(4)}
            assert homes == {ranked(trajectory, servers)[0]}, f"{trajectory}'s turns were split over servers"
        assert all(s.trajectories() for s in servers), "the hash spreads the trajectories over both servers"
    finally:
        for server in servers:
            server.kill()


def test_a_dead_servers_trajectories_move_together_to_one_survivor_whichever_proxy_takes_each_turn(
    start_proxy: Callable[..., RunningProxy], three: list[Server], tmp_path: Path
) -> None:
    proxies = proxies_over(start_proxy, three, tmp_path)
    trajectories = spread("run", three, 6)
    for n in range(2):
        for i, trajectory in enumerate(trajectories):
            turn(proxies[(i + n) % 2], trajectory, n)
    dead = three[0]
    affected = {t for t in trajectories if ranked(t, three)[0] is dead}
    assert len(affected) == 6 and dead.trajectories() == affected
    dead.kill()
    for n in range(2, 6):
        for i, trajectory in enumerate(trajectories):  # the first calls after the kill find it refusing
            reply = turn(proxies[(i + n) % 2], trajectory, n)
            assert reply.choices[0].message.content == f"echo: {trajectory} turn {n}"
    where = served(three)
    survivors = three[1:]
    for trajectory in trajectories:
        before = {where[trajectory, n] for n in range(2)}
        after = {where[trajectory, n] for n in range(2, 6)}
        assert before == {ranked(trajectory, three)[0]}
        if trajectory in affected:  # all later turns on the next server of its own ranking, via either proxy
            assert after == {ranked(trajectory, survivors)[0]}, f"{trajectory} moved to {len(after)} servers"
        else:  # the others stay where their cache is
            assert after == before
    for proxy in proxies:
        assert states(proxy)[dead.v1] == "down"
