"""The policies as the admin API and the dashboard show and change them: list, add, configure, retire.

A policy added or retired here is written to the store (``store.Policies``) and this proxy's publisher
syncs at once, so this replica serves it (or stops) before the answer; every other replica follows at
its next sync (``proxy.training._policy_sync``, within a second). Retiring keeps every row of the policy:
its trajectories, groups, jobs and adapters stay readable, and adding it again serves it from the version
it served before.

Which policy an action or a per-policy page is about (``chosen``): the one named, or, when the request
names none, the only one served (several served: a 400 that lists them).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from proxy._policy_config import PolicyOverrides, policy_settings, unconfigured_judge
from proxy._settings import Settings
from proxy.errors import Conflict, InvalidRequest, NotFound
from proxy.gateway import PolicyRegistry
from proxy.training import Publisher
from store import POLICY_NAME_PATTERN, PolicyAdded, PolicyState, Store


class PolicySources(Protocol):
    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store: ...
    @property
    def registry(self) -> PolicyRegistry: ...
    @property
    def publisher(self) -> Publisher: ...


def _not_found(name: str) -> NotFound:
    return NotFound(f"No policy '{name}' (see GET /admin/policies).", param="policy", code="policy_not_found")


async def chosen(services: PolicySources, policy: str | None) -> str:
    """The policy a request is about: ``policy`` when it names one the store holds (a retired one too: its data
    stays readable); else the only one served."""
    if policy is not None:
        if await services.store.policies.get(policy) is None:
            raise _not_found(policy)
        return policy
    served = services.registry.names()
    if len(served) == 1:
        return served[0]
    if not served:
        raise InvalidRequest("No policy is served: name one with ?policy=NAME (see GET /admin/policies).",
                             param="policy")  # fmt: skip
    raise InvalidRequest(f"Several policies are served ({', '.join(served)}): name one with ?policy=NAME.",
                         param="policy")  # fmt: skip


def policy_view(services: PolicySources, row: dict[str, Any]) -> dict[str, Any]:
    """One policy: its state, alias, versions loaded here, its own settings and what they resolve to."""
    name = str(row["name"])
    served = services.registry.get(name) if name in services.registry else None
    defaults = services.settings.policy_defaults
    resolved = served.settings if served is not None else policy_settings(name, defaults, row["config"])
    return {
        "object": "policy",
        "name": name,
        "state": row["state"],
        "base_model": row["base_model"],
        "active_version": served.active_version if served is not None else int(row["active_version"]),
        "loaded_versions": sorted(served.loaded_versions) if served is not None else [],
        "training": row["training"],
        "training_reason": row["training_reason"],
        "config": row["config"],  # what it overrides
        "settings": resolved.model_dump(exclude={"name"})  # what it runs with
        | {"sampling": resolved.sampling.model_dump(exclude_none=True)},
        "created_at": row["created_at"],
        "retired_at": row["retired_at"],
    }


async def list_policies(services: PolicySources) -> dict[str, Any]:
    """Every policy, retired ones too."""
    return {"object": "list", "data": [policy_view(services, row) for row in await services.store.policies.all()]}


async def get_policy(services: PolicySources, name: str) -> dict[str, Any]:
    row = await services.store.policies.get(name)
    if row is None:
        raise _not_found(name)
    return policy_view(services, row)


async def add_policy(services: PolicySources, name: str, config: PolicyOverrides | None) -> dict[str, Any]:
    """Serve ``name`` (new, or a retired one again) with ``config`` (None: none of its own, or what it had)."""
    if not re.fullmatch(POLICY_NAME_PATTERN, name):
        raise InvalidRequest(f"Invalid policy name {name[:120]!r}: 1-100 letters, digits, '_', '.' or '-', beginning "
                             "with a letter or digit.", param="name")  # fmt: skip
    row = await services.store.policies.get(name)
    if row is not None and row["state"] == PolicyState.SERVING:
        raise Conflict(f"The policy '{name}' is served already; change its settings with PATCH /admin/policies/{name}.",
                       param="name", code="policy_exists")  # fmt: skip
    _check_judge(services.settings, config)
    stored = config.stored() if config is not None else None
    added = await services.store.policies.add(name, services.registry.base_model or "", stored)
    await services.publisher.sync_once()  # served here before the answer; the other replicas within a second
    view = await get_policy(services, name)
    return {**view, "added": added is PolicyAdded.ADDED}


async def configure_policy(services: PolicySources, name: str, config: PolicyOverrides) -> dict[str, Any]:
    """Replace the settings ``name`` overrides (the server's apply to everything ``config`` leaves out)."""
    _check_judge(services.settings, config)
    if not await services.store.policies.configure(name, config.stored()):
        raise _not_found(name)
    await services.publisher.sync_once()
    return await get_policy(services, name)


def _check_judge(settings: Settings, config: PolicyOverrides | None) -> None:
    """A policy's judge is one the operator configured: the admin API picks among them, never names a URL."""
    if config is not None and (problem := unconfigured_judge(config.judge_model, settings.judge_endpoints)):
        raise InvalidRequest(f"Invalid value for 'config.judge_model': {problem}.", param="config.judge_model")


async def retire_policy(services: PolicySources, name: str) -> dict[str, Any]:
    """Stop serving and training ``name``; its data stays readable, and adding it again serves it again."""
    if not await services.store.policies.retire(name):
        if await services.store.policies.get(name) is None:
            raise _not_found(name)
        raise Conflict(f"The policy '{name}' is retired already; POST /admin/policies serves it again.",
                       param="name", code="policy_retired")  # fmt: skip
    await services.publisher.sync_once()
    return await get_policy(services, name)
