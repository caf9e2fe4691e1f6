"""What routes depend on: the app's services, and the credential each route asks for.

The checks themselves are ``proxy._credentials``'s; these only hand it the request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from proxy._credentials import Admin
from proxy._policy_keys import Scope
from proxy._services import Services


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def inference_scope(request: Request, services: ServicesDep) -> Scope:
    """An inference key (every policy) or a policy key (its policies); see ``proxy._policy_keys``."""
    return services.policy_keys.inference(request, services.credentials)


async def reward_scope(request: Request, services: ServicesDep) -> Scope:
    """A reward key (or, without them, the inference rule: a loopback default just works), or a policy key."""
    return services.policy_keys.reward(request, services.credentials)


# What a route's key may reach: FastAPI solves each once per request, however many times it is named.
InferenceScope = Annotated[Scope, Depends(inference_scope)]
RewardScope = Annotated[Scope, Depends(reward_scope)]


async def require_inference_key(request: Request, services: ServicesDep) -> None:
    await inference_scope(request, services)


async def require_reward_key(request: Request, services: ServicesDep) -> None:
    """Reward keys when configured; otherwise the inference rule (so a loopback default just works)."""
    await reward_scope(request, services)


async def require_adapter_reader(request: Request, services: ServicesDep) -> None:
    """An adapter key or the admin token; without adapter keys, the admin rule alone (``require_admin``)."""
    await services.credentials.adapter_reader(request)


async def require_admin(request: Request, services: ServicesDep) -> Admin:
    """The admin token or a dashboard session (see ``proxy._credentials``); 401/403 otherwise."""
    return await services.credentials.admin.admit(request)


AdminDep = Annotated[Admin, Depends(require_admin)]
