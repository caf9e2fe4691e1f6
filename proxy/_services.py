"""The app's services: built by one function, torn down in reverse order by an ``AsyncExitStack``.

``build_services(settings, ...)`` opens the store, the upstreams' clients and everything that
stands on them, starts the background tasks (``proxy._periodic``), and yields ``Services``:
what every route reaches through ``proxy.api._deps``. Whatever was built is closed when the
block ends, or when building fails half-way: the background tasks first (newest first: the
judge before the hand-over, which wakes vLLM as it ends, before the publisher), then the
Langfuse exporter (it sends what is still queued), the clients, and the store last (it writes
every queued record first).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from proxy._credentials import Credentials
from proxy._settings import Settings
from proxy.admin import TokenTexts
from proxy.errors import UpstreamError
from proxy.gateway import Forwarder, Gate, Keyer, PolicyRegistry, Upstream
from proxy.gateway.upstream import Router
from proxy.judge import JudgeService
from proxy.judge._timeout import RewardTimeout
from proxy.observability import LangfuseExporter, Metrics, start_langfuse
from proxy.observability._disk import DiskWatch
from proxy.training import Canary, CanaryConfig, HandoverCoordinator, JobScheduler, Publisher
from proxy.training._guard import RegressionGuard
from proxy.training._regression import GuardConfig
from proxy.training._step_watch import StepWatch
from store import Store

log = logging.getLogger("tracetrain.proxy")

# Generation calls go through each Upstream's own kept connections; these httpx clients carry only the control calls.
_UPSTREAM_POOLS = 1


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    credentials: Credentials  # every key and the admin token (proxy._credentials)
    store: Store
    upstream: Upstream  # the first server, for what any one of them answers alike (a tokenizer's texts)
    router: Router  # every server, and which one takes each call
    registry: PolicyRegistry
    keyer: Keyer
    forwarder: Forwarder
    scheduler: JobScheduler  # also told of every reward written (metrics, Langfuse, a job when due)
    publisher: Publisher
    canary: Canary  # canary trials of new versions (--canary); also ends a trial left running when it is off
    metrics: Metrics
    token_texts: TokenTexts
    judging: JudgeService
    langfuse: LangfuseExporter | None = None  # with --langfuse
    handover: HandoverCoordinator | None = None  # with --share-gpu
    disk: DiskWatch | None = None  # disk usage, free space, retention of data


@asynccontextmanager
async def build_services(
    settings: Settings,
    metrics: Metrics,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    on_upstream_stuck: Callable[[str], None] | None = None,
) -> AsyncIterator[Services]:
    """Every service of one app, running until the block ends (see the module's docstring)."""
    async with AsyncExitStack() as stack:
        store = await Store.open(settings.resolved_database_url)
        stack.push_async_callback(store.close)
        router = await _router(settings, transport, stack)
        registry = PolicyRegistry(settings.policy, settings.served_model)
        if registry.base_model is None:
            try:
                registry.base_model = await router.base_model()
            except UpstreamError as exc:
                log.warning("upstream not answering yet (%s); will ask again on the first call", exc.message)
        # The policy row holds the alias; it must exist even while vLLM is still starting.
        registry.active_version = await store.policies.ensure(settings.policy, registry.base_model or "")
        langfuse = start_langfuse(settings)  # None unless --langfuse
        if langfuse is not None:
            stack.push_async_callback(langfuse.aclose)  # sends what is still queued, within its time limit
        keyer = Keyer(store, group_size=settings.group_size, thread_ttl_s=settings.thread_ttl_s)
        gate = Gate(settings.handover_wait_s, metrics)  # closed only by the hand-over's coordinator
        scheduler = JobScheduler(store, policy=settings.policy, batch_groups=settings.batch_groups,
                                 min_group_size=settings.min_group_size, metrics=metrics,
                                 langfuse=langfuse)  # fmt: skip
        publisher = await _publishing(settings, store, registry, router, stack)
        canary = _canary(settings, store, publisher, metrics, stack)
        handover = _training(settings, store, publisher, router, gate, metrics, on_upstream_stuck, stack)
        judging = JudgeService(settings, store, registry, scheduler)
        judging.start()  # scans for complete groups unless rewards are external only
        stack.push_async_callback(judging.close)
        if settings.reward_timeout_s is not None:
            _start(stack, RewardTimeout(settings, store, judging, metrics).run(), "tracetrain-reward-timeout")
        disk = DiskWatch(store, metrics, settings.data_dir, min_free_bytes=settings.min_free_disk_mb * 2**20,
                         keep_trajectories_days=settings.keep_trajectories_days)  # fmt: skip
        _start(stack, disk.run(), "tracetrain-disk")
        forwarder = Forwarder(router, store, keyer, registry, metrics, langfuse, gate)
        yield Services(
            settings, Credentials(settings), store, router.upstreams[0], router, registry, keyer, forwarder,
            scheduler, publisher, canary, metrics, TokenTexts(router.upstreams[0]), judging,
            langfuse=langfuse, handover=handover, disk=disk,
        )  # fmt: skip


async def _router(settings: Settings, transport: httpx.AsyncBaseTransport | None, stack: AsyncExitStack) -> Router:
    """Every vLLM server, over kept connections (closed after the clients, as the stack unwinds)."""
    clients = [
        httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
        )
        for _ in range(_UPSTREAM_POOLS)
    ]
    upstreams = [Upstream(url, clients, timeout_s=settings.upstream_timeout_s) for url in settings.upstreams]
    for upstream in upstreams:
        stack.callback(upstream.close)
    for client in clients:
        stack.push_async_callback(client.aclose)
    return Router(upstreams, health_check_s=settings.health_check_s)


async def _publishing(
    settings: Settings, store: Store, registry: PolicyRegistry, router: Router, stack: AsyncExitStack
) -> Publisher:
    """The publisher, with what the store says is served adopted, and the servers' health watched."""
    publisher = Publisher(
        store, registry, router, keep_versions=settings.keep_versions, unload_grace_s=settings.unload_grace_s,
        guard=settings.regression_guard, delivery=settings.adapter_delivery, canary=settings.canary,
    )  # fmt: skip
    # Publishing starts once this proxy serves: a vLLM that fetches an adapter by name
    # (tracetrain_vllm's resolver) may fetch it from this very proxy.
    await publisher.adopt()
    await router.check_once(functools.partial(publisher.restore, paths_only=True))  # then they take traffic
    _start(stack, publisher.run(), "tracetrain-publisher")
    _start(stack, router.run(publisher.restore), "tracetrain-upstream-health")
    _start(stack, StepWatch(store).run(), "tracetrain-step-watch")
    return publisher


def _canary(settings: Settings, store: Store, publisher: Publisher, metrics: Metrics, stack: AsyncExitStack) -> Canary:
    """The canary's check of the running trial (``--canary``); it runs without one too, to end a trial left over."""
    cfg = None
    if settings.canary is not None:
        cfg = CanaryConfig(fraction=settings.canary, margin=settings.canary_margin, alpha=settings.canary_alpha,
                           max_groups=settings.canary_groups, max_s=settings.canary_minutes * 60)  # fmt: skip
    canary = Canary(store, publisher, metrics, cfg, policy=settings.policy, min_group_size=settings.min_group_size,
                    guard=settings.regression_guard)  # fmt: skip
    _start(stack, canary.run(), "tracetrain-canary")
    return canary


def _training(
    settings: Settings,
    store: Store,
    publisher: Publisher,
    router: Router,
    gate: Gate,
    metrics: Metrics,
    on_upstream_stuck: Callable[[str], None] | None,
    stack: AsyncExitStack,
) -> HandoverCoordinator | None:
    """The regression guard (``--regression-guard``) and the GPU hand-over (``--share-gpu``), when asked for."""
    if settings.regression_guard:
        cfg = GuardConfig(margin=settings.regression_margin, alpha=settings.regression_alpha,
                          max_groups=settings.regression_groups)  # fmt: skip
        guard = RegressionGuard(store, publisher, metrics, cfg, policy=settings.policy)
        _start(stack, guard.run(), "tracetrain-regression-guard")
    if not settings.share_gpu:
        return None
    handover = HandoverCoordinator(
        store, publisher, router.upstreams, gate, metrics, policy=settings.policy,
        timeout_s=settings.handover_timeout_s, on_stuck=on_upstream_stuck,
    )  # fmt: skip
    _start(stack, handover.run(), "tracetrain-gpu-handover")  # a hand-over under way wakes vLLM as it ends
    return handover


def _start(stack: AsyncExitStack, work: Coroutine[Any, Any, object], name: str) -> None:
    """Run ``work`` as a background task, cancelled (and awaited) as the stack unwinds."""
    task = asyncio.create_task(work, name=name)
    stack.push_async_callback(_cancel, task)


async def _cancel(task: asyncio.Task[object]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
