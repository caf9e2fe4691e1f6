"""Is the version on trial worse than the version it is tried against? A sequential test within groups.

Evidence. A canary trial splits new trajectories at random between the candidate (N) and the
baseline (B). The same task's attempts form a group, and a group holding trajectories of both
compares the two on one task: d_g = mean_N(g) - mean_B(g), in which the task's difficulty (most
of the reward's variance between groups) cancels. Groups are strata, as in a stratified trial:

    D = sum_g w_g d_g / sum_g w_g,   w_g = n_N(g) n_B(g) / (n_N(g) + n_B(g)),

the version's effect in an additive model of reward ~ task + version; a group split 4/4 weighs
more than one split 1/7 (Var d_g = sigma^2 / w_g). sigma^2 is the rewards' spread within a task and
a version, pooled over every paired group's cells (sum of squared deviations over sum(n_g - 2)
degrees of freedom); where no cell has two trajectories, the spread of the d_g around D
(G - 1 degrees of freedom) stands in. se(D) = sigma / sqrt(sum w_g). A group counts once every
trajectory in it is rewarded: rewards arrive late and unevenly, and a group read before it is
complete would favour whichever version's attempts end (and are rewarded) sooner. Groups are
taken in the order they completed. Trajectories outside mixed groups (each conversation its own
group, or a group one version served wholly) join strata of their own, the conversations begun
in one time window (``proxy.training._canary_windows``): each such stratum is one more paired
group here, weighed and pooled alike.

Test. With the margin delta (reward units), H0: E[D] >= -delta (N is no worse than the margin
allows) against H1: E[D] < -delta; t = (D + delta) / se(D), Student's t.

- **rolled back** at the first look where P(T <= t) < alpha/L: N is worse than the margin allows;
- **promoted** early at the first look where P(T >= t) < alpha/L: N is shown no worse than the
  margin (a better version is promoted as soon as that shows);
- else at the trial's bound, ``max_groups`` paired groups or ``max_s`` seconds, **promoted**: nothing
  showed it worse, and the regression guard keeps watching it; with fewer than ``min_groups``
  paired groups by then it is promoted untested, and the reason says so.

Looks come after each new paired group from ``min_groups`` to ``max_groups`` (L looks); each
spends alpha/L on each side (Bonferroni), so a version no worse than delta is rolled back with
probability at most alpha over the trial, whatever order the rewards arrive in, when the version's
effect is the same on every task. Where it differs from task to task (a step that helps some tasks
and hurts others) the within-task spread understates D's; measured by simulation
(``bench/canary_test.py``, docs/BENCHMARKS.md) an equal-on-average version is still rolled back in
2.5% of trials with a per-task effect of standard deviation 0.2, 4.4% at 0.3. Weighing within groups
is what makes a short trial decisive: a version rewarded 0 against 0.6 is rolled back after 3.3
paired groups on average (5.2 with a t-test over the groups' d_g alone, which lets 4% of such
versions through by the bound of 8). Pure: no I/O; ``proxy.training._canary`` reads and acts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from proxy.training._canary_windows import Windows
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
    windows: Windows = field(default_factory=Windows)  # strata outside mixed groups (``_canary_windows``)

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
    difference: float | None  # D: candidate - baseline, within groups
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


def paired(groups: Sequence[GroupArms]) -> list[GroupArms]:
    """The groups holding trajectories of both versions, in their order: the paired evidence."""
    return [g for g in groups if g.candidate_mean is not None and g.baseline_mean is not None]


@dataclass(frozen=True, slots=True)
class Within:
    """The within-group comparison of paired groups: D, its standard error and degrees of freedom."""

    difference: float
    se: float
    df: float


def within_groups(groups: Sequence[GroupArms]) -> Within | None:
    """D, se(D) and its degrees of freedom over paired ``groups`` (see the module's docstring); None if unknown."""
    both = paired(groups)
    if not both:
        return None
    # (``or 0.0`` only satisfies the type checker: a paired group has both means.)
    rows = [(g.candidate_n * g.baseline_n / (g.candidate_n + g.baseline_n),
             (g.candidate_mean or 0.0) - (g.baseline_mean or 0.0)) for g in both]  # fmt: skip
    total = sum(w for w, _ in rows)
    difference = sum(w * d for w, d in rows) / total
    df_within = sum(g.candidate_n + g.baseline_n - 2 for g in both)
    if df_within >= 1:
        variance, df = sum(g.candidate_ss + g.baseline_ss for g in both) / df_within, float(df_within)
    elif len(rows) >= 2:  # no cell holds two trajectories: the groups' spread around D
        variance, df = sum(w * (d - difference) ** 2 for w, d in rows) / (len(rows) - 1), float(len(rows) - 1)
    else:
        return None
    return Within(difference, math.sqrt(variance / total), df)


def decide(groups: Sequence[GroupArms], cfg: CanaryConfig, *, elapsed_s: float) -> Verdict:
    """The verdict on the trial's complete groups so far (the first ``max_groups`` paired ones are used).

    Every look from ``min_groups`` paired groups on is taken in turn, so the verdict is the same
    whenever (and by whichever replica) it is read: two groups completing between two reads do not
    skip the look between them."""
    used = paired(groups)[: cfg.max_groups]
    for k in range(cfg.min_groups, len(used)):
        early = _look(used[:k], cfg, elapsed_s=0.0)
        if early.decision != "running":
            return early
    return _look(used, cfg, elapsed_s=elapsed_s)


def _look(used: Sequence[GroupArms], cfg: CanaryConfig, *, elapsed_s: float) -> Verdict:
    """One look at the first ``len(used)`` paired groups; at the bound, the trial's last."""
    n = len(used)
    at_bound = n >= cfg.max_groups or elapsed_s >= cfg.max_s
    bound = f"{n} paired groups" if n >= cfg.max_groups else f"{elapsed_s / 60:.0f} min"
    within = within_groups(used)
    if n < cfg.min_groups or within is None:
        difference = within.difference if within is not None else None
        if at_bound:
            return Verdict("promoted", n, difference, None, None, None, None,
                           f"promoted untested: the trial reached its bound ({bound}) with {n} paired groups, fewer "
                           f"than the {cfg.min_groups} a look needs", "bound")  # fmt: skip
        return Verdict("running", n, difference, None, None, None, None,
                       f"{n} of {cfg.min_groups} paired groups to a look")  # fmt: skip
    mean, se, df = within.difference, within.se, within.df
    half = t_quantile(0.5 + _CONFIDENCE / 2, df) * se
    t, p = _t_worse(mean, se, df, cfg.margin)
    summary = (f"candidate - baseline = {mean:+.3f} (95% interval {mean - half:+.3f} to {mean + half:+.3f}) within "
               f"{n} paired groups{_windows_of(used)}; margin {cfg.margin:g}, t = {t:.2f}, df = {df:.0f}, "
               f"P(worse) = {p:.2g}, alpha per look {cfg.alpha_per_look:.2g}")  # fmt: skip
    decision, why, by = _verdict_of(p, cfg, at_bound, bound)
    return Verdict(decision, n, mean, (mean - half, mean + half), t, df, p, f"{why}: {summary}", by)


def _windows_of(used: Sequence[GroupArms]) -> str:
    """How many of the strata are time windows of trajectories outside mixed groups, when any are."""
    windows = sum(g.window for g in used)
    return f" ({windows} of them time windows)" if windows else ""


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


def _t_worse(mean: float, se: float, df: float, margin: float) -> tuple[float, float]:
    """(t, P(T <= t)) of H1: the difference is below -margin."""
    shifted = mean + margin
    if se <= 1e-12:  # no spread at all: the difference is exact
        if shifted == 0:
            return 0.0, 0.5
        return (math.inf, 1.0) if shifted > 0 else (-math.inf, 0.0)
    t = shifted / se
    return t, student_t_cdf(t, df)


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


@functools.lru_cache(maxsize=1024)  # a bisection of ~200 CDFs, asked again at every look for the same (q, df)
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
