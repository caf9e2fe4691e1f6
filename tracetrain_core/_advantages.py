"""Group-relative advantages: reward minus the group mean, optionally over the group std.

Pure Python, below the store and the trainer: the trainer trains on these
advantages (``trainer._batch``; ``trainer._advantages`` wraps them in tensors) and the
dashboard shows the same numbers, so the two can never disagree.

Where this departs from the papers:

- The std is the *population* std (divide by n, as nano-aha-moment's ``np.std``), not
  the sample std TRL uses (``torch.std``, n - 1). A group of two with rewards 0 and 1
  then gets advantages -1 and +1, and every scaled group has unit variance exactly.
- Groups whose rewards do not vary (std at most ``eps``) carry no signal: GRPO would
  give them zero advantages and still spend a forward on them; DAPO resamples until a
  group varies. We cannot resample an agent's traffic, so we drop them, mark their
  members ``keep=False`` and count them, so the caller can say how much was dropped.
  A group of one sample has no baseline and is dropped the same way.
- With ``scale=False`` (Dr. GRPO) advantages are the centered rewards, unscaled.
- Rewards anywhere in the doubles' range are centred and scaled without overflow (each group is
  computed at unit size, then scaled back); a centred reward past the largest double, possible only
  unscaled, drops its group: a non-finite advantage is never kept.

Call rewards (``call_returns``, ``call_advantages``): a call's tokens get the return
``G_k = R + sum_{j >= k} gamma^(j-k) r_j`` (its own reward ``r_k``, the later calls' discounted by the turn
discount ``gamma`` per call, and the trajectory's reward ``R``), and the advantage ``(G_k - mean) / std`` where
mean and std are the group's over the first calls' returns ``G_0``. Departures from AReaL's turn discount,
which discounts the final reward too: ``R`` is the outcome of the whole episode and counts fully for every
call, so a trajectory without call rewards trains exactly as ``group_advantages`` trains it, for any gamma
(and a long successful trajectory's first calls are not worth less than a short one's). The baseline is the
group's ``G_0``: every attempt at a task starts from the same state, whose value ``G_0`` estimates; a mean per
call index would compare calls in different states and has no baseline where only one trajectory is that long.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

ADVANTAGE_EPS = 1e-6  # a group whose reward std is at most this does not vary


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Per-item advantages and which items carry signal."""

    advantages: list[float]  # one per item; 0.0 where keep is False
    keep: list[bool]  # False for members of zero-variance groups and groups of one
    groups: int  # distinct group ids seen
    dropped_groups: int  # groups with one member or with rewards that do not vary
    dropped_samples: int  # members of those groups


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], *, scale: bool, eps: float = ADVANTAGE_EPS
) -> GroupAdvantages:
    """Reward minus its group's mean, divided by the group's population std when ``scale``.

    ``groups`` names each item's group (any hashable); members of a group need not be adjacent.
    Sums run in double precision, whatever the type of the rewards.

    >>> r = group_advantages([0.0, 1.0, 5.0, 5.0], ["a", "a", "b", "b"], scale=True)
    >>> r.advantages, r.keep, r.dropped_groups
    ([-1.0, 1.0, 0.0, 0.0], [True, True, False, False], 1)
    """
    if len(rewards) != len(groups):
        raise ValueError(f"rewards and groups must be of one length, got {len(rewards)} and {len(groups)}")
    values = [float(r) for r in rewards]
    if not all(math.isfinite(v) for v in values):
        raise ValueError("rewards must be finite numbers")
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)

    advantages = [0.0] * len(values)
    keep = [False] * len(values)
    dropped_groups = 0
    for indices in members.values():
        # Sums of rewards near the largest double overflow (1e308 + 1e308 is inf, inf - inf NaN). So each
        # group is brought to unit size by a power of two (exact: the same bits as unscaled sums wherever
        # those do not overflow), and only the results go back to reward units.
        unit = math.ldexp(1.0, -max(0, math.frexp(max(abs(values[i]) for i in indices))[1]))
        small = [values[i] * unit for i in indices]  # each in [-1, 1]; unit is 1 for rewards below 1
        mean = sum(small) / len(small)
        centered = [v - mean for v in small]
        std = math.sqrt(sum(c * c for c in centered) / len(small))  # population std, in units of 1/unit
        if len(indices) < 2 or std <= eps * unit:
            dropped_groups += 1
            continue
        out = [c / std if scale else c / unit for c in centered]
        if not all(math.isfinite(a) for a in out):  # centered beyond the largest double: no usable signal
            dropped_groups += 1
            continue
        for i, a in zip(indices, out, strict=True):
            advantages[i] = a
            keep[i] = True
    return GroupAdvantages(
        advantages=advantages,
        keep=keep,
        groups=len(members),
        dropped_groups=dropped_groups,
        dropped_samples=keep.count(False),
    )


def call_returns(call_rewards: Sequence[float | None], reward: float, discount: float) -> list[float]:
    """Each call's return: the trajectory's ``reward`` plus its own and the later calls' rewards, discounted by
    ``discount`` per call (a call without a reward adds 0). Summed from the last call back, in double precision.

    >>> call_returns([None, 1.0, None, -1.0], 0.5, 0.5)
    [0.875, 1.25, 0.0, -0.5]
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"the turn discount must be in [0, 1], got {discount}")
    returns = [0.0] * len(call_rewards)
    later = 0.0  # the discounted sum of the later calls' rewards
    for k in range(len(call_rewards) - 1, -1, -1):
        later = float(call_rewards[k] or 0.0) + discount * later
        returns[k] = float(reward) + later
    return returns


@dataclass(frozen=True, slots=True)
class CallAdvantages:
    """Per-call advantages of each item (a trajectory) and which items carry signal."""

    advantages: list[list[float]]  # one per call of each item; zeros where keep is False
    keep: list[bool]  # False for members of groups of one and of groups whose returns do not vary
    groups: int
    dropped_groups: int
    dropped_samples: int


def call_advantages(
    returns: Sequence[Sequence[float]], groups: Sequence[Hashable], *, scale: bool, eps: float = ADVANTAGE_EPS
) -> CallAdvantages:
    """Each call's return minus the group's mean first-call return, over the group's std of first-call returns
    when ``scale`` (``call_returns`` gives the returns). Where every call of every item has the return of its
    first call (no call rewards), the advantages are exactly ``group_advantages``' of the first returns.

    A group whose first returns do not vary but whose call returns do is scaled by the std of all its call
    returns; a group whose returns do not vary at all, or of one item, is dropped.

    >>> r = call_advantages([[1.0, 1.0], [0.0], [2.0, 0.0]], ["a", "a", "b"], scale=False)
    >>> r.advantages, r.keep
    ([[0.5, 0.5], [-0.5], [0.0, 0.0]], [True, True, False])
    """
    if len(returns) != len(groups):
        raise ValueError(f"returns and groups must be of one length, got {len(returns)} and {len(groups)}")
    if any(not item for item in returns):
        raise ValueError("every item needs the return of at least one call")
    values = [[float(v) for v in item] for item in returns]
    if not all(math.isfinite(v) for item in values for v in item):
        raise ValueError("returns must be finite numbers")
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)

    advantages = [[0.0] * len(item) for item in values]
    keep = [False] * len(values)
    dropped_groups = 0
    for indices in members.values():
        # The same arithmetic as group_advantages, on the first calls' returns: identical where calls add nothing.
        mean = sum(values[i][0] for i in indices) / len(indices)
        std = math.sqrt(sum((values[i][0] - mean) ** 2 for i in indices) / len(indices))
        if std <= eps:
            pooled = [v - mean for i in indices for v in values[i]]
            std = math.sqrt(sum(c * c for c in pooled) / len(pooled))
        if len(indices) < 2 or std <= eps:
            dropped_groups += 1
            continue
        for i in indices:
            advantages[i] = [(v - mean) / std if scale else v - mean for v in values[i]]
            keep[i] = True
    return CallAdvantages(advantages, keep, len(members), dropped_groups, keep.count(False))
