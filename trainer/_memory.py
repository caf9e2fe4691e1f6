"""Giving a step's GPU memory back, after it ends well or badly, before anyone else needs the GPU.

What a step allocated lives on after it in two places. A step that failed (out of memory, say)
raised an exception whose traceback holds every frame the step ran, and with them its activations,
its packed rows and its autograd graph: while that exception propagates, or sits in a log record, a
variable or a ``concurrent.futures`` result, nothing it references is freed, and
``torch.cuda.empty_cache()`` can give back only blocks nothing uses. So a failed step's frames are
cleared first (``traceback.clear_frames``: the locals go, the line numbers stay, so the traceback
still prints), the garbage collector takes the cycles autograd leaves, and only then is CUDA's
cache emptied. A vLLM sharing the GPU wakes into that memory (``trainer._handover``); every rank
of a multi-process trainer does this after each step (``trainer._worker.follow``).
"""

from __future__ import annotations

import gc
import traceback


def release_step_memory(error: BaseException | None = None) -> None:
    """Free what the step (and ``error``, if it failed) still holds, then return CUDA's cached blocks.

    Off CUDA the frames are cleared and nothing more: the collector's full pass (a fraction of a
    second in a process that loaded torch and transformers, holding the interpreter) buys nothing
    where no other process waits for the memory.
    """
    if error is not None:
        drop_frames(error)
    if _cuda_in_use():
        gc.collect()
        empty_cuda_cache()


def release_learner_memory() -> None:
    """Free a learner just dropped (its model and AdamW state form reference cycles) before another is built."""
    gc.collect()
    empty_cuda_cache()


def drop_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in ``error``'s traceback and in the errors it was raised from.

    Frames still running (the caller's own, a coroutine awaiting) cannot be cleared and are left as they are.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]
        if isinstance(exc, BaseExceptionGroup):
            pending += list(exc.exceptions)


def empty_cuda_cache() -> None:
    """Wait for the GPU's queued work, then give every unused cached block back to the driver (no-op off CUDA)."""
    import torch  # here, not at the top: the store-only parts of the trainer's tests import this module

    if _cuda_in_use():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
