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

Logging out ends the session on the server too: its nonce is written to the store
(``store.Sessions``), which every replica asks before it accepts a session, and ``revoke_all``
ends every session issued so far. A wrong credential wherever the admin token is accepted (the admin
API, the login form, the adapter files, a protected ``/metrics``) costs its sender one of a few
attempts (``proxy._throttle``); past them a wrong one is answered 429 with ``Retry-After``, and the
right token is still admitted (one address may be every client behind a reverse proxy).
Credentials that are not ASCII (a cookie or header a browser or script mangled) are compared as
bytes: they fail like any wrong credential, never as a server error.

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
from proxy._throttle import LoginThrottle
from proxy.errors import AuthenticationFailed, PermissionDenied, TooManyRequests
from store import Sessions

COOKIE = "tracetrain_admin"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SESSION_S = 12 * 3600
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_ANY = "surrogateescape"  # how a text of any code points is made bytes to compare


@dataclass(frozen=True, slots=True)
class Admin:
    """An admitted admin request: how it got in, and the CSRF token its pages embed."""

    via: str  # "token" | "session" | "open"
    csrf: str
    cookie: str | None = None  # the session's cookie ("session"): what logging out revokes


def presented_token(request: Request) -> str | None:
    """The bearer token of ``Authorization``, if any."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class Credentials:
    """The keys and the admin token of one app; raises ``AuthenticationFailed`` (401) or ``PermissionDenied`` (403)."""

    def __init__(
        self, settings: Settings, sessions: Sessions | None = None, *, throttle: LoginThrottle | None = None
    ) -> None:
        self._inference = settings.api_keys
        self._reward = settings.reward_keys
        self._adapter = settings.adapter_keys
        self.admin = AdminAuth(
            settings.admin_token, loopback=is_loopback(settings.host), sessions=sessions, throttle=throttle
        )

    def inference(self, request: Request) -> None:
        _check_key(request, self._inference, "inference key")

    def reward(self, request: Request) -> None:
        """Reward keys when configured; otherwise the inference rule."""
        if self._reward:
            _check_key(request, self._reward, "reward key")
        else:
            _check_key(request, self._inference, "key")

    async def adapter_reader(self, request: Request) -> None:
        """An adapter key or the admin token; without adapter keys, the admin rule alone."""
        if not self._adapter:
            await self.admin.admit(request)
            return
        presented = presented_token(request)
        if presented is not None and self.admin.token_matches(presented):
            return
        try:
            _check_key(request, self._adapter, "adapter key")
        except AuthenticationFailed:
            if presented is not None or request.headers.get("x-api-key") is not None:
                self.admin.failed(request)  # a guess at the admin token too: throttled as one (429 past the burst)
            raise

    def metadata_reader(self, request: Request) -> None:
        """``--protect-metrics-and-docs``: the admin token, or a reward key, as a bearer token."""
        presented = presented_token(request)
        if presented is not None and self.admin.token_matches(presented):
            return
        if presented is not None and any(_same(presented, key.get_secret_value()) for key in self._reward):
            return
        if presented is not None:
            self.admin.failed(request)  # a guess at the admin token: throttled as one (429 past the burst)
        raise AuthenticationFailed(
            "This server's metrics and API docs need 'Authorization: Bearer <admin token or reward key>'."
        )


def _check_key(request: Request, keys: tuple[SecretStr, ...], what: str) -> None:
    if not keys:
        return
    # Anthropic's clients (its SDK, Claude Code) send their key as x-api-key.
    presented = presented_token(request) or request.headers.get("x-api-key")
    if presented is None:
        raise AuthenticationFailed(f"Missing {what}: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
    matched = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        matched |= _same(presented, key.get_secret_value())
    if not matched:
        raise AuthenticationFailed(f"Invalid {what}.")


def _same(presented: str, expected: str) -> bool:
    """Constant-time equality of two texts, compared as UTF-8 bytes: any text is comparable (non-ASCII too)."""
    return hmac.compare_digest(presented.encode("utf-8", _ANY), expected.encode("utf-8", _ANY))


class AdminAuth:
    """Checks admin credentials; one per app (its key outlives no token change)."""

    def __init__(
        self,
        admin_token: SecretStr | None,
        *,
        loopback: bool,
        sessions: Sessions | None = None,
        throttle: LoginThrottle | None = None,
    ) -> None:
        self._token = admin_token.get_secret_value() if admin_token else None
        self._loopback = loopback
        self._sessions = sessions  # the store's revoked sessions (None: no store, as the front door's checks)
        # One per app, shared with the front door (its protected /metrics): a guess counts wherever it is made.
        self.throttle = throttle if throttle is not None else LoginThrottle()
        # Open mode signs CSRF tokens with a key that lives as long as the process.
        base = self._token.encode() if self._token else secrets.token_bytes(32)
        self._key = hmac.new(base, b"tracetrain admin session v1", hashlib.sha256).digest()

    @property
    def open(self) -> bool:
        """No admin token configured: the app only listens on loopback, and admits everyone."""
        return self._token is None

    def token_matches(self, presented: str) -> bool:
        return self._token is not None and _same(presented, self._token)

    def log_in(self, request: Request, presented: str) -> bool:
        """Whether ``presented`` is the admin token (the right one is always admitted); a wrong one is
        ``TooManyRequests`` once this address sent too many (``failed``)."""
        if self.token_matches(presented):
            return True
        self.failed(request)
        return False

    def failed(self, request: Request) -> None:
        """The request's address sent a wrong credential: one attempt fewer, or ``TooManyRequests`` when it has
        none left (the attempt is not counted then: waiting out ``Retry-After`` is enough)."""
        address = request.client.host if request.client else ""
        wait_s = self.throttle.wait_s(address)
        if wait_s:
            raise TooManyRequests(
                f"Too many wrong admin tokens from this address: try again in {wait_s} s.", retry_after_s=wait_s
            )
        self.throttle.failed(address)

    def new_session(self, now: float | None = None) -> str:
        """A cookie value for a successful login: ``expires_ms.nonce.signature``."""
        payload = f"{int(((now or time.time()) + SESSION_S) * 1000)}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._sign(payload)}"

    def session_nonce(self, cookie: str | None, now: float | None = None) -> str | None:
        """The nonce of a validly signed, unexpired session cookie; None otherwise."""
        parsed = self._session(cookie, now)
        return parsed[0] if parsed is not None else None

    def _session(self, cookie: str | None, now: float | None = None) -> tuple[str, float] | None:
        """(nonce, expires at) of a validly signed, unexpired session cookie; None otherwise."""
        if not cookie or cookie.count(".") != 2:
            return None
        expires, nonce, signature = cookie.split(".")
        if not _same(signature, self._sign(f"{expires}.{nonce}")):
            return None
        if not (expires.isascii() and expires.isdigit()) or int(expires) / 1000 < (now or time.time()):
            return None
        return nonce, int(expires) / 1000

    def csrf_token(self, nonce: str) -> str:
        return self._sign(f"csrf.{nonce}")

    async def admit(self, request: Request, form_csrf: str | None = None) -> Admin:
        """Admit the request or raise 401/403 (429 while its address is throttled) in OpenAI's error shape."""
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
        if presented is not None:
            if self.log_in(request, presented):
                return Admin("token", "")
            raise AuthenticationFailed("Invalid admin token.")
        cookie = request.cookies.get(COOKIE)
        session = self._session(cookie)
        if session is None or await self._revoked(*session):
            raise AuthenticationFailed(
                "Missing admin credentials: send 'Authorization: Bearer <admin token>', or log in at /admin/ui/login."
            )
        admin = Admin("session", self.csrf_token(session[0]), cookie)
        if unsafe:
            sent = form_csrf if form_csrf is not None else request.headers.get(CSRF_HEADER)
            if not sent or not _same(sent, admin.csrf):
                raise PermissionDenied("Missing or invalid CSRF token: reload the page and try again.")
        return admin

    async def revoke(self, admin: Admin) -> None:
        """End ``admin``'s session on the server (a logout): its cookie is refused everywhere from now on."""
        session = self._session(admin.cookie)
        if session is not None and self._sessions is not None:
            await self._sessions.revoke(*session)

    async def revoke_all(self) -> None:
        """End every session issued so far, on every replica (each log in again)."""
        if self._sessions is not None:
            await self._sessions.revoke_all(SESSION_S)

    async def _revoked(self, nonce: str, expires_at: float) -> bool:
        return self._sessions is not None and await self._sessions.revoked(nonce, expires_at - SESSION_S)

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode("utf-8", _ANY), hashlib.sha256).hexdigest()


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
