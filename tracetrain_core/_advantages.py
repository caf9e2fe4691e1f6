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
        mean = sum(values[i] for i in indices) / len(indices)
        centered = [values[i] - mean for i in indices]
        std = math.sqrt(sum(c * c for c in centered) / len(indices))  # population std
        if len(indices) < 2 or std <= eps:
            dropped_groups += 1
            continue
        for i, c in zip(indices, centered, strict=True):
            advantages[i] = c / std if scale else c
            keep[i] = True
    return GroupAdvantages(
        advantages=advantages,
        keep=keep,
        groups=len(members),
        dropped_groups=dropped_groups,
        dropped_samples=keep.count(False),
    )
