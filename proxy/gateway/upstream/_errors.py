"""The upstream's failures as the proxy's errors (``proxy.errors``): transport errors talking to vLLM
(``upstream_errors``) and vLLM's error statuses (``upstream_http_error``), a prompt over its context included."""

from __future__ import annotations

import re

import httpx

import store
from proxy.errors import ContextLengthExceeded, UpstreamError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnreachable

# vLLM 0.32's texts for a prompt over the context (renderers/params.py, and get_max_tokens in serve/utils).
_CONTEXT_TOKENS = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, your prompt contains (?:at least )?(\d+) input"
)
_CONTEXT_CHARS = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, your prompt contains (\d+) characters "
    r"\(more than (\d+) characters, which is the upper bound for (\d+) input tokens\)"
)
_INPUT_LENGTH = re.compile(r"Input length \((\d+)\) exceeds model's maximum context length \((\d+)\)")


def upstream_http_error(status_code: int, content: bytes) -> UpstreamError | ContextLengthExceeded:
    """The upstream's error status as the proxy raises it: a prompt over vLLM's context is
    ``ContextLengthExceeded``, anything else ``UpstreamHTTPError`` (passed through)."""
    error = UpstreamHTTPError(status_code, content)
    if status_code != 400 or "context length" not in error.message:
        return error
    if found := _CONTEXT_TOKENS.search(error.message):
        limit, tokens = int(found[1]), int(found[2])
    elif found := _CONTEXT_CHARS.search(error.message):
        # Counted in characters: at least the characters over the upper bound's rate, and more than the limit.
        limit, chars, bound, bound_tokens = (int(g) for g in found.groups())
        tokens = max(-(-chars * bound_tokens // max(bound, 1)), limit + 1)
    elif found := _INPUT_LENGTH.search(error.message):
        tokens, limit = int(found[1]), int(found[2])
    else:
        return error
    return ContextLengthExceeded(error.message, prompt_tokens=tokens, limit=limit)


class upstream_errors:  # lower case: used as the function it was, ``async with upstream_errors(url):``
    """Translate httpx's and the generation pool's transport errors talking to ``upstream`` into ``UpstreamError``s.

    A class rather than an ``asynccontextmanager``: it wraps every upstream call, and a generator's
    context manager costs several frames in ``contextlib`` per use."""

    __slots__ = ("_upstream",)

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        if isinstance(exc, httpx.TimeoutException | TimeoutError):
            shown = store.redact(self._upstream)  # the URL may carry a password: messages reach clients and the store
            raise UpstreamTimeout(f"the upstream at {shown} did not answer in time ({type(exc).__name__})") from exc
        if isinstance(exc, httpx.TransportError | ConnectionError):  # ConnectionError: upstream._http1's
            message = f"cannot reach the upstream at {self._upstream} ({type(exc).__name__}: {exc}); is vLLM running?"
            raise UpstreamUnreachable(store.redact(message)) from exc
