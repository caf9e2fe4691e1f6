"""The front door: what every HTTP request passes before any route, generation paths included.

- **Browsers, with no keys** (the loopback default, where anything on the machine may call): a
  web page in the operator's browser is not such a caller. A request a browser marks as sent for
  another site (``Sec-Fetch-Site: cross-site`` or ``same-site``, an ``Origin`` that is not the
  request's own) is refused 403, on every route: a ``text/plain`` POST needs no CORS preflight, so
  without this any page could post chat calls and rewards. Only a top-level navigation (a link
  followed, ``GET``) passes: it changes nothing and the page that made it cannot read the answer.
  A ``Host`` that is neither a loopback name (``localhost``, ``*.localhost``, ``127.0.0.0/8``,
  ``[::1]``) nor the bound address is refused 403 too: DNS rebinding points a name the attacker
  owns at 127.0.0.1, and the browser then sends that name. With inference keys configured these
  checks are off: every route needs a key, which no other site's page holds.
- **Body size**: a body longer than ``--max-body-mb`` is refused 413 from its ``Content-Length``
  before it is read, and a chunked body once it grows past it; the connection is closed after.
- **Metrics and docs** (``--protect-metrics-and-docs``): ``/metrics``, ``/docs``, ``/redoc`` and
  ``/openapi.json`` need the admin token or a reward key (``proxy._credentials``).

Refusals are answered in the shape of the route's API (Anthropic's on ``/v1/messages``) and
counted on ``/metrics`` (``tracetrain_refused_requests``). The checks read a handful of headers once
per request, before Starlette's middleware (``proxy._app``), so the generation paths pay microseconds.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope

from proxy._credentials import Credentials
from proxy._settings import Settings
from proxy._throttle import LoginThrottle
from proxy.errors import BodyTooLarge, PermissionDenied, ProxyError, error_response
from proxy.gateway.dialects import MESSAGES
from proxy.observability import Metrics

_PROTECTED = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
_CLOSE = {"Connection": "close"}
_FOREIGN_SITES = frozenset({b"cross-site", b"same-site"})


class Door:
    """The checks of the module's docstring, built once per app from its settings."""

    def __init__(self, settings: Settings, metrics: Metrics, throttle: LoginThrottle | None = None) -> None:
        self._max_body = settings.max_body_bytes
        self._browsers_refused = not settings.api_keys
        self._bound = settings.host.lower().encode()
        self._protected = _PROTECTED if settings.protect_metrics_and_docs else frozenset()
        self._credentials = Credentials(settings, throttle=throttle)  # the app's throttle: one count per address
        self._metrics = metrics

    def check(self, scope: Scope, receive: Receive) -> tuple[Response | None, Receive]:
        """The answer to a request refused at the door (None: it goes on to its route), and the ``receive`` to
        read its body with: bounded when its length is not known ahead (chunked), raising 413 past the cap."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            return self._refused(scope, "body_too_large", self._too_large(), _CLOSE), receive
        if self._browsers_refused:
            problem = self._browser_problem(scope, headers)
            if problem is not None:
                return self._refused(scope, problem[0], PermissionDenied(problem[1])), receive
        if scope["path"] in self._protected:
            try:
                self._credentials.metadata_reader(Request(scope))
            except ProxyError as exc:
                return error_response(exc), receive
        if b"transfer-encoding" in headers:
            return None, _Capped(receive, self._max_body, self._too_large)
        return None, receive

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(
            f"The request body is longer than {self._max_body / 1e6:g} MB, the most this proxy reads "
            "(tracetrain serve --max-body-mb)."
        )

    def _browser_problem(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[str, str] | None:
        """Why a key-less server refuses this request as a browser's on behalf of another site, or None."""
        host = headers.get(b"host", b"")
        if host and not self._local_host(host):
            return "foreign_host", (
                f"Host {host[:100].decode('latin-1')!r} is not this server's: with no keys configured it answers "
                "only to loopback names (localhost, 127.0.0.1, [::1]). Set --api-keys to serve other names."
            )
        site = headers.get(b"sec-fetch-site")
        navigation = scope["method"] in ("GET", "HEAD") and headers.get(b"sec-fetch-mode") == b"navigate"
        if site in _FOREIGN_SITES and not navigation:
            return "cross_site", "Requests sent by a browser for another site are refused here (no keys configured)."
        origin = headers.get(b"origin")
        if origin is not None and not navigation and (origin == b"null" or origin.partition(b"://")[2] != host):
            return (
                "cross_site",
                f"Requests from {origin[:100].decode('latin-1')} are refused here (no keys configured).",
            )
        return None

    def _local_host(self, host: bytes) -> bool:
        return _is_local(host.lower(), self._bound)

    def _refused(self, scope: Scope, reason: str, exc: ProxyError, headers: dict[str, str] | None = None) -> Response:
        self._metrics.refused(reason)
        path: str = scope["path"]
        if path.endswith(("/v1/messages", "/v1/messages/count_tokens")):
            return MESSAGES.error(exc, headers)
        return error_response(exc, headers)


@functools.lru_cache(maxsize=256)
def _is_local(host: bytes, bound: bytes) -> bool:
    """``host`` (a Host header, port and all) names this machine's loopback or the address it is bound to."""
    name = host[1:].partition(b"]")[0] if host.startswith(b"[") else host.partition(b":")[0]
    if name in (b"localhost", bound) or name.endswith(b".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.decode("ascii")).is_loopback
    except (ValueError, UnicodeDecodeError):
        return False


class _Capped:
    """A ``receive`` that raises ``BodyTooLarge`` once the body it has handed out passes ``limit`` bytes."""

    def __init__(self, receive: Receive, limit: int, error: Callable[[], ProxyError]) -> None:
        self._receive = receive
        self._left = limit
        self._error = error

    async def __call__(self) -> Message:
        message: Message = await self._receive()
        if message["type"] == "http.request":
            self._left -= len(message.get("body", b""))
            if self._left < 0:
                raise self._error()
        return message
