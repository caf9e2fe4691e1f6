"""From a training job's groups in the store to the items of one GRPO step.

Each trajectory's calls become samples (``build_samples``: token ids only); every
sample of a trajectory carries the trajectory's group-relative advantage. In a group where some
call has its own reward, each call's tokens carry that call's advantage instead
(``tracetrain_core.call_advantages``: the outcome's advantage plus the discounted call rewards): its calls are
built one sample each, so that each segment has its own advantage (the prefix tree forwards the
prefix they share once). A group without call rewards trains exactly as before. Samples
sampled by a policy more than ``max_staleness`` versions older than the one being
trained are skipped, and so are the groups whose rewards do not vary. Everything
dropped is counted in the step's metrics. Each call carries the temperature it was sampled
at: the request's, else the server's default (``trainer._sampling``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from store import RewardedTrajectory
from tracetrain_core import CallAdvantages, GroupAdvantages, call_advantages, group_advantages
from trainer._config import TrainConfig
from trainer._samples import CapturedCall, Decode, Sample, SampleStats, build_samples
from trainer._sampling import SamplingDefaults


@dataclass(frozen=True, slots=True)
class TrajectoryData:
    id: str
    group_id: str
    reward: float
    calls: list[CapturedCall]
    metrics: dict[str, float] = field(default_factory=dict)  # the reward's components, as posted
    call_rewards: list[float | None] = field(default_factory=list)  # each call's own reward (None: none); [] none

    @classmethod
    def from_store(cls, stored: RewardedTrajectory, defaults: SamplingDefaults | None = None) -> TrajectoryData:
        """The trajectory's calls; a sampling parameter a request left out takes ``defaults`` (vLLM's)."""
        defaults = defaults or SamplingDefaults()
        calls = [
            CapturedCall(
                c.prompt_token_ids,
                c.completion_token_ids,
                c.logprobs,
                c.status_code,
                c.version,
                temperature=defaults.temperature_of(c.temperature),
                truncated=defaults.truncates(c.top_p, c.top_k, c.min_p),
                # key order kept: a JSON schema's properties are generated in the order written
                structured_outputs=json.dumps(c.structured_outputs) if c.structured_outputs is not None else None,
            )
            for c in stored.calls
        ]
        call_rewards = [c.reward for c in stored.calls]
        return cls(stored.id, stored.group_id, stored.reward, calls, dict(stored.metrics), call_rewards)


@dataclass(frozen=True, slots=True)
class Batch:
    samples: list[Sample]
    advantages: list[float]  # one per sample
    metrics: dict[str, Any]


def _rewarded_calls(trajectory: TrajectoryData) -> bool:
    return any(r is not None for r in trajectory.call_rewards)


def build_batch(
    trajectories: Sequence[TrajectoryData],
    cfg: TrainConfig,
    *,
    trained_version: int,
    decode: Decode | None = None,
    turn_discount: float = 1.0,
) -> Batch:
    """Samples and their advantages for one step on top of ``trained_version`` (``decode``: see build_samples;
    ``turn_discount``: how call rewards reach the calls before them, ``tracetrain_core.call_advantages``)."""
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)  # (N,)
    groups = [t.group_id for t in trajectories]
    adv = group_advantages([t.reward for t in trajectories], groups, scale=cfg.scale_advantages)
    by_call = {t.group_id for t in trajectories if _rewarded_calls(t)}  # the groups trained call by call
    per_call = None
    if by_call:
        call_rewards = [t.call_rewards or [None] * max(1, len(t.calls)) for t in trajectories]
        per_call = call_advantages(call_rewards, [t.reward for t in trajectories], groups, discount=turn_discount,
                                   scale=cfg.scale_advantages)  # fmt: skip
    samples: list[Sample] = []
    advantages: list[float] = []
    stats = SampleStats()
    stale = off_policy = 0
    for i, trajectory in enumerate(trajectories):
        pieces: list[tuple[Sequence[CapturedCall], float]]
        if per_call is not None and trajectory.group_id in by_call:
            if not per_call.keep[i]:
                continue
            pieces = [([call], a) for call, a in zip(trajectory.calls, per_call.advantages[i], strict=False)]
        else:
            if not adv.keep[i]:
                continue
            pieces = [(trajectory.calls, adv.advantages[i])]
        built_stats = SampleStats()
        for calls, advantage in pieces:
            built, piece_stats = build_samples(calls, decode)
            built_stats += piece_stats
            for sample in built:
                if sample.oldest_version < trained_version - cfg.max_staleness:
                    stale += 1
                    continue
                off_policy += sample.oldest_version < trained_version
                samples.append(sample)
                advantages.append(advantage)
        stats += dataclasses.replace(built_stats, trajectories=1)
    metrics: dict[str, Any] = {
        "trajectories": len(trajectories),
        "groups": adv.groups,
        "dropped_groups_zero_variance": _dropped(adv, per_call, by_call, groups)[0],
        "dropped_trajectories_zero_variance": _dropped(adv, per_call, by_call, groups)[1],
        "call_rewarded_groups": len(by_call),
        "skipped_stale_samples": stale,
        # Trained samples some of whose tokens an older version sampled: their logprob mismatch includes that move.
        "off_policy_samples": off_policy,
        "reward_mean": float(rewards.mean()) if len(trajectories) else None,
        "reward_std": float(rewards.std(unbiased=False)) if len(trajectories) else None,
        **component_means(trajectories),
        **{f"samples_{name}": value for name, value in asdict(stats).items()},
        **turns(stats, trained_tokens=sum(s.loss_tokens for s in samples)),
    }
    return Batch(samples, advantages, metrics)


def _dropped(
    adv: GroupAdvantages, per_call: CallAdvantages | None, by_call: set[str], groups: Sequence[str]
) -> tuple[int, int]:
    """Groups and trajectories dropped for want of signal: each group counted by the rule it trained under."""
    keep = [(per_call.keep[i] if per_call is not None and g in by_call else adv.keep[i]) for i, g in enumerate(groups)]
    dropped = {g for g, k in zip(groups, keep, strict=True) if not k}
    return len(dropped), keep.count(False)


COMPONENT_PREFIX = "reward_component_"
MAX_COMPONENTS = 32  # a step's metrics stay few whatever names a reward service sends


def component_means(trajectories: Sequence[TrajectoryData]) -> dict[str, float]:
    """Each reward component's mean over the step's trajectories that gave it, as ``reward_component_<name>``
    (the first ``MAX_COMPONENTS`` names in order): what ``--reward-weights`` weighs, and what the dashboard,
    ``/metrics`` and the trackers show per step."""
    values: dict[str, list[float]] = {}
    for trajectory in trajectories:
        for name, value in trajectory.metrics.items():
            values.setdefault(name, []).append(float(value))
    return {f"{COMPONENT_PREFIX}{name}": sum(v) / len(v) for name, v in sorted(values.items())[:MAX_COMPONENTS]}


def turns(stats: SampleStats, *, trained_tokens: int) -> dict[str, float | int | None]:
    """Multi-turn accounting of the trained trajectories: per trajectory, calls and samples; the tokens kept.

    ``samples_per_trajectory`` is 1.0 when every trajectory's calls merged into one sample, and
    ``calls_per_trajectory`` when none did. ``trained_token_share``: of the completion tokens captured,
    the share that carried loss in the step (``trained_tokens``: failed, empty or greedy calls and
    stale samples do not).
    """
    n = stats.trajectories
    return {
        "calls_per_trajectory": stats.calls / n if n else None,
        "samples_per_trajectory": stats.samples / n if n else None,
        "trained_tokens": trained_tokens,
        "trained_token_share": trained_tokens / stats.completion_tokens if stats.completion_tokens else None,
    }
