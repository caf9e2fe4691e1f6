"""The app's exception handlers: every error answered in OpenAI's shape, made by ``proxy.errors``.

A ``ProxyError`` has its own handler: Starlette's handler for ``Exception`` runs in its outermost
middleware, which re-raises after answering (the server then logs it as a crash).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from proxy.api._pages import PageResponse, bad_page_request
from proxy.errors import InvalidRequest, NotFound, ProxyError, error_response, http_error_response, response_for


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ProxyError, _proxy_error)  # type: ignore[arg-type]
    app.add_exception_handler(PageResponse, _page_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _any_error)


async def _proxy_error(_request: Request, exc: ProxyError) -> Response:
    return error_response(exc)


async def _page_response(_request: Request, exc: PageResponse) -> Response:
    return exc.response  # a dashboard page's refusal or error page, already rendered


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    error = InvalidRequest.from_validation(exc.errors())
    return bad_page_request(request, error) or error_response(error)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(NotFound(f"Unknown request URL: {request.method} {request.url.path}."))
    return http_error_response(exc.status_code, str(exc.detail), exc.headers)


async def _any_error(request: Request, exc: Exception) -> Response:
    """An error nothing else answered: a logged 500 (``proxy.errors.response_for``)."""
    return response_for(exc, request.method, request.url.path)
