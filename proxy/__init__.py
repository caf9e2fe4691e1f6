"""tracetrain's server side: the OpenAI-compatible proxy, capture, store and rewards.

Never imports torch or the trainer: training jobs and their results pass through the store.
Inside, imports run one way, top to bottom (import-linter holds it; docs/ARCHITECTURE.md):

    _app                                 create_app: the app, its routers, its lifespan
    api/                                 the HTTP surface: routers, dependencies, exception handlers
    _services                            every service, built by one function, torn down in reverse
    admin/                               what the dashboard and the admin API show
    judge/                               the group judge, --reward-timeout
    data/ | training/                    rewards in, trajectories out | jobs, publishing, guard, hand-over
    gateway/                             one call: key, forward, capture; the upstreams
    observability/                       /metrics, Langfuse, disk usage
    _credentials | _policy_keys | ...    keys and the admin token, keys bound to policies; parameter types; a beat
    _settings | _policy_config | errors  the settings, each policy's own; the error tree and every error's response
"""

from proxy._app import create_app
from proxy._declare import GROUPS, Declared, declared
from proxy._policy_config import PolicyOverrides, SamplingDefaults
from proxy._settings import Settings
from proxy.gateway import HANG_UP  # how `tracetrain serve`'s server tells a stream that its client left

__all__ = ["GROUPS", "HANG_UP", "Declared", "PolicyOverrides", "SamplingDefaults", "Settings", "create_app", "declared"]
