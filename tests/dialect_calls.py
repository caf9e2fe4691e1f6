"""A dialect's calls built by hand, for the tests that drive a translator without the proxy around it."""

from __future__ import annotations

from typing import Any

from proxy.gateway._call import Call
from proxy.gateway._capture import Asked
from proxy.gateway._keying import Conversation, Key
from proxy.gateway._policies import Route
from proxy.gateway._served import Served, Signer

SERVED = Served(signer=Signer(b"tracetrain-tests-signing-key-000"))


def call_of(body: dict[str, Any], model: str = "agent@1", served: Served = SERVED, api: str = "messages") -> Call:
    """``body`` as a call served by ``model`` (``policy@N``), as the forwarder hands it to a dialect."""
    policy, _, version = model.partition("@")
    route = Route(policy, int(version or 0), "fake/base-model")
    asked = Asked(token_ids=True, logprobs=False, usage_chunk=True)
    key = Key("traj-test", "group-test", "header", None)
    return Call("chat.completions", body, route, key, Conversation(policy, None), asked, 0.0, 0.0, api, served)
