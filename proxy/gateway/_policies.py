"""Which upstream model a request's ``model`` names, among the policies this proxy serves.

Each policy is one agent's LoRA line on the base model. ``NAME`` routes to the policy's newest
published version, ``NAME@N`` pins one, and ``NAME@0`` is the base model. Versions are immutable
names in vLLM (``NAME@7``): a live name is never reloaded, so the prefix cache never serves an old
policy. One vLLM serves every policy's versions side by side.

``PolicyRegistry`` holds a ``ServedPolicy`` per policy served (its settings, the version its name
routes to, the versions loaded); the publisher adds, updates and removes them as the store says
(``proxy.training._publisher``), so a policy added or retired on one replica is served or not on
every replica. ``resolve(model, scope)`` answers for a request whose key reaches ``scope``'s
policies: any other name, another policy's included, is a 404 exactly as an unknown one is.

While a canary trial of a policy's new version runs (``--canary``), ``NAME`` names one of two
versions, by trajectory: ``resolve`` gives the version serving everything, and the call path, once
it knows the call's trajectory, asks ``for_trajectory`` (the policy's trial's split: ``_split``).
Each policy has its own trial, or none: a trial of one never moves another's calls.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from proxy._policy_config import PolicySettings, policy_settings
from proxy._policy_keys import EVERY, Scope
from proxy._settings import Settings
from proxy.errors import ModelNotFound, UpstreamNotReady
from proxy.gateway._split import Split

# ASCII digits, few enough for int(): str.isdigit() also takes "²", and int() refuses 4,300 digits.
_PINNED = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True, slots=True)
class Route:
    policy: str
    version: int
    served_model: str  # what vLLM serves: the base model, or "policy@N"
    pinned: bool = False  # the client named the version (``policy@N``): no canary trial moves it

    @property
    def public_name(self) -> str:
        """The name clients see in responses: always ``policy@N``."""
        return f"{self.policy}@{self.version}"


class ServedPolicy:
    """One policy as this proxy serves it: its settings, the version ``NAME`` routes to, the versions loaded."""

    def __init__(self, settings: PolicySettings, active_version: int = 0) -> None:
        self.name = settings.name
        self.settings = settings
        self.active_version = active_version
        self.loaded_versions: set[int] = {0}
        # The policy's canary trial running, as the store says (adopted by its publisher); None: ``NAME`` is the
        # alias.
        self.split: Split | None = None

    def adapter(self, version: int) -> str:
        """The version's name in vLLM: ``NAME@N``."""
        return f"{self.name}@{version}"


class PolicyRegistry:
    """The policies served, each one's published versions and alias; calls in flight on each version."""

    def __init__(self, base_model: str | None = None, policies: tuple[PolicySettings, ...] = (),
                 aliases: tuple[tuple[str, str], ...] = ()) -> None:  # fmt: skip
        self.base_model = base_model
        # An agent's own model names, each to the policy that serves it ("*": every name nothing else serves).
        self.aliases = dict(aliases)
        self._states: dict[str, ServedPolicy] = {}
        # (policy, version) -> requests now being served by it: a version is not unloaded under them, even after
        # its policy was retired.
        self.in_flight: Counter[tuple[str, int]] = Counter()
        self._created = int(time.time())
        for settings in policies:
            self.add(ServedPolicy(settings))

    @classmethod
    def of(cls, *names: str, base_model: str | None = None, settings: Settings | None = None) -> PolicyRegistry:
        """A registry serving ``names`` with ``settings``' values (the defaults when None), at version 0."""
        server = settings if settings is not None else Settings()
        return cls(base_model, tuple(policy_settings(name, server.policy_defaults) for name in names))

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def __iter__(self) -> Iterator[ServedPolicy]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def names(self) -> list[str]:
        return sorted(self._states)

    def get(self, name: str) -> ServedPolicy:
        """The served policy ``name`` (``KeyError`` when it is not served)."""
        return self._states[name]

    def add(self, state: ServedPolicy) -> ServedPolicy:
        self._states[state.name] = state
        return state

    def remove(self, name: str) -> ServedPolicy | None:
        """Stop routing to ``name``; its calls in flight finish on their versions."""
        return self._states.pop(name, None)

    @contextmanager
    def serving(self, policy: str, version: int) -> Iterator[None]:
        """Count a request on ``policy@version`` while it runs, so the version is not unloaded under it."""
        self.in_flight[(policy, version)] += 1
        try:
            yield
        finally:
            self.in_flight[(policy, version)] -= 1

    def policy(self, model: str, scope: Scope = EVERY) -> ServedPolicy:
        """The policy ``model`` names (``NAME``, ``NAME@N`` or an alias), if served and within ``scope``; else a
        404."""
        name = self.aliased(model).partition("@")[0]
        state = self._states.get(name)
        if state is None or not scope.allows(name):
            raise self._unknown(model, scope)
        return state

    def aliased(self, model: str) -> str:
        """The policy's name an alias stands for (``--model-alias``); a policy's own name as it is."""
        if model in self.aliases:
            return self.aliases[model]
        if model.partition("@")[0] in self._states or "*" not in self.aliases:
            return model
        return self.aliases["*"]

    def resolve(self, model: str, scope: Scope = EVERY) -> Route:
        """The version ``model`` names; a 404 for a name outside ``scope``, as for one that does not exist."""
        state = self.policy(model, scope)
        _, sep, pinned = self.aliased(model).partition("@")
        if not sep:
            return Route(state.name, state.active_version, self.served_name(state.name, state.active_version))
        if _PINNED.fullmatch(pinned) and int(pinned) in state.loaded_versions:
            return Route(state.name, int(pinned), self.served_name(state.name, int(pinned)), pinned=True)
        loaded = ", ".join(state.adapter(v) for v in sorted(state.loaded_versions))
        raise ModelNotFound(f"The model '{model}' is not loaded; loaded versions: {loaded}.", param="model")

    def for_trajectory(self, route: Route, trajectory_id: str, served_by: int | None) -> Route:
        """The canary hook: while ``route``'s policy has a trial running, the version ``route``'s trajectory
        meets (``Split.version_for``); a pinned route, or no trial, as it is. ``served_by``: the version of the
        trajectory's recorded calls."""
        state = self._states.get(route.policy)
        split = state.split if state is not None else None
        if state is None or split is None or route.pinned:
            return route
        version = split.version_for(trajectory_id, served_by)
        if version == route.version or version not in state.loaded_versions:
            return route
        return Route(state.name, version, self.served_name(state.name, version))

    def served_name(self, policy: str, version: int) -> str:
        if version == 0:
            if self.base_model is None:
                raise UpstreamNotReady("the upstream has not said which model it serves yet; is vLLM up?")
            return self.base_model
        return f"{policy}@{version}"

    def _unknown(self, model: str, scope: Scope) -> ModelNotFound:
        visible = [name for name in sorted(self._states) if scope.allows(name)]
        if not visible:
            return ModelNotFound(f"The model '{model}' does not exist, and no model is served to this key.",
                                 param="model")  # fmt: skip
        names = ", ".join(f"'{name}'" for name in visible)
        aliased = self.aliased(model)
        if aliased != model and aliased.partition("@")[0] not in self._states:
            return ModelNotFound(f"The model '{model}' is an alias (--model-alias) of the policy '{aliased}', which "
                                 f"this proxy does not serve; it serves {names}.", param="model")  # fmt: skip
        return ModelNotFound(
            f"The model '{model[:200]}' does not exist. This proxy serves {names} (each one's newest version) and "
            f"pinned versions such as '{visible[0]}@0'; see GET /v1/models. To serve an agent's own model name, "
            f"map it to a policy: tracetrain serve --model-alias '{model[:200]}={visible[0]}' (or --model-alias "
            f"'*={visible[0]}' for every name).",
            param="model",
        )

    def model_list(self, scope: Scope = EVERY) -> dict[str, Any]:
        """``GET /v1/models``: each policy within ``scope``, its alias and every loaded version."""

        def entry(model_id: str) -> dict[str, Any]:
            return {
                "id": model_id,
                "object": "model",
                "created": self._created,
                "owned_by": "tracetrain",
                "root": self.base_model,
                "parent": None,
            }

        data = []
        for name in sorted(self._states):
            if scope.allows(name):
                state = self._states[name]
                data += [entry(name)] + [entry(state.adapter(v)) for v in sorted(state.loaded_versions)]
        # An alias is listed as a model of its own: agents that check the list find the name they ask for.
        data += [entry(alias) for alias, name in sorted(self.aliases.items())
                 if alias != "*" and name in self._states and scope.allows(name)]  # fmt: skip
        return {"object": "list", "data": data}
