"""What routes depend on: the app's services, and the credential each route asks for.

The checks themselves are ``proxy._credentials``'s; these only hand it the request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from proxy._credentials import Admin
from proxy._services import Services


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def require_inference_key(request: Request, services: ServicesDep) -> None:
    services.credentials.inference(request)


async def require_reward_key(request: Request, services: ServicesDep) -> None:
    """Reward keys when configured; otherwise the inference rule (so a loopback default just works)."""
    services.credentials.reward(request)


async def require_adapter_reader(request: Request, services: ServicesDep) -> None:
    """An adapter key or the admin token; without adapter keys, the admin rule alone (``require_admin``)."""
    await services.credentials.adapter_reader(request)


async def require_admin(request: Request, services: ServicesDep) -> Admin:
    """The admin token or a dashboard session (see ``proxy._credentials``); 401/403 otherwise."""
    return await services.credentials.admin.admit(request)


AdminDep = Annotated[Admin, Depends(require_admin)]
