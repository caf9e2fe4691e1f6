"""Keys bound to policies (``--policy-key NAME=KEY``): what a request may reach, as a ``Scope``.

A policy key calls its policy's model, reads its trajectories and groups, and posts its rewards:
it is an inference key and a reward key for that one policy (a key given for several policies
reaches each of them). Inference and reward keys (``--api-keys``, ``--reward-keys``) keep meaning
every policy, and so does a server with no keys at all (loopback).

Whatever lies outside a request's scope does not exist for it: another policy's model, trajectory,
group or reward is a 404, exactly as an unknown one (``proxy.gateway.PolicyRegistry.resolve``,
``proxy.data``), so a key learns nothing of another tenant's data, not even that it exists.

Once any policy key is configured, a request without a key is refused even on loopback (else the
keys would confine nobody): inference then takes an inference key or a policy key, and the
read/reward API a reward key, an inference key when there are no reward keys, or a policy key.
Keys are compared in constant time against every configured key and never logged
(``proxy._credentials`` holds the other credentials; this module only adds the scope).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import Request

from proxy._credentials import Credentials, presented_token
from proxy._settings import Settings
from proxy.errors import AuthenticationFailed


@dataclass(frozen=True, slots=True)
class Scope:
    """The policies a request may reach; ``policies`` None: every policy."""

    policies: frozenset[str] | None = None

    def allows(self, policy: str) -> bool:
        return self.policies is None or policy in self.policies


EVERY = Scope()


class PolicyKeys:
    """The keys bound to policies, and the scope each request's key gives it."""

    def __init__(self, settings: Settings) -> None:
        bound: dict[str, set[str]] = {}
        for name, key in settings.policy_keys:
            bound.setdefault(key.get_secret_value(), set()).add(name)
        self._keys = [(key.encode(), frozenset(names)) for key, names in bound.items()]
        self._inference_keys = bool(settings.api_keys)
        self._reward_keys = bool(settings.reward_keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def inference(self, request: Request, credentials: Credentials) -> Scope:
        """The scope of a generation call (or ``/v1/models``): a policy key's policies, or every one."""
        if not self._keys:
            credentials.inference(request)
            return EVERY
        if (scope := self._match(request)) is not None:
            return scope
        if not self._inference_keys:
            raise _refused(request)
        credentials.inference(request)
        return EVERY

    def reward(self, request: Request, credentials: Credentials) -> Scope:
        """The scope of the read/reward API: a policy key's policies, or every one."""
        if not self._keys:
            credentials.reward(request)
            return EVERY
        if (scope := self._match(request)) is not None:
            return scope
        if not (self._reward_keys or self._inference_keys):
            raise _refused(request)
        credentials.reward(request)
        return EVERY

    def _match(self, request: Request) -> Scope | None:
        presented = _presented(request)
        if presented is None:
            return None
        found: frozenset[str] = frozenset()
        encoded = presented.encode()
        for key, names in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(encoded, key):
                found = names
        return Scope(found) if found else None


def _presented(request: Request) -> str | None:
    # Anthropic's clients (its SDK, Claude Code) send their key as x-api-key.
    return presented_token(request) or request.headers.get("x-api-key")


def _refused(request: Request) -> AuthenticationFailed:
    if _presented(request) is None:
        return AuthenticationFailed("Missing key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
    return AuthenticationFailed("Invalid key.")
