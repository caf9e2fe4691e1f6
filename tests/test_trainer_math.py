"""The RL math on hand-made tensors: config, group advantages and the four policy losses.

Expected values are computed by hand (with `math`) in each test, never by the code under test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from tracetrain_core import group_advantages as store_advantages
from trainer._advantages import group_advantages
from trainer._config import LossVariant, TrainConfig
from trainer._logprobs import chunked_logprobs
from trainer._losses import Mismatch, logprob_mismatch, policy_loss

VARIANTS: tuple[LossVariant, ...] = ("grpo", "dr_grpo", "gspo", "cispo")


def leaf(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def ratios_to_old(logp: Tensor, ratios: list[float]) -> Tensor:
    """old_logp such that exp(logp - old_logp) equals the given ratios."""
    return logp.detach() - torch.tensor([math.log(r) for r in ratios])


def all_on(n: int) -> Tensor:
    return torch.ones(n, dtype=torch.bool)


def one_seq(n: int) -> Tensor:
    return torch.zeros(n, dtype=torch.long)


# --- config ---------------------------------------------------------------------------------


def test_config_round_trips_through_json() -> None:
    cfg = TrainConfig(loss="gspo", kl_coef=0.05, target_modules=("q_proj", "v_proj"), dtype="bfloat16")
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.target_modules == ("q_proj", "v_proj")


def test_config_from_an_older_file_takes_defaults_for_missing_keys() -> None:
    assert TrainConfig.from_dict({"loss": "cispo"}) == TrainConfig(loss="cispo")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss", "ppo"),
        ("clip_low", 1.0),
        ("clip_low", 0.0),
        ("clip_high", -0.1),
        ("gspo_clip_low", 0.0),
        ("cispo_clip_high", 0.0),
        ("kl_coef", -0.01),
        ("kl_coef", float("nan")),
        ("dr_grpo_norm_tokens", 0),
        ("lora_r", 0),
        ("lora_dropout", 1.0),
        ("target_modules", ()),
        ("target_modules", ("q_proj", " ")),
        ("learning_rate", 0.0),
        ("max_grad_norm", 0.0),
        ("micro_batch_tokens", 0),
        ("logprob_chunk_tokens", 0),
        ("dtype", "float16"),
        ("min_group_size", 1),
        ("max_staleness", -1),
        ("log_ratio_clamp", 0.0),
        ("default_temperature", -0.5),
    ],
)
def test_config_rejects_bad_values_when_built_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        TrainConfig.from_dict({field: value})


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="clip_eps"):
        TrainConfig.from_dict({"clip_eps": 0.2})


def test_config_is_frozen() -> None:
    cfg = TrainConfig()
    with pytest.raises(ValidationError):
        cfg.loss = "cispo"  # type: ignore[misc]


def test_dr_grpo_does_not_scale_advantages_unless_asked() -> None:
    assert TrainConfig(loss="grpo").scale_advantages is True
    assert TrainConfig(loss="dr_grpo").scale_advantages is False
    assert TrainConfig(loss="dr_grpo", scale_rewards=True).scale_advantages is True
    assert TrainConfig(loss="grpo", scale_rewards=False).scale_advantages is False


# --- advantages -----------------------------------------------------------------------------


def test_unscaled_advantages_are_rewards_minus_group_mean() -> None:
    out = group_advantages(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0]), scale=False)
    assert out.advantages.tolist() == pytest.approx([-2.0, -1.0, 3.0])
    assert out.keep.tolist() == [True, True, True]


def test_scaled_advantages_divide_by_the_population_std() -> None:
    out = group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4, 4, 4]), scale=True)
    std = math.sqrt(((1 - 2) ** 2 + 0 + (3 - 2) ** 2) / 3)  # population: divide by n, not n - 1
    assert out.advantages.tolist() == pytest.approx([-1 / std, 0.0, 1 / std])


def test_a_group_of_two_gets_plus_and_minus_one_when_scaled() -> None:
    out = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), scale=True)
    assert out.advantages.tolist() == pytest.approx([-1.0, 1.0])


def test_zero_variance_group_is_dropped_and_counted() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0])
    out = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]), scale=True)
    assert out.keep.tolist() == [False, False, False, True, True]
    assert out.advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert (out.groups, out.dropped_groups, out.dropped_samples) == (2, 1, 3)


def test_single_sample_group_is_dropped() -> None:
    out = group_advantages(torch.tensor([5.0, 0.0, 1.0]), torch.tensor([9, 1, 1]), scale=False)
    assert out.keep.tolist() == [False, True, True]
    assert out.advantages.tolist() == pytest.approx([0.0, -0.5, 0.5])
    assert (out.groups, out.dropped_groups, out.dropped_samples) == (2, 1, 1)


def test_interleaved_groups_are_centered_separately() -> None:
    rewards = torch.tensor([0.0, 10.0, 1.0, 20.0, 2.0])
    out = group_advantages(rewards, torch.tensor([5, 9, 5, 9, 5]), scale=False)
    assert out.advantages.tolist() == pytest.approx([-1.0, -5.0, 0.0, 5.0, 1.0])
    assert out.dropped_groups == 0


def test_advantages_keep_the_reward_dtype_and_reject_bad_input() -> None:
    out = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0, 0]), scale=True)
    assert out.advantages.dtype == torch.float64
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), scale=True)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([0.0, float("inf")]), torch.tensor([0, 0]), scale=True)


def test_no_rewards_give_no_groups() -> None:
    out = group_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long), scale=True)
    assert (out.advantages.numel(), out.groups, out.dropped_groups) == (0, 0, 0)


@pytest.mark.parametrize("scale", [True, False])
def test_tensor_advantages_are_the_pure_ones_the_dashboard_shows(scale: bool) -> None:
    rewards = [0.2, 3.0, 1.0, 0.4, 0.4, 5.0, 7.0]
    groups = [2, 8, 2, 2, 2, 8, 1]
    pure = store_advantages(rewards, groups, scale=scale)
    out = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), scale=scale)
    assert out.advantages.tolist() == pure.advantages and out.keep.tolist() == pure.keep
    assert (out.groups, out.dropped_groups, out.dropped_samples) == (3, 1, 1)


# --- grpo and dr_grpo -----------------------------------------------------------------------


def test_grpo_is_the_clipped_objective_averaged_over_loss_tokens() -> None:
    # tokens: r=1.1 A=+1 (inside the clip), r=1.5 A=+1 (clipped at 1.2), r=0.5 A=-1 (clipped at 0.8),
    # then a masked token with wild values that must not count.
    logp = leaf([-1.0, -2.0, -0.5, -3.0])
    old = ratios_to_old(logp, [1.1, 1.5, 0.5, 100.0])
    adv = torch.tensor([1.0, 1.0, -1.0, 5.0])
    mask = torch.tensor([True, True, True, False])
    loss, m = policy_loss(logp, old, adv, mask, torch.tensor([0, 0, 1, 1]), TrainConfig())
    expected = (-min(1.1, 1.1) - min(1.5, 1.2) - min(-0.5, -0.8)) / 3  # = -0.5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["loss"] == pytest.approx(expected, rel=1e-6)
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    assert m["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5) / 3, rel=1e-6)
    assert (m["tokens"], m["sequences"]) == (3.0, 2.0)
    loss.backward()
    assert logp.grad is not None
    # d(-r A)/dlogp = -r A, over 3 tokens; clipped tokens and the masked one get nothing.
    assert logp.grad.tolist() == pytest.approx([-1.1 / 3, 0.0, 0.0, 0.0], abs=1e-6)


def test_dr_grpo_sums_tokens_over_sequences_times_a_constant() -> None:
    logp = leaf([-1.0, -2.0, -0.5])
    old = ratios_to_old(logp, [1.1, 1.5, 0.5])
    adv = torch.tensor([1.0, 1.0, -1.0])
    cfg = TrainConfig(loss="dr_grpo", dr_grpo_norm_tokens=4)
    loss, m = policy_loss(logp, old, adv, all_on(3), torch.tensor([0, 0, 1]), cfg)
    expected = (-1.1 - 1.2 + 0.8) / (2 * 4)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clip_fraction"] == pytest.approx(2 / 3)


def test_dr_grpo_does_not_normalize_by_length() -> None:
    # Adding an on-policy token (r=1, A=1) to a sequence adds -1/(S*C) to dr_grpo's loss,
    # whereas grpo's token mean would change every token's weight.
    cfg = TrainConfig(loss="dr_grpo", dr_grpo_norm_tokens=10)
    short, _ = policy_loss(leaf([-1.0]), torch.tensor([-1.0]), torch.tensor([1.0]), all_on(1), one_seq(1), cfg)
    long, _ = policy_loss(
        leaf([-1.0, -1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0]), all_on(2), one_seq(2), cfg
    )
    assert short.item() == pytest.approx(-1 / 10)
    assert long.item() == pytest.approx(-2 / 10)


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo"])
def test_positive_advantage_token_above_the_clip_gets_no_gradient(variant: LossVariant) -> None:
    logp = leaf([-1.0, -1.0])
    old = ratios_to_old(logp, [1.3, 1.1])  # 1.3 > 1 + 0.2
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 1.0]), all_on(2), one_seq(2), TrainConfig(loss=variant))
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].item() == 0.0
    assert logp.grad[1].item() < 0.0  # raising this token's log-prob lowers the loss


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo"])
def test_negative_advantage_token_below_the_clip_gets_no_gradient(variant: LossVariant) -> None:
    logp = leaf([-1.0, -1.0])
    old = ratios_to_old(logp, [0.7, 0.9])  # 0.7 < 1 - 0.2
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0, -1.0]), all_on(2), one_seq(2), TrainConfig(loss=variant))
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].item() == 0.0
    assert logp.grad[1].item() > 0.0


def test_the_clip_is_pessimistic_it_keeps_gradients_that_undo_a_bad_move() -> None:
    # A positive-advantage token whose ratio fell below 1 - eps, and a negative one above 1 + eps,
    # still get a gradient: min() picks the unclipped term there.
    logp = leaf([-1.0, -1.0])
    old = ratios_to_old(logp, [0.5, 1.5])
    loss, m = policy_loss(logp, old, torch.tensor([1.0, -1.0]), all_on(2), one_seq(2), TrainConfig())
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-0.5 / 2, 1.5 / 2])
    assert m["clip_fraction"] == 0.0


def test_asymmetric_clip_high_lets_positive_tokens_rise_further() -> None:
    logp = leaf([-1.0])
    old = ratios_to_old(logp, [1.25])
    cfg = TrainConfig(clip_high=0.28)
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), all_on(1), one_seq(1), cfg)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.item() == pytest.approx(-1.25)


# --- gspo -----------------------------------------------------------------------------------


def test_gspo_clips_the_sequence_ratio_and_averages_over_sequences() -> None:
    # seq 0: log ratios 0.1, 0.3 -> s = e^0.2, A=+1, clipped at 1 + 4e-4.
    # seq 1: log ratios -1e-4 x 3 -> s = e^-1e-4, A=-2, inside [1 - 3e-4, 1 + 4e-4].
    logp = leaf([-1.0, -1.0, -2.0, -2.0, -2.0])
    old = logp.detach() - torch.tensor([0.1, 0.3, -1e-4, -1e-4, -1e-4])
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0, -2.0])
    seq = torch.tensor([3, 3, 8, 8, 8])
    loss, m = policy_loss(logp, old, adv, all_on(5), seq, TrainConfig(loss="gspo"))
    s0, s1 = math.exp(0.2), math.exp(-1e-4)
    per_seq = [-min(s0 * 1, (1 + 4e-4) * 1), -min(s1 * -2, s1 * -2)]  # seq 1 unclipped: clip(s1) = s1
    expected = sum(per_seq) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx((s0 + s1) / 2, rel=1e-5)
    assert m["clip_fraction"] == pytest.approx(2 / 5)  # the two tokens of the clipped sequence
    loss.backward()
    assert logp.grad is not None
    # seq 0 is clipped: no gradient. seq 1: d(-s A / 2)/dlogp_t = -A s (1/3) / 2 = s / 3 per token.
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, s1 / 3, s1 / 3, s1 / 3], rel=1e-5)


def test_gspo_uses_the_sequence_ratio_not_token_ratios() -> None:
    # Token ratios e^0.5 and e^-0.5 would be far outside any token clip, but their
    # geometric mean is exactly 1: the sequence is not clipped and both tokens learn equally.
    logp = leaf([-1.0, -1.0])
    old = logp.detach() - torch.tensor([0.5, -0.5])
    loss, m = policy_loss(logp, old, torch.tensor([1.0, 1.0]), all_on(2), one_seq(2), TrainConfig(loss="gspo"))
    loss.backward()
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-0.5, -0.5])


# --- cispo ----------------------------------------------------------------------------------


def test_cispo_weights_logp_by_the_capped_detached_ratio() -> None:
    logp = leaf([-1.0, -2.0, -0.5])
    old = ratios_to_old(logp, [0.5, 2.0, 8.0])  # the last is capped at 1 + 4.0 = 5
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, m = policy_loss(logp, old, adv, all_on(3), one_seq(3), TrainConfig(loss="cispo"))
    w = [0.5, 2.0, 5.0]
    expected = -(w[0] * 1.0 * -1.0 + w[1] * -1.0 * -2.0 + w[2] * 2.0 * -0.5) / 3  # = 0.5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad is not None
    # Stop-gradient: the weight is a constant, so d/dlogp_t = -w_t A_t (over 3 tokens), even
    # for the capped token, where a PPO clip would give zero.
    assert logp.grad.tolist() == pytest.approx([-0.5 / 3, 2.0 / 3, -10.0 / 3], rel=1e-6)


def test_cispo_has_no_lower_bound_on_the_weight() -> None:
    logp = leaf([-1.0])
    old = ratios_to_old(logp, [0.01])
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), all_on(1), one_seq(1), TrainConfig(loss="cispo"))
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.item() == pytest.approx(-0.01, rel=1e-5)
    assert m["clip_fraction"] == 0.0


# --- KL, masking, empty batches, micro-batches ----------------------------------------------


def test_kl_term_is_zero_when_the_policy_equals_the_reference() -> None:
    logp = leaf([-1.0, -2.0])
    old = ratios_to_old(logp, [1.0, 1.0])
    adv = torch.tensor([1.0, -1.0])
    base, _ = policy_loss(logp, old, adv, all_on(2), one_seq(2), TrainConfig())
    with_kl, m = policy_loss(logp, old, adv, all_on(2), one_seq(2), TrainConfig(kl_coef=0.5), ref_logp=logp.detach())
    assert m["kl"] == 0.0
    assert with_kl.item() == pytest.approx(base.item())


def test_kl_term_is_the_k3_estimate_times_its_coefficient() -> None:
    logp = leaf([-1.0, -2.0])
    old = ratios_to_old(logp, [1.0, 1.0])
    adv = torch.tensor([0.0, 0.0])  # no policy term: the loss is the KL alone
    ref = torch.tensor([-1.5, -1.0])
    loss, m = policy_loss(logp, old, adv, all_on(2), one_seq(2), TrainConfig(kl_coef=0.1), ref_logp=ref)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert m["kl"] == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert m["kl"] > 0
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-6)


def test_kl_is_reported_but_not_added_when_its_coefficient_is_zero() -> None:
    logp = leaf([-1.0])
    old = ratios_to_old(logp, [1.0])
    loss, m = policy_loss(logp, old, torch.tensor([0.0]), all_on(1), one_seq(1), TrainConfig(), ref_logp=logp - 1)
    assert m["kl"] > 0
    assert loss.item() == 0.0


def test_kl_coefficient_without_reference_logprobs_is_an_error() -> None:
    logp = leaf([-1.0])
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp.detach(), torch.tensor([1.0]), all_on(1), one_seq(1), TrainConfig(kl_coef=0.1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_masked_tokens_never_get_gradient_nor_change_the_loss(variant: LossVariant) -> None:
    cfg = TrainConfig(loss=variant, kl_coef=0.1)
    mask = torch.tensor([False, True, False, True])
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([9.0, 1.0, -9.0, -1.0])
    losses = []
    for junk in (0.0, 50.0):
        logp = leaf([-1.0 - junk, -2.0, -3.0 + junk, -1.5])
        old = torch.tensor([-1.0 + junk, -2.2, -3.0 - junk, -1.4])
        ref = torch.tensor([-1.0 + junk, -2.1, -3.0, -1.3])
        loss, _ = policy_loss(logp, old, adv, mask, seq, cfg, ref_logp=ref)
        loss.backward()
        assert logp.grad is not None
        assert logp.grad[0].item() == 0.0
        assert logp.grad[2].item() == 0.0
        assert logp.grad[1].item() != 0.0
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_masked_batch_gives_a_zero_loss_that_still_backpropagates(variant: LossVariant) -> None:
    logp = leaf([-1.0, -2.0])
    mask = torch.zeros(2, dtype=torch.bool)
    cfg = TrainConfig(loss=variant)
    loss, m = policy_loss(logp, logp.detach() + 1, torch.tensor([1.0, 1.0]), mask, one_seq(2), cfg, ref_logp=logp)
    assert loss.item() == 0.0
    assert loss.grad_fn is not None
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == [0.0, 0.0]
    assert m["tokens"] == 0.0
    assert m["loss"] == 0.0
    assert "kl" in m


@pytest.mark.parametrize("variant", VARIANTS)
def test_micro_batch_losses_sum_to_the_whole_batch_loss(variant: LossVariant) -> None:
    cfg = TrainConfig(loss=variant, dr_grpo_norm_tokens=8)
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.2, -0.7])
    old = torch.tensor([-1.1, -1.9, -0.6, -1.0, -0.7])
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5])
    seq = torch.tensor([0, 0, 1, 1, 1])
    whole, _ = policy_loss(logp, old, adv, all_on(5), seq, cfg)
    first, _ = policy_loss(logp[:2], old[:2], adv[:2], all_on(2), seq[:2], cfg, batch_tokens=5, batch_sequences=2)
    second, _ = policy_loss(logp[2:], old[2:], adv[2:], all_on(3), seq[2:], cfg, batch_tokens=5, batch_sequences=2)
    assert first.item() + second.item() == pytest.approx(whole.item(), rel=1e-6)
    assert first.item() != pytest.approx(whole.item())


def test_mismatched_shapes_and_non_bool_masks_are_rejected() -> None:
    logp = leaf([-1.0, -2.0])
    with pytest.raises(ValueError, match="1-D of one length"):
        policy_loss(logp, torch.zeros(3), torch.zeros(2), all_on(2), one_seq(2), TrainConfig())
    with pytest.raises(ValueError, match="bool"):
        policy_loss(logp, torch.zeros(2), torch.zeros(2), torch.ones(2), one_seq(2), TrainConfig())


# --- scoring at the sampling temperature ---------------------------------------------------

# A 2-d hidden state and a 3-token vocabulary: logits = W h, with W the rows below.
W = [[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0]]


def head() -> torch.nn.Linear:
    lm_head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.tensor(W))
    return lm_head


def by_hand(h: list[float], target: int, temperature: float) -> tuple[float, float]:
    """log softmax(W h / T)[target] and the entropy of softmax(W h / T), with math."""
    logits = [sum(w * x for w, x in zip(row, h, strict=True)) / temperature for row in W]
    log_z = math.log(sum(math.exp(v) for v in logits))
    logp = [v - log_z for v in logits]
    return logp[target], -sum(math.exp(v) * v for v in logp)


HIDDEN = [[0.5, -1.0], [1.0, 1.0], [-0.3, 0.8]]
TARGETS = [1, 0, 2]


def test_temperature_one_scores_the_plain_log_softmax() -> None:
    hidden, targets = torch.tensor(HIDDEN), torch.tensor(TARGETS)
    logp, entropy = chunked_logprobs(hidden, targets, head(), 2, torch.ones(3))
    default, _ = chunked_logprobs(hidden, targets, head(), 2)
    expected = [by_hand(h, t, 1.0) for h, t in zip(HIDDEN, TARGETS, strict=True)]
    assert logp.tolist() == pytest.approx([e[0] for e in expected], abs=1e-6)
    assert entropy.tolist() == pytest.approx([e[1] for e in expected], abs=1e-6)
    assert torch.equal(default, logp)


def test_temperature_one_half_is_log_softmax_of_twice_the_logits() -> None:
    hidden, targets = torch.tensor(HIDDEN), torch.tensor(TARGETS)
    logp, _ = chunked_logprobs(hidden, targets, head(), 2, torch.full((3,), 0.5))
    twice = (2 * torch.tensor(HIDDEN) @ torch.tensor(W).T).log_softmax(-1)  # (3, 3)
    assert logp.tolist() == pytest.approx(twice.gather(-1, targets[:, None]).squeeze(-1).tolist(), abs=1e-6)
    assert logp.tolist() == pytest.approx([by_hand(h, t, 0.5)[0] for h, t in zip(HIDDEN, TARGETS, strict=True)])


def test_each_token_is_scored_at_its_own_temperature_across_chunks() -> None:
    # One row whose tokens came from calls at 0.7 and 1.0 (a merged sample); chunks of 2 split them.
    temperatures = [0.7, 0.7, 1.0]
    hidden = torch.tensor(HIDDEN, requires_grad=True)
    logp, entropy = chunked_logprobs(hidden, torch.tensor(TARGETS), head(), 2, torch.tensor(temperatures))
    expected = [by_hand(h, t, temp) for h, t, temp in zip(HIDDEN, TARGETS, temperatures, strict=True)]
    assert logp.tolist() == pytest.approx([e[0] for e in expected], abs=1e-6)
    assert entropy.tolist() == pytest.approx([e[1] for e in expected], abs=1e-6)
    # d log softmax(W h / T)[y] / dh = W^T (onehot(y) - softmax(W h / T)) / T, through the checkpointed chunks
    logp.sum().backward()
    assert hidden.grad is not None
    for i, (h, y, temp) in enumerate(zip(HIDDEN, TARGETS, temperatures, strict=True)):
        probs = [math.exp(by_hand(h, k, temp)[0]) for k in range(3)]
        grad = [sum(W[k][j] * ((k == y) - probs[k]) for k in range(3)) / temp for j in range(2)]
        assert hidden.grad[i].tolist() == pytest.approx(grad, abs=1e-6)


# --- the log-ratio clamp and the mismatch metric ---------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_log_ratio_beyond_float32_exp_gives_a_finite_loss_and_is_counted(variant: LossVariant) -> None:
    # exp(100) overflows float32; clamped at 20, the token's ratio is e^20 and it gets no gradient through it.
    logp = leaf([-1.0, -0.5])
    old = torch.tensor([-101.0, -0.6])
    loss, m = policy_loss(logp, old, torch.tensor([-1.0, 1.0]), all_on(2), one_seq(2), TrainConfig(loss=variant))
    loss.backward()
    assert math.isfinite(loss.item()) and logp.grad is not None and torch.isfinite(logp.grad).all()
    assert m["log_ratio_clamped"] == 1.0
    assert m["logprob_mismatch_max"] == pytest.approx(100.0)  # reported before the clamp


def test_the_clamped_ratio_is_exp_of_the_bound_and_carries_no_gradient() -> None:
    cfg = TrainConfig(log_ratio_clamp=2.0, clip_high=100.0)  # a wide clip, so only the clamp bounds the ratio
    logp = leaf([-1.0, -1.0, -1.0])
    old = torch.tensor([-4.0, 2.0, -1.5])  # log ratios 3 (clamped to 2), -3 (clamped to -2), 0.5
    loss, m = policy_loss(logp, old, torch.tensor([1.0, -1.0, 1.0]), all_on(3), one_seq(3), cfg)
    # per token -min(r A, clip(r) A): e^2 (A=+1, inside the wide clip); e^-2 (A=-1, below 1 - 0.2: -0.8); e^0.5
    expected = (-math.exp(2.0) + 0.8 - math.exp(0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["log_ratio_clamped"] == 2.0
    assert m["ratio_mean"] == pytest.approx((math.exp(2.0) + math.exp(-2.0) + math.exp(0.5)) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -math.exp(0.5) / 3], abs=1e-6)


def test_logprob_mismatch_is_the_mean_and_max_absolute_difference() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.25, -3.0])
    old = torch.tensor([-1.5, -2.0, -0.5, -2.0])
    assert logprob_mismatch(logp, old) == Mismatch(mean=(0.5 + 0.0 + 0.25 + 1.0) / 4, max=1.0, tokens=4)
    assert logprob_mismatch(torch.zeros(0), torch.zeros(0)) == Mismatch(0.0, 0.0, 0)


def test_policy_loss_reports_the_mismatch_of_its_loss_tokens_only() -> None:
    logp = leaf([-1.0, -2.0, -0.5])
    old = torch.tensor([-1.25, -1.5, -40.0])  # the third token is masked: its 39.5 must not count
    mask = torch.tensor([True, True, False])
    _, m = policy_loss(logp, old, torch.ones(3), mask, one_seq(3), TrainConfig())
    assert m["logprob_mismatch_mean"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["logprob_mismatch_max"] == pytest.approx(0.5)
    assert m["log_ratio_clamped"] == 0.0
