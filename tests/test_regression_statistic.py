"""The regression guard's test (``proxy.training._regression``): the t distribution, and its error rates.

Rewards are simulated per group as the mean of ``size`` attempts, each a seeded Bernoulli
draw (0/1 rewards, the hardest case for a normal approximation). "Equal" versions share a
success rate; the false-rollback rate over many seeds must stay under the configured alpha.
"""

from __future__ import annotations

import math
import random

import pytest

from proxy.training._regression import GuardConfig, decide, regularized_beta, student_t_cdf, welch_worse

CFG = GuardConfig()


def group_means(rng: random.Random, p: float, n_groups: int, size: int = 8) -> list[float]:
    return [sum(rng.random() < p for _ in range(size)) / size for _ in range(n_groups)]


def guard_rolls_back(rng: random.Random, p_before: float, p_new: float, cfg: GuardConfig = CFG) -> tuple[bool, int]:
    before = group_means(rng, p_before, cfg.baseline_groups)
    return first_decision(group_means(rng, p_new, cfg.max_groups), before, cfg)


def first_decision(new: list[float], before: list[float], cfg: GuardConfig = CFG) -> tuple[bool, int]:
    """Feed N's groups one at a time, as they complete; (rolled back?, groups seen at the decision)."""
    for n in range(1, cfg.max_groups + 1):
        verdict = decide(new[:n], before, cfg)
        if verdict.decision != "watching":
            return verdict.decision == "rolled_back", n
    raise AssertionError("no decision within max_groups")


@pytest.mark.parametrize("t", [-12.0, -3.0, -1.0, -0.2, 0.0, 0.5, 2.5, 40.0])
def test_the_t_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(t: float) -> None:
    cauchy = 0.5 + math.atan(t) / math.pi
    two = 0.5 + t / (2 * math.sqrt(2 + t * t))
    assert student_t_cdf(t, 1) == pytest.approx(cauchy, rel=1e-9)
    assert student_t_cdf(t, 2) == pytest.approx(two, rel=1e-9)


def test_the_t_cdf_gives_the_tabled_critical_values() -> None:
    # One-sided 5% and 1% points from any t table; a large df is the normal distribution.
    for t, df, p in ((-2.015048, 5, 0.05), (-1.812461, 10, 0.05), (-2.467140, 28, 0.01), (-1.644854, 1e7, 0.05)):
        assert student_t_cdf(t, df) == pytest.approx(p, rel=1e-5)
    assert regularized_beta(0.3, 2.0, 3.0) == pytest.approx(0.3483, rel=1e-4)  # the binomial sum for integer a, b


def test_welch_says_an_exact_difference_when_nothing_varies() -> None:
    assert welch_worse([0.0, 0.0], [1.0, 1.0, 1.0], 0.05)[2] == 0.0
    assert welch_worse([0.98, 0.98], [1.0, 1.0, 1.0], 0.05)[2] == 1.0  # within the margin: not worse


def test_equal_versions_are_rarely_rolled_back_over_many_seeds() -> None:
    seeds = 2000
    for p in (0.2, 0.5, 0.8):
        rolled = sum(guard_rolls_back(random.Random(seed), p, p)[0] for seed in range(seeds))
        rate = rolled / seeds
        print(f"success rate {p}: false rollbacks {rolled}/{seeds} = {rate:.4f} (alpha {CFG.alpha})")
        assert rate <= CFG.alpha / 2, (p, rate)


def mixed_difficulty(rng: random.Random, n_groups: int, size: int = 8) -> list[float]:
    """Groups of requests that differ in difficulty: 3 in 10 hard (success 0.1), the rest easy (0.85)."""
    rates = [0.1 if rng.random() < 0.3 else 0.85 for _ in range(n_groups)]
    return [sum(rng.random() < p for _ in range(size)) / size for p in rates]


def test_equal_versions_on_requests_of_mixed_difficulty_are_rarely_rolled_back() -> None:
    # Group means are then a mixture, far from normal, and a version whose first groups are all hard requests
    # varies little among them (the demo's tool task meets four such requests in a row): the rate still holds.
    seeds, rolled = 2000, 0
    for seed in range(seeds):
        rng = random.Random(seed)
        before, new = mixed_difficulty(rng, CFG.baseline_groups), mixed_difficulty(rng, CFG.max_groups)
        rolled += first_decision(new, before)[0]
    print(f"mixed difficulty: false rollbacks {rolled}/{seeds} = {rolled / seeds:.4f} (alpha {CFG.alpha})")
    assert rolled / seeds <= CFG.alpha


def test_a_much_worse_version_is_rolled_back_within_eight_groups_and_a_better_one_never() -> None:
    seeds = 500
    worse = [guard_rolls_back(random.Random(seed), 0.7, 0.3) for seed in range(seeds)]
    caught = [n for rolled, n in worse if rolled]
    print(f"0.7 -> 0.3: rolled back {len(caught)}/{seeds}, after {sum(caught) / len(caught):.1f} groups on average")
    assert len(caught) / seeds >= 0.95 and max(caught) <= 8
    assert not any(guard_rolls_back(random.Random(seed), 0.4, 0.7)[0] for seed in range(seeds))


def test_a_decision_needs_a_baseline_and_comes_by_max_groups() -> None:
    assert decide([0.1, 0.1, 0.2], [0.9, 0.8], CFG).decision == "watching"  # 2 baseline groups: too few
    kept = decide([0.1] * 8, [0.9, 0.8], CFG)
    assert kept.decision == "kept" and "untested" in kept.reason
    assert decide([0.5, 0.6], [0.5, 0.6, 0.55], CFG).decision == "watching"  # before the first look
    assert decide([0.5, 0.6, 0.55, 0.5, 0.6, 0.55, 0.5, 0.6, 0.0], [0.5, 0.6, 0.55], CFG).n == 8  # never past 8


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"alpha": 0.0}, "alpha"), ({"margin": -0.1}, "margin"), ({"min_groups": 9}, "min_groups"),
     ({"min_baseline_groups": 1}, "min_baseline_groups")],
)  # fmt: skip
def test_a_bad_guard_config_is_refused_when_built(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuardConfig(**fields)  # type: ignore[arg-type]
