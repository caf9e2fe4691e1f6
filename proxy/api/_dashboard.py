"""The admin dashboard: server-rendered HTML at ``/admin`` and ``/admin/ui/...``.

Each page renders one result of ``proxy.admin`` (the admin JSON API, ``proxy.api._admin``, returns the same);
what they share (rendering, its Content-Security-Policy, admitting an admin, error pages) is ``_pages``. The
review queue and canary trials are ``_dashboard_review``'s.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Request
from starlette.responses import RedirectResponse, Response

from proxy._credentials import COOKIE, SESSION_S, Admin, cookie_is_secure
from proxy._params import Id, Version
from proxy._services import Services
from proxy.admin import _review
from proxy.admin import _service as _admin
from proxy.admin._svg import line_chart
from proxy.api._deps import ServicesDep
from proxy.api._pages import (
    CURSOR_PARAM,
    ID_PARAM,
    VERSION_PARAM,
    admin_auth,
    admit,
    login_page,
    or_error_page,
    query_filter,
    safe_next,
    show,
)
from proxy.errors import ProxyError
from tracetrain_core import call_reply

router = APIRouter(prefix="/admin", include_in_schema=False)

_SINCE = {"15m": 900, "1h": 3600, "24h": 86400, "7d": 7 * 86400, "": None}
_SINCE_CHOICES = [("", "any time"), ("15m", "15 min"), ("1h", "1 hour"), ("24h", "24 hours"), ("7d", "7 days")]


# -- log in and out ------------------------------------------------------------------------


@router.get("/ui/login")
async def login_form(request: Request, next: str = "/admin") -> Response:
    if admin_auth(request).open:
        return RedirectResponse("/admin", status_code=303)
    return login_page(request, 200, next_url=safe_next(next))


@router.post("/ui/login")
async def login(
    request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/admin"
) -> Response:
    auth = admin_auth(request)
    if auth.open:
        return RedirectResponse("/admin", status_code=303)
    if not auth.token_matches(token):
        return login_page(request, 401, error="That is not the admin token.", next_url=safe_next(next))
    response = RedirectResponse(safe_next(next), status_code=303)
    response.set_cookie(
        COOKIE, auth.new_session(), max_age=SESSION_S, path="/admin", httponly=True, samesite="strict",
        secure=cookie_is_secure(request),
    )  # fmt: skip
    return response


@router.post("/ui/logout")
async def logout(request: Request, csrf_token: Annotated[str, Form()] = "") -> Response:
    admit(request, csrf_token)
    response = RedirectResponse("/admin/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="strict")
    return response


# -- pages -----------------------------------------------------------------------------------


@router.get("")
async def overview(request: Request, services: ServicesDep) -> Response:
    admin = admit(request)
    jobs = (await _admin.list_jobs(services, 500))["data"]
    latest = await _admin.list_trajectories(
        services, policy=None, group_id=None, rewarded=None, limit=8, after=None
    )  # fmt: skip
    return show(
        request, services, admin, "overview.html", "Overview", o=await _admin.overview(services), refresh=15,
        reward_chart=line_chart(_admin.curves(jobs)["reward_mean"], title="Reward mean", x_label="version"),
        latest=latest["data"],
    )  # fmt: skip


@router.get("/ui/trajectories")
async def trajectories(request: Request, services: ServicesDep) -> Response:
    q = request.query_params
    admin = admit(request)
    rewarded = {"true": True, "false": False}.get(q.get("rewarded", ""))
    since = q.get("since", "") if q.get("since", "") in _SINCE else ""
    seconds = _SINCE[since]
    filters: dict[str, Any] = {
        "policy": query_filter(request, "policy", ID_PARAM),
        "group_id": query_filter(request, "group_id", ID_PARAM),
        "rewarded": rewarded,
        "version": query_filter(request, "version", VERSION_PARAM),
        "created_after": time.time() - seconds if seconds else None,
        "created_before": None,
    }
    after = query_filter(request, "after", CURSOR_PARAM)
    listing = _admin.list_trajectories(services, **filters, limit=50, after=after)
    page = await or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {**q, "after": page["next_cursor"]}.items() if v}
    return show(
        request, services, admin, "trajectories.html", "Trajectories", page=page,
        f={**filters, "since": since, "rewarded_raw": q.get("rewarded", "")}, since_choices=_SINCE_CHOICES,
        next_url="/admin/ui/trajectories?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/trajectories/{trajectory_id}")
async def trajectory(trajectory_id: Id, request: Request, services: ServicesDep) -> Response:
    """A trajectory, and the form that scores it (its review shortcuts: ``templates/review.js``)."""
    admin = admit(request)
    detail = await or_error_page(request, _admin.trajectory_detail(services, trajectory_id), "Not found")
    for call in detail["calls"]:
        call["tokens"] = _token_rows(call)
        call["reply"] = call_reply(call["endpoint"], call.get("response"))
    queue = await _review.neighbours(services, trajectory_id)
    return show(request, services, admin, "trajectory.html", "Trajectories", t=detail, queue=queue, review_script=True)


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
    admin = admit(request)
    after = query_filter(request, "after", CURSOR_PARAM)
    listing = _admin.list_groups(services, policy=None, state=state, limit=50, after=after)
    page = await or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {"state": state, "after": page["next_cursor"]}.items() if v}
    return show(
        request, services, admin, "groups.html", "Groups", page=page, state=state or "",
        next_url="/admin/ui/groups?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/groups/{group_id}")
async def group(group_id: Id, request: Request, services: ServicesDep) -> Response:
    admin = admit(request)
    detail = await or_error_page(request, _admin.group_detail(services, group_id), "Not found")
    return show(request, services, admin, "group.html", "Groups", g=detail)


@router.post("/ui/groups/{group_id}/judge")
async def judge_group(
    group_id: Id, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    admit(request, csrf_token)
    judgement = await or_error_page(request, services.judging.judge_group(group_id), "Not judged")
    notice = "judged" if judgement["state"] == "ok" else "judge_failed"
    return RedirectResponse(f"/admin/ui/groups/{quote(group_id, safe='')}?notice={notice}", status_code=303)


@router.get("/ui/training")
async def training(request: Request, services: ServicesDep) -> Response:
    admin = admit(request)
    jobs = (await _admin.list_jobs(services, 500))["data"]
    curves = _admin.curves(jobs)
    running = next((j for j in jobs if j["state"] == "running"), None)
    return show(
        request, services, admin, "training.html", "Training", jobs=jobs, running=running,
        training=await _admin.training_state(services),
        refresh=10 if running else None,
        reward_chart=line_chart(curves["reward_mean"], title="Reward mean", x_label="version"),
        loss_chart=line_chart(curves["loss"], title="Loss", x_label="version"),
        mismatch_chart=line_chart(curves["logprob_mismatch_mean"], title="Log-prob mismatch", x_label="version"),
    )  # fmt: skip


@router.get("/ui/adapters")
async def adapters(request: Request, services: ServicesDep) -> Response:
    admin = admit(request)
    return await _adapters_page(request, services, admin)


async def _adapters_page(
    request: Request, services: Services, admin: Admin, error: str | None = None, status: int = 200
) -> Response:
    listing = await _admin.list_adapters(services)
    base = {"version": 0, "state": "base model", "path": services.registry.base_model or "", "job_id": None,
            "error": None, "metrics": {}, "created_at": None}  # fmt: skip
    response = show(
        request, services, admin, "adapters.html", "Adapters", a=listing, versions=[base, *listing["data"]], error=error
    )
    response.status_code = status
    return response


# -- actions ---------------------------------------------------------------------------------


@router.post("/ui/adapters/{version}/activate")
async def activate(
    version: Version, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    admin = admit(request, csrf_token)
    try:
        active = await services.publisher.activate(version)
    except ProxyError as exc:
        return await _adapters_page(request, services, admin, error=exc.message, status=exc.status_code)
    return RedirectResponse(f"/admin/ui/adapters?notice=activated&version={active}", status_code=303)


@router.post("/ui/training/resume")
async def resume_training(request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = "") -> Response:
    admit(request, csrf_token)
    await _admin.resume_training(services)
    return RedirectResponse("/admin/ui/training?notice=resumed", status_code=303)


@router.post("/ui/train")
async def train_now(request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = "") -> Response:
    admin = admit(request, csrf_token)
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
