"""The gateway: every call of every API the proxy speaks, keyed, forwarded to vLLM, captured.

Its routes are ``proxy.api._openai``; what they call is here, in three rooms:

- at the top, one call's steps, the same for every API: ``Forwarder.handle`` (``_forward``), a stream's
  relay (``_relay``), the call in flight and its record (``_call``), capture (``_capture``), keying
  (``_keying``), the policies served and their versions (``_policies``) and a canary trial's split of a
  policy's versions (``_split``), the gate a training step closes (``_gate``), what the served model takes
  and the proxy's signatures (``_served``);
- ``dialects/``: the APIs, each a translator on either side of those steps (chat is the identity);
- ``upstream/``: reaching vLLM: one server's client, the router over several.
"""

from proxy.gateway._forward import Forwarder
from proxy.gateway._gate import NOT_AWAKE, RETRY_AFTER_FAILED_S, Gate
from proxy.gateway._keying import Key, Keyer, KeyHints, new_trajectory_id
from proxy.gateway._policies import PolicyRegistry, Route, ServedPolicy
from proxy.gateway._relay import HANG_UP
from proxy.gateway._served import Served, Signer
from proxy.gateway._split import Split
from proxy.gateway.upstream import Upstream

__all__ = [
    "HANG_UP",
    "NOT_AWAKE",
    "RETRY_AFTER_FAILED_S",
    "Forwarder",
    "Gate",
    "Key",
    "KeyHints",
    "Keyer",
    "PolicyRegistry",
    "Route",
    "Served",
    "ServedPolicy",
    "Signer",
    "Split",
    "Upstream",
    "new_trajectory_id",
]
