"""Asking the judge model through litellm, with bounded retries of our own.

Retries (``Judge.judge``, through tenacity) are ours, with litellm's own off
(``num_retries=0``), so every request is visible to tests: a rate limit, a timeout, a
dropped connection or a 5xx is retried after an exponential backoff (``Retry-After``
honoured, capped); an invalid answer is retried at once with the error shown to the
model; a provider refusing ``response_format`` is asked again without it; any other error
(a bad key, an unknown model, a prompt too long) fails at once. After ``max_attempts``
requests ``JudgeFailed`` says why, in a classified reason (the exception's kind, an HTTP status, a
timeout, a refused connection, an answer that was not JSON): never the far end's body. Nothing here
writes to the store: that is ``proxy.judge._service``.

litellm is imported on first use only, in a worker thread: it takes seconds, which must
not stall the proxy's event loop, and most proxies never judge.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
from dataclasses import dataclass, field
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential

from proxy.judge._prompt import InvalidJudgement, JudgePrompt, Score, parse_scores

_MAX_BACKOFF_S = 30.0

_RETRY = """\
Your answer could not be used: {reason}. Answer again with only the JSON object, one \
entry for each of the ids {ids}, each score a number from 0 to 1."""


@dataclass(slots=True)
class Verdict:
    """A valid answer: scores in label order, what it took to get them."""

    scores: list[Score]
    attempts: int
    usage: dict[str, int] = field(default_factory=dict)


class JudgeFailed(Exception):
    """No valid answer within the attempts; ``reason`` is what went wrong last."""

    def __init__(self, reason: str, *, attempts: int, usage: dict[str, int]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts
        self.usage = usage


class Judge:
    """Asks a judge model through litellm, with bounded retries of our own.

    ``model`` is a litellm model name: ``openai/gpt-4o-mini``, ``anthropic/claude-...``,
    or ``hosted_vllm/<served model>`` with ``api_base`` at that vLLM. Provider keys come
    from the provider's usual environment variables (``OPENAI_API_KEY``, ...).
    """

    def __init__(
        self,
        model: str,
        *,
        api_base: str | None = None,
        max_attempts: int = 3,
        backoff_s: float = 1.0,
        timeout_s: float = 120.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.model = model
        self.api_base = api_base
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        # backoff_s, 2 backoff_s, 4 backoff_s ... after the 1st, 2nd, 3rd ... failed request, capped.
        self._exponential = wait_exponential(multiplier=backoff_s, max=_MAX_BACKOFF_S)

    async def judge(self, prompt: JudgePrompt) -> Verdict:
        """Scores for every label in ``prompt``, or ``JudgeFailed`` after ``max_attempts`` requests."""
        try:
            litellm = await asyncio.to_thread(_litellm)  # the first import takes seconds: not on the event loop
        except ImportError as exc:
            raise JudgeFailed(
                f"litellm is not installed ({exc}): pip install 'tracetrain[proxy]'", attempts=0, usage={}
            ) from exc
        asking = _Asking(prompt, list(prompt.messages), "response_format" in _supported_params(litellm, self.model))
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(_TryAgain),
            reraise=True,  # the last _TryAgain, not tenacity's RetryError
        )
        try:
            return await retrying(self._ask, litellm, asking)
        except _TryAgain as exc:
            raise JudgeFailed(
                f"no valid answer after {self.max_attempts} attempts; last: {exc}",
                attempts=self.max_attempts,
                usage=asking.usage,
            ) from exc

    async def _ask(self, litellm: Any, asking: _Asking) -> Verdict:
        """One request: a verdict, ``_TryAgain`` when another request may do better, or ``JudgeFailed``."""
        asking.attempts += 1
        prompt = asking.prompt
        try:
            response = await litellm.acompletion(
                model=self.model,
                messages=asking.messages,
                api_base=self.api_base,
                response_format=prompt.response_format() if asking.use_format else None,
                timeout=self.timeout_s,
                num_retries=0,
                drop_params=True,
            )
        # Providers raise litellm's exception types, but also httpx's, aiohttp's and their
        # SDK's: each is classified, none is swallowed silently (the reason is kept).
        except Exception as exc:
            reason = _describe(litellm, exc)
            if asking.use_format and _rejects_format(litellm, exc):
                asking.use_format = False  # asked again at once, without response_format
                raise _TryAgain(reason, back_off=False) from exc
            if not _retryable(litellm, exc):
                raise JudgeFailed(reason, attempts=asking.attempts, usage=asking.usage) from exc
            raise _TryAgain(reason, back_off=True) from exc
        _add_usage(asking.usage, response)
        content = _content_of(response)
        try:
            scores = parse_scores(content, prompt.labels)
        except InvalidJudgement as exc:
            ids = ", ".join(prompt.labels)
            asking.messages = [
                *prompt.messages,
                {"role": "assistant", "content": content or ""},
                {"role": "user", "content": _RETRY.format(reason=exc, ids=ids)},
            ]
            raise _TryAgain(f"invalid answer: {exc}", back_off=False) from exc  # asked again at once
        return Verdict(scores, asking.attempts, asking.usage)

    def _wait(self, state: RetryCallState) -> float:
        """Seconds before the next request: none after an invalid answer or a refused response_format,
        else ``Retry-After`` when the provider sent one (capped), else the exponential backoff +-20%."""
        failure = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(failure, _TryAgain) or not failure.back_off:
            return 0.0
        cause = failure.__cause__
        retry_after = _retry_after(cause) if isinstance(cause, Exception) else None
        if retry_after is not None:
            return min(retry_after, _MAX_BACKOFF_S)
        return float(self._exponential(state)) * random.uniform(0.8, 1.2)


@dataclass(slots=True)
class _Asking:
    """What one request leaves to the next."""

    prompt: JudgePrompt
    messages: list[dict[str, Any]]  # the prompt, plus the last invalid answer and why once there was one
    use_format: bool  # send the answer's JSON schema as response_format
    attempts: int = 0
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})


class _TryAgain(Exception):
    """A request failed in a way the next one may not: retried, after a backoff when ``back_off``."""

    def __init__(self, reason: str, *, back_off: bool) -> None:
        super().__init__(reason)
        self.back_off = back_off


def _litellm() -> Any:
    """litellm, imported on first use, with its cost map read from the package (no fetch at import)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True  # it would print a "Give Feedback" banner to stdout on every error
    return litellm


def _supported_params(litellm: Any, model: str) -> list[str]:
    try:
        name, provider, *_ = litellm.get_llm_provider(model)
        return list(litellm.get_supported_openai_params(model=name, custom_llm_provider=provider) or [])
    except Exception:  # an unknown provider: litellm.acompletion will say so, with a better message
        return []


def _status(exc: Exception) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def _retryable(litellm: Any, exc: Exception) -> bool:
    if isinstance(exc, litellm.ContextWindowExceededError):
        return False
    if isinstance(exc, litellm.Timeout | litellm.APIConnectionError | litellm.RateLimitError | TimeoutError):
        return True
    status = _status(exc)
    return status is not None and (status in (408, 409, 429) or status >= 500)


def _rejects_format(litellm: Any, exc: Exception) -> bool:
    """A 400 that names response_format: the provider or model does not take JSON schemas."""
    if isinstance(exc, litellm.ContextWindowExceededError) or _status(exc) not in (400, 422):
        return False
    text = str(exc).lower()
    return "response_format" in text or "json_schema" in text or "response format" in text


def _retry_after(exc: Exception) -> float | None:
    # litellm's exceptions carry the provider's headers in litellm_response_headers; their
    # ``response`` is one litellm builds, without them. Other exceptions (httpx's) have ``response``.
    headers = getattr(exc, "litellm_response_headers", None)
    if headers is None:
        headers = getattr(getattr(exc, "response", None), "headers", None)
    if headers is None:
        return None
    try:
        value = headers.get("retry-after")
        return max(0.0, float(value)) if value is not None else None
    except (TypeError, ValueError):
        return None


def _content_of(response: Any) -> str | None:
    try:
        content = response.choices[0].message.content
    except (AttributeError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


def _add_usage(total: dict[str, int], response: Any) -> None:
    usage = getattr(response, "usage", None)
    for key in ("prompt_tokens", "completion_tokens"):
        value = getattr(usage, key, None)
        if isinstance(value, int):
            total[key] += value


_NOT_JSON = "Empty or invalid response from LLM endpoint"


def _describe(litellm: Any, exc: Exception) -> str:
    """A short reason for the record, classified (``RateLimitError: HTTP 429``, ``APIConnectionError: connection
    refused``): never the exception's text, which carries the far end's body, and the far end may be any server."""
    kind = type(exc).__name__
    causes = _chain(exc)
    if isinstance(exc, litellm.ContextWindowExceededError):
        return f"{kind}: the prompt is longer than the judge model's context"
    if isinstance(exc, litellm.Timeout | TimeoutError) or any(isinstance(c, TimeoutError) for c in causes):
        return f"{kind}: timed out"
    # litellm reports a body that is not JSON as a 500 of its own, saying so in its text (read, not repeated).
    if any(isinstance(c, json.JSONDecodeError) for c in causes) or _NOT_JSON in str(exc):
        return f"{kind}: the answer was not valid JSON"
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return f"{kind}: connection refused"
    if any(isinstance(c, socket.gaierror) for c in causes):
        return f"{kind}: the host name did not resolve"
    if isinstance(exc, litellm.APIConnectionError) or any(isinstance(c, OSError) for c in causes):
        return f"{kind}: the connection failed"
    status = _status(exc)
    return f"{kind}: HTTP {status}" if status is not None else kind


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it, as far back as the chain goes (bounded: a cycle ends it)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 20:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
