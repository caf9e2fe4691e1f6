"""The canary's paired test (a pure function) and the gateway's split of new trajectories, on hand-made groups."""

from __future__ import annotations

import random

import pytest

from proxy.gateway import Split
from proxy.gateway._split import draw
from proxy.training import CanaryConfig
from proxy.training._canary_verdict import arm_view, decide, paired, t_quantile, within_groups
from proxy.training._canary_windows import Windows, window_strata
from store import ArmTotals, GroupArms, TrialUnit

CFG = CanaryConfig(fraction=0.5)  # min 3, max 8 paired groups, margin 0.05, alpha 0.05
_ids = iter(range(10**9))


def group(candidate: list[float], baseline: list[float]) -> GroupArms:
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    def spread(xs: list[float]) -> float:
        return sum((x - (mean(xs) or 0.0)) ** 2 for x in xs)

    return GroupArms(f"g{next(_ids)}", len(candidate), mean(candidate), spread(candidate), len(baseline),
                     mean(baseline), spread(baseline), 0.0)  # fmt: skip


def test_only_groups_holding_both_versions_are_paired_evidence() -> None:
    groups = [group([1.0], [0.0]), group([1.0, 1.0], []), group([], [0.5]), group([0.5, 0.0], [1.0])]
    assert [g.candidate_mean for g in paired(groups)] == [1.0, 0.25]


def test_the_difference_weighs_each_group_by_its_split_and_its_spread_is_pooled_within_groups() -> None:
    within = within_groups([group([1.0, 0.0], [0.0, 0.0, 0.0]), group([0.5], [1.0, 0.5])])
    # w = 2*3/5 = 1.2 and 1*2/3; d = 0.5 and -0.25; spread 0.5 + 0.125 over (3 + 1) degrees of freedom
    assert within is not None
    assert within.difference == pytest.approx((1.2 * 0.5 + 2 / 3 * -0.25) / (1.2 + 2 / 3))
    assert within.se == pytest.approx((0.625 / 4 / (1.2 + 2 / 3)) ** 0.5) and within.df == 4
    # One trajectory per version per group: the groups' own spread around the difference stands in.
    ones = within_groups([group([1.0], [0.0]), group([0.0], [0.0]), group([1.0], [1.0])])
    assert ones is not None and ones.df == 2 and ones.difference == pytest.approx(1 / 3)
    assert ones.se == pytest.approx((0.5 * ((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2 / 1.5) ** 0.5)


def test_a_version_worse_in_every_group_is_rolled_back_as_soon_as_a_look_shows_it() -> None:
    worse = [group([0.0, 0.0, 0.0], [0.75, 0.5, 1.0, 0.5]), group([0.0, 0.25], [0.5, 0.75]),
             group([0.0], [1.0, 0.5, 0.25]), group([0.0, 0.0], [0.5, 0.5, 0.75]), group([0.0], [0.5, 1.0])]  # fmt: skip
    looks = [decide(worse[:n], CFG, elapsed_s=60).decision for n in range(1, 6)]
    verdict = decide(worse, CFG, elapsed_s=60)
    assert looks[:2] == ["running", "running"] and "rolled_back" in looks
    assert verdict.decision == "rolled_back" and verdict.by == "test" and verdict.reason.startswith("worse: ")
    assert verdict.difference is not None and verdict.difference < -0.5
    assert verdict.p_worse is not None and verdict.p_worse < CFG.alpha_per_look
    assert verdict.interval is not None and verdict.interval[1] < 0


def test_an_equal_version_runs_to_the_size_bound_and_is_promoted() -> None:
    rng = random.Random(2)
    equal = [group([float(rng.random() < 0.5) for _ in range(4)], [float(rng.random() < 0.5) for _ in range(4)])
             for _ in range(10)]  # fmt: skip
    running = decide(equal[:7], CFG, elapsed_s=60)
    verdict = decide(equal, CFG, elapsed_s=60)
    assert running.decision == "running" and running.reason.startswith("no verdict yet")
    assert verdict.decision == "promoted" and verdict.by == "bound" and verdict.n == 8  # the first 8 paired groups
    assert "not shown worse by its bound (8 paired groups)" in verdict.reason


def test_a_clearly_better_version_is_promoted_before_the_bound() -> None:
    better = [group([1.0, 1.0, 0.75], [0.0, 0.25]), group([1.0, 0.75], [0.25, 0.0, 0.0]), group([1.0], [0.0, 0.25]),
              group([0.75, 1.0], [0.0]), group([1.0, 1.0], [0.25, 0.0])]  # fmt: skip
    verdict = decide(better, CFG, elapsed_s=60)
    assert verdict.decision == "promoted" and verdict.by == "test" and verdict.reason.startswith("not worse: ")


def test_groups_that_differ_alike_decide_at_the_first_look() -> None:
    same = [group([0.0], [0.6]) for _ in range(3)]
    assert decide(same, CFG, elapsed_s=1).decision == "rolled_back"
    assert decide([group([0.6], [0.6]) for _ in range(3)], CFG, elapsed_s=1).decision == "promoted"
    assert decide([group([0.6], [0.6]) for _ in range(3)], CFG, elapsed_s=1).view()["t"] is None  # inf: not JSON


def test_too_few_paired_groups_wait_and_the_time_bound_promotes_untested() -> None:
    two = [group([0.0], [1.0]), group([0.0], [1.0])]
    waiting = decide(two, CFG, elapsed_s=60)
    at_bound = decide(two, CFG, elapsed_s=CFG.max_s)
    assert waiting.decision == "running" and waiting.reason == "2 of 3 paired groups to a look"
    assert at_bound.decision == "promoted" and at_bound.by == "bound" and at_bound.reason.startswith(
        "promoted untested: the trial reached its bound (30 min) with 2 paired groups"
    )


def test_the_time_bound_decides_on_the_evidence_it_has() -> None:
    rng = random.Random(4)
    some = [group([float(rng.random() < 0.5) for _ in range(3)], [float(rng.random() < 0.5) for _ in range(3)])
            for _ in range(4)]  # fmt: skip
    assert decide(some, CFG, elapsed_s=60).decision == "running"
    verdict = decide(some, CFG, elapsed_s=CFG.max_s + 1)
    assert verdict.decision == "promoted" and verdict.by == "bound" and verdict.n == 4


def test_every_look_is_taken_however_late_the_verdict_is_read() -> None:
    """A look that decides stays the verdict when more groups complete before anyone reads it."""
    decisive = [group([0.6], [0.6]) for _ in range(3)]  # shown no worse at the first look
    noisy = [group([0.0, 0.0], [1.0, 1.0]), group([0.0, 1.0], [1.0, 0.0])]
    read_late = decide(decisive + noisy, CFG, elapsed_s=60)
    assert read_late == decide(decisive, CFG, elapsed_s=60)
    assert read_late.decision == "promoted" and read_late.by == "test" and read_late.n == 3


def simulate(
    rng: random.Random, cfg: CanaryConfig, candidate_p: float, baseline_p: float, effect_sd: float = 0.0
) -> tuple[str, int]:
    """One trial on groups of 8 attempts at tasks of random difficulty, split at random; (verdict, groups).

    ``effect_sd``: how much the candidate's effect differs from task to task (0: alike on every task)."""
    groups: list[GroupArms] = []
    while True:
        task = rng.uniform(-0.3, 0.3)  # some tasks are easier for both versions
        effect = rng.gauss(0.0, effect_sd) if effect_sd else 0.0
        arms: tuple[list[float], list[float]] = ([], [])
        for _ in range(8):
            on_trial = rng.random() < cfg.fraction
            p = min(1.0, max(0.0, (candidate_p + effect if on_trial else baseline_p) + task))
            arms[0 if on_trial else 1].append(float(rng.random() < p))
        groups.append(group(*arms))
        verdict = decide(groups, cfg, elapsed_s=0)
        if verdict.decision != "running":
            return verdict.decision, len(groups)


@pytest.mark.parametrize("effect_sd", [0.0, 0.2])
def test_an_equal_version_is_rolled_back_at_most_alpha_of_the_time(effect_sd: float) -> None:
    rng = random.Random(11)
    verdicts = [simulate(rng, CFG, 0.5, 0.5, effect_sd)[0] for _ in range(1000)]
    assert verdicts.count("rolled_back") / len(verdicts) <= CFG.alpha


def test_a_version_scoring_0_against_0_6_is_rolled_back_in_a_few_groups_nearly_always() -> None:
    rng = random.Random(12)
    outcomes = [simulate(rng, CFG, -1.0, 0.6) for _ in range(500)]  # 0 whatever the task: the bench's bad version
    assert sum(v == "rolled_back" for v, _ in outcomes) / len(outcomes) >= 0.99
    assert sum(n for _, n in outcomes) / len(outcomes) < 4.5


def test_each_arm_is_shown_with_its_mean_and_95_percent_interval() -> None:
    view = arm_view(ArmTotals(trajectories=10, rewarded=4, reward_sum=2.0, reward_sq_sum=2.0))
    assert view["mean"] == 0.5 and view["interval"] == pytest.approx([0.5 - 3.182 * 0.2887, 0.5 + 3.182 * 0.2887],
                                                                     abs=1e-3)  # fmt: skip
    assert arm_view(ArmTotals(3, 0, 0.0, 0.0)) == {"trajectories": 3, "rewarded": 0, "mean": None, "interval": None}
    assert t_quantile(0.975, 1000) == pytest.approx(1.962, abs=1e-3)


def unit(version: int, begun_at: float, reward: float | None, rewarded_at: float = 0.0,
         active_at: float | None = None) -> TrialUnit:  # fmt: skip
    """A conversation of its own (an ungrouped one) that ``version`` served, begun at ``begun_at``, its last call
    at ``active_at`` (a second after it began unless said)."""
    active = begun_at + 1.0 if active_at is None else active_at
    return TrialUnit(f"u{next(_ids)}", version, begun_at, active, reward is not None, reward or 0.0, rewarded_at)


WINDOWS = Windows(window_s=10.0, wait_s=300.0, grace_s=2.0, min_each=2)


def strata(units: list[TrialUnit], now: float) -> list[GroupArms]:
    return window_strata(units, candidate=1, started_at=0.0, now=now, windows=WINDOWS)


def test_a_window_counts_once_every_conversation_begun_in_it_is_rewarded_and_later_ones_wait_for_it() -> None:
    # Window 0 (0-10 s): the candidate's conversations end fast, rewarded 0; one of the baseline's is slow.
    first = [unit(1, 1.0, 0.0, 3.0), unit(1, 2.0, 0.0, 4.0), unit(0, 3.0, 1.0, 6.0), unit(0, 4.0, 1.0, 8.0),
             unit(0, 5.0, None)]  # fmt: skip
    second = [unit(1, 11.0, 0.0, 13.0), unit(1, 12.0, 0.0, 14.0), unit(0, 13.0, 1.0, 15.0), unit(0, 14.0, 0.0, 16.0)]
    assert strata(first + second, now=9.0) == []  # window 0 has not ended
    assert strata(first + second, now=30.0) == []  # its slow conversation's reward: window 1 waits with it
    rewarded = [*first[:4], unit(0, 5.0, 0.0, 40.0)]
    done = strata(rewarded + second, now=41.0)
    assert [(s.candidate_n, s.candidate_mean, s.baseline_n, s.baseline_mean) for s in done] == [
        (2, 0.0, 3, pytest.approx(2 / 3)), (2, 0.0, 2, 0.5)]  # fmt: skip
    assert all(s.window for s in done) and done[0].completed_at == 40.0 and done[1].completed_at == 20.0
    assert done[0].baseline_ss == pytest.approx(2 / 3)  # the units' spread within the window
    # A reward that never comes: the window counts without it once the conversation has waited wait_s since its
    # last call; a long conversation, still calling, holds its window however long ago it began.
    assert len(strata(first + second, now=306.5)) == 2
    still_calling = [*first[:4], unit(0, 5.0, None, active_at=400.0)]
    assert strata(still_calling + second, now=500.0) == []


def test_consecutive_windows_join_until_a_stratum_holds_two_of_each_version() -> None:
    units = [unit(1, 1.0, 0.0, 2.0), unit(0, 2.0, 1.0, 3.0), unit(0, 12.0, 1.0, 13.0), unit(1, 25.0, 0.0, 26.0),
             unit(0, 31.0, 1.0, 32.0), unit(0, 32.0, 1.0, 33.0)]  # fmt: skip
    only = strata(units, now=100.0)
    assert [(s.group_id, s.candidate_n, s.baseline_n) for s in only] == [("window 0-2", 2, 2)]  # window 3: 0 and 2


def test_windows_of_a_version_rewarded_0_against_1_roll_it_back_at_the_first_look() -> None:
    units = [unit(v, 10.0 * k + i, 1.0 - v, 10.0 * k + i + 1) for k in range(3) for i, v in enumerate([1, 0, 0, 1, 0])]
    verdict = decide(strata(units, now=40.0), CFG, elapsed_s=40.0)
    assert verdict.decision == "rolled_back" and verdict.n == 3 and verdict.difference == -1.0
    assert "within 3 paired groups (3 of them time windows)" in verdict.reason


REFUSED: list[dict[str, float]] = [
    {"fraction": 0.0}, {"fraction": 1.0}, {"fraction": 0.5, "alpha": 0}, {"fraction": 0.5, "margin": -1},
    {"fraction": 0.5, "min_groups": 9}, {"fraction": 0.5, "max_s": 0},
]  # fmt: skip


@pytest.mark.parametrize("bad", REFUSED)
def test_a_canary_config_that_cannot_work_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CanaryConfig(**bad)  # type: ignore[arg-type]


def test_the_split_gives_about_its_fraction_of_new_trajectories_and_keeps_each_ones_version() -> None:
    split = Split(trial_id=7, candidate=3, baseline=2, fraction=0.3)
    ids = [f"traj-{i}" for i in range(10_000)]
    first = {t: split.version_for(t, None) for t in ids}
    assert abs(sum(v == 3 for v in first.values()) / len(ids) - 0.3) < 0.02
    assert all(split.version_for(t, None) == v for t, v in first.items())  # the same on every replica, every time
    assert split.version_for("any", served_by=3) == 3  # a trajectory the candidate served stays on it
    assert {split.version_for("any", served_by=v) for v in (0, 1, 2)} == {2}  # begun before: the baseline
    other = Split(trial_id=8, candidate=4, baseline=3, fraction=0.3)
    moved = sum((first[t] == 3) != (other.version_for(t, None) == 4) for t in ids)
    assert moved > 0.3 * len(ids)  # another trial draws other trajectories
    assert 0 <= draw(1, "") < 1
