"""What routes depend on: the services built in the lifespan, and the credential checks.

Keys are compared in constant time against every configured key, and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import SecretStr

from proxy._settings import Settings
from proxy.admin._auth import Admin, AdminAuth, presented_token
from proxy.admin._token_texts import TokenTexts
from proxy.errors import AuthenticationFailed
from proxy.gateway._forward import Forwarder
from proxy.gateway._keying import Keyer
from proxy.gateway._policies import PolicyRegistry
from proxy.gateway._router import Router
from proxy.gateway._upstream import Upstream
from proxy.judge._service import JudgeService
from proxy.observability._disk import DiskWatch
from proxy.observability._langfuse import LangfuseExporter
from proxy.observability._metrics import Metrics
from proxy.training._handover import HandoverCoordinator
from proxy.training._publisher import Publisher
from proxy.training._scheduler import JobScheduler
from store import Store


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    store: Store
    upstream: Upstream  # the first server, for what any one of them answers alike (a tokenizer's texts)
    router: Router  # every server, and which one takes each call
    registry: PolicyRegistry
    keyer: Keyer
    forwarder: Forwarder
    scheduler: JobScheduler
    publisher: Publisher
    metrics: Metrics
    token_texts: TokenTexts
    judging: JudgeService
    # Told of every reward just written, posted or judged (as POST /v1/rewards answers them): metrics, Langfuse.
    report_rewards: Callable[[list[dict[str, Any]]], None]
    langfuse: LangfuseExporter | None = None  # with --langfuse
    handover: HandoverCoordinator | None = None  # with --share-gpu
    disk: DiskWatch | None = None  # disk usage, free space, retention of data


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def _check(request: Request, keys: tuple[SecretStr, ...], what: str) -> None:
    if not keys:
        return
    # Anthropic's clients (its SDK, Claude Code) send their key as x-api-key.
    presented = presented_token(request) or request.headers.get("x-api-key")
    if presented is None:
        raise AuthenticationFailed(f"Missing {what}: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
    matched = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        matched |= hmac.compare_digest(presented.encode(), key.get_secret_value().encode())
    if not matched:
        raise AuthenticationFailed(f"Invalid {what}.")


async def require_inference_key(request: Request, services: ServicesDep) -> None:
    _check(request, services.settings.api_keys, "inference key")


async def require_reward_key(request: Request, services: ServicesDep) -> None:
    """Reward keys when configured; otherwise the inference rule (so a loopback default just works)."""
    settings = services.settings
    if settings.reward_keys:
        _check(request, settings.reward_keys, "reward key")
    else:
        _check(request, settings.api_keys, "key")


async def require_adapter_reader(request: Request, services: ServicesDep) -> None:
    """An adapter key or the admin token; without adapter keys, the admin rule alone (``require_admin``).

    Adapter keys read adapter files and nothing else: the key every vLLM server holds
    cannot roll back, train or read trajectories if it leaks.
    """
    settings = services.settings
    if not settings.adapter_keys:
        await require_admin(request)
        return
    auth: AdminAuth = request.app.state.admin_auth
    presented = presented_token(request)
    if presented is not None and auth.token_matches(presented):
        return
    _check(request, settings.adapter_keys, "adapter key")


async def require_admin(request: Request) -> Admin:
    """The admin token or a dashboard session (see ``proxy.admin._auth``); 401/403 otherwise."""
    auth: AdminAuth = request.app.state.admin_auth
    return auth.admit(request)


AdminDep = Annotated[Admin, Depends(require_admin)]
