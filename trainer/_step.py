"""What the learner takes (``TrainItem``) and what one optimizer step reports (``StepResult``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from trainer._samples import Sample

PeakMemoryKind = Literal["cuda_max_allocated", "process_max_rss"]


@dataclass(frozen=True, slots=True)
class TrainItem:
    """One sample to train on and its advantage (the same for all of its sampled tokens)."""

    sample: Sample
    advantage: float
    # Sampled by the version being trained (no staler call in it): its log-prob gap is the numerics alone.
    on_policy: bool = True


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step did. Token and sample counts cover the samples that carried loss."""

    loss: float
    clip_fraction: float  # share of loss tokens whose update the clip bounded
    ratio_mean: float  # mean importance ratio to the sampler (per sequence for gspo)
    kl: float | None  # k3 estimate of KL(policy || base), mean over loss tokens; None when kl_coef is 0
    entropy: float  # mean over loss tokens of the policy's next-token entropy, in nats
    grad_norm: float  # global L2 norm before clipping; if not finite, the step was skipped
    step_skipped: bool  # the grad norm was not finite: no optimizer step, the weights did not move
    # |trainer - sampler| log-prob per sampled token, mean and max, in nats, from the step's own forward
    # (before the update). On-policy samples: numerics alone (kernels, dtype, a temperature or top-p the
    # two disagree on): ~1e-5 with both in float32, ~0.05 with vLLM in bf16 (docs/BENCHMARKS.md).
    # Stale samples add how far the policy has moved since they were sampled.
    logprob_mismatch_mean: float
    logprob_mismatch_max: float
    log_ratio_clamped: int  # sampled tokens whose |log ratio| exceeded cfg.log_ratio_clamp
    # The mean mismatch over the on-policy samples' tokens only (TrainItem.on_policy): what the sampler's and
    # the learner's numerics alone make it, without the policy's move since a stale call. None: none on-policy.
    logprob_mismatch_on_policy: float | None
    # The sampler correction (cfg.resolved_correction): none, tis or mis; its mean weight over the loss tokens,
    # and the share of loss tokens whose learner/sampler ratio exceeded cfg.sampler_ratio_cap.
    sampler_correction: str
    sampler_weight_mean: float
    sampler_over_cap: float
    tokens: int  # the samples' tokens, prompts included (what forwarding each sample alone would cost)
    # What the step's rows laid, each prefix that samples share once (trainer._prefix_tree); the reference
    # forward of kl_coef > 0 runs them again. Per sampled (loss) token: 1 plus the context each one needed.
    forwarded_tokens: int
    forwarded_per_sampled_token: float
    loss_tokens: int
    samples: int
    micro_batches: int
    seconds: float
    tokens_per_second: float  # the samples' tokens (``tokens``) per second
    # CUDA: torch.cuda.max_memory_allocated during this step. CPU: the process's peak
    # resident set size since it started (getrusage), an upper bound, not this step's own.
    peak_memory_bytes: int | None
    peak_memory_kind: PeakMemoryKind | None
    # Structured outputs (trainer._grammar): the sampled tokens vLLM drew under a grammar, and the samples
    # holding any; the on-policy |trainer - sampler| log-prob gap of those tokens and of the others (None:
    # no such on-policy token); the constrained calls whose grammar could not be rebuilt, scored unmasked;
    # the milliseconds spent walking the sampled tokens through their grammars.
    constrained_tokens: int = 0
    constrained_samples: int = 0
    logprob_mismatch_constrained: float | None = None
    logprob_mismatch_unconstrained: float | None = None
    grammar_fallbacks: int = 0
    mask_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_item(item: TrainItem, k: int, vocab: int) -> None:
    """ValueError naming item ``k`` when it cannot train (see ``Learner.step``)."""
    s = item.sample
    n = len(s.token_ids)
    if not (len(s.loss_mask) == len(s.old_logprobs) == n):
        raise ValueError(f"item {k}: token_ids, loss_mask and old_logprobs differ in length")
    if any(math.isnan(v) for v in s.old_logprobs):
        raise ValueError(f"item {k}: an old logprob is NaN")
    if len(s.temperatures) not in (0, n) or not all(t > 0 and math.isfinite(t) for t in s.temperatures):
        raise ValueError(f"item {k}: temperatures must be one positive number per token (or none)")
    if any(not 0 < start <= end <= n for start, end, _ in s.grammars):
        raise ValueError(f"item {k}: a constrained span lies outside its tokens (or covers the first)")
    if n and s.loss_mask[0]:
        raise ValueError(f"item {k}: its first token is marked sampled, but nothing precedes it to score it")
    if any(t < 0 or t >= vocab for t in s.token_ids):
        raise ValueError(f"item {k}: a token id is outside the model's vocabulary of {vocab}")
    if not math.isfinite(item.advantage):
        raise ValueError(f"item {k}: advantage {item.advantage} is not finite")
