"""tracetrain: the thin client of a tracetrain proxy (needs only httpx and pydantic).

Point an unmodified agent at the proxy, let it work, then score what it did. The
proxy records every call into the trajectory, and trains the policy on the rewards::

    from openai import OpenAI
    import tracetrain

    tt = tracetrain.Client("http://127.0.0.1:8100", api_key="sk-reward")
    trajectory_id = tracetrain.new_trajectory_id()

    agent = OpenAI(base_url=tt.openai_base_url(trajectory_id), api_key="sk-infer")
    reply = agent.chat.completions.create(
        model="my-policy", messages=[{"role": "user", "content": "Capital of France?"}]
    )
    tt.post_reward(trajectory_id, 1.0 if "Paris" in reply.choices[0].message.content else 0.0)

Pass a `group_id` to `openai_base_url` to choose which attempts are compared with each
other in a GRPO group; left out, the proxy groups attempts at the same task.
`AsyncClient` offers the same methods for asyncio.
"""

from ._client import AsyncClient, Client, RewardLike, new_trajectory_id, trajectory_headers
from ._errors import (
    APIConnectionError,
    APIError,
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    TracetrainError,
)
from ._models import Call, Group, Page, Reward, RewardIn, Trajectory, TrajectorySummary

__all__ = [
    "APIConnectionError",
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Call",
    "Client",
    "Group",
    "NotFoundError",
    "Page",
    "Reward",
    "RewardIn",
    "RewardLike",
    "TracetrainError",
    "Trajectory",
    "TrajectorySummary",
    "new_trajectory_id",
    "trajectory_headers",
]
