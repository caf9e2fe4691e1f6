"""A cluster on loopback: PostgreSQL, two vLLM servers (the fake), two proxies, one trainer.

Every part is real but vLLM: two proxies (``create_app`` under uvicorn), each routing over both
fake vLLM servers, share one PostgreSQL database; the real OpenAI client sends the agent's
traffic through both; rewards go in through both; the real trainer ``Worker`` (the tiny model,
its embedding padded so the fake's token ids fit) claims the job from the store and trains on
the tokens the proxies captured. Each fake notes, when asked to load an adapter, what the alias
in the store says at that moment, so the test sees every server load ``agent@N`` before the
flip. In the second step one server hangs on its load and is killed there: calls sent after the
kill all succeed, and the adapter is still published on the server left.

Needs TRACETRAIN_TEST_POSTGRES_URL (a database it may wipe), like tests/test_replicas.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from fake_vllm_text import TOKEN_ID_LIMIT
from test_postgres import _dsn, sql
from test_publishing import wait_for
from test_replicas import _pg_url
from test_router import Server, spread

GROUP_SIZE = 4


@dataclass
class Loads:
    """A fake vLLM's app, wrapped: each adapter load is noted with the alias the store had meanwhile.

    ``hold`` names an adapter whose load hangs (the server answers everything else) until the
    server is killed; ``holding`` is set once such a load arrived.
    """

    server: Server
    pg_url: str
    seen: list[tuple[str, int]] = field(default_factory=list)  # (adapter, the store's alias when it was asked)
    hold: str | None = None
    holding: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        inner = self.server.fake.app

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/v1/load_lora_adapter":
                messages = [await receive()]
                while messages[-1].get("more_body"):
                    messages.append(await receive())
                name = str(orjson.loads(b"".join(m.get("body", b"") for m in messages))["lora_name"])
                self.seen.append((name, await self._alias()))
                if name == self.hold:
                    self.holding.set()
                    while True:  # until the kill: uvicorn's shutdown cancels this request and answers 500
                        await asyncio.sleep(0.01)

                async def replay() -> Any:
                    return messages.pop(0) if messages else await receive()

                await inner(scope, replay, send)
                return
            await inner(scope, receive, send)

        self.server.fake.app = app  # type: ignore[assignment]

    async def _alias(self) -> int:
        conn = await asyncpg.connect(_dsn(self.pg_url))
        try:
            return int(await conn.fetchval("SELECT active_version FROM policies WHERE name = 'agent'"))
        finally:
            await conn.close()


@pytest.fixture
def wide_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an embedding as wide as the fake vLLM's token ids."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama-wide", vocab_size=TOKEN_ID_LIMIT)


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    pair = (Server(), Server())
    yield pair
    for server in pair:
        if server._stack is not None:
            server.kill()


def alias(proxy: RunningProxy) -> int:
    return int(httpx.get(f"{proxy.url}/admin/adapters").json()["active_version"])


def upstream_states(proxy: RunningProxy) -> dict[str, str]:
    return {u["url"]: u["state"] for u in httpx.get(f"{proxy.url}/admin/overview").json()["upstreams"]}


def play_group(proxies: list[RunningProxy], servers: tuple[Server, Server], group: str, turns: int) -> list[str]:
    """One group of GROUP_SIZE attempts, its trajectories alternating between the proxies; each of ``turns`` calls.

    Half of the trajectories hash to each server first (``proxy.gateway.upstream._placement``).
    """
    ids = []
    for i, trajectory in enumerate(spread(f"{group}-t", servers, GROUP_SIZE // 2)):
        client = proxies[i % 2].client()
        messages: list[Any] = [{"role": "user", "content": f"{trajectory} task"}]
        for turn in range(turns):
            reply = client.chat.completions.create(
                model="agent", messages=messages,
                extra_headers={"X-Trajectory-Id": trajectory, "X-Group-Id": group},
            )  # fmt: skip
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"{trajectory} turn {turn + 1}"}]  # fmt: skip
        ids.append(trajectory)
    return ids


def reward(proxies: list[RunningProxy], trajectories: list[str]) -> None:
    """Rewards with spread in each group, half posted through each proxy."""
    scores = [{"trajectory_id": t, "reward": [1.0, 0.0, 0.5, 0.25][i % GROUP_SIZE]} for i, t in enumerate(trajectories)]
    for k, proxy in enumerate(proxies):
        httpx.post(f"{proxy.v1}/rewards", json={"rewards": scores[k::2]}).raise_for_status()


def queued_job(proxy: RunningProxy, groups: list[str]) -> bool:
    jobs = httpx.get(f"{proxy.url}/admin/jobs").json()["data"]
    return any(j["state"] == "queued" and sorted(j["group_ids"]) == sorted(groups) for j in jobs)


@pytest.fixture
def pg_url() -> str:
    """The wiped PostgreSQL database (asked first, so the test skips before building the model)."""
    return _pg_url()


def test_two_proxies_two_vllm_servers_and_a_trainer_on_one_postgres(
    pg_url: str,
    start_proxy: Callable[..., RunningProxy],
    servers: tuple[Server, Server],
    wide_tiny_model: Path,
    tmp_path: Path,
) -> None:
    from trainer import TrainConfig
    from trainer._worker import Worker, WorkerSettings

    first, second = servers
    loads = [Loads(server, pg_url) for server in servers]
    for server in servers:
        server.start()
    options: dict[str, Any] = {"database_url": pg_url, "upstreams": (first.v1, second.v1), "health_check_s": 0.1,
                               "group_size": GROUP_SIZE, "min_group_size": GROUP_SIZE, "batch_groups": 2}  # fmt: skip
    proxies = [start_proxy(data_dir=tmp_path / name, **options) for name in ("proxy-a", "proxy-b")]
    wait_for(lambda: all(set(upstream_states(p).values()) == {"serving"} for p in proxies))
    settings = WorkerSettings(database_url=pg_url, data_dir=tmp_path / "trainer", policies=("agent",),
                              base_model=wide_tiny_model,
                              config=TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-3, dtype="float32"),
                              poll_s=0.05)  # fmt: skip
    with asyncio.Runner() as runner:
        worker = runner.run(Worker.open(settings))
        try:
            # -- step 1: traffic through both proxies, over both servers; rewards; a step; both servers load it
            trajectories = [t for g in ("g1", "g2") for t in play_group(proxies, servers, g, turns=2)]
            assert first.trajectories() and second.trajectories(), "one server took no traffic"
            sizes = {g["id"]: g["size"] for g in httpx.get(f"{proxies[1].v1}/groups").json()["data"]}
            assert sizes == {"g1": GROUP_SIZE, "g2": GROUP_SIZE}  # each group whole, though split over the proxies
            reward(proxies, trajectories)
            wait_for(lambda: queued_job(proxies[0], ["g1", "g2"]))
            assert runner.run(worker.run(once=True)) == 1
            (job,) = sql(pg_url, "SELECT state, version, error, metrics FROM training_jobs")
            assert (job["state"], job["version"], job["error"]) == ("succeeded", 1, None)
            m = orjson.loads(job["metrics"]) if isinstance(job["metrics"], str) else job["metrics"]
            # Learned from the captured tokens: each trajectory's two calls, one extending the other, one sample.
            assert (m["trajectories"], m["samples_calls"], m["samples"], m["samples_mismatched"]) == (8, 16, 8, 0)
            assert m["loss_tokens"] > 0 and not m["step_skipped"]
            wait_for(lambda: all(alias(p) == 1 for p in proxies))
            for watched in loads:  # each server was asked once, while the alias still named the base
                assert watched.seen == [("agent@1", 0)], watched.seen
                assert set(watched.server.fake.loras) == {"agent@1"}
            before = [len(s.fake.requests) for s in servers]
            for k, proxy in enumerate(proxies):  # both proxies serve it, from both servers
                for trajectory in spread(f"after-{k}-", servers, 2):
                    raw = proxy.client().chat.completions.with_raw_response.create(
                        model="agent", messages=[{"role": "user", "content": f"after step {trajectory}"}],
                        extra_headers={"X-Trajectory-Id": trajectory},
                    )  # fmt: skip
                    assert raw.headers["x-policy-version"] == "1" and raw.parse().model == "agent@1"
            for server, count in zip(servers, before, strict=True):
                assert {b["model"] for b in server.fake.requests[count:]} == {"agent@1"}

            # -- step 2: the second server hangs on loading agent@2 and is killed there
            trajectories = [t for g in ("g3", "g4") for t in play_group(proxies, servers, g, turns=1)]
            on_second = sorted(second.trajectories() & set(trajectories))
            assert on_second, "no trajectory of step 2 went to the second server"
            reward(proxies, trajectories)
            wait_for(lambda: queued_job(proxies[1], ["g3", "g4"]))
            loads[1].hold = "agent@2"
            assert runner.run(worker.run(once=True)) == 1
            assert loads[1].holding.wait(20), "no proxy asked the second server to load agent@2"
            assert [alias(p) for p in proxies] == [1, 1]  # the first holds agent@2, but the alias waits
            assert loads[0].seen[-1] == ("agent@2", 1) and "agent@2" in first.fake.loras
            second.kill()  # mid-load

            # Calls not yet sent: those of trajectories that stuck to the dead server, and new ones, via both proxies.
            answered = []
            for k, proxy in enumerate(proxies):
                for trajectory in [*on_second, f"new-{k}"]:
                    reply = proxy.client().chat.completions.create(
                        model="agent", messages=[{"role": "user", "content": f"{trajectory} after the kill"}],
                        extra_headers={"X-Trajectory-Id": trajectory},
                    )  # fmt: skip
                    answered.append(reply.choices[0].message.content)
            assert answered == [f"echo: {t} after the kill" for k in range(2) for t in [*on_second, f"new-{k}"]]
            wait_for(lambda: all(alias(p) == 2 for p in proxies))  # published on the server left
            for proxy in proxies:
                assert upstream_states(proxy) == {first.v1: "serving", second.v1: "down"}
                reply = proxy.client().chat.completions.create(
                    model="agent", messages=[{"role": "user", "content": "on version 2"}]
                )
                assert reply.model == "agent@2"
            (adapter,) = sql(pg_url, "SELECT state, error FROM adapters WHERE version = 2")
            assert (adapter["state"], adapter["error"]) == ("published", None)

            # Started again (a fresh process, no adapter), it gets both versions before it takes traffic again.
            restarted = FakeVLLM(emit_eos=True)
            second.start(restarted)
            wait_for(lambda: all(upstream_states(p)[second.v1] == "serving" for p in proxies))
            assert set(restarted.loras) == {"agent@1", "agent@2"}
        finally:
            runner.run(worker.close())
    statuses = [row["status_code"] for row in sql(pg_url, "SELECT status_code FROM calls")]
    assert statuses and set(statuses) == {200}, "a call failed"
