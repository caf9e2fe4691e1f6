"""Adapters into and out of vLLM servers: by path or through vLLM's resolver, all or none.

Every policy's versions go into the same servers, each under its own immutable name (``NAME@N``).

A version is loaded into every server in rotation or into none: a failed load unloads it
from the servers that took it, so no server serves a version the others lack. A server that
refuses the connection, or fails the load and then no longer answers ``/health`` (stopped
mid-load), leaves the rotation and the load goes on without it (the router restores it
when it is back, ``Publisher.restore``). Loading a name a server already holds counts as
loaded: names are immutable, so it is the same adapter (a replica that died mid-publish
loaded it).

Adapters reach vLLM one of two ways (``--adapter-delivery``). By path: vLLM is sent the
directory the trainer wrote (one box, or a filesystem shared by every machine). Through
the resolver: vLLM is asked for ``policy@N`` by name, and tracetrain_vllm's LoRA resolver,
running inside vLLM, downloads the files the trainer recorded in the store from
``GET /v1/adapters/...`` of a proxy (``Upstream.resolve_lora``). Either way the call
returns once that vLLM holds the version. ``auto`` goes by path when the directory exists
on this machine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Literal

from proxy.errors import ProxyError, UpstreamUnreachable
from proxy.gateway import PolicyRegistry
from proxy.gateway.upstream import Router, Server, Upstream
from store import Store

log = logging.getLogger("tracetrain.publisher")

_RELOAD_CHECK_S = 5.0
# How adapters reach vLLM: the trainer's directory by path, or fetched by vLLM's tracetrain resolver.
AdapterDelivery = Literal["auto", "path", "resolver"]


def already_loaded(exc: ProxyError) -> bool:
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


class AdapterLoader:
    """Loads and unloads every policy's versions in the router's servers; the publisher decides which and when."""

    def __init__(self, store: Store, registry: PolicyRegistry, router: Router, delivery: AdapterDelivery) -> None:
        self._store = store
        self._registry = registry
        self._router = router
        self._delivery = delivery
        self._last_reload_check = 0.0

    async def load_everywhere(self, policy: str, version: int, path: str) -> None:
        """``policy@version`` into every server in rotation, or into none (``PublishError``)."""
        name = f"{policy}@{version}"
        loaded: list[Server] = []
        servers = self._router.serving()
        if not servers:
            raise PublishError(f"loading {name} failed: no vLLM server is in rotation")
        for server in servers:
            try:
                await self.load_into(server.upstream, name, path)
            except UpstreamUnreachable as exc:  # gone: out of rotation; it gets every version when back
                self._router.mark_down(server, exc.message)
                continue
            except ProxyError as exc:
                # A replica that died mid-publish loaded it; names are immutable, so it is this adapter.
                if already_loaded(exc):
                    server.versions.add(name)
                    loaded.append(server)
                    continue
                if not await _answers(server.upstream):  # it went down mid-load (its shutdown answered 500)
                    self._router.mark_down(server, f"it stopped answering while loading {name}: {exc.message}")
                    continue
                for done in loaded:  # leave no server serving a version the others lack
                    try:
                        await done.upstream.unload_lora(name)
                        done.versions.discard(name)
                    except ProxyError:
                        log.warning("could not unload %s from %s after a failed publish", name, done.url)
                raise PublishError(f"loading {name} into {server.url} failed: {exc.message}") from exc
            server.versions.add(name)
            loaded.append(server)
        if not loaded:
            raise PublishError(f"loading {name} failed: every vLLM server left the rotation meanwhile")

    async def load_into(self, replica: Upstream, name: str, path: str) -> None:
        """Returns once ``replica`` holds ``name``: sent by path, or fetched by its resolver."""
        if self.by_path(path):
            await replica.load_lora(name, path)
            return
        try:
            await replica.resolve_lora(name)
        except ProxyError as exc:
            raise ProxyError(
                f"{exc.message} (the adapter goes by name: {replica.name} must run tracetrain_vllm's resolver, "
                "with TRACETRAIN_ADAPTERS_URL naming a proxy)"
            ) from exc

    def by_path(self, path: str) -> bool:
        if self._delivery == "auto":
            return Path(path).is_dir()
        return self._delivery == "path"

    async def loadable(self, policy: str, version: int, path: str) -> bool:
        """Whether ``policy@version`` can still be loaded: its directory, or its files in the store."""
        if self.by_path(path):
            return Path(path).is_dir()
        return await self._store.adapter_files.has_files(policy, version)

    async def unload_everywhere(self, policy: str, version: int) -> None:
        """Unload ``policy@version`` from every server that takes adapters; a failure is only logged (one that
        no longer holds it, unloaded by another replica or restarted, is no failure)."""
        name = f"{policy}@{version}"
        for server in self._router.servers:
            if server.state == "refused":
                continue
            try:
                await server.upstream.unload_lora(name)
            except ProxyError as exc:
                if exc.status_code != 404:
                    log.warning("could not unload %s from %s: %s", name, server.url, exc.message)
                    continue
            server.versions.discard(name)

    async def reload_missing(self, *, now: bool = False) -> None:
        """A restarted vLLM has lost its adapters: load every policy's published ones again."""
        if not now and time.monotonic() - self._last_reload_check < _RELOAD_CHECK_S:
            return
        self._last_reload_check = time.monotonic()
        wanted = {state.adapter(v): (state.name, v) for state in self._registry for v in state.loaded_versions if v}
        if not wanted:
            return
        for server in self._router.serving():
            try:
                present = {str(m.get("id")) for m in await server.upstream.models()}
            except ProxyError:
                continue  # down: the router's health check takes it out; it is restored when back
            server.versions = {name for name in present if "@" in name}
            for name, (policy, version) in wanted.items():
                row = None if name in present else await self._store.adapters.get(policy, version)
                if row is not None:
                    try:
                        await self.load_into(server.upstream, name, row["path"])
                        server.versions.add(name)
                        log.info("reloaded %s into %s", name, server.url)
                    except ProxyError as exc:
                        server.versions.discard(name)
                        log.warning("could not reload %s into %s: %s", name, server.url, exc.message)
