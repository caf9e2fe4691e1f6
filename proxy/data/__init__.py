"""The data API: rewards in (``POST /v1/rewards``, a person's score: ``give_feedback``), trajectories and groups out."""

from proxy.data._feedback import FeedbackPost, give_feedback, parse_feedback, review_queue, validate_feedback
from proxy.data._service import get_trajectory, list_groups, list_trajectories, post_rewards
from proxy.data._wire import RewardBatch, RewardPost

__all__ = [
    "FeedbackPost",
    "RewardBatch",
    "RewardPost",
    "get_trajectory",
    "give_feedback",
    "list_groups",
    "list_trajectories",
    "parse_feedback",
    "post_rewards",
    "review_queue",
    "validate_feedback",
]
