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
