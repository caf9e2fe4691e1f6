"""Whether this CPU computes in bf16 natively: what vLLM's dtype on a CPU hangs on.

Read by ``tracetrain serve`` (vLLM's ``--dtype auto`` falls back to float32 on a CPU without bf16
units, where bf16 is emulated and slow) and by ``tracetrain demo`` (its city task samples in bf16
where the units exist). Standard library only.
"""

from __future__ import annotations

from pathlib import Path


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU has AVX512-BF16 or AMX-BF16, from ``cpuinfo``'s flags (False where it cannot be read)."""
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
