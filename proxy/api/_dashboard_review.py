"""The dashboard's review queue, a person's score of a trajectory, and canary trials (pages and their forms).

The score form is on a trajectory's page (``_dashboard.trajectory``); its keyboard shortcuts are
``templates/review.js``, and work without them too: the form is a plain POST. After a score the
page moves on to the next trajectory awaiting one.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Request
from starlette.responses import RedirectResponse, Response

from proxy._params import Id, TrialId
from proxy._services import Services
from proxy.admin import _review, _trials
from proxy.api._deps import ServicesDep
from proxy.api._pages import CURSOR_PARAM, PageResponse, admit, error_page, or_error_page, query_filter, show
from proxy.data import validate_feedback
from proxy.errors import InvalidRequest, ProxyError

router = APIRouter(prefix="/admin", include_in_schema=False)


@router.get("/ui/review")
async def review(request: Request, services: ServicesDep) -> Response:
    admin = admit(request)
    after = query_filter(request, "after", CURSOR_PARAM)
    queue = await or_error_page(request, _review.queue(services, limit=50, after=after), "Bad filter")
    next_url = "/admin/ui/review?" + urlencode({"after": queue["next_cursor"]}) if queue["next_cursor"] else None
    return show(request, services, admin, "review.html", "Review", q=queue, next_url=next_url)


@router.post("/ui/trajectories/{trajectory_id}/feedback")
async def feedback(
    trajectory_id: Id,
    request: Request,
    services: ServicesDep,
    score: Annotated[str, Form()] = "",
    note: Annotated[str, Form()] = "",
    csrf_token: Annotated[str, Form()] = "",
) -> Response:
    """The score form: the score saved as the trajectory's reward, then the next trajectory awaiting one."""
    admit(request, csrf_token)
    try:
        parsed = validate_feedback({"score": float(score), "note": note or None})
    except (ValueError, InvalidRequest) as exc:
        error = exc if isinstance(exc, InvalidRequest) else InvalidRequest(
            "The score must be a number from 0 to 1.", param="score")  # fmt: skip
        raise PageResponse(error_page(request, error, "Bad score")) from None
    await or_error_page(request, _review.score(services, trajectory_id, parsed), "Not scored")
    following = (await _review.neighbours(services, trajectory_id))["next"]
    if following is None:
        return RedirectResponse(f"/admin/ui/trajectories/{quote(trajectory_id, safe='')}?notice=scored_last",
                                status_code=303)  # fmt: skip
    return RedirectResponse(f"/admin/ui/trajectories/{quote(following, safe='')}?notice=scored", status_code=303)


@router.get("/ui/trials")
async def trials(request: Request, services: ServicesDep) -> Response:
    admin = admit(request)
    listing = await _trials.list_trials(services, 50)
    return show(request, services, admin, "trials.html", "Trials", trials=listing, refresh=10 if listing["running"]
                else None)  # fmt: skip


async def _end(
    request: Request, services: Services, trial_id: int, decision: _trials.Ending, csrf_token: str
) -> Response:
    admit(request, csrf_token)
    try:
        ended = await _trials.end_trial(services, trial_id, decision)
    except ProxyError as exc:
        raise PageResponse(error_page(request, exc, "Not ended")) from None
    return RedirectResponse(f"/admin/ui/trials?notice={decision}&version={ended['candidate']}", status_code=303)


@router.post("/ui/trials/{trial_id}/promote")
async def promote(
    trial_id: TrialId, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    return await _end(request, services, trial_id, "promoted", csrf_token)


@router.post("/ui/trials/{trial_id}/roll-back")
async def roll_back(
    trial_id: TrialId, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    return await _end(request, services, trial_id, "rolled_back", csrf_token)
