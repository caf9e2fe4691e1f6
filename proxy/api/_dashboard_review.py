"""The dashboard's review queue, a person's score of a trajectory, and canary trials (pages and their forms).

The score form is on a trajectory's page (``_dashboard.trajectory``); its keyboard shortcuts are
``templates/review.js``, and work without them too: the form is a plain POST. After a score the
page moves on to the next trajectory awaiting one (in the same policy's queue).

The review queue is one policy's (the one picked, else the first served); the trials page shows every
policy's trials unless one is picked. A trial's forms name its policy (a hidden field): a trial of
another policy is a 404 there, as an unknown one.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Request
from starlette.responses import RedirectResponse, Response

from proxy._params import Id, PolicyName, TrialId
from proxy._services import Services
from proxy.admin import _policies, _review, _trials
from proxy.api._deps import ServicesDep
from proxy.api._pages import (
    CURSOR_PARAM,
    PageResponse,
    admit,
    error_page,
    one_policy,
    or_error_page,
    picked,
    query_filter,
    show,
)
from proxy.data import validate_feedback
from proxy.errors import InvalidRequest, ProxyError

router = APIRouter(prefix="/admin", include_in_schema=False)
PolicyField = Annotated[PolicyName | None, Form()]


def _policy_q(services: Services, policy: str) -> dict[str, str]:
    """The ``policy`` query a link keeps: none while it is the only one served (the pages' default)."""
    return {} if services.registry.names() == [policy] else {"policy": policy}


@router.get("/ui/review")
async def review(request: Request, services: ServicesDep) -> Response:
    admin = await admit(request)
    policy = await one_policy(request, services)
    after = query_filter(request, "after", CURSOR_PARAM)
    queue = await or_error_page(request, _review.queue(services, policy, limit=50, after=after), "Bad filter")
    shown = {**_policy_q(services, policy), "after": queue["next_cursor"]}
    next_url = "/admin/ui/review?" + urlencode(shown) if queue["next_cursor"] else None
    return await show(request, services, admin, "review.html", "Review", policy, q=queue, next_url=next_url)


@router.post("/ui/trajectories/{trajectory_id}/feedback")
async def feedback(
    trajectory_id: Id,
    request: Request,
    services: ServicesDep,
    score: Annotated[str, Form()] = "",
    note: Annotated[str, Form()] = "",
    demonstration: Annotated[str, Form()] = "",
    csrf_token: Annotated[str, Form()] = "",
) -> Response:
    """The score form: the score saved as the trajectory's reward, then the next trajectory awaiting one."""
    await admit(request, csrf_token)
    try:
        parsed = validate_feedback({"score": float(score), "note": note or None,
                                    "demonstration": demonstration or None})  # fmt: skip
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
    admin = await admit(request)
    policy = await picked(request, services)
    listing = await _trials.list_trials(services, policy, 50)
    # The policy in view (picked, or the only one served) names the notice's version.
    return await show(request, services, admin, "trials.html", "Trials", listing["policy"], trials=listing,
                      refresh=10 if listing["running"] else None)  # fmt: skip


async def _end(
    request: Request, services: Services, trial_id: int, decision: _trials.Ending, csrf_token: str,
    policy: str | None,
) -> Response:  # fmt: skip
    await admit(request, csrf_token)
    try:
        if policy is not None:
            policy = await _policies.chosen(services, policy)
        ended = await _trials.end_trial(services, trial_id, decision, policy)
    except ProxyError as exc:
        raise PageResponse(error_page(request, exc, "Not ended")) from None
    query = urlencode({**_policy_q(services, str(ended["policy"])), "notice": decision, "version": ended["candidate"]})
    return RedirectResponse(f"/admin/ui/trials?{query}", status_code=303)


@router.post("/ui/trials/{trial_id}/promote")
async def promote(
    trial_id: TrialId, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = "",
    policy: PolicyField = None,
) -> Response:  # fmt: skip
    return await _end(request, services, trial_id, "promoted", csrf_token, policy)


@router.post("/ui/trials/{trial_id}/roll-back")
async def roll_back(
    trial_id: TrialId, request: Request, services: ServicesDep, csrf_token: Annotated[str, Form()] = "",
    policy: PolicyField = None,
) -> Response:  # fmt: skip
    return await _end(request, services, trial_id, "rolled_back", csrf_token, policy)
