"""The floor under the proxy: what a relay in its process model pays per call while doing none of its work.

Two relays, each a process of its own in front of the fake vLLM, load-tested as the proxy is
(``bench/proxy_cpu.py --floor``):

- ``pipe``: a TCP relay on uvloop, no HTTP at all: each client connection gets one connection to the
  upstream, and bytes are copied both ways as they arrive. What the kernel's sockets and the event loop
  cost a call, and nothing else.
- ``asgi``: uvicorn run as ``tracetrain serve`` runs it (httptools, uvloop, its protocol with the front
  door's deadlines) and an app that posts each request's body unchanged to the upstream over the proxy's
  own HTTP/1.1 pool (``proxy.gateway.upstream._http1``) and sends back what comes, as it comes. The
  server's and the client's share of a call, with no parse, no capture and no record.

The client sends these relays chat bodies that already ask for the token ids and logprobs the proxy adds
(``chat.lua``'s "chat-as-proxied"), so the fake does the same work and sends the same bytes for either.

    python bench/_proxy/floor.py pipe --upstream 127.0.0.1:8001 --port 9001
    python bench/_proxy/floor.py asgi --upstream 127.0.0.1:8001 --port 9002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import uvloop

_READY = b'{"object":"list","data":[]}'
_JSON = [(b"content-type", b"application/json")]


class _Half(asyncio.Protocol):
    """One side of a piped connection: what arrives is written to the other side."""

    def __init__(self, peer: _Half | None = None) -> None:
        self.peer = peer  # the other side, once it is connected
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # what arrived before the other side connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self.pending.append(data)
        else:
            self.peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def pipe(host: str, port: int, upstream_host: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()

    def client() -> _Half:
        half = _Half()

        async def connect() -> None:
            try:
                _, upstream = await loop.create_connection(lambda: _Half(half), upstream_host, upstream_port)
            except OSError:
                if half.transport is not None:
                    half.transport.close()
                return
            assert upstream.transport is not None
            for data in half.pending:
                upstream.transport.write(data)
            half.peer, half.pending = upstream, []

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return half

    server = await loop.create_server(client, host, port, backlog=1024)
    await server.serve_forever()


def asgi_app(upstream: str) -> Any:
    from proxy.gateway.upstream._http1 import Http1Pool  # this tree's, from the repository root

    pool: Http1Pool | None = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal pool
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":  # the readiness probe
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": _READY})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if pool is None:
            pool = Http1Pool(f"http://{upstream}", timeout_s=60.0)
        exchange = await pool.post(scope["path"], b"".join(chunks))
        try:
            kind = b"text/event-stream" if b'"stream":true' in chunks[0] else b"application/json"
            await send({"type": "http.response.start", "status": exchange.status, "headers": [(b"content-type", kind)]})
            while chunk := await exchange.next_chunk():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            exchange.release()

    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("relay", choices=("pipe", "asgi"))
    parser.add_argument("--upstream", required=True, help="the upstream's HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.relay == "pipe":
        up_host, _, up_port = args.upstream.rpartition(":")
        with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(pipe(args.host, args.port, up_host, int(up_port)))
        return 0
    import uvicorn

    from proxy import Settings
    from tracetrain_cli._http_server import server_config

    settings = Settings(host=args.host, port=args.port)
    uvicorn.Server(server_config(asgi_app(args.upstream), settings, log_level="warning")).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
