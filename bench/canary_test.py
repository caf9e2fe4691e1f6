"""The canary's test on simulated trials, beside a t-test over the groups' differences alone.

    .venv/bin/python bench/canary_test.py [--trials 2000] [--seed 1] [--traffic-trials 1000] [--per-window 8]

Each trial: groups of 8 attempts at tasks of random difficulty (the success chance of both
versions shifted by U(-0.3, 0.3) per task), each attempt served by the version on trial with
probability 0.5, rewarded 0 or 1; the candidate's effect may differ from task to task (a normal
draw per task, standard deviation ``effect_sd``). The canary looks after each group as the proxy
does (``proxy.training._canary_verdict.decide``: serve's defaults, 3 to 8 paired groups, alpha
0.05, margin 0.05); the other test is the same sequential design with each paired group one value,
mean_N - mean_B, and a one-sample t-test over them (G - 1 degrees of freedom). Printed per
scenario: how often each test rolls back and how many paired groups its verdict took.

Then the canary's test on three kinds of traffic, the same scenarios: ``grouped`` (as above),
``ungrouped`` (every conversation its own task and group: the evidence is time windows,
``proxy.training._canary_windows``, about ``--per-window`` conversations begun in each) and
``mixed`` (each window a group of 8 attempts and about half as many conversations of their own).
Printed: how often the version is rolled back (a wrong rollback where it is no worse, a wrong
promotion where it is worse) and how many strata (paired groups and windows) its verdict took.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence

from proxy.training import CanaryConfig
from proxy.training._canary_verdict import decide, paired
from proxy.training._canary_windows import Windows, window_strata
from proxy.training._regression import student_t_cdf
from store import GroupArms, TrialUnit

CFG = CanaryConfig(fraction=0.5)
# (name, candidate's success chance, baseline's, effect_sd): "the bench's bad version" earns 0 on every task.
SCENARIOS = [
    ("equal, 0.5 against 0.5", 0.5, 0.5, 0.0),
    ("equal on average, effect sd 0.1 per task", 0.5, 0.5, 0.1),
    ("equal on average, effect sd 0.2 per task", 0.5, 0.5, 0.2),
    ("equal on average, effect sd 0.3 per task", 0.5, 0.5, 0.3),
    ("worse by 0.15 (0.35 against 0.5)", 0.35, 0.5, 0.0),
    ("0 whatever the task, against 0.6", -1.0, 0.6, 0.0),
    ("better by 0.3 (0.8 against 0.5)", 0.8, 0.5, 0.0),
]
Test = Callable[[Sequence[GroupArms]], str]


def group(rng: random.Random, candidate_p: float, baseline_p: float, effect_sd: float, i: int) -> GroupArms:
    task = rng.uniform(-0.3, 0.3)
    effect = rng.gauss(0.0, effect_sd) if effect_sd else 0.0
    arms: tuple[list[float], list[float]] = ([], [])
    for _ in range(8):
        on_trial = rng.random() < 0.5
        p = min(1.0, max(0.0, (candidate_p + effect if on_trial else baseline_p) + task))
        arms[0 if on_trial else 1].append(float(rng.random() < p))
    c, b = arms
    mc, mb = (sum(c) / len(c) if c else None), (sum(b) / len(b) if b else None)
    return GroupArms(f"g{i}", len(c), mc, sum((x - (mc or 0)) ** 2 for x in c), len(b), mb,
                     sum((x - (mb or 0)) ** 2 for x in b), float(i))  # fmt: skip


def within_groups_test(groups: Sequence[GroupArms]) -> str:
    return decide(groups, CFG, elapsed_s=0).decision


def t_over_groups(groups: Sequence[GroupArms]) -> str:
    d = [(g.candidate_mean or 0.0) - (g.baseline_mean or 0.0) for g in paired(groups)][: CFG.max_groups]
    n = len(d)
    if n < CFG.min_groups:
        return "running"
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    shifted = mean + CFG.margin
    p = (0.0 if shifted < 0 else 1.0) if sd < 1e-12 else student_t_cdf(shifted / (sd / math.sqrt(n)), n - 1)
    if p < CFG.alpha_per_look:
        return "rolled_back"
    if 1 - p < CFG.alpha_per_look or n >= CFG.max_groups:
        return "promoted"
    return "running"


def trial(rng: random.Random, test: Test, candidate_p: float, baseline_p: float, effect_sd: float) -> tuple[str, int]:
    groups: list[GroupArms] = []
    while True:
        groups.append(group(rng, candidate_p, baseline_p, effect_sd, len(groups)))
        decision = test(groups)
        if decision != "running":
            return decision, len(paired(groups))


def traffic_trial(rng: random.Random, traffic: str, candidate_p: float, baseline_p: float, effect_sd: float,
                  per_window: float) -> tuple[str, int]:  # fmt: skip
    """One trial on ``traffic``, a window at a time: (verdict, strata it took). Every reward of a window has come
    by the look after it (the windows' waiting is what keeps late rewards from biasing the comparison)."""
    windows = Windows()
    units: list[TrialUnit] = []
    groups: list[GroupArms] = []

    def reward(on_trial: bool, task: float, effect: float) -> float:
        p = min(1.0, max(0.0, (candidate_p + effect if on_trial else baseline_p) + task))
        return float(rng.random() < p)

    for k in range(10_000):
        begun = k * windows.window_s
        if traffic in ("grouped", "mixed"):
            g = group(rng, candidate_p, baseline_p, effect_sd, len(groups))
            if g.candidate_mean is not None and g.baseline_mean is not None:
                groups.append(GroupArms(g.group_id, g.candidate_n, g.candidate_mean, g.candidate_ss, g.baseline_n,
                                        g.baseline_mean, g.baseline_ss, begun + windows.window_s))  # fmt: skip
            else:  # a group one version served wholly: one unit of its window
                on_trial = g.candidate_mean is not None
                mean = g.candidate_mean if on_trial else g.baseline_mean
                units.append(TrialUnit(g.group_id, int(on_trial), begun, begun, True, mean or 0.0, begun))
        if traffic in ("ungrouped", "mixed"):
            expected = per_window if traffic == "ungrouped" else per_window / 2
            for i in range(_poisson(rng, expected)):
                on_trial = rng.random() < CFG.fraction
                effect = rng.gauss(0.0, effect_sd) if effect_sd else 0.0
                at = begun + rng.random() * windows.window_s
                units.append(TrialUnit(f"u{k}-{i}", int(on_trial), at, at, True,
                                       reward(on_trial, rng.uniform(-0.3, 0.3), effect), at))  # fmt: skip
        now = begun + windows.window_s + windows.grace_s
        strata = sorted([*groups, *window_strata(units, candidate=1, started_at=0.0, now=now, windows=windows)],
                        key=lambda s: s.completed_at)  # fmt: skip
        verdict = decide(strata, CFG, elapsed_s=0)
        if verdict.decision != "running":
            return verdict.decision, verdict.n
    raise RuntimeError("no verdict")


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's: the means here are small)."""
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k, product = k + 1, product * rng.random()
    return k


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=2000, help="simulated trials per scenario and test (default 2000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--traffic-trials", type=int, default=1000, help="simulated trials per scenario and traffic")
    p.add_argument("--per-window", type=float, default=8.0, help="ungrouped conversations begun per window (8)")
    args = p.parse_args()
    if args.trials > 0:
        print(f"{'scenario':44s} | {'within groups: rolled back, groups':36s} | t over groups: rolled back, groups")
    for name, candidate_p, baseline_p, effect_sd in SCENARIOS if args.trials > 0 else []:
        cells = []
        for test in (within_groups_test, t_over_groups):
            rng = random.Random(args.seed)  # the same trials for both tests
            outcomes = [trial(rng, test, candidate_p, baseline_p, effect_sd) for _ in range(args.trials)]
            rolled = sum(d == "rolled_back" for d, _ in outcomes) / len(outcomes)
            groups = sum(n for _, n in outcomes) / len(outcomes)
            cells.append(f"{rolled:7.1%} after {groups:4.1f} paired groups")
        print(f"{name:44s} | {cells[0]:36s} | {cells[1]}")
    print(f"\nThe canary's test by traffic ({args.per_window:g} ungrouped conversations a window): rolled back, strata")
    print(f"{'scenario':44s} | {'grouped':22s} | {'ungrouped':22s} | mixed")
    for name, candidate_p, baseline_p, effect_sd in SCENARIOS:
        cells = []
        for traffic in ("grouped", "ungrouped", "mixed"):
            rng = random.Random(args.seed)
            outcomes = [traffic_trial(rng, traffic, candidate_p, baseline_p, effect_sd, args.per_window)
                        for _ in range(args.traffic_trials)]  # fmt: skip
            rolled = sum(d == "rolled_back" for d, _ in outcomes) / len(outcomes)
            cells.append(f"{rolled:6.1%} after {sum(n for _, n in outcomes) / len(outcomes):4.1f}")
        print(f"{name:44s} | {cells[0]:22s} | {cells[1]:22s} | {cells[2]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
