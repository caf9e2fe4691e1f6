"""A vLLM plugin: LoRA sampling on a CPU made fast and right, and adapters fetched from a tracetrain proxy.

vLLM loads it through the `vllm.general_plugins` entry point `tracetrain_cpu_lora`
(see `pyproject.toml`), in the API server, the engine core and the worker processes,
and calls `register()` in each. On a CPU, `register()` swaps vLLM's torch LoRA ops
`bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice` for the grouped ones in
`tracetrain_vllm._cpu_lora` (the `sgmv_*` ops, used for every step on a CPU, call these).
On any other platform it does nothing.

On every platform, when ``TRACETRAIN_ADAPTERS_URL`` names a proxy, `register()` also adds a
LoRA resolver (`tracetrain_vllm._resolver`): asked for ``policy@N`` it does not hold, vLLM
downloads that adapter's files from the proxy into a local cache and loads them, so vLLM
need not see the trainer's disk. Without that variable nothing is registered.

Switch it off with `TRACETRAIN_VLLM_CPU_LORA=0`, or leave it out with vLLM's own
`VLLM_PLUGINS` allow-list (a list that does not name `tracetrain_cpu_lora`).

Nothing happens at import time: vLLM and torch are imported inside `register()`.
"""

from __future__ import annotations

import importlib
import logging
import os

from tracetrain_vllm._cpu import cpu_has_bf16

__all__ = ["cpu_has_bf16", "register"]

# vLLM configures handlers for the "vllm" logger only; a child of it lands in vLLM's log.
_logger = logging.getLogger("vllm.tracetrain_vllm")

# Every module that bound vLLM's torch ops by name: the ops module itself (its sgmv_*
# wrappers look the bgmv_* ones up there), the package that re-exports them, and the CPU
# punica wrapper, which imported them from that package.
_PATCHED_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)
_OP_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def register() -> None:
    """Install the grouped CPU LoRA ops into vLLM, if running on a CPU and not switched off.

    Also registers the adapter resolver when ``TRACETRAIN_ADAPTERS_URL`` is set.

    Idempotent: a second call (vLLM may load plugins more than once per process) changes
    nothing and logs nothing.
    """
    from tracetrain_vllm._resolver import register_resolver

    register_resolver()
    if os.environ.get("TRACETRAIN_VLLM_CPU_LORA") == "0":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from tracetrain_vllm import _cpu_lora

    changed = False
    for module_name in _PATCHED_MODULES:
        module = importlib.import_module(module_name)
        for op_name in _OP_NAMES:
            op = getattr(_cpu_lora, op_name)
            if getattr(module, op_name) is not op:
                setattr(module, op_name, op)
                changed = True
    if changed:
        _logger.info("tracetrain_cpu_lora: grouped CPU LoRA ops installed (TRACETRAIN_VLLM_CPU_LORA=0 turns them off)")
