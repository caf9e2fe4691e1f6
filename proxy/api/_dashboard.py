"""The admin dashboard's pages: server-rendered HTML at ``/admin`` and ``/admin/ui/...``.

Each page renders one result of ``proxy.admin`` (the admin JSON API, ``proxy.api._admin``, returns the same);
what they share (rendering, its Content-Security-Policy, admitting an admin, error pages, the policy picker)
is ``_pages``. Actions are POSTed forms carrying the session's CSRF token (``proxy.api._dashboard_actions``);
the review queue and canary trials are ``_dashboard_review``'s.

Overview, trajectories, groups and trials show every policy unless one is picked; training, adapters and
the review queue are one policy's (the one picked, else the first served).
"""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from starlette.responses import Response

from proxy._credentials import Admin
from proxy._params import Id
from proxy._services import Services
from proxy.admin import _policies, _review
from proxy.admin import _service as _admin
from proxy.admin._svg import line_chart
from proxy.api._deps import ServicesDep
from proxy.api._pages import (
    CURSOR_PARAM,
    ID_PARAM,
    VERSION_PARAM,
    admit,
    one_policy,
    or_error_page,
    picked,
    query_filter,
    show,
)
from tracetrain_core import call_reply

router = APIRouter(prefix="/admin", include_in_schema=False)
forms = APIRouter(prefix="/admin", include_in_schema=False)  # the forms' actions: proxy.api._dashboard_actions
_SINCE = {"15m": 900, "1h": 3600, "24h": 86400, "7d": 7 * 86400, "": None}
_SINCE_CHOICES = [("", "any time"), ("15m", "15 min"), ("1h", "1 hour"), ("24h", "24 hours"), ("7d", "7 days")]


# -- pages -----------------------------------------------------------------------------------


@router.get("")
async def overview(request: Request, services: ServicesDep) -> Response:
    admin = await admit(request)
    policy = await picked(request, services)
    latest = await _admin.list_trajectories(
        services, policy=policy, group_id=None, rewarded=None, limit=8, after=None
    )  # fmt: skip
    charts = []
    for name in [policy] if policy else services.registry.names():
        jobs = (await _admin.list_jobs(services, 500, name))["data"]
        charts.append((name, line_chart(_admin.curves(jobs)["reward_mean"], title=f"Reward mean of {name}",
                                        x_label="version")))  # fmt: skip
    return await show(
        request, services, admin, "overview.html", "Overview", policy, o=await _admin.overview(services, policy),
        refresh=15, reward_charts=charts, latest=latest["data"],
    )  # fmt: skip


@router.get("/ui/policies")
async def policies(request: Request, services: ServicesDep) -> Response:
    admin = await admit(request)
    listing = await _policies.list_policies(services)
    return await show(request, services, admin, "policies.html", "Policies", await picked(request, services),
                       rows=listing["data"])  # fmt: skip


@router.get("/ui/trajectories")
async def trajectories(request: Request, services: ServicesDep) -> Response:
    q = request.query_params
    admin = await admit(request)
    policy = await picked(request, services)
    rewarded = {"true": True, "false": False}.get(q.get("rewarded", ""))
    since = q.get("since", "") if q.get("since", "") in _SINCE else ""
    seconds = _SINCE[since]
    filters: dict[str, Any] = {
        "policy": policy,
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
    return await show(
        request, services, admin, "trajectories.html", "Trajectories", policy, page=page,
        f={**filters, "since": since, "rewarded_raw": q.get("rewarded", "")}, since_choices=_SINCE_CHOICES,
        next_url="/admin/ui/trajectories?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/trajectories/{trajectory_id}")
async def trajectory(trajectory_id: Id, request: Request, services: ServicesDep) -> Response:
    """A trajectory, and the form that scores it (its review shortcuts: ``templates/review.js``)."""
    admin = await admit(request)
    detail = await or_error_page(request, _admin.trajectory_detail(services, trajectory_id), "Not found")
    for call in detail["calls"]:
        call["tokens"] = _token_rows(call)
        call["reply"] = call_reply(call["endpoint"], call.get("response"))
    queue = await _review.neighbours(services, trajectory_id)
    return await show(request, services, admin, "trajectory.html", "Trajectories", detail["policy"], t=detail,
                      picker_path="/admin/ui/trajectories", queue=queue, review_script=True)  # fmt: skip


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
    admin = await admit(request)
    policy = await picked(request, services)
    after = query_filter(request, "after", CURSOR_PARAM)
    listing = _admin.list_groups(services, policy=policy, state=state, limit=50, after=after)
    page = await or_error_page(request, listing, "Bad filter")
    shown = {k: v for k, v in {"policy": policy, "state": state, "after": page["next_cursor"]}.items() if v}
    return await show(
        request, services, admin, "groups.html", "Groups", policy, page=page, state=state or "",
        next_url="/admin/ui/groups?" + urlencode(shown),
    )  # fmt: skip


@router.get("/ui/groups/{group_id}")
async def group(group_id: Id, request: Request, services: ServicesDep) -> Response:
    admin = await admit(request)
    detail = await or_error_page(request, _admin.group_detail(services, group_id), "Not found")
    return await show(request, services, admin, "group.html", "Groups", detail["policy"], g=detail,
                       picker_path="/admin/ui/groups")  # fmt: skip


@router.get("/ui/training")
async def training(request: Request, services: ServicesDep) -> Response:
    admin = await admit(request)
    policy = await one_policy(request, services)
    jobs = (await _admin.list_jobs(services, 500, policy))["data"]
    curves = _admin.curves(jobs)
    running = next((j for j in jobs if j["state"] == "running"), None)
    return await show(
        request, services, admin, "training.html", "Training", policy, jobs=jobs, running=running,
        training=await _admin.training_state(services, policy),
        refresh=10 if running else None,
        reward_chart=line_chart(curves["reward_mean"], title="Reward mean", x_label="version"),
        loss_chart=line_chart(curves["loss"], title="Loss", x_label="version"),
        mismatch_chart=line_chart(curves["logprob_mismatch_mean"], title="Log-prob mismatch", x_label="version"),
    )  # fmt: skip


@router.get("/ui/adapters")
async def adapters(request: Request, services: ServicesDep) -> Response:
    admin = await admit(request)
    return await adapters_page(request, services, admin, await one_policy(request, services))


async def adapters_page(
    request: Request, services: Services, admin: Admin, policy: str, error: str | None = None, status: int = 200
) -> Response:
    """``policy``'s versions (the action forms' error page too, with ``error``)."""
    listing = await _admin.list_adapters(services, policy)
    base = {"version": 0, "state": "base model", "path": services.registry.base_model or "", "job_id": None,
            "error": None, "metrics": {}, "created_at": None}  # fmt: skip
    response = await show(request, services, admin, "adapters.html", "Adapters", policy, a=listing,
                           versions=[base, *listing["data"]], error=error)  # fmt: skip
    response.status_code = status
    return response
