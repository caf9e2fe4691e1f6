"""Is the version on trial worse than the version it is tried against? A sequential paired t-test over groups.

Evidence. A canary trial splits new trajectories at random between the candidate (N) and the
baseline (B). The same task's attempts form a group; a group holding trajectories of both gives
the difference of their mean rewards, d = mean_N - mean_B: the two versions on the same task, so
the task's difficulty, which makes most of the reward's variance between groups, cancels (a
paired comparison). Groups are independent of each other; a group's d is the unit of evidence.
A group counts once every trajectory in it is rewarded: rewards arrive late and unevenly, and
a group read before it is complete would favour whichever version's attempts end (and are
rewarded) sooner. Groups are taken in the order they completed.

Test. With the margin δ (reward units), H0: μ_d ≥ -δ (N is no worse than δ allows) against
H1: μ_d < -δ. The statistic

    t = (mean_d + δ) / (s_d / √n),   Student's t with n - 1 degrees of freedom,

where s_d is the spread of d over groups: it holds how much the difference itself varies from
task to task, so the verdict speaks of the traffic's tasks, not only of those seen. A group's d
is a difference of means of bounded rewards, close to normal even for 0/1 rewards.

- **rolled back** at the first look where P(T ≤ t) < alpha/L: N is worse than the margin allows;
- **promoted** early at the first look where P(T ≥ t) < alpha/L: N is shown no worse than the margin
  (a better version is promoted as soon as that shows);
- else at the trial's bound, ``max_groups`` paired groups or ``max_s`` seconds, **promoted**: nothing
  showed it worse, and the regression guard keeps watching it; with fewer than ``min_groups``
  paired groups by then it is promoted untested, and the reason says so.

Looks come after each new paired group from ``min_groups`` to ``max_groups`` (L looks); each
spends alpha/L on each side (Bonferroni), so over the whole trial a version no worse than δ is rolled
back with probability at most alpha, and one worse than δ promoted early with probability at most alpha,
whatever order the rewards arrive in. Pure: no I/O; ``proxy.training._canary`` reads and acts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from proxy.training._regression import student_t_cdf
from store import ArmTotals, GroupArms

Decision = Literal["running", "promoted", "rolled_back"]
_CONFIDENCE = 0.95  # the intervals shown (each arm's mean reward, the paired difference)


@dataclass(frozen=True, slots=True)
class CanaryConfig:
    """A canary trial's share and test (``--canary*`` flags; docs/TRAINING.md gives the defaults' reasons)."""

    fraction: float  # the share of new trajectories the new version serves
    margin: float = 0.05  # δ: how much worse (reward units) still counts as "not worse"
    alpha: float = 0.05  # per side, over all the trial's looks
    min_groups: int = 3  # the first look, in paired groups
    max_groups: int = 8  # the size bound, in paired groups
    max_s: float = 1800.0  # the time bound

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1:
            raise ValueError(f"the canary's fraction must be in (0, 1), got {self.fraction}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"the canary's alpha must be in (0, 1), got {self.alpha}")
        if self.margin < 0 or not math.isfinite(self.margin):
            raise ValueError(f"the canary's margin must be a finite number >= 0, got {self.margin}")
        if not 2 <= self.min_groups <= self.max_groups:
            raise ValueError(f"need 2 <= min_groups <= max_groups, got {self.min_groups} and {self.max_groups}")
        if not self.max_s > 0:
            raise ValueError(f"the canary's time bound must be > 0 seconds, got {self.max_s}")

    @property
    def alpha_per_look(self) -> float:
        return self.alpha / (self.max_groups - self.min_groups + 1)


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    n: int  # paired groups looked at
    difference: float | None  # mean over groups of mean_N - mean_B
    interval: tuple[float, float] | None  # its 95% interval
    t: float | None
    df: float | None
    p_worse: float | None  # P(T <= t): small when N is worse than the margin allows
    reason: str
    by: Literal["test", "bound"] | None = None  # what decided it: the test, or the trial's bound

    def view(self) -> dict[str, Any]:
        """As JSON keeps it (an infinite t, from groups that all differ alike, is null)."""
        finite = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(self).items()}
        return {**finite, "interval": list(self.interval) if self.interval else None}


def paired_differences(groups: Sequence[GroupArms]) -> list[float]:
    """Each group's mean_N - mean_B, for the groups that hold trajectories of both versions, in their order."""
    return [
        g.candidate_mean - g.baseline_mean
        for g in groups
        if g.candidate_mean is not None and g.baseline_mean is not None
    ]


def decide(groups: Sequence[GroupArms], cfg: CanaryConfig, *, elapsed_s: float) -> Verdict:
    """The verdict on the trial's complete groups so far (the first ``max_groups`` paired ones are used)."""
    d = paired_differences(groups)[: cfg.max_groups]
    n = len(d)
    at_bound = n >= cfg.max_groups or elapsed_s >= cfg.max_s
    bound = f"{n} paired groups" if n >= cfg.max_groups else f"{elapsed_s / 60:.0f} min"
    if n < cfg.min_groups:
        mean = sum(d) / n if n else None
        if at_bound:
            return Verdict("promoted", n, mean, None, None, None, None,
                           f"promoted untested: the trial reached its bound ({bound}) with {n} paired groups, fewer "
                           f"than the {cfg.min_groups} a look needs", "bound")  # fmt: skip
        return Verdict("running", n, mean, None, None, None, None, f"{n} of {cfg.min_groups} paired groups to a look")
    mean, sd = _mean_sd(d)
    half = t_quantile(0.5 + _CONFIDENCE / 2, n - 1) * sd / math.sqrt(n)
    t, p = _t_worse(mean, sd, n, cfg.margin)
    summary = (f"candidate - baseline = {mean:+.3f} (95% interval {mean - half:+.3f} to {mean + half:+.3f}) over {n} "
               f"paired groups; margin {cfg.margin:g}, t = {t:.2f}, df = {n - 1}, P(worse) = {p:.2g}, alpha per look "
               f"{cfg.alpha_per_look:.2g}")  # fmt: skip
    decision, why, by = _verdict_of(p, cfg, at_bound, bound)
    return Verdict(decision, n, mean, (mean - half, mean + half), t, float(n - 1), p, f"{why}: {summary}", by)


def _verdict_of(
    p: float, cfg: CanaryConfig, at_bound: bool, bound: str
) -> tuple[Decision, str, Literal["test", "bound"] | None]:
    if p < cfg.alpha_per_look:
        return "rolled_back", "worse", "test"
    if 1.0 - p < cfg.alpha_per_look:
        return "promoted", "not worse", "test"
    if at_bound:
        return "promoted", f"not shown worse by its bound ({bound})", "bound"
    return "running", "no verdict yet", None


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _t_worse(mean: float, sd: float, n: int, margin: float) -> tuple[float, float]:
    """(t, P(T <= t)) of H1: the mean difference is below -margin."""
    shifted = mean + margin
    if sd <= 1e-12:  # every group differs alike: the difference is exact
        if shifted == 0:
            return 0.0, 0.5
        return (math.inf, 1.0) if shifted > 0 else (-math.inf, 0.0)
    t = shifted / (sd / math.sqrt(n))
    return t, student_t_cdf(t, n - 1)


def arm_view(totals: ArmTotals) -> dict[str, Any]:
    """What one version of a trial served: trajectories, rewarded ones, their mean reward and its 95% interval."""
    k = totals.rewarded
    mean = totals.reward_sum / k if k else None
    interval = None
    if mean is not None and k >= 2:
        var = max(0.0, (totals.reward_sq_sum - k * mean * mean) / (k - 1))
        half = t_quantile(0.5 + _CONFIDENCE / 2, k - 1) * math.sqrt(var / k)
        interval = [mean - half, mean + half]
    return {"trajectories": totals.trajectories, "rewarded": k, "mean": mean, "interval": interval}


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom, by bisection of its CDF.

    >>> round(t_quantile(0.975, 4), 3)
    2.776
    """
    lo, hi = -1e3, 1e3
    for _ in range(100):
        mid = (lo + hi) / 2
        if student_t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
