"""The dashboard's forms: logging in and out, and every action (each one POSTed with the session's CSRF token).

Each action is about one policy, named by the form's hidden ``policy`` field (optional while one policy is
served), and redirects to the page that shows its effect, with a notice; a refusal renders the page it came
from with the reason. The pages themselves are ``proxy.api._dashboard``.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import Form, Request
from starlette.responses import RedirectResponse, Response

from proxy._credentials import COOKIE, SESSION_S, cookie_is_secure
from proxy._params import Id, PolicyName, Version
from proxy._services import Services
from proxy.admin import _policies
from proxy.admin import _service as _admin
from proxy.api._dashboard import adapters_page, forms
from proxy.api._deps import ServicesDep
from proxy.api._pages import admin_auth, admit, login_page, or_error_page, safe_next
from proxy.errors import ProxyError, TooManyRequests

Csrf = Annotated[str, Form()]
PolicyField = Annotated[PolicyName | None, Form()]


def _to(services: Services, path: str, policy: str, **notice: str | int) -> RedirectResponse:
    """Back to ``path`` with a notice; naming the policy unless it is the only one served (the page's default)."""
    named = {} if services.registry.names() == [policy] else {"policy": policy}
    query = "&".join(f"{key}={quote(str(value), safe='')}" for key, value in {**named, **notice}.items())
    return RedirectResponse(f"{path}?{query}", status_code=303)


# -- log in and out ------------------------------------------------------------------------


@forms.get("/ui/login")
async def login_form(request: Request, next: str = "/admin") -> Response:
    if admin_auth(request).open:
        return RedirectResponse("/admin", status_code=303)
    return login_page(request, 200, next_url=safe_next(next))


@forms.post("/ui/login")
async def login(
    request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/admin"
) -> Response:
    auth = admin_auth(request)
    if auth.open:
        return RedirectResponse("/admin", status_code=303)
    try:
        right = auth.log_in(request, token)
    except TooManyRequests as exc:
        page = login_page(request, 429, error=exc.message, next_url=safe_next(next))
        page.headers["Retry-After"] = str(exc.retry_after_s)
        return page
    if not right:
        return login_page(request, 401, error="That is not the admin token.", next_url=safe_next(next))
    response = RedirectResponse(safe_next(next), status_code=303)
    response.set_cookie(
        COOKIE, auth.new_session(), max_age=SESSION_S, path="/admin", httponly=True, samesite="strict",
        secure=cookie_is_secure(request),
    )  # fmt: skip
    return response


@forms.post("/ui/logout")
async def logout(request: Request, csrf_token: Csrf = "") -> Response:
    admin = await admit(request, csrf_token)
    await admin_auth(request).revoke(admin)  # ended on the server too: a copy of the cookie is refused from now on
    response = RedirectResponse("/admin/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="strict")
    return response


# -- actions ---------------------------------------------------------------------------------


@forms.post("/ui/groups/{group_id}/judge")
async def judge_group(group_id: Id, request: Request, services: ServicesDep, csrf_token: Csrf = "") -> Response:
    await admit(request, csrf_token)
    judgement = await or_error_page(request, services.judging.judge_group(group_id), "Not judged")
    notice = "judged" if judgement["state"] == "ok" else "judge_failed"
    return RedirectResponse(f"/admin/ui/groups/{quote(group_id, safe='')}?notice={notice}", status_code=303)


@forms.post("/ui/adapters/{version}/activate")
async def activate(
    version: Version, request: Request, services: ServicesDep, csrf_token: Csrf = "", policy: PolicyField = None
) -> Response:
    admin = await admit(request, csrf_token)
    name = await or_error_page(request, _policies.chosen(services, policy), "Not found")
    try:
        active = await services.publisher.activate(name, version)
    except ProxyError as exc:
        return await adapters_page(request, services, admin, name, error=exc.message, status=exc.status_code)
    return _to(services, "/admin/ui/adapters", name, notice="activated", version=active)


@forms.post("/ui/training/resume")
async def resume_training(
    request: Request, services: ServicesDep, csrf_token: Csrf = "", policy: PolicyField = None
) -> Response:
    await admit(request, csrf_token)
    name = await or_error_page(request, _policies.chosen(services, policy), "Not found")
    await _admin.resume_training(services, name)
    return _to(services, "/admin/ui/training", name, notice="resumed")


@forms.post("/ui/train")
async def train_now(
    request: Request, services: ServicesDep, csrf_token: Csrf = "", policy: PolicyField = None
) -> Response:
    admin = await admit(request, csrf_token)
    name = await or_error_page(request, _policies.chosen(services, policy), "Not found")
    if reason := await services.scheduler.paused(name):
        why = f"Training is paused: {reason}. Resume it on the Training page first."
        return await adapters_page(request, services, admin, name, status=409, error=why)
    job = await services.scheduler.maybe_create_job(name, force=True)
    if job is None:
        size = services.registry.get(name).settings.min_group_size if name in services.registry else None
        return await adapters_page(
            request, services, admin, name, status=400,
            error=f"No group is ready to train {name} on: a group is ready when all its trajectories are rewarded "
            f"and it has at least {size or services.settings.min_group_size} of them; a retired policy trains nothing.",
        )  # fmt: skip
    return _to(services, "/admin/ui/training", name, notice="queued", job=job["id"])


@forms.post("/ui/policies")
async def add_policy(
    request: Request, services: ServicesDep, csrf_token: Csrf = "", name: Annotated[str, Form()] = ""
) -> Response:
    await admit(request, csrf_token)
    await or_error_page(request, _policies.add_policy(services, name, None), "Not added")
    return _to(services, "/admin/ui/policies", name, notice="added", name=name)


@forms.post("/ui/policies/{name}/retire")
async def retire_policy(name: PolicyName, request: Request, services: ServicesDep, csrf_token: Csrf = "") -> Response:
    await admit(request, csrf_token)
    await or_error_page(request, _policies.retire_policy(services, name), "Not retired")
    return RedirectResponse(f"/admin/ui/policies?notice=retired&name={quote(name, safe='')}", status_code=303)
