"""The worker's side of a GPU shared with vLLM (``python -m trainer --share-gpu``).

Around each step (the step itself, saving the adapter, recording it) the worker asks for
the GPU through the store and waits; the proxy finishes the calls vLLM runs, puts vLLM to
sleep and grants it (``proxy.training._handover``). The worker gives it back in a
``finally``, after a failed step too, and the proxy wakes vLLM and loads the adapter the
step recorded. The batch is built on the CPU before asking, so vLLM sleeps only while the
GPU computes. The job's lease keeps being renewed while the worker waits (``Worker.run_job``
renews it in a task of its own): a long wait never loses the claim.

The store is the only channel: the worker never talks to the proxy or to vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from store import GpuHandover, JobState, Store

log = logging.getLogger("tracetrain.trainer")

_WAITING_LOG_S = 60.0


class GpuLost(RuntimeError):
    """The job stopped being this worker's before the GPU was granted (it was queued again)."""


@asynccontextmanager
async def gpu_handed_over(store: Store, job_id: int, owner: str, *, poll_s: float = 0.05) -> AsyncIterator[None]:
    """Hold the shared GPU for the block: ask, wait for the grant, give it back however the block ends."""
    if not await store.jobs.request_gpu(job_id, owner):
        raise GpuLost(f"job {job_id} is no longer {owner}'s: the GPU was not asked for")
    asked = time.monotonic()
    next_note = asked + _WAITING_LOG_S
    while True:
        row = await store.jobs.gpu_handover(job_id)
        if row is None or row["state"] != JobState.RUNNING or row["worker"] != owner:
            raise GpuLost(f"job {job_id} stopped being {owner}'s while it waited for the GPU")
        if row["gpu_state"] == GpuHandover.GRANTED:
            break
        if row["gpu_state"] != GpuHandover.REQUESTED:
            raise GpuLost(f"job {job_id}: the GPU request ended as {row['gpu_state']} before the grant")
        if time.monotonic() > next_note:
            next_note += _WAITING_LOG_S
            log.warning("job %s: waiting %.0f s for the GPU (is the proxy started with --share-gpu?)", job_id,
                        time.monotonic() - asked)  # fmt: skip
        await asyncio.sleep(poll_s)
    log.info("job %s: the GPU is ours (vLLM sleeps; %.2f s after asking)", job_id, time.monotonic() - asked)
    try:
        yield
    finally:
        _free_cuda_cache()
        if not await store.jobs.release_gpu(job_id, owner):
            log.warning("job %s: the hand-over was revoked before the step ended (it outlived --handover-timeout, "
                        "or the claim was lost); vLLM already serves again", job_id)  # fmt: skip


def _free_cuda_cache() -> None:
    """Give the step's cached blocks (its activations) back to the driver before vLLM wakes into that memory."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
