"""Log-probs of packed samples, scored in chunks so a batch's vocabulary logits never exist whole.

A micro-batch is one row. Its samples are laid as their prefix tree (``trainer._prefix_tree``):
a prefix several samples share (a GRPO group's prompt; the prompts the split samples of one
trajectory share) is laid once, and each token attends to its own sample's path only, so every
sample is scored exactly as alone. The kernel gets those paths as an explicit (T, T) mask (sdpa,
eager) or as one variable-length sequence per segment with its keys gathered (flash attention:
``Varlen``, read by ``trainer._attention``). Where no sample forks off another, no mask is needed:
the samples go end to end with ``position_ids`` restarting at 0 for each, and transformers 5's
``masking_utils`` reads each restart as a sequence boundary and builds a block-diagonal causal mask,
so attention never crosses samples and no padding is spent. It does so only when the decoder gets
no ``attention_mask`` *and no cache*: the decoder's default ``use_cache=True`` creates an empty
``DynamicCache``, which switches the detection off and lets every token attend to the samples
before it. Hence ``use_cache=False`` below; ``tests/test_trainer_learner.py`` pins that a sample
scored beside another equals it scored alone (sdpa and eager).

Scoring runs the decoder body once, then ``lm_head`` + ``log_softmax`` + gather on the
hidden states of the scored positions only (in training: the sampled tokens; a prompt's
positions never reach ``lm_head``), ``chunk_tokens`` rows at a time. With grad, each chunk
runs under ``torch.utils.checkpoint``: its (C, V) logits are freed after the forward and
rebuilt in the backward, so neither pass holds more than one chunk's logits.
The logits are taken to be ``lm_head(hidden)``; models that scale or soft-cap them
(Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``) are refused by the learner.
Each scored token is scored at the temperature it was sampled at: ``log_softmax(logits / T)``
is the distribution vLLM sampled from, and the one its processed logprobs describe. A token vLLM sampled
under a grammar (structured outputs, ``trainer._grammar``) is scored with the tokens that grammar forbade
there at -inf, as vLLM masked them: its log-softmax is over the allowed tokens only. A chunk with no such
token takes the plain path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trainer._grammar import SpanMasks, unpack_bitmask
from trainer._prefix_tree import TreeLayout, lay_out
from trainer._samples import Sample


@dataclass(frozen=True, slots=True)
class Varlen:
    """A row as flash attention's variable-length input: each segment one query sequence, its keys gathered."""

    keys: Tensor  # (K,) long: row positions of each segment's keys (its path to the fork, then itself), in turn
    cu_seqlens_q: Tensor  # (S + 1,) int32: where each segment starts and ends in the row
    cu_seqlens_k: Tensor  # (S + 1,) int32: where each segment's keys start and end in ``keys``
    max_seqlen_q: int
    max_seqlen_k: int

    def kwargs(self) -> dict[str, Any]:
        """The decoder's extra keyword arguments: transformers hands them to every attention call."""
        return {"varlen_keys": self.keys, "varlen_cu_q": self.cu_seqlens_q, "varlen_cu_k": self.cu_seqlens_k,
                "varlen_max_q": self.max_seqlen_q, "varlen_max_k": self.max_seqlen_k}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PackedRow:
    """Several samples as one row, and which of its tokens are scored."""

    input_ids: Tensor  # (1, T) long: the samples' prefix tree, each shared prefix once
    position_ids: Tensor  # (1, T) long: each token's position in its own sample
    # (1, 1, T, T) bool, True = may attend: each token sees the tokens of its own sample's path,
    # causally. None when no sample forks off another (transformers then derives the block-diagonal
    # mask from the position restarts) or when ``varlen`` stands for it.
    attention_mask: Tensor | None
    varlen: Varlen | None  # flash attention's layout of the same paths; None for the mask kernels
    score_at: Tensor  # (P,) long: row position of the hidden state that predicts each scored token
    targets: Tensor  # (P,) long: the scored tokens
    seq: Tensor  # (P,) long in [0, len(members)): the member each scored token belongs to
    offset: Tensor  # (P,) long: each scored token's index within its own sample
    members: tuple[int, ...]  # indices into the caller's samples, in row order
    temperature: Tensor  # (P,) float32: the temperature each scored token was sampled at (1.0 if not sampled)
    # Constrained tokens: each scored token's row in ``bitmask`` (-1: unconstrained), and the packed
    # allowed-token bitmasks (M, ceil(V / 32)) int32. None: no scored token of the row is constrained.
    mask_rows: Tensor | None = None
    bitmask: Tensor | None = None
    # (P,) bool: the scored tokens vLLM sampled under a grammar (``Sample.grammars``), masked or not. None: none.
    constrained: Tensor | None = None

    @property
    def tokens(self) -> int:
        """The tokens this row forwards."""
        return int(self.input_ids.shape[1])


def pack_row(
    samples: Sequence[Sample],
    members: Sequence[int],
    *,
    loss_only: bool,
    device: torch.device,
    share_prefix: bool = True,
    varlen: bool = False,
    masks: Sequence[SpanMasks] | None = None,
) -> PackedRow:
    """Lay ``samples[i] for i in members`` in one row: as their prefix tree (``share_prefix``), else each whole.

    ``varlen``: describe the paths as flash attention's variable-length sequences instead of a mask.
    ``masks``: per sample (indexed like ``samples``), its constrained spans and their bitmasks.

    Scored tokens: the sampled ones (``loss_mask``) when ``loss_only``, else every token
    but each sample's first, which has no prefix to predict it from. A scored token's
    ``score_at`` is the row position whose hidden state predicts it: the position of the token
    before it in its own sample, which a shared prefix holds once for every sample that has it.
    """
    layout = lay_out([samples[i].token_ids for i in members], share=share_prefix)
    score_at: list[int] = []
    targets: list[int] = []
    seq: list[int] = []
    offset: list[int] = []
    temperature: list[float] = []
    mask_rows: list[int] = []
    bitmasks: list[Tensor] = []
    constrained: list[bool] = []
    for k, i in enumerate(members):
        sample = samples[i]
        temperatures = sample.temperatures or [1.0] * len(sample.token_ids)
        where = layout.where[k]
        row_of = [-1] * len(sample.token_ids)
        under = [False] * len(sample.token_ids)
        for start, end, _ in sample.grammars:
            under[start:end] = [True] * (end - start)
        for start, end, bitmask in masks[i] if masks is not None else ():
            first = sum(len(b) for b in bitmasks)
            row_of[start:end] = range(first, first + end - start)
            bitmasks.append(bitmask)
        for t in range(1, len(sample.token_ids)):
            if sample.loss_mask[t] or not loss_only:
                score_at.append(where[t - 1])
                targets.append(sample.token_ids[t])
                seq.append(k)
                offset.append(t)
                temperature.append(temperatures[t])
                mask_rows.append(row_of[t])
                constrained.append(under[t])

    def longs(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    forks = any(segment.fork >= 0 for segment in layout.segments)
    return PackedRow(
        input_ids=longs(layout.ids)[None],  # (1, T)
        position_ids=longs(layout.positions)[None],  # (1, T)
        attention_mask=_tree_mask(layout, device) if forks and not varlen else None,
        varlen=_varlen(layout, device) if varlen else None,
        score_at=longs(score_at),  # (P,)
        targets=longs(targets),  # (P,)
        seq=longs(seq),  # (P,)
        offset=longs(offset),  # (P,)
        members=tuple(members),
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),  # (P,)
        mask_rows=longs(mask_rows) if bitmasks else None,  # (P,)
        bitmask=torch.cat(bitmasks).to(device) if bitmasks else None,  # (M, W)
        constrained=torch.tensor(constrained, dtype=torch.bool, device=device) if any(constrained) else None,  # (P,)
    )


def _tree_mask(layout: TreeLayout, device: torch.device) -> Tensor:
    """(1, 1, T, T) bool: row token i may attend row token j iff j is on i's path (itself included)."""
    n = len(layout.ids)
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)  # (T, T)
    for segment in layout.segments:  # in row order: a fork's row is complete before its branches copy it
        rows = slice(segment.start, segment.end)
        if segment.fork >= 0:
            mask[rows] = mask[segment.fork]  # the path up to the fork ...
        length = segment.end - segment.start
        mask[rows, rows] = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # ... then causally
    return mask[None, None]  # (1, 1, T, T)


def _varlen(layout: TreeLayout, device: torch.device) -> Varlen:
    per_segment = [layout.keys(segment) for segment in layout.segments]
    keys = [i for segment_keys in per_segment for i in segment_keys]
    cu_q = [0, *(segment.end for segment in layout.segments)]  # the segments cut the row in order
    cu_k = [0, *itertools.accumulate(len(k) for k in per_segment)]
    return Varlen(
        keys=torch.tensor(keys, dtype=torch.long, device=device),  # (K,)
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),  # (S + 1,)
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),  # (S + 1,)
        max_seqlen_q=max((segment.end - segment.start for segment in layout.segments), default=0),
        max_seqlen_k=max((len(k) for k in per_segment), default=0),
    )


def hidden_states(model: PreTrainedModel, row: PackedRow) -> Tensor:
    """The decoder body's final (normed) hidden states of the row's scoring positions: (P, H)."""
    decoder = model.get_decoder()  # type: ignore[no-untyped-call]  # unannotated upstream
    mask = row.attention_mask
    if mask is not None and model.config._attn_implementation == "eager":
        # eager attention adds its mask to the scores: 0 where allowed, a large negative elsewhere
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(model.dtype).min
        )  # (1, 1, T, T)
    extra = row.varlen.kwargs() if row.varlen is not None else {}
    out = decoder(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=mask, use_cache=False,
                  **extra)  # fmt: skip
    hidden: Tensor = out.last_hidden_state[0]  # (T, H)
    return hidden[row.score_at]  # (P, H)


def _score_chunk(lm_head: nn.Module, hidden: Tensor, targets: Tensor, temperature: Tensor,
                 allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    logits = lm_head(hidden).float() / temperature[:, None]  # (C, V) as vLLM samples: logits / T, in float32
    if allowed is not None:  # (C, V) bool: what the grammar let vLLM sample, the rest at -inf as vLLM sets it
        logits = logits.masked_fill(~allowed, float("-inf"))  # (C, V)
    logp_all = logits.log_softmax(-1)  # (C, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (C,)
    # Computed after everything the backward needs, so checkpoint's recompute (which stops
    # early once it has rebuilt the saved tensors) does not redo it.
    with torch.no_grad():
        # of the next-token distribution at T (masked where constrained); a forbidden token adds 0, not 0 * -inf
        entropy = -(logp_all.exp() * logp_all.clamp(min=torch.finfo(torch.float32).min)).sum(-1)  # (C,) nats
    return logp, entropy


def _allowed(mask_rows: Tensor, bitmask: Tensor, vocab: int) -> Tensor | None:
    """(C, V) bool of a chunk whose scored tokens index ``bitmask`` by ``mask_rows`` (C,); None: none constrained."""
    constrained = mask_rows >= 0  # (C,)
    if not bool(constrained.any()):
        return None
    allowed = torch.ones(mask_rows.shape[0], vocab, dtype=torch.bool, device=bitmask.device)  # (C, V)
    allowed[constrained] = unpack_bitmask(bitmask[mask_rows[constrained]], vocab)  # (K, V)
    return allowed


def chunked_logprobs(
    hidden: Tensor,
    targets: Tensor,
    lm_head: nn.Module,
    chunk_tokens: int,
    temperature: Tensor | None = None,
    mask_rows: Tensor | None = None,
    bitmask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target under ``log_softmax(lm_head(hidden) / temperature)`` and that distribution's entropy.

    ``hidden`` (P, H), ``targets`` (P,), ``temperature`` (P,) positive (None: all 1.0), ``mask_rows`` (P,)
    and ``bitmask`` (M, W) as ``PackedRow`` holds them (None: no grammar; the forbidden logits at -inf) ->
    ``logp`` (P,) float32 (with grad when ``hidden`` has one) and ``entropy`` (P,) float32
    (never with grad).
    """
    if temperature is None:
        temperature = torch.ones(targets.shape, dtype=torch.float32, device=hidden.device)  # (P,)
    logps: list[Tensor] = []
    entropies: list[Tensor] = []
    with_grad = torch.is_grad_enabled() and hidden.requires_grad
    for lo in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[lo : lo + chunk_tokens]  # (C, H)
        t = targets[lo : lo + chunk_tokens]  # (C,)
        temp = temperature[lo : lo + chunk_tokens]  # (C,)
        allowed = None
        if mask_rows is not None and bitmask is not None:
            allowed = _allowed(mask_rows[lo : lo + chunk_tokens], bitmask, _vocab(lm_head))  # (C, V) or None
        if with_grad:
            logp, entropy = checkpoint(_score_chunk, lm_head, h, t, temp, allowed, use_reentrant=False)
        else:
            logp, entropy = _score_chunk(lm_head, h, t, temp, allowed)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)  # (0,)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def _vocab(lm_head: nn.Module) -> int:
    weight = lm_head.weight
    assert isinstance(weight, Tensor)
    return int(weight.shape[0])
