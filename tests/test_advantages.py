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
