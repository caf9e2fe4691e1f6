"""The worker's side of a GPU shared with vLLM (``python -m trainer --share-gpu``).

Around each step (the step itself, saving the adapter, recording it) the worker asks for
the GPU through the store and waits; the proxy finishes the calls vLLM runs, puts vLLM to
sleep and grants it (``proxy.training._handover``). The worker gives it back in a
``finally``, after a failed step too, and the proxy wakes vLLM and loads the adapter the
step recorded. The batch is built on the CPU before asking, so vLLM sleeps only while the
GPU computes. The job's lease keeps being renewed while the worker waits (``Worker.run_job``
renews it in a task of its own): a long wait never loses the claim.

Before giving the GPU back the worker frees what the step held (``trainer._memory``): a failed
step's traceback keeps its activations alive, and a vLLM woken into a GPU the trainer still fills
cannot wake (its ``/wake_up`` runs out of memory, and a restarted vLLM fails its start-up check).
A grant the proxy revokes while the step still computes (``--handover-timeout``) stops the step at
its next decoder layer (``stop_when_revoked``), so the memory comes back within a layer's time.

While it waits for the grant, the worker calls ``keepalive`` every ``keepalive_s``: under torchrun
it tells the other ranks to idle, which keeps them short of the collective timeout (their next
word, the step, comes only after the grant).

The store is the only channel: the worker never talks to the proxy or to vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

from store import GpuHandover, JobState, Store
from trainer._memory import release_step_memory

if TYPE_CHECKING:
    from trainer._learner import Learner

log = logging.getLogger("tracetrain.trainer")

_WAITING_LOG_S = 60.0
_WATCH_S = 0.5  # how often a granted hand-over is looked at for a revocation while the step runs


class GpuLost(RuntimeError):
    """The job stopped being this worker's before the GPU was granted (it was queued again)."""


class GpuRevoked(RuntimeError):
    """The proxy took the GPU back while the step computed (it outlived --handover-timeout, or the claim was lost)."""


class Grant:
    """The GPU held for a block: ``revoked`` is set (from the event loop) once the proxy takes it back."""

    def __init__(self) -> None:
        self.revoked = threading.Event()


@asynccontextmanager
async def gpu_handed_over(
    store: Store,
    job_id: int,
    owner: str,
    *,
    poll_s: float = 0.05,
    keepalive: Callable[[], None] | None = None,
    keepalive_s: float = 60.0,
) -> AsyncIterator[Grant]:
    """Hold the shared GPU for the block: ask, wait for the grant, free the step's memory and give it back."""
    if not await store.jobs.request_gpu(job_id, owner):
        raise GpuLost(f"job {job_id} is no longer {owner}'s: the GPU was not asked for")
    await _until_granted(store, job_id, owner, poll_s, keepalive, keepalive_s)
    grant = Grant()
    watching = asyncio.create_task(_watch(store, job_id, owner, grant), name=f"gpu-watch-{job_id}")
    try:
        yield grant
    except BaseException as exc:
        release_step_memory(exc)  # the traceback holds the step's activations: freed before vLLM wakes
        raise
    else:
        release_step_memory()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        if not await store.jobs.release_gpu(job_id, owner):
            log.warning("job %s: the hand-over was revoked before the step ended (it outlived --handover-timeout, "
                        "or the claim was lost); vLLM already serves again", job_id)  # fmt: skip


async def _until_granted(
    store: Store, job_id: int, owner: str, poll_s: float, keepalive: Callable[[], None] | None, keepalive_s: float
) -> None:
    asked = time.monotonic()
    next_note, next_keepalive = asked + _WAITING_LOG_S, asked + keepalive_s
    while True:
        row = await store.jobs.gpu_handover(job_id)
        if row is None or row["state"] != JobState.RUNNING or row["worker"] != owner:
            raise GpuLost(f"job {job_id} stopped being {owner}'s while it waited for the GPU")
        if row["gpu_state"] == GpuHandover.GRANTED:
            break
        if row["gpu_state"] != GpuHandover.REQUESTED:
            raise GpuLost(f"job {job_id}: the GPU request ended as {row['gpu_state']} before the grant")
        now = time.monotonic()
        if now > next_note:
            next_note += _WAITING_LOG_S
            log.warning("job %s: waiting %.0f s for the GPU (is the proxy started with --share-gpu?)", job_id,
                        now - asked)  # fmt: skip
        if keepalive is not None and now > next_keepalive:
            next_keepalive = now + keepalive_s
            keepalive()
        await asyncio.sleep(poll_s)
    log.info("job %s: the GPU is ours (vLLM sleeps; %.2f s after asking)", job_id, time.monotonic() - asked)


async def _watch(store: Store, job_id: int, owner: str, grant: Grant) -> None:
    """Set ``grant.revoked`` once the hand-over is no longer this worker's grant."""
    while True:
        await asyncio.sleep(_WATCH_S)
        try:
            row = await store.jobs.gpu_handover(job_id)
        except Exception:  # the store may be briefly unreachable: look again at the next beat
            log.exception("job %s: reading the hand-over failed", job_id)
            continue
        if row is None or row["gpu_state"] != GpuHandover.GRANTED or row["worker"] != owner:
            log.error("job %s: the proxy took the GPU back while the step runs; stopping the step", job_id)
            grant.revoked.set()
            return


@contextlib.contextmanager
def stop_when_revoked(learner: Learner, grant: Grant | None) -> Iterator[None]:
    """Make ``learner``'s step raise GpuRevoked at its next decoder layer once ``grant`` is revoked.

    A forward pre-hook on each layer: the step never sees it otherwise. Not for a sharded learner: a
    rank that stops inside FSDP's forward would leave the others in a collective; its step runs out.
    """
    if grant is None or learner.sharded:
        yield
        return
    from transformers import PreTrainedModel

    from trainer._sharded import decoder_layers

    revoked = grant.revoked

    def check(module: Any, args: Any) -> None:
        if revoked.is_set():
            raise GpuRevoked("the proxy took the GPU back (the step outlived --handover-timeout); step abandoned")

    hooks = [
        layer.register_forward_pre_hook(check)
        for layer in decoder_layers(cast(PreTrainedModel, learner.model.get_base_model()))
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
