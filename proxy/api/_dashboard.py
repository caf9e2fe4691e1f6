"""The admin dashboard: server-rendered HTML at ``/admin`` and ``/admin/ui/...``.

Each page renders one result of ``proxy.admin`` (the admin JSON API, ``proxy.api._admin``, returns the same).
Jinja2 escapes everything it prints: captured content is attacker-controlled. The
pages run no JavaScript, and their Content-Security-Policy allows none, nor any style
but the page's own stylesheet (by hash), so a payload that got past escaping would
still not run. Actions are POSTed forms carrying the session's CSRF token (``proxy.api._dashboard_actions``).

Every page takes ``?policy=NAME``: the picker in the header sets it and every link keeps it. Overview,
trajectories and groups show every policy unless one is picked; training and adapters are one policy's
(the one picked, else the first served).
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response

from proxy._credentials import Admin, AdminAuth
from proxy._params import Cursor, Id, PolicyName, Version
from proxy._services import Services
from proxy.admin import _policies
from proxy.admin import _service as _admin
from proxy.admin._svg import line_chart
from proxy.api._deps import ServicesDep
from proxy.errors import AuthenticationFailed, InvalidRequest, ProxyError
from tracetrain_core import call_reply

router = APIRouter(prefix="/admin", include_in_schema=False)
forms = APIRouter(prefix="/admin", include_in_schema=False)  # the forms' actions: proxy.api._dashboard_actions
_T = TypeVar("_T")

_HERE = Path(__file__).parent / "templates"
_CSS = (_HERE / "dashboard.css").read_text()
_CSS_HASH = base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()
_HEADERS = {
    "Content-Security-Policy": (
        f"default-src 'none'; style-src 'sha256-{_CSS_HASH}'; img-src data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes Chromium send "Origin: null" on our own forms
    "Cache-Control": "no-store",
}
_SINCE = {"15m": 900, "1h": 3600, "24h": 86400, "7d": 7 * 86400, "": None}
_SINCE_CHOICES = [("", "any time"), ("15m", "15 min"), ("1h", "1 hour"), ("24h", "24 hours"), ("7d", "7 days")]
_NOTICES = {
    "activated": "Now serving {policy}@{version}.",
    "queued": "Training job {job} of {policy} queued.",
    "judged": "The judge scored this group.",
    "judge_failed": "The judge could not score this group; its reason is in the judgements below.",
    "resumed": "Training of {policy} resumed: the regression guard watches the next version it publishes.",
    "added": "Serving {name}: its first calls are served by the base model ({name}@0) until it trains.",
    "retired": "{name} is retired: no longer served or trained; its data stays readable here.",
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


def _auth(request: Request) -> AdminAuth:
    services: Services = request.app.state.services
    return services.credentials.admin


def _render(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    context.setdefault("admin", None)
    context.setdefault("title", "tracetrain")
    response = templates.TemplateResponse(request, name, {"css": _CSS, **context}, status_code=status)
    response.headers.update(_HEADERS)
    return response


def _login_page(request: Request, status: int, error: str | None = None, next_url: str = "/admin") -> Response:
    response = _render(request, "login.html", status, title="Log in", error=error, next=next_url)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="tracetrain admin"'
    return response


class PageResponse(Exception):
    """Ends a page early with this response (the app answers it as is): refusals and error pages."""

    def __init__(self, response: Response) -> None:
        self.response = response


async def _admit(request: Request, csrf: str | None = None) -> Admin:
    """The admitted admin; a page without credentials answers 401 with the login form."""
    try:
        return await _auth(request).admit(request, csrf)
    except AuthenticationFailed:
        raise PageResponse(_login_page(request, 401, next_url=_safe_next(request.url.path))) from None
    except ProxyError as exc:
        raise PageResponse(_error_page(request, exc, "Not allowed")) from None


def _error_page(request: Request, exc: ProxyError, title: str) -> Response:
    page = _render(request, "error.html", exc.status_code, title=title, error=exc.message)
    if exc.retry_after_s is not None:
        page.headers["Retry-After"] = str(exc.retry_after_s)
    return page


def bad_page_request(request: Request, exc: ProxyError) -> Response | None:
    """The error page for a page or form action whose URL or form failed validation; None for any other route."""
    route = request.scope.get("route")
    pages = [page.endpoint for routes in (router.routes, forms.routes) for page in routes if isinstance(page, APIRoute)]
    if not isinstance(route, APIRoute) or route.endpoint not in pages:
        return None
    return _error_page(request, exc, "Bad request")


async def _or_error_page(request: Request, result: Awaitable[_T], title: str) -> _T:
    """The service's result; its error (an unknown id, a bad filter) as an HTML page."""
    try:
        return await result
    except ProxyError as exc:
        raise PageResponse(_error_page(request, exc, title)) from None


def _filter(request: Request, name: str, adapter: TypeAdapter[_T]) -> _T | None:
    """A filter from a page's form, typed as the JSON twin types it: empty is no filter, a bad one a 400 page."""
    raw = request.query_params.get(name) or None
    if raw is None:
        return None
    try:
        return adapter.validate_python(raw)
    except ValidationError as exc:
        error = InvalidRequest.from_validation([{**exc.errors()[0], "loc": (name,)}])
        raise PageResponse(_error_page(request, error, "Bad filter")) from None


_ID: TypeAdapter[str] = TypeAdapter(Id)
_POLICY: TypeAdapter[str] = TypeAdapter(PolicyName)
_VERSION: TypeAdapter[int] = TypeAdapter(Version)
_CURSOR: TypeAdapter[str | None] = TypeAdapter(Cursor)


def _safe_next(path: str) -> str:
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
        _POLICY.validate_python(name)
    except ValidationError:
        return False
    return True


async def _page(
    request: Request, services: Services, admin: Admin, name: str, section: str, policy: str | None = None,
    **context: Any,
) -> Response:  # fmt: skip
    """A page, with the policy picker: every policy (retired ones muted), the one picked (None: all)."""
    policies = [{"name": p["name"], "state": p["state"]} for p in await services.store.policies.all()]
    context.setdefault("picker_path", request.url.path)  # a page of one item picks on its list instead
    # Links keep the policy picked; with one policy there is nothing to pick.
    keep = policy is not None and len(policies) > 1
    return _render(
        request, name, admin=admin, section=section, title=section, notice=_notice(request, policy), policy=policy,
        policies=policies, policy_q=f"?policy={quote(policy, safe='')}" if keep and policy else "", **context,
    )  # fmt: skip


async def picked(request: Request, services: Services) -> str | None:
    """The policy the picker chose (``?policy=``), None for every one; an unknown name is a 404 page."""
    name = _filter(request, "policy", _POLICY)
    if name is None:
        return None
    return await _or_error_page(request, _policies.chosen(services, name), "Not found")


async def one_policy(request: Request, services: Services) -> str:
    """The policy a per-policy page shows: the one picked, else the first served (a 400 page when none is)."""
    name = await picked(request, services)
    if name is not None:
        return name
    served = services.registry.names()
    if not served:
        raise PageResponse(
            _error_page(
                request,
                InvalidRequest(
                    "No policy is served: pick a retired one to read its data, or add one on the Policies page."
                ),
                "No policy",
            )
        )
    return served[0]


# -- pages -----------------------------------------------------------------------------------


@router.get("")
async def overview(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    policy = await picked(request, services)
    latest = await _admin.list_trajectories(
        services, policy=policy, group_id=None, rewarded=None, limit=8, after=None
    )  # fmt: skip
    charts = []
    for name in [policy] if policy else services.registry.names():
        jobs = (await _admin.list_jobs(services, 500, name))["data"]
        charts.append((name, line_chart(_admin.curves(jobs)["reward_mean"], title=f"Reward mean of {name}",
                                        x_label="version")))  # fmt: skip
    return await _page(
        request, services, admin, "overview.html", "Overview", policy, o=await _admin.overview(services, policy),
        refresh=15, reward_charts=charts, latest=latest["data"],
    )  # fmt: skip


@router.get("/ui/policies")
async def policies(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    listing = await _policies.list_policies(services)
    return await _page(request, services, admin, "policies.html", "Policies", await picked(request, services),
                       rows=listing["data"])  # fmt: skip


@router.get("/ui/trajectories")
async def trajectories(request: Request, services: ServicesDep) -> Response:
    q = request.query_params
    admin = await _admit(request)
    policy = await picked(request, services)
    rewarded = {"true": True, "false": False}.get(q.get("rewarded", ""))
    since = q.get("since", "") if q.get("since", "") in _SINCE else ""
    seconds = _SINCE[since]
    filters: dict[str, Any] = {
        "policy": policy,
        "group_id": _filter(request, "group_id", _ID),
        "rewarded": rewarded,
        "version": _filter(request, "version", _VERSION),
        "created_after": time.time() - seconds if seconds else None,
        "created_before": None,
    }
    listing = _admin.list_trajectories(services, **filters, limit=50, after=_filter(request, "after", _CURSOR))
    page = await _or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {**q, "after": page["next_cursor"]}.items() if v}
    return await _page(
        request, services, admin, "trajectories.html", "Trajectories", policy, page=page,
        f={**filters, "since": since, "rewarded_raw": q.get("rewarded", "")}, since_choices=_SINCE_CHOICES,
        next_url="/admin/ui/trajectories?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/trajectories/{trajectory_id}")
async def trajectory(trajectory_id: Id, request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    detail = await _or_error_page(request, _admin.trajectory_detail(services, trajectory_id), "Not found")
    for call in detail["calls"]:
        call["tokens"] = _token_rows(call)
        call["reply"] = call_reply(call["endpoint"], call.get("response"))
    return await _page(request, services, admin, "trajectory.html", "Trajectories", detail["policy"], t=detail,
                       picker_path="/admin/ui/trajectories")  # fmt: skip


def _token_rows(call: dict[str, Any]) -> list[dict[str, Any]]:
    """Each completion token with its text, its logprob and a shade from 0 (unlikely) to 9."""
    rows = []
    texts = call["completion_token_texts"]
    for token_id, logprob, text in zip(call["completion_token_ids"], call["logprobs"], texts, strict=False):
        p = math.exp(logprob) if logprob is not None and math.isfinite(logprob) else 1.0
        rows.append(
            {
                "id": token_id,
                "text": text if text is not None else f"⟨{token_id}⟩",
                "logprob_text": f"{logprob:.3f} (p {p:.2f})" if logprob is not None else "n/a",
                "shade": min(9, int(p * 10)),
            }
        )
    return rows


@router.get("/ui/groups")
async def groups(request: Request, services: ServicesDep) -> Response:
    state = request.query_params.get("state") or None
    admin = await _admit(request)
    policy = await picked(request, services)
    after = _filter(request, "after", _CURSOR)
    listing = _admin.list_groups(services, policy=policy, state=state, limit=50, after=after)
    page = await _or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {"policy": policy, "state": state, "after": page["next_cursor"]}.items() if v}
    return await _page(
        request, services, admin, "groups.html", "Groups", policy, page=page, state=state or "",
        next_url="/admin/ui/groups?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/groups/{group_id}")
async def group(group_id: Id, request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    detail = await _or_error_page(request, _admin.group_detail(services, group_id), "Not found")
    return await _page(request, services, admin, "group.html", "Groups", detail["policy"], g=detail,
                       picker_path="/admin/ui/groups")  # fmt: skip


@router.get("/ui/training")
async def training(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    policy = await one_policy(request, services)
    jobs = (await _admin.list_jobs(services, 500, policy))["data"]
    curves = _admin.curves(jobs)
    running = next((j for j in jobs if j["state"] == "running"), None)
    return await _page(
        request, services, admin, "training.html", "Training", policy, jobs=jobs, running=running,
        training=await _admin.training_state(services, policy),
        refresh=10 if running else None,
        reward_chart=line_chart(curves["reward_mean"], title="Reward mean", x_label="version"),
        loss_chart=line_chart(curves["loss"], title="Loss", x_label="version"),
        mismatch_chart=line_chart(curves["logprob_mismatch_mean"], title="Log-prob mismatch", x_label="version"),
    )  # fmt: skip


@router.get("/ui/adapters")
async def adapters(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    return await adapters_page(request, services, admin, await one_policy(request, services))


async def adapters_page(
    request: Request, services: Services, admin: Admin, policy: str, error: str | None = None, status: int = 200
) -> Response:
    """``policy``'s versions (the action forms' error page too, with ``error``)."""
    listing = await _admin.list_adapters(services, policy)
    base = {"version": 0, "state": "base model", "path": services.registry.base_model or "", "job_id": None,
            "error": None, "metrics": {}, "created_at": None}  # fmt: skip
    response = await _page(request, services, admin, "adapters.html", "Adapters", policy, a=listing,
                           versions=[base, *listing["data"]], error=error)  # fmt: skip
    response.status_code = status
    return response
