"""The canary's test on simulated trials, beside a t-test over the groups' differences alone.

    .venv/bin/python bench/canary_test.py [--trials 2000] [--seed 1]

Each trial: groups of 8 attempts at tasks of random difficulty (the success chance of both
versions shifted by U(-0.3, 0.3) per task), each attempt served by the version on trial with
probability 0.5, rewarded 0 or 1; the candidate's effect may differ from task to task (a normal
draw per task, standard deviation ``effect_sd``). The canary looks after each group as the proxy
does (``proxy.training._canary_verdict.decide``: serve's defaults, 3 to 8 paired groups, alpha
0.05, margin 0.05); the other test is the same sequential design with each paired group one value,
mean_N - mean_B, and a one-sample t-test over them (G - 1 degrees of freedom). Printed per
scenario: how often each test rolls back and how many paired groups its verdict took.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence

from proxy.training import CanaryConfig
from proxy.training._canary_verdict import decide, paired
from proxy.training._regression import student_t_cdf
from store import GroupArms

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=2000, help="simulated trials per scenario and test (default 2000)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    print(f"{'scenario':44s} | {'within groups: rolled back, groups':36s} | t over groups: rolled back, groups")
    for name, candidate_p, baseline_p, effect_sd in SCENARIOS:
        cells = []
        for test in (within_groups_test, t_over_groups):
            rng = random.Random(args.seed)  # the same trials for both tests
            outcomes = [trial(rng, test, candidate_p, baseline_p, effect_sd) for _ in range(args.trials)]
            rolled = sum(d == "rolled_back" for d, _ in outcomes) / len(outcomes)
            groups = sum(n for _, n in outcomes) / len(outcomes)
            cells.append(f"{rolled:7.1%} after {groups:4.1f} paired groups")
        print(f"{name:44s} | {cells[0]:36s} | {cells[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
