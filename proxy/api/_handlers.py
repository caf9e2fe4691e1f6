"""The app's exception handlers: every error answered in OpenAI's shape, made by ``proxy.errors``.

A ``ProxyError`` has its own handler: Starlette's handler for ``Exception`` runs in its outermost
middleware, which re-raises after answering (the server then logs it as a crash, and closes the
connection: the 500 says ``Connection: close``, so that no client sends its next call down it).
So do the store's errors and the database's own (a query no store method translated): a full disk or a
database gone is a 503, told once in the log (a full disk: ``store.FULL_DISK``), never a crash.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from proxy.api._pages import PageResponse, bad_page_request
from proxy.errors import (
    InvalidRequest,
    NotFound,
    ProxyError,
    database_failure,
    error_response,
    from_store_error,
    http_error_response,
    response_for,
)
from store import DRIVER_ERRORS, StoreError


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ProxyError, _proxy_error)  # type: ignore[arg-type]
    app.add_exception_handler(PageResponse, _page_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(StoreError, _store_error)  # type: ignore[arg-type]
    for driver_error in DRIVER_ERRORS:
        app.add_exception_handler(driver_error, _database_error)
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


async def _store_error(_request: Request, exc: StoreError) -> Response:
    return error_response(from_store_error(exc))


async def _database_error(request: Request, exc: Exception) -> Response:
    return error_response(database_failure(exc, f"answer {request.method} {request.url.path}"))


async def _any_error(request: Request, exc: Exception) -> Response:
    """An error nothing else answered: a logged 500 (``proxy.errors.response_for``)."""
    return response_for(exc, request.method, request.url.path)
