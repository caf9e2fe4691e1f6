"""The policies this proxy serves, as the store says: added, retired, their settings and their versions.

Every proxy replica reads the ``policies`` table (``store.Policies``) on each publisher sync and makes
its ``PolicyRegistry`` agree with it, so a policy added or retired through one replica's admin API is
served, or not, by every replica within a sync (a second at most):

- a policy that appears (added, or added again after it was retired) has its published versions loaded
  into every vLLM first, then joins the registry: its first call finds its version loaded;
- a policy that is retired leaves the registry at once (its name is a 404 from then on) and its versions
  are unloaded from vLLM once no call of this proxy runs on them and the unload grace has passed;
- a policy that stays takes the store's settings (``policies.config`` over the server's), alias and
  published versions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from proxy._policy_config import PolicySettings
from proxy.errors import ProxyError
from proxy.gateway import PolicyRegistry, ServedPolicy
from proxy.training._loading import AdapterLoader
from store import PolicyState, Store

log = logging.getLogger("tracetrain.publisher")

# A policy's settings from its stored overrides (``proxy._policy_config.policy_settings`` over the server's).
Resolve = Callable[[str, dict[str, Any]], PolicySettings]


class PolicySync:
    """Makes a registry agree with the store's policies; the publisher calls it under its lock."""

    def __init__(self, store: Store, registry: PolicyRegistry, loader: AdapterLoader, resolve: Resolve) -> None:
        self._store = store
        self._registry = registry
        self._loader = loader
        self._resolve = resolve
        self.retiring: dict[str, tuple[ServedPolicy, float]] = {}  # retired here -> (its state, since when)

    async def adopt(self, *, load: bool = True) -> None:
        """The store's policies into the registry. ``load``: a policy new here has its published versions
        loaded into vLLM before it is served (at start-up the router restores every server instead)."""
        rows = {row["name"]: row for row in await self._store.policies.all() if row["state"] == PolicyState.SERVING}
        for name, row in rows.items():
            published = await self._store.adapters.published_versions(name)
            state = self._registry.get(name) if name in self._registry else None
            if state is None:
                state = ServedPolicy(self._resolve(name, row["config"]), int(row["active_version"]))
                state.loaded_versions = {0, *published}
                if load and not await self._loaded(state):
                    continue  # tried again at the next sync; not served meanwhile
                self._registry.add(state)
                self.retiring.pop(name, None)
                log.info("serving policy %s (at version %d)", name, state.active_version)
                continue
            state.settings = self._resolve(name, row["config"])
            state.loaded_versions = {0, *published}
            state.active_version = int(row["active_version"])
        for state in list(self._registry):
            if state.name not in rows:
                self._registry.remove(state.name)
                self.retiring[state.name] = (state, time.monotonic())
                log.warning("policy %s was retired: no longer served or trained (its data stays readable)", state.name)

    async def _loaded(self, state: ServedPolicy) -> bool:
        """Every published version of a policy new here into every vLLM; False when one could not be loaded."""
        for version in sorted(v for v in state.loaded_versions if v):
            row = await self._store.adapters.get(state.name, version)
            if row is None:
                continue
            try:
                await self._loader.load_everywhere(state.name, version, row["path"])
            except ProxyError as exc:
                log.error("policy %s is not served yet: loading %s failed (%s)", state.name, state.adapter(version),
                          exc.message)  # fmt: skip
                return False
        return True

    async def unload_retired(self, grace_s: float) -> None:
        """Unload a retired policy's versions once its calls here are done and the grace has passed."""
        now = time.monotonic()
        for name, (state, since) in list(self.retiring.items()):
            running = any(self._registry.in_flight[(name, v)] > 0 for v in state.loaded_versions)
            if now - since < grace_s or running:
                continue
            for version in sorted(v for v in state.loaded_versions if v):
                await self._loader.unload_everywhere(name, version)
            del self.retiring[name]
            log.info("policy %s: its versions were unloaded from vLLM", name)
