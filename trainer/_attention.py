"""Which attention kernel the trainer runs, chosen in one place, and what it means for packed rows.

    choose_attention("auto", cuda, bf16): flash_attention_2 if the flash_attn package imports, else sdpa
    choose_attention("auto", cpu, any):   sdpa (transformers' own default, as before this choice existed)
    choose_attention(name, ...):          name, as the user asked (--attn-implementation); checked here

Packed rows (``trainer._logprobs.pack_row``) stay correct under each kernel:

- ``sdpa`` and ``eager`` take the explicit (1, 1, T, T) mask of a row whose samples share their
  prompt (laid once), and otherwise derive a block-diagonal causal mask from the position
  restarts. Both pay for the row's whole T x T score matrix.
- ``flash_attention_2`` takes no such mask: transformers passes a 4-D mask to it as padding,
  which is wrong. It reads the position restarts as variable-length boundaries (``cu_seqlens``,
  flash-attn's varlen kernel) and pays only per sample. So under flash attention samples are
  never laid over a shared prompt: each is laid whole, and the prompt is computed once per
  sample (``shares_prefix``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal, get_args

import torch

AttnChoice = Literal["auto", "sdpa", "eager", "flash_attention_2"]
ATTN_CHOICES: tuple[str, ...] = get_args(AttnChoice)
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class Attention:
    """The kernel transformers loads the model with, and why (the worker logs both)."""

    implementation: str  # "sdpa", "eager" or "flash_attention_2"
    why: str

    @property
    def shares_prefix(self) -> bool:
        """Whether a micro-batch may lay its samples' common prompt once (needs an explicit mask)."""
        return self.implementation != "flash_attention_2"


def flash_attn_available() -> bool:
    """Whether the flash_attn package (flash-attention 2) can be imported, without importing it."""
    return importlib.util.find_spec("flash_attn") is not None


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
