"""Group advantages (``tracetrain_core``) on hand-made lists: the math the trainer trains on and the dashboard shows.

Expected values are computed by hand (with ``math``) in each test, never by the code under test.
"""

from __future__ import annotations

import math

import pytest

from tracetrain_core import group_advantages


def test_unscaled_advantages_are_rewards_minus_group_mean() -> None:
    out = group_advantages([1.0, 2.0, 6.0], ["g", "g", "g"], scale=False)
    assert out.advantages == pytest.approx([-2.0, -1.0, 3.0])
    assert out.keep == [True, True, True]
    assert (out.groups, out.dropped_groups, out.dropped_samples) == (1, 0, 0)


def test_scaled_advantages_divide_by_the_population_std() -> None:
    out = group_advantages([1.0, 2.0, 3.0], [4, 4, 4], scale=True)
    std = math.sqrt(((1 - 2) ** 2 + 0 + (3 - 2) ** 2) / 3)  # population: divide by n, not n - 1
    assert out.advantages == pytest.approx([-1 / std, 0.0, 1 / std])


def test_a_group_of_two_gets_plus_and_minus_one_when_scaled() -> None:
    assert group_advantages([0.0, 1.0], ["g", "g"], scale=True).advantages == [-1.0, 1.0]


def test_groups_that_do_not_vary_and_groups_of_one_are_dropped_and_counted() -> None:
    out = group_advantages([0.1, 0.1, 0.1, 0.0, 1.0, 7.0], ["flat"] * 3 + ["varied"] * 2 + ["alone"], scale=True)
    assert out.keep == [False, False, False, True, True, False]
    assert out.advantages == [0.0, 0.0, 0.0, -1.0, 1.0, 0.0]
    assert (out.groups, out.dropped_groups, out.dropped_samples) == (3, 2, 4)


def test_a_group_varies_only_beyond_eps() -> None:
    # Population std of (0, d) is d / 2: 1e-6 is at eps (dropped), 1.1e-6 beyond it (kept, scaled to +-1).
    assert group_advantages([0.0, 2e-6], ["g", "g"], scale=True).keep == [False, False]
    assert group_advantages([0.0, 2.2e-6], ["g", "g"], scale=True).advantages == pytest.approx([-1.0, 1.0])


def test_interleaved_groups_are_centered_separately() -> None:
    out = group_advantages([0.0, 10.0, 1.0, 20.0, 2.0], ["a", "b", "a", "b", "a"], scale=False)
    assert out.advantages == pytest.approx([-1.0, -5.0, 0.0, 5.0, 1.0])
    assert (out.groups, out.dropped_groups) == (2, 0)


def test_no_rewards_give_no_groups() -> None:
    out = group_advantages([], [], scale=True)
    assert (out.advantages, out.keep, out.groups, out.dropped_groups) == ([], [], 0, 0)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages([0.0, float("nan")], [0, 0], scale=True)
    with pytest.raises(ValueError, match="one length"):
        group_advantages([0.0, 1.0], [0], scale=True)


# -- extreme inputs: the largest finite rewards never give a kept NaN or infinity --------------------------------------

BIG = 1e308  # two of them sum past the largest double (1.797e308)
MAX = 1.7976931348623157e308


def test_the_largest_finite_rewards_are_scaled_without_overflow() -> None:
    out = group_advantages([BIG, BIG, 0.0], ["g"] * 3, scale=True)
    # mean = 2/3 BIG, population std = BIG * sqrt(2) / 3: the advantages of (1, 1, 0) in units of BIG.
    plus, minus = (1 - 2 / 3) / (math.sqrt(2) / 3), (0 - 2 / 3) / (math.sqrt(2) / 3)
    assert out.keep == [True, True, True]
    assert out.advantages == pytest.approx([plus, plus, minus], rel=1e-12)
    assert all(math.isfinite(a) for a in out.advantages)


def test_opposite_extremes_are_scaled_to_plus_and_minus_one() -> None:
    out = group_advantages([-MAX, MAX, -MAX, MAX], ["g"] * 4, scale=True)
    assert out.advantages == [-1.0, 1.0, -1.0, 1.0] and out.keep == [True] * 4


def test_centered_advantages_that_overflow_are_dropped_never_kept() -> None:
    # Centered without scaling: (-MAX, MAX) has mean 0, so its advantages are the rewards themselves.
    out = group_advantages([-MAX, MAX, 1.0, 0.0], ["wide", "wide", "small", "small"], scale=False)
    assert out.advantages[:2] == [-MAX, MAX] and out.keep[:2] == [True, True]
    big = group_advantages([-MAX, -MAX, -MAX, MAX], ["g"] * 4, scale=False)  # mean -MAX/2: MAX + MAX/2 overflows
    assert all(math.isfinite(a) for a in big.advantages)
    assert big.keep == [False] * 4 and (big.dropped_groups, big.dropped_samples) == (1, 4)


def test_tiny_and_huge_rewards_in_one_group_keep_their_order() -> None:
    out = group_advantages([1e-300, 1e300, 0.0], ["g"] * 3, scale=True)
    assert out.keep == [True] * 3 and all(math.isfinite(a) for a in out.advantages)
    assert out.advantages[1] > 0 > out.advantages[0] and out.advantages[0] == pytest.approx(out.advantages[2])


def test_ordinary_rewards_give_the_same_advantages_as_the_plain_formula() -> None:
    rewards = [0.1, 0.7, 0.25, 1.0, 0.0, 0.33]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    out = group_advantages(rewards, ["g"] * len(rewards), scale=True)
    assert out.advantages == pytest.approx([(r - mean) / std for r in rewards], rel=1e-14, abs=1e-15)
