"""Inside a contender's process: the timed steps, peak RSS, and the gradients of the first step."""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path
from typing import Any


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def page_in(model: Any) -> None:
    """Touch every weight: from_pretrained maps safetensors files, so weights join RSS when first read.

    Without this the first forward would page in the whole model (540 MB for SmolLM2-135M in
    float32) and count it as the step's own memory.
    """
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.sum()


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def capture_first_step_grads(optimizer: Any, named: list[tuple[str, Any]], path: Path) -> None:
    """Save the LoRA gradients that the first optimizer step applies (after clipping) to ``path``."""
    import torch

    def hook(*_: Any) -> None:
        torch.save({name: w.grad.detach().clone() for name, w in named if w.grad is not None}, path)
        handle.remove()

    handle = optimizer.register_step_pre_hook(hook)


def timed(step: Any, name: str, opts: argparse.Namespace, rss_load: int) -> dict[str, Any]:
    """Warm-up step, peak reset, ``opts.steps`` timed steps; the result dict of this contender."""
    start = time.perf_counter()
    first = step()
    warmup_s = time.perf_counter() - start
    maxrss_before = _maxrss_kib()
    reset = _reset_peak_rss()
    runs = []
    for _ in range(opts.steps):
        start = time.perf_counter()
        info = step()
        runs.append({**info, "wall_s": time.perf_counter() - start})
    maxrss_end = _maxrss_kib()
    step_peak = status_kib("VmHWM") if reset else maxrss_end
    seconds = statistics.median(r["wall_s"] for r in runs)
    tokens = opts.samples * (opts.prompt + opts.completion)
    return {
        "name": name,
        "tokens": tokens,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "step_s_all": [r["wall_s"] for r in runs],
        "runs": runs,
        "warmup_s": warmup_s,
        "first_step": first,
        "rss_after_load_bytes": rss_load * 1024,
        "peak_rss_abs_bytes": max(maxrss_before, maxrss_end) * 1024,
        "step_extra_rss_bytes": (step_peak - rss_load) * 1024,
        "peak_reset_after_warmup": reset,
    }
