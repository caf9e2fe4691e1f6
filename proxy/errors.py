"""Every error the proxy raises, and how each leaves it in OpenAI's shape.

    ProxyError                      status, type, code -> {"error": {message, type, param, code}}
    ├── InvalidRequest              400 invalid_request_error (bad JSON, fields, path or query values)
    │   ├── BodyTooLarge                413 code request_too_large (over --max-body-mb)
    │   └── ContextLengthExceeded       code context_length_exceeded: vLLM's 400 for a prompt over its context
    ├── AuthenticationFailed        401 authentication_error
    ├── PermissionDenied            403 permission_error
    ├── NotFound                    404 not_found_error
    │   ├── ModelNotFound               code model_not_found
    │   ├── TrajectoryNotFound          code trajectory_not_found
    │   ├── CallNotFound                code call_not_found (a reward's call_id, not of its trajectory)
    │   └── GroupNotFound               code group_not_found
    ├── Conflict                    409 conflict_error (the request contradicts the server's set-up or state)
    ├── TooManyRequests             429 rate_limit_error + Retry-After (failed log-ins, throttled)
    ├── UpstreamError               the upstream failed us
    │   ├── UpstreamUnreachable         502 (connection refused, reset, protocol error)
    │   ├── UpstreamNotReady            503 (the base model is not known yet)
    │   ├── UpstreamTimeout             504
    │   ├── UpstreamHTTPError           the upstream's own status and body, passed through
    │   └── UpstreamStreamError         vLLM ended a stream with its error event (an engine failure)
    ├── GpuBusy                     503 + Retry-After: held through a training step (--share-gpu) longer than
    │                                   --handover-wait; code vllm_not_awake: vLLM did not wake after one
    └── StoreUnavailable            503 the call could not be recorded, so it is not answered

Upstream transport errors and the upstream's error statuses are translated where vLLM is spoken to
(``proxy.gateway.upstream._errors``: ``upstream_errors()``, ``upstream_http_error()``); the store's
errors (``store.StoreError``) in another, ``store_errors()`` (``from_store_error()``). Every
error's HTTP response is made here: ``error_response()`` for a ``ProxyError``,
``response_for()`` for whatever a request raised (an unexpected error is logged and answered
500 without its detail), ``http_error_response()`` for Starlette's own (404 and 405). An
error with ``retry_after_s`` also sends a ``Retry-After`` header (OpenAI's SDKs wait that
long, up to a minute, before their automatic retry). The APIs translated to chat answer in
their own error shape (``Dialect.error``, ``proxy.gateway.dialects``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response

import store

log = logging.getLogger("tracetrain.proxy")


class ProxyError(Exception):
    """Base of the tree; carries what the OpenAI error body needs."""

    status_code = 500
    type = "server_error"
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(ProxyError):
    status_code = 400
    type = "invalid_request_error"

    @classmethod
    def from_validation(cls, errors: Sequence[Mapping[str, Any]], hint: str = "") -> InvalidRequest:
        """The first of pydantic's (or FastAPI's) validation errors, naming the parameter."""
        first = errors[0]
        param = ".".join(str(part) for part in first["loc"] if part not in ("query", "path", "body"))
        message = f"Invalid value for '{param}': {first['msg']}." + (f" {hint}" if hint else "")
        return cls(message, param=param)


class BodyTooLarge(InvalidRequest):
    """The body is longer than the proxy reads (``--max-body-mb``); the connection is closed after the answer."""

    status_code = 413
    code = "request_too_large"


class ContextLengthExceeded(InvalidRequest):
    """vLLM's 400 for a prompt longer than its context (``--max-model-len``), coded as OpenAI codes it.

    Agents look for this code (Codex, the Agents SDK) or for Anthropic's "prompt is too long" (Claude
    Code) to compact their history and go on. ``prompt_tokens`` is the prompt's length as vLLM counted
    it (a lower bound when vLLM only counted characters), ``limit`` the context; None where vLLM's text
    did not say. The message stays vLLM's; each API's error shape sets ``param`` (``with_param``).
    """

    code = "context_length_exceeded"

    def __init__(self, message: str, *, prompt_tokens: int | None, limit: int | None, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def with_param(self, param: str) -> ContextLengthExceeded:
        return ContextLengthExceeded(self.message, prompt_tokens=self.prompt_tokens, limit=self.limit, param=param)


class AuthenticationFailed(ProxyError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(ProxyError):
    status_code = 403
    type = "permission_error"


class NotFound(ProxyError):
    status_code = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class TrajectoryNotFound(NotFound):
    code = "trajectory_not_found"


class CallNotFound(NotFound):
    code = "call_not_found"


class GroupNotFound(NotFound):
    code = "group_not_found"


class Conflict(ProxyError):
    status_code = 409
    type = "conflict_error"


class TooManyRequests(ProxyError):
    """Refused for a while (failed log-ins); ``Retry-After`` says how long."""

    status_code = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(ProxyError):
    status_code = 502
    type = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamNotReady(UpstreamError):
    status_code = 503
    code = "upstream_not_ready"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class UpstreamHTTPError(UpstreamError):
    """The upstream answered with an error status; its status and body go to the client."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content
        super().__init__(_upstream_message(content) or f"upstream answered {status_code}")

    def body(self) -> dict[str, Any]:
        try:
            parsed = orjson.loads(self.content)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
        return error_body(self.message, self.type, None, str(self.status_code))


class UpstreamStreamError(UpstreamError):
    """vLLM ended a stream with an error event instead of its answer (an engine failure mid-generation).

    vLLM 0.32 sends ``data: {"error": {"message", "type", "param", "code"}}`` and then ``data: [DONE]``;
    ``event`` is that error event's data as vLLM wrote it (chat streams forward it so), ``status_code``
    its ``code`` (500 by default; 503 when vLLM says the request may be retried).
    """

    def __init__(self, message: str, status_code: int, event: bytes | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.event = event

    @classmethod
    def from_event(cls, data: bytes, error: Any) -> UpstreamStreamError:
        """The error event vLLM sent (``error``: its parsed ``error`` member)."""
        error = error if isinstance(error, dict) else {}
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        return cls(str(error.get("message") or "the upstream failed mid-stream"), status, data)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, "server_error", None, self.status_code)


class GpuBusy(ProxyError):
    """The GPU is the trainer's for a step (``--share-gpu``), or vLLM did not wake after one."""

    status_code = 503
    type = "server_error"
    code = "gpu_busy_training"

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class StoreUnavailable(ProxyError):
    status_code = 503
    type = "server_error"
    code = "store_unavailable"


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _upstream_message(content: bytes) -> str:
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:500].decode("utf-8", "replace")
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(parsed.get("message"), str):
            return str(parsed["message"])
    return content[:500].decode("utf-8", "replace")


def key_taken(kind: Literal["trajectory", "group"], key: str) -> TrajectoryNotFound | GroupNotFound:
    """A call naming a trajectory or group id that another policy took first: a 404 that says the id is taken
    and not whose it is (another tenant's)."""
    if kind == "trajectory":
        return TrajectoryNotFound(
            f"The trajectory id '{key}' is taken by another policy's trajectory: a trajectory takes calls of one "
            "policy. Start a new trajectory (another id).",
            param="trajectory_id",
        )
    return GroupNotFound(
        f"The group id '{key}' is taken by another policy's group: a group holds trajectories of one policy. "
        "Name another group.",
        param="group_id",
    )


def from_store_error(exc: store.StoreError) -> ProxyError:
    """The store's error as the proxy answers it."""
    if isinstance(exc, store.KeyTaken):
        return key_taken(exc.kind, exc.key)
    if isinstance(exc, store.UnknownTrajectories):
        return TrajectoryNotFound(
            f"{exc}; nothing was recorded. Rewards name the X-Trajectory-Id the proxy returned with the agent's calls.",
            param="trajectory_id",
        )
    if isinstance(exc, store.UnknownCalls):
        return CallNotFound(
            f"{exc}; nothing was recorded. A call's reward names the X-Call-Id the proxy returned with the call, "
            "and the X-Trajectory-Id returned with it.",
            param="call_id",
        )
    if isinstance(exc, store.GroupChanged):
        return Conflict(str(exc), param="group_id")
    if isinstance(exc, store.RecordRefused):  # the same call would be refused again: not worth a retry
        return InvalidRequest(f"{exc}; the call was not recorded, so it is not answered.", code="record_refused")
    return StoreUnavailable(f"the store failed: {store.redact(str(exc))}")


def database_failure(exc: BaseException, doing: str) -> ProxyError:
    """A database failure no store method translated, as a 503: a full disk told once in the log (``store.FULL_DISK``),
    anything else a line each time (never a traceback and a 500, which would end the client's connection)."""
    error = store.store_error_of(exc, doing)
    if not isinstance(error, store.StoreFull):
        log.warning("%s: %s", error, store.redact(str(exc)).splitlines()[0] if str(exc) else "")
    return from_store_error(error)


class _StoreErrors:
    """A class, not a generator: it is entered on every call's path (keying, recording)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, _kind: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None) -> None:
        if isinstance(exc, store.StoreError):
            raise from_store_error(exc) from exc


_STORE_ERRORS = _StoreErrors()


def store_errors() -> _StoreErrors:
    """``with store_errors():`` translates the store's errors raised in the block into the proxy's
    (``from_store_error``); anything else passes through."""
    return _STORE_ERRORS


def error_response(
    exc: ProxyError, headers: Mapping[str, str] | None = None, *, body: Mapping[str, Any] | None = None
) -> Response:
    """``exc`` with its status (and ``Retry-After`` when it has one): in OpenAI's shape, or as ``body`` (the
    shape of a translated API, ``Dialect.error``)."""
    sent = dict(headers or {})
    if exc.retry_after_s is not None:
        sent["Retry-After"] = str(exc.retry_after_s)
    content = orjson.dumps(exc.body() if body is None else body)
    return Response(content, status_code=exc.status_code, headers=sent or None, media_type="application/json")


def server_error_response() -> Response:
    """What the client gets for an error the proxy did not expect (its detail goes to the log).

    The server closes the connection after it (an unexpected error ends it, ``proxy.api._handlers``): the
    answer says so, or a client that keeps connections alive would send its next call down a closed one and
    see it reset, a call lost for another's error."""
    body = error_body("The proxy failed unexpectedly; the error is in its log.", "server_error")
    return Response(orjson.dumps(body), status_code=500, media_type="application/json",
                    headers={"Connection": "close"})  # fmt: skip


def response_for(exc: Exception, method: str, path: str) -> Response:
    """Whatever a request raised, answered: a ``ProxyError`` in its shape, anything else a logged 500."""
    if isinstance(exc, ProxyError):
        return error_response(exc)
    if isinstance(exc, ClientDisconnect):  # gone while sending its body (or cut off, too slow): nobody reads this
        return Response(status_code=400)
    log.error("unexpected error on %s %s", method, path, exc_info=exc)
    return server_error_response()


def http_error_response(status_code: int, detail: str, headers: Mapping[str, str] | None = None) -> Response:
    """Starlette's own errors (an unknown route, a method not allowed) in OpenAI's shape."""
    body = error_body(detail, "invalid_request_error")
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json", headers=headers)
