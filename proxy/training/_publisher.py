"""Publishing adapters: load into every vLLM, flip the alias, unload what fell out of the window.

The trainer writes an adapter and records it (state ``trained``). The publisher claims
it, loads it as ``policy@N`` into every vLLM server in rotation (``proxy.gateway._router``),
and only when all loaded flips the policy's alias to N; a request already running finishes on the
version it started with. Versions beyond the newest ``keep_versions`` (the active one
always stays) are unloaded once no request of this proxy is running on them and they
have been out of the window for a grace period. A failed load leaves the old version
serving and marks the adapter and its job failed, with the reason.

Every proxy replica runs a publisher: claims make one replica publish each adapter (only
the claim's owner marks it published), its alias flip only moves forward, one replica
retires and unloads each version, and each replica adopts the active version from the store. A claim carries a lease: an
adapter left ``loading`` by a replica that died is taken back after the lease by
whichever replica polls first, and published again. The same poll requeues training jobs
whose worker stopped renewing its lease (see ``store._lifecycle``).

A server out of rotation (down, refusing connections) is skipped. One that refuses the
load's connection, or fails the load and then no longer answers ``/health`` (stopped
mid-load), leaves the rotation and the publish goes on without it: the router hands a
server that answers again to ``restore``, which loads every published version into it
before it takes traffic. Nothing is claimed while no server is in rotation.

Versions are immutable names: a name is never reloaded with other weights, so vLLM's
prefix cache cannot serve an old policy under a new name.

Adapters reach vLLM one of two ways (``--adapter-delivery``). By path: vLLM is sent the
directory the trainer wrote (one box, or a filesystem shared by every machine). Through
the resolver: vLLM is asked for ``policy@N`` by name, and tracetrain_vllm's LoRA resolver,
running inside vLLM, downloads the files the trainer recorded in the store from
``GET /v1/adapters/...`` of a proxy (``Upstream.resolve_lora``). Either way the call
returns once that vLLM holds the version, so the alias still flips only after every
replica loaded it. ``auto`` goes by path when the directory exists on this machine.

While vLLM sleeps for a training step (``--share-gpu``), the hand-over's coordinator holds
the publisher (``held()``): nothing is loaded into a sleeping vLLM; once it is awake the
coordinator publishes what the step recorded before any held call goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from proxy.errors import Conflict, NotFound, ProxyError, UpstreamUnreachable
from proxy.gateway._policies import PolicyRegistry
from proxy.gateway._router import Router, Server
from proxy.gateway._upstream import Upstream
from proxy.training._regression import watch_record
from store import AdapterState, Store, TrainingState

log = logging.getLogger("tracetrain.publisher")

_UNLOAD_GRACE_S = 30.0
_RELOAD_CHECK_S = 5.0
# A publish takes milliseconds to seconds per vLLM; a replica that held a claim this long is gone.
PUBLISH_LEASE_S = 120.0
_RECLAIM_CHECK_S = 5.0
_FULL_SYNC_S = 1.0  # between these, a poll syncs only when the store's publishing state changed
# How adapters reach vLLM: the trainer's directory by path, or fetched by vLLM's tracetrain resolver.
AdapterDelivery = Literal["auto", "path", "resolver"]


def _already_loaded(exc: ProxyError) -> bool:
    """vLLM's answer to loading a name it holds (400, "... has already been loaded ...")."""
    return exc.status_code == 400 and "has already been loaded" in exc.message


async def _answers(upstream: Upstream) -> bool:
    """Whether ``upstream`` still answers ``/health``: a load that failed on a server going away is no verdict."""
    try:
        await upstream.health()
    except ProxyError:
        return False
    return True


class PublishError(ProxyError):
    status_code = 502
    type = "upstream_error"
    code = "adapter_load_failed"


class Publisher:
    def __init__(
        self,
        store: Store,
        registry: PolicyRegistry,
        router: Router,
        *,
        keep_versions: int,
        poll_s: float = 0.1,
        unload_grace_s: float = _UNLOAD_GRACE_S,
        lease_s: float = PUBLISH_LEASE_S,
        guard: bool = False,
        delivery: AdapterDelivery = "auto",
    ) -> None:
        self._store = store
        self._delivery = delivery
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._lease_s = lease_s
        self._last_reclaim = 0.0
        self._registry = registry
        self._router = router
        self._keep = keep_versions
        self._poll_s = poll_s
        self._grace_s = unload_grace_s
        self._left_window: dict[int, float] = {}
        self._last_reload_check = 0.0
        self._lock = asyncio.Lock()
        self._guard = guard  # each version published is watched by the regression guard (proxy.training._guard)
        self._withdrawn: dict[int, float] = {}  # rolled-back versions still loaded -> when they were withdrawn

    async def run(self) -> None:
        """Poll the store until cancelled (an error is logged; the next poll tries again): a brief read
        (``Store.publishing_state``) each ``poll_s``, the whole sync when it changed and each second
        (an idle proxy syncing wholly every 100 ms spent ~6% of a core: docs/BENCHMARKS.md)."""
        seen: tuple[Any, ...] | None = None
        synced_at = 0.0
        while True:
            try:
                state = await self._store.publishing_state(self._registry.policy)
                if state != seen or time.monotonic() - synced_at >= _FULL_SYNC_S:
                    await self.sync_once()
                    seen, synced_at = state, time.monotonic()
            except Exception:
                log.exception("publishing adapters failed; retrying")
            await asyncio.sleep(self._poll_s)

    async def sync_once(self) -> None:
        async with self._lock:
            await self._sync()

    async def adopt(self) -> None:
        """What the store says is served, for the first calls; publishing waits for ``run``.

        The app's start-up calls this, not ``sync_once``: a vLLM that fetches an adapter by
        name may fetch it from this very proxy, which answers only once started.
        """
        async with self._lock:
            await self._reclaim_expired()
            await self._adopt_store_state()

    @asynccontextmanager
    async def held(self) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """Publish nothing until the block ends; it gets the sync to run once vLLM can load again.

        That sync also reloads at once the published versions a vLLM lacks (a restarted one).
        """
        async with self._lock:
            yield lambda: self._sync(reload_now=True)

    async def _sync(self, *, reload_now: bool = False) -> None:
        await self._reclaim_expired()
        await self._adopt_store_state()
        policy = self._registry.policy
        for version, why in await self._store.guards.discard_stale(policy):
            log.warning("adapter %s@%d %s", policy, version, why)
        training = (await self._store.guards.training(policy))["training"] == TrainingState.ACTIVE
        if training and self._router.serving():  # with no server in rotation a load could not be checked
            for version, path in await self._store.adapters.claim_trained(policy, self._owner, self._lease_s):
                await self._publish(version, path)
        if reload_now:
            self._last_reload_check = 0.0
        await self._reload_missing()
        await self._unload_outside_window()
        await self._unload_withdrawn()

    async def activate(self, version: int) -> int:
        """Roll back or forward: serve ``version`` (still on disk) as the policy. Returns it."""
        async with self._lock:
            policy = self._registry.policy
            if version != 0 and version not in self._registry.loaded_versions:
                row = await self._store.adapters.get(policy, version)
                if row is not None and row["state"] == AdapterState.PRUNED:
                    raise Conflict(f"{policy}@{version} was pruned by retention (--keep-versions): its metrics are "
                                   "kept, its files are gone.", param="version")  # fmt: skip
                if row is None or not await self._loadable(version, row["path"]):
                    raise NotFound(f"No adapter {policy}@{version} on disk or in the store.", param="version")
                await self._load_everywhere(version, row["path"])
                await self._store.adapters.published(policy, version)
            await self._flip(version)
            return version

    async def restore(self, server: Server, *, paths_only: bool = False) -> None:
        """Load every published version into ``server`` (a vLLM back in service) that it lacks.

        Runs under the publishing lock: no version is published meanwhile, so when the router
        admits the server right after, it holds every version the alias may point at.
        ``paths_only`` (the proxy's start, before it answers): versions that go by name are left
        to vLLM's resolver, which fetches one from a proxy on its first call; asking for them
        now would wait on this very proxy.
        """
        async with self._lock:
            await self._adopt_store_state()
            policy = self._registry.policy
            present = {m.get("id") for m in await server.upstream.models()}
            for version in sorted(v for v in self._registry.loaded_versions if v):
                name = f"{policy}@{version}"
                if name not in present:
                    row = await self._store.adapters.get(policy, version)
                    if row is None or (paths_only and not self._by_path(row["path"])):
                        continue
                    try:
                        await self._load_into(server.upstream, name, row["path"])
                    except ProxyError as exc:
                        if not _already_loaded(exc):  # else another proxy restored the same server first
                            raise
                    log.info("loaded %s into %s before it takes traffic again", name, server.url)
                server.versions.add(version)

    async def roll_back(self, bad: int, to: int, commit: Callable[[], Awaitable[bool]]) -> bool:
        """Serve ``to`` instead of ``bad``: ``to`` is loaded first if it must be, then ``commit`` records the
        rollback (it flips the alias in the store; False: another replica did first). ``bad`` is unloaded
        from vLLM once the requests running on it are done (after the unload grace)."""
        async with self._lock:
            policy = self._registry.policy
            if to != 0 and to not in self._registry.loaded_versions:
                row = await self._store.adapters.get(policy, to)
                if row is None or not await self._loadable(to, row["path"]):
                    log.error("cannot roll %s@%d back: %s@%d is neither on disk nor in the store", policy, bad, policy,
                              to)  # fmt: skip
                    return False
                await self._load_everywhere(to, row["path"])
                await self._store.adapters.published(policy, to)
            if not await commit():
                return False
            self._registry.active_version = to
            self._registry.loaded_versions.discard(bad)
            self._withdrawn[bad] = time.monotonic()
            return True

    async def _unload_withdrawn(self) -> None:
        now = time.monotonic()
        for version, since in list(self._withdrawn.items()):
            if now - since < self._grace_s or self._registry.in_flight[version] > 0:
                continue
            await self._unload_everywhere(version)
            del self._withdrawn[version]

    async def _unload_everywhere(self, version: int) -> None:
        """Unload ``policy@version`` from every server that takes adapters; a failure is only logged."""
        name = f"{self._registry.policy}@{version}"
        for server in self._router.servers:
            if server.state == "refused":
                continue
            try:
                await server.upstream.unload_lora(name)
                server.versions.discard(version)
            except ProxyError as exc:
                log.warning("could not unload %s from %s: %s", name, server.url, exc.message)

    async def _reclaim_expired(self) -> None:
        """Take back the claims of dead processes: adapters left loading, jobs left running."""
        if time.monotonic() - self._last_reclaim < _RECLAIM_CHECK_S:
            return
        self._last_reclaim = time.monotonic()
        for policy, version, owner in await self._store.adapters.reclaim_expired():
            log.warning("%s@%d: its publisher %s stopped before finishing; publishing it again", policy, version, owner)
        for job_id, worker in await self._store.jobs.reclaim_expired():
            log.warning("training job %d: its worker %s stopped renewing its lease; queued again", job_id, worker)

    async def _adopt_store_state(self) -> None:
        policy = self._registry.policy
        self._registry.loaded_versions = {0, *await self._store.adapters.published_versions(policy)}
        active = await self._store.policies.active_version(policy)
        if active is not None:
            self._registry.active_version = active

    async def _publish(self, version: int, path: str) -> None:
        started = time.perf_counter()
        try:
            await self._load_everywhere(version, path)
        except PublishError as exc:
            log.error("adapter %s@%d not published: %s", self._registry.policy, version, exc.message)
            await self._store.adapters.failed(self._registry.policy, version, exc.message)
            return
        if not await self._store.adapters.published(self._registry.policy, version, self._owner):
            # Our lease ran out mid-load and another replica took the adapter over: it publishes it.
            log.warning("%s@%d: the claim was taken back while loading; left to its new publisher",
                        self._registry.policy, version)  # fmt: skip
            return
        replaced = self._registry.active_version
        await self._flip(version, forward_only=True)
        if self._guard:
            await self._store.guards.watch(self._registry.policy, version, watch_record(replaced))
        log.info("published %s@%d in %.0f ms", self._registry.policy, version, (time.perf_counter() - started) * 1e3)

    async def _load_everywhere(self, version: int, path: str) -> None:
        name = f"{self._registry.policy}@{version}"
        loaded: list[Server] = []
        servers = self._router.serving()
        if not servers:
            raise PublishError(f"loading {name} failed: no vLLM server is in rotation")
        for server in servers:
            try:
                await self._load_into(server.upstream, name, path)
            except UpstreamUnreachable as exc:  # gone: out of rotation; it gets every version when back
                self._router.mark_down(server, exc.message)
                continue
            except ProxyError as exc:
                # A replica that died mid-publish loaded it; names are immutable, so it is this adapter.
                if _already_loaded(exc):
                    server.versions.add(version)
                    loaded.append(server)
                    continue
                if not await _answers(server.upstream):  # it went down mid-load (its shutdown answered 500)
                    self._router.mark_down(server, f"it stopped answering while loading {name}: {exc.message}")
                    continue
                for done in loaded:  # leave no server serving a version the others lack
                    try:
                        await done.upstream.unload_lora(name)
                        done.versions.discard(version)
                    except ProxyError:
                        log.warning("could not unload %s from %s after a failed publish", name, done.url)
                raise PublishError(f"loading {name} into {server.url} failed: {exc.message}") from exc
            server.versions.add(version)
            loaded.append(server)
        if not loaded:
            raise PublishError(f"loading {name} failed: every vLLM server left the rotation meanwhile")
        self._registry.loaded_versions.add(version)

    async def _load_into(self, replica: Upstream, name: str, path: str) -> None:
        """Returns once ``replica`` holds ``name``: sent by path, or fetched by its resolver."""
        if self._by_path(path):
            await replica.load_lora(name, path)
            return
        try:
            await replica.resolve_lora(name)
        except ProxyError as exc:
            raise ProxyError(
                f"{exc.message} (the adapter goes by name: {replica.base_url} must run tracetrain_vllm's resolver, "
                "with TRACETRAIN_ADAPTERS_URL naming a proxy)"
            ) from exc

    def _by_path(self, path: str) -> bool:
        if self._delivery == "auto":
            return Path(path).is_dir()
        return self._delivery == "path"

    async def _loadable(self, version: int, path: str) -> bool:
        """Whether ``version`` can still be loaded: its directory, or its files in the store."""
        if self._by_path(path):
            return Path(path).is_dir()
        return await self._store.adapter_files.has_files(self._registry.policy, version)

    async def _flip(self, version: int, *, forward_only: bool = False) -> None:
        if not await self._store.policies.flip(self._registry.policy, version, forward_only=forward_only):
            # Another replica published a newer version meanwhile: the alias stays on it.
            log.info("%s@%d published; the alias stays on a newer version", self._registry.policy, version)
            return
        self._registry.active_version = version
        self._left_window.pop(version, None)

    async def _reload_missing(self) -> None:
        """A restarted vLLM has lost its adapters: load the published ones again."""
        if time.monotonic() - self._last_reload_check < _RELOAD_CHECK_S:
            return
        self._last_reload_check = time.monotonic()
        wanted = {v: f"{self._registry.policy}@{v}" for v in self._registry.loaded_versions if v}
        if not wanted:
            return
        for server in self._router.serving():
            try:
                present = {str(m.get("id")) for m in await server.upstream.models()}
            except ProxyError:
                continue  # down: the router's health check takes it out; it is restored when back
            prefix = f"{self._registry.policy}@"
            server.versions = {
                int(n[len(prefix) :]) for n in present if n.startswith(prefix) and n[len(prefix) :].isdigit()
            }
            for version, name in wanted.items():
                row = None if name in present else await self._store.adapters.get(self._registry.policy, version)
                if row is not None:
                    try:
                        await self._load_into(server.upstream, name, row["path"])
                        server.versions.add(version)
                        log.info("reloaded %s into %s", name, server.url)
                    except ProxyError as exc:
                        server.versions.discard(version)
                        log.warning("could not reload %s into %s: %s", name, server.url, exc.message)

    async def _unload_outside_window(self) -> None:
        loaded = sorted(v for v in self._registry.loaded_versions if v)
        keep = set(loaded[-self._keep :]) | {self._registry.active_version}
        now = time.monotonic()
        for version in loaded:
            if version in keep:
                self._left_window.pop(version, None)
                continue
            left = self._left_window.setdefault(version, now)
            if now - left < self._grace_s or self._registry.in_flight[version] > 0:
                continue
            self._registry.loaded_versions.discard(version)
            self._left_window.pop(version, None)
            # One replica retires a version (a guarded move) and unloads it; the others adopt that.
            if not await self._store.adapters.retired(self._registry.policy, version):
                continue
            await self._unload_everywhere(version)
