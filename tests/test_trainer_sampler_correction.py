"""The sampler correction (truncated / masked importance sampling) on hand-made tensors (trainer._losses)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from trainer._config import LossVariant, TrainConfig
from trainer._losses import policy_loss, sampler_weights

VARIANTS: tuple[LossVariant, ...] = ("grpo", "dr_grpo", "gspo", "cispo")


def leaf(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def sampler_at(logp: Tensor, ratios: list[float]) -> Tensor:
    """Sampler log-probs such that exp(learner - sampler) equals the given ratios."""
    return logp.detach() - torch.tensor([math.log(r) for r in ratios])


def test_tis_weight_is_the_learner_over_sampler_ratio_truncated_at_the_cap() -> None:
    learner = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    sampler = sampler_at(learner, [0.5, 1.0, 1.9, 3.0])
    w = sampler_weights(learner, sampler, "tis", 2.0, 20.0)
    assert w.weight.tolist() == pytest.approx([0.5, 1.0, 1.9, 2.0], rel=1e-5)
    assert w.over_cap.tolist() == [False, False, False, True]


def test_mis_masks_the_tokens_above_the_cap_and_keeps_the_ratio_below() -> None:
    learner = torch.tensor([-1.0, -1.0, -1.0])
    sampler = sampler_at(learner, [0.5, 1.5, 3.0])
    assert sampler_weights(learner, sampler, "mis", 2.0, 20.0).weight.tolist() == pytest.approx([0.5, 1.5, 0.0])


def test_no_correction_weighs_every_token_one() -> None:
    w = sampler_weights(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -0.1]), "none", 2.0, 20.0)
    assert w.weight.tolist() == [1.0, 1.0] and not w.over_cap.any()


def test_the_weight_never_carries_a_gradient_and_survives_a_broken_sampler_logprob() -> None:
    learner = leaf([-1.0, -2.0])
    w = sampler_weights(learner, torch.tensor([-9999.0, -2.0]), "tis", 2.0, 20.0)  # vLLM's -inf
    assert not w.weight.requires_grad
    assert torch.isfinite(w.weight).all() and w.weight.tolist() == pytest.approx([2.0, 1.0])


def test_grpo_with_tis_keeps_the_gradient_the_clip_would_remove_weighted_by_the_truncated_ratio() -> None:
    # Both tokens have A = +1 and a learner/sampler ratio of 1.5 and 3.0: against the sampler, the
    # PPO clip (1.2) zeroes both gradients; with TIS the ratio is to the learner (1) and the weights
    # are 1.5 and 2.0 (truncated).
    logp = leaf([-1.0, -2.0])
    sampler = sampler_at(logp, [1.5, 3.0])
    adv, mask, seq = torch.ones(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 1])
    plain, _ = policy_loss(logp, sampler, adv, mask, seq, TrainConfig())
    plain.backward()
    assert logp.grad is not None and logp.grad.tolist() == [0.0, 0.0]

    logp.grad = None
    loss, m = policy_loss(logp, sampler, adv, mask, seq, TrainConfig(), correction="tis")
    assert loss.item() == pytest.approx(-(1.5 + 2.0) / 2, rel=1e-5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.5 / 2, -2.0 / 2], rel=1e-5)
    assert m["clip_fraction"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    assert m["sampler_weight_mean"] == pytest.approx(1.75, rel=1e-5)
    assert m["sampler_over_cap"] == pytest.approx(0.5)
    assert m["logprob_mismatch_mean"] == pytest.approx((math.log(1.5) + math.log(3.0)) / 2, rel=1e-5)


def test_mis_gives_a_token_above_the_cap_no_gradient() -> None:
    logp = leaf([-1.0, -2.0])
    sampler = sampler_at(logp, [0.8, 3.0])
    loss, _ = policy_loss(logp, sampler, -torch.ones(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 0]),
                          TrainConfig(), correction="mis")  # fmt: skip
    loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([0.8 / 2, 0.0], rel=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_with_sampler_and_learner_equal_the_correction_changes_nothing(variant: LossVariant) -> None:
    cfg = TrainConfig(loss=variant)
    logp = leaf([-1.0, -2.0, -0.5])
    adv, mask, seq = torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, dtype=torch.bool), torch.tensor([0, 0, 1])
    plain, _ = policy_loss(logp, logp.detach().clone(), adv, mask, seq, cfg)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    corrected, _ = policy_loss(logp, logp.detach().clone(), adv, mask, seq, cfg, correction="tis")
    (corrected_grad,) = torch.autograd.grad(corrected, logp)
    assert corrected.item() == pytest.approx(plain.item(), rel=1e-6)
    assert corrected_grad.tolist() == pytest.approx(plain_grad.tolist(), rel=1e-6)


@pytest.mark.parametrize("variant", ["dr_grpo", "cispo"])
def test_token_variants_scale_each_tokens_gradient_by_its_weight(variant: LossVariant) -> None:
    cfg = TrainConfig(loss=variant, dr_grpo_norm_tokens=1)
    logp = leaf([-1.0, -2.0])
    sampler = sampler_at(logp, [0.5, 4.0])  # weights 0.5 and 2 (truncated)
    loss, _ = policy_loss(logp, sampler, torch.ones(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 0]), cfg,
                          correction="tis")  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[1].item() / grad[0].item() == pytest.approx(2.0 / 0.5, rel=1e-5)


def test_gspo_weights_each_sequence_by_the_mean_weight_of_its_tokens() -> None:
    cfg = TrainConfig(loss="gspo")
    logp = leaf([-1.0, -2.0, -0.5])
    sampler = sampler_at(logp, [0.5, 1.5, 1.0])  # sequence 0: mean weight 1.0; sequence 1: 1.0
    seq = torch.tensor([0, 0, 1])
    loss, _ = policy_loss(logp, sampler, torch.tensor([1.0, 1.0, 1.0]), torch.ones(3, dtype=torch.bool), seq, cfg,
                          correction="tis")  # fmt: skip
    assert loss.item() == pytest.approx(-1.0, rel=1e-5)
    sampler = sampler_at(logp, [3.0, 3.0, 1.0])  # sequence 0 truncated to 2
    loss, _ = policy_loss(logp, sampler, torch.tensor([1.0, 1.0, 1.0]), torch.ones(3, dtype=torch.bool), seq, cfg,
                          correction="tis")  # fmt: skip
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2, rel=1e-5)


def test_the_cap_must_exceed_one_and_the_variant_must_be_known() -> None:
    with pytest.raises(ValidationError, match="sampler_ratio_cap"):
        TrainConfig(sampler_ratio_cap=1.0)
    with pytest.raises(ValidationError, match="sampler_correction"):
        TrainConfig(sampler_correction="ppo")  # type: ignore[arg-type]  # the error under test


def test_the_resolved_correction_round_trips_with_the_config() -> None:
    cfg = TrainConfig(sampler_dtype="bfloat16", sampler_correction="mis", sampler_ratio_cap=3.0)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
