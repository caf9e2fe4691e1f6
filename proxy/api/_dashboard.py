"""The admin dashboard: server-rendered HTML at ``/admin`` and ``/admin/ui/...``.

Each page renders one result of ``proxy.admin`` (the admin JSON API, ``proxy.api._admin``, returns the same).
Jinja2 escapes everything it prints: captured content is attacker-controlled. The
pages run no JavaScript, and their Content-Security-Policy allows none, nor any style
but the page's own stylesheet (by hash), so a payload that got past escaping would
still not run. Actions are POSTed forms carrying the session's CSRF token.
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Request
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from pydantic import TypeAdapter, ValidationError
from starlette.responses import RedirectResponse, Response

from proxy._credentials import COOKIE, SESSION_S, Admin, AdminAuth, cookie_is_secure
from proxy._params import Cursor, Id, Version
from proxy._services import Services
from proxy.admin import _service as _admin
from proxy.admin._svg import line_chart
from proxy.api._deps import ServicesDep
from proxy.errors import AuthenticationFailed, InvalidRequest, ProxyError, TooManyRequests
from tracetrain_core import call_reply

router = APIRouter(prefix="/admin", include_in_schema=False)
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
    "queued": "Training job {job} queued.",
    "judged": "The judge scored this group.",
    "judge_failed": "The judge could not score this group; its reason is in the judgements below.",
    "resumed": "Training resumed: the regression guard watches the next version it publishes.",
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
    pages = [page.endpoint for page in router.routes if isinstance(page, APIRoute)]
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
_VERSION: TypeAdapter[int] = TypeAdapter(Version)
_CURSOR: TypeAdapter[str | None] = TypeAdapter(Cursor)


def _safe_next(path: str) -> str:
    """Only a path of this dashboard: never an open redirect."""
    return path if path.startswith("/admin") and not path.startswith("//") else "/admin"


def _notice(request: Request, services: Services) -> str | None:
    template = _NOTICES.get(request.query_params.get("notice", ""))
    if template is None:
        return None
    values = {"policy": services.registry.policy, "version": "", "job": ""}
    for key in ("version", "job"):
        raw = request.query_params.get(key, "")
        values[key] = raw if raw.isdigit() else "?"
    return template.format(**values)


def _page(request: Request, services: Services, admin: Admin, name: str, section: str, **context: Any) -> Response:
    return _render(
        request, name, admin=admin, section=section, title=section, notice=_notice(request, services), **context
    )


# -- log in and out ------------------------------------------------------------------------


@router.get("/ui/login")
async def login_form(request: Request, next: str = "/admin") -> Response:
    if _auth(request).open:
        return RedirectResponse("/admin", status_code=303)
    return _login_page(request, 200, next_url=_safe_next(next))


@router.post("/ui/login")
async def login(
    request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/admin"
) -> Response:
    auth = _auth(request)
    if auth.open:
        return RedirectResponse("/admin", status_code=303)
    try:
        right = auth.log_in(request, token)
    except TooManyRequests as exc:
        page = _login_page(request, 429, error=exc.message, next_url=_safe_next(next))
        page.headers["Retry-After"] = str(exc.retry_after_s)
        return page
    if not right:
        return _login_page(request, 401, error="That is not the admin token.", next_url=_safe_next(next))
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(
        COOKIE, auth.new_session(), max_age=SESSION_S, path="/admin", httponly=True, samesite="strict",
        secure=cookie_is_secure(request),
    )  # fmt: skip
    return response


@router.post("/ui/logout")
async def logout(request: Request, csrf_token: Annotated[str, Form()] = "") -> Response:
    admin = await _admit(request, csrf_token)
    await _auth(request).revoke(admin)  # ended on the server too: a copy of the cookie is refused from now on
    response = RedirectResponse("/admin/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="strict")
    return response


# -- pages -----------------------------------------------------------------------------------


@router.get("")
async def overview(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    jobs = (await _admin.list_jobs(services, 500))["data"]
    latest = await _admin.list_trajectories(
        services, policy=None, group_id=None, rewarded=None, limit=8, after=None
    )  # fmt: skip
    return _page(
        request, services, admin, "overview.html", "Overview", o=await _admin.overview(services), refresh=15,
        reward_chart=line_chart(_admin.curves(jobs)["reward_mean"], title="Reward mean", x_label="version"),
        latest=latest["data"],
    )  # fmt: skip


@router.get("/ui/trajectories")
async def trajectories(request: Request, services: ServicesDep) -> Response:
    q = request.query_params
    admin = await _admit(request)
    rewarded = {"true": True, "false": False}.get(q.get("rewarded", ""))
    since = q.get("since", "") if q.get("since", "") in _SINCE else ""
    seconds = _SINCE[since]
    filters: dict[str, Any] = {
        "policy": _filter(request, "policy", _ID),
        "group_id": _filter(request, "group_id", _ID),
        "rewarded": rewarded,
        "version": _filter(request, "version", _VERSION),
        "created_after": time.time() - seconds if seconds else None,
        "created_before": None,
    }
    listing = _admin.list_trajectories(services, **filters, limit=50, after=_filter(request, "after", _CURSOR))
    page = await _or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {**q, "after": page["next_cursor"]}.items() if v}
    return _page(
        request, services, admin, "trajectories.html", "Trajectories", page=page,
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
    return _page(request, services, admin, "trajectory.html", "Trajectories", t=detail)


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
    after = _filter(request, "after", _CURSOR)
    listing = _admin.list_groups(services, policy=None, state=state, limit=50, after=after)
    page = await _or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {"state": state, "after": page["next_cursor"]}.items() if v}
    return _page(
        request, services, admin, "groups.html", "Groups", page=page, state=state or "",
        next_url="/admin/ui/groups?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/groups/{group_id}")
async def group(group_id: Id, request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    detail = await _or_error_page(request, _admin.group_detail(services, group_id), "Not found")
    return _page(request, services, admin, "group.html", "Groups", g=detail)


@router.post("/ui/groups/{group_id}/judge")
async def judge_group(
    group_id: Id, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    await _admit(request, csrf_token)
    judgement = await _or_error_page(request, services.judging.judge_group(group_id), "Not judged")
    notice = "judged" if judgement["state"] == "ok" else "judge_failed"
    return RedirectResponse(f"/admin/ui/groups/{quote(group_id, safe='')}?notice={notice}", status_code=303)


@router.get("/ui/training")
async def training(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    jobs = (await _admin.list_jobs(services, 500))["data"]
    curves = _admin.curves(jobs)
    running = next((j for j in jobs if j["state"] == "running"), None)
    return _page(
        request, services, admin, "training.html", "Training", jobs=jobs, running=running,
        training=await _admin.training_state(services),
        refresh=10 if running else None,
        reward_chart=line_chart(curves["reward_mean"], title="Reward mean", x_label="version"),
        loss_chart=line_chart(curves["loss"], title="Loss", x_label="version"),
        mismatch_chart=line_chart(curves["logprob_mismatch_mean"], title="Log-prob mismatch", x_label="version"),
    )  # fmt: skip


@router.get("/ui/adapters")
async def adapters(request: Request, services: ServicesDep) -> Response:
    admin = await _admit(request)
    return await _adapters_page(request, services, admin)


async def _adapters_page(
    request: Request, services: Services, admin: Admin, error: str | None = None, status: int = 200
) -> Response:
    listing = await _admin.list_adapters(services)
    base = {"version": 0, "state": "base model", "path": services.registry.base_model or "", "job_id": None,
            "error": None, "metrics": {}, "created_at": None}  # fmt: skip
    response = _page(
        request, services, admin, "adapters.html", "Adapters", a=listing, versions=[base, *listing["data"]], error=error
    )
    response.status_code = status
    return response


# -- actions ---------------------------------------------------------------------------------


@router.post("/ui/adapters/{version}/activate")
async def activate(
    version: Version, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    admin = await _admit(request, csrf_token)
    try:
        active = await services.publisher.activate(version)
    except ProxyError as exc:
        return await _adapters_page(request, services, admin, error=exc.message, status=exc.status_code)
    return RedirectResponse(f"/admin/ui/adapters?notice=activated&version={active}", status_code=303)


@router.post("/ui/training/resume")
async def resume_training(request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = "") -> Response:
    await _admit(request, csrf_token)
    await _admin.resume_training(services)
    return RedirectResponse("/admin/ui/training?notice=resumed", status_code=303)


@router.post("/ui/train")
async def train_now(request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = "") -> Response:
    admin = await _admit(request, csrf_token)
    if reason := await services.scheduler.paused():
        return await _adapters_page(
            request,
            services,
            admin,
            status=409,
            error=f"Training is paused: {reason}. Resume it on the Training page first.",
        )
    job = await services.scheduler.maybe_create_job(force=True)
    if job is None:
        return await _adapters_page(
            request, services, admin, status=400,
            error="No group is ready to train on: a group is ready when all its trajectories are rewarded and it "
            f"has at least {services.settings.min_group_size} of them.",
        )  # fmt: skip
    return RedirectResponse(f"/admin/ui/training?notice=queued&job={job['id']}", status_code=303)
