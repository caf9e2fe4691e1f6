"""What every dashboard page shares: rendering (Jinja2, its headers), admitting an admin, error pages, filters,
and the policy picker.

Jinja2 escapes everything it prints: captured content is attacker-controlled. The pages run no
script but the review shortcuts of a trajectory's page (``review.js``, allowed by its hash alone),
and their Content-Security-Policy allows no other, nor any style but the page's own stylesheet (by
hash), so a payload that got past escaping would still not run. Actions are POSTed forms carrying
the session's CSRF token.

Every page takes ``?policy=NAME``: the picker in the header sets it and every link keeps it (``picked``;
a page about one policy shows the one picked, else the first served: ``one_policy``).
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import Request
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response

from proxy._credentials import Admin, AdminAuth
from proxy._params import Cursor, Id, PolicyName, Version
from proxy._services import Services
from proxy.admin import _policies
from proxy.errors import AuthenticationFailed, InvalidRequest, ProxyError

_T = TypeVar("_T")

_HERE = Path(__file__).parent / "templates"
_CSS = (_HERE / "dashboard.css").read_text()
_CSS_HASH = base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()
# The only script: a trajectory page's review shortcuts, allowed by its hash where the page carries it.
REVIEW_JS = (_HERE / "review.js").read_text()
_JS_HASH = base64.b64encode(hashlib.sha256(REVIEW_JS.encode()).digest()).decode()
_CSP = (f"default-src 'none'; style-src 'sha256-{_CSS_HASH}'; img-src data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'")  # fmt: skip
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes Chromium send "Origin: null" on our own forms
    "Cache-Control": "no-store",
}
_NOTICES = {
    "activated": "Now serving {policy}@{version}.",
    "queued": "Training job {job} of {policy} queued.",
    "judged": "The judge scored this group.",
    "judge_failed": "The judge could not score this group; its reason is in the judgements below.",
    "resumed": "Training of {policy} resumed: the regression guard watches the next version it publishes.",
    "added": "Serving {name}: its first calls are served by the base model ({name}@0) until it trains.",
    "retired": "{name} is retired: no longer served or trained; its data stays readable here.",
    "scored": "Score saved: it is the reward of the trajectory you scored. Here is the next one to review.",
    "scored_last": "Score saved. Nothing else awaits a score.",
    "promoted": "Trial ended: {policy}@{version} is promoted and serves everything.",
    "rolled_back": "Trial ended: {policy}@{version} is rolled back; training goes on from the version before it.",
}


def _ago(when: float | None) -> str:
    if when is None:
        return "-"
    seconds = max(0.0, time.time() - float(when))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


templates = Jinja2Templates(directory=_HERE)
templates.env.filters["ago"] = _ago


def admin_auth(request: Request) -> AdminAuth:
    services: Services = request.app.state.services
    return services.credentials.admin


def render(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    """The page; with ``review_script`` (the review shortcuts) its CSP allows that one script, by its hash."""
    context.setdefault("admin", None)
    context.setdefault("title", "tracetrain")
    script = REVIEW_JS if context.pop("review_script", False) else None
    response = templates.TemplateResponse(request, name, {"css": _CSS, "script": script, **context},
                                          status_code=status)  # fmt: skip
    response.headers.update(_HEADERS)
    if script is not None:
        response.headers["Content-Security-Policy"] = f"{_CSP}; script-src 'sha256-{_JS_HASH}'"
    return response


def login_page(request: Request, status: int, error: str | None = None, next_url: str = "/admin") -> Response:
    response = render(request, "login.html", status, title="Log in", error=error, next=next_url)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="tracetrain admin"'
    return response


class PageResponse(Exception):
    """Ends a page early with this response (the app answers it as is): refusals and error pages."""

    def __init__(self, response: Response) -> None:
        self.response = response


async def admit(request: Request, csrf: str | None = None) -> Admin:
    """The admitted admin; a page without credentials answers 401 with the login form."""
    try:
        return await admin_auth(request).admit(request, csrf)
    except AuthenticationFailed:
        raise PageResponse(login_page(request, 401, next_url=safe_next(request.url.path))) from None
    except ProxyError as exc:
        raise PageResponse(error_page(request, exc, "Not allowed")) from None


def error_page(request: Request, exc: ProxyError, title: str) -> Response:
    page = render(request, "error.html", exc.status_code, title=title, error=exc.message)
    if exc.retry_after_s is not None:
        page.headers["Retry-After"] = str(exc.retry_after_s)
    return page


def bad_page_request(request: Request, exc: ProxyError) -> Response | None:
    """The error page for a page or form action whose URL or form failed validation; None for any other route."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not (route.path == "/admin" or route.path.startswith("/admin/ui/")):
        return None
    return error_page(request, exc, "Bad request")


async def or_error_page(request: Request, result: Awaitable[_T], title: str) -> _T:
    """The service's result; its error (an unknown id, a bad filter) as an HTML page."""
    try:
        return await result
    except ProxyError as exc:
        raise PageResponse(error_page(request, exc, title)) from None


def query_filter(request: Request, name: str, adapter: TypeAdapter[_T]) -> _T | None:
    """A filter from a page's form, typed as the JSON twin types it: empty is no filter, a bad one a 400 page."""
    raw = request.query_params.get(name) or None
    if raw is None:
        return None
    try:
        return adapter.validate_python(raw)
    except ValidationError as exc:
        error = InvalidRequest.from_validation([{**exc.errors()[0], "loc": (name,)}])
        raise PageResponse(error_page(request, error, "Bad filter")) from None


ID_PARAM: TypeAdapter[str] = TypeAdapter(Id)
POLICY_PARAM: TypeAdapter[str] = TypeAdapter(PolicyName)
VERSION_PARAM: TypeAdapter[int] = TypeAdapter(Version)
CURSOR_PARAM: TypeAdapter[str | None] = TypeAdapter(Cursor)


def safe_next(path: str) -> str:
    """Only a path of this dashboard: never an open redirect."""
    return path if path.startswith("/admin") and not path.startswith("//") else "/admin"


def _notice(request: Request, policy: str | None) -> str | None:
    template = _NOTICES.get(request.query_params.get("notice", ""))
    if template is None:
        return None
    values = {"policy": policy or "?", "version": "", "job": "", "name": ""}
    for key in ("version", "job"):
        raw = request.query_params.get(key, "")
        values[key] = raw if raw.isdigit() else "?"
    name = request.query_params.get("name", "")
    values["name"] = name if _is_policy_name(name) else "?"
    return template.format(**values)


def _is_policy_name(name: str) -> bool:
    try:
        POLICY_PARAM.validate_python(name)
    except ValidationError:
        return False
    return True


async def show(
    request: Request, services: Services, admin: Admin, name: str, section: str, policy: str | None = None,
    **context: Any,
) -> Response:  # fmt: skip
    """A page, with the policy picker: every policy (retired ones muted), the one picked (None: all)."""
    policies = [{"name": p["name"], "state": p["state"]} for p in await services.store.policies.all()]
    context.setdefault("picker_path", request.url.path)  # a page of one item picks on its list instead
    # Links keep the policy picked; with one policy there is nothing to pick.
    keep = policy is not None and len(policies) > 1
    return render(
        request, name, admin=admin, section=section, title=section, notice=_notice(request, policy), policy=policy,
        policies=policies, policy_q=f"?policy={quote(policy, safe='')}" if keep and policy else "", **context,
    )  # fmt: skip


async def picked(request: Request, services: Services) -> str | None:
    """The policy the picker chose (``?policy=``), None for every one; an unknown name is a 404 page."""
    name = query_filter(request, "policy", POLICY_PARAM)
    if name is None:
        return None
    return await or_error_page(request, _policies.chosen(services, name), "Not found")


async def one_policy(request: Request, services: Services) -> str:
    """The policy a per-policy page shows: the one picked, else the first served (a 400 page when none is)."""
    name = await picked(request, services)
    if name is not None:
        return name
    served = services.registry.names()
    if not served:
        error = InvalidRequest("No policy is served: pick a retired one to read its data, or add one on the Policies "
                               "page.")  # fmt: skip
        raise PageResponse(error_page(request, error, "No policy"))
    return served[0]
