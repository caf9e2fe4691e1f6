"""Which upstream model a request's ``model`` names.

``policy`` routes to the newest published version, ``policy@N`` pins one, and
``policy@0`` is the base model. Versions are immutable names in vLLM (``policy@7``):
a live name is never reloaded, so the prefix cache never serves an old policy.

While a canary trial of a new version runs (``--canary``), ``policy`` names one of two versions,
by trajectory: ``resolve`` gives the version serving everything, and the call path, once it knows
the call's trajectory, asks ``for_trajectory`` (the trial's split: ``_split``).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


class PolicyRegistry:
    """The policy's published versions, and the alias that ``policy`` points at."""

    def __init__(self, policy: str, base_model: str | None = None) -> None:
        self.policy = policy
        self.base_model = base_model
        self.active_version = 0
        self.loaded_versions: set[int] = {0}
        self.in_flight: Counter[int] = Counter()  # version -> requests now being served by it
        # The canary trial running, as the store says (adopted by the publisher); None: ``policy`` is the alias.
        self.split: Split | None = None
        self._created = int(time.time())

    @contextmanager
    def serving(self, version: int) -> Iterator[None]:
        """Count a request on ``version`` while it runs, so the version is not unloaded under it."""
        self.in_flight[version] += 1
        try:
            yield
        finally:
            self.in_flight[version] -= 1

    def resolve(self, model: str) -> Route:
        name, sep, pinned = model.partition("@")
        if name != self.policy:
            raise ModelNotFound(
                f"The model '{model}' does not exist. This proxy serves the policy '{self.policy}' "
                f"(its newest version) and pinned versions such as '{self.policy}@0'; see GET /v1/models.",
                param="model",
            )
        if not sep:
            return Route(self.policy, self.active_version, self.served_name(self.active_version))
        if _PINNED.fullmatch(pinned) and int(pinned) in self.loaded_versions:
            return Route(self.policy, int(pinned), self.served_name(int(pinned)), pinned=True)
        loaded = ", ".join(f"{self.policy}@{v}" for v in sorted(self.loaded_versions))
        raise ModelNotFound(f"The model '{model}' is not loaded; loaded versions: {loaded}.", param="model")

    def for_trajectory(self, route: Route, trajectory_id: str, served_by: int | None) -> Route:
        """The canary hook: while a trial runs, the version ``route``'s trajectory meets (``Split.version_for``);
        a pinned route, or no trial, as it is. ``served_by``: the version of the trajectory's recorded calls."""
        split = self.split
        if split is None or route.pinned:
            return route
        version = split.version_for(trajectory_id, served_by)
        if version == route.version or version not in self.loaded_versions:
            return route
        return Route(self.policy, version, self.served_name(version))

    def served_name(self, version: int) -> str:
        if version == 0:
            if self.base_model is None:
                raise UpstreamNotReady("the upstream has not said which model it serves yet; is vLLM up?")
            return self.base_model
        return f"{self.policy}@{version}"

    def model_list(self) -> dict[str, Any]:
        """``GET /v1/models``: the policy alias and every loaded version."""

        def entry(model_id: str) -> dict[str, Any]:
            return {
                "id": model_id,
                "object": "model",
                "created": self._created,
                "owned_by": "tracetrain",
                "root": self.base_model,
                "parent": None,
            }

        data = [entry(self.policy)] + [entry(f"{self.policy}@{v}") for v in sorted(self.loaded_versions)]
        return {"object": "list", "data": data}
