"""Log-probs of packed samples, scored in chunks so a batch's vocabulary logits never exist whole.

A micro-batch is one row. When its samples share a prefix (a GRPO group's prompt),
the prefix is laid once and an explicit mask lets each sample see it and itself (see
``pack_row``). Otherwise the samples' token ids go end to end, with ``position_ids``
restarting at 0 for each sample. transformers 5's ``masking_utils`` reads each restart
as a sequence boundary and builds a block-diagonal causal mask, so attention never
crosses samples and no padding is spent. It does so only when the decoder gets no
``attention_mask`` *and no cache*: the decoder's default ``use_cache=True`` creates an
empty ``DynamicCache``, which switches the detection off and lets every token attend to
the samples before it. Hence ``use_cache=False`` below; ``tests/test_trainer_learner.py``
pins that a sample scored beside another equals it scored alone (sdpa and eager).

Scoring runs the decoder body once, then ``lm_head`` + ``log_softmax`` + gather on the
hidden states of the scored positions only (in training: the sampled tokens; a prompt's
positions never reach ``lm_head``), ``chunk_tokens`` rows at a time. With grad, each chunk
runs under ``torch.utils.checkpoint``: its (C, V) logits are freed after the forward and
rebuilt in the backward, so neither pass holds more than one chunk's logits.
The logits are taken to be ``lm_head(hidden)``; models that scale or soft-cap them
(Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``) are refused by the learner.
Each scored token is scored at the temperature it was sampled at: ``log_softmax(logits / T)``
is the distribution vLLM sampled from, and the one its processed logprobs describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from tracetrain_core import common_prefix
from trainer._samples import Sample


@dataclass(frozen=True, slots=True)
class PackedRow:
    """Several samples as one row, and which of its tokens are scored."""

    input_ids: Tensor  # (1, T) long: the shared prefix once, then each member's rest
    position_ids: Tensor  # (1, T) long: each member's own positions
    # (1, 1, T, T) bool, True = may attend: each member sees the shared prefix and its own
    # tokens, causally. None when nothing is shared (transformers then derives the
    # block-diagonal mask from the position restarts).
    attention_mask: Tensor | None
    score_at: Tensor  # (P,) long: row position of the hidden state that predicts each scored token
    targets: Tensor  # (P,) long: the scored tokens
    seq: Tensor  # (P,) long in [0, len(members)): the member each scored token belongs to
    offset: Tensor  # (P,) long: each scored token's index within its own sample
    members: tuple[int, ...]  # indices into the caller's samples, in row order
    temperature: Tensor  # (P,) float32: the temperature each scored token was sampled at (1.0 if not sampled)


def pack_row(
    samples: Sequence[Sample],
    members: Sequence[int],
    *,
    loss_only: bool,
    device: torch.device,
    share_prefix: bool = True,
) -> PackedRow:
    """Lay ``samples[i] for i in members`` in one row, their common prefix only once (if ``share_prefix``).

    The samples of a GRPO group share their prompt: the row holds it once, then each
    member's remaining tokens, positioned as if they followed the prefix directly, and
    attention lets every member see the prefix and its own tokens only. Without a common
    prefix, or without ``share_prefix`` (flash attention takes no explicit mask:
    ``trainer._attention``), the members are simply laid end to end.

    Scored tokens: the sampled ones (``loss_mask``) when ``loss_only``, else every token
    but each sample's first, which has no prefix to predict it from. A scored token's
    ``score_at`` is the row position whose hidden state predicts it: for a member's first
    token after the prefix, that is the prefix's last position, shared by all members.
    """
    token_lists = [samples[i].token_ids for i in members]
    shared = 0
    if share_prefix and len(token_lists) > 1:
        shared = common_prefix(*token_lists)
    ids: list[int] = list(token_lists[0][:shared])
    positions: list[int] = list(range(shared))
    starts: list[int] = []  # row position of each member's first token after the prefix
    score_at: list[int] = []
    targets: list[int] = []
    seq: list[int] = []
    offset: list[int] = []
    temperature: list[float] = []
    for k, i in enumerate(members):
        sample = samples[i]
        temperatures = sample.temperatures or [1.0] * len(sample.token_ids)
        start = len(ids)
        starts.append(start)
        ids += sample.token_ids[shared:]
        positions += range(shared, len(sample.token_ids))
        for t in range(1, len(sample.token_ids)):
            if sample.loss_mask[t] or not loss_only:
                score_at.append(t - 1 if t <= shared else start + t - shared - 1)
                targets.append(sample.token_ids[t])
                seq.append(k)
                offset.append(t)
                temperature.append(temperatures[t])

    def longs(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    mask = None
    if shared:
        n = len(ids)
        mask = torch.zeros(n, n, dtype=torch.bool, device=device)  # (T, T)
        mask[:, :shared] = True  # everyone sees the prefix ...
        for start, end in zip(starts, [*starts[1:], n], strict=True):
            mask[start:end, start:end] = True  # ... and its own tokens
        mask &= torch.ones(n, n, dtype=torch.bool, device=device).tril()  # (T, T) causally
        mask = mask[None, None]  # (1, 1, T, T)
    return PackedRow(
        input_ids=longs(ids)[None],  # (1, T)
        position_ids=longs(positions)[None],  # (1, T)
        attention_mask=mask,
        score_at=longs(score_at),  # (P,)
        targets=longs(targets),  # (P,)
        seq=longs(seq),  # (P,)
        offset=longs(offset),  # (P,)
        members=tuple(members),
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),  # (P,)
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
    out = decoder(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=mask, use_cache=False)
    hidden: Tensor = out.last_hidden_state[0]  # (T, H)
    return hidden[row.score_at]  # (P, H)


def _score_chunk(lm_head: nn.Module, hidden: Tensor, targets: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor]:
    logits = lm_head(hidden).float() / temperature[:, None]  # (C, V) as vLLM samples: logits / T, in float32
    logp_all = logits.log_softmax(-1)  # (C, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (C,)
    # Computed after everything the backward needs, so checkpoint's recompute (which stops
    # early once it has rebuilt the saved tensors) does not redo it.
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (C,) nats, of the full next-token distribution at T
    return logp, entropy


def chunked_logprobs(
    hidden: Tensor, targets: Tensor, lm_head: nn.Module, chunk_tokens: int, temperature: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target under ``log_softmax(lm_head(hidden) / temperature)`` and that distribution's entropy.

    ``hidden`` (P, H), ``targets`` (P,), ``temperature`` (P,) positive (None: all 1.0) ->
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
        if with_grad:
            logp, entropy = checkpoint(_score_chunk, lm_head, h, t, temp, use_reentrant=False)
        else:
            logp, entropy = _score_chunk(lm_head, h, t, temp)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)  # (0,)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
