"""Several vLLM servers behind one proxy: which one serves each call.

    pick(trajectory)   the first server of the trajectory's own ranking (rendezvous hashing of its
                       id over the servers in rotation) that is not over its load bound: the same
                       server on every proxy, with no state shared (``proxy.gateway.upstream._placement``).
                       vLLM's prefix cache there holds the trajectory's history, whichever proxy
                       a balancer hands each call to. A new trajectory is placed the same way: the
                       hash spreads new ones, the bound keeps a burst off a server already busy.

Picking hashes the trajectory id once per server in rotation (~0.5 µs each): no await, no memory
per trajectory.

A server leaves the rotation when a connection to it is refused, or when it fails its health
check (``GET /health`` every ``health_check_s``). A call whose connection was refused sent
nothing, so it goes to another server at once; a call that broke after it was sent is answered
as it broke (vLLM may have run it). A server that answers ``/health`` again is handed to
``restore`` (the publisher loads every published adapter into it) and takes traffic again only
once that succeeded: a call for ``policy@N`` never reaches a server without ``policy@N``.

vLLM's own data-parallel mode (``--data-parallel-size N``) starts N API server processes by
default, each with its own list of LoRA adapters: ``/v1/load_lora_adapter`` reaches one of
them, and calls for the adapter that land on the others fail. A server whose ``/metrics``
reports more than one engine is therefore refused (it never joins the rotation, and says why
in the log, ``/readyz``, ``/metrics`` and the dashboard): start one vLLM per GPU group instead
and name each with ``--upstream``.

With one server nothing changes from a single upstream. When no server is in rotation, calls
still go to the ones merely down (a health check may lag behind a restart); they get the
upstream's own error if it really is down.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import httpx

from proxy._periodic import every
from proxy.errors import ProxyError, UpstreamNotReady, UpstreamUnreachable
from proxy.gateway.upstream._client import Reply, Upstream, UpstreamStream
from proxy.gateway.upstream._http1 import ConnectFailed
from proxy.gateway.upstream._placement import choose, server_salt

log = logging.getLogger("tracetrain.router")

# in rotation; unreachable or unhealthy; answering again, getting its adapters; data parallel, never used
State = Literal["serving", "down", "restoring", "refused"]
UPSTREAM_STATES: tuple[State, ...] = get_args(State)  # every state, for /metrics' one series per state
_ENGINE = re.compile(rb'^vllm:[^{\s]*\{[^}]*engine="([^"]*)"', re.MULTILINE)


@dataclass(eq=False, slots=True)
class Server:
    """One vLLM server: its state as the router sees it, and the adapter versions it holds."""

    upstream: Upstream
    state: State = "down"
    in_flight: int = 0
    versions: set[str] = field(default_factory=set)  # adapters loaded into it, by name ("NAME@N"; the base always is)
    problem: str | None = "not checked yet"  # why it is out of rotation
    failovers: int = 0  # calls sent elsewhere because it refused their connection
    salt: bytes = field(init=False)  # its scores' salt: the hash of its URL (proxy.gateway.upstream._placement)

    def __post_init__(self) -> None:
        self.salt = server_salt(self.upstream.base_url)

    @property
    def url(self) -> str:
        """The server's URL as logs, /metrics and /readyz show it: without its password."""
        return self.upstream.name

    def view(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "healthy": self.state == "serving",
            "in_flight": self.in_flight,
            "versions": sorted(self.versions),
            "problem": self.problem,
            "failovers": self.failovers,
        }


def _refused(exc: ProxyError) -> bool:
    """The connection was never made, so nothing was sent: the call can go to another server."""
    return isinstance(exc, UpstreamUnreachable) and isinstance(exc.__cause__, (httpx.ConnectError, ConnectFailed))


class Router:
    """Routes calls over ``upstreams`` (see the module's docstring); ``run()`` checks their health."""

    def __init__(self, upstreams: Sequence[Upstream], *, health_check_s: float = 2.0) -> None:
        if not upstreams:
            raise ValueError("a router needs at least one upstream")
        self.servers = [Server(upstream) for upstream in upstreams]
        self._serving: list[Server] = []  # filled by the first health check (check_once)
        self._health_check_s = health_check_s

    @property
    def upstreams(self) -> list[Upstream]:
        return [server.upstream for server in self.servers]

    def serving(self) -> list[Server]:
        """The servers in rotation."""
        return list(self._serving)

    async def base_model(self) -> str:
        """The base model the servers serve, asked of those in rotation first."""
        order = [*self._serving, *(s for s in self.servers if s.state != "refused" and s not in self._serving)]
        error: ProxyError = UpstreamNotReady(self.why_none())
        for server in order:
            try:
                return await server.upstream.base_model()
            except ProxyError as exc:
                error = exc
        raise error

    def views(self) -> list[dict[str, Any]]:
        """Each server as /metrics and the dashboard show it."""
        return [server.view() for server in self.servers]

    # -- the call path --

    def pick(self, trajectory_id: str, avoid: Sequence[Server] = ()) -> Server:
        """The server for the next call of ``trajectory_id`` (see the module's docstring)."""
        candidates = [s for s in self._serving if s not in avoid] if avoid else self._serving
        if not candidates:  # none in rotation: try those merely down (their health check may lag)
            candidates = [s for s in self.servers if s.state == "down" and s not in avoid]
        if not candidates:
            raise UpstreamNotReady(self.why_none())
        return choose(trajectory_id, candidates)

    def why_none(self) -> str:
        """Why no server is in rotation, server by server."""
        problems = "; ".join(f"{s.url}: {s.problem or s.state}" for s in self.servers)
        return f"no vLLM server can take the call ({problems})"

    async def post(self, trajectory_id: str, path: str, body: bytes) -> Reply:
        """POST to the trajectory's server and read the whole answer; a refused connection tries another."""
        tried: list[Server] = []
        while True:
            server = self.pick(trajectory_id, tried)
            server.in_flight += 1
            try:
                return await server.upstream.post(path, body)
            except ProxyError as exc:
                self._failed(server, exc, tried)
            finally:
                server.in_flight -= 1

    async def open_stream(
        self, trajectory_id: str, path: str, body: bytes
    ) -> tuple[UpstreamStream, Callable[[], None]]:
        """Open a stream on the trajectory's server; call the second item once the stream is closed.

        The server counts the stream in flight until then. A refused connection tries another server.
        """
        tried: list[Server] = []
        while True:
            server = self.pick(trajectory_id, tried)
            server.in_flight += 1
            try:
                response = await server.upstream.open_stream(path, body)
            except ProxyError as exc:
                server.in_flight -= 1
                self._failed(server, exc, tried)
                continue
            except BaseException:  # cancelled
                server.in_flight -= 1
                raise
            return response, _Done(server)

    def _failed(self, server: Server, exc: ProxyError, tried: list[Server]) -> None:
        """Re-raise ``exc`` unless it was a refused connection and another server is left to try."""
        if not _refused(exc):
            raise exc
        self.mark_down(server, exc.message)
        tried.append(server)
        if not any(s.state in ("serving", "down") and s not in tried for s in self.servers):
            raise exc
        server.failovers += 1
        log.warning("%s refused a call's connection; sending it to another server", server.url)

    # -- rotation --

    def mark_down(self, server: Server, problem: str) -> None:
        if server.state == "serving":
            log.error("%s leaves the rotation: %s", server.url, problem)
        server.state, server.problem = "down", problem
        self._serving = [s for s in self.servers if s.state == "serving"]

    def _admit(self, server: Server) -> None:
        server.state, server.problem = "serving", None
        self._serving = [s for s in self.servers if s.state == "serving"]
        log.info("%s is in rotation (adapters loaded: %s)", server.url, sorted(server.versions) or "none")

    async def run(self, restore: Callable[[Server], Awaitable[None]]) -> None:
        """Check every server's health until cancelled; ``restore`` readies one that came back."""
        await every(self._health_check_s, lambda: self.check_once(restore), log, "checking vLLM's health failed")

    async def check_once(self, restore: Callable[[Server], Awaitable[None]] | None = None) -> None:
        """One health check of every server, at once; returning servers are restored, then admitted."""
        await asyncio.gather(*(self._check(server, restore) for server in self.servers))

    async def _check(self, server: Server, restore: Callable[[Server], Awaitable[None]] | None) -> None:
        try:
            await server.upstream.health()
        except ProxyError as exc:
            self.mark_down(server, f"/health failed: {exc.message}")
            return
        if server.state in ("serving", "refused"):
            return
        if engines := await _data_parallel_engines(server.upstream):
            server.state = "refused"
            server.problem = (
                f"vLLM data parallel ({engines} engines behind one server): /v1/load_lora_adapter reaches only one "
                "of its API processes, so adapters would be missing on the others. Start one vLLM per GPU group "
                "(no --data-parallel-size) and name each with --upstream."
            )
            self._serving = [s for s in self.servers if s.state == "serving"]
            log.error("%s is refused: %s", server.url, server.problem)
            return
        server.state = "restoring"
        try:
            if restore is not None:
                await restore(server)
        except Exception as exc:  # stays out of rotation; the next check tries again
            server.state = "down"
            server.problem = f"loading its adapters failed: {exc.message if isinstance(exc, ProxyError) else exc!r}"
            log.error("%s answers again but %s", server.url, server.problem)
            return
        self._admit(server)


class _Done:
    """Ends one stream's count in flight, once, however often it is called."""

    __slots__ = ("_server",)

    def __init__(self, server: Server) -> None:
        self._server: Server | None = server

    def __call__(self) -> None:
        if self._server is not None:
            self._server.in_flight -= 1
            self._server = None


async def _data_parallel_engines(upstream: Upstream) -> int:
    """How many engines the server's ``/metrics`` reports when more than one, else 0 (also when it has none)."""
    try:
        text = await upstream.prometheus()
    except ProxyError:
        return 0  # no /metrics (not vLLM?): nothing to tell
    engines = set(_ENGINE.findall(text))
    return len(engines) if len(engines) > 1 else 0
