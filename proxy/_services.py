"""The app's services: built by one function, torn down in reverse order by an ``AsyncExitStack``.

``build_services(settings, ...)`` opens the store, the upstreams' clients and everything that
stands on them, starts the background tasks (``proxy._periodic``), and yields ``Services``:
what every route reaches through ``proxy.api._deps``. Whatever was built is closed when the
block ends, or when building fails half-way: the background tasks first (newest first: the
judge before the hand-over, which wakes vLLM as it ends, before the publisher), then the
trace exporters (they send what is still queued), the clients, and the store last (it writes
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
from proxy._periodic import every
from proxy._policy_keys import PolicyKeys
from proxy._settings import Settings
from proxy._throttle import LoginThrottle
from proxy.admin import TokenTexts
from proxy.errors import UpstreamError
from proxy.gateway import Forwarder, Gate, Keyer, PolicyRegistry, Served, Signer, Upstream
from proxy.gateway.upstream import Router
from proxy.judge import JudgeService
from proxy.judge._timeout import RewardTimeout
from proxy.observability import Exporters, Metrics, start_exporters
from proxy.observability._disk import DiskWatch
from proxy.training import Canary, HandoverCoordinator, JobScheduler, Publisher
from proxy.training._guard import RegressionGuard
from proxy.training._step_watch import StepWatch
from store import PolicyAdded, Store

log = logging.getLogger("tracetrain.proxy")

# Generation calls go through each Upstream's own kept connections; these httpx clients carry only the control calls.
_UPSTREAM_POOLS = 1


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    credentials: Credentials  # every key and the admin token (proxy._credentials)
    policy_keys: PolicyKeys  # keys bound to policies, and the scope each gives a request (proxy._policy_keys)
    store: Store
    upstream: Upstream  # the first server, for what any one of them answers alike (a tokenizer's texts)
    router: Router  # every server, and which one takes each call
    registry: PolicyRegistry  # the policies served, as the store says (the publisher keeps it so)
    keyer: Keyer
    forwarder: Forwarder
    scheduler: JobScheduler  # also told of every reward written (metrics, the trace exporters, a job when due)
    publisher: Publisher
    canary: Canary  # canary trials of new versions (--canary); also ends a trial left running when it is off
    metrics: Metrics
    token_texts: TokenTexts
    judging: JudgeService
    exporters: Exporters | None = None  # with --otlp-endpoint or --langfuse
    handover: HandoverCoordinator | None = None  # with --share-gpu
    disk: DiskWatch | None = None  # disk usage, free space, retention of data


@asynccontextmanager
async def build_services(
    settings: Settings,
    metrics: Metrics,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    on_upstream_stuck: Callable[[str], None] | None = None,
    throttle: LoginThrottle | None = None,
) -> AsyncIterator[Services]:
    """Every service of one app, running until the block ends (see the module's docstring)."""
    async with AsyncExitStack() as stack:
        store = await Store.open(settings.resolved_database_url)
        stack.push_async_callback(store.close)
        router = await _router(settings, transport, stack)
        registry = PolicyRegistry(settings.served_model, aliases=settings.model_aliases)
        if registry.base_model is None:
            try:
                registry.base_model = await router.base_model()
            except UpstreamError as exc:
                log.warning("upstream not answering yet (%s); will ask again on the first call", exc.message)
        await _named_policies(settings, store, registry.base_model or "")
        exporters = start_exporters(settings)  # None unless --otlp-endpoint or --langfuse
        if exporters is not None:
            stack.push_async_callback(exporters.aclose)  # sends what is still queued, within its time limit
        keyer = Keyer(store, group_size=settings.group_size, thread_ttl_s=settings.thread_ttl_s)
        gate = Gate(settings.handover_wait_s, metrics)  # closed only by the hand-over's coordinator
        scheduler = JobScheduler(store, registry, metrics=metrics, exporters=exporters)
        publisher = await _publishing(settings, store, registry, router, stack)  # fills the registry from the store
        canary = _canary(store, publisher, registry, metrics, stack)
        handover = _training(settings, store, publisher, registry, router, gate, metrics, on_upstream_stuck, stack)
        judging = JudgeService(settings, store, registry, scheduler)
        judging.start()  # judges the groups of the policies whose rewards come from (or beside) the judge
        stack.push_async_callback(judging.close)
        timeout = RewardTimeout(settings, store, judging, metrics, registry)
        _start(stack, timeout.run(), "tracetrain-reward-timeout")  # for the policies with --reward-timeout
        disk = DiskWatch(store, metrics, settings.data_dir, min_free_bytes=settings.min_free_disk_mb * 2**20,
                         keep_trajectories_days=settings.keep_trajectories_days)  # fmt: skip
        _start(stack, disk.run(), "tracetrain-disk")
        # A seat whose call was never recorded (its process died) is given back, so its group can fill (store._derived).
        sweep = functools.partial(store.release_stale_seats, settings.seat_timeout_s)
        _start(stack, every(min(60.0, settings.seat_timeout_s / 2), sweep, log, "could not give back stale seats"),
               "tracetrain-seats")  # fmt: skip
        admin_token = settings.admin_token.get_secret_value() if settings.admin_token else None
        served = Served(reasoning=settings.reasoning_parser is not None, images=settings.reads_images,
                        signer=Signer.for_server(settings.data_dir, admin_token))  # fmt: skip
        forwarder = Forwarder(router, store, keyer, registry, metrics, exporters, gate, served)
        yield Services(
            settings, Credentials(settings, store.sessions, throttle=throttle), PolicyKeys(settings), store,
            router.upstreams[0], router,
            registry, keyer, forwarder, scheduler, publisher, canary, metrics, TokenTexts(router.upstreams[0]),
            judging, exporters=exporters, handover=handover, disk=disk,
        )  # fmt: skip


async def _named_policies(settings: Settings, store: Store, base_model: str) -> None:
    """The policies ``--policy`` names, served (a retired one again) with the settings ``--policy-config`` gives.

    The rows must exist even while vLLM is still starting: they hold each alias. Policies added through the
    admin API are in the store already, and served as well.
    """
    for name in settings.policies:
        overrides = settings.policy_configs.get(name)
        added = await store.policies.add(name, base_model, overrides.stored() if overrides is not None else None)
        if added is PolicyAdded.READDED:
            log.warning("policy %s was retired; --policy names it, so it is served again", name)


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
    publisher = Publisher(store, registry, router, settings)
    # Publishing starts once this proxy serves: a vLLM that fetches an adapter by name
    # (tracetrain_vllm's resolver) may fetch it from this very proxy.
    await publisher.adopt()
    await router.check_once(functools.partial(publisher.restore, paths_only=True))  # then they take traffic
    _start(stack, publisher.run(), "tracetrain-publisher")
    _start(stack, router.run(publisher.restore), "tracetrain-upstream-health")
    _start(stack, StepWatch(store).run(), "tracetrain-step-watch")
    return publisher


def _canary(store: Store, publisher: Publisher, registry: PolicyRegistry, metrics: Metrics,
            stack: AsyncExitStack) -> Canary:  # fmt: skip
    """The canary's check of each policy's running trial (its canary setting); it runs without one too, to end a
    trial left over."""
    canary = Canary(store, publisher, metrics, registry)
    _start(stack, canary.run(), "tracetrain-canary")
    return canary


def _training(
    settings: Settings,
    store: Store,
    publisher: Publisher,
    registry: PolicyRegistry,
    router: Router,
    gate: Gate,
    metrics: Metrics,
    on_upstream_stuck: Callable[[str], None] | None,
    stack: AsyncExitStack,
) -> HandoverCoordinator | None:
    """The regression guard (for each policy whose settings keep it on) and the GPU hand-over (``--share-gpu``)."""
    guard = RegressionGuard(store, publisher, metrics, registry)
    _start(stack, guard.run(), "tracetrain-regression-guard")
    if not settings.share_gpu:
        return None
    handover = HandoverCoordinator(
        store, publisher, router.upstreams, gate, metrics, timeout_s=settings.handover_timeout_s,
        on_stuck=on_upstream_stuck,
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
