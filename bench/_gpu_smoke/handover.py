"""One GPU, two hand-overs: the real proxy's coordinator, the tests' fake vLLM and the real trainer worker.

The proxy (``create_app``, ``--share-gpu``) serves the fake vLLM of tests/fake_vllm.py (pinned to real
vLLM's protocol) and hands the GPU to the worker (``python -m trainer --share-gpu``'s ``Worker``, in
this process, training on the GPU) around each step. Two jobs: a good one, then one whose sample is
too long for the GPU (a real out-of-memory on CUDA; on a CPU a token outside the vocabulary). The
fake vLLM can wake only into free memory: its ``/wake_up`` fails, as vLLM's does, while the trainer's
reserved memory is above what it held before the step. Both hand-overs must end with vLLM woken at
the first try, in the usual order of calls, with nothing refused or aborted.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from _gpu_smoke.memory import gib
from _gpu_smoke.model import REPO, vocab_size
from _gpu_smoke.report import Skip

POLICY = "agent"


def handover(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    try:
        import fastapi  # noqa: F401
        import sqlalchemy  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise Skip(f"the proxy's packages are not installed ({exc.name}): pip install 'tracetrain[proxy]'") from None
    if ctx["device"] == "cpu" and ctx["model"] != "tiny":
        raise Skip("no GPU: steps of a 1.5B model on a CPU take minutes (--model tiny runs this on a CPU)")
    ctx.pop("learner", None)  # the steps section's learner would hold the GPU beside the worker's
    from trainer._memory import release_learner_memory

    release_learner_memory()
    return asyncio.run(_handover(ctx, figures))


async def _handover(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    from fake_vllm import FakeVLLM, serve_in_thread

    from proxy import Settings, create_app
    from store import Store
    from trainer import TrainConfig
    from trainer._worker import Worker, WorkerSettings

    data = ctx["out_dir"] / "handover"
    fake = FakeVLLM(emit_eos=True)
    with serve_in_thread(fake.app) as fake_url:
        settings = Settings(upstream=f"{fake_url}/v1", data_dir=data, share_gpu=True, policy=POLICY)
        with serve_in_thread(create_app(settings)):
            store = await Store.open(settings.resolved_database_url, capture=False)
            try:
                vocab = vocab_size(ctx["model_dir"])
                await _seed(store, "good", vocab, completion=256)
                await _seed(store, "too-long", vocab, completion=_too_long(ctx), poison=ctx["device"] == "cpu")
                config = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=ctx["micro_batch_tokens"])
                worker_settings = WorkerSettings(settings.resolved_database_url, data, POLICY, ctx["model_dir"], config,
                                                 device=ctx["device"], share_gpu=True)  # fmt: skip
                worker = await Worker.open(worker_settings)
                try:
                    await worker.prepare()
                    _wake_only_into_free_memory(fake, ctx["device"], figures)
                    started = time.monotonic()
                    ran = await worker.run(once=True)
                    figures["jobs_s"] = round(time.monotonic() - started, 1)
                finally:
                    await worker.close()
                rows = [await store.jobs.gpu_handover(job_id) for job_id in (1, 2)]
            finally:
                await store.close()
    calls = [c for c in fake.handover.calls if not c.startswith(("chat", "completions"))]
    expected = ["pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping", f"load {POLICY}@1", "resume",
                "pause mode=wait", "sleep level=1 mode=wait", "wake_up", "is_sleeping", "resume"]  # fmt: skip
    figures["wake_ups"] = calls.count("wake_up")
    figures["asleep_s"] = [round(r["gpu_asleep_s"] or 0, 2) for r in rows if r is not None]
    states = [(r["state"], r["gpu_state"]) for r in rows if r is not None]
    figures["jobs"] = states
    assert ran == 2, f"{ran} jobs ran"
    assert calls[-len(expected) :] == expected, calls
    assert states == [("succeeded", "released"), ("failed", "released")], states
    assert fake.handover.refused == [] and fake.handover.aborted == 0
    return "two hand-overs (a step, then a failed step); vLLM woke at the first try after each"


def _wake_only_into_free_memory(fake: Any, device: str, figures: dict[str, Any]) -> None:
    """The fake vLLM's wake needs the memory the trainer held before its step back (CUDA only)."""
    if device != "cuda":
        return
    import torch

    torch.cuda.synchronize()
    resident = torch.cuda.memory_reserved()
    figures["worker_reserved_gib"] = gib(resident)
    slack = 512 * 1024**2  # the allocator may keep a few blocks of the learner's own

    def memory_free() -> bool:
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() <= resident + slack

    fake.handover.memory_free = memory_free


def _too_long(ctx: dict[str, Any]) -> int:
    if ctx["device"] != "cuda":
        return 64
    import torch

    from _gpu_smoke.train import _activation_bytes_per_token

    return int(2 * torch.cuda.mem_get_info()[0] / _activation_bytes_per_token(ctx))


async def _seed(store: Any, name: str, vocab: int, *, completion: int, poison: bool = False) -> None:
    """Two groups of two rewarded trajectories (one call each) and a queued job over them."""
    import torch
    from sqlalchemy import insert

    from store._tables import calls, groups, trajectories

    g = torch.Generator().manual_seed(len(name))
    now = time.time()
    group_ids = [f"{name}-{k}" for k in range(2)]
    async with store.engine.begin() as conn:
        for group_id in group_ids:
            await conn.execute(insert(groups).values(id=group_id, policy=POLICY, state="open", created_at=now))
            prompt = torch.randint(3, vocab, (64,), generator=g).tolist()
            for i, reward in enumerate((1.0, 0.0)):
                tid = f"{group_id}-{i}"
                ids = torch.randint(3, vocab, (completion,), generator=g).tolist()
                if poison:
                    ids[-1] = vocab + 1000  # the CPU's stand-in for a step that fails
                await conn.execute(insert(trajectories).values(id=tid, group_id=group_id, policy=POLICY,
                                                               keyed_by="header", created_at=now, updated_at=now,
                                                               reward=reward, metrics={}))  # fmt: skip
                await conn.execute(insert(calls).values(
                    id=f"{tid}-0", trajectory_id=tid, group_id=group_id, policy=POLICY, endpoint="chat.completions",
                    model=POLICY, served_model="fake", version=0, stream=False, request={}, prompt_token_ids=prompt,
                    completion_token_ids=ids, logprobs=[-2.0] * completion, other_choices=[], status_code=200,
                    latency_ms=1.0, started_at=now,
                ))  # fmt: skip
    assert await store.jobs.create(POLICY, group_ids) is not None
