"""The data API: rewards in (``POST /v1/rewards``), trajectories and groups out."""

from proxy.data._service import get_trajectory, list_groups, list_trajectories, post_rewards
from proxy.data._wire import RewardBatch, RewardPost

__all__ = ["RewardBatch", "RewardPost", "get_trajectory", "list_groups", "list_trajectories", "post_rewards"]
