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

Clearing a frame leaves the function it ran, and that function's closure: a module with hooks
(FSDP's, or ``trainer._handover.stop_when_revoked``'s) runs its forward inside the closure
``inner`` that ``torch.nn.Module._call_impl`` makes, whose cells hold the layer's input, and through
its autograd graph every activation before it. Measured on an H200: with such hooks the 130 GiB
of a step that ran out of memory stayed allocated after the frames were cleared. So the closures
of the functions that ran in the failed call (the nested functions its finished frames hold whose
code is one of those frames') are emptied too: that call has ended, they never run again.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import traceback
import types


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
    running: set[int] = set()
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:  # this thread's stack, and with it every coroutine awaiting on it
        running.add(id(frame))
        frame = frame.f_back
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        _empty_closures([f for f in _frames(exc.__traceback__) if id(f) not in running])
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]
        if isinstance(exc, BaseExceptionGroup):
            pending += list(exc.exceptions)


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _empty_closures(finished: list[types.FrameType]) -> None:
    """Empty the cells of the nested functions that ran in these finished frames (``_call_impl``'s ``inner``)."""
    codes = {frame.f_code for frame in finished}
    for frame in finished:
        if not any(const in codes for const in frame.f_code.co_consts if isinstance(const, types.CodeType)):
            continue  # it made no function that ran here: its locals are not read (reading keeps a copy of them)
        local_values = frame.f_locals  # before 3.13 a dict cached on the frame, which clear() would not empty
        for value in list(local_values.values()):
            if isinstance(value, types.FunctionType) and value.__code__ in codes and value.__closure__:
                for cell in value.__closure__:
                    with contextlib.suppress(ValueError):  # an empty cell
                        del cell.cell_contents
        if isinstance(local_values, dict):
            local_values.clear()


def empty_cuda_cache() -> None:
    """Wait for the GPU's queued work, then give every unused cached block back to the driver (no-op off CUDA)."""
    import torch  # here, not at the top: the store-only parts of the trainer's tests import this module

    if _cuda_in_use():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
