"""Reaching vLLM: one server's client, and the router over several.

- ``Upstream`` (``_client``): one vLLM server; generation calls over ``_http1``'s kept HTTP/1.1
  connections (parsed by llhttp), the control endpoints (adapters, pause, sleep, tokenize) over httpx;
- ``Router`` (``_router``): every server behind the proxy, each call to the one ``_placement`` picks
  for its trajectory (rendezvous hashing with a load bound), health checks and failover;
- ``SSEDecoder`` (``_sse``): server-sent events parsed from the byte chunks a stream arrives in;
- ``upstream_http_error`` (``_errors``): vLLM's error status as the proxy's error.
"""

from proxy.gateway.upstream._client import Reply, Upstream, UpstreamStream
from proxy.gateway.upstream._errors import upstream_http_error
from proxy.gateway.upstream._router import UPSTREAM_STATES, Router, Server
from proxy.gateway.upstream._sse import ServerSentEvent, SSEDecoder

__all__ = [
    "UPSTREAM_STATES",
    "Reply",
    "Router",
    "SSEDecoder",
    "Server",
    "ServerSentEvent",
    "Upstream",
    "UpstreamStream",
    "upstream_http_error",
]
