"""FSDP2 for a base model that does not fit one device: the frozen base and the LoRA sharded over the ranks.

    --procs N --shard:  every decoder layer is one ``fully_shard`` unit, the scoring module (embeddings,
                        final norm, lm_head) the root; each rank keeps 1/N of every weight and AdamW moment
    a forward:          each layer all-gathers its weights, runs, frees them again (the root's stay
                        gathered until the backward ends: FSDP's rule for the root)
    a backward:         the LoRA gradients are reduce-scattered, as a SUM over the ranks

The loss of each rank is already its share of the whole batch's (``trainer._learner``), so the
gradients must be summed, not averaged: FSDP2 divides by the world size unless told otherwise
(``set_gradient_divide_factor(1.0)``), and gloo cannot run the PREMUL_SUM that the factor then
asks for ("Cannot use ReduceOp.PREMUL_SUM with Gloo", torch 2.13), hence
``set_force_sum_reduction_for_comms(True)``: a plain SUM, on gloo and nccl alike.

Every layer's all-gather is a collective, so every rank runs as many micro-batch forwards as
the busiest one (``padding_rounds``); a rank short of micro-batches repeats one with a loss
weight of 0. A rank that fails inside a forward leaves the others waiting in a collective until
its timeout; torchrun then stops them all (the job's lease runs out and it is queued again).

The adapter and AdamW's state are gathered after each step (``gather_lora``,
``gather_optimizer_state``: a collective on every rank, kept on rank 0 only), so that rank 0
alone writes the same files one process would; a resumed state is sharded again like each
parameter (``shard_optimizer_state``). Each rank loads the whole base on the host before
sharding it onto its device: N copies at start-up, freed once the shards are placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from trainer._logprobs import PackedRow, chunked_logprobs, hidden_states


class Scorer(nn.Module):
    """A causal LM's scoring (decoder body, then chunked lm_head log-probs) as one module.

    The learner scores through it with or without sharding. Sharded, it is FSDP's root: its
    forward hooks gather the embeddings, final norm and lm_head, which the decoder body and
    the chunked log-probs then use outside the model's own ``forward``.
    """

    def __init__(self, causal_lm: PreTrainedModel, chunk_tokens: int) -> None:
        super().__init__()
        self.lm = causal_lm
        self.chunk_tokens = chunk_tokens

    def forward(self, row: PackedRow) -> tuple[Tensor, Tensor]:
        hidden = hidden_states(self.lm, row)  # (P, H)
        lm_head = self.lm.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated upstream
        return chunked_logprobs(hidden, row.targets, lm_head, self.chunk_tokens, row.temperature, row.mask_rows,
                                row.bitmask)  # fmt: skip


def decoder_layers(causal_lm: PreTrainedModel) -> list[nn.Module]:
    """The decoder's layers (Llama, Qwen, Mistral, ...: ``get_decoder().layers``); each becomes one FSDP unit."""
    layers = getattr(causal_lm.get_decoder(), "layers", None)  # type: ignore[no-untyped-call]
    if not isinstance(layers, nn.ModuleList) or not layers:
        raise NotImplementedError(f"{type(causal_lm).__name__}: sharding needs a decoder with a `layers` list")
    return list(layers)


def shard(scorer: Scorer, device: torch.device) -> None:
    """Shard ``scorer``'s model over every rank of the process group, in place, onto ``device``."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units: list[nn.Module] = [*decoder_layers(scorer.lm), scorer]  # the root last
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        fsdp = cast(FSDPModule, unit)
        fsdp.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        fsdp.set_gradient_divide_factor(1.0)  # each rank's loss is its share: SUM is the batch's gradient


def padding_rounds(micro_batches: int, mine: int, world: int) -> int:
    """How many zero-weight forwards this rank adds so that every rank runs ceil(micro_batches / world)."""
    return -(-micro_batches // world) - mine


def full(tensor: Tensor) -> Tensor:
    """A sharded tensor gathered whole (a collective on every rank); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gather_lora(named: Sequence[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The trainable parameters gathered whole onto the CPU, by name (a collective on every rank)."""
    return {name: full(p.detach()).cpu() for name, p in named}


def gather_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each sharded moment gathered whole onto the CPU (a collective)."""
    saved = optimizer.state_dict()
    state = {i: {key: full(value).cpu() if isinstance(value, Tensor) else value for key, value in entry.items()}
             for i, entry in saved["state"].items()}  # fmt: skip
    return {"state": state, "param_groups": saved["param_groups"]}


def shard_optimizer_state(saved: dict[str, Any], params: Sequence[Tensor]) -> dict[str, Any]:
    """A state from ``gather_optimizer_state`` sharded again like each (sharded) parameter."""

    def like(value: Any, param: Tensor) -> Any:
        if isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.shape:
            # Every rank read the same file: each takes its own shard, with no communication (src_data_rank=None).
            mesh = param.device_mesh
            return distribute_tensor(value.to(mesh.device_type), mesh, param.placements, src_data_rank=None)
        return value

    state = {i: {key: like(value, params[int(i)]) for key, value in entry.items()}
             for i, entry in saved["state"].items()}  # fmt: skip
    return {"state": state, "param_groups": saved["param_groups"]}
