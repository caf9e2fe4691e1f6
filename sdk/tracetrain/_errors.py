"""The errors the tracetrain client raises: one tree, rooted at `TracetrainError`.

::

    TracetrainError
     ├── APIConnectionError         the server could not be reached (wraps httpx.TransportError)
     └── APIError                   the server answered with an error, or with a body we cannot read
          ├── BadRequestError       400, 422: the request was invalid
          ├── AuthenticationError   401, 403: missing or wrong API key
          └── NotFoundError         404: e.g. an unknown trajectory id

Invalid arguments caught before any request (a non-finite reward, a group without a
trajectory) raise `ValueError`, like any Python function given a bad value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx


class TracetrainError(Exception):
    """Base class of every error raised by the tracetrain client."""


class APIConnectionError(TracetrainError):
    """The request never got an answer: connection refused, DNS failure, timeout, ...

    The underlying httpx exception is the `__cause__`.
    """


class APIError(TracetrainError):
    """The server answered with an error status, in OpenAI's `{"error": {...}}` shape.

    Attributes mirror that body; `message` falls back to the raw response text when
    the body is not OpenAI-shaped JSON.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code


class BadRequestError(APIError):
    """400 or 422: the server rejected the request as invalid."""


class AuthenticationError(APIError):
    """401 or 403: the API key is missing or not accepted."""


class NotFoundError(APIError):
    """404: the trajectory (or other resource) does not exist."""


_ERROR_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    422: BadRequestError,
}


def error_from_response(response: httpx.Response) -> APIError:
    """Build the `APIError` subclass matching an error response."""
    cls = _ERROR_BY_STATUS.get(response.status_code, APIError)
    error = _openai_error_body(response)
    if error is None:
        return cls(response.status_code, response.text or response.reason_phrase)
    code = error.get("code")
    return cls(
        response.status_code,
        str(error.get("message") or response.reason_phrase),
        type=_str_or_none(error.get("type")),
        param=_str_or_none(error.get("param")),
        code=code if isinstance(code, str | int) else None,
    )


@contextmanager
def translate_transport_errors(request: httpx.Request) -> Iterator[None]:
    """Turn httpx's transport errors into `APIConnectionError`: the one place this happens."""
    try:
        yield
    except httpx.TransportError as exc:
        raise APIConnectionError(f"{request.method} {request.url} failed: {exc!r}") from exc


def _openai_error_body(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error: dict[str, Any] = body["error"]
        return error
    return None


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
