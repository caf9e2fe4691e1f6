"""Is version N worse than the version before it? A one-sided Welch t-test on group-mean rewards.

The unit of evidence is a *group*: the mean reward of the trajectories one version served
for one task. Group means of GRPO groups (several attempts at the same task) are close to
normal even when single rewards are 0/1, and averaging within a group removes most of the
attempt-to-attempt noise; groups are independent of each other, trajectories of one group
are not. The baseline's and N's variances differ (a policy that learned is more consistent),
hence Welch's test, not Student's.

Hypotheses, with ``margin`` (δ) in reward units: H0: μ_N ≥ μ_before - δ (N is no worse
than the margin allows); H1: μ_N < μ_before - δ. The statistic is

    t = (mean_N - mean_before + δ) / sqrt(s²_N / n_N + s²_before / n_before)

with Welch-Satterthwaite degrees of freedom, and H0 is rejected when P(T ≤ t) < alpha_look.

Sequential looks: N is tested after each new group from ``min_groups`` to ``max_groups``
(3 to 8 by default); it is rolled back at the first look that rejects, and kept once it
reached ``max_groups`` without one. Every look spends alpha / (number of looks) (Bonferroni),
so the chance of rolling back a version that is *not* worse is at most alpha over all looks,
whatever the order of the groups. scipy is not a dependency of the proxy: the t
distribution's CDF is computed here from the regularized incomplete beta function.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Decision = Literal["watching", "kept", "rolled_back"]


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The regression guard's test (``--regression-*`` flags; defaults in docs/TRAINING.md)."""

    margin: float = 0.05  # δ: how much worse (in reward units) still counts as "not worse"
    alpha: float = 0.05  # the chance of rolling back a version that is not worse, over all its looks
    min_groups: int = 3  # the first look, in rewarded groups of N
    max_groups: int = 8  # by then the guard has decided
    min_baseline_groups: int = 3  # fewer groups of the versions before: no test (N is kept)
    baseline_groups: int = 16  # the newest this many groups of the versions before N

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"the regression guard's alpha must be in (0, 1), got {self.alpha}")
        if self.margin < 0 or not math.isfinite(self.margin):
            raise ValueError(f"the regression guard's margin must be a finite number >= 0, got {self.margin}")
        if not 2 <= self.min_groups <= self.max_groups:
            raise ValueError(f"need 2 <= min_groups <= max_groups, got {self.min_groups} and {self.max_groups}")
        if not 2 <= self.min_baseline_groups <= self.baseline_groups:
            raise ValueError("need 2 <= min_baseline_groups <= baseline_groups")

    @property
    def alpha_per_look(self) -> float:
        return self.alpha / (self.max_groups - self.min_groups + 1)


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    n: int  # groups of N looked at
    n_baseline: int
    mean: float | None
    baseline_mean: float | None
    t: float | None
    df: float | None
    p_value: float | None  # one-sided: small means N is worse beyond the margin
    reason: str


def watch_record(baseline_version: int) -> dict[str, Any]:
    """What a freshly published version's ``adapters.guard`` starts as: watched against the version it replaced."""
    return {"state": "watching", "baseline_version": baseline_version, "since": time.time()}


def welch_worse(new: Sequence[float], before: Sequence[float], margin: float) -> tuple[float, float, float]:
    """(t, df, one-sided p) of H1: mean(new) < mean(before) - margin. Each sample needs two values or more.

    >>> round(welch_worse([0.1, 0.2, 0.15], [0.6, 0.7, 0.65, 0.55], 0.05)[2], 6) < 0.001
    True
    """
    n1, n2 = len(new), len(before)
    if n1 < 2 or n2 < 2:
        raise ValueError("Welch's test needs at least two values in each sample")
    m1, m2 = sum(new) / n1, sum(before) / n2
    v1 = sum((x - m1) ** 2 for x in new) / (n1 - 1)
    v2 = sum((x - m2) ** 2 for x in before) / (n2 - 1)
    diff = m1 - m2 + margin
    se2 = v1 / n1 + v2 / n2
    if se2 <= 1e-300:  # no variance at all: the difference is exact
        return (-math.inf if diff < 0 else math.inf), float(n1 + n2 - 2), (0.0 if diff < 0 else 1.0)
    t = diff / math.sqrt(se2)
    df = se2**2 / ((v1 / n1) ** 2 / (n1 - 1) + (v2 / n2) ** 2 / (n2 - 1))
    return t, df, student_t_cdf(t, df)


def decide(new: Sequence[float], before: Sequence[float], cfg: GuardConfig) -> Verdict:
    """The guard's look at N's first groups (at most ``max_groups`` are used) against the baseline."""
    new = list(new)[: cfg.max_groups]
    n, nb = len(new), len(before)
    mean = sum(new) / n if n else None
    base = sum(before) / nb if nb else None
    if nb < cfg.min_baseline_groups:
        if n >= cfg.max_groups:
            return Verdict("kept", n, nb, mean, base, None, None, None,
                           f"kept untested: only {nb} rewarded groups of the versions before it")  # fmt: skip
        return Verdict("watching", n, nb, mean, base, None, None, None, "waiting for groups of the versions before")
    if n < cfg.min_groups:
        return Verdict("watching", n, nb, mean, base, None, None, None, f"{n} of {cfg.min_groups} groups to a 1st look")
    t, df, p = welch_worse(new, before, cfg.margin)
    assert mean is not None and base is not None
    summary = (f"mean reward {mean:.3f} over {n} groups against {base:.3f} over {nb} groups before it "
               f"(margin {cfg.margin:g}; one-sided Welch t = {t:.2f}, df = {df:.1f}, p = {p:.2g}, "
               f"alpha per look {cfg.alpha_per_look:.2g})")  # fmt: skip
    if p < cfg.alpha_per_look:
        return Verdict("rolled_back", n, nb, mean, base, t, df, p, "worse: " + summary)
    if n >= cfg.max_groups:
        return Verdict("kept", n, nb, mean, base, t, df, p, "not worse: " + summary)
    return Verdict("watching", n, nb, mean, base, t, df, p, "no evidence yet: " + summary)


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` > 0 degrees of freedom (df need not be an integer).

    Uses P(|T| > |t|) = I_x(df/2, 1/2) with x = df / (df + t²), the regularized incomplete beta.
    """
    if math.isinf(t):
        return 0.0 if t < 0 else 1.0
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2, 0.5)
    return tail if t < 0 else 1.0 - tail


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), by the continued fraction of Numerical Recipes (``betacf``), Lentz's method."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h
