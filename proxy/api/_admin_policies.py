"""The admin API's policies: list them, add one (or serve a retired one again), change its settings, retire it.

A policy's settings are what it overrides of the server's (``proxy.PolicyOverrides``: its groups, batch,
retention, regression guard, judge and sampling defaults), given as JSON. The service is
``proxy.admin._policies``; the same admin token or dashboard session admits these as every admin route.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from proxy._params import PolicyName
from proxy._policy_config import PolicyOverrides
from proxy.admin import _policies
from proxy.api._deps import ServicesDep, require_admin

router = APIRouter(prefix="/admin/policies", dependencies=[Depends(require_admin)], tags=["admin"])


class NewPolicy(BaseModel):
    """``POST /admin/policies``: a policy's name and, optionally, the settings it overrides."""

    model_config = ConfigDict(extra="forbid")

    name: PolicyName
    config: PolicyOverrides | None = None  # None: none of its own (a retired one keeps what it had)


class PolicyConfig(BaseModel):
    """``PATCH /admin/policies/{name}``: the settings it overrides from now on (all of them: omitted ones go back
    to the server's)."""

    model_config = ConfigDict(extra="forbid")

    config: PolicyOverrides


@router.get("")
async def list_policies(services: ServicesDep) -> dict[str, Any]:
    """Every policy, retired ones too: its state, the version it serves, what it overrides and what it runs with."""
    return await _policies.list_policies(services)


@router.post("", status_code=201)
async def add_policy(body: NewPolicy, services: ServicesDep) -> dict[str, Any]:
    """Serve a new policy, or a retired one again (409 when it is served already). Every replica serves it
    within a second; its first version is the base model (`NAME@0`) until it trains."""
    return await _policies.add_policy(services, body.name, body.config)


@router.get("/{name}")
async def get_policy(name: PolicyName, services: ServicesDep) -> dict[str, Any]:
    """One policy."""
    return await _policies.get_policy(services, name)


@router.patch("/{name}")
async def configure_policy(name: PolicyName, body: PolicyConfig, services: ServicesDep) -> dict[str, Any]:
    """Replace the settings the policy overrides; every replica and the trainer apply them within a second."""
    return await _policies.configure_policy(services, name, body.config)


@router.post("/{name}/retire")
async def retire_policy(name: PolicyName, services: ServicesDep) -> dict[str, Any]:
    """Stop serving and training the policy (its model becomes a 404, its versions leave vLLM); its
    trajectories, groups, jobs and adapters stay readable, and POST /admin/policies serves it again."""
    return await _policies.retire_policy(services, name)
