"""From a training job's groups in the store to the items of one GRPO step.

Each trajectory's calls become samples (``build_samples``: token ids only); every
sample of a trajectory carries the trajectory's group-relative advantage. Samples
sampled by a policy more than ``max_staleness`` versions older than the one being
trained are skipped, and so are the groups whose rewards do not vary. Everything
dropped is counted in the step's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._advantages import group_advantages
from store._store import C, T
from trainer._config import TrainConfig
from trainer._samples import CapturedCall, Sample, SampleStats, build_samples


@dataclass(frozen=True, slots=True)
class TrajectoryData:
    id: str
    group_id: str
    reward: float
    calls: list[CapturedCall]


@dataclass(frozen=True, slots=True)
class Batch:
    samples: list[Sample]
    advantages: list[float]  # one per sample
    metrics: dict[str, Any]


async def load_trajectories(engine: AsyncEngine, group_ids: Sequence[str]) -> list[TrajectoryData]:
    """The rewarded trajectories of ``group_ids`` with their calls in order."""
    async with engine.connect() as conn:
        trajectories = (
            await conn.execute(
                select(T.c.id, T.c.group_id, T.c.reward)
                .where(T.c.group_id.in_(list(group_ids)), T.c.reward.is_not(None))
                .order_by(T.c.pk)
            )
        ).all()
        ids = [row.id for row in trajectories]
        calls = (
            await conn.execute(
                select(C.c.trajectory_id, C.c.prompt_token_ids, C.c.completion_token_ids, C.c.logprobs,
                       C.c.status_code, C.c.version)
                .where(C.c.trajectory_id.in_(ids))
                .order_by(C.c.started_at, C.c.pk)
            )
        ).all()  # fmt: skip
    by_trajectory: dict[str, list[CapturedCall]] = {i: [] for i in ids}
    for call in calls:
        by_trajectory[call.trajectory_id].append(
            CapturedCall(call.prompt_token_ids, call.completion_token_ids, call.logprobs, call.status_code,
                         call.version)
        )  # fmt: skip
    return [TrajectoryData(t.id, t.group_id, float(t.reward), by_trajectory[t.id]) for t in trajectories]


def build_batch(trajectories: Sequence[TrajectoryData], cfg: TrainConfig, *, trained_version: int) -> Batch:
    """Samples and their advantages for one step on top of ``trained_version``."""
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)  # (N,)
    adv = group_advantages(
        [t.reward for t in trajectories], [t.group_id for t in trajectories], scale=cfg.scale_advantages
    )
    samples: list[Sample] = []
    advantages: list[float] = []
    stats = SampleStats()
    stale = 0
    for trajectory, advantage, keep in zip(trajectories, adv.advantages, adv.keep, strict=True):
        if not keep:
            continue
        built, built_stats = build_samples(trajectory.calls)
        stats += built_stats
        for sample in built:
            if sample.oldest_version < trained_version - cfg.max_staleness:
                stale += 1
                continue
            samples.append(sample)
            advantages.append(advantage)
    metrics: dict[str, Any] = {
        "trajectories": len(trajectories),
        "groups": adv.groups,
        "dropped_groups_zero_variance": adv.dropped_groups,
        "dropped_trajectories_zero_variance": adv.dropped_samples,
        "skipped_stale_samples": stale,
        "reward_mean": float(rewards.mean()) if len(trajectories) else None,
        "reward_std": float(rewards.std(unbiased=False)) if len(trajectories) else None,
        **{f"samples_{name}": value for name, value in asdict(stats).items()},
    }
    return Batch(samples, advantages, metrics)
