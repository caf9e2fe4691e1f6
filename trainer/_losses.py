"""The policy-gradient losses: GRPO and its variants, on flattened, packed token tensors.

Inputs are per token over a packed micro-batch of T positions; ``mask`` marks the L
sampled tokens that carry loss and ``seq_index`` says which sample each belongs to.
``cfg.loss`` picks one variant from a table built at import; each is a small function.
Let r_t = exp(clamp(logp_t - old_logp_t, -c, c)) with c = ``log_ratio_clamp`` and A the
(per-token) advantage:

- ``grpo``:    -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A), mean over all loss tokens.
- ``dr_grpo``: the same per-token term, summed, divided by (sequences x ``dr_grpo_norm_tokens``).
- ``gspo``:    s_i = exp(mean over sample i's loss tokens of clamp(logp - old_logp, -c, c)),
               -min(s_i A_i, clip(s_i, 1 - gspo_clip_low, 1 + gspo_clip_high) A_i), mean over sequences.
- ``cispo``:   -sg(min(r_t, 1 + cispo_clip_high)) A logp_t, mean over all loss tokens.
- sampler correction (``correction``, the config's resolved ``sampler_correction``): with ``tis`` or
  ``mis`` the ratio r_t above is taken against the learner's own log-prob before the step,
  p_t = sg(logp_t) (one optimizer step per batch: every forward runs on the pre-step weights), and each
  token's term is multiplied by w_t = min(exp(clamp(p_t - old_logp_t, -c, c)), C) (``tis``) or by that
  ratio where it is at most C and 0 above (``mis``), detached, C = ``sampler_ratio_cap``. gspo weights
  each sequence by the mean of its tokens' w_t.
- KL (any variant, ``kl_coef > 0``): k3 = exp(ref - logp) - (ref - logp) - 1, mean over loss
  tokens, times ``kl_coef``, added to the loss.

Where this departs from the papers:

- The "old" policy is the sampler: ``old_logp`` are the logprobs vLLM returned when it
  sampled, not a trainer forward of the previous weights. So even a fully on-policy
  batch shows r != 1 where vLLM's and the trainer's numerics differ, and the clip also
  bounds that mismatch. Staler calls (``max_staleness``) are corrected by the same ratio.
  ``logprob_mismatch`` measures it; ``old_logp`` must be vLLM's processed logprobs (after
  temperature) and ``logp`` scored at the same temperature (``trainer._logprobs``).
- The log-ratio is clamped before exp (verl does the same at 20), so one broken token cannot
  overflow the ratio; a clamped token gets no gradient through its ratio.
- ``grpo`` averages over all loss tokens of the batch (DAPO's token-level mean), not
  per sequence then per group as DeepSeekMath wrote it: long samples are not down-weighted.
- ``dr_grpo``'s constant is a config field, not the generation budget, since one sample
  may span several calls of an agent.
- ``gspo``'s A_i is the mean of the sample's per-token advantages (they are equal when the
  caller broadcasts one advantage per sample, as the trainer does).
- ``cispo`` has no lower bound on the IS weight (MiniMax-M1 set it out of reach) and is
  averaged per token as in the paper.
- The sampler correction follows Yao et al., "Your efficient RL framework secretly brings you
  off-policy RL training" (2025): the PPO ratio against the learner's old policy, times a truncated
  importance weight of learner-old over sampler. It departs from it in three ways: the learner's old
  log-probs are the step's own forward (no second pass; exact since the step is one optimizer step),
  the weight also absorbs staleness (a sample one version behind is weighted by learner-now over the
  sampler that served it, AReaL's decoupled PPO, truncated), and ``mis`` masks per token (Liu et al.'s
  masked IS is per sequence; per token keeps the rest of a long agent trajectory).
- The KL term sits outside the clipped objective, as in DeepSeekMath's GRPO, averaged
  like ``grpo`` whatever the variant; the reference is the base model (adapter disabled).

When one optimizer step spans several micro-batches, pass the step's totals as
``batch_tokens`` / ``batch_sequences``: each call's loss is then its share, and the sum
over micro-batches equals the loss of the whole batch at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from trainer._config import LossVariant, TrainConfig

Correction = Literal["none", "tis", "mis"]


@dataclass(frozen=True, slots=True)
class _LossTokens:
    """The loss tokens of a micro-batch, gathered out of the packed (T,) tensors."""

    logp: Tensor  # (L,) float32, carries the gradient
    log_ratio: Tensor  # (L,) float32, clamp(logp - old_logp, -c, c): carries the gradient inside the clamp
    adv: Tensor  # (L,) float32
    weight: Tensor  # (L,) float32, detached: the sampler correction's w_t (ones without one)
    seq: Tensor  # (L,) long in [0, S): which of the S sequences each token belongs to
    n_seqs: int  # S
    token_denom: float  # loss tokens of the whole optimizer step
    seq_denom: float  # sequences of the whole optimizer step


class _Term(NamedTuple):
    loss: Tensor  # () the policy part of the loss
    clipped: Tensor  # (L,) bool: tokens whose update the variant's clip bounded
    ratio_mean: Tensor  # () mean of the ratio the variant clips


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic term per element, and where the clip removed the gradient."""
    clipped_ratio = ratio.clamp(1.0 - low, 1.0 + high)  # (K,)
    per = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (K,)
    clipped = ((ratio > 1.0 + high) & (adv > 0)) | ((ratio < 1.0 - low) & (adv < 0))  # (K,) bool
    return per, clipped


def _token_clipped(tok: _LossTokens, cfg: TrainConfig) -> tuple[Tensor, Tensor, Tensor]:
    ratio = tok.log_ratio.exp()  # (L,)
    per_token, clipped = _clipped_surrogate(ratio, tok.adv, cfg.clip_low, cfg.clip_high)  # (L,), (L,)
    return per_token * tok.weight, clipped, ratio.detach().mean()


def _grpo(tok: _LossTokens, cfg: TrainConfig) -> _Term:
    per_token, clipped, ratio_mean = _token_clipped(tok, cfg)  # (L,), (L,), ()
    return _Term(per_token.sum() / tok.token_denom, clipped, ratio_mean)


def _dr_grpo(tok: _LossTokens, cfg: TrainConfig) -> _Term:
    per_token, clipped, ratio_mean = _token_clipped(tok, cfg)  # (L,), (L,), ()
    return _Term(per_token.sum() / (tok.seq_denom * cfg.dr_grpo_norm_tokens), clipped, ratio_mean)


def _gspo(tok: _LossTokens, cfg: TrainConfig) -> _Term:
    length = tok.logp.new_zeros(tok.n_seqs).index_add(0, tok.seq, torch.ones_like(tok.logp))  # (S,)
    log_ratio = tok.logp.new_zeros(tok.n_seqs).index_add(0, tok.seq, tok.log_ratio)  # (S,)
    seq_ratio = (log_ratio / length).exp()  # (S,) geometric mean of the token ratios
    seq_adv = tok.logp.new_zeros(tok.n_seqs).index_add(0, tok.seq, tok.adv) / length  # (S,)
    per_seq, seq_clipped = _clipped_surrogate(seq_ratio, seq_adv, cfg.gspo_clip_low, cfg.gspo_clip_high)  # (S,)
    seq_weight = tok.logp.new_zeros(tok.n_seqs).index_add(0, tok.seq, tok.weight) / length  # (S,)
    per_seq = per_seq * seq_weight  # (S,)
    return _Term(per_seq.sum() / tok.seq_denom, seq_clipped[tok.seq], seq_ratio.detach().mean())


def _cispo(tok: _LossTokens, cfg: TrainConfig) -> _Term:
    ratio = tok.log_ratio.exp().detach()  # (L,)
    cap = 1.0 + cfg.cispo_clip_high
    weight = ratio.clamp(max=cap)  # (L,) stop-gradient IS weight
    per_token = -weight * tok.weight * tok.adv * tok.logp  # (L,)
    return _Term(per_token.sum() / tok.token_denom, ratio > cap, ratio.mean())


_VARIANTS: dict[LossVariant, Callable[[_LossTokens, TrainConfig], _Term]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "gspo": _gspo,
    "cispo": _cispo,
}


class Mismatch(NamedTuple):
    mean: float  # mean |logp - old_logp| over the tokens, nats
    max: float  # largest |logp - old_logp|, nats
    tokens: int


def logprob_mismatch(logp: Tensor, old_logp: Tensor) -> Mismatch:
    """How far the trainer's log-probs are from the sampler's, per sampled token: mean and max of |difference|.

    ``logp``, ``old_logp`` (L,) of the sampled tokens. Scored with the weights that sampled
    them (an on-policy batch, before the update), it measures the numerics alone: vLLM's
    kernels and dtype against the trainer's, a temperature or top-p the two disagree on.
    For stale samples it adds how far the policy has moved since.

    >>> logprob_mismatch(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]))
    Mismatch(mean=0.25, max=0.5, tokens=2)
    """
    if logp.numel() == 0:
        return Mismatch(0.0, 0.0, 0)
    diff = (logp.detach().float() - old_logp.float()).abs()  # (L,)
    return Mismatch(float(diff.mean()), float(diff.max()), logp.numel())


class SamplerWeights(NamedTuple):
    weight: Tensor  # (L,) float32, detached: what each token's loss term is multiplied by
    over_cap: Tensor  # (L,) bool: tokens whose learner/sampler ratio exceeded the cap (truncated or masked)


def sampler_weights(learner_logp: Tensor, sampler_logp: Tensor, correction: Correction, cap: float,
                    clamp: float) -> SamplerWeights:  # fmt: skip
    """The per-token weight that corrects for the gap between the learner's and the sampler's distributions.

    ``learner_logp`` (L,): the learner's log-probs of the sampled tokens under the weights before the
    step; ``sampler_logp`` (L,): vLLM's. ``tis``: min(exp(learner - sampler), cap); ``mis``: the
    ratio where it is at most ``cap``, else 0; ``none``: ones. The log-ratio is clamped to
    [-clamp, clamp] first; the weight never carries a gradient.

    >>> sampler_weights(torch.tensor([-1.0, 0.0]), torch.tensor([-1.0, -2.0]), "tis", 2.0, 20.0).weight
    tensor([1., 2.])
    """
    log_ratio = (learner_logp.detach().float() - sampler_logp.float()).clamp(-clamp, clamp)  # (L,)
    ratio = log_ratio.exp()  # (L,)
    over_cap = ratio > cap  # (L,) bool
    if correction == "tis":
        return SamplerWeights(ratio.clamp(max=cap), over_cap)
    if correction == "mis":
        return SamplerWeights(torch.where(over_cap, torch.zeros_like(ratio), ratio), over_cap)
    return SamplerWeights(torch.ones_like(ratio), torch.zeros_like(over_cap))


def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): unbiased, never negative."""
    delta = ref_logp - logp  # (L,)
    return delta.exp() - delta - 1.0  # (L,)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_index: Tensor,
    cfg: TrainConfig,
    *,
    ref_logp: Tensor | None = None,
    batch_tokens: int | None = None,
    batch_sequences: int | None = None,
    correction: Correction = "none",
) -> tuple[Tensor, dict[str, float]]:
    """The loss of ``cfg.loss`` over a packed micro-batch, and its metrics as Python floats.

    All tensors are (T,): ``logp`` the trainer's log-probs of each token (with grad),
    ``old_logp`` vLLM's sampling logprobs, ``advantages`` per token, ``mask`` True on
    sampled tokens (only they carry loss or gradient), ``seq_index`` the sample each token
    belongs to (any integers), ``ref_logp`` the base model's log-probs (needed when
    ``cfg.kl_coef > 0``). ``batch_tokens`` / ``batch_sequences``: the optimizer step's
    totals when it spans several micro-batches (default: this micro-batch's).

    Metrics: ``loss``; ``clip_fraction``, the share of loss tokens whose update the clip
    bounded (grpo/dr_grpo: zero-gradient tokens; gspo: tokens of clipped sequences; cispo:
    tokens whose weight hit the cap); ``ratio_mean`` (token ratio, or sequence ratio for
    gspo); ``kl`` when ``ref_logp`` is given; ``tokens`` and ``sequences`` carrying loss;
    ``log_ratio_clamped``, loss tokens whose |log-ratio| exceeded ``cfg.log_ratio_clamp``;
    ``logprob_mismatch_mean`` / ``_max``, ``logprob_mismatch`` of the loss tokens;
    ``sampler_weight_mean`` and ``sampler_over_cap`` (the share of loss tokens above the cap) of the
    sampler correction (``correction``: the config's ``resolved_correction``; see the module docstring).
    A micro-batch without loss tokens gives a zero loss that still backpropagates (zeros).
    """
    shape = logp.shape
    if logp.dim() != 1 or any(t.shape != shape for t in (old_logp, advantages, mask, seq_index)):
        raise ValueError("logp, old_logp, advantages, mask and seq_index must all be 1-D of one length")
    if ref_logp is not None and ref_logp.shape != shape:
        raise ValueError(f"ref_logp must have logp's shape {tuple(shape)}, got {tuple(ref_logp.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    if seq_index.dtype.is_floating_point or seq_index.dtype == torch.bool:
        raise ValueError(f"seq_index must be an integer tensor, got {seq_index.dtype}")
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp: the base model's log-probs of the same tokens")

    n_tokens = int(mask.sum())
    if n_tokens == 0:
        empty = logp[mask].sum()  # () zero, yet connected to logp: backward gives zero grads
        metrics = {"loss": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "tokens": 0.0, "sequences": 0.0,
                   "log_ratio_clamped": 0.0, "logprob_mismatch_mean": 0.0, "logprob_mismatch_max": 0.0,
                   "sampler_weight_mean": 0.0, "sampler_over_cap": 0.0}  # fmt: skip
        if ref_logp is not None:
            metrics["kl"] = 0.0
        return empty, metrics

    seq_ids, seq = torch.unique(seq_index[mask], return_inverse=True)  # (S,), (L,)
    raw_log_ratio = logp[mask].float() - old_logp[mask].float()  # (L,)
    bound = cfg.log_ratio_clamp
    weights = sampler_weights(logp[mask], old_logp[mask], correction, cfg.sampler_ratio_cap, bound)  # (L,), (L,)
    # Corrected, the ratio is to the learner before the step: exactly 1, but carrying logp's gradient.
    policy_log_ratio = logp[mask].float() - logp[mask].detach().float() if correction != "none" else raw_log_ratio
    tok = _LossTokens(
        logp=logp[mask].float(),  # (L,)
        log_ratio=policy_log_ratio.clamp(-bound, bound),  # (L,)
        adv=advantages[mask].float(),  # (L,)
        weight=weights.weight,  # (L,)
        seq=seq,  # (L,)
        n_seqs=seq_ids.numel(),
        token_denom=float(batch_tokens if batch_tokens is not None else n_tokens),
        seq_denom=float(batch_sequences if batch_sequences is not None else seq_ids.numel()),
    )
    term = _VARIANTS[cfg.loss](tok, cfg)
    loss = term.loss  # ()

    mismatch = logprob_mismatch(logp[mask], old_logp[mask])
    metrics = {
        "clip_fraction": float(term.clipped.float().mean()),
        "ratio_mean": float(term.ratio_mean),
        "tokens": float(n_tokens),
        "sequences": float(tok.n_seqs),
        "log_ratio_clamped": float((raw_log_ratio.detach().abs() > bound).sum()),
        "logprob_mismatch_mean": mismatch.mean,
        "logprob_mismatch_max": mismatch.max,
        "sampler_weight_mean": float(weights.weight.mean()),
        "sampler_over_cap": float(weights.over_cap.float().mean()),
    }
    if ref_logp is not None:
        kl = _k3(tok.logp, ref_logp[mask].float()).sum() / tok.token_denom  # ()
        metrics["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl  # ()
    metrics["loss"] = float(loss.detach())
    return loss, metrics
