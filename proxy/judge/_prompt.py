"""The group judge: an LLM scores every trajectory of a group from 0 to 1, relative to the others.

After OpenPipe ART's RULER: ranking attempts at the same task against each other is
easier for a model than grading one in isolation, and GRPO only needs relative
rewards anyway (advantages are reward minus the group mean). So the user need not
write a reward function.

The prompt (``build_prompt``):

- Each trajectory becomes a list of chat messages: its calls in order, each call's
  request messages plus its reply, where a call that extends the previous one (the
  usual agent loop) adds only what is new. Message contents longer than
  ``MAX_MESSAGE_CHARS`` keep their start and end.
- The messages every trajectory starts with (the system prompt, the task, often the
  first tool results) are sent once, in ``<context>``; then each trajectory's own
  continuation in ``<trajectory id="t1">``. The ids are short labels, not trajectory ids,
  so the judge sees nothing that could leak an order or a hint, and the same content
  always makes the same prompt (the cache depends on that).
- The rubric says what "better" means; ``DEFAULT_RUBRIC`` suits generic agent tasks.

The answer is JSON ``{"scores": [{"id", "explanation", "score"}]}``. It is requested as a
JSON schema through litellm's ``response_format`` when the provider takes that parameter
(vLLM then constrains decoding to it, ids included), and it is always validated with
pydantic (``parse_scores``): every id exactly once, no other id, a finite score in
[0, 1]. Explanations come before scores so the model reasons before it commits.

Retries (``Judge.judge``) are ours, with litellm's own off (``num_retries=0``), so every
request is visible to tests: a rate limit, a timeout, a dropped connection or a 5xx is
retried after an exponential backoff (``Retry-After`` honoured, capped); an invalid
answer is retried at once with the error shown to the model; a provider refusing
``response_format`` is asked again without it; any other error (a bad key, an unknown
model, a prompt too long) fails at once. After ``max_attempts`` requests ``JudgeFailed``
says why. Nothing here writes to the store: that is ``proxy.judge._service``.

litellm is imported on first use only, in a worker thread: it takes seconds, which must
not stall the proxy's event loop, and most proxies never judge.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from store._conversation import common_prefix, first_choice, reply_message

DEFAULT_RUBRIC = """\
- A trajectory that achieves the task's goal scores clearly higher than one that does not.
- Between two that achieve it, the one that gets there more directly (fewer wasted steps, \
no needless tool calls, no detours) scores higher.
- Partial progress earns partial credit: a trajectory that gets closer to the goal scores \
higher than one that gets less far.
- Follow the instructions of the task exactly (format, length, constraints): a violated \
instruction costs credit even when the content is right.
- Make score differences proportional to quality differences: nearly equal trajectories get \
nearly equal scores, a much better one a much higher score. Use the whole range from 0 to 1."""

MAX_MESSAGE_CHARS = 8000  # per message content, in the prompt; the middle is elided beyond
MAX_EXPLANATION_CHARS = 1000  # longer explanations are cut, not rejected
_MAX_BACKOFF_S = 30.0
_PROMPT_VERSION = 1  # part of the cache key: bump when the prompt's wording changes

_SYSTEM = """\
You are a careful, impartial judge of an AI agent's work. You are shown several \
trajectories: independent attempts by the same agent at the same task. They share the \
context shown first, then each continues in its own way. Score every trajectory from 0 \
to 1 relative to the others, following the rubric.

Rubric:
{rubric}

Answer with only a JSON object, no other text: {{"scores": [{{"id": "<trajectory id>", \
"explanation": "<one or two sentences on why>", "score": <number from 0 to 1>}}, ...]}}, \
with exactly one entry for each of these trajectory ids: {ids}."""

_RETRY = """\
Your answer could not be used: {reason}. Answer again with only the JSON object, one \
entry for each of the ids {ids}, each score a number from 0 to 1."""


# ---------------------------------------------------------------- the prompt


@dataclass(frozen=True, slots=True)
class TrajectoryText:
    """A trajectory as the judge reads it: its messages, oldest first."""

    trajectory_id: str
    messages: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class JudgePrompt:
    """What is sent to the judge model, and the labels it must score."""

    messages: list[dict[str, Any]]
    labels: list[str]  # "t1", "t2", ... in the order of the trajectories given
    trajectory_ids: list[str]  # the trajectory each label stands for
    shared: int  # messages sent once, as the context

    def response_format(self) -> dict[str, Any]:
        """The JSON schema of the answer; the ids are an enum, so constrained decoding gets them right."""
        item = {
            "type": "object",
            "properties": {
                "id": {"type": "string", "enum": self.labels},
                "explanation": {"type": "string"},
                "score": {"type": "number"},
            },
            "required": ["id", "explanation", "score"],
            "additionalProperties": False,
        }
        schema = {
            "type": "object",
            "properties": {"scores": {"type": "array", "items": item}},
            "required": ["scores"],
            "additionalProperties": False,
        }
        return {"type": "json_schema", "json_schema": {"name": "group_scores", "schema": schema, "strict": True}}

    def cache_key(self, model: str) -> str:
        """Hash of everything that decides the answer: the model, the prompt (rubric included), the format."""
        content = {"v": _PROMPT_VERSION, "model": model, "messages": self.messages, "format": self.response_format()}
        return hashlib.sha256(orjson.dumps(content, option=orjson.OPT_SORT_KEYS)).hexdigest()


def call_messages(
    endpoint: str, request: dict[str, Any], response: dict[str, Any] | None, error: str | None
) -> list[dict[str, Any]]:
    """One captured call as chat messages: the request's messages (or prompt), then the reply."""
    if endpoint == "chat.completions":
        messages = [_message(m) for m in request.get("messages") or () if isinstance(m, dict)]
    else:
        messages = [{"role": "user", "content": _content(request.get("prompt"))}]
    first, reply = first_choice(response), reply_message(response)
    if reply is not None:
        messages.append(_message(reply))
    elif first is not None:
        messages.append({"role": "assistant", "content": _content(first.get("text"))})
    else:
        messages.append({"role": "assistant", "content": f"[the call failed: {error or 'no reply'}]"})
    return messages


def trajectory_messages(calls: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A trajectory's calls (each from ``call_messages``) as one conversation.

    A call whose messages start with everything so far (the usual agent loop) adds what
    is new; a call that starts over (a new context) is appended whole.
    """
    merged: list[dict[str, Any]] = []
    for messages in calls:
        if messages[: len(merged)] == merged:
            merged = list(messages)
        else:
            merged += messages
    return merged


def build_prompt(trajectories: Sequence[TrajectoryText], rubric: str) -> JudgePrompt:
    """The judge's messages: the shared prefix once, then each trajectory's continuation."""
    if not trajectories:
        raise ValueError("a group to judge has at least one trajectory")
    labels = [f"t{i + 1}" for i in range(len(trajectories))]
    shared = common_prefix(*(t.messages for t in trajectories))
    parts = []
    if shared:
        parts.append("<context>\n" + _render(trajectories[0].messages[:shared]) + "\n</context>")
        parts.append("Each trajectory continues the context above:")
    else:
        parts.append("The trajectories share no context.")
    for label, t in zip(labels, trajectories, strict=True):
        rest = t.messages[shared:]
        body = _render(rest) if rest else "(nothing beyond the shared context)"
        parts.append(f'<trajectory id="{label}">\n{body}\n</trajectory>')
    ids = ", ".join(labels)
    messages = [
        {"role": "system", "content": _SYSTEM.format(rubric=rubric.strip(), ids=ids)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
    return JudgePrompt(messages, labels, [t.trajectory_id for t in trajectories], shared)


def _render(messages: Sequence[dict[str, Any]]) -> str:
    return "\n".join(orjson.dumps(m).decode() for m in messages)


def _message(raw: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat message that matter to a judge, in a stable shape."""
    out: dict[str, Any] = {"role": str(raw.get("role") or "assistant")}
    for key in ("name", "tool_call_id"):
        if raw.get(key):
            out[key] = str(raw[key])
    out["content"] = _content(raw.get("content"))
    if raw.get("reasoning_content") or raw.get("reasoning"):
        out["reasoning"] = _content(raw.get("reasoning_content") or raw.get("reasoning"))
    calls = raw.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [
            {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
            for c in calls
            if isinstance(c, dict)
        ]
    return out


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: text kept, the rest named
        text = "".join(
            p.get("text", "") if isinstance(p, dict) and p.get("type") == "text" else f"[{_part_type(p)}]"
            for p in content
        )
    else:
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
    if len(text) > MAX_MESSAGE_CHARS:
        keep = MAX_MESSAGE_CHARS // 2
        text = f"{text[:keep]}\n[... {len(text) - 2 * keep} characters elided ...]\n{text[-keep:]}"
    return text


def _part_type(part: Any) -> str:
    return str(part.get("type", "part")) if isinstance(part, dict) else "part"


# ---------------------------------------------------------------- the answer


class Score(BaseModel):
    """One trajectory's verdict, as the judge model must write it."""

    model_config = ConfigDict(extra="ignore")

    id: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
    explanation: str = ""
    score: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    scores: list[Score]


class InvalidJudgement(ValueError):
    """The judge model's answer cannot be used; the message says why, for the model and the log."""


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_scores(content: str | None, labels: Sequence[str]) -> list[Score]:
    """Validate an answer: JSON of the right shape, every label exactly once, nothing else.

    Returns the scores in ``labels`` order, explanations cut to ``MAX_EXPLANATION_CHARS``.
    """
    text = (content or "").strip()
    if fenced := _FENCE.match(text):  # small models wrap JSON in a code fence despite the instructions
        text = fenced.group(1)
    if not text:
        raise InvalidJudgement("the answer was empty")
    try:
        answer = _Answer.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the answer"
        raise InvalidJudgement(f"{where}: {first['msg']}") from exc
    by_id: dict[str, Score] = {}
    for score in answer.scores:
        if score.id in by_id:
            raise InvalidJudgement(f"the id {score.id} was scored more than once")
        by_id[score.id] = score
    unknown = sorted(by_id.keys() - set(labels))
    if unknown:
        raise InvalidJudgement(f"unknown id {', '.join(unknown)}")
    missing = [label for label in labels if label not in by_id]
    if missing:
        raise InvalidJudgement(f"no score for {', '.join(missing)}")
    return [
        by_id[label].model_copy(update={"explanation": by_id[label].explanation.strip()[:MAX_EXPLANATION_CHARS]})
        for label in labels
    ]


# ---------------------------------------------------------------- asking the model


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
        self.model = model
        self.api_base = api_base
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s

    async def judge(self, prompt: JudgePrompt) -> Verdict:
        """Scores for every label in ``prompt``, or ``JudgeFailed`` after ``max_attempts`` requests."""
        try:
            litellm = await asyncio.to_thread(_litellm)  # the first import takes seconds: not on the event loop
        except ImportError as exc:
            raise JudgeFailed(
                f"litellm is not installed ({exc}): pip install 'tracetrain[proxy]'", attempts=0, usage={}
            ) from exc
        use_format = "response_format" in _supported_params(litellm, self.model)
        messages = list(prompt.messages)
        usage: dict[str, int] = {"prompt_tokens": 0, "completion_tokens": 0}
        reason = "no attempt was made"
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = await litellm.acompletion(
                    model=self.model,
                    messages=messages,
                    api_base=self.api_base,
                    response_format=prompt.response_format() if use_format else None,
                    timeout=self.timeout_s,
                    num_retries=0,
                    drop_params=True,
                )
            # Providers raise litellm's exception types, but also httpx's, aiohttp's and their
            # SDK's: each is classified, none is swallowed silently (the reason is kept).
            except Exception as exc:
                reason = _describe(exc)
                if use_format and _rejects_format(litellm, exc):
                    use_format = False  # asked again without response_format
                    continue
                if not _retryable(litellm, exc):
                    raise JudgeFailed(reason, attempts=attempt, usage=usage) from exc
                if attempt < self.max_attempts:
                    await asyncio.sleep(self._backoff(attempt, exc))
                continue
            _add_usage(usage, response)
            content = _content_of(response)
            try:
                scores = parse_scores(content, prompt.labels)
            except InvalidJudgement as exc:
                reason = f"invalid answer: {exc}"
                ids = ", ".join(prompt.labels)
                messages = [
                    *prompt.messages,
                    {"role": "assistant", "content": content or ""},
                    {"role": "user", "content": _RETRY.format(reason=exc, ids=ids)},
                ]
                continue
            return Verdict(scores, attempt, usage)
        raise JudgeFailed(
            f"no valid answer after {self.max_attempts} attempts; last: {reason}",
            attempts=self.max_attempts,
            usage=usage,
        )

    def _backoff(self, attempt: int, exc: Exception) -> float:
        retry_after = _retry_after(exc)
        if retry_after is not None:
            return min(retry_after, _MAX_BACKOFF_S)
        return min(self.backoff_s * 2.0 ** (attempt - 1), _MAX_BACKOFF_S) * random.uniform(0.8, 1.2)


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
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
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


# Values of these environment variables never appear in a recorded error.
_SECRET_ENV = re.compile(r"(API_KEY|_TOKEN|_SECRET|_PASSWORD)$")


def _describe(exc: Exception) -> str:
    """A short, key-free reason for the record: ``RateLimitError: ...``."""
    text = f"{type(exc).__name__}: {exc}".replace("litellm.", "")
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_ENV.search(name):
            text = text.replace(value, "***")
    return text[:1000]
