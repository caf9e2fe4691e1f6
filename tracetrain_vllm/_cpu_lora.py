"""Grouped LoRA ops for vLLM on a CPU: one matmul per adapter instead of one gathered matrix per token.

vLLM's torch fallback (`vllm/lora/ops/torch_ops/lora_ops.py`) computes every LoRA
product as `lora_weights[indices]` -> a (tokens, out, in) copy, then an einsum over it.
The functions here have the same signatures and write their output in place the same
way, but gather nothing: for each adapter slot present in `indices`, the rows that use
it go through one `F.linear` with that slot's matrix. A batch on one adapter (the common
case) is a single matmul. Half-precision operands are rounded as vLLM rounds them, then
multiplied in float32 (see `_round_to`): the same values up to summation order.

They depart from vLLM's on purpose in one place: an index of -1 means "no LoRA" (vLLM's
own convention, see `vllm/lora/punica_wrapper/utils.py`). The GPU kernels skip those
rows; the torch ops index with -1, i.e. apply the adapter in the last slot. Here such a
row gets no LoRA contribution: shrink writes 0, expand with `add_inputs` adds nothing,
expand without it writes 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bgmv_expand", "bgmv_expand_slice", "bgmv_shrink"]


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """`output_tensor[r, :rank] = scaling * inputs[r] @ W[indices[r]].T` (0 for index -1)."""
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        output_tensor[:, : _out_features(lora_b_weights)] = 0
        return
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """`output_tensor[r, :n] (+)= inputs[r] @ W[indices[r]].T`, n the smaller of the two widths."""
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # LoRA adapter and model may add different amounts of padding to output
    common_len = min(_out_features(lora_b_weights), output_tensor.shape[1])
    if outputs is None:
        if not add_inputs:
            output_tensor[:, :common_len] = 0
        return
    # As in vLLM: a single row of LoRA output is broadcast over all output rows.
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """`output_tensor[r, offset:offset + size] (+)= inputs[r] @ W[indices[r]].T`."""
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    columns = slice(slice_offset, slice_offset + slice_size)
    if outputs is None:
        if not add_inputs:
            output_tensor[:, columns] = 0
        return
    if add_inputs:
        output_tensor[:, columns] += outputs
    else:
        output_tensor[:, columns] = outputs


def _lora_rows(
    inputs: torch.Tensor,  # (tokens, in)
    weights: torch.Tensor,  # (slots, out, in) or (slots, 1, out, in)
    indices: torch.Tensor,  # (tokens,) slot per token, -1 = no LoRA
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Row r is `inputs[r] @ weights[indices[r]].T` in `dtype`, 0 where the index is -1.

    Returns None when no row has a LoRA, so callers can skip the work.
    """
    if weights.dim() == 4:
        weights = weights.squeeze(dim=1)
    if indices.numel() == 0:
        return None
    low, high = (int(bound) for bound in torch.aminmax(indices))  # cheaper than torch.unique
    if high < 0:
        return None
    x = _round_to(inputs, dtype)
    if low == high:
        return F.linear(x, _round_to(weights[low], dtype)).to(dtype)  # (tokens, out)
    outputs = x.new_zeros((x.shape[0], weights.shape[-2]))  # (tokens, out)
    for index in torch.unique(indices).tolist():
        if index < 0:
            continue
        rows = (indices == index).nonzero().squeeze(1)  # (rows,)
        outputs[rows] = F.linear(x[rows], _round_to(weights[index], dtype))  # (rows, out)
    return outputs.to(dtype)


def _round_to(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` rounded to `dtype` as vLLM's ops round it, but held in float32 if `dtype` is a half type.

    A CPU without native bf16 matmul (AVX2 only) multiplies a (tokens, 16) bf16 matrix by
    a (16, out) one about 10x slower than the same in float32; a bf16 gemm accumulates in
    float32 anyway, so the result is the same up to summation order.
    """
    rounded = tensor.to(dtype)
    return rounded.float() if dtype in (torch.bfloat16, torch.float16) else rounded


def _out_features(weights: torch.Tensor) -> int:
    return int(weights.shape[-2])
