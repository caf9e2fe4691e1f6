"""Group-relative advantages: reward minus the group mean, optionally over the group std.

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

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Per-sample advantages and which samples carry signal."""

    advantages: Tensor  # (N,) float; 0.0 where keep is False
    keep: Tensor  # (N,) bool; False for members of zero-variance groups and groups of one
    groups: int  # distinct group ids seen
    dropped_groups: int  # groups with one member or with rewards that do not vary
    dropped_samples: int  # members of those groups


def group_advantages(rewards: Tensor, group_ids: Tensor, *, scale: bool, eps: float = 1e-6) -> GroupAdvantages:
    """Reward minus its group's mean, divided by the group's population std when ``scale``.

    ``group_ids`` may be any integers, in any order; members of a group need not be adjacent.

    >>> r = group_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0]), torch.tensor([7, 7, 3, 3]), scale=True)
    >>> r.advantages.tolist(), r.keep.tolist(), r.dropped_groups
    ([-1.0, 1.0, 0.0, 0.0], [True, True, False, False], 1)
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of one length, got {rewards.shape}, {group_ids.shape}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite numbers")
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.get_default_dtype()

    r = rewards.to(torch.float64)  # (N,) accumulate in double: means of equal rewards stay equal
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # (N,), (G,)
    n_groups = counts.numel()
    size = counts.to(torch.float64)  # (G,)
    mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, r) / size  # (G,)
    centered = r - mean[group]  # (N,)
    sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, centered.square())  # (G,)
    std = (sq / size).sqrt()  # (G,) population std
    group_keep = (counts > 1) & (std > eps)  # (G,) bool
    keep = group_keep[group]  # (N,) bool
    if scale:
        centered = centered / std.clamp_min(eps)[group]  # (N,)
    advantages = torch.where(keep, centered, torch.zeros_like(centered)).to(out_dtype)  # (N,)

    dropped_groups = int((~group_keep).sum())
    return GroupAdvantages(
        advantages=advantages,
        keep=keep,
        groups=n_groups,
        dropped_groups=dropped_groups,
        dropped_samples=int((~keep).sum()),
    )
