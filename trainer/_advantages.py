"""Group-relative advantages as tensors, for callers that hold rewards and group ids as tensors.

The math, and where it departs from the papers, is ``tracetrain_core.group_advantages``: pure Python, so
that the dashboard shows exactly what the trainer trains on. A step has one reward per
trajectory, so the round trip through lists costs nothing that matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import tracetrain_core


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Per-sample advantages and which samples carry signal."""

    advantages: Tensor  # (N,) float; 0.0 where keep is False
    keep: Tensor  # (N,) bool; False for members of zero-variance groups and groups of one
    groups: int  # distinct group ids seen
    dropped_groups: int  # groups with one member or with rewards that do not vary
    dropped_samples: int  # members of those groups


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale: bool, eps: float = tracetrain_core.ADVANTAGE_EPS
) -> GroupAdvantages:
    """Reward minus its group's mean, divided by the group's population std when ``scale``.

    ``group_ids`` may be any integers, in any order; members of a group need not be adjacent.
    The advantages keep the rewards' floating dtype and device.

    >>> r = group_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0]), torch.tensor([7, 7, 3, 3]), scale=True)
    >>> r.advantages.tolist(), r.keep.tolist(), r.dropped_groups
    ([-1.0, 1.0, 0.0, 0.0], [True, True, False, False], 1)
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of one length, got {rewards.shape}, {group_ids.shape}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.get_default_dtype()
    pure = tracetrain_core.group_advantages(rewards.tolist(), group_ids.tolist(), scale=scale, eps=eps)
    return GroupAdvantages(
        advantages=torch.tensor(pure.advantages, dtype=out_dtype, device=rewards.device),  # (N,)
        keep=torch.tensor(pure.keep, dtype=torch.bool, device=rewards.device),  # (N,)
        groups=pure.groups,
        dropped_groups=pure.dropped_groups,
        dropped_samples=pure.dropped_samples,
    )
