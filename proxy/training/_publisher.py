"""Publishing adapters: load into every vLLM, flip the alias, unload what fell out of the window.

The trainer writes an adapter and records it (state ``trained``). The publisher claims
it, loads it as ``policy@N`` into every configured vLLM replica, and only when all
loaded flips the policy's alias to N; a request already running finishes on the
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

Versions are immutable names: a name is never reloaded with other weights, so vLLM's
prefix cache cannot serve an old policy under a new name.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from proxy.errors import NotFound, ProxyError
from proxy.gateway._policies import PolicyRegistry
from proxy.gateway._upstream import Upstream
from store import Store

log = logging.getLogger("tracetrain.publisher")

_UNLOAD_GRACE_S = 30.0
_RELOAD_CHECK_S = 5.0
# A publish takes milliseconds to seconds per vLLM; a replica that held a claim this long is gone.
PUBLISH_LEASE_S = 120.0
_RECLAIM_CHECK_S = 5.0


def _already_loaded(exc: ProxyError) -> bool:
    """vLLM's answer to loading a name it holds (400, "... has already been loaded ...")."""
    return exc.status_code == 400 and "has already been loaded" in exc.message


class PublishError(ProxyError):
    status_code = 502
    type = "upstream_error"
    code = "adapter_load_failed"


class Publisher:
    def __init__(
        self,
        store: Store,
        registry: PolicyRegistry,
        replicas: Sequence[Upstream],
        *,
        keep_versions: int,
        poll_s: float = 0.1,
        unload_grace_s: float = _UNLOAD_GRACE_S,
        lease_s: float = PUBLISH_LEASE_S,
    ) -> None:
        self._store = store
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._lease_s = lease_s
        self._last_reclaim = 0.0
        self._registry = registry
        self._replicas = list(replicas)
        self._keep = keep_versions
        self._poll_s = poll_s
        self._grace_s = unload_grace_s
        self._left_window: dict[int, float] = {}
        self._last_reload_check = 0.0
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Poll the store until cancelled; an error is logged and the next poll tries again."""
        while True:
            try:
                await self.sync_once()
            except Exception:
                log.exception("publishing adapters failed; retrying")
            await asyncio.sleep(self._poll_s)

    async def sync_once(self) -> None:
        async with self._lock:
            await self._sync()

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
        for version, path in await self._store.adapters.claim_trained(policy, self._owner, self._lease_s):
            await self._publish(version, path)
        if reload_now:
            self._last_reload_check = 0.0
        await self._reload_missing()
        await self._unload_outside_window()

    async def activate(self, version: int) -> int:
        """Roll back or forward: serve ``version`` (still on disk) as the policy. Returns it."""
        async with self._lock:
            policy = self._registry.policy
            if version != 0 and version not in self._registry.loaded_versions:
                row = await self._store.adapters.get(policy, version)
                if row is None or not Path(row["path"]).is_dir():
                    raise NotFound(f"No adapter {policy}@{version} on disk.", param="version")
                await self._load_everywhere(version, row["path"])
                await self._store.adapters.published(policy, version)
            await self._flip(version)
            return version

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
        await self._flip(version, forward_only=True)
        log.info("published %s@%d in %.0f ms", self._registry.policy, version, (time.perf_counter() - started) * 1e3)

    async def _load_everywhere(self, version: int, path: str) -> None:
        name = f"{self._registry.policy}@{version}"
        loaded: list[Upstream] = []
        for replica in self._replicas:
            try:
                await replica.load_lora(name, path)
            except ProxyError as exc:
                # A replica that died mid-publish loaded it; names are immutable, so it is this adapter.
                if _already_loaded(exc):
                    loaded.append(replica)
                    continue
                for done in loaded:  # leave no replica serving a version the others lack
                    try:
                        await done.unload_lora(name)
                    except ProxyError:
                        log.warning("could not unload %s from %s after a failed publish", name, done.base_url)
                raise PublishError(f"loading {name} into {replica.base_url} failed: {exc.message}") from exc
            loaded.append(replica)
        self._registry.loaded_versions.add(version)

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
        for replica in self._replicas:
            try:
                present = {m.get("id") for m in await replica.models()}
            except ProxyError:
                continue  # down: requests will say so; try again later
            for version, name in wanted.items():
                row = None if name in present else await self._store.adapters.get(self._registry.policy, version)
                if row is not None:
                    try:
                        await replica.load_lora(name, row["path"])
                        log.info("reloaded %s into %s", name, replica.base_url)
                    except ProxyError as exc:
                        log.warning("could not reload %s into %s: %s", name, replica.base_url, exc.message)

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
            name = f"{self._registry.policy}@{version}"
            for replica in self._replicas:
                try:
                    await replica.unload_lora(name)
                except ProxyError as exc:
                    log.warning("could not unload %s from %s: %s", name, replica.base_url, exc.message)
