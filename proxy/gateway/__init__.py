"""The OpenAI-compatible gateway: keying, forwarding to vLLM, capture of every call.

Its routes are ``proxy.api._openai``; what they call is here.
"""

from proxy.gateway._forward import Forwarder
from proxy.gateway._gate import NOT_AWAKE, RETRY_AFTER_FAILED_S, Gate
from proxy.gateway._keying import Key, Keyer, KeyHints, new_trajectory_id
from proxy.gateway._policies import PolicyRegistry, Route
from proxy.gateway.upstream import Upstream

__all__ = [
    "NOT_AWAKE",
    "RETRY_AFTER_FAILED_S",
    "Forwarder",
    "Gate",
    "Key",
    "KeyHints",
    "Keyer",
    "PolicyRegistry",
    "Route",
    "Upstream",
    "new_trajectory_id",
]
