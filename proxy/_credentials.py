"""Every credential the proxy checks, in one place: API keys, the admin token, dashboard sessions.

``Credentials`` is built once from the settings (``proxy._services``); each route's dependency
(``proxy.api._deps``) asks it one question. Keys are compared in constant time against every
configured key, and never logged.

- Inference keys (``--api-key``) admit the generation calls; Anthropic's clients send theirs
  as ``x-api-key``, everyone else as ``Authorization: Bearer``.
- Reward keys (``--reward-key``) admit ``POST /v1/rewards`` and the data reads; without them,
  the inference rule (so a loopback default just works).
- Adapter keys (``--adapter-key``) read adapter files and nothing else: the key every vLLM
  server holds cannot roll back, train or read trajectories if it leaks. The admin token
  reads them too; without adapter keys, the admin rule alone.

The dashboard and the admin API (``AdminAuth``) have two ways in, both checked in constant time:

- ``Authorization: Bearer <admin token>``: scripts and the admin JSON API. Browsers never
  attach it on their own, so such requests cannot be forged cross-site.
- A session cookie set by the login form. Its value is ``expires.nonce.signature``, an
  HMAC of the first two under a key derived from the admin token: the token itself never
  leaves the server, every replica sharing the token accepts it, and changing the token
  ends every session. The cookie is ``HttpOnly``, ``SameSite=Strict``, scoped to
  ``/admin`` and ``Secure`` over https.

A state-changing request that rides on the cookie must also carry the session's CSRF
token (a hidden form field, or the ``X-CSRF-Token`` header), and every state-changing
admin request is refused when the browser says it comes from another site (``Origin``
or ``Sec-Fetch-Site``). SameSite alone would already stop the forgery in current
browsers; the token keeps it stopped behind a proxy that rewrites cookies.

Without an admin token (a loopback bind only; ``tracetrain serve`` always makes one),
everything is open to local processes, and the cross-site checks still apply: a web
page in the operator's browser must not be able to roll back an adapter.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import SecretStr
from starlette.requests import Request

from proxy._settings import Settings, is_loopback
from proxy.errors import AuthenticationFailed, PermissionDenied

COOKIE = "tracetrain_admin"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SESSION_S = 12 * 3600
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Admin:
    """An admitted admin request: how it got in, and the CSRF token its pages embed."""

    via: str  # "token" | "session" | "open"
    csrf: str


def presented_token(request: Request) -> str | None:
    """The bearer token of ``Authorization``, if any."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class Credentials:
    """The keys and the admin token of one app; raises ``AuthenticationFailed`` (401) or ``PermissionDenied`` (403)."""

    def __init__(self, settings: Settings) -> None:
        self._inference = settings.api_keys
        self._reward = settings.reward_keys
        self._adapter = settings.adapter_keys
        self.admin = AdminAuth(settings.admin_token, loopback=is_loopback(settings.host))

    def inference(self, request: Request) -> None:
        _check_key(request, self._inference, "inference key")

    def reward(self, request: Request) -> None:
        """Reward keys when configured; otherwise the inference rule."""
        if self._reward:
            _check_key(request, self._reward, "reward key")
        else:
            _check_key(request, self._inference, "key")

    def adapter_reader(self, request: Request) -> None:
        """An adapter key or the admin token; without adapter keys, the admin rule alone."""
        if not self._adapter:
            self.admin.admit(request)
            return
        presented = presented_token(request)
        if presented is not None and self.admin.token_matches(presented):
            return
        _check_key(request, self._adapter, "adapter key")


def _check_key(request: Request, keys: tuple[SecretStr, ...], what: str) -> None:
    if not keys:
        return
    # Anthropic's clients (its SDK, Claude Code) send their key as x-api-key.
    presented = presented_token(request) or request.headers.get("x-api-key")
    if presented is None:
        raise AuthenticationFailed(f"Missing {what}: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
    matched = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        matched |= hmac.compare_digest(presented.encode(), key.get_secret_value().encode())
    if not matched:
        raise AuthenticationFailed(f"Invalid {what}.")


class AdminAuth:
    """Checks admin credentials; one per app (its key outlives no token change)."""

    def __init__(self, admin_token: SecretStr | None, *, loopback: bool) -> None:
        self._token = admin_token.get_secret_value().encode() if admin_token else None
        self._loopback = loopback
        # Open mode signs CSRF tokens with a key that lives as long as the process.
        base = self._token or secrets.token_bytes(32)
        self._key = hmac.new(base, b"tracetrain admin session v1", hashlib.sha256).digest()

    @property
    def open(self) -> bool:
        """No admin token configured: the app only listens on loopback, and admits everyone."""
        return self._token is None

    def token_matches(self, presented: str) -> bool:
        return self._token is not None and hmac.compare_digest(presented.encode(), self._token)

    def new_session(self, now: float | None = None) -> str:
        """A cookie value for a successful login."""
        payload = f"{int((now or time.time()) + SESSION_S)}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._sign(payload)}"

    def session_nonce(self, cookie: str | None, now: float | None = None) -> str | None:
        """The nonce of a valid, unexpired session cookie; None otherwise."""
        if not cookie or cookie.count(".") != 2:
            return None
        expires, nonce, signature = cookie.split(".")
        if not hmac.compare_digest(signature, self._sign(f"{expires}.{nonce}")):
            return None
        if not expires.isdigit() or int(expires) < (now or time.time()):
            return None
        return nonce

    def csrf_token(self, nonce: str) -> str:
        return self._sign(f"csrf.{nonce}")

    def admit(self, request: Request, form_csrf: str | None = None) -> Admin:
        """Admit the request or raise 401/403 in OpenAI's error shape."""
        unsafe = request.method not in _SAFE_METHODS
        if unsafe:
            _refuse_cross_site(request)
        if self.open:
            if not self._loopback:
                raise PermissionDenied(
                    "The dashboard and admin API need TRACETRAIN_ADMIN_TOKEN when the proxy listens beyond loopback."
                )
            return Admin("open", self.csrf_token("open"))
        presented = presented_token(request)
        if presented is not None and self.token_matches(presented):
            return Admin("token", "")
        nonce = self.session_nonce(request.cookies.get(COOKIE))
        if nonce is None:
            if presented is not None:
                raise AuthenticationFailed("Invalid admin token.")
            raise AuthenticationFailed(
                "Missing admin credentials: send 'Authorization: Bearer <admin token>', or log in at /admin/ui/login."
            )
        admin = Admin("session", self.csrf_token(nonce))
        if unsafe:
            sent = form_csrf if form_csrf is not None else request.headers.get(CSRF_HEADER)
            if not sent or not hmac.compare_digest(sent, admin.csrf):
                raise PermissionDenied("Missing or invalid CSRF token: reload the page and try again.")
        return admin

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()


def _refuse_cross_site(request: Request) -> None:
    """A state-changing request a browser sent on behalf of another site is refused."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise PermissionDenied("Cross-site requests may not change anything here.")
    origin = request.headers.get("origin")
    if origin is None:
        return  # not a browser's cross-origin request (curl, SDKs, same-origin GET-less forms of old browsers)
    host = request.headers.get("host", "")
    if origin == "null" or urlsplit(origin).netloc != host:
        raise PermissionDenied(f"Requests from {origin} may not change anything here.")


def cookie_is_secure(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
