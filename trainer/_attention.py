"""Which attention kernel the trainer runs, chosen in one place, and how it reads a packed row.

    choose_attention("auto", cuda, bf16): flash_attention_2 if the flash_attn package imports, else sdpa
    choose_attention("auto", cpu, any):   sdpa (transformers' own default, as before this choice existed)
    choose_attention(name, ...):          name, as the user asked (--attn-implementation); checked here

A packed row (``trainer._logprobs.pack_row``) is its samples' prefix tree: each token must see
its own sample's path and nothing else. Each kernel gets those paths its own way:

- ``sdpa`` and ``eager`` take an explicit (1, 1, T, T) mask, or none where no sample forks off
  another (transformers then derives a block-diagonal causal mask from the position restarts).
  Both pay for the row's whole T x T score matrix.
- ``flash_attention_2`` takes no such mask (transformers would read a 4-D mask as padding). The
  row comes as variable-length sequences instead, one per segment of the tree, and the model is
  loaded with ``flash_tree_attention`` (registered with transformers as ``FLASH_TREE``): it gathers
  each segment's keys (its path to the fork, then itself) and runs flash-attn's varlen kernel,
  causal from the bottom right (flash-attn >= 2.1), so a segment's first query sees its whole path
  and each later one a token more. A shared prefix then costs its keys' gather once per branch,
  but its layers' matmuls only once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

AttnChoice = Literal["auto", "sdpa", "eager", "flash_attention_2"]
ATTN_CHOICES: tuple[str, ...] = get_args(AttnChoice)
_HALF = (torch.bfloat16, torch.float16)
# The name the learner loads a flash-attention model with: flash_tree_attention, registered with transformers.
# Without "flash" in it: transformers would take such a name for a flash-attn kernel to import from the hub.
FLASH_TREE = "tracetrain_varlen_tree"


@dataclass(frozen=True, slots=True)
class Attention:
    """The kernel transformers loads the model with, and why (the worker logs both)."""

    implementation: str  # "sdpa", "eager" or "flash_attention_2"
    why: str

    @property
    def varlen(self) -> bool:
        """Whether rows come as variable-length sequences (flash attention) rather than with a mask."""
        return self.implementation == "flash_attention_2"

    def load_as(self) -> str:
        """The ``attn_implementation`` to load the model with (flash attention: ``FLASH_TREE``, registered here)."""
        if not self.varlen:
            return self.implementation
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

        AttentionInterface.register(FLASH_TREE, flash_tree_attention)
        AttentionMaskInterface.register(FLASH_TREE, flash_attention_mask)  # no 4-D mask: None, or 2-D padding
        return FLASH_TREE


def flash_attn_available() -> bool:
    """Whether the flash_attn package (flash-attention 2.1 or newer) can be imported, without importing it."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        major, minor = (int(part) for part in importlib.metadata.version("flash-attn").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return True  # a build without metadata: trust the import
    return (major, minor) >= (2, 1)  # before 2.1 a causal mask with fewer queries than keys was top-left aligned


def flash_tree_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    *,
    varlen_keys: Tensor | None = None,
    varlen_cu_q: Tensor | None = None,
    varlen_cu_k: Tensor | None = None,
    varlen_max_q: int = 0,
    varlen_max_k: int = 0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention over a packed row's prefix tree with flash-attn's varlen kernel (transformers' interface).

    ``query`` (1, H, T, D), ``key`` and ``value`` (1, H_kv, T, D) -> (1, T, H, D). The ``varlen_*``
    arguments are ``trainer._logprobs.Varlen``'s: the learner forwards packed rows only. A segment's
    gathered keys are its sample's tokens in order, so a sliding window counts in positions, as
    transformers' own flash attention does (``sliding_window - 1`` to the left of each query).
    """
    if varlen_keys is None or varlen_cu_q is None or varlen_cu_k is None:
        raise ValueError("a model loaded for the learner's flash attention forwards packed rows only (pack_row)")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by the learner's flash attention")
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]  # CUDA only

    half = next((p.dtype for p in module.parameters() if p.dtype in _HALF), torch.bfloat16)
    q = query[0].transpose(0, 1)  # (T, H, D)
    k = key[0].transpose(0, 1)[varlen_keys]  # (K, H_kv, D): each segment's path, then itself
    v = value[0].transpose(0, 1)[varlen_keys]  # (K, H_kv, D)
    if q.dtype not in _HALF:  # peft's float32 LoRA output: flash attention runs in half precision only
        q, k, v = q.to(half), k.to(half), v.to(half)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None else (-1, -1)
    out = flash_attn_varlen_func(q, k, v, varlen_cu_q, varlen_cu_k, varlen_max_q, varlen_max_k, dropout_p=dropout,
                                 softmax_scale=scaling, causal=True, window_size=window,
                                 softcap=softcap or 0.0)  # fmt: skip
    return out[None].to(query.dtype), None  # (1, T, H, D), in the dtype the layer computes in


def choose_attention(requested: str, device: torch.device, dtype: torch.dtype) -> Attention:
    """The attention for a model of ``dtype`` weights on ``device``; ``requested`` "auto" lets this choose.

    Raises ValueError for a name that is no choice, and for flash_attention_2 where it cannot run
    (no CUDA device, float32 weights, no flash_attn package).
    """
    if requested not in ATTN_CHOICES:
        raise ValueError(f"attention implementation {requested!r}: one of {', '.join(ATTN_CHOICES)}")
    if requested == "flash_attention_2":
        if device.type != "cuda" or dtype not in _HALF or not flash_attn_available():
            raise ValueError(
                "flash_attention_2 needs a CUDA device, bfloat16 or float16 weights and the flash_attn package "
                f"(here: device {device.type}, {dtype}, flash_attn {'found' if flash_attn_available() else 'missing'})"
            )
        return Attention(requested, "as asked (--attn-implementation)")
    if requested != "auto":
        return Attention(requested, "as asked (--attn-implementation)")
    if device.type != "cuda":
        return Attention("sdpa", f"on {device.type}: torch's scaled_dot_product_attention")
    if dtype not in _HALF:
        return Attention("sdpa", f"{dtype} weights: flash attention runs in bfloat16 or float16 only")
    if not flash_attn_available():
        return Attention("sdpa", "the flash_attn package is not installed (pip install flash-attn)")
    return Attention("flash_attention_2", "CUDA, half-precision weights and flash_attn installed")
