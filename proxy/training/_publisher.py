"""Publishing adapters: load into every vLLM, flip the alias, unload what fell out of the window.

Every policy the proxy serves is published the same way, side by side in the same vLLM servers;
which policies those are, the store says (``proxy.training._policy_sync``: added, retired, their
settings). The trainer writes an adapter and records it (state ``trained``). The publisher claims
it, loads it as ``policy@N`` into every vLLM server in rotation (``proxy.gateway.upstream._router``),
and only when all loaded flips the policy's alias to N; a request already running finishes on the
version it started with. Versions beyond the policy's newest ``keep_versions`` (the active one
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

How a version gets into a vLLM server (by path, or by name through its resolver) and out again:
``proxy.training._loading``.

While vLLM sleeps for a training step (``--share-gpu``), the hand-over's coordinator holds
the publisher (``held()``): nothing is loaded into a sleeping vLLM; once it is awake the
coordinator publishes what the step recorded before any held call goes on.

With a canary (``canary``: the share of new trajectories a new version serves), a loaded version
is published on trial instead of becoming the alias (``store.Trials.start``), one trial at a time:
while one runs nothing is claimed, and then only the newest trained version. The registry's split
is the store's running trial, adopted with the alias; ``promote`` and ``roll_back`` end a trial
(``proxy.training._canary``). An admin's ``activate`` waits for the trial's end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from proxy._periodic import every
from proxy._policy_config import policy_settings
from proxy._settings import Settings
from proxy.errors import Conflict, NotFound, ProxyError
from proxy.gateway import PolicyRegistry, ServedPolicy, Split
from proxy.gateway.upstream import Router, Server
from proxy.training._loading import AdapterDelivery, AdapterLoader, PublishError, already_loaded
from proxy.training._policy_sync import PolicySync
from proxy.training._regression import watch_record
from store import AdapterState, Store, TrainingState

log = logging.getLogger("tracetrain.publisher")

# A publish takes milliseconds to seconds per vLLM; a replica that held a claim this long is gone.
PUBLISH_LEASE_S = 120.0
_RECLAIM_CHECK_S = 5.0
_FULL_SYNC_S = 1.0  # between these, a poll syncs only when the store's publishing state changed


class Publisher:
    def __init__(
        self,
        store: Store,
        registry: PolicyRegistry,
        router: Router,
        settings: Settings,
        *,
        poll_s: float = 0.1,
        unload_grace_s: float | None = None,
        lease_s: float = PUBLISH_LEASE_S,
        delivery: AdapterDelivery | None = None,
    ) -> None:
        """``settings``: the server's (each policy's own are the store's overrides over them); the unload grace
        and the delivery are ``settings``' unless given."""
        self._store = store
        self._loader = AdapterLoader(store, registry, router, delivery or settings.adapter_delivery)
        defaults = settings.policy_defaults
        self._policies = PolicySync(store, registry, self._loader, lambda name, stored: policy_settings(
            name, defaults, stored))  # fmt: skip
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._lease_s = lease_s
        self._last_reclaim = 0.0
        self._registry = registry
        self._router = router
        self._poll_s = poll_s
        self._grace_s = settings.unload_grace_s if unload_grace_s is None else unload_grace_s
        self._left_window: dict[tuple[str, int], float] = {}
        self._seen: tuple[Any, ...] | None = None  # the store's publishing state at the last whole sync
        self._synced_at = 0.0
        self._lock = asyncio.Lock()
        # rolled-back versions still loaded -> when they were withdrawn
        self._withdrawn: dict[tuple[str, int], float] = {}

    async def run(self) -> None:
        """Poll the store until cancelled (an error is logged; the next poll tries again): a brief read
        (``Store.publishing_state``) each ``poll_s``, the whole sync when it changed and each second
        (an idle proxy syncing wholly every 100 ms spent ~6% of a core: docs/BENCHMARKS.md)."""
        await every(self._poll_s, self._poll, log, "publishing adapters failed; retrying")

    async def _poll(self) -> None:
        state = await self._store.publishing_state()
        if state != self._seen or time.monotonic() - self._synced_at >= _FULL_SYNC_S:
            await self.sync_once()
            self._seen, self._synced_at = state, time.monotonic()

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
            await self._policies.adopt(load=False)
            await self._adopt_trials()

    @asynccontextmanager
    async def held(self) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """Publish nothing until the block ends; it gets the sync to run once vLLM can load again.

        That sync also reloads at once the published versions a vLLM lacks (a restarted one).
        """
        async with self._lock:
            yield lambda: self._sync(reload_now=True)

    async def _sync(self, *, reload_now: bool = False) -> None:
        await self._reclaim_expired()
        await self._policies.adopt()
        await self._adopt_trials()
        for served in self._registry:
            await self._publish_trained(served)
        await self._loader.reload_missing(now=reload_now)
        for served in self._registry:
            await self._unload_outside_window(served)
        await self._unload_withdrawn()
        await self._policies.unload_retired(self._grace_s)

    async def _publish_trained(self, served: ServedPolicy) -> None:
        """Publish what the trainer recorded for ``served`` (while it trains: a paused policy's are discarded)."""
        policy = served.name
        for version, why in await self._store.guards.discard_stale(policy):
            log.warning("adapter %s@%d %s", policy, version, why)
        training = (await self._store.guards.training(policy))["training"] == TrainingState.ACTIVE
        if training and self._router.serving():  # with no server in rotation a load could not be checked
            for version, path in await self._claim(served):
                await self._publish(served, version, path)

    async def _claim(self, served: ServedPolicy) -> list[tuple[int, str]]:
        """What to publish now: every trained version; with a canary (the policy's ``canary``), the newest, and
        nothing while the policy's trial runs."""
        policy = served.name
        if served.settings.canary is None:
            return await self._store.adapters.claim_trained(policy, self._owner, self._lease_s)
        if await self._store.trials.running(policy) is not None:
            return []
        return await self._store.adapters.claim_trained(policy, self._owner, self._lease_s, newest_only=True)

    async def activate(self, policy: str, version: int) -> int:
        """Roll back or forward: serve ``version`` (still on disk) as ``policy``. Returns it."""
        async with self._lock:
            served = self._served(policy)
            if (trial := await self._store.trials.running(policy)) is not None:
                raise Conflict(f"{policy}@{trial['candidate']} is on canary trial (trial {trial['id']}): end the "
                               "trial first, promoting or rolling it back (POST /admin/trials/{id}/promote or "
                               "/roll-back, or the dashboard's Trials page).", code="trial_running")  # fmt: skip
            if version != 0 and version not in served.loaded_versions:
                row = await self._store.adapters.get(policy, version)
                if row is not None and row["state"] == AdapterState.PRUNED:
                    raise Conflict(f"{policy}@{version} was pruned by retention (--keep-versions): its metrics are "
                                   "kept, its files are gone.", param="version")  # fmt: skip
                if row is None or not await self._loader.loadable(policy, version, row["path"]):
                    raise NotFound(f"No adapter {policy}@{version} on disk or in the store.", param="version")
                await self._loader.load_everywhere(policy, version, row["path"])
                served.loaded_versions.add(version)
                await self._store.adapters.published(policy, version)
            await self._flip(served, version)
            return version

    def _served(self, policy: str) -> ServedPolicy:
        if policy not in self._registry:
            raise NotFound(f"No policy '{policy}' is served (see GET /admin/policies).", param="policy",
                           code="policy_not_found")  # fmt: skip
        return self._registry.get(policy)

    async def restore(self, server: Server, *, paths_only: bool = False) -> None:
        """Load every published version of every policy into ``server`` (a vLLM back in service) that it lacks.

        Runs under the publishing lock: no version is published meanwhile, so when the router
        admits the server right after, it holds every version an alias may point at.
        ``paths_only`` (the proxy's start, before it answers): versions that go by name are left
        to vLLM's resolver, which fetches one from a proxy on its first call; asking for them
        now would wait on this very proxy.
        """
        async with self._lock:
            await self._policies.adopt(load=False)
            present = {m.get("id") for m in await server.upstream.models()}
            for served in self._registry:
                for version in sorted(v for v in served.loaded_versions if v):
                    name = served.adapter(version)
                    if name not in present:
                        row = await self._store.adapters.get(served.name, version)
                        if row is None or (paths_only and not self._loader.by_path(row["path"])):
                            continue
                        try:
                            await self._loader.load_into(server.upstream, name, row["path"])
                        except ProxyError as exc:
                            if not already_loaded(exc):  # else another proxy restored the same server first
                                raise
                        log.info("loaded %s into %s before it takes traffic again", name, server.url)
                    server.versions.add(name)

    async def roll_back(self, policy: str, bad: int, to: int, commit: Callable[[], Awaitable[bool]]) -> bool:
        """Serve ``to`` instead of ``bad`` as ``policy``: ``to`` is loaded first if it must be, then ``commit``
        records the rollback (it flips the alias in the store; False: another replica did first). ``bad`` is
        unloaded from vLLM once the requests running on it are done (after the unload grace)."""
        async with self._lock:
            if policy not in self._registry:
                return False  # retired meanwhile: nothing of it is served
            served = self._registry.get(policy)
            if to != 0 and to not in served.loaded_versions:
                row = await self._store.adapters.get(policy, to)
                if row is None or not await self._loader.loadable(policy, to, row["path"]):
                    log.error("cannot roll %s@%d back: %s@%d is neither on disk nor in the store", policy, bad, policy,
                              to)  # fmt: skip
                    return False
                await self._loader.load_everywhere(policy, to, row["path"])
                served.loaded_versions.add(to)
                await self._store.adapters.published(policy, to)
            if not await commit():
                return False
            served.active_version = to
            served.loaded_versions.discard(bad)
            self._withdrawn[(policy, bad)] = time.monotonic()
            await self._adopt_trial(served)
            return True

    async def promote(self, policy: str, version: int, commit: Callable[[], Awaitable[bool]]) -> bool:
        """``policy``'s version on canary trial serves everything: ``commit`` ends the trial and flips the alias
        in the store (False: another replica or an admin ended it first)."""
        async with self._lock:
            if not await commit():
                return False
            if policy in self._registry:
                served = self._registry.get(policy)
                served.active_version = version
                self._left_window.pop((policy, version), None)
                await self._adopt_trial(served)
            return True

    async def _unload_withdrawn(self) -> None:
        now = time.monotonic()
        for (policy, version), since in list(self._withdrawn.items()):
            if now - since < self._grace_s or self._registry.in_flight[(policy, version)] > 0:
                continue
            await self._loader.unload_everywhere(policy, version)
            del self._withdrawn[(policy, version)]

    async def _reclaim_expired(self) -> None:
        """Take back the claims of dead processes: adapters left loading, jobs left running."""
        if time.monotonic() - self._last_reclaim < _RECLAIM_CHECK_S:
            return
        self._last_reclaim = time.monotonic()
        for policy, version, owner in await self._store.adapters.reclaim_expired():
            log.warning("%s@%d: its publisher %s stopped before finishing; publishing it again", policy, version, owner)
        for job_id, worker in await self._store.jobs.reclaim_expired():
            log.warning("training job %d: its worker %s stopped renewing its lease; queued again", job_id, worker)

    async def _adopt_trials(self) -> None:
        """Each policy's canary trial the store says runs, as the registry splits its trajectories."""
        for served in self._registry:
            await self._adopt_trial(served)

    async def _adopt_trial(self, served: ServedPolicy) -> None:
        """The policy's running canary trial, as the registry splits its trajectories (``proxy.gateway.Split``)."""
        trial = await self._store.trials.running(served.name)
        served.split = None if trial is None else Split(
            int(trial["id"]), int(trial["candidate"]), int(trial["baseline"]), float(trial["fraction"])
        )  # fmt: skip

    async def _publish(self, served: ServedPolicy, version: int, path: str) -> None:
        policy = served.name
        started = time.perf_counter()
        try:
            await self._loader.load_everywhere(policy, version, path)
        except PublishError as exc:
            log.error("adapter %s@%d not published: %s", policy, version, exc.message)
            await self._store.adapters.failed(policy, version, exc.message)
            return
        if served.settings.canary is not None:
            await self._start_trial(served, version, started)
            return
        served.loaded_versions.add(version)
        if not await self._store.adapters.published(policy, version, self._owner):
            _claim_lost(policy, version)
            return
        replaced = served.active_version
        await self._flip(served, version, forward_only=True)
        if served.settings.regression_guard:
            await self._store.guards.watch(policy, version, watch_record(replaced))
        log.info("published %s@%d in %.0f ms", policy, version, (time.perf_counter() - started) * 1e3)

    async def _start_trial(self, served: ServedPolicy, version: int, started: float) -> None:
        """A loaded version goes on canary trial; if another trial of its policy began meanwhile, it waits
        (unloaded first, while this replica still holds its claim: no other replica loads it meanwhile)."""
        policy = served.name
        trial = await self._store.trials.start(policy, version, self._owner, float(served.settings.canary or 0))
        if trial == "claim lost":
            _claim_lost(policy, version)
            return
        if isinstance(trial, str):
            await self._loader.unload_everywhere(policy, version)
            if await self._store.trials.release(policy, version, self._owner):
                log.info("%s@%d waits: another version went on trial first", policy, version)
            return
        served.loaded_versions.add(version)
        served.split = Split(int(trial["id"]), version, int(trial["baseline"]), float(trial["fraction"]))
        log.info("published %s@%d on canary trial in %.0f ms: it serves %.0f%% of new trajectories, @%d the rest",
                 policy, version, (time.perf_counter() - started) * 1e3, trial["fraction"] * 100,
                 trial["baseline"])  # fmt: skip

    async def _flip(self, served: ServedPolicy, version: int, *, forward_only: bool = False) -> None:
        if not await self._store.policies.flip(served.name, version, forward_only=forward_only):
            # Another replica published a newer version meanwhile: the alias stays on it.
            log.info("%s@%d published; the alias stays on a newer version", served.name, version)
            return
        served.active_version = version
        self._left_window.pop((served.name, version), None)

    async def _unload_outside_window(self, served: ServedPolicy) -> None:
        loaded = sorted(v for v in served.loaded_versions if v)
        keep = set(loaded[-served.settings.keep_versions :]) | {served.active_version}
        now = time.monotonic()
        for version in loaded:
            key = (served.name, version)
            if version in keep:
                self._left_window.pop(key, None)
                continue
            left = self._left_window.setdefault(key, now)
            if now - left < self._grace_s or self._registry.in_flight[key] > 0:
                continue
            served.loaded_versions.discard(version)
            self._left_window.pop(key, None)
            # One replica retires a version (a guarded move) and unloads it; the others adopt that.
            if not await self._store.adapters.retired(served.name, version):
                continue
            await self._loader.unload_everywhere(served.name, version)


def _claim_lost(policy: str, version: int) -> None:
    # Our lease ran out mid-load and another replica took the adapter over: it publishes it.
    log.warning("%s@%d: the claim was taken back while loading; left to its new publisher", policy, version)
