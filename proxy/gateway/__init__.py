"""The OpenAI-compatible gateway: keying, forwarding to vLLM, capture of every call.

Its routes are ``proxy.api._openai``; what they call is here.
"""

from proxy.gateway._forward import Forwarder
from proxy.gateway._gate import Gate
from proxy.gateway._keying import Key, Keyer, KeyHints, new_trajectory_id
from proxy.gateway._policies import PolicyRegistry, Route
from proxy.gateway._upstream import Upstream

__all__ = ["Forwarder", "Gate", "Key", "KeyHints", "Keyer", "PolicyRegistry", "Route", "Upstream", "new_trajectory_id"]
