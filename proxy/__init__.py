"""tracetrain's server side: the OpenAI-compatible proxy, capture, store and rewards.

Never imports torch or the trainer: training jobs and their results pass through the store.
"""

from proxy._app import create_app
from proxy._settings import Settings

__all__ = ["Settings", "create_app"]
