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

Call rewards (``call_advantages``): each kind of reward is normalized against its own kind in the group, as
DeepSeekMath's process supervision normalizes step rewards: call ``k`` of a trajectory gets
``A_k = (R - mean R) / std R + sum_{j >= k} gamma^(j-k) (r_j - mean r) / std r``, the outcome's advantage
plus its own and the later calls' normalized rewards discounted by the turn discount ``gamma`` per call (a call
without a reward adds nothing). Departures from AReaL's turn discount, which discounts the final reward too:
``R`` is the outcome of the whole episode and counts fully for every call, so a trajectory without call rewards
trains exactly as ``group_advantages`` trains it, for any gamma. Each kind has its own baseline because a
shared one biases the calls without a reward: centred on the first call's return ``R + r_0``, an answer call
(no reward of its own) got ``R - mean(R + r_0)``, pushed down by the mean tool-call reward even when every
attempt succeeded, and the tool task's answers were unlearned as its tool calls improved.
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


def discounted_sums(values: Sequence[float], discount: float) -> list[float]:
    """Each position's value plus the later ones', discounted by ``discount`` per position; summed from the last
    back, in double precision.

    >>> discounted_sums([0.0, 1.0, 0.0, -1.0], 0.5)
    [0.375, 0.75, -0.5, -1.0]
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"the turn discount must be in [0, 1], got {discount}")
    sums = [0.0] * len(values)
    later = 0.0
    for k in range(len(values) - 1, -1, -1):
        later = float(values[k]) + discount * later
        sums[k] = later
    return sums


@dataclass(frozen=True, slots=True)
class CallAdvantages:
    """Per-call advantages of each item (a trajectory) and which items carry signal."""

    advantages: list[list[float]]  # one per call of each item; zeros where keep is False
    keep: list[bool]  # False for members of groups of one and of groups where neither kind of reward varies
    groups: int
    dropped_groups: int
    dropped_samples: int


def call_advantages(
    call_rewards: Sequence[Sequence[float | None]],
    rewards: Sequence[float],
    groups: Sequence[Hashable],
    *,
    discount: float,
    scale: bool,
    eps: float = ADVANTAGE_EPS,
) -> CallAdvantages:
    """Each call's advantage: its trajectory's outcome advantage (``group_advantages`` of ``rewards``) plus the
    discounted sum of its own and the later calls' normalized call rewards (``call_rewards``: one list per item,
    one entry per call, ``None`` where a call has none).

    A call reward is normalized against the group's call rewards: minus their mean, over their population std
    when ``scale``. A call without a reward adds nothing, so an item without call rewards gets its outcome
    advantage on every call, exactly. A group keeps its items when its rewards or its call rewards vary.

    >>> r = call_advantages([[1.0, None], [0.0, None]], [1.0, 0.0], ["a", "a"], discount=0.0, scale=True)
    >>> r.advantages, r.keep
    ([[2.0, 1.0], [-2.0, -1.0]], [True, True])
    """
    if not len(call_rewards) == len(rewards) == len(groups):
        raise ValueError(f"call_rewards, rewards and groups must be of one length, got {len(call_rewards)}, "
                         f"{len(rewards)} and {len(groups)}")  # fmt: skip
    if any(not item for item in call_rewards):
        raise ValueError("every item has at least one call")
    present = [float(r) for item in call_rewards for r in item if r is not None]
    if not all(math.isfinite(v) for v in present):
        raise ValueError("call rewards must be finite numbers")
    outcome = group_advantages(rewards, groups, scale=scale, eps=eps)
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)

    advantages = [[0.0] * len(item) for item in call_rewards]
    keep = [False] * len(call_rewards)
    dropped_groups = 0
    for indices in members.values():
        given = [float(r) for i in indices for r in call_rewards[i] if r is not None]
        mean = sum(given) / len(given) if given else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in given) / len(given)) if given else 0.0
        calls_vary = std > eps
        if len(indices) < 2 or not (calls_vary or outcome.keep[indices[0]]):
            dropped_groups += 1
            continue
        for i in indices:
            normalized = [0.0 if r is None or not calls_vary else (float(r) - mean) / std if scale
                          else float(r) - mean for r in call_rewards[i]]  # fmt: skip
            advantages[i] = [outcome.advantages[i] + c for c in discounted_sums(normalized, discount)]
            keep[i] = True
    return CallAdvantages(advantages, keep, len(members), dropped_groups, keep.count(False))
