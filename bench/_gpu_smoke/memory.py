"""Memory readings: torch's allocator, nvidia-smi's view of the whole GPU, this process's resident set."""

from __future__ import annotations

import os
import subprocess
from typing import Any

GiB = 1024**3


def gib(n: float) -> float:
    return round(n / GiB, 2)


def nvidia_smi_used_mib(index: int = 0) -> int | None:
    """Memory in use on GPU ``index`` as nvidia-smi reports it (every process's), or None without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                               str(index)], capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return int(done.stdout.strip().splitlines()[0])


def host_rss() -> int:
    """This process's resident set size in bytes."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def torch_figures(prefix: str = "") -> dict[str, Any]:
    """torch.cuda's allocated and reserved GiB, and nvidia-smi's used MiB (CUDA contexts and other processes too)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    return {
        f"{prefix}allocated_gib": gib(torch.cuda.memory_allocated()),
        f"{prefix}reserved_gib": gib(torch.cuda.memory_reserved()),
        f"{prefix}nvidia_smi_used_mib": nvidia_smi_used_mib(),
    }
