"""The shared GPU under failure: every path that ends a step gives its memory back before vLLM wakes into it.

No CUDA runs here, so the faults are injected where CUDA would raise them: a step that raises
torch's OutOfMemoryError from a worker thread, a step still computing when the proxy revokes the
grant, a rank above 0 whose step fails. "The memory" is a tensor the step allocated (a weakref says
whether it is still alive), the fake vLLM's ``/wake_up`` fails while it is (as a real one runs out of
memory re-mapping its weights), and CUDA's cache calls are recorded by a stand-in for ``torch.cuda``.
The proxy, the store, the fake vLLM and the tiny model are the real ones of the other tests.
"""

from __future__ import annotations

import asyncio
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from test_handover import WORKER, claimed_job, eventually, serving_again, since_pause, store, until_gpu  # noqa: F401

from store import GpuHandover, JobState
from trainer import TrainConfig
from trainer._handover import gpu_handed_over
from trainer._learner import Learner

TINY = TrainConfig(lora_r=8, lora_alpha=16, dtype="float32")


class CudaCache:
    """Stands in for torch.cuda's cache calls; notes, at each empty_cache, whether the step's memory was alive."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, alive: Callable[[], bool]) -> None:
        self.emptied_while_alive: list[bool] = []
        for name, value in (("is_available", lambda: True), ("is_initialized", lambda: True),
                            ("synchronize", lambda *a: None),
                            ("empty_cache", lambda: self.emptied_while_alive.append(alive()))):  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.fixture
def step_memory() -> Iterator[list[weakref.ref[torch.Tensor]]]:
    """Weak references to what fault-injected steps allocated (their "activations")."""
    yield []


def oom_step(memory: list[weakref.ref[torch.Tensor]]) -> None:
    activations = torch.ones(256, 1024)
    memory.append(weakref.ref(activations))
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


async def test_a_step_that_runs_out_of_memory_frees_it_before_vllm_wakes_and_vllm_wakes_at_once(
    start_proxy: Callable[..., RunningProxy],
    fake: FakeVLLM,
    store: Any,  # noqa: F811  (test_handover's fixture)
    monkeypatch: pytest.MonkeyPatch,
    step_memory: list[weakref.ref[torch.Tensor]],
) -> None:
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    alive = lambda: any(ref() is not None for ref in step_memory)  # noqa: E731
    cache = CudaCache(monkeypatch, alive)
    fake.handover.memory_free = lambda: not alive()

    with pytest.raises(torch.OutOfMemoryError) as failed:
        async with gpu_handed_over(trainer, job_id, WORKER, poll_s=0.02):
            await asyncio.to_thread(oom_step, step_memory)
    await eventually(lambda: serving_again(fake))

    assert step_memory and not alive()
    assert cache.emptied_while_alive == [False]  # the cache was emptied once the step's tensors were gone
    # The wake worked the first time: the order of the hand-over is the usual one, nothing retried.
    assert since_pause(fake) == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping", "resume"]
    assert "in oom_step" in "".join(traceback.format_exception(failed.value))  # still a full traceback in the log
    assert proxy.client().chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])


async def test_a_real_step_out_of_memory_inside_hooked_layers_is_freed_before_vllm_wakes(
    start_proxy: Callable[..., RunningProxy],
    fake: FakeVLLM,
    store: Any,  # noqa: F811
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    step_memory: list[weakref.ref[torch.Tensor]],
) -> None:
    """As the worker runs it: in a thread, under stop_when_revoked's layer hooks (FSDP's hooks do the same).

    A hooked module runs its forward in a closure whose cells hold the layer's input, and through its
    autograd graph every activation before it: seen on an H200, where 130 GiB stayed allocated.
    """
    import distributed_learner

    from trainer._handover import stop_when_revoked

    learner = Learner(tiny_model_dir, TINY)
    layers = learner.model.get_base_model().get_decoder().layers
    layers[0].register_forward_hook(
        lambda _m, _a, out: step_memory.append(weakref.ref(out[0] if isinstance(out, tuple) else out))
    )

    def out_of_memory(*_: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB")

    layers[1].register_forward_pre_hook(out_of_memory)
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    alive = lambda: any(ref() is not None for ref in step_memory)  # noqa: E731
    cache = CudaCache(monkeypatch, alive)
    fake.handover.memory_free = lambda: not alive()

    with pytest.raises(torch.OutOfMemoryError):
        async with gpu_handed_over(trainer, job_id, WORKER, poll_s=0.02) as grant:
            with stop_when_revoked(learner, grant):
                await asyncio.to_thread(learner.step, distributed_learner.batch())
    await eventually(lambda: serving_again(fake))

    assert step_memory and not alive() and cache.emptied_while_alive == [False]
    assert since_pause(fake) == ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping", "resume"]


async def test_a_step_still_computing_when_the_grant_is_revoked_stops_at_its_next_layer(
    start_proxy: Callable[..., RunningProxy],
    fake: FakeVLLM,
    store: Any,  # noqa: F811
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer import _worker
    from trainer._worker import Worker, WorkerSettings

    layers_run: list[float] = []

    class SlowLearner(Learner):
        """Each decoder layer's forward takes 1 s: a step of 4 micro-batches computes for over 8 s, far past the
        1 s hand-over timeout and the watcher's polls even when a loaded machine delays them by seconds."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for layer in self.model.get_base_model().get_decoder().layers:
                layer.register_forward_pre_hook(slow)

    def slow(*_: Any) -> None:
        layers_run.append(time.monotonic())
        time.sleep(1.0)

    monkeypatch.setattr(_worker, "Learner", SlowLearner)
    proxy = start_proxy(share_gpu=True, handover_timeout_s=1.0)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer, calls_per_trajectory=1)
    await trainer.jobs.release(job_id, WORKER)  # queued again, for the real worker
    config = TINY.model_copy(update={"micro_batch_tokens": 8})  # one 6-token sample per micro-batch
    settings = WorkerSettings(database_url=proxy.settings.resolved_database_url, data_dir=proxy.settings.data_dir,
                              policies=("agent",), base_model=tiny_model_dir, config=config,
                              share_gpu=True)  # fmt: skip
    worker = await Worker.open(settings)
    try:
        assert await asyncio.wait_for(worker.run(once=True), 60) == 1
    finally:
        await worker.close()
    await eventually(lambda: serving_again(fake))

    row = await trainer.jobs.gpu_handover(job_id)
    assert row is not None and row["state"] == JobState.FAILED and row["gpu_state"] == GpuHandover.REVOKED
    [job] = proxy.rows("SELECT error FROM training_jobs WHERE id = ?", job_id)
    assert "GpuRevoked" in job["error"]
    assert len(layers_run) < 8, "the step ran all its 4 x 2 layers after the GPU was taken back"
    assert await trainer.adapters.get("agent", 1) is None  # nothing trained on a GPU vLLM was woken into


def test_a_rank_above_0_empties_cudas_cache_after_each_step_before_it_waits_for_the_next_word(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step_memory: list[weakref.ref[torch.Tensor]]
) -> None:
    import distributed_learner

    from trainer import _distributed, _worker
    from trainer._distributed import Step, StepFailed, Stop

    alive = lambda: any(ref() is not None for ref in step_memory)  # noqa: E731
    cache = CudaCache(monkeypatch, alive)
    items = tuple(distributed_learner.batch())
    words: list[Any] = [Step("agent", 0, ("agent", -1), items), Step("agent", 0, ("agent", 0), items), Stop()]
    heard: list[tuple[int, list[bool]]] = []  # at each word: how many steps ran, and the cache calls so far

    def listen() -> Any:
        heard.append((len(step_memory), list(cache.emptied_while_alive)))
        return words.pop(0)

    real_step = Learner.step

    def step(self: Learner, batch: Any) -> Any:
        result = real_step(self, batch)
        activations = torch.ones(256, 1024)
        step_memory.append(weakref.ref(activations))
        if len(step_memory) == 2:  # the second step fails on some rank, as StepFailed says on every rank
            raise StepFailed("the training step failed on rank 0: OutOfMemoryError: CUDA out of memory")
        return result

    monkeypatch.setattr(_distributed, "listen", listen)
    monkeypatch.setattr(Learner, "step", step)
    settings = _worker.WorkerSettings("sqlite+aiosqlite:///unused.db", tmp_path, ("agent",), tiny_model_dir, TINY)
    _worker.follow(settings)

    # Before the second word, after a good step; before the third, after a failed one: emptied, nothing alive.
    assert heard == [(0, []), (1, [False]), (2, [False, False])]


def test_a_learner_rebuilt_at_another_version_frees_the_one_it_held_first(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiny_model import build_tiny_lora

    from trainer import _worker

    held_at_build: list[int] = []
    alive: weakref.WeakSet[Any] = weakref.WeakSet()

    class Counted(Learner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            held_at_build.append(len(alive))
            super().__init__(*args, **kwargs)
            alive.add(self)

    monkeypatch.setattr(_worker, "Learner", Counted)
    settings = _worker.WorkerSettings("sqlite+aiosqlite:///unused.db", tmp_path, ("agent",), tiny_model_dir, TINY)
    # Another rank than the learner's: it cannot be switched in place (Learner.switch), so a new learner is built.
    build_tiny_lora(tiny_model_dir, settings.adapters_of("agent") / "1", r=4)
    held = _worker.HeldLearner(settings)
    held.at("agent", 0)
    rebuilt = held.at("agent", 1)  # a rollback, or a publish that failed: the weights to train on changed
    assert held_at_build == [0, 0]  # the old learner was gone before the new one loaded its base
    assert held.holds == ("agent", 1) and held.at("agent", 1) is rebuilt and held_at_build == [0, 0]


async def test_a_vllm_that_keeps_refusing_to_sleep_stops_training_says_why_and_serves_on(
    start_proxy: Callable[..., RunningProxy],
    fake: FakeVLLM,
    store: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import httpx

    monkeypatch.setattr("proxy.training._handover._RETRY_MIN_S", 0.05)
    proxy = start_proxy(share_gpu=True)
    trainer = await store(proxy)
    job_id = await claimed_job(trainer)
    fake.handover.failing = {"sleep"}  # a vLLM started without --enable-sleep-mode, say
    await trainer.jobs.request_gpu(job_id, WORKER)

    await until_gpu(trainer, job_id, GpuHandover.REVOKED)
    await asyncio.sleep(0.5)  # long enough for several more tries, were it still trying
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        ready = (await http.get("/readyz")).json()
        overview = (await http.get("/admin/training")).json()
        answered = await http.post("/v1/chat/completions", json={"model": "agent", "messages": [
            {"role": "user", "content": "still there?"}]})  # fmt: skip

    assert fake.handover.calls.count("pause mode=wait") == 5  # capped: no gate closed for nothing after that
    assert "sleep failed (injected)" in ready["training"] and ready["status"] == "ready"
    assert overview["training"] == "paused" and "5 times in a row" in overview["training_reason"]
    assert answered.status_code == 200
    assert any("vLLM serves on without training" in r.getMessage() for r in caplog.records)

    fake.handover.failing = set()
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        assert (await http.post("/admin/training/resume")).status_code == 200
        await eventually(lambda: _not_stopped(http))
    assert fake.handover.calls.count("pause mode=wait") == 5  # resumed, it tries again when a step asks


async def _not_stopped(http: Any) -> bool:
    return "training" not in (await http.get("/readyz")).json()
