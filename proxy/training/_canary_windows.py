"""The canary's evidence outside mixed groups: trajectories begun in the same time window, compared within it.

A group holding both versions compares them on one task (``_canary_verdict``). Traffic whose
groups hold one version each (every conversation its own group, or groups too small to draw
both) gives no such pairs. Its trajectories still compare the versions, with one hazard: rewards
arrive late and unevenly, and a version whose trajectories end (and are rewarded) sooner would be
over-represented among the rewards read so far. The paired test avoids it by counting a group only
once all of it is rewarded; this does the same by start time:

- each unit (a group holding one version: its trajectories' mean reward, one value, since the same
  task's attempts are not independent; an ungrouped conversation is a group of one) falls in the
  window its first trajectory began in, windows of ``window_s`` seconds from the trial's start;
- a window is complete once it has ended (``grace_s`` past its end, for the records to land) and
  every unit in it is rewarded, or has waited ``wait_s`` since its last call (left out: its reward
  is not coming; a long conversation still calling is not left out however long it runs);
- complete windows are taken in time order, up to the first incomplete one, and consecutive ones
  join one stratum until it holds ``min_each`` units of each version.

A stratum is then one more "paired group" of the stratified test: D weighs it by its split, and
the spread within it (units of one version in one window) is pooled with the groups'. The split
is random per trajectory and the same all the trial long, so within a window the versions meet
the same traffic: a change in traffic over time (harder tasks in the afternoon) cancels as a
task's difficulty does in a group. Pure: the store reads the units (``store.Trials.units``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from store import GroupArms, TrialUnit


@dataclass(frozen=True, slots=True)
class Windows:
    """How trajectories outside mixed groups are windowed (``CanaryConfig`` holds the trial's)."""

    window_s: float = 5.0  # each window's length
    wait_s: float = 300.0  # a unit unrewarded this long after its last call is left out of its window
    grace_s: float = 2.0  # past a window's end before it may count: a trajectory's record lands after its call
    min_each: int = 2  # units of each version a stratum holds at least


def window_strata(
    units: Sequence[TrialUnit], *, candidate: int, started_at: float, now: float, windows: Windows = Windows()
) -> list[GroupArms]:
    """The strata of complete windows over ``units`` (see the module's docstring), oldest first."""
    by_window: dict[int, list[TrialUnit]] = {}
    for unit in units:
        by_window.setdefault(max(0, math.floor((unit.begun_at - started_at) / windows.window_s)), []).append(unit)
    strata: list[GroupArms] = []
    cells: dict[bool, list[float]] = {True: [], False: []}
    first, done = None, 0.0
    for k in sorted(by_window):
        end = started_at + (k + 1) * windows.window_s
        if end + windows.grace_s > now:
            break
        members = by_window[k]
        if any(not u.complete and now - u.active_at < windows.wait_s for u in members):
            break  # a reward still to come: this window, and every later one, waits
        for u in members:
            if u.complete:
                cells[u.version == candidate].append(u.mean)
                done = max(done, u.rewarded_at)
        first = k if first is None else first
        if min(len(cells[True]), len(cells[False])) >= windows.min_each:
            strata.append(_stratum(f"window {first}-{k}", cells[True], cells[False], max(done, end)))
            cells, first, done = {True: [], False: []}, None, 0.0
    return strata


def _stratum(name: str, candidate: list[float], baseline: list[float], completed_at: float) -> GroupArms:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def spread(xs: list[float]) -> float:
        m = mean(xs)
        return sum((x - m) ** 2 for x in xs)

    return GroupArms(name, len(candidate), mean(candidate), spread(candidate), len(baseline), mean(baseline),
                     spread(baseline), completed_at, window=True)  # fmt: skip
